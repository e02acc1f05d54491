"""The redis-server `dialog-worker run` starts by itself, so a newcomer gets a working service
with one command, and says in plain words which Redis the worker uses:

- REDIS_URL set nowhere: the Redis that answers on 127.0.0.1:6379 if one does (said on stderr,
  with its key count: on a shared machine it may be anyone's), else a redis-server started
  there (AOF on, data under ~/.local/share/dialog-worker/redis);
- REDIS_URL=embedded: the user's own redis-server, on a socket in
  ~/.local/share/dialog-worker/embedded and no TCP port, started unless another `run` of the
  same user already did (config.embedded_redis_url is where clients find it).

The server runs in a process group of its own: Ctrl-C in a terminal signals the foreground
process group, and the worker needs Redis to finish or hand back what it holds, so the server
must not stop with it. The caller stops it after the worker's graceful shutdown.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis
import structlog

from dialog_worker.config import embedded_redis_dir, embedded_redis_url

log = structlog.get_logger("dialog_worker.store.embedded_redis")

DATA_DIR = Path.home() / ".local" / "share" / "dialog-worker" / "redis"
HOST, PORT = "127.0.0.1", 6379  # where it listens: the address of the default REDIS_URL
DEFAULT_URL = "redis://localhost:6379/0"
START_TIMEOUT_S = 10.0


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


def _socket_answers(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            s.connect(str(path))
            return True
    except OSError:  # no socket, or one a killed server left behind
        return False


def ensure_local_redis() -> subprocess.Popen[bytes] | None:
    """REDIS_URL set nowhere: start redis-server on HOST:PORT unless something already
    listens there, and say which it is. Returns the process we started (the caller stops it
    on exit, see `stop`) or None."""
    host, port = HOST, PORT
    if _answers(host, port):
        _say(
            f"REDIS_URL is not set: using the Redis server already listening on {host}:{port}, "
            f"which dialog-worker did not start ({_holds(url())}); REDIS_URL=embedded runs a "
            "server of your own instead"
        )
        return None
    proc = _start(["--bind", host, "--port", str(port)], DATA_DIR, lambda: _answers(host, port))
    log.info("embedded_redis_started", host=host, port=port, dir=str(DATA_DIR), pid=proc.pid)
    _say(
        f"REDIS_URL is not set and nothing listens on {host}:{port}: started redis-server "
        f"there (data in {DATA_DIR}); it stops when this worker stops"
    )
    return proc


def ensure_own_redis() -> subprocess.Popen[bytes] | None:
    """REDIS_URL=embedded: start the user's own redis-server on its socket unless it runs
    already (another `run` of the same user started it), and say which. Returns the process
    we started or None."""
    folder = embedded_redis_dir()
    path = folder / "redis.sock"
    if _socket_answers(path):
        _say(
            f"REDIS_URL=embedded: using your redis-server at {path}, started by another "
            f"dialog-worker run ({_holds(embedded_redis_url())}); it stops when that one stops"
        )
        return None
    proc = _start(
        ["--port", "0", "--unixsocket", str(path), "--unixsocketperm", "700"],
        folder,
        lambda: _socket_answers(path),
    )
    log.info("embedded_redis_started", socket=str(path), dir=str(folder), pid=proc.pid)
    _say(
        f"REDIS_URL=embedded: started your own redis-server at {path} (no TCP port; data in "
        f"{folder}); it stops when this worker stops"
    )
    return proc


def _start(where: list[str], folder: Path, answers: Callable[[], bool]) -> subprocess.Popen[bytes]:
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError(
            "REDIS_URL is not set (or is embedded) and redis-server is not installed: install "
            "it (apt-get install redis-server) or set REDIS_URL to a Redis you run"
        )
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            server,
            *where,
            "--dir",
            str(folder),
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
    deadline = time.monotonic() + START_TIMEOUT_S
    while not answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"could not start the embedded redis-server ({' '.join(where)})")
        time.sleep(0.05)
    return proc


def _holds(redis_url: str) -> str:
    """How many keys the server's database holds, in words (or why it did not say)."""
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1)
        try:
            keys = int(client.dbsize())
        finally:
            client.close()
    except redis.RedisError as exc:
        return f"it did not say how many keys it holds: {exc}"
    return f"it holds {keys:,} key{'' if keys == 1 else 's'}"


def _say(line: str) -> None:
    """For the person who started the worker: plain text on stderr, as its other start-up
    notes (the JSON log is for machines)."""
    print(f"dialog-worker: {line}", file=sys.stderr, flush=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (redis-server then writes its AOF and exits), SIGKILL if it does not."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
