"""The worker's presence on each shard: a key that exists while it runs (Keys.presence), set
every `ANNOUNCE_EVERY_S` with a TTL of three of those, and deleted when it stops. Redis keeps
a consumer of the workers' group long after its worker stopped or died (until
DIALOG_CONSUMER_IDLE_DELETE_S), and a live worker of an idle pool is handed no entries either:
the consumers alone cannot tell the two apart, so the console reads this (console/reads.py).

One SET per shard every ten seconds per worker: next to what an idle pool costs Redis, nothing.
"""

from __future__ import annotations

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dialog_worker.daemon.shard import Shard
from dialog_worker.version import __version__

log = structlog.get_logger("dialog_worker.daemon.presence")

ANNOUNCE_EVERY_S = 10.0
# A worker killed without a word (kill -9, a lost host) reads as gone this long after its last
# announcement at most: three announcements, so one late or failed one is not a death.
PRESENCE_TTL_MS = int(3 * ANNOUNCE_EVERY_S * 1000)


class Presence:
    def __init__(self, redis: Redis, shards: list[Shard], consumer: str) -> None:
        self.redis = redis
        self.shards = shards
        self.consumer = consumer

    async def announce_once(self) -> float:
        """This worker runs: its presence key on every shard, for the next TTL."""
        for shard in self.shards:
            await self.redis.set(
                shard.keys.presence(self.consumer), __version__, px=PRESENCE_TTL_MS
            )
        return ANNOUNCE_EVERY_S

    async def leave(self) -> None:
        """This worker stops: its presence goes now, not a TTL later. Redis out of reach: the
        keys expire by themselves."""
        for shard in self.shards:
            try:
                await self.redis.delete(shard.keys.presence(self.consumer))
            except (RedisError, OSError) as exc:
                log.info("presence_left_to_expire", shard=shard.label, error=type(exc).__name__)
                return
