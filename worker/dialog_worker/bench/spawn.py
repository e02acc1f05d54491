"""Worker processes the bench starts, watches and stops: dialog-worker ("ours") or a comparison
worker from the checkout's bench/ folder, each under the counting shim."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, cast

import anyio

from dialog_worker.bench.redis_server import free_port
from dialog_worker.config import Settings
from dialog_worker.errors import ValidationError

# How each system's worker process is started (python -m MODULE ARGS).
WORKER_MODULES: dict[str, list[str]] = {
    "ours": ["dialog_worker", "run"],
    "naive": ["bench.naive_worker"],
    "seed": ["bench.seed_worker"],
    "peer": ["bench.peer_worker"],
    "bare": ["bench.bare_roundtrip"],
}
# The directory that holds the `dialog_worker` package (worker/ in a checkout), and the
# checkout around it, which holds the comparison workers in bench/.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
CHECKOUT = PACKAGE_PARENT.parent


def source_root() -> Path | None:
    """The checkout that holds bench/ next to worker/ (comparisons need it)."""
    return CHECKOUT if (CHECKOUT / "bench" / "common.py").is_file() else None


@dataclasses.dataclass
class WorkerProcess:
    system: str
    name: str
    proc: subprocess.Popen[bytes]
    metrics_port: int
    counts_file: Path
    stats_file: Path
    log_file: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def counts(self) -> dict[str, Any]:
        return _read_json(self.counts_file)

    def ready(self) -> bool:
        if self.metrics_port:
            try:
                url = f"http://127.0.0.1:{self.metrics_port}/readyz"
                with urllib.request.urlopen(url, timeout=1) as r:
                    return int(r.status) == 200
            except OSError:
                return False
        return self.stats_file.exists()

    def stats(self) -> dict[str, Any]:
        return _read_json(self.stats_file)

    def metrics(self) -> dict[str, float]:
        if not self.metrics_port:
            return {}
        return scrape_metrics(f"http://127.0.0.1:{self.metrics_port}/metrics")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return cast(dict[str, Any], json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def scrape_metrics(url: str) -> dict[str, float]:
    """`name{labels}` -> value for every dialog_ sample of a /metrics page ({} if unreachable)."""
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("dialog_"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


class Workers:
    """The worker processes of one system, named `bench-<system>-<i>-<run>`."""

    def __init__(
        self,
        system: str,
        settings: Settings,
        run: str,
        tmp: Path,
        concurrency: int | None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.system = system
        self.settings = settings
        self.run = run
        self.tmp = tmp
        self.concurrency = concurrency
        self.extra_env = extra_env or {}
        self.procs: list[WorkerProcess] = []

    def env(self, name: str, metrics_port: int, counts: Path, stats: Path) -> dict[str, str]:
        env = dict(os.environ)
        root = source_root()
        paths = [p for p in (str(root) if root else "", str(PACKAGE_PARENT)) if p]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        s = self.settings
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
                "REDIS_URL": s.redis_url,
                "DIALOG_STREAM": s.stream,
                "DIALOG_GROUP": s.group,
                "DIALOG_REPLY_STREAM": s.reply_stream,
                "DIALOG_DLQ_STREAM": s.dlq_stream,
                "DIALOG_KEY_PREFIX": s.prefix,
                "DIALOG_CONSUMER": name,
                "DIALOG_LOG_LEVEL": "warning",
                "DIALOG_METRICS_HOST": "127.0.0.1",
                "DIALOG_METRICS_PORT": str(metrics_port),
                "BENCH_COUNTS_FILE": str(counts),
                "BENCH_STATS_FILE": str(stats),
            }
        )
        if self.concurrency:
            env["DIALOG_CONCURRENCY"] = str(self.concurrency)
        env.update(self.extra_env)
        return env

    async def start(self, n: int) -> None:
        if n and self.system != "ours" and source_root() is None:
            raise ValidationError("--compare needs a source checkout (bench/ next to worker/)")
        self._spawn(n)
        await self._wait_ready()

    def _spawn(self, n: int) -> None:
        for i in range(n):
            name = f"bench-{self.system}-{i + 1}-{self.run}"
            port = free_port() if self.system == "ours" else 0
            counts, stats = self.tmp / f"{name}.counts.json", self.tmp / f"{name}.stats.json"
            log = self.tmp / f"{name}.log"
            cmd = [
                sys.executable,
                "-m",
                "dialog_worker.bench",
                "_count",
                *WORKER_MODULES[self.system],
            ]
            with log.open("wb") as fh:
                proc = subprocess.Popen(
                    cmd,
                    env=self.env(name, port, counts, stats),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.procs.append(WorkerProcess(self.system, name, proc, port, counts, stats, log))

    async def _wait_ready(self) -> None:
        """Every spawned worker is ready: /readyz answers 200 (ours), or the worker has
        created its group and written its first counters file (comparison workers)."""
        deadline = time.monotonic() + 30
        waiting = list(self.procs)
        while waiting:
            for w in self.procs:
                if w.proc.poll() is not None:
                    raise RuntimeError(
                        f"{w.name} exited with {w.proc.returncode}: "
                        f"{w.log_file.read_text(errors='replace')[-1500:]}"
                    )
            waiting = [w for w in waiting if not await anyio.to_thread.run_sync(w.ready)]
            if waiting and time.monotonic() > deadline:
                names = [w.name for w in waiting]
                raise RuntimeError(f"workers not ready within 30 s: {names}")
            if waiting:
                await anyio.sleep(0.05)

    def stop(self) -> None:
        for w in self.procs:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.procs:
            try:
                w.proc.wait(30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(10)
