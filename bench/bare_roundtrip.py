"""(d) The bare Streams round trip, the floor: no state, no engine, no lock.

    XREADGROUP -> one pipelined round trip: XACK + XADD reply

One round trip per message plus the amortised read. The reply is needed for the bench to see
the message done (it measures enqueue -> reply for every system the same way).
Run by the bench: `python -m bench.bare_roundtrip` with dialog-worker's environment.
"""

from __future__ import annotations

from bench.common import Base, main


class Bare(Base):
    async def handle(self, entry_id: str, fields: dict[str, str]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.keys.stream, self.keys.group, entry_id)
            pipe.xadd(self.keys.replies, self.reply_fields(fields, ""))
            await pipe.execute()
        self.counters["processed"] += 1

    async def run(self) -> None:
        await self.consume(self.handle)


if __name__ == "__main__":
    main(lambda: Bare().run())
