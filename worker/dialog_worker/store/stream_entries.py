"""The one reader of stream entries for operator tools (`stats`, `session`, `dlq`, `reshard`)
and the metrics sampler.

What producers write is bytes: it need not be UTF-8, and one entry may repeat a field name
(such an entry is dead-lettered as malformed, with every field as it was). Entries are read as
bytes, every field pair kept in its stored order, and each name and value decoded alone for
showing: UTF-8 as it is, anything else with its undecodable bytes escaped (``\\xff``). Nothing
read here is ever re-sent from its shown form unless `Entry.is_text` says it is exact.

redis-py folds an entry's pairs into a dict, losing a repeated name; the reader therefore owns
a bytes client of its own whose XRANGE / XREVRANGE replies keep the pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.client import NEVER_DECODE

Pair = tuple[bytes, bytes]


def shown(value: bytes | str) -> str:
    """A name or value as text: UTF-8 as it is, other bytes escaped (``\\xff``)."""
    if isinstance(value, str):
        return value
    return value.decode("utf-8", "backslashreplace")


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    id: str
    pairs: tuple[Pair, ...]  # as stored: order and repeated names kept

    @property
    def fields(self) -> dict[str, str]:
        """Each name's first value, shown (a repeated name's later values are in `pairs`)."""
        out: dict[str, str] = {}
        for name, value in self.pairs:
            out.setdefault(shown(name), shown(value))
        return out

    def get(self, name: str) -> str | None:
        want = name.encode()
        for key, value in self.pairs:
            if key == want:
                return shown(value)
        return None

    def raw(self, name: str) -> bytes | None:
        want = name.encode()
        for key, value in self.pairs:
            if key == want:
                return value
        return None

    @property
    def names_repeat(self) -> bool:
        names = [name for name, _ in self.pairs]
        return len(set(names)) != len(names)

    @property
    def is_text(self) -> bool:
        """Every name and value is UTF-8: the shown form is exact."""
        return all(_is_utf8(name) and _is_utf8(value) for name, value in self.pairs)

    def shown_pairs(self) -> list[list[str]]:
        return [[shown(name), shown(value)] for name, value in self.pairs]

    def flat(self) -> list[bytes]:
        out: list[bytes] = []
        for name, value in self.pairs:
            out += [name, value]
        return out


def _entries(response: Any, **_: Any) -> list[tuple[bytes, list[bytes]]]:
    """XRANGE / XREVRANGE reply as Redis sent it: [id, [name, value, ...]] per entry."""
    return [(item[0], list(item[1])) for item in response or [] if item is not None]


def _entry(item: tuple[bytes, list[bytes]]) -> Entry:
    entry_id, flat = item
    values = list(flat)
    pairs = tuple(zip(values[0::2], values[1::2], strict=False))
    return Entry(shown(entry_id), pairs)


async def undecoded(redis: Redis, *args: Any) -> Any:
    """One command whose reply is read as bytes whatever the client decodes (redis-py's
    NEVER_DECODE option; its response callback still applies)."""
    execute: Callable[..., Awaitable[Any]] = redis.execute_command
    return await execute(*args, **{NEVER_DECODE: True})


async def first_id(redis: Redis, stream: str) -> str | None:
    """The id of a stream's first entry, on any client: the entry is read undecoded (its
    fields need not be UTF-8) and only its id is kept."""
    reply = await undecoded(redis, "XRANGE", stream, "-", "+", "COUNT", 1)
    return shown(reply[0][0]) if reply else None


class StreamReader:
    """Reads entries of any stream through `client`'s connections, undecoded, every pair kept.

    On a standalone server the reader makes its own client object on `client`'s connection
    pool (its XRANGE and XREVRANGE replies are changed, the caller's are not). A cluster
    client cannot be shared that way: give the reader one of its own (its replies change)."""

    def __init__(self, client: Redis) -> None:
        own = (
            client
            if isinstance(client, RedisCluster)
            else Redis(connection_pool=client.connection_pool)
        )
        for command in ("XRANGE", "XREVRANGE"):
            own.set_response_callback(command, _entries)
        self.redis = own

    async def range(
        self, stream: str, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[Entry]:
        args: list[Any] = [stream, start, end] + (["COUNT", count] if count is not None else [])
        reply = await undecoded(self.redis, "XRANGE", *args)
        return [_entry(item) for item in cast(list[tuple[bytes, list[bytes]]], reply)]

    async def revrange(self, stream: str, count: int) -> list[Entry]:
        reply = await undecoded(self.redis, "XREVRANGE", stream, "+", "-", "COUNT", count)
        return [_entry(item) for item in cast(list[tuple[bytes, list[bytes]]], reply)]

    async def one(self, stream: str, entry_id: str) -> Entry | None:
        found = await self.range(stream, entry_id, entry_id)
        return found[0] if found else None

    async def first_id(self, stream: str) -> str | None:
        found = await self.range(stream, count=1)
        return found[0].id if found else None

    async def scan(
        self,
        stream: str,
        start: str = "-",
        *,
        end: str = "+",
        page: int = 1000,
        limit: int | None = None,
        keep: Callable[[Entry], bool] | None = None,
    ) -> list[Entry]:
        """Entries from `start` (inclusive, or exclusive with a leading "(") to `end`, page by
        page; only those `keep` accepts, at most `limit` of them."""
        found: list[Entry] = []
        while limit is None or len(found) < limit:
            batch = await self.range(stream, start, end, page)
            found += [e for e in batch if keep is None or keep(e)]
            if len(batch) < page:
                break
            start = f"({batch[-1].id}"
        return found if limit is None else found[:limit]


# Reads of streams whose every value the worker wrote itself, as text (reply events, for
# `verify` and the bench), on a client that decodes responses: redis-py's type hints cannot
# know that, so the casts live here instead of at every call site.
Decoded = tuple[str, dict[str, str]]


async def xrange(
    redis: Redis, stream: str, start: str = "-", end: str = "+", count: int | None = None
) -> list[Decoded]:
    return cast(list[Decoded], await redis.xrange(stream, min=start, max=end, count=count))


async def xrevrange(redis: Redis, stream: str, count: int) -> list[Decoded]:
    return cast(list[Decoded], await redis.xrevrange(stream, count=count))


async def scan_all(
    redis: Redis, stream: str, start: str = "-", page: int = 1000, limit: int | None = None
) -> list[Decoded]:
    """Every entry after `start` (inclusive, or exclusive with a leading "("), page by page."""
    found: list[Decoded] = []
    while limit is None or len(found) < limit:
        batch = await xrange(redis, stream, start, "+", page)
        found += batch
        if len(batch) < page:
            break
        start = f"({batch[-1][0]}"
    return found
