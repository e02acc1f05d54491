"""The embedded default: when REDIS_URL is not set anywhere and nothing answers on the default
address, `dialog-worker run` starts a local redis-server (AOF on, data under
~/.local/share/dialog-worker) so a newcomer gets a working service with one command."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import structlog

log = structlog.get_logger("dialog_worker.embedded")

DATA_DIR = Path.home() / ".local" / "share" / "dialog-worker" / "redis"


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def ensure_local_redis(host: str = "127.0.0.1", port: int = 6379) -> subprocess.Popen[bytes] | None:
    """Start redis-server on host:port unless something already listens there.
    Returns the process we started (the caller stops it on exit) or None."""
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
    )
    deadline = time.monotonic() + 10
    while not _answers(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"could not start the embedded redis-server on {host}:{port}")
        time.sleep(0.05)
    log.info("embedded_redis_started", host=host, port=port, dir=str(DATA_DIR), pid=proc.pid)
    return proc
