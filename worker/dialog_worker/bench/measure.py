"""The instruments of a run: before/after snapshots of every counter the bench reads (Redis
commandstats and CPU, the bench's own command counts and CPU, each worker's CPU, RSS, counts
file, stats file and /metrics), and the reader that times every reply as it arrives."""

from __future__ import annotations

import dataclasses
import resource
import time
from collections import Counter, defaultdict
from typing import Any, cast

import anyio

from dialog_worker.bench.counting import COUNTER, command_calls
from dialog_worker.bench.machine import proc_cpu_s, proc_rss_kb
from dialog_worker.bench.spawn import scrape_metrics
from dialog_worker.bench.stats import id_ms
from dialog_worker.bench.target import Target


@dataclasses.dataclass
class Snapshot:
    t: float
    calls: dict[str, int]
    redis_cpu_s: float
    bench: dict[str, Any]
    bench_cpu_s: float
    workers_cpu_s: dict[int, float]
    workers_rss_kb: dict[int, int]
    counts: dict[str, dict[str, Any]]
    stats: dict[str, dict[str, Any]]
    metrics: dict[str, dict[str, float]]


async def snapshot(target: Target, metrics_urls: list[str]) -> Snapshot:
    bench = COUNTER.snapshot()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    calls = await command_calls(target.redis)
    cpu = await target.redis.info("cpu")
    metrics: dict[str, dict[str, float]] = {}
    for w in target.procs:
        metrics[w.name] = await anyio.to_thread.run_sync(w.metrics)
    for url in metrics_urls:
        metrics[url] = await anyio.to_thread.run_sync(scrape_metrics, url)
    return Snapshot(
        t=time.perf_counter(),
        calls=calls,
        redis_cpu_s=float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        bench=bench,
        bench_cpu_s=ru.ru_utime + ru.ru_stime,
        workers_cpu_s={w.pid: proc_cpu_s(w.pid) or 0.0 for w in target.procs},
        workers_rss_kb={w.pid: proc_rss_kb(w.pid) or 0 for w in target.procs},
        counts={w.name: w.counts() for w in target.procs},
        stats={w.name: w.stats() for w in target.procs},
        metrics=metrics,
    )


class ReplyReader:
    """Reads the reply stream (XREAD BLOCK from the last ID before the run) and records, per
    (session, msg_id), when each reply reached the bench and its Redis time, and per session
    the order of the msg_ids replied to. Keyed by msg_id, not seq: the bench knows every
    msg_id when it sends, while a seq is the worker's to assign."""

    def __init__(self, target: Target, after: str, prefix: str) -> None:
        self.target = target
        self.after = after
        self.prefix = prefix
        self.first: dict[tuple[str, str], tuple[float, int]] = {}
        self.count: Counter[tuple[str, str]] = Counter()
        self.order: dict[str, list[str]] = defaultdict(list)
        self.dead_lettered: set[tuple[str, str]] = set()
        self.stop = False

    async def run(self) -> None:
        last = self.after
        redis = self.target.redis
        stream = self.target.keys.replies
        while not self.stop:
            reply = await redis.xread({stream: last}, count=2000, block=100)
            now = time.perf_counter()
            for _, entries in cast(list[tuple[str, list[tuple[str, dict[str, str]]]]], reply):
                for entry_id, f in entries:
                    last = entry_id
                    sid = f.get("session_id", "")
                    if not sid.startswith(self.prefix):
                        continue
                    key = (sid, f.get("msg_id", ""))
                    self.count[key] += 1
                    self.order[sid].append(key[1])
                    # v2 replies say `outcome`; the seed comparison marks `dead_lettered=1`
                    if f.get("outcome") == "dead_lettered" or f.get("dead_lettered") == "1":
                        self.dead_lettered.add(key)
                    if key not in self.first:
                        self.first[key] = (now, id_ms(entry_id))
