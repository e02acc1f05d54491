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
    # Its own process group, as a shell gives a foreground job, so `interrupt` can signal it
    # the way a terminal's Ctrl-C does.
    new_session = False

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        logdir: Path,
        metrics: bool,
        args: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.args = args
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
            [sys.executable, "-m", "dialog_worker", "run", *self.args],
            env=self.env,
            cwd=REPO_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=self.new_session,
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

    def interrupt(self) -> None:
        """Ctrl-C in a terminal: SIGINT to the whole foreground process group."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGINT)

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


class Supervisor(WorkerProc):
    """`dialog-worker run --processes N`: one supervisor, its children found through the
    per-child `dialog_ready{pid=...}` series of its /metrics."""

    new_session = True

    def __init__(self, name: str, env: dict[str, str], logdir: Path, processes: int) -> None:
        super().__init__(name, env, logdir, metrics=True, args=("--processes", str(processes)))
        self.processes = processes

    def readyz(self) -> int | None:
        got = self._get("/readyz")
        return None if got is None else got[0]

    def child_pids(self) -> set[int]:
        got = self._get("/metrics")
        if got is None or got[0] != 200:
            return set()
        return {
            int(line.split('pid="', 1)[1].split('"', 1)[0])
            for line in got[1].splitlines()
            if line.startswith("dialog_ready{")
        }

    def wait_ready(self, timeout_s: float = 30) -> set[int]:
        """Every child ready: /readyz 200 with `processes` children reporting."""

        def ready() -> set[int] | None:
            assert self.alive(), self.log_text()[-3000:]
            pids = self.child_pids()
            return pids if self.readyz() == 200 and len(pids) == self.processes else None

        pids: set[int] = wait_until(ready, timeout_s, what=f"{self.name} /readyz 200")
        return pids


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


def run_cli(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """`python -m dialog_worker ARGS` with `env` (plus `extra`), its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", *args],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )
