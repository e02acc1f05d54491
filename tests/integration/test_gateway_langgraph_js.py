"""The LangGraph JS SDK (@langchain/langgraph-sdk, pinned in tests/js/langgraph's lockfile),
unmodified, against a real gateway and real workers: tests/js/langgraph/langgraph.test.mjs
under node's own test runner."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from gateway_proc import REPO_DIR, GatewayProc
from npm_packages import npm_ci
from worker_procs import WorkerPool

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
ENGINE = "chat_engines:Assistant"
FOLDER = REPO_DIR / "tests" / "js" / "langgraph"
NODE_TIMEOUT_S = 240
# A test that hangs fails alone after a minute, and the runner exits with what is still open.
BOUNDED = ("--test-timeout=60000", "--test-force-exit")


def test_the_langgraph_js_sdk_drives_threads_runs_interrupts_and_cancel(
    env: dict[str, str], workers: WorkerPool, tmp_path: Path
):
    folder = npm_ci(FOLDER)
    workers.start(1, DIALOG_ENGINE=ENGINE)
    gateway = GatewayProc(
        {**env, "DIALOG_HTTP_TOKEN": TOKEN, "DIALOG_ENGINE": ENGINE}, tmp_path
    )
    try:
        done = subprocess.run(
            ["node", "--test", *BOUNDED, "langgraph.test.mjs"],
            cwd=folder,
            env={**env, "LANGGRAPH_URL": f"{gateway.url}/langgraph", "GATEWAY_TOKEN": TOKEN},
            capture_output=True,
            text=True,
            timeout=NODE_TIMEOUT_S,
        )
    finally:
        gateway.stop()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{gateway.log_path.read_text()}"
    assert "# fail 0" in done.stdout
