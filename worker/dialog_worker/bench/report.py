"""What the bench tells a human: progress and the summary on stderr, the latency plot."""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from typing import Any

SYSTEMS = ("ours", "naive", "seed", "peer", "bare")


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def line(r: dict[str, Any]) -> str:
    if r.get("mode") == "hold":  # bench/hold.py
        return (
            f"{r['system']}/hold: {r['steps_in_flight']} steps in flight for {r['seconds']}s, "
            f"{r['commands_per_s_per_step']} Redis commands/s/step, "
            f"Redis memory {r['redis_memory_per_step_bytes']} B/step, "
            f"worker RSS {r['worker_rss_per_step_bytes']} B/step"
        )
    lat, c = r["latency_ms"], r["correctness"]
    red = r["redis"]
    rt = red.get("worker_round_trips_per_msg")
    return (
        f"{r['system']}/{r['phase']}: {r['messages']} msgs, "
        f"{r['throughput_msg_s']} msg/s, drain {r['drain_s']}s, "
        f"latency p50/p95/p99 {lat['p50']}/{lat['p95']}/{lat['p99']} ms, "
        f"requeues/msg {r['requeues']['per_msg']}, "
        f"redis cmds/msg {red['commands_per_msg']} (worker round trips/msg {rt}), "
        f"cpu ms/msg redis {r['cpu']['redis_ms_per_msg']} workers {r['cpu']['workers_ms_per_msg']}"
        f" | lost {c['lost']} dup {c['duplicated']} out-of-order {c['out_of_order']} "
        f"missing {c['missing_replies']} dead-lettered {c['dead_lettered']}"
    )


def summary(report: dict[str, Any]) -> None:
    print("\n== dialog-worker bench ==", file=sys.stderr)
    m = report["machine"]
    print(
        f"{m['nproc']} cpu ({m['cpu_model']}), {m['mem_total_gib']} GiB, Python {m['python']}, "
        f"redis {m.get('redis_version')}",
        file=sys.stderr,
    )
    for r in report["runs"]:
        print("  " + line(r), file=sys.stderr)
    print(f"violations by system: {report['violations']}", file=sys.stderr)
    print("OK" if report["ok"] else "FAILED: dialog-worker broke a guarantee", file=sys.stderr)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Latency percentiles (client-observed) against offered load, one colour per system."""
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"p50": ":", "p95": "--", "p99": "-"}
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        if r["mode"] == "rate" and r["offered_rate"]:
            series[r["system"]].append(r)
    colours = dict(zip(SYSTEMS, ["C0", "C3", "C1", "C2", "C7"], strict=True))
    for system, rs in series.items():
        rs.sort(key=lambda r: r["offered_rate"])
        xs = [r["offered_rate"] for r in rs]
        for pct, style in styles.items():
            ys = [r["latency_ms"][pct] for r in rs]
            ax.plot(xs, ys, style, marker="o", color=colours[system], label=f"{system} {pct}")
    ax.set_xlabel("offered load (messages/s)")
    ax.set_ylabel("enqueue -> reply latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("dialog-worker bench: latency vs offered load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
