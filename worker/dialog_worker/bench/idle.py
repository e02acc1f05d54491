"""Idle cost and a lone message on an idle pool:

    python -m dialog_worker.bench.idle [--workers 8] [--seconds 10] [--messages 100]

Starts a redis-server of its own and N `dialog-worker run` processes, waits until all are
ready, then measures over --seconds: Redis commands per second (``INFO commandstats``, every
command, those run inside scripts included) and the workers' CPU (``/proc``). Then it sends
--messages lone messages, one at a time with a pause in between, each to a new session, and
times each from just before its ``XADD`` to the moment a blocked ``XREAD`` on the reply
stream returns its reply event; the script calls and blocking reads per lone message show how
many workers each append woke. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from redis.asyncio import Redis

from dialog_worker.bench.redis_server import EmbeddedRedis
from dialog_worker.bench.spawn import Workers
from dialog_worker.bench.stats import summarize
from dialog_worker.config import Settings


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _commands(stats: dict[str, Any]) -> dict[str, int]:
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name.startswith("cmdstat_")
    }


async def measure(n_workers: int, seconds: float, messages: int) -> dict[str, Any]:
    embedded = await anyio.to_thread.run_sync(EmbeddedRedis)
    settings = Settings().replace(redis_url=embedded.url, stream="idle")
    redis = Redis.from_url(embedded.url, decode_responses=True, socket_timeout=10)
    with tempfile.TemporaryDirectory(prefix="dialog-idle-") as tmp:
        workers = Workers("ours", settings, "idle", Path(tmp), None)
        try:
            await workers.start(n_workers)
            await anyio.sleep(2)  # first sampler / reclaim rounds after start-up
            pids = [w.pid for w in workers.procs]
            cpu0 = sum(_cpu_s(p) for p in pids)
            before = _commands(await redis.info("commandstats"))
            started = time.monotonic()
            await anyio.sleep(seconds)
            after = _commands(await redis.info("commandstats"))
            elapsed = time.monotonic() - started
            cpu1 = sum(_cpu_s(p) for p in pids)
            delta = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
            delta.pop("info", None)
            total = sum(delta.values())
            before = _commands(await redis.info("commandstats"))
            lat = await _lone_messages(redis, settings, messages)
            after = _commands(await redis.info("commandstats"))
            lone = {
                k: round((v - before.get(k, 0)) / max(1, messages), 2)
                for k, v in sorted(after.items())
                if v - before.get(k, 0) and k in ("evalsha", "xread", "xreadgroup", "xadd")
            }
        finally:
            if os.environ.get("IDLE_KEEP_LOGS"):
                for w in workers.procs:
                    print(w.log_file.read_text()[-3000:])
            workers.stop()
            await redis.aclose()
            await anyio.to_thread.run_sync(embedded.stop)
    return {
        "workers": n_workers,
        "seconds": round(elapsed, 2),
        "redis_commands_per_s": round(total / elapsed, 2),
        "redis_commands_per_s_per_worker": round(total / elapsed / n_workers, 2),
        "by_command_per_s": {k: round(v / elapsed, 2) for k, v in sorted(delta.items())},
        "worker_cpu_pct_of_core_each": round(100 * (cpu1 - cpu0) / elapsed / n_workers, 3),
        "lone_message_ms": lat,
        # Per lone message: script calls (intake, commit), blocking reads that returned.
        "lone_message_commands": lone,
    }


async def _lone_messages(redis: Redis, settings: Settings, n: int) -> dict[str, Any]:
    replies = settings.reply_stream
    found = await redis.xrevrange(replies, count=1)
    last = str(found[0][0]) if found else "$"
    samples: list[float] = []
    for i in range(n):
        await anyio.sleep(0.05)  # idle again: every worker blocked
        got: list[Any] = []

        async def wait_reply(since: str, into: list[Any]) -> None:
            into.extend(await redis.xread({replies: since}, count=1, block=3000))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_reply, last, got)
            await anyio.sleep(0.01)  # the XREAD is blocked before the message is sent
            t0 = time.perf_counter()
            await redis.xadd(settings.stream, {"session_id": f"lone-{i}", "text": "halo"})
        t1 = time.perf_counter()
        if got:
            last = got[0][1][-1][0]
            samples.append((t1 - t0) * 1000)
    return {"n": len(samples), **summarize(samples)}


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m dialog_worker.bench.idle", description=__doc__)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--messages", type=int, default=100)
    a = p.parse_args()
    # Stopped with SIGTERM: exit through measure's cleanup (workers, redis-server) too.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    print(json.dumps(anyio.run(measure, a.workers, a.seconds, a.messages)), flush=True)


if __name__ == "__main__":
    main()
