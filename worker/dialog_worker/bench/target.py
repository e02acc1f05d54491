"""One system under test (ours or a comparison worker): its settings (see namespace.py), its
worker processes and its producer."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from redis.asyncio import Redis

from dialog_worker.bench.spawn import WorkerProcess, Workers, source_root
from dialog_worker.bench.workload import Producer, Sent
from dialog_worker.config import Settings
from dialog_worker.store.connection import connect
from dialog_worker.store.keys import Keys


class Target:
    def __init__(self, system: str, settings: Settings, args: argparse.Namespace, run: str):
        self.system = system
        self.settings = settings
        self.args = args
        self.run = run
        self.keys = Keys.from_settings(settings)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"dialog-bench-{system}-"))
        self.redis: Redis = connect(settings, max_connections=16)
        extra: dict[str, str] = {}
        if system == "ours" and float(getattr(args, "step_ms", 0.0) or 0.0) > 0:
            extra = {
                "DIALOG_ENGINE": "dialog_worker.bench.slow_engine:make",
                "BENCH_STEP_MS": str(args.step_ms),
            }
        worker_path = getattr(args, "worker_path", None)
        if system == "ours" and worker_path:
            # Another version's package ahead of this one (and bench/ of this checkout).
            root = source_root()
            paths = [str(Path(worker_path).resolve() / "worker"), str(root) if root else ""]
            extra["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.workers = Workers(system, settings, run, self.tmp, args.concurrency, extra)
        self.producer = Producer(
            system, settings, self.redis, run, args.senders, msg_ids=args.msg_ids
        )

    @property
    def procs(self) -> list[WorkerProcess]:
        return self.workers.procs

    async def send(self, items: list[tuple[str, str]]) -> list[Sent]:
        return await self.producer.send(items)

    async def close(self) -> None:
        """Stop the workers and let go; what was written is namespace.clean's to remove."""
        self.workers.stop()
        await self.redis.aclose()
        shutil.rmtree(self.tmp, ignore_errors=True)
