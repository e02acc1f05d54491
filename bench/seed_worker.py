"""(b) The seed design (shared/seeds/000), ported literally to Redis Streams.

Per message, as `processDialogMessage` does:

    1. SET lock token PX 5000 NX        contended -> "CONCURRENCY_LOCK_ACTIVE" error
    2. GET state                        (HGET of field d)
    3. engine step, history push
    4. SET state EX 86400               unconditional: no fencing, no version check
                                        (HSET d + EXPIRE, pipelined: one round trip)
    5. EVAL compare-and-delete release  (EVAL with the script text, as ioredis `eval` sends it)
    then the queue completes the job:   XADD reply + XACK (pipelined: one round trip)

An error (here: lock contention, the only one) is what the seed hands to its queue for "retry
with backoff": the `attempts` header of the entry goes up by one and, after an exponential
backoff (DIALOG_BACKOFF_BASE_MS * 2^(attempts-1), no jitter, as BullMQ's "exponential"),
a copy is XADDed to the tail of the stream and the original XACKed (one round trip). The
message waits for its backoff in a background task, not in a concurrency slot. When attempts
would exceed SEED_MAX_ATTEMPTS (default 3, the seed's "attempts > 3"), the message goes to
the dead-letter stream with a fallback reply (`dead_lettered=1`) instead.

Nothing orders a session's messages: a re-queued message goes to the back of the stream and
its successors overtake it (the bench counts them out of order). Adaptations for the shared
checker, which cost the same: the state is field `d` of the session's state hash (the send
script keeps the seq counter in that hash), its JSON has dialog-worker's shape (history turns
carry seq and msg_id, applied_seq, version = version read + 1) and the same history limit.
Run by the bench: `python -m bench.seed_worker` with dialog-worker's environment.
"""

from __future__ import annotations

import asyncio
import os
import uuid

from bench.common import LOCK_TTL_MS, RELEASE_LOCK_LUA, Base, main


class Seed(Base):
    def __init__(self) -> None:
        super().__init__()
        self.max_attempts = int(os.environ.get("SEED_MAX_ATTEMPTS", "3"))
        self.backoff_ms = self.settings.backoff_base_ms
        self.waiting: set[asyncio.Task[None]] = set()

    async def handle(self, entry_id: str, fields: dict[str, str]) -> None:
        sid = fields["session_id"]
        sk = self.keys.session(sid)
        token = str(uuid.uuid4())
        acquired = await self.redis.set(sk.lock, token, px=LOCK_TTL_MS, nx=True)
        if not acquired:
            self.counters["lock_contended"] += 1
            await self.fail(entry_id, fields, f"CONCURRENCY_LOCK_ACTIVE: Session {sid} is locked")
            return
        try:
            state = self.load_state(await self.redis.hget(sk.state, "d"), sid)
            _, doc, reply = self.apply(state, fields)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(sk.state, "d", doc)
                pipe.expire(sk.state, 86400)
                await pipe.execute()
        finally:
            await self.redis.eval(RELEASE_LOCK_LUA, 1, sk.lock, token)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.keys.replies, self.reply_fields(fields, reply))
            pipe.xack(self.keys.stream, self.keys.group, entry_id)
            await pipe.execute()
        self.counters["processed"] += 1

    async def fail(self, entry_id: str, fields: dict[str, str], error: str) -> None:
        attempts = int(fields.get("attempts", "0")) + 1
        if attempts > self.max_attempts:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.keys.dlq, {**fields, "error": error, "attempts": str(attempts)})
                pipe.xadd(
                    self.keys.replies,
                    self.reply_fields(fields, self.settings.fallback_reply, dead_lettered="1"),
                )
                pipe.xack(self.keys.stream, self.keys.group, entry_id)
                await pipe.execute()
            self.counters["dead_lettered"] += 1
            return
        task = asyncio.create_task(self.requeue_later(entry_id, fields, attempts))
        self.waiting.add(task)
        task.add_done_callback(self.waiting.discard)

    async def requeue_later(self, entry_id: str, fields: dict[str, str], attempts: int) -> None:
        await asyncio.sleep(self.backoff_ms * 2 ** (attempts - 1) / 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.keys.stream, {**fields, "attempts": str(attempts)})
            pipe.xack(self.keys.stream, self.keys.group, entry_id)
            await pipe.execute()
        self.counters["requeued_contended"] += 1

    async def run(self) -> None:
        await self.consume(self.handle)


if __name__ == "__main__":
    main(lambda: Seed().run())
