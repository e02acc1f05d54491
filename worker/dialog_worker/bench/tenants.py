"""`dialog-worker bench --mode tenants` and `--mode merge`: how the slots are shared between
tenants, and how bursts merge.

`--mode tenants` (workers of `--concurrency` slots, steps of `--step-ms`, default 200 ms, tenants
in use through their settings) runs four scenarios, each on fresh keys:
- ``flood``: tenant a sends ``--flood`` messages (default 10,000) over ``--sessions`` sessions
  (default 1,000), then, while a's backlog is worked, tenant b sends one message at a time
  (``--probes``, default 20, one every half second): b's reply latency (send -> reply);
- ``flood_spread``: the same with a's messages over as many sessions as messages (one each);
- ``alone``: a's flood with no other tenant: slots used, as a share of what the slots allow
  (messages/s against slots / step);
- ``weights``: a (weight 3) and b (weight 1) both with backlogs: their shares of the replies
  while both still had messages waiting.
`--mode merge` (one worker, ``DIALOG_MULTITASK=merge``, window ``--merge-window-ms`` default
2,000, longest ``--merge-max-ms`` default 10,000, instant steps): three messages 0.5 s apart
(steps and reply events), a lone message (its wait against the window), and a trickle one
message every half window until the longest wait (its wait against the longest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, cast

import anyio

from dialog_worker.bench.machine import machine_info
from dialog_worker.bench.report import progress
from dialog_worker.bench.spawn import Workers
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.store import tenants
from dialog_worker.store.keys import Keys, Topology


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flood", type=int, default=10_000, help="tenants mode: a's messages")
    p.add_argument("--probes", type=int, default=20, help="tenants mode: b's lone messages")
    p.add_argument("--merge-window-ms", type=int, default=2000, help="merge mode: the window")
    p.add_argument("--merge-max-ms", type=int, default=10_000, help="merge mode: longest wait")


def _fresh(settings: Settings, what: str) -> Settings:
    name = f"bench-{what}-{uuid.uuid4().hex[:6]}"
    return settings.replace(stream=name, key_prefix=name)


async def _workers(
    settings: Settings, tmp: Path, n: int, concurrency: int, env: dict[str, str]
) -> Workers:
    workers = Workers("ours", settings, uuid.uuid4().hex[:6], tmp, concurrency, extra_env=env)
    await workers.start(n)
    return workers


async def _flood(client: DialogClient, tenant: str, messages: int, sessions: int) -> None:
    for start in range(0, messages, 1000):
        async with client.redis.pipeline(transaction=False) as pipe:
            for i in range(start, min(messages, start + 1000)):
                sid = f"{tenant}-{i % sessions}"
                pipe.xadd(client.keys.stream, {"session_id": sid, "text": "hi", "tenant": tenant})
            await pipe.execute()


async def _drain(
    client: DialogClient, total: int, deadline_s: float
) -> list[tuple[int, dict[bytes, bytes]]]:
    """The reply events once `total` are there (or the deadline passed), each with the time
    Redis wrote it (its entry id's milliseconds)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await client.redis.xlen(client.keys.replies) >= total:
            break
        await anyio.sleep(0.2)
    rows = cast(list[Any], await client.raw.xrange(client.keys.replies))
    return [(int(bytes(entry_id).split(b"-")[0]), fields) for entry_id, fields in rows]


async def _redis_ms(client: DialogClient) -> int:
    sec, usec = await client.redis.time()
    return int(sec) * 1000 + int(usec) // 1000


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


async def _scenario(
    base: Settings, args: argparse.Namespace, tmp: Path, name: str, step_ms: float
) -> dict[str, Any]:
    settings = _fresh(base, name)
    slots = args.concurrency or 64
    env = {
        "DIALOG_ENGINE": "dialog_worker.bench.slow_engine:make",
        "BENCH_STEP_MS": str(step_ms),
        "DIALOG_TENANT_PATTERN": "^([a-z]+)-",  # a-7 is tenant a's, b-probe-3 tenant b's
    }
    async with DialogClient(settings=settings, max_connections=16) as client:
        topology = Topology.from_settings(settings)
        keys = Keys.from_settings(settings)
        # Tenants in use (the workers read ahead into the tenants' queues).
        await tenants.set_settings(client.redis, keys, "a", topology, weight=1.0)
        if name == "weights":
            await tenants.set_settings(client.redis, keys, "a", topology, weight=3.0)
        await tenants.set_settings(client.redis, keys, "b", topology, weight=1.0)
        flood, sessions = args.flood, args.sessions
        if name == "flood_spread":
            sessions = flood
        await _flood(client, "a", flood, sessions)
        if name == "weights":
            await _flood(client, "b", flood, sessions)
        workers = await _workers(settings, tmp, args.workers, slots, env)
        result: dict[str, Any] = {"scenario": name}
        try:
            started_ms = await _redis_ms(client)
            expected = flood * (2 if name == "weights" else 1)
            if name in ("flood", "flood_spread"):
                latencies = []
                await anyio.sleep(1.0)  # a's backlog is being worked
                for i in range(args.probes):
                    sent = time.monotonic()
                    reply = await client.ask(f"b-probe-{i}", "hi", timeout=60)
                    assert reply.outcome == "applied", reply
                    latencies.append((time.monotonic() - sent) * 1000)
                    await anyio.sleep(0.5)
                expected += args.probes
                result["b_latency_ms"] = {
                    "p50": _pct(latencies, 0.5),
                    "p99": _pct(latencies, 0.99),
                    "max": round(max(latencies), 1),
                    "probes": len(latencies),
                }
                result["bound_ms"] = step_ms + 100
            timed = await _drain(client, expected, deadline_s=flood * step_ms / 1000 / 8 + 120)
            events = [fields for _, fields in timed]
            result["replies"] = len(events)
            if name == "alone" and timed:
                # From the workers' start to the last reply event (Redis's clock), and the
                # steady part alone: from the 10th to the 90th percentile reply (no start-up,
                # no last partial round of slots).
                bound = args.workers * slots / (step_ms / 1000)
                rate = len(events) / max(0.001, (timed[-1][0] - started_ms) / 1000)
                lo, hi = timed[len(timed) // 10][0], timed[len(timed) * 9 // 10][0]
                steady = (len(timed) * 9 // 10 - len(timed) // 10) / max(0.001, (hi - lo) / 1000)
                result["throughput_msg_s"] = round(rate, 1)
                result["steady_throughput_msg_s"] = round(steady, 1)
                result["slots_bound_msg_s"] = round(bound, 1)
                result["share_of_bound"] = round(rate / bound, 4)
                result["steady_share_of_bound"] = round(steady / bound, 4)
            if name == "weights":
                # Up to the first tenant's last reply, both had messages waiting.
                order = [e[b"session_id"][:1] for e in events]
                last_a = max(i for i, t in enumerate(order) if t == b"a")
                last_b = max(i for i, t in enumerate(order) if t == b"b")
                both = order[: min(last_a, last_b)]
                a, b = both.count(b"a"), both.count(b"b")
                result["while_both_waited"] = {"a": a, "b": b, "ratio": round(a / max(1, b), 3)}
                # The same from b's first reply on: a's flood was sent first, so the readers
                # read a's 10,000 entries before b's, and until then a alone had messages to
                # schedule (the scheduler shares out what has been read).
                first_b = order.index(b"b")
                both = order[first_b : min(last_a, last_b)]
                a, b = both.count(b"a"), both.count(b"b")
                result["both_read"] = {"a": a, "b": b, "ratio": round(a / max(1, b), 3)}
        finally:
            workers.stop()
            await _clean(client, settings)
    return result


async def _clean(client: DialogClient, settings: Settings) -> None:
    async for key in client.redis.scan_iter(match=f"{settings.stream}*", count=1000):
        await client.redis.delete(key)


async def tenants_bench(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    step_ms = args.step_ms or 200.0
    report: dict[str, Any] = {
        "bench": 1,
        "mode": "tenants",
        "machine": machine_info(),
        "config": {
            "workers": args.workers,
            "concurrency": args.concurrency or 64,
            "step_ms": step_ms,
            "flood": args.flood,
            "sessions": args.sessions,
            "probes": args.probes,
        },
        "scenarios": [],
    }
    for name in ("flood", "flood_spread", "alone", "weights"):
        progress(f"tenants: {name}")
        result = await _scenario(settings, args, tmp, name, step_ms)
        progress(json.dumps(result))
        report["scenarios"].append(result)
    return report


async def merge_bench(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-merge-"))
    window, longest = args.merge_window_ms, args.merge_max_ms
    settings = _fresh(settings, "merge")
    env = {
        "DIALOG_MULTITASK": "merge",
        "DIALOG_MERGE_WINDOW_MS": str(window),
        "DIALOG_MERGE_MAX_MS": str(longest),
    }
    report: dict[str, Any] = {
        "bench": 1,
        "mode": "merge",
        "machine": machine_info(),
        "config": {"window_ms": window, "max_ms": longest},
    }
    async with DialogClient(settings=settings, max_connections=8) as client:
        workers = await _workers(settings, tmp, 1, 8, env)
        try:
            # Three messages half a second apart: one step, three reply events.
            before = await client.redis.xlen(client.keys.replies)
            for i in range(3):
                await client.send("burst", f"part {i}", msg_id=f"p{i}")
                await anyio.sleep(0.5)
            timed = await _drain(client, before + 3, deadline_s=longest / 1000 + 30)
            events = [fields for _, fields in timed]
            outcomes = [e[b"outcome"].decode() for e in events[before:]]
            report["three_parts"] = {
                "reply_events": len(outcomes),
                "outcomes": outcomes,
                "steps": outcomes.count("applied"),
            }
            # A lone message waits the window.
            waits = []
            for i in range(5):
                sent = time.monotonic()
                await client.ask(f"lone-{i}", "hello", timeout=longest / 1000 + 30)
                waits.append((time.monotonic() - sent) * 1000)
            report["lone_wait_ms"] = {
                "mean": round(statistics.mean(waits), 1),
                "min": round(min(waits), 1),
                "max": round(max(waits), 1),
                "window_ms": window,
            }
            # A trickle one message every half window: answered at the longest wait.
            sent_at = time.monotonic()
            before = await client.redis.xlen(client.keys.replies)
            first_reply = None
            n = 0
            while first_reply is None and time.monotonic() - sent_at < longest / 1000 + 10:
                await client.send("trickle", f"bit {n}", msg_id=f"t{n}")
                n += 1
                step_end = time.monotonic() + window / 2000
                while time.monotonic() < step_end:
                    if await client.redis.xlen(client.keys.replies) > before:
                        first_reply = time.monotonic()
                        break
                    await anyio.sleep(0.01)
            waited = ((first_reply or time.monotonic()) - sent_at) * 1000
            report["trickle_first_answer_ms"] = {"waited": round(waited, 1), "max_ms": longest}
        finally:
            workers.stop()
            await _clean(client, settings)
    report["ok"] = (
        report["three_parts"]["steps"] == 1 and report["three_parts"]["reply_events"] == 3
    )
    return report
