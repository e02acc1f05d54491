"""One measured run: snapshot, send the workload while the reader times the replies, wait for
the drain, snapshot again, and put the result together (latency, cost, correctness)."""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any, cast

import anyio

from dialog_worker.bench import check, cost
from dialog_worker.bench.machine import proc_rss_kb
from dialog_worker.bench.measure import ReplyReader, Snapshot, snapshot
from dialog_worker.bench.report import progress
from dialog_worker.bench.stats import summarize
from dialog_worker.bench.target import Target
from dialog_worker.bench.workload import Sent, send_at_rate, workload_items


class Run:
    def __init__(self, target: Target, phase: str, args: argparse.Namespace) -> None:
        self.target = target
        self.phase = phase
        self.args = args
        self.label = uuid.uuid4().hex[:6]
        self.prefix = f"bench-{target.run}-{self.label}-"
        self.sent: list[Sent] = []
        self.rss_samples: list[dict[str, Any]] = []

    def sessions(self, n: int) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(n)]

    async def execute(
        self, mode: str, sessions: int, burst: int, rate: float = 0.0, duration: float = 0.0
    ) -> dict[str, Any]:
        t = self.target
        last = cast(list[tuple[str, Any]], await t.redis.xrevrange(t.keys.replies, count=1))
        after = last[0][0] if last else "0-0"
        reader = ReplyReader(t, after, self.prefix)
        before = await snapshot(t, self.args.metrics_url)
        names = self.sessions(sessions)
        timed_out = False
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.run)
            t_start = time.perf_counter()
            if mode == "burst":
                self.sent = await t.send(workload_items(names, burst, self.args.senders))
            else:
                sample = self._sample_rss if self.phase == "memory" else None
                self.sent = await send_at_rate(t.producer, names, rate, duration, sample)
            t_sent = time.perf_counter()
            deadline = time.monotonic() + self.args.timeout
            while True:
                missing = sum(1 for s in self.sent if (s.session_id, s.msg_id) not in reader.first)
                if not missing:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    progress(f"{t.system}/{self.phase}: timed out with {missing} without a reply")
                    break
                await anyio.sleep(0.01)
            t_done = max((v[0] for v in reader.first.values()), default=time.perf_counter())
            await anyio.sleep(0.4)  # let straggling duplicates arrive and counters files flush
            reader.stop = True
        after_snap = await snapshot(t, self.args.metrics_url)
        result = self._result(mode, sessions, burst, rate, duration, reader, before, after_snap)
        result["send_s"] = round(t_sent - t_start, 3)
        result["drain_s"] = round(t_done - t_start, 3)
        n = len(self.sent)
        result["throughput_msg_s"] = round(n / (t_done - t_start), 1) if t_done > t_start else None
        result["timed_out"] = timed_out
        result["correctness"] = await check.correctness(t, self.sent, reader, timed_out)
        result["violations"] = check.violations(result["correctness"])
        if self.rss_samples:
            result["rss_samples"] = self.rss_samples
        return result

    def _sample_rss(self, elapsed_s: float) -> None:
        self.rss_samples.append(
            {
                "t_s": round(elapsed_s, 1),
                "rss_kb": {w.name: proc_rss_kb(w.pid) for w in self.target.procs},
            }
        )

    def _result(
        self,
        mode: str,
        sessions: int,
        burst: int,
        rate: float,
        duration: float,
        reader: ReplyReader,
        a: Snapshot,
        b: Snapshot,
    ) -> dict[str, Any]:
        n = len(self.sent) or 1
        lat, lat_redis = [], []
        for s in self.sent:
            got = reader.first.get((s.session_id, s.msg_id))
            if got is not None:
                lat.append((got[0] - s.t_send) * 1000)
                lat_redis.append(float(got[1] - s.enq_ms))
        offered = rate if mode == "rate" else None
        achieved = None
        if mode == "rate" and self.sent:
            span = max(s.t_send for s in self.sent) - min(s.t_send for s in self.sent)
            achieved = round(len(self.sent) / span, 1) if span > 0 else None
        producer_inside = 0  # a producer's XADD runs no command inside Redis
        return {
            "system": self.target.system,
            "phase": self.phase,
            "mode": mode,
            "sessions": sessions,
            "burst": burst if mode == "burst" else None,
            "duration_s": duration if mode == "rate" else None,
            "workers": len(self.target.procs) or None,
            "messages": len(self.sent),
            "offered_rate": offered,
            "achieved_send_rate": achieved,
            "latency_ms": summarize(lat),
            "latency_redis_ms": summarize(lat_redis),
            "requeues": cost.requeues(a, b, n),
            "redis": cost.redis_cost(a, b, n, producer_inside),
            "cpu": cost.cpu(a, b, n),
            "workers_rss_kb": {
                "start": list(a.workers_rss_kb.values()),
                "end": list(b.workers_rss_kb.values()),
            }
            if b.workers_rss_kb
            else None,
        }
