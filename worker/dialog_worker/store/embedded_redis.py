"""The embedded default: when REDIS_URL is not set anywhere and nothing answers on the default
address, `dialog-worker run` starts a local redis-server (AOF on, data under
~/.local/share/dialog-worker) so a newcomer gets a working service with one command.

The server runs in a process group of its own: Ctrl-C in a terminal signals the foreground
process group, and the worker needs Redis to finish or hand back what it holds, so the server
must not stop with it. The caller stops it after the worker's graceful shutdown.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import structlog

log = structlog.get_logger("dialog_worker.store.embedded_redis")

DATA_DIR = Path.home() / ".local" / "share" / "dialog-worker" / "redis"
HOST, PORT = "127.0.0.1", 6379  # where it listens: the address of the default REDIS_URL
DEFAULT_URL = "redis://localhost:6379/0"


def wanted(redis_url: str) -> bool:
    """Only when REDIS_URL is set nowhere: an explicit URL is never replaced."""
    return "REDIS_URL" not in os.environ and redis_url == DEFAULT_URL


def url() -> str:
    return f"redis://{HOST}:{PORT}/0"


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def ensure_local_redis() -> subprocess.Popen[bytes] | None:
    """Start redis-server on HOST:PORT unless something already listens there.
    Returns the process we started (the caller stops it on exit, see `stop`) or None."""
    host, port = HOST, PORT
    if _answers(host, port):
        return None
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError(
            "REDIS_URL is not set, nothing listens on 127.0.0.1:6379 and redis-server is not "
            "installed: install it (apt-get install redis-server) or set REDIS_URL"
        )
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            server,
            "--bind",
            host,
            "--port",
            str(port),
            "--dir",
            str(DATA_DIR),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while not _answers(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"could not start the embedded redis-server on {host}:{port}")
        time.sleep(0.05)
    log.info("embedded_redis_started", host=host, port=port, dir=str(DATA_DIR), pid=proc.pid)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (redis-server then writes its AOF and exits), SIGKILL if it does not."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
