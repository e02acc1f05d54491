"""(a) The naive worker: no lock, no ordering.

    XREADGROUP -> HGET state -> engine step -> one pipelined round trip: HSET state + EXPIRE,
    XADD reply, XACK

Two round trips per message plus the amortised read: the cheapest a worker can be while still
keeping state in Redis. Two messages of one session processed at once both read the same
state and the second write wins: a lost update (the bench counts them from `version`, which
each write sets to the version it read + 1).

State lives where dialog-worker keeps it (field `d` of the session's state hash, which the
send script also uses for the seq counter) in the same JSON shape, so the same checker reads it.
Run by the bench: `python -m bench.naive_worker` with dialog-worker's environment.
"""

from __future__ import annotations

from bench.common import Base, main


class Naive(Base):
    async def handle(self, entry_id: str, fields: dict[str, str]) -> None:
        sid = fields["session_id"]
        key = self.keys.session(sid).state
        state = self.load_state(await self.redis.hget(key, "d"), sid)
        _, doc, reply = self.apply(state, fields)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, "d", doc)
            pipe.expire(key, self.settings.state_ttl_s)
            pipe.xadd(self.keys.replies, self.reply_fields(fields, reply))
            pipe.xack(self.keys.stream, self.keys.group, entry_id)
            await pipe.execute()
        self.counters["processed"] += 1

    async def run(self) -> None:
        await self.consume(self.handle)


if __name__ == "__main__":
    main(lambda: Naive().run())
