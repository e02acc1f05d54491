"""The embedded redis-server of `dialog-worker run` (REDIS_URL set nowhere) as a newcomer meets
it in a terminal: Ctrl-C signals the whole foreground process group, and the worker must still
find Redis there to finish what it holds; a Redis already on the default address is named, and
REDIS_URL=embedded insists on a server of the user's own. The server is started on a free port
(or a socket) and in a temporary directory, never on the machine's 6379."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import free_port, wait_until
from worker_procs import run_cli

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# `dialog-worker run` with the embedded server's address moved off 6379.
DRIVER = """
import sys
from pathlib import Path
import dialog_worker.store.embedded_redis as embedded
embedded.PORT, embedded.DATA_DIR = int(sys.argv[1]), Path(sys.argv[2])
assert embedded.url() == f"redis://127.0.0.1:{sys.argv[1]}/0"
from dialog_worker.cli import main
raise SystemExit(main(["run", *sys.argv[3:]]))
"""

# The lock of the session the test sends to: it exists while a worker holds the session.
HELD_LOCK = "dialog:{dialog}:s:{c1}:lock"


def test_ctrl_c_lets_the_worker_finish_before_the_embedded_redis_stops(
    env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    child_env = {k: v for k, v in env.items() if k != "REDIS_URL"}
    child_env.update(DIALOG_ENGINE="fault_engine:make", DIALOG_LOG_LEVEL="info")
    log_path = tmp_path / "run.log"
    with log_path.open("wb") as log:
        # A new session, as a shell runs a foreground job: its own process group, which is
        # what the terminal's SIGINT reaches.
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(port), str(tmp_path / "data")],
            env=child_env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        r = redis.Redis(port=port, decode_responses=True)

        def group_ready() -> bool:
            try:
                return any(g["name"] == "dialog-workers" for g in r.xinfo_groups("dialog"))
            except redis.RedisError:
                return False

        wait_until(group_ready, 20, what="the worker's group on the embedded server")
        r.xadd("dialog", {"session_id": "c1", "msg_id": "m1", "text": "sleep 1.5 x"})
        wait_until(lambda: r.exists(HELD_LOCK), 10, what="pickup")  # a worker holds it
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line[:1] == "{"]
    names = [e["event"] for e in events]
    assert "redis_unavailable" not in names, names
    assert any(e["event"] == "committed" and e.get("session_id") == "c1" for e in events), names
    assert names.index("worker_stopped") > names.index("committed")
    # ... and the server went away with the worker, not before it.
    wait_until(lambda: not _answers(port), 10, what="the embedded server to stop")


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _run(
    port: int, data: Path, env: dict[str, str], log: Path, **extra: str
) -> subprocess.Popen[bytes]:
    """`dialog-worker run` (the embedded server's default address moved to ``port``) in a
    process group of its own, its stderr and stdout into ``log``."""
    child_env = {k: v for k, v in env.items() if k != "REDIS_URL"}
    child_env.update(DIALOG_LOG_LEVEL="info", **extra)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(port), str(data)],
            env=child_env,
            cwd=data.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _said(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("dialog-worker: ")]


def test_a_redis_already_on_the_default_address_is_named_with_its_key_count(
    redis_server: Any, env: dict[str, str], tmp_path: Path
) -> None:
    """REDIS_URL unset and a server dialog-worker did not start answers where the embedded one
    would listen (on a shared machine: anyone's): the worker uses it and says so plainly."""
    other = redis.Redis.from_url(redis_server.url)
    other.mset({"theirs:1": "a", "theirs:2": "b", "theirs:3": "c"})
    log = tmp_path / "run.log"
    proc = _run(redis_server.port, tmp_path / "data", env, log)
    try:
        wait_until(lambda: _said(log), 20, what="the start-up line")
        wait_until(lambda: other.exists("dialog"), 20, what="the worker's group there")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _said(log)[0] == (
        f"dialog-worker: REDIS_URL is not set: using the Redis server already listening on "
        f"127.0.0.1:{redis_server.port}, which dialog-worker did not start (it holds 3 keys); "
        "REDIS_URL=embedded runs a server of your own instead"
    )
    assert other.ping()  # not ours to stop
    assert not (tmp_path / "data").exists()


def test_redis_url_embedded_runs_a_server_of_its_own_beside_an_occupied_default_port(
    redis_server: Any, env: dict[str, str], tmp_path: Path
) -> None:
    """REDIS_URL=embedded with the default address taken: `run` starts the user's own
    redis-server on a socket in their home (no TCP port), clients with the same setting reach
    it, a second `run` shares it and says so, and it stops with the worker that started it.
    The server on the default address is never written to."""
    home = Path(tempfile.mkdtemp(prefix="dw", dir="/tmp"))  # a socket path has 107 bytes
    try:
        mine = {"HOME": str(home), "REDIS_URL": "embedded"}
        sock = home / ".local/share/dialog-worker/embedded/redis.sock"
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        first = _run(redis_server.port, tmp_path / "data", env, first_log, **mine)
        second: subprocess.Popen[bytes] | None = None
        try:
            wait_until(lambda: _said(first_log), 20, what="the first start-up line")
            assert _said(first_log) == [
                f"dialog-worker: REDIS_URL=embedded: started your own redis-server at {sock} "
                f"(no TCP port; data in {sock.parent}); it stops when this worker stops"
            ]
            second = _run(redis_server.port, tmp_path / "data", env, second_log, **mine)
            wait_until(lambda: _said(second_log), 20, what="the second start-up line")
            [shared] = _said(second_log)
            assert shared.startswith(
                f"dialog-worker: REDIS_URL=embedded: using your redis-server at {sock}, started "
                "by another dialog-worker run (it holds "
            )
            asked = run_cli({**env, **mine}, "ask", "e1", "nama saya Budi", "--timeout", "20")
            assert asked.returncode == 0, asked.stderr
            assert json.loads(asked.stdout)["text"] == "Halo Budi, ada yang bisa dibantu?"
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
            assert sock.exists()  # the second run leaves the first one's server running
            first.send_signal(signal.SIGTERM)
            assert first.wait(30) == 0
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        wait_until(lambda: not sock.exists(), 10, what="the embedded server to stop")
        assert redis.Redis.from_url(redis_server.url).keys("dialog*") == []
    finally:
        shutil.rmtree(home, ignore_errors=True)
