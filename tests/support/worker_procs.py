"""Real `dialog-worker run` processes for integration and fault tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from redis_server import free_port, wait_until

SUPPORT_DIR = Path(__file__).resolve().parent
REPO_DIR = SUPPORT_DIR.parent.parent


class WorkerProc:
    def __init__(self, name: str, env: dict[str, str], logdir: Path, metrics: bool) -> None:
        self.name = name
        self.metrics_port = free_port() if metrics else 0
        self.env = {
            **env,
            "DIALOG_CONSUMER": name,
            "DIALOG_METRICS_HOST": "127.0.0.1",
            "DIALOG_METRICS_PORT": str(self.metrics_port),
        }
        self.log_path = logdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProc:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "run"],
            env=self.env,
            cwd=REPO_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        if self.metrics_port:
            wait_until(lambda: self._get("/healthz") is not None, 20, what=f"{self.name} /healthz")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.alive():
            self.signal(signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait(10)

    def terminate(self, timeout_s: float = 30) -> int:
        assert self.proc is not None
        if self.alive():
            self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise

    def _get(self, path: str) -> tuple[int, str] | None:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}{path}", timeout=2
            ) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return None

    def metrics_text(self) -> str:
        got = self._get("/metrics")
        assert got is not None and got[0] == 200, got
        return got[1]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


class WorkerPool:
    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.env = env
        self.logdir = logdir
        self.procs: list[WorkerProc] = []
        self._n = 0

    def start(self, n: int = 1, metrics: bool = False, **extra_env: str) -> list[WorkerProc]:
        started = []
        for _ in range(n):
            self._n += 1
            w = WorkerProc(f"w{self._n}", {**self.env, **extra_env}, self.logdir, metrics)
            started.append(w.start())
        self.procs += started
        return started

    def stop_all(self) -> None:
        for w in self.procs:
            if w.alive():
                w.signal(signal.SIGTERM)
        for w in self.procs:
            if w.proc is not None:
                try:
                    w.proc.wait(30)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait(10)
