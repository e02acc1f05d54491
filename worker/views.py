"""Read-only views of the queue for `stats`, the metrics sampler and `session`."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.keys import Keys
from dialog_worker.streams import Entry, scan_all, xrange


def entry_age_s(entry_id: str, now_ms: int) -> float:
    return max(0.0, (now_ms - int(entry_id.split("-", 1)[0])) / 1000)


async def queue_stats(redis: Redis, keys: Keys) -> dict[str, Any]:
    """The `stats` keys. Every entry in the inbound stream is a message not yet finished
    (applied messages are deleted), so ``oldest_pending_age_s`` is the age of the stream's
    first entry (0 when it is empty); ``waiting`` counts the entries already delivered and
    sequenced (stream length minus lag), ``delayed`` the sessions in the ready set (sessions
    with messages outstanding)."""
    now = int(time.time() * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.stream)
        pipe.zcard(keys.ready)
        pipe.xlen(keys.dlq)
        pipe.xrange(keys.stream, count=1)
        stream_length, delayed, dlq_length, first = await pipe.execute()
    lag: int | None = stream_length  # no group yet: nothing has been read
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
    if first:
        oldest = entry_age_s(first[0][0], now)
    if lag is None:
        # Redis cannot tell the lag after deletions inside the unread range; count it instead.
        lag = await _count_unread(redis, keys)
    # Replaying the AOF after a crash does not advance the group's entries-read (the intake
    # script's reads are logged as XCLAIMs), so Redis 7.0 can report more lag than there are
    # entries; nothing unread can be more than what the stream holds.
    lag = min(int(lag), int(stream_length))
    return {
        "stream": keys.stream,
        "group": keys.group,
        "stream_length": stream_length,
        "lag": lag,
        "pending": pending,
        "waiting": max(0, stream_length - (lag or 0)),
        "oldest_pending_age_s": round(oldest, 3),
        "delayed": delayed,
        "dlq_length": dlq_length,
        "consumers": consumers,
    }


async def reply_group_lags(redis: Redis, keys: Keys) -> dict[str, int]:
    """Unread events per consumer group of the shard's reply stream. Trimming (MAXLEN ~) does
    not wait for groups: a group that falls a whole MAXLEN behind loses events unread."""
    try:
        groups = await redis.xinfo_groups(keys.replies)
    except ResponseError:
        return {}  # no reply stream yet
    lags: dict[str, int] = {}
    for group in groups:
        lag = group.get("lag")
        if lag is None:  # Redis cannot tell after deletions: count what follows its position
            lag = len(await scan_all(redis, keys.replies, start=f"({group['last-delivered-id']}"))
        lags[str(group["name"])] = int(lag)
    return lags


async def aggregate_stats(redis: Redis, shards: Sequence[Keys]) -> dict[str, Any]:
    """`queue_stats` summed over shards (ages and consumers: the maximum); with more than one
    shard, the per-shard figures follow under "shards"."""
    per_shard = [await queue_stats(redis, keys) for keys in shards]
    if len(per_shard) == 1:
        return per_shard[0]
    total: dict[str, Any] = {"stream": [s["stream"] for s in per_shard], "group": shards[0].group}
    for key in ("stream_length", "lag", "pending", "waiting", "delayed", "dlq_length"):
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


async def session_view(
    redis: Redis, keys: Keys, session_id: str, raw: Redis | None = None
) -> dict[str, Any]:
    """Everything about one session: lock holder and TTL, applied vs last assigned seq, the
    next message's attempts and last error, its sequenced messages still waiting in the stream,
    when the ready set looks at it next, and its dead letters (scans bounded by SCAN_LIMIT)."""
    sk = keys.session(session_id)
    fields = cast(dict[str, str], await redis.hgetall(sk.state))
    holder = await redis.get(sk.lock)
    ttl_ms = await redis.pttl(sk.lock)
    due = await redis.zscore(keys.ready, session_id)
    state = json.loads(fields["d"]) if "d" in fields else None
    applied = int(fields.get("a", 0))
    waiting = []
    for name, entry_id in sorted(
        ((n, v) for n, v in fields.items() if n[:1] == "q" and n[1:].isdigit()),
        key=lambda item: int(item[0][1:]),
    ):
        rows = await xrange(redis, keys.stream, entry_id, entry_id)
        f = rows[0][1] if rows else {}
        waiting.append(
            {
                "seq": int(name[1:]),
                "entry_id": entry_id,
                "msg_id": f.get("msg_id", entry_id) if rows else None,
                "age_s": entry_age_s(entry_id, _now_ms()),
                "present": bool(rows),
            }
        )
    dead = [
        {
            "id": i,
            "seq": _int(f.get("seq")),
            "msg_id": f.get("msg_id"),
            "error_kind": f.get("error_kind"),
            "error": f.get("error"),
        }
        for i, f in await _scan_letters(raw or redis, keys.dlq, session_id)
    ]
    return {
        "session_id": session_id,
        "lock": {"token": holder, "ttl_ms": ttl_ms if ttl_ms >= 0 else None},
        "applied_seq": applied,
        "last_seq": int(fields.get("s", 0)),
        "version": int(fields.get("v", 0)),
        "step": state.get("step") if state else None,
        "in_flight": (
            {
                "seq": applied + 1,
                "attempts": int(fields.get("n", 0)),
                "last_error": fields.get("e"),
            }
            if int(fields.get("s", 0)) > applied
            else None
        ),
        "next_look_in_s": round((float(due) - _now_ms()) / 1000, 3) if due is not None else None,
        "waiting": waiting,
        "dead_letters": dead,
    }


async def _scan_letters(redis: Redis, stream: str, session_id: str) -> list[Entry]:
    """Dead letters keep their original bytes, which need not be UTF-8: read them with a
    bytes client (`raw`) and decode each field alone."""
    found: list[Entry] = []
    start = "-"
    want = session_id.encode()
    while len(found) < SCAN_LIMIT:
        batch = cast(
            list[tuple[Any, dict[Any, Any]]], await redis.xrange(stream, min=start, count=1000)
        )
        for entry_id, fields in batch:
            if fields.get(b"session_id", fields.get("session_id")) in (want, session_id):
                found.append(
                    (_decoded(entry_id), {_decoded(k): _decoded(v) for k, v in fields.items()})
                )
        if len(batch) < 1000:
            break
        start = f"({_decoded(batch[-1][0])}"
    return found


def _decoded(value: bytes | str) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)
