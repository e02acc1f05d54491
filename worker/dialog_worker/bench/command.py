"""`dialog-worker bench`: a load generator that measures throughput, latency, Redis cost and
correctness of dialog-worker, optionally side by side with the comparison workers of bench/.

One JSON object on stdout; progress and a human summary on stderr. Exit 0, or 1 when any run
of dialog-worker ("ours") breaks a guarantee (lost, duplicated, out of order, missing or extra
reply, not applied), or 2 for a usage problem (e.g. --plot without matplotlib).

Workload. N sessions x B messages ("nama saya Budi", then "pesan 2".."pesan B"), sent as plain
XADDs in pipelines on one connection, so a session's messages are enqueued in order.
`--mode burst` sends everything at once while the workers run, sessions in groups of
`--senders` with a group's messages interleaved (a session's consecutive messages are about
`--senders` entries apart, as `dialog-worker verify` sends them). `--rate R --duration S` sends
R messages/s for S seconds, round robin over the N sessions, in ticks of 2 ms.

Latency. Primary: enqueue to reply as the bench client sees it (perf_counter just before the
send pipeline is written, to the moment the bench's XREAD BLOCK on the reply stream returns the
reply). It includes the bench's own scheduling, the same for every system. Secondary
(`latency_redis_ms`): reply entry ID time minus inbound entry ID time, both Redis clock, 1 ms
resolution.

Redis cost. INFO commandstats deltas over the run. Top-level commands and round trips of the
worker processes are counted inside them: spawned workers run under a counting shim
(`python -m dialog_worker.bench _count MODULE ...`, which wraps redis-py's pack_command and
send_packed_command) and the bench counts its own the same way, so commands inside scripts =
all commands - top-level commands (a producer's XADD runs nothing inside). CPU: INFO cpu
delta for Redis, /proc/<pid>/stat utime+stime for the spawned workers, getrusage for the bench.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from dialog_worker.bench import hold, limits, namespace, tenants
from dialog_worker.bench.counting import COUNTER
from dialog_worker.bench.machine import machine_info
from dialog_worker.bench.redis_server import EmbeddedRedis
from dialog_worker.bench.report import SYSTEMS, line, plot, progress, summary
from dialog_worker.bench.run import Run
from dialog_worker.bench.spawn import source_root
from dialog_worker.bench.target import Target
from dialog_worker.config import Settings
from dialog_worker.errors import ValidationError
from dialog_worker.store.connection import connect

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def add_parser(sub: Any) -> None:
    """Register `dialog-worker bench` on the CLI's subparsers."""
    p = sub.add_parser(
        "bench",
        help="load generator: throughput, latency, Redis cost, correctness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sessions", type=int, default=500, help="sessions (default 500)")
    p.add_argument("--burst", type=int, default=10, help="messages per session (default 10)")
    p.add_argument(
        "--mode",
        choices=["burst", "rate", "limits", "tenants", "merge", "adapters", "hold"],
        help="burst: all at once (default); rate: --rate msg/s for --duration s; limits: "
        "workers against a fake model provider's quota for --duration s (bench/limits.py); "
        "tenants: a tenant's flood and another's lone messages, weights, a tenant alone; "
        "merge: bursts merged by the window (bench/tenants.py); adapters: an agent framework "
        "adapter's cost per turn against a hand-written engine, and the state after 50 turns "
        "(bench/adapters.py); hold: --sessions steps held in flight for --duration s, Redis "
        "commands per second per step and memory per step (bench/hold.py)",
    )
    p.add_argument("--rate", type=float, help="fixed arrival rate, messages/s (implies rate)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of a rate run")
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes to spawn per system (0: measure running workers, ours only; "
        "needs --namespace naming their stream)",
    )
    p.add_argument(
        "--namespace",
        metavar="STREAM",
        help=f"inbound stream to run in; group, replies, DLQ and key prefix derive from it "
        f"(default {namespace.DEFAULT!r}, or {namespace.DEFAULT}-<system> per compared "
        "system; a stream that a consumer group reads is refused unless named here)",
    )
    p.add_argument("--concurrency", type=int, help="DIALOG_CONCURRENCY of spawned workers")
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="dialog-worker's engine waits this long per message (async), like a remote model "
        "call (ours only; default 0: the built-in rules alone)",
    )
    p.add_argument(
        "--worker-path",
        metavar="CHECKOUT",
        help="ours: spawned workers import dialog_worker from CHECKOUT/worker instead of this "
        "package (another version, for a before/after comparison)",
    )
    p.add_argument(
        "--redis",
        default="url",
        help="'url' (REDIS_URL, default) or 'embedded' (a redis-server of its own)",
    )
    p.add_argument(
        "--compare",
        default="ours",
        help=f"comma-separated systems, run one after the other: {','.join(SYSTEMS)}",
    )
    p.add_argument(
        "--latency-sweep",
        action="store_true",
        help="a max-throughput burst, then fixed-rate runs at --loads of that maximum",
    )
    p.add_argument("--loads", default="0.5,0.8", help="fractions of the max for the sweep")
    p.add_argument(
        "--max-rate",
        type=float,
        help="known maximum (msg/s) for --latency-sweep / --memory-run (skips the max run)",
    )
    p.add_argument(
        "--memory-run",
        type=float,
        metavar="SECONDS",
        help="fixed rate at 50%% of the max for SECONDS, sampling worker RSS",
    )
    p.add_argument("--plot", metavar="FILE.png", help="latency percentiles vs offered load")
    p.add_argument(
        "--senders",
        type=int,
        default=1,
        help="sessions whose bursts are interleaved (1: each burst back to back)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="drain deadline per run (s)")
    p.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="/metrics of running workers to scrape with --workers 0 (repeatable)",
    )
    p.add_argument(
        "--warmup", type=int, default=200, help="unreported warm-up messages per system (0: none)"
    )
    p.add_argument(
        "--keep-data", action="store_true", help="keep what the bench wrote (default: removed)"
    )
    limits.add_arguments(p)
    tenants.add_arguments(p)
    p.add_argument(
        "--msg-ids",
        action="store_true",
        help="ours: every message carries a msg_id, as DialogClient.send gives it (default: a "
        "plain XADD without one, the entry id standing in)",
    )


def _validate(args: argparse.Namespace) -> list[str]:
    systems = [s.strip() for s in args.compare.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValidationError(f"--compare: unknown system(s) {unknown}; choose from {SYSTEMS}")
    if args.sessions < 1 or args.burst < 1 or args.senders < 1:
        raise ValidationError("--sessions, --burst and --senders must be >= 1")
    if args.workers < 0:
        raise ValidationError("--workers must be >= 0")
    if args.workers == 0 and systems != ["ours"]:
        raise ValidationError("--workers 0 (running workers) works only with --compare ours")
    if args.workers == 0 and args.namespace is None:
        raise ValidationError(
            "--workers 0 measures running workers: name their stream with --namespace STREAM "
            "(their reply consumers see the bench's replies until the bench removes them)"
        )
    if args.rate is not None and args.rate <= 0:
        raise ValidationError("--rate must be positive")
    if args.mode == "rate" and args.rate is None:
        raise ValidationError("--mode rate needs --rate")
    if args.mode == "hold":
        if systems != ["ours"] or args.workers < 1:
            raise ValidationError("--mode hold measures spawned workers of ours only")
        args.warmup = 0  # a warm-up would wait for steps that outlast the run
        args.step_ms = args.step_ms or hold.default_step_ms(args)
        args.concurrency = args.concurrency or -(-args.sessions // args.workers) + 8
    if args.redis not in ("url", "embedded"):
        raise ValidationError("--redis must be 'url' or 'embedded'")
    if args.memory_run is not None and args.workers == 0:
        raise ValidationError("--memory-run samples spawned workers: needs --workers >= 1")
    try:
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        raise ValidationError("--loads: comma-separated fractions, e.g. 0.5,0.8") from None
    if not loads or any(not 0 < x <= 1.5 for x in loads):
        raise ValidationError("--loads: fractions within (0, 1.5]")
    args.loads_list = loads
    others = [s for s in systems if s != "ours"]
    if others and source_root() is None:
        raise ValidationError(
            f"--compare {','.join(others)}: the comparison workers live in the bench/ folder of "
            "a source checkout, which the installed package does not ship; run the bench from "
            "a clone of the repository (pip install -e .)"
        )
    if "peer" in systems:
        try:
            importlib.import_module("taskiq_redis")
        except ImportError:
            raise ValidationError(
                "--compare peer needs taskiq-redis: pip install -r bench/requirements.txt"
            ) from None
    return systems


def _check_plot(path: str | None) -> bool:
    if not path:
        return True
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        print(
            "dialog-worker: --plot needs matplotlib, which is not installed "
            "(pip install matplotlib)",
            file=sys.stderr,
        )
        return False
    return True


async def bench_command(settings: Settings, args: argparse.Namespace) -> int:
    if args.mode == "limits":
        return await _limits_command(settings, args)
    if args.mode in ("tenants", "merge"):
        return await _tenants_command(settings, args)
    if args.mode == "adapters":
        return await _adapters_command(settings, args)
    systems = _validate(args)
    if not _check_plot(args.plot):
        return EXIT_USAGE
    if settings.redis_mode != "standalone" or settings.shards != 1:
        raise ValidationError("bench supports the plain (standalone, one shard) layout only")
    if threading.current_thread() is threading.main_thread():
        # Stopped with SIGTERM (`timeout`, a CI runner, `kill`): exit through the cleanup
        # below, which stops the workers and the embedded redis-server, instead of leaving
        # them running.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    COUNTER.install()
    embedded: EmbeddedRedis | None = None
    if args.redis == "embedded":
        embedded = await anyio.to_thread.run_sync(EmbeddedRedis)
        settings = settings.replace(redis_url=embedded.url)
        progress(f"embedded redis-server on 127.0.0.1:{embedded.port}")
    run_id = uuid.uuid4().hex[:6]
    report: dict[str, Any] = {
        "bench": 1,
        "machine": machine_info(),
        "config": {
            "sessions": args.sessions,
            "burst": args.burst,
            "workers": args.workers,
            "concurrency": args.concurrency or settings.concurrency,
            "redis": "embedded" if embedded else settings.redacted_url(),
            "systems": systems,
            "latency": "client: send pipeline written -> reply read by XREAD (ms)",
        },
        "runs": [],
    }
    try:
        probe = connect(settings, 2)
        info = await probe.info("server")
        report["machine"]["redis_version"] = info.get("redis_version")
        await probe.aclose()
        reference_max: float | None = args.max_rate
        for system in systems:
            try:
                runs, reference_max = await _bench_system(
                    system, settings, args, run_id, len(systems) > 1, reference_max, report
                )
            except (RuntimeError, OSError, ImportError) as exc:
                if system == "ours":
                    raise
                progress(f"{system}: skipped: {exc}")
                report.setdefault("skipped", {})[system] = str(exc)[-2000:]
                continue
            report["runs"] += runs
    finally:
        if embedded is not None:
            await anyio.to_thread.run_sync(embedded.stop)
    ours_bad = sum(r["violations"] for r in report["runs"] if r["system"] == "ours")
    report["violations"] = {
        s: sum(r["violations"] for r in report["runs"] if r["system"] == s) for s in systems
    }
    report["ok"] = ours_bad == 0
    if args.plot:
        plot(report["runs"], args.plot)
        report["plot"] = args.plot
    summary(report)
    print(json.dumps(report, ensure_ascii=False), flush=True)
    return EXIT_OK if ours_bad == 0 else EXIT_FAILURE


async def _on_own_redis(
    settings: Settings,
    args: argparse.Namespace,
    bench: Callable[[Settings, argparse.Namespace], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """Run a bench mode that starts its own workers (tenants, merge, limits): the plain layout
    only, SIGTERM stops its workers too, and with --redis embedded a redis-server of its own."""
    if settings.redis_mode != "standalone" or settings.shards != 1:
        raise ValidationError("bench supports the plain (standalone, one shard) layout only")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler=_exit_on_sigterm)  # its workers stop too
    embedded: EmbeddedRedis | None = None
    if args.redis == "embedded":
        embedded = await anyio.to_thread.run_sync(EmbeddedRedis)
        settings = settings.replace(redis_url=embedded.url)
    try:
        return await bench(settings, args)
    finally:
        if embedded is not None:
            await anyio.to_thread.run_sync(embedded.stop)


async def _tenants_command(settings: Settings, args: argparse.Namespace) -> int:
    bench = tenants.tenants_bench if args.mode == "tenants" else tenants.merge_bench
    report = await _on_own_redis(settings, args, bench)
    print(json.dumps(report, ensure_ascii=False), flush=True)
    return EXIT_OK if report.get("ok", True) else EXIT_FAILURE


async def _adapters_command(settings: Settings, args: argparse.Namespace) -> int:
    from dialog_worker.bench import adapters  # imports no framework: its workers do

    report = await _on_own_redis(settings, args, adapters.adapters_bench)
    progress(json.dumps({"turns": report["turns"], "state": report["state_bytes_after_50_turns"]}))
    print(json.dumps(report, ensure_ascii=False), flush=True)
    return EXIT_OK if report["ok"] else EXIT_FAILURE


async def _limits_command(settings: Settings, args: argparse.Namespace) -> int:
    if args.tenants:
        from dialog_worker.bench import fair_turns

        report = await _on_own_redis(settings, args, fair_turns.fair_turns_bench)
        progress(json.dumps({k: report[k] for k in ("flood", "weights", "alone", "ok")}))
        print(json.dumps(report, ensure_ascii=False), flush=True)
        return EXIT_OK if report["ok"] else EXIT_FAILURE
    report = await _on_own_redis(settings, args, limits.limits_bench)
    progress(json.dumps({k: report[k] for k in ("provider", "correctness", "budget", "ok")}))
    print(json.dumps(report, ensure_ascii=False), flush=True)
    return EXIT_OK if report["ok"] else EXIT_FAILURE


async def _bench_system(
    system: str,
    settings: Settings,
    args: argparse.Namespace,
    run_id: str,
    several: bool,
    reference_max: float | None,
    report: dict[str, Any],
) -> tuple[list[dict[str, Any]], float | None]:
    base = args.namespace or namespace.DEFAULT
    settings = namespace.settings_for(settings, base, system, several)
    target = Target(system, settings, args, run_id)
    runs: list[dict[str, Any]] = []

    async def one(phase: str, mode: str, rate: float = 0.0, duration: float = 0.0) -> float:
        label = f"{system}/{phase}" + (f" at {rate:.0f} msg/s for {duration:g}s" if rate else "")
        progress(f"{label} ...")
        result = await Run(target, phase, args).execute(
            mode, args.sessions, args.burst, rate, duration
        )
        runs.append(result)
        progress(line(result))
        return float(result["throughput_msg_s"] or 0.0)

    ns: namespace.Namespace | None = None
    try:
        ns = await namespace.claim(target.redis, settings, explicit=args.namespace is not None)
        if ns.groups:
            progress(f"{system}: running in {ns.keys.stream}, read by group(s) {ns.groups}")
        if args.workers:
            progress(f"{system}: starting {args.workers} worker process(es)")
        await target.workers.start(args.workers)
        await target.producer.start()
        if args.warmup:
            # Not reported: fills connection pools, loads scripts, warms caches.
            progress(f"{system}: warm-up ({args.warmup} messages)")
            await Run(target, "warmup", args).execute(
                "burst", max(1, args.warmup // 5), min(5, args.warmup)
            )
        rate_mode = args.mode == "rate" or (args.rate is not None and args.mode != "burst")
        if args.memory_run is not None:
            maximum = reference_max or await one("max", "burst")
            reference_max = reference_max or maximum
            await one("memory", "rate", 0.5 * reference_max, args.memory_run)
        elif args.latency_sweep:
            measured = await one("max", "burst")
            reference_max = reference_max or measured
            for load in args.loads_list:
                await one(f"load{int(load * 100)}", "rate", load * reference_max, args.duration)
        elif args.mode == "hold":
            progress(f"{system}: holding {args.sessions} steps for {args.duration:g}s")
            runs.append(await hold.hold_run(target, args))
        elif rate_mode:
            await one("rate", "rate", float(args.rate), args.duration)
        else:
            await one("burst", "burst")
        await target.producer.close()
    finally:
        target.workers.stop()
        where = {"stream": settings.stream, "kept": bool(args.keep_data)}
        if ns is not None and not args.keep_data:
            consumers = [w.name for w in target.procs]
            removed = await namespace.clean(target.redis, ns, f"bench-{run_id}-", consumers)
            where.update(own=ns.own, removed=removed)
        report.setdefault("namespaces", {})[system] = where
        await target.close()
    for r in runs:
        r["reference_max_msg_s"] = reference_max
        if r["offered_rate"] and reference_max:
            r["load_fraction"] = round(r["offered_rate"] / reference_max, 3)
    return runs, reference_max
