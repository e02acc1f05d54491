"""Resume to first delta: how long after `DialogClient.resume` a reader of the answer gets the
first piece of text of the run that goes on, against real worker processes and a redis-server
of its own (not a test: the figure for docs/benchmarks.md).

    .venv/bin/python tests/integration/measure_resume_latency.py [--sessions 200] [--workers 2]

Each session's message (tests/support/journal_engines.py, text "stream") emits a piece of
text and an event, then waits for a person; the script reads its answer up to the prompt, then
times resume() -> the first delta of the next attempt, read through `DialogClient.stream` from
the prompt's cursor. Sessions are resumed one at a time, with the pool otherwise idle (the
case the resumers' kick stream is for: nothing else wakes them). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(SUPPORT))
sys.path.insert(0, str(SUPPORT.parent))

from conftest import worker_env  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from worker_procs import WorkerPool  # noqa: E402

from dialog_worker import DialogClient  # noqa: E402
from dialog_worker.config import load_settings  # noqa: E402


async def one(client: DialogClient, sid: str) -> float:
    cursor = None
    async for event in client.ask_stream(sid, "stream", msg_id="m1", timeout=30):
        if event.kind == "event" and event.event_kind == "awaiting":
            cursor = event.cursor
            iid = event.data["interrupt_id"]
            break
    assert cursor is not None
    await asyncio.sleep(0.3)  # the pool goes idle again: resumers block on the kick stream
    started = time.perf_counter()
    result = await client.resume(sid, iid, "yes")
    assert result.status == "resumed", result
    async for event in client.stream(sid, "m1", after=cursor, timeout=30):
        if event.kind == "delta" and event.attempt > 1:
            return time.perf_counter() - started
    raise AssertionError(f"{sid}: no delta after the resume")


async def measure(url: str, sessions: int) -> list[float]:
    settings = load_settings(environ={"REDIS_URL": url})
    async with DialogClient(settings=settings) as client:
        return [await one(client, f"lat-{i}") for i in range(sessions)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        pool = WorkerPool(worker_env(server.url), Path(tmp))
        try:
            pool.start(
                args.workers,
                DIALOG_ENGINE="journal_engines:Agent",
                JOURNAL_CALLS=str(Path(tmp) / "calls.txt"),
            )
            took = asyncio.run(measure(server.url, args.sessions))
        finally:
            pool.stop_all()
            server.stop()
    ms = sorted(t * 1000 for t in took)
    print(
        json.dumps(
            {
                "sessions": len(ms),
                "workers": args.workers,
                "resume_to_first_delta_ms": {
                    "p50": round(statistics.median(ms), 1),
                    "p99": round(ms[max(0, round(0.99 * len(ms)) - 1)], 1),
                    "max": round(ms[-1], 1),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
