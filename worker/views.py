"""Read-only views of the queue for `stats`, the metrics sampler and `session`."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from worker.keys import Keys
from worker.streams import Entry, scan_all


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
    except ResponseError:
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


async def aggregate_stats(redis: Redis, shards: Sequence[Keys]) -> dict[str, Any]:
    """`queue_stats` summed over shards (ages and consumers: the maximum); with more than one
    shard, the per-shard figures follow under "shards"."""
    per_shard = [await queue_stats(redis, keys) for keys in shards]
    if len(per_shard) == 1:
        return per_shard[0]
    total: dict[str, Any] = {"stream": [s["stream"] for s in per_shard], "group": shards[0].group}
    for key in ("stream_length", "lag", "pending", "delayed", "dlq_length"):
        total[key] = sum(s[key] or 0 for s in per_shard)
    total["oldest_pending_age_s"] = max(s["oldest_pending_age_s"] for s in per_shard)
    total["consumers"] = max(s["consumers"] for s in per_shard)
    total["shards"] = [{"shard": k.shard, **s} for k, s in zip(shards, per_shard, strict=True)]
    return total


async def _count_unread(redis: Redis, keys: Keys) -> int:
    last = "0-0"
    for group in await redis.xinfo_groups(keys.stream):
        if group["name"] == keys.group:
            last = group["last-delivered-id"]
    return len(await scan_all(redis, keys.stream, start=f"({last}"))


# An operator tool scans at most this many entries of each stream / the delayed set.
SCAN_LIMIT = 100_000


async def session_view(redis: Redis, keys: Keys, session_id: str) -> dict[str, Any]:
    """Everything about one session: lock holder and TTL, applied vs last assigned seq, the
    message in flight with its attempts and last error, its messages waiting in the stream or
    the delayed set, and its dead letters. Scans are bounded by SCAN_LIMIT per structure."""
    sk = keys.session(session_id)
    fields = await redis.hgetall(sk.state)
    holder = await redis.get(sk.lock)
    ttl_ms = await redis.pttl(sk.lock)
    state = json.loads(fields["d"]) if "d" in fields else None
    parked = await redis.hgetall(sk.parked)
    pending_ids = await _pending_index(redis, keys)
    waiting = []
    for entry_id, f in await _scan_stream(redis, keys.stream, session_id):
        owner = pending_ids.get(entry_id)
        waiting.append(
            {
                "where": "stream",
                "entry_id": entry_id,
                "seq": _int(f.get("seq")),
                "msg_id": f.get("msg_id"),
                "age_s": entry_age_s(entry_id, _now_ms()),
                "consumer": owner[0] if owner else None,
                "deliveries": owner[1] if owner else 0,
            }
        )
    due = dict(
        cast(
            list[tuple[str, float]],
            await redis.zrange(keys.delayed, 0, SCAN_LIMIT - 1, withscores=True),
        )
    )
    cursor = 0
    while True:
        cursor, batch = cast(
            tuple[int, dict[str, str]], await redis.hscan(keys.delayed_data, cursor, count=1000)
        )
        for delayed_id, payload in batch.items():
            flat = json.loads(payload)
            f = dict(zip(flat[0::2], flat[1::2], strict=False))
            if f.get("session_id") == session_id:
                waiting.append(
                    {
                        "where": "delayed",
                        "entry_id": delayed_id,
                        "seq": _int(f.get("seq")),
                        "msg_id": f.get("msg_id"),
                        "due_in_s": round((due.get(delayed_id, 0) - _now_ms()) / 1000, 3),
                        "requeues": _int(f.get("requeues")),
                    }
                )
        if cursor == 0:
            break
    waiting.sort(key=lambda w: w["seq"] or 0)
    dead = [
        {
            "id": i,
            "seq": _int(f.get("seq")),
            "msg_id": f.get("msg_id"),
            "error_kind": f.get("error_kind"),
            "error": f.get("error"),
        }
        for i, f in await _scan_stream(redis, keys.dlq, session_id)
    ]
    return {
        "session_id": session_id,
        "lock": {"token": holder, "ttl_ms": ttl_ms if ttl_ms >= 0 else None},
        "applied_seq": int(fields.get("a", 0)),
        "last_seq": int(fields.get("s", 0)),
        "version": int(fields.get("v", 0)),
        "step": state.get("step") if state else None,
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
        "waiting": waiting,
        "dead_letters": dead,
    }


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _scan_stream(redis: Redis, stream: str, session_id: str) -> list[Entry]:
    return [
        e
        for e in await scan_all(redis, stream, limit=SCAN_LIMIT)
        if e[1].get("session_id") == session_id
    ]


async def _pending_index(redis: Redis, keys: Keys) -> dict[str, tuple[str, int]]:
    try:
        rows = await redis.xpending_range(keys.stream, keys.group, "-", "+", SCAN_LIMIT)
    except ResponseError:
        return {}
    return {str(r["message_id"]): (str(r["consumer"]), int(r["times_delivered"])) for r in rows}
