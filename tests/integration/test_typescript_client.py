"""The TypeScript client (clients/typescript): type-checked and built with its pinned
TypeScript, then its own tests (node's test runner) against a real gateway and real workers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from gateway_proc import REPO_DIR, GatewayProc
from npm_packages import npm_ci
from worker_procs import WorkerPool

from dialog_worker.client import session_tokens

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
SIGNING_KEY = "k" * 32
FOLDER = REPO_DIR / "clients" / "typescript"
BUILD_TIMEOUT_S = 180
NODE_TIMEOUT_S = 240
# A test that hangs fails alone after a minute, and the runner exits with what is still open.
BOUNDED = ("--test-timeout=60000", "--test-force-exit")


def test_the_typescript_client_builds_and_passes_its_tests_against_a_gateway(
    env: dict[str, str], workers: WorkerPool, tmp_path: Path
):
    folder = npm_ci(FOLDER)
    built = subprocess.run(
        ["npm", "run", "--silent", "build"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert built.returncode == 0, f"{built.stdout}\n{built.stderr}"
    workers.start(1, DIALOG_ENGINE="chat_engines:Assistant")
    gateway = GatewayProc(
        {**env, "DIALOG_HTTP_TOKEN": TOKEN, "DIALOG_HTTP_SIGNING_KEY": SIGNING_KEY}, tmp_path
    )
    try:
        done = subprocess.run(
            ["node", "--test", *BOUNDED, "dist/test/client.test.js"],
            cwd=folder,
            env={
                **env,
                "GATEWAY_URL": gateway.url,
                "GATEWAY_TOKEN": TOKEN,
                "SESSION_TOKEN": session_tokens.mint(SIGNING_KEY, "its-own-session", 600),
            },
            capture_output=True,
            text=True,
            timeout=NODE_TIMEOUT_S,
        )
    finally:
        gateway.stop()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{gateway.log_path.read_text()}"
    assert "# fail 0" in done.stdout and "# skipped 0" in done.stdout
