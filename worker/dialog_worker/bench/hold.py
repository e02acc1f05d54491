"""`dialog-worker bench --mode hold`: what holding steps in flight costs Redis.

--sessions N sessions get one message each; the workers' engine waits longer than the run
(--step-ms, default: --duration plus a minute), so every step is in flight at once. Once all N
are (the workers' dialog_in_flight gauges add up to N), the bench reads INFO commandstats and
INFO memory, waits --duration seconds, and reads them again: the Redis commands per second per
step in flight (every command the server ran, scripts' inner commands included, the bench's
own INFO calls left out), Redis memory and worker RSS per step. The steps are not waited for:
the workers are stopped and what the run wrote is removed, as after any run.

`--worker-path DIR` runs the workers from another checkout's worker/ folder (a before/after
comparison: run the same command with and without it, alternating)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from dialog_worker.bench.counting import ADMIN_COMMANDS, command_calls
from dialog_worker.bench.report import progress
from dialog_worker.bench.target import Target

# Longest wait for every step to be in flight.
FILL_DEADLINE_S = 120.0


def default_step_ms(args: argparse.Namespace) -> float:
    """Steps outlast the fill and the measurement."""
    return (float(args.duration) + 60.0) * 1000


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def _in_flight(target: Target) -> float:
    total = 0.0
    for w in target.procs:
        sample = await anyio.to_thread.run_sync(w.metrics)
        total += sample.get("dialog_in_flight", 0.0)
    return total


async def _used_memory(target: Target) -> int:
    return int((await target.redis.info("memory"))["used_memory"])


async def hold_run(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    n, duration = int(args.sessions), float(args.duration)
    rss_before = sum(_rss_bytes(w.pid) for w in target.procs)
    memory_before = await _used_memory(target)
    run = target.run
    await target.send([(f"hold-{run}-{i}", "nama saya Budi") for i in range(n)])
    filled_at = time.monotonic() + FILL_DEADLINE_S
    while (held := await _in_flight(target)) < n:
        if time.monotonic() > filled_at:
            raise RuntimeError(f"only {held:.0f} of {n} steps in flight after {FILL_DEADLINE_S}s")
        await anyio.sleep(0.2)  # a poll of the workers' gauges: nothing to wait on
    await anyio.sleep(1.0)  # the fill's own commits and intake calls are over
    before, t0 = await command_calls(target.redis), time.monotonic()
    await anyio.sleep(duration)
    after, t1 = await command_calls(target.redis), time.monotonic()
    held_end = await _in_flight(target)
    memory = await _used_memory(target)
    rss = sum(_rss_bytes(w.pid) for w in target.procs)
    deltas = {
        k: v - before.get(k, 0)
        for k, v in after.items()
        if k not in ADMIN_COMMANDS and v - before.get(k, 0) > 0
    }
    seconds = t1 - t0
    total = sum(deltas.values())
    result = {
        "mode": "hold",
        "system": target.system,
        "worker_path": getattr(args, "worker_path", None) or "",
        "steps_in_flight": n,
        "steps_in_flight_at_end": int(held_end),
        "workers": len(target.procs),
        "seconds": round(seconds, 2),
        "commands": total,
        "commands_per_s": round(total / seconds, 1),
        "commands_per_s_per_step": round(total / seconds / n, 4),
        "by_command": dict(sorted(deltas.items(), key=lambda kv: -kv[1])),
        "redis_memory_per_step_bytes": round((memory - memory_before) / n),
        "worker_rss_per_step_bytes": round((rss - rss_before) / n),
        "offered_rate": 0,
        "violations": 0,
    }
    progress(
        f"hold: {n} steps in flight for {seconds:.1f}s: {total} Redis commands, "
        f"{result['commands_per_s_per_step']} /s/step; Redis memory "
        f"{result['redis_memory_per_step_bytes']} B/step, worker RSS "
        f"{result['worker_rss_per_step_bytes']} B/step"
    )
    return result
