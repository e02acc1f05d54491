"""The embedded redis-server of `dialog-worker run` (REDIS_URL set nowhere) as a newcomer meets
it in a terminal: Ctrl-C signals the whole foreground process group, and the worker must still
find Redis there to finish what it holds. The server is started on a free port and in a
temporary directory, never on the machine's 6379."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from redis_server import free_port, wait_until

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
