"""`dialog-worker bench --mode limits`: workers against a provider that enforces its quota.

The fake provider (fake_provider.py) runs in this process with ``--provider-rpm`` /
``--provider-tpm`` (default 60 / 100,000) and answers slowly (``--step-ms``, default 2,000 ms);
``--workers`` processes of ``--concurrency`` slots (default 64) run the bench's LLM
engine (limits_engine.py) with the same limits on its key, and a backlog of ``--sessions`` x
``--burst`` messages (prompts of about 400 tokens, answers of 1,600: the token limit binds)
waits, far more than the quota serves in ``--duration`` seconds (at least 150). At 60 % of the
run the provider has an incident: it answers 429 with ``Retry-After: --incident-s`` (default
10) for that long. Then the workers are stopped (what is in flight is handed back).

Reported (from the provider's own log of every request, and from Redis):
- ``rate_limited_share_after_first_minute``: 429s among the calls after the first minute,
  outside the incident (the quota's own 429s);
- ``tokens_served_share_of_tpm``: tokens the provider served per minute after the first minute
  and before the incident, as a share of its TPM;
- ``calls_during_retry_after``: calls that reached the provider between 100 ms after the
  incident's first 429 and the end of its Retry-After (0: the key was paused for every worker);
- with ``--provider-retry-after`` (the incident's 429s say e.g. ``Retry-After: 0``):
  ``incident_calls_per_s``, the calls that reached the provider during the incident per second,
  against ``key_rate_per_s`` (the key's rpm / 60): at most twice it (no hot loop);
- ``dead_letters``, ``duplicates``, ``out_of_order``: from the reply and dead-letter streams;
  ``usage_counted_equals_committed``: the tenant's counters against the replies' usage;
- ``budget``: 64 concurrent calls against a budget (the budget scripts), each using 10 % more
  than its estimate: how far the spent tokens passed the budget, and the bound (what the
  granted calls used beyond their estimates).
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
from dialog_worker.errors import ValidationError
from dialog_worker.store import tenants
from dialog_worker.store.keys import Keys, Topology
from dialog_worker.store.scripts import Scripts

KEY = "bench:model"
MODEL = "model"
FIRST_WINDOW_S = 60.0
# ~1,600 bytes: about 400 prompt tokens (the provider counts 4 bytes a token).
PROMPT = "Ringkas percakapan pelanggan berikut dan jawab pertanyaannya. " * 26


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--provider-rpm", type=int, default=60, help="limits mode: provider RPM")
    p.add_argument("--provider-tpm", type=int, default=100_000, help="limits mode: provider TPM")
    p.add_argument(
        "--incident-s", type=float, default=10.0, help="limits mode: the 429 incident's length"
    )
    p.add_argument(
        "--tenants",
        action="store_true",
        help="limits mode: tenants sharing the key's turns instead (bench/fair_turns.py): b's "
        "lone messages behind a's flood, weights 3:1, a tenant alone; --provider-rpm "
        "(default then 600), --step-ms (100), --duration (the weights' window, 60)",
    )
    p.add_argument(
        "--provider-retry-after",
        metavar="TEXT",
        help="limits mode: the incident's 429s carry this Retry-After (e.g. 0, -5, a past date) "
        "instead of the seconds left; the figure is then the calls per second during the "
        "incident against the key's rate",
    )


async def limits_bench(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    if args.duration < 150:
        # The first minute is left out; the incident comes at 60 % of the run.
        raise ValidationError("--mode limits needs --duration of at least 150 (seconds)")
    run_id = uuid.uuid4().hex[:6]
    stream = f"bench-limits-{run_id}"
    settings = settings.replace(stream=stream, key_prefix=stream)
    rpm, tpm = args.provider_rpm, args.provider_tpm
    workers_n = max(1, args.workers)
    concurrency = args.concurrency or 64
    latency_ms = int(args.step_ms) if args.step_ms else 2000
    tmp = Path(tempfile.mkdtemp(prefix="bench-limits-"))
    report: dict[str, Any] = {
        "bench": 1,
        "mode": "limits",
        "machine": machine_info(),
        "config": {
            "provider_rpm": rpm,
            "provider_tpm": tpm,
            "workers": workers_n,
            "concurrency": concurrency,
            "sessions": args.sessions,
            "burst": args.burst,
            "duration_s": args.duration,
            "incident_s": args.incident_s,
            "provider_latency_ms": latency_ms,
        },
    }
    with Running(rpm=rpm, tpm=tpm, output_tokens=1600, latency_ms=latency_ms) as provider:
        workers = Workers(
            "ours",
            settings,
            run_id,
            tmp,
            concurrency,
            extra_env={
                "DIALOG_ENGINE": "dialog_worker.bench.limits_engine:LimitsEngine",
                "DIALOG_MODEL_LIMITS": json.dumps({KEY: {"rpm": rpm, "tpm": tpm}}),
                "DIALOG_STEP_TIMEOUT_S": "120",
                "BENCH_PROVIDER_URL": provider.url,
                "BENCH_LIMIT_KEY": KEY,
                "BENCH_MODEL": MODEL,
                "BENCH_MAX_TOKENS": "1600",
            },
        )
        async with DialogClient(settings=settings, max_connections=32) as client:
            try:
                progress(f"limits: starting {workers_n} worker process(es) x {concurrency}")
                await workers.start(workers_n)
                sent = await _send_backlog(client, args.sessions, args.burst)
                started = time.time()
                incident_at = started + 0.6 * args.duration
                progress(f"limits: {sent} messages waiting; running {args.duration:g} s")
                await anyio.sleep(max(0.0, incident_at - time.time()))
                provider.provider.throttle(MODEL, args.incident_s, args.provider_retry_after)
                progress(f"limits: provider incident, 429 for {args.incident_s:g} s")
                await anyio.sleep(max(0.0, started + args.duration - time.time()))
            finally:
                workers.stop()
            ended = time.time()
            report["provider"] = _provider_figures(
                provider.provider.stats(), started, incident_at, ended, args.incident_s, tpm
            )
            report["provider"]["key_rate_per_s"] = round(rpm / 60, 3)
            report["correctness"] = await _correctness(client, settings)
            report["budget"] = await _budget_overshoot(client, settings)
            await _clean(client, stream)
    figures = report["provider"]
    report["ok"] = bool(
        report["correctness"]["dead_letters"] == 0
        and report["correctness"]["duplicates"] == 0
        and report["correctness"]["out_of_order"] == 0
        and report["correctness"]["usage_counted_equals_committed"]
        and _incident_ok(figures, args.provider_retry_after)
        and report["budget"]["overshoot"] <= report["budget"]["bound"]
    )
    return report


def _incident_ok(figures: dict[str, Any], retry_after: str | None) -> bool:
    """An honest Retry-After: no call until it is over (the key paused for every worker). One
    that names no usable wait (0, negative, a past date): no more calls than twice the key's
    rate, however long the incident (the pause's floor, no hot loop)."""
    if retry_after is None:
        return bool(figures["calls_during_retry_after"] == 0)
    return bool(figures["incident_calls_per_s"] <= 2 * figures["key_rate_per_s"])


async def _send_backlog(client: DialogClient, sessions: int, burst: int) -> int:
    sent = 0
    for b in range(burst):
        async with client.redis.pipeline(transaction=False) as pipe:
            for s in range(sessions):
                pipe.xadd(
                    client.keys.stream,
                    {"session_id": f"u{s}", "text": f"{b + 1}. {PROMPT}", "msg_id": f"m{s}-{b}"},
                )
                sent += 1
            await pipe.execute()
    return sent


def _provider_figures(
    stats: dict[str, Any],
    started: float,
    incident_at: float,
    ended: float,
    incident_s: float,
    tpm: int,
) -> dict[str, Any]:
    log = [e for e in stats["log"] if e["model"] == MODEL]
    throttled = [e for e in log if e["status"] == 429 and e["t"] >= incident_at]
    first_429 = min((e["t"] for e in throttled), default=None)
    incident_end = (first_429 or incident_at) + incident_s
    steady = [e for e in log if started + FIRST_WINDOW_S <= e["t"] < incident_at]
    after_first = [
        e
        for e in log
        if e["t"] >= started + FIRST_WINDOW_S and not incident_at <= e["t"] < incident_end + 1
    ]
    limited = sum(1 for e in after_first if e["status"] == 429)
    served = sum(e["tokens"] for e in steady if e["status"] == 200)
    window_s = max(1e-9, incident_at - (started + FIRST_WINDOW_S))
    during = (
        [e for e in log if first_429 + 0.1 < e["t"] < first_429 + incident_s]
        if first_429 is not None
        else []
    )
    incident = (
        [e for e in log if first_429 <= e["t"] < first_429 + incident_s]
        if first_429 is not None
        else []
    )
    return {
        "calls": sum(1 for e in log if e["status"] == 200),
        "rate_limited": sum(1 for e in log if e["status"] == 429),
        "calls_after_first_minute": len(after_first),
        "rate_limited_share_after_first_minute": round(limited / max(1, len(after_first)), 4),
        "tokens_served_per_minute": round(served / window_s * 60),
        "tokens_served_share_of_tpm": round(served / window_s * 60 / tpm, 4) if tpm else None,
        "incident_first_429_after_s": round(first_429 - started, 2) if first_429 else None,
        "calls_during_retry_after": len(during),
        "incident_429s": len(throttled),
        "incident_calls_per_s": round(len(incident) / max(incident_s, 1e-9), 3),
    }


async def _correctness(client: DialogClient, settings: Settings) -> dict[str, Any]:
    seen: dict[str, int] = {}
    applied = duplicates = out_of_order = 0
    committed_in = committed_out = 0
    with_usage = 0
    async for reply in client.replies(start="0", follow=False):
        if reply.outcome != "applied":
            continue
        applied += 1
        last = seen.get(reply.session_id, 0)
        if reply.seq is not None and reply.seq == last:
            duplicates += 1
        elif reply.seq is not None and reply.seq < last:
            out_of_order += 1
        seen[reply.session_id] = max(last, reply.seq or 0)
        if reply.usage:
            with_usage += 1
            committed_in += reply.usage["input_tokens"]
            committed_out += reply.usage["output_tokens"]
    counted = await client.tenant_usage("default")
    return {
        "applied": applied,
        "dead_letters": int(await client.redis.xlen(client.keys.dlq)),
        "duplicates": duplicates,
        "out_of_order": out_of_order,
        "usage_counted_equals_committed": (
            counted["input_tokens"],
            counted["output_tokens"],
            counted["calls"],
        )
        == (committed_in, committed_out, with_usage),
        "wasted_calls": counted["wasted"]["calls"],
    }


async def _budget_overshoot(client: DialogClient, settings: Settings) -> dict[str, Any]:
    """64 calls at once against a budget, as the worker makes them (store/tenants.py): each
    holds its estimate and checks the day's usage, uses 10 % more than its estimate, and its
    usage is then counted (as its commit would) and its hold dropped."""
    scripts, keys = Scripts.register(client.redis), Keys.from_settings(settings)
    topology = Topology.from_settings(settings)
    day, budget, estimate = tenants.today(), 100_000, 2_000
    actual = estimate * 11 // 10
    granted: list[int] = []

    async def call(i: int) -> None:
        got = await tenants.reserve(
            client.redis, scripts, topology, keys, "bench", day, f"c{i}", estimate, budget, 60_000
        )
        if got.granted:
            granted.append(i)
            await anyio.sleep(0.05)  # the call itself
            await tenants.spend(scripts, keys, "bench", day, f"c{i}", actual)
            await client.redis.hincrby(keys.usage(day), "bench:in", actual)  # its commit
            await tenants.land(scripts, keys, "bench", day, [f"c{i}"])

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(call, i)
    spent, _ = await tenants.used_today(client.redis, topology, keys, "bench", day)
    return {
        "concurrent_calls": 64,
        "budget": budget,
        "estimate": estimate,
        "used_per_call": actual,
        "granted": len(granted),
        "spent": spent,
        "overshoot": max(0, spent - budget),
        "bound": len(granted) * (actual - estimate),
    }


async def _clean(client: DialogClient, stream: str) -> None:
    """Remove every key of the run (its own namespace, nobody else's)."""
    names = [stream, f"{stream}-workers", f"{stream}-replies", f"{stream}-dlq"]
    async for key in client.redis.scan_iter(match=f"{stream}*", count=1000):
        names.append(key)
    for i in range(0, len(names), 500):
        await client.redis.delete(*names[i : i + 500])
