"""(c) A peer library with the same engine and the same lock: taskiq + taskiq-redis's
RedisStreamBroker (versions pinned in bench/requirements.txt).

The task does what the seed does (SET NX PX lock, GET state, step, SET state, compare-and-delete
release, reply) and raises on contention; taskiq's SmartRetryMiddleware re-sends the task.
Without a schedule source RedisStreamBroker has no delayed delivery, so the retry is an
immediate XADD to the tail of the stream: the library's own behaviour, kept as is. The retry
budget is PEER_MAX_RETRIES (default 100000, so that nothing is dropped: taskiq has no dead
letters and would just log the failure).

The broker's stream is `<DIALOG_STREAM>:taskiq`; state, replies and keys are dialog-worker's,
so the bench checks it like the others. The bench enqueues with `enqueue()` (one `kiq` per
message; a session's messages in order, sessions in parallel).
Run by the bench: `python -m bench.peer_worker` with dialog-worker's environment.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from typing import Any

from taskiq.api import run_receiver_task
from taskiq.kicker import AsyncKicker
from taskiq.middlewares import SmartRetryMiddleware
from taskiq_redis import RedisStreamBroker

from bench.common import LOCK_TTL_MS, RELEASE_LOCK_LUA, Base, main
from dialog_worker.config import Settings

TASK_NAME = "bench.apply"


class LockContended(Exception):
    pass


def make_broker(settings: Settings) -> RedisStreamBroker:
    broker = RedisStreamBroker(
        settings.redis_url,
        queue_name=f"{settings.stream}:taskiq",
        consumer_group_name=f"{settings.group}-taskiq",
        consumer_name=settings.consumer or None,
        consumer_id="0",
        xread_block=500,
        xread_count=settings.concurrency,
        max_connection_pool_size=settings.concurrency + 8,
    )
    retries = int(os.environ.get("PEER_MAX_RETRIES", "100000"))
    return broker.with_middlewares(
        SmartRetryMiddleware(default_retry_count=retries, default_retry_label=True, default_delay=0)
    )


class Peer(Base):
    def __init__(self) -> None:
        super().__init__()
        self.release = self.redis.register_script(RELEASE_LOCK_LUA)
        self.broker = make_broker(self.settings)

        async def apply(session_id: str, seq: int, msg_id: str, text: str) -> None:
            await self.apply(session_id, seq, msg_id, text)

        self.broker.register_task(apply, task_name=TASK_NAME)

    async def apply(self, session_id: str, seq: int, msg_id: str, text: str) -> None:
        sk = self.keys.session(session_id)
        token = str(uuid.uuid4())
        if not await self.redis.set(sk.lock, token, px=LOCK_TTL_MS, nx=True):
            self.counters["requeued_contended"] += 1
            raise LockContended(f"CONCURRENCY_LOCK_ACTIVE: Session {session_id} is locked")
        fields = {"session_id": session_id, "seq": str(seq), "msg_id": msg_id, "text": text}
        try:
            state = self.load_state(await self.redis.hget(sk.state, "d"), session_id)
            _, doc, reply = self.apply_turn(state, fields)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(sk.state, "d", doc)
                pipe.expire(sk.state, 86400)
                pipe.xadd(self.keys.replies, self.reply_fields(fields, reply))
                await pipe.execute()
        finally:
            await self.release(keys=[sk.lock], args=[token])
        self.counters["processed"] += 1

    def apply_turn(
        self, state: dict[str, Any], fields: dict[str, str]
    ) -> tuple[dict[str, Any], str, str]:
        return Base.apply(self, state, fields)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        await self.broker.startup()
        stats = asyncio.create_task(self._write_stats())
        receiver = asyncio.create_task(
            run_receiver_task(self.broker, max_async_tasks=self.concurrency, run_startup=False)
        )
        await self.stopping.wait()
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
        await stats
        await self.broker.shutdown()
        await self.redis.aclose()


class Producer:
    """Bench side: `send` kiqs every (session_id, seq, msg_id, text); a session's messages in
    order, up to `senders` sessions at once (one XADD round trip per message)."""

    def __init__(self, settings: Settings, senders: int = 200) -> None:
        self.broker = make_broker(settings)
        self.kicker: AsyncKicker[Any, Any] = AsyncKicker(
            task_name=TASK_NAME, broker=self.broker, labels={}
        )
        self.senders = senders

    async def start(self) -> None:
        await self.broker.startup()

    async def send(self, items: list[tuple[str, int, str, str]]) -> None:
        by_session: dict[str, list[tuple[str, int, str, str]]] = {}
        for item in items:
            by_session.setdefault(item[0], []).append(item)
        limiter = asyncio.Semaphore(self.senders)

        async def one(msgs: list[tuple[str, int, str, str]]) -> None:
            async with limiter:
                for sid, seq, msg_id, text in msgs:
                    await self.kicker.kiq(session_id=sid, seq=seq, msg_id=msg_id, text=text)

        await asyncio.gather(*(one(m) for m in by_session.values()))

    async def close(self) -> None:
        await self.broker.shutdown()


if __name__ == "__main__":
    main(lambda: Peer().run())
