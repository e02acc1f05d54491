"""What a run cost, from two snapshots: re-queues (by reason), Redis commands and round trips
(split between producer, worker top level and inside scripts), and CPU of Redis, workers and
the bench, all per message."""

from __future__ import annotations

from collections import Counter
from typing import Any

from dialog_worker.bench.counting import ADMIN_COMMANDS
from dialog_worker.bench.measure import Snapshot


def cpu(a: Snapshot, b: Snapshot, n: int) -> dict[str, Any]:
    wall = b.t - a.t
    workers_s = sum(b.workers_cpu_s[p] - a.workers_cpu_s.get(p, 0) for p in b.workers_cpu_s)
    return {
        "window_s": round(wall, 3),
        "redis_ms_per_msg": round((b.redis_cpu_s - a.redis_cpu_s) * 1000 / n, 4),
        "workers_ms_per_msg": round(workers_s * 1000 / n, 4) if b.workers_cpu_s else None,
        "bench_ms_per_msg": round((b.bench_cpu_s - a.bench_cpu_s) * 1000 / n, 4),
        "redis_core_utilisation": round((b.redis_cpu_s - a.redis_cpu_s) / wall, 3),
        "workers_core_utilisation": round(workers_s / wall, 3) if b.workers_cpu_s else None,
    }


def requeues(a: Snapshot, b: Snapshot, n: int) -> dict[str, Any]:
    by_reason: Counter[str] = Counter()
    extra: Counter[str] = Counter()
    for name, after in b.metrics.items():
        before = a.metrics.get(name, {})
        for key, value in after.items():
            delta = value - before.get(key, 0.0)
            if key.startswith("dialog_retries_total{"):
                by_reason[key.split('"')[1]] += int(delta)
            elif key in ("dialog_handoffs_total", "dialog_fencing_rejections_total"):
                extra[key.removeprefix("dialog_").removesuffix("_total")] += int(delta)
    for name, after in b.stats.items():
        before = a.stats.get(name, {})
        for key, value in after.items():
            if key.startswith("requeued_"):
                by_reason[key.removeprefix("requeued_")] += int(value) - int(before.get(key, 0))
    total = sum(by_reason.values())
    return {
        "total": total,
        "per_msg": round(total / n, 4),
        "by_reason_per_msg": {k: round(v / n, 4) for k, v in sorted(by_reason.items())},
        "by_reason": dict(sorted(by_reason.items())),
        **dict(extra),
    }


def redis_cost(a: Snapshot, b: Snapshot, n: int, producer_inside: float) -> dict[str, Any]:
    """`producer_inside`: commands a producer's script ran inside Redis in the window (0 with
    plain XADDs; kept for producers that do run scripts)."""
    delta = {
        k: v - a.calls.get(k, 0)
        for k, v in b.calls.items()
        if v - a.calls.get(k, 0) and k not in ADMIN_COMMANDS
    }
    total = sum(delta.values())
    script_calls = sum(delta.get(k, 0) for k in ("evalsha", "eval", "fcall"))
    bench_top = sum(
        v - a.bench["by_name"].get(k, 0)
        for k, v in b.bench["by_name"].items()
        if k not in ADMIN_COMMANDS
    )
    bench_scripts = sum(
        b.bench["by_name"].get(k, 0) - a.bench["by_name"].get(k, 0) for k in ("evalsha", "eval")
    )
    out: dict[str, Any] = {
        "commands_per_msg": round(total / n, 3),
        "by_command_per_msg": {
            k: round(v / n, 3) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])[:14]
        },
        "producer_commands_per_msg": round((bench_top + producer_inside) / n, 3),
    }
    counted = bool(b.counts) and all(b.counts.values())
    if counted:
        w_rt = sum(
            c.get("round_trips", 0) - a.counts.get(k, {}).get("round_trips", 0)
            for k, c in b.counts.items()
        )
        w_by: Counter[str] = Counter()
        for k, c in b.counts.items():
            before = a.counts.get(k, {}).get("by_name", {})
            for cmd, v in c.get("by_name", {}).items():
                if cmd not in ADMIN_COMMANDS:
                    w_by[cmd] += v - before.get(cmd, 0)
        w_top = sum(w_by.values())
        w_scripts = sum(w_by.get(k, 0) for k in ("evalsha", "eval"))
        w_inside = total - bench_top - producer_inside - w_top
        out.update(
            {
                "worker_round_trips_per_msg": round(w_rt / n, 3),
                "worker_top_level_commands_per_msg": round(w_top / n, 3),
                "worker_script_calls_per_msg": round(w_scripts / n, 3),
                "worker_commands_inside_scripts_per_msg": round(max(0.0, w_inside) / n, 3),
                "worker_commands_per_msg": round((w_top + max(0.0, w_inside)) / n, 3),
                "worker_top_level_by_command_per_msg": {
                    k: round(v / n, 3) for k, v in w_by.most_common(10) if v
                },
            }
        )
    else:
        out["worker_script_calls_per_msg"] = round((script_calls - bench_scripts) / n, 3)
    return out
