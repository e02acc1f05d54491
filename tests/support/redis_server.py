"""A real redis-server the suite starts itself on a free port, so tests can kill, pause and
restart it. Tests never depend on a Redis that happens to run on the machine."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


async def wait_until_async(
    predicate: Callable[[], Awaitable[Any]],
    timeout_s: float,
    what: str = "condition",
    interval_s: float = 0.05,
) -> Any:
    """`wait_until` for an async predicate: await it until it returns something truthy, or
    fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await anyio.sleep(interval_s)


async def wait_for(check: Callable[[], Any], timeout_s: float = 15) -> Any:
    """In an async test: poll the plain (non-async) `check` until it returns something truthy
    (returned), or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await anyio.sleep(0.01)
    raise AssertionError(f"not within {timeout_s} s")


class RedisServer:
    def __init__(
        self,
        workdir: Path,
        *,
        appendonly: bool = False,
        fsync: str = "everysec",
        port: int | None = None,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.fsync = fsync
        self.extra = extra
        # Added to the server's environment (e.g. LD_PRELOAD of tests/support/clockshift.c).
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        # Times a start found the AOF cut short by a kill and repaired it (redis-check-aof).
        self.aof_fixes = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or start again, from what a killed server left on disk). With AOF the
        server refuses a file cut short inside a command (`aof-load-truncated no`), and this
        repairs it with `redis-check-aof --fix`, as docs/deploy.md tells operators: with the
        default `yes`, Redis 7.0 cuts such a file after the last whole command, which can be
        inside a script's effects (an unterminated MULTI); on the next start the writes made
        after it are queued into that MULTI and lost, or replayed with half a script."""
        log = self.workdir / "redis.log"
        logged = log.stat().st_size if log.exists() else 0
        try:
            return self._start()
        except RuntimeError:
            tail = log.read_text(errors="replace")[logged:] if log.exists() else ""
            if not self.appendonly or "reading the append only file" not in tail:
                raise
        manifest = self.workdir / "appendonlydir" / "appendonly.aof.manifest"
        fixed = subprocess.run(
            [shutil.which("redis-check-aof") or "redis-check-aof", "--fix", str(manifest)],
            input=b"y\n",
            capture_output=True,
            timeout=60,
        )
        if fixed.returncode != 0:
            raise RuntimeError(f"redis-check-aof --fix failed: {fixed.stdout[-2000:]!r}")
        self.aof_fixes += 1
        return self._start()

    def _start(self) -> RedisServer:
        truncated = ("--aof-load-truncated", "no") if self.appendonly else ()
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.fsync,
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(self.workdir / "redis.log"),
            *truncated,
            *self.extra,
        ]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
        )
        wait_until(self._answers, 15, what=f"redis-server on port {self.port}")
        return self

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"redis-server exited: {log}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                # NOAUTH: it answers, and wants a password (a test's `--requirepass`).
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def kill(self) -> None:
        """kill -9: no shutdown, no final fsync."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
