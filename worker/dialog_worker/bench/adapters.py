"""`dialog-worker bench --mode adapters`: what an agent framework adapter costs per turn, and
how large a conversation's state grows.

The fake provider (fake_provider.py) runs in this process and answers at once (``--step-ms``
for a slower one). For each engine of adapter_engines.py whose package is installed
(``hand-written`` first, then ``openai-agents``, ``pydantic-ai``, ``langgraph``), in the same
run: ``--workers`` worker processes with that engine take ``--sessions`` x ``--burst``
messages that make the same calls (a model call asking for a tool, the tool, a model call
answering; journaled, under a limit key, streamed). Reported per engine: turns per second,
the latency of a turn (send to reply event, p50 and p95), and the CPU time the workers spent
per turn (their processes' user plus system time: what the framework and the adapter add,
less sensitive to the machine's other load than the wall clock); ``overhead_cpu_ms_per_turn``
is that CPU time minus the hand-written engine's.

Then, per engine, one session of 50 turns with the adapters' default bounds and without them
(``BENCH_TRIM=0``; the hand-written engine keeps its last 20 turns either way): the size of
the session's state (its JSON) after the 50th turn, and of its memory (the conversation the
engine keeps; the rest is mostly the worker's history of the last DIALOG_HISTORY_LIMIT turns).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from dialog_worker.bench.adapter_engines import ENGINES, PROMPT
from dialog_worker.bench.fake_provider import Running
from dialog_worker.bench.machine import machine_info
from dialog_worker.bench.report import progress
from dialog_worker.bench.spawn import Workers
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings

MODEL = "fake-1"
STATE_TURNS = 50
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process (and its finished children), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / CLOCK_TICKS


async def adapters_bench(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:6]
    tmp = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    engines = [name for name, (package, _f) in ENGINES.items() if importlib.util.find_spec(package)]
    report: dict[str, Any] = {
        "bench": 1,
        "mode": "adapters",
        "machine": machine_info(),
        "config": {
            "sessions": args.sessions,
            "burst": args.burst,
            "workers": max(1, args.workers),
            "concurrency": args.concurrency or settings.concurrency,
            "provider_latency_ms": int(args.step_ms),
            "engines": engines,
            "turn": f"{PROMPT!r}: a model call asking for the tool, the tool, a model call",
        },
        "turns": {},
        # The state's JSON, and within it the memory (the conversation the adapter keeps; the
        # rest is mostly the worker's history of the last DIALOG_HISTORY_LIMIT turns).
        "state_bytes_after_50_turns": {},
    }
    with Running(latency_ms=int(args.step_ms), output_tokens=20) as provider:
        for name in engines:
            progress(f"adapters: {name}: {args.sessions} x {args.burst} turns")
            report["turns"][name] = await _turns(settings, args, run_id, tmp, provider, name)
            for trim in ("1", "0"):
                label = "trimmed" if trim == "1" else "untrimmed"
                sizes = await _state_size(settings, run_id, tmp, provider, name, trim)
                report["state_bytes_after_50_turns"].setdefault(name, {})[label] = sizes
    base = report["turns"].get("hand-written")
    for figures in report["turns"].values():
        if base is not None:
            figures["overhead_cpu_ms_per_turn"] = round(
                figures["cpu_ms_per_turn"] - base["cpu_ms_per_turn"], 2
            )
    report["ok"] = all(f["errors"] == 0 for f in report["turns"].values())
    return report


def _workers(
    settings: Settings, run_id: str, tmp: Path, provider: Running, name: str, trim: str
) -> tuple[Settings, Workers]:
    stream = f"bench-adapters-{run_id}-{name}-{trim}"
    settings = settings.replace(stream=stream, key_prefix=stream)
    workers = Workers(
        "ours",
        settings,
        f"{run_id}-{name}",
        tmp,
        None,
        extra_env={
            "DIALOG_ENGINE": f"dialog_worker.bench.adapter_engines:{ENGINES[name][1]}",
            "BENCH_PROVIDER_URL": provider.url,
            "BENCH_MODEL": MODEL,
            "BENCH_TRIM": trim,
            "DIALOG_STEP_TIMEOUT_S": "120",
        },
    )
    return settings, workers


async def _turns(
    settings: Settings,
    args: argparse.Namespace,
    run_id: str,
    tmp: Path,
    provider: Running,
    name: str,
) -> dict[str, Any]:
    n = max(1, args.workers)
    settings, workers = _workers(settings, run_id, tmp, provider, name, "1")
    if args.concurrency:
        workers.concurrency = args.concurrency
    async with DialogClient(settings=settings, max_connections=32) as client:
        try:
            await workers.start(n)
            # One turn per worker first: imports and connections warm, outside the figures.
            for i in range(n):
                await client.ask(f"warm{i}", PROMPT, timeout=120)
            cpu_before = sum(cpu_s(w.pid) for w in workers.procs)
            started = time.time()
            sent_at: dict[str, float] = {}
            async with client.redis.pipeline(transaction=False) as pipe:
                for b in range(args.burst):
                    for s in range(args.sessions):
                        msg_id = f"m{s}-{b}"
                        pipe.xadd(
                            client.keys.stream,
                            {"session_id": f"u{s}", "text": PROMPT, "msg_id": msg_id},
                        )
                        sent_at[msg_id] = started
                await pipe.execute()
            latencies, errors = await _collect(client, sent_at, args.sessions * args.burst)
            elapsed = time.time() - started
            cpu = sum(cpu_s(w.pid) for w in workers.procs) - cpu_before
        finally:
            workers.stop()
    turns = len(latencies)
    return {
        "turns": turns,
        "errors": errors,
        "turns_per_s": round(turns / elapsed, 1),
        "latency_ms_p50": round(statistics.median(latencies), 1) if latencies else None,
        "latency_ms_p95": round(_p95(latencies), 1) if latencies else None,
        "cpu_ms_per_turn": round(cpu * 1000 / max(1, turns), 2),
    }


async def _collect(
    client: DialogClient, sent_at: dict[str, float], expected: int
) -> tuple[list[float], int]:
    """Read the reply stream until every message ended: each applied turn's latency (its
    reply event's production time minus its send time, ms) and the count of the others."""
    latencies: list[float] = []
    errors = 0
    last = "0-0"
    deadline = time.monotonic() + 600
    while len(latencies) + errors < expected and time.monotonic() < deadline:
        answer: Any = await client.redis.xread({client.keys.replies: last}, count=500, block=500)
        for _stream, entries in answer or []:
            for entry_id, fields in entries:
                last = _text(entry_id)
                f = {_text(k): _text(v) for k, v in fields.items()}
                if f.get("msg_id") not in sent_at:
                    continue
                if f.get("outcome") == "applied":
                    produced_ms = int(f.get("produced_at", "0"))
                    latencies.append(produced_ms - sent_at[f["msg_id"]] * 1000)
                else:
                    errors += 1
    errors += expected - len(latencies) - errors
    return latencies, errors


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


async def _state_size(
    settings: Settings, run_id: str, tmp: Path, provider: Running, name: str, trim: str
) -> dict[str, int]:
    """The session's state and its memory (their JSON, bytes) after STATE_TURNS turns of one
    conversation."""
    settings, workers = _workers(settings, run_id, tmp, provider, name, trim)
    async with DialogClient(settings=settings, max_connections=8) as client:
        try:
            await workers.start(1)
            for turn in range(STATE_TURNS):
                text = PROMPT if turn % 2 == 0 else f"and what about turn {turn}?"
                await client.ask("state", text, timeout=120)
            state = await client.state("state")
        finally:
            workers.stop()
    assert state is not None

    def size(value: Any) -> int:
        return len(json.dumps(value, ensure_ascii=False).encode())

    return {"state": size(state), "memory": size(state["memory"])}
