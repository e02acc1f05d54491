"""Read-only views of the queue for `stats`, the metrics sampler and `session`."""

from __future__ import annotations

import json
import time
from typing import Any

from redis.asyncio import Redis

from worker.keys import Keys


def entry_age_s(entry_id: str, now_ms: int) -> float:
    return max(0.0, (now_ms - int(entry_id.split("-", 1)[0])) / 1000)


async def queue_stats(redis: Redis, keys: Keys) -> dict[str, Any]:
    """The contract's `stats` keys. ``oldest_pending_age_s`` is the time since the oldest
    entry still pending entered the stream (0 when nothing is pending)."""
    now = int(time.time() * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.stream)
        pipe.zcard(keys.delayed)
        pipe.xlen(keys.dlq)
        stream_length, delayed, dlq_length = await pipe.execute()
    lag: int | None = 0
    pending = 0
    consumers = 0
    oldest = 0.0
    try:
        for group in await redis.xinfo_groups(keys.stream):
            if group["name"] == keys.group:
                lag = group.get("lag")
                pending = int(group["pending"])
                consumers = int(group["consumers"])
    except redis.exceptions.ResponseError:
        pass  # no stream yet
    if pending:
        summary = await redis.xpending(keys.stream, keys.group)
        if summary.get("min"):
            oldest = entry_age_s(summary["min"], now)
    if lag is None:
        # Redis cannot tell the lag after deletions inside the unread range; count it instead.
        lag = await _count_unread(redis, keys)
    return {
        "stream": keys.stream,
        "group": keys.group,
        "stream_length": stream_length,
        "lag": lag,
        "pending": pending,
        "oldest_pending_age_s": round(oldest, 3),
        "delayed": delayed,
        "dlq_length": dlq_length,
        "consumers": consumers,
    }


async def _count_unread(redis: Redis, keys: Keys) -> int:
    last = "0-0"
    for group in await redis.xinfo_groups(keys.stream):
        if group["name"] == keys.group:
            last = group["last-delivered-id"]
    count = 0
    start = f"({last}"
    while True:
        batch = await redis.xrange(keys.stream, min=start, max="+", count=1000)
        count += len(batch)
        if len(batch) < 1000:
            return count
        start = f"({batch[-1][0]}"


async def session_view(redis: Redis, keys: Keys, session_id: str) -> dict[str, Any]:
    """Everything about one session: lock, seq, waiting and dead-lettered messages."""
    sk = keys.session(session_id)
    fields = await redis.hgetall(sk.state)
    holder = await redis.get(sk.lock)
    ttl_ms = await redis.pttl(sk.lock)
    state = json.loads(fields["d"]) if "d" in fields else None
    parked = await redis.hgetall(sk.parked)
    return {
        "session_id": session_id,
        "lock": {"token": holder, "ttl_ms": ttl_ms if ttl_ms >= 0 else None},
        "applied_seq": int(fields.get("a", 0)),
        "last_seq": int(fields.get("s", 0)),
        "version": int(fields.get("v", 0)),
        "in_flight": (
            {
                "seq": int(fields["ia_seq"]),
                "attempts": int(fields.get("ia_n", 0)),
                "last_error": fields.get("ia_err"),
            }
            if "ia_seq" in fields
            else None
        ),
        "parked": {int(seq): delayed_id for seq, delayed_id in parked.items()},
        "step": state.get("step") if state else None,
    }
