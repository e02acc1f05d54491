"""What the comparison workers share: settings, the engine, a slot-bounded XREADGROUP loop,
the state shape of dialog-worker (read and written with orjson, as dialog-worker does), and a
counters file the bench reads.

Each worker is one asyncio process (uvloop when available), started by the bench with the
same environment as a `dialog-worker run` process (REDIS_URL, DIALOG_STREAM, DIALOG_GROUP,
DIALOG_REPLY_STREAM, DIALOG_DLQ_STREAM, DIALOG_KEY_PREFIX, DIALOG_CONCURRENCY,
DIALOG_CONSUMER). Counters go to the JSON file named by BENCH_STATS_FILE, rewritten every
0.2 s, so the bench can take deltas around a run without adding Redis commands.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import ResponseError

from dialog_worker.config import Settings, load_settings
from dialog_worker.engine.protocol import initial_state
from dialog_worker.engine.rules import RuleEngine, load_rules
from dialog_worker.store.keys import Keys

Handler = Callable[[str, dict[str, str]], Awaitable[None]]

# The seed design's lock, as both locking comparison workers use it: SET NX PX to take it, this
# compare-and-delete to release it (seeds/000, verbatim), and the seed's 5 s lease.
RELEASE_LOCK_LUA = """
if redis.call("get", KEYS[1]) == ARGV[1] then
  return redis.call("del", KEYS[1])
else
  return 0
end
"""
LOCK_TTL_MS = 5000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Base:
    """Settings, keys, engine, client and counters of one comparison worker process."""

    def __init__(self) -> None:
        self.settings: Settings = load_settings()
        self.keys = Keys.from_settings(self.settings)
        self.engine: RuleEngine = load_rules(self.settings.rules_file or None)
        self.concurrency = self.settings.concurrency
        pool = BlockingConnectionPool.from_url(
            self.settings.redis_url,
            max_connections=self.concurrency + 8,
            timeout=30,
            decode_responses=True,
            socket_timeout=10,
        )
        self.redis = Redis(connection_pool=pool)
        self.counters: Counter[str] = Counter()
        self.stats_file = os.environ.get("BENCH_STATS_FILE", "")
        self.stopping = asyncio.Event()

    # -- the state shape dialog-worker writes (contract section 6) ----------------------

    def load_state(self, doc: str | None, session_id: str) -> dict[str, Any]:
        return orjson.loads(doc) if doc else initial_state(session_id)

    def apply(
        self, state: dict[str, Any], fields: dict[str, str]
    ) -> tuple[dict[str, Any], str, str]:
        """Run the engine step and set history, applied_seq and version as dialog-worker
        does (same history limit). Returns (new state, its JSON, reply)."""
        seq = int(fields["seq"])
        message = {
            "session_id": fields["session_id"],
            "msg_id": fields["msg_id"],
            "seq": seq,
            "text": fields["text"],
        }
        new_state, reply = self.engine.step(state, message)
        turn = {"seq": seq, "msg_id": fields["msg_id"], "user": fields["text"], "bot": reply}
        limit = self.settings.history_limit
        history = [*state.get("history", []), turn][-limit:] if limit else []
        new_state = {
            **new_state,
            "session_id": fields["session_id"],
            "history": history,
            "applied_seq": seq,
            "version": int(state.get("version", 0)) + 1,
        }
        return new_state, orjson.dumps(new_state).decode(), reply

    def reply_fields(self, fields: dict[str, str], reply: str, **extra: str) -> dict[str, str]:
        return {
            "session_id": fields["session_id"],
            "msg_id": fields.get("msg_id", ""),
            "seq": fields.get("seq", ""),
            "reply": reply,
            "produced_at": str(now_ms()),
            **extra,
        }

    # -- process plumbing ----------------------------------------------------------------

    def _dump(self, snapshot: dict[str, int]) -> None:
        tmp = f"{self.stats_file}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(snapshot, fh)
        os.replace(tmp, self.stats_file)

    async def _write_stats(self) -> None:
        last: dict[str, int] | None = None
        while True:
            snapshot = dict(self.counters)
            if snapshot != last and self.stats_file:
                self._dump(snapshot)
                last = snapshot
            if self.stopping.is_set():
                return
            await asyncio.sleep(0.2)

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.stream, self.keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def consume(self, handle: Handler) -> None:
        """XREADGROUP as many entries as there are free slots (as dialog-worker does), one
        task per entry, until SIGTERM/SIGINT; then let in-flight tasks finish."""
        await self.ensure_group()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        stats = asyncio.create_task(self._write_stats())
        free = self.concurrency
        wake = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()

        async def run(entry_id: str, fields: dict[str, str]) -> None:
            nonlocal free
            try:
                await handle(entry_id, fields)
            except Exception as exc:  # a comparison worker logs and goes on
                self.counters["errors"] += 1
                print(f"error on {entry_id}: {exc!r}", flush=True)
            finally:
                free += 1
                wake.set()

        consumer = self.settings.consumer
        while not self.stopping.is_set():
            if free == 0:
                wake.clear()
                await wake.wait()
                continue
            reply = await self.redis.xreadgroup(
                self.keys.group, consumer, {self.keys.stream: ">"}, count=free, block=500
            )
            for _, batch in reply or []:
                for entry_id, fields in batch:
                    free -= 1
                    task = asyncio.create_task(run(entry_id, fields))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        self.stopping.set()
        await stats
        await self.redis.aclose()


def main(factory: Callable[[], Awaitable[None]]) -> None:
    try:
        import uvloop

        uvloop.run(factory())
    except ImportError:
        asyncio.run(factory())
