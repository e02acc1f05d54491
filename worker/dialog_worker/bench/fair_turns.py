"""`dialog-worker bench --mode limits --tenants`: tenants sharing one limit key's turns.

The fake provider (fake_provider.py) answers in ``--step-ms`` (default 100 ms) and enforces
``--provider-rpm`` (default 600: 10 calls a second); the key has the same rate and no token
limit. ``--workers`` processes of ``--concurrency`` slots (default 2 x 16) run the bench's LLM
engine (limits_engine.py: one model call per message) on messages that name their tenant
(a ``tenant`` field: no `tenants set` needed). Three runs, each in its own namespace:

- ``flood``: tenant a's 200 messages wait for the key, then tenant b sends one message every
  0.5 s (``--probes``, default 20): each of b's replies' time from its send (goal: at most
  0.5 s plus the step);
- ``weights``: a (weight 3, `tenants set`) and b (weight 1) both with backlogs for
  ``--duration`` seconds (default 60): their calls' ratio (goal 3 +- 10 %);
- ``alone``: a alone with a backlog for a third of that: its calls per second against the
  key's rate (goal >= 0.95).

Calls are counted from the replies (one call per message), by the time they were written.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio

from dialog_worker.bench.fake_provider import Running
from dialog_worker.bench.machine import machine_info
from dialog_worker.bench.report import progress
from dialog_worker.bench.spawn import Workers
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.store import tenants
from dialog_worker.store.keys import Keys, Topology

KEY = "bench:model"
MODEL = "model"
PROMPT = "Jawab singkat: apa kabar?"


async def fair_turns_bench(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    rpm = args.provider_rpm if args.provider_rpm != 60 else 600
    step_ms = int(args.step_ms) if args.step_ms else 100
    workers_n, concurrency = max(1, args.workers), args.concurrency or 16
    window_s = float(args.duration) if args.duration else 60.0
    report: dict[str, Any] = {
        "bench": 1,
        "mode": "limits-tenants",
        "machine": machine_info(),
        "config": {
            "key_rpm": rpm,
            "workers": workers_n,
            "concurrency": concurrency,
            "provider_latency_ms": step_ms,
            "window_s": window_s,
        },
    }
    with Running(rpm=rpm, tpm=0, output_tokens=20, latency_ms=step_ms) as provider:

        async def run(name: str, scenario: Any) -> dict[str, Any]:
            run_id = uuid.uuid4().hex[:6]
            stream = f"bench-fair-{run_id}"
            own = settings.replace(stream=stream, key_prefix=stream)
            workers = Workers(
                "ours",
                own,
                run_id,
                Path(tempfile.mkdtemp(prefix="bench-fair-")),
                concurrency,
                extra_env={
                    "DIALOG_ENGINE": "dialog_worker.bench.limits_engine:LimitsEngine",
                    "DIALOG_MODEL_LIMITS": json.dumps({KEY: {"rpm": rpm}}),
                    "BENCH_PROVIDER_URL": provider.url,
                    "BENCH_LIMIT_KEY": KEY,
                    "BENCH_MODEL": MODEL,
                    "BENCH_MAX_TOKENS": "20",
                },
            )
            async with DialogClient(settings=own, max_connections=16) as client:
                try:
                    progress(f"limits/tenants: {name}")
                    await workers.start(workers_n)
                    return dict(await scenario(client, own))
                finally:
                    workers.stop()
                    await _clean(client, stream)

        async def flood(client: DialogClient, own: Settings) -> dict[str, Any]:
            await _send(client, "a", 200, 0)
            await anyio.sleep(2.0)  # a's calls wait for the key
            sent: dict[str, float] = {}
            for i in range(args.probes):
                sent[f"b-{i}"] = time.time()
                await _send(client, "b", 1, i)
                await anyio.sleep(0.5)
            await anyio.sleep(3.0)
            return flood_figures(sent, await _replies(client), step_ms)

        async def weights(client: DialogClient, own: Settings) -> dict[str, Any]:
            keys, topology = Keys.from_settings(own), Topology.from_settings(own)
            await tenants.set_settings(client.redis, keys, "a", topology, weight=3.0)
            backlog = int(window_s * rpm / 60) + 50
            await _send(client, "a", backlog, 0)
            await _send(client, "b", backlog, 0)
            began = time.time()
            await anyio.sleep(window_s)
            return weights_figures(await _replies(client), began + 5)

        async def alone(client: DialogClient, own: Settings) -> dict[str, Any]:
            span = max(20.0, window_s / 3)
            await _send(client, "a", int(span * rpm / 60) + 50, 0)
            await anyio.sleep(span)
            return alone_figures(list((await _replies(client)).values()), rpm)

        report["flood"] = await run("flood", flood)
        report["weights"] = await run("weights", weights)
        report["alone"] = await run("alone", alone)
    report["ok"] = all(report[n]["met"] for n in ("flood", "weights", "alone"))
    return report


def flood_figures(sent: dict[str, float], done: dict[str, float], step_ms: int) -> dict[str, Any]:
    """b's lone messages (session -> when sent) against the replies (session -> when written):
    each answered within half a second plus the step."""
    waits = [round(done[s] - t, 3) for s, t in sent.items() if s in done]
    goal = 0.5 + step_ms / 1000
    return {
        "b_reply_s": waits,
        "b_answered": len(waits),
        "goal_s": round(goal, 3),
        "met": len(waits) == len(sent) and bool(waits) and max(waits) <= goal,
    }


def weights_figures(done: dict[str, float], since: float) -> dict[str, Any]:
    """a's (weight 3) and b's calls answered from ``since`` on: 3 : 1 within 10 %."""
    calls = {t: sum(1 for s, at in done.items() if s.startswith(f"{t}-") and at >= since)
             for t in ("a", "b")}  # fmt: skip
    ratio = calls["a"] / max(1, calls["b"])
    return {"calls": calls, "ratio": round(ratio, 3), "met": abs(ratio - 3) <= 0.3}


def alone_figures(times: list[float], rpm: int) -> dict[str, Any]:
    """A tenant alone: its calls per second after the first 2 s, against the key's rate."""
    times = sorted(times)
    steady = [t for t in times if t >= times[0] + 2] if times else []
    rate = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else 0.0
    share = rate / (rpm / 60)
    return {"calls_per_s": round(rate, 3), "share_of_rate": round(share, 3), "met": share >= 0.95}


async def _send(client: DialogClient, tenant: str, n: int, first: int) -> None:
    async with client.redis.pipeline(transaction=False) as pipe:
        for i in range(first, first + n):
            pipe.xadd(
                client.keys.stream,
                {"session_id": f"{tenant}-{i}", "text": PROMPT, "tenant": tenant},
            )
        await pipe.execute()


async def _replies(client: DialogClient) -> dict[str, float]:
    """Session -> when its (one) applied reply was written (s, from its entry id)."""
    done: dict[str, float] = {}
    async for reply in client.replies(start="0", follow=False):
        if reply.outcome == "applied":
            done[reply.session_id] = int(reply.id.split("-")[0]) / 1000
    return done


async def _clean(client: DialogClient, stream: str) -> None:
    names = [stream]
    async for key in client.redis.scan_iter(match=f"{stream}*", count=1000):
        names.append(key)
    for i in range(0, len(names), 500):
        await client.redis.delete(*names[i : i + 500])
