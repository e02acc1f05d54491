"""Typed reads of streams. The worker's clients decode responses to str, which redis-py's
type hints cannot know; the casts live here instead of at every call site."""

from __future__ import annotations

from typing import cast

from redis.asyncio import Redis

Entry = tuple[str, dict[str, str]]


async def xrange(
    redis: Redis, stream: str, start: str = "-", end: str = "+", count: int | None = None
) -> list[Entry]:
    return cast(list[Entry], await redis.xrange(stream, min=start, max=end, count=count))


async def xrevrange(redis: Redis, stream: str, count: int) -> list[Entry]:
    return cast(list[Entry], await redis.xrevrange(stream, count=count))


async def scan_all(
    redis: Redis, stream: str, start: str = "-", page: int = 1000, limit: int | None = None
) -> list[Entry]:
    """Every entry after `start` (inclusive, or exclusive with a leading "("), page by page."""
    found: list[Entry] = []
    while limit is None or len(found) < limit:
        batch = await xrange(redis, stream, start, "+", page)
        found += batch
        if len(batch) < page:
            break
        start = f"({batch[-1][0]}"
    return found
