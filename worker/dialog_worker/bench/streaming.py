"""Streamed answers under load: N answers at once, each a fake model's 200 tokens at 50 tokens
per second, on real `dialog-worker run` processes and a redis-server of its own.

    python -m dialog_worker.bench.streaming --answers 100 --workers 2

Prints one JSON line: Redis commands per token (every command the server ran during the run,
from INFO commandstats, divided by the tokens streamed), emit-to-client latency of the tokens
(p50/p99/max: the fake model writes its emit time into each token, the reader compares it
with its own clock on arrival; same host), Redis memory per live answer (peak used_memory
over the idle baseline, divided by N) and per finished answer (its partial stream, kept until
DIALOG_PARTIAL_TTL_S), the CPU seconds of this reading process, redis-server and each worker
while the answers streamed, and the answers' correctness (each reader's text equals the
reply).

With ``--plain M``: the throughput of messages that stream nothing (bursts of M plain XADDs
over ``--plain-sessions`` sessions, answered at once by the same engine, one burst after the
other until they took ``--plain-min-s`` together), first on the idle workers, then again
``--plain-after-s`` into the streaming run, while every answer is still being written:
``plain_ratio`` is the second throughput over the first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar, cast

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.engine.emit import emit

T = TypeVar("T")


class FakeModel:
    """``<tokens> <per second>``: emits that many tokens at that rate, each ``<emit time in
    microseconds> ``, and returns them all."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        count, rate = (float(x) for x in message["text"].split())
        tokens = []
        started = time.monotonic()
        for i in range(int(count)):
            # Paced against the start, so a late wake-up does not slow the whole answer.
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            token = f"{time.time_ns() // 1000} "
            emit(token)
            tokens.append(token)
        return {**state, "step": "ANSWERED"}, "".join(tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _read(client: DialogClient, i: int, tokens: int, rate: int) -> tuple[list[float], bool]:
    """One reader: latencies (ms) of the tokens it received, and whether its text is the
    committed reply exactly once."""
    latencies: list[float] = []
    shown = ""
    final = ""
    async for event in client.ask_stream(f"bench-{i}", f"{tokens} {rate}", timeout=120):
        now_us = time.time_ns() // 1000
        if event.kind == "delta":
            for token in event.text.split():
                latencies.append((now_us - int(token)) / 1000)
            shown += event.text
        elif event.kind == "reset":
            shown = ""
        elif event.kind == "resync":
            shown = event.text
        else:
            final = event.text
    return latencies, shown == final and len(final.split()) == tokens


async def _plain(
    client: DialogClient, count: int, sessions: int, label: str, after_s: float, min_s: float
) -> dict[str, float]:
    """Bursts of ``count`` messages that stream nothing (`_plain_burst`), one after the other
    until they took ``min_s`` together (a single burst of a thousand took 0.2 s: too short to
    tell throughput from noise): messages per second over the bursts' time."""
    await asyncio.sleep(after_s)
    messages, bursts, seconds = 0, 0, 0.0
    while bursts == 0 or seconds < min_s:
        seconds += await _plain_burst(client, count, sessions, f"{label}{bursts}")
        messages, bursts = messages + count, bursts + 1
    return {
        "messages": messages,
        "bursts": bursts,
        "seconds": round(seconds, 3),
        "per_s": round(messages / seconds, 1),
    }


async def _plain_burst(client: DialogClient, count: int, sessions: int, label: str) -> float:
    """``count`` messages that stream nothing, appended at once (one pipeline of plain XADDs,
    as producers do), on sessions of their own: the time from the append to the last one's
    reply event (its ``produced_at``, the worker's clock on this same host: the bench's own
    loop, busy with the readers, does not count), in seconds."""
    replies = client.keys.replies
    newest = cast(list[tuple[str, Any]], await client.redis.xrevrange(replies, count=1))
    last_id: str = newest[0][0] if newest else "0-0"
    prefix = f"plain-{label}-"
    started = time.monotonic()
    sent_at_ms = time.time() * 1000
    async with client.redis.pipeline(transaction=False) as pipe:
        for i in range(count):
            pipe.xadd(
                client.keys.stream,
                {"session_id": f"{prefix}{i % sessions}", "text": "0 1", "msg_id": f"{prefix}{i}"},
            )
        await pipe.execute()
    seen = 0
    last_ms = sent_at_ms
    while seen < count:
        got = cast(
            list[tuple[str, list[tuple[str, dict[str, str]]]]],
            await client.redis.xread({replies: last_id}, count=1000, block=1000),
        )
        for _, entries in got or []:
            for entry_id, fields in entries:
                last_id = entry_id
                if str(fields.get("session_id", "")).startswith(prefix):
                    seen += 1
                    last_ms = max(last_ms, float(fields.get("produced_at", 0)))
        if time.monotonic() - started > 300:
            raise TimeoutError(f"{count - seen} plain messages unanswered after 300 s")
    return max(0.001, (last_ms - sent_at_ms) / 1000)


async def _until_done(work: Awaitable[T]) -> tuple[T, float]:
    """``work``'s result and when it came (``time.monotonic()``)."""
    result = await work
    return result, time.monotonic()


def _used(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 2)


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else 0.0


def _cpu_s(pids: list[int]) -> list[float | None]:
    """CPU seconds (user + system) each process used so far, from /proc (None elsewhere)."""
    out: list[float | None] = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            out.append(None)
    return out


async def _redis_cpu_s(client: DialogClient) -> float:
    info = await client.redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _run(args: argparse.Namespace, url: str, worker_pids: list[int]) -> dict[str, Any]:
    settings = load_settings({"redis_url": url})
    # The client's default pool, as an application has: a pool as large as the answers opened
    # a thousand connections at the start (each costs redis-py about a millisecond of CPU),
    # while the first answers were already streaming.
    async with DialogClient(settings=settings) as client:
        info = await client.redis.info("memory")
        baseline = int(info["used_memory"])
        await client.redis.config_resetstat()
        peak = baseline
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, int((await client.redis.info("memory"))["used_memory"]))
                await asyncio.sleep(0.2)

        plain: dict[str, Any] = {}
        if args.plain:
            # Alone first, on idle workers, after a small burst that warms them up (their
            # first calls load scripts and fill connection pools).
            await _plain_burst(client, 200, args.plain_sessions, "warm")
            plain["alone"] = await _plain(
                client, args.plain, args.plain_sessions, "alone", 0.0, args.plain_min_s
            )
            await client.redis.config_resetstat()
        sampler = asyncio.create_task(sample())
        cpu_before = [time.process_time(), await _redis_cpu_s(client), *_cpu_s(worker_pids)]
        started = time.monotonic()
        alongside = (
            asyncio.create_task(
                _until_done(
                    _plain(
                        client,
                        args.plain,
                        args.plain_sessions,
                        "along",
                        args.plain_after_s,
                        args.plain_min_s,
                    )
                )
            )
            if args.plain
            else None
        )
        results = await asyncio.gather(
            *(_read(client, i, args.tokens, args.rate) for i in range(args.answers))
        )
        elapsed = time.monotonic() - started
        cpu_after = [time.process_time(), await _redis_cpu_s(client), *_cpu_s(worker_pids)]
        if alongside is not None:
            plain["alongside"], ended_at = await alongside
            plain["streaming_still_running"] = ended_at <= started + elapsed
        done.set()
        await sampler
        stats = await client.redis.info("commandstats")
        after = int((await client.redis.info("memory"))["used_memory"])
        stream_bytes = 0
        for i in range(args.answers):
            session = client.keys_for(f"bench-{i}").session(f"bench-{i}")
            # The msg_ids are random: find each answer's partial stream by its prefix.
            async for key in client.redis.scan_iter(match=session.partial("*"), count=1000):
                stream_bytes += int(await client.redis.memory_usage(key) or 0)
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    for own in ("info", "config|resetstat", "scan", "memory|usage"):
        calls.pop(own, None)  # the bench's own sampling
    latencies = [ms for lat, _ in results for ms in lat]
    tokens = max(1, args.answers * args.tokens)
    answers = max(1, args.answers)
    if plain:
        plain["ratio"] = round(plain["alongside"]["per_s"] / plain["alone"]["per_s"], 3)
    result = {
        "answers": args.answers,
        "tokens_per_answer": args.tokens,
        "tokens_per_s_per_answer": args.rate,
        "workers": args.workers,
        "flush_ms": args.flush_ms,
        "seconds": round(elapsed, 2),
        "correct_answers": sum(ok for _, ok in results),
        "tokens_received": len(latencies),
        # Calls clients sent (every script call, the readers' reads) and every command Redis
        # ran, those inside scripts included.
        "redis_calls_per_token": round(
            sum(calls.get(c, 0) for c in ("evalsha", "xread", "xrange")) / tokens, 3
        ),
        "redis_commands_per_token": round(sum(calls.values()) / tokens, 3),
        "redis_commands": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
        "latency_ms_p50": round(_percentile(latencies, 50), 1),
        "latency_ms_p99": round(_percentile(latencies, 99), 1),
        "latency_ms_max": round(max(latencies, default=0.0), 1),
        # CPU seconds used while the answers streamed: this reading process, redis-server,
        # each worker process.
        "cpu_s": {
            "reader": _used(cpu_before[0], cpu_after[0]),
            "redis": _used(cpu_before[1], cpu_after[1]),
            "workers": [_used(b, a) for b, a in zip(cpu_before[2:], cpu_after[2:], strict=True)],
        },
        "memory_bytes_per_live_answer": (peak - baseline) // answers,
        "memory_bytes_per_finished_answer": (after - baseline) // answers,
        "partial_stream_bytes_per_answer": stream_bytes // answers,
        # Messages that stream nothing: alone, and alongside the streamed answers.
        "plain": plain or None,
    }
    if plain:
        # The plain messages' commands and state are in these: measure them without --plain.
        for name in (
            "redis_calls_per_token",
            "redis_commands_per_token",
            "redis_commands",
            "memory_bytes_per_live_answer",
            "memory_bytes_per_finished_answer",
        ):
            result[name] = None
    return result


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=100, help="answers at once (default 100)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per answer (default 200)")
    parser.add_argument("--rate", type=int, default=50, help="tokens per second (default 50)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--flush-ms", type=int, default=40, help="DIALOG_PARTIAL_FLUSH_MS")
    parser.add_argument(
        "--plain",
        type=int,
        default=0,
        help="also measure M messages that stream nothing, alone and alongside (default 0)",
    )
    parser.add_argument(
        "--plain-sessions", type=int, default=200, help="sessions of those (default 200)"
    )
    parser.add_argument(
        "--plain-min-s",
        type=float,
        default=1.0,
        help="bursts of M one after the other until they took this long (default 1.0)",
    )
    parser.add_argument(
        "--plain-after-s",
        type=float,
        default=1.0,
        help="when the burst alongside starts, after the answers (default 1.0)",
    )
    args = parser.parse_args(argv)
    # Stopped with SIGTERM (`timeout`, a CI runner, `kill`): exit through the cleanup below,
    # which stops the workers and the redis-server, instead of leaving them running.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    binary = shutil.which("redis-server")
    if binary is None:
        print("dialog-worker: bench.streaming needs redis-server on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        redis = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                tmp,
                "--appendonly",
                "no",
                "--maxmemory-policy",
                "noeviction",
            ],
            stdout=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("DIALOG_")},
            "REDIS_URL": url,
            "DIALOG_ENGINE": "dialog_worker.bench.streaming:FakeModel",
            "DIALOG_CONCURRENCY": str(max(64, args.answers // args.workers + 16)),
            "DIALOG_PARTIAL_FLUSH_MS": str(args.flush_ms),
            "DIALOG_METRICS_PORT": "0",
            "DIALOG_LOG_LEVEL": "warning",
        }
        workers = []
        try:
            time.sleep(0.5)
            for i in range(args.workers):
                log = Path(tmp, f"worker-{i}.log").open("ab")
                workers.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "dialog_worker", "run"],
                        env={**env, "DIALOG_CONSUMER": f"bench-{i}"},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            time.sleep(2.0)  # the workers start (imports, script loads)
            result = asyncio.run(_run(args, url, [proc.pid for proc in workers]))
        finally:
            for proc in workers:
                proc.terminate()
            for proc in workers:
                proc.wait(30)
            redis.terminate()
            redis.wait(10)
    print(json.dumps(result), flush=True)
    return 0 if result["correct_answers"] == args.answers else 1


if __name__ == "__main__":
    raise SystemExit(main())
