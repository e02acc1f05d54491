"""Read-only views of the queue for `stats`, the metrics sampler and `session`."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.store.codec import unpack_custody
from dialog_worker.store.keys import HELD_PLACE_MS, Keys
from dialog_worker.store.stream_entries import StreamReader, first_id, shown, undecoded


def entry_age_s(entry_id: str, now_ms: int) -> float:
    return max(0.0, (now_ms - int(entry_id.split("-", 1)[0])) / 1000)


async def queue_stats(redis: Redis, keys: Keys) -> dict[str, Any]:
    """The `stats` keys. The inbound stream holds only unread entries (intake moves each
    message it sequences into its session's keys), so ``lag`` is what no worker has read yet;
    ``waiting`` counts the sessions with sequenced messages not applied yet (the ages set),
    ``delayed`` the sessions in the ready set, and ``oldest_pending_age_s`` is the age of the
    oldest message not finished: the older of the first unread entry and the oldest
    outstanding message of any session. ``trimmed`` counts unread entries something other
    than a worker removed (XTRIM, MAXLEN, XDEL), ``id_ahead`` is the inbound stream's last id
    while it is pushed far ahead of the clock, ``trim_check_error`` why that check is off.

    A constant number of O(1) or O(log n) commands whatever the backlog (the metrics sampler
    runs this every few seconds): no scan of the stream. Producer data is never decoded: only
    the first entry's id is read."""
    now = int(time.time() * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.stream)
        pipe.zcard(keys.ready)
        pipe.xlen(keys.dlq)
        pipe.zcard(keys.ages)
        pipe.zrange(keys.ages, 0, 0, withscores=True)
        pipe.hmget(keys.inbound, "trimmed", "ahead", "error")
        (
            stream_length,
            delayed,
            dlq_length,
            waiting,
            oldest_outstanding,
            inbound,
        ) = await pipe.execute()
    first = await first_id(redis, keys.stream)
    lag: int | None = stream_length  # no group yet: nothing has been read
    entries_read: int | None = None
    pending = 0
    consumers = 0
    oldest = 0.0
    try:
        for group in await redis.xinfo_groups(keys.stream):
            if group["name"] == keys.group:
                lag = group.get("lag")
                entries_read = group.get("entries-read")
                pending = int(group["pending"])
                consumers = int(group["consumers"])
    except ResponseError:
        pass  # no stream yet
    if first is not None:
        oldest = entry_age_s(first, now)
    if oldest_outstanding:
        oldest = max(oldest, max(0.0, (now - float(oldest_outstanding[0][1])) / 1000))
    if lag is None:
        # Redis reports no lag once an entry at or after the group's position was deleted
        # (intake deletes what it reads). What was appended minus what the group read is the
        # same figure whenever the group's read counter is known; else the stream length
        # bounds it.
        lag = await _lag_from_counters(redis, keys, entries_read, int(stream_length))
    # Replaying the AOF after a crash does not advance the group's entries-read (the intake
    # script's reads are logged as XCLAIMs), so Redis 7.0 can report more lag than there are
    # entries; nothing unread can be more than what the stream holds.
    lag = min(int(lag), int(stream_length))
    trimmed, ahead, check_error = inbound
    queued = await queued_sessions(redis, keys)
    return {
        "stream": keys.stream,
        "group": keys.group,
        "stream_length": stream_length,
        "lag": lag,
        "pending": pending,
        "waiting": waiting,
        "queued": queued,
        "oldest_pending_age_s": round(oldest, 3),
        "delayed": delayed,
        "dlq_length": dlq_length,
        "consumers": consumers,
        "trimmed": _int(trimmed) or 0,
        "id_ahead": ahead,
        "trim_check_error": check_error,
    }


# Most tenants whose queues `queued_sessions` counts (one ZCARD each).
QUEUED_TENANTS_COUNTED = 1000


async def queued_sessions(redis: Redis, keys: Keys) -> int:
    """Sessions waiting in the shard's tenants' queues for a slot (lua/_common.lua, the
    tenants): where tenants are in use, the backlog a busy pool has read waits there rather
    than in the inbound stream."""
    tenants = await redis.zrange(keys.tenants_active, 0, QUEUED_TENANTS_COUNTED - 1)
    if not tenants:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            name = tenant.decode() if isinstance(tenant, bytes) else str(tenant)
            pipe.zcard(keys.tenant_queue(name))
        return sum(int(n) for n in await pipe.execute())


async def _lag_from_counters(
    redis: Redis, keys: Keys, entries_read: int | None, stream_length: int
) -> int:
    return min(stream_length, await _appended_since(redis, keys.stream, entries_read))


async def _appended_since(redis: Redis, stream: str, entries_read: int | None) -> int:
    """Entries appended to `stream` after a group's first `entries_read` (XINFO STREAM's
    entries-added minus it); unbounded when the group's counter is unknown."""
    if entries_read is None:
        return 2**63
    try:
        # Undecoded: the reply carries the first and last entries, which need not be UTF-8.
        info = await undecoded(redis, "XINFO STREAM", stream)
    except ResponseError:
        return 2**63
    return max(0, int(info["entries-added"]) - int(entries_read))


async def reply_group_lags(redis: Redis, keys: Keys) -> dict[str, int]:
    """Unread events per consumer group of the shard's reply stream. Trimming (MAXLEN ~) does
    not wait for groups: a group that falls a whole MAXLEN behind loses events unread. O(1)
    per group, as `queue_stats`."""
    try:
        groups = await redis.xinfo_groups(keys.replies)
    except ResponseError:
        return {}  # no reply stream yet
    lags: dict[str, int] = {}
    length: int | None = None
    for group in groups:
        lag = group.get("lag")
        if lag is None:  # Redis cannot tell after deletions: appended minus read, as above
            if length is None:
                length = int(await redis.xlen(keys.replies))
            lag = min(length, await _appended_since(redis, keys.replies, group.get("entries-read")))
        lags[str(group["name"])] = int(lag)
    return lags


async def aggregate_stats(redis: Redis, shards: Sequence[Keys]) -> dict[str, Any]:
    """`queue_stats` summed over shards (ages and consumers: the maximum); with more than one
    shard, the per-shard figures follow under "shards"."""
    per_shard = [await queue_stats(redis, keys) for keys in shards]
    if len(per_shard) == 1:
        return per_shard[0]
    total: dict[str, Any] = {"stream": [s["stream"] for s in per_shard], "group": shards[0].group}
    for key in (
        "stream_length",
        "lag",
        "pending",
        "waiting",
        "queued",
        "delayed",
        "dlq_length",
        "trimmed",
    ):
        total[key] = sum(s[key] or 0 for s in per_shard)
    total["oldest_pending_age_s"] = max(s["oldest_pending_age_s"] for s in per_shard)
    total["consumers"] = max(s["consumers"] for s in per_shard)
    total["id_ahead"] = next((s["id_ahead"] for s in per_shard if s["id_ahead"]), None)
    total["trim_check_error"] = next(
        (s["trim_check_error"] for s in per_shard if s["trim_check_error"]), None
    )
    total["shards"] = [{"shard": k.shard, **s} for k, s in zip(shards, per_shard, strict=True)]
    return total


# A stream entry id as Redis writes it (anything else in a session's q<seq> field is neither a
# message kept since intake nor the id of one still in the stream).
_ENTRY_ID = re.compile(rb"\d{1,20}-\d{1,20}\Z")

# An operator tool scans at most this many entries of each stream / the delayed set.
SCAN_LIMIT = 100_000


async def session_view(
    redis: Redis, keys: Keys, session_id: str, reader: StreamReader
) -> dict[str, Any]:
    """Everything about one session: lock holder and TTL, applied vs last assigned seq, the
    next message's attempts and last error, its sequenced messages still waiting (kept in the
    session's state hash since intake), when the ready set looks at it next, and its dead
    letters (a scan bounded by SCAN_LIMIT). The state hash is read undecoded: a waiting
    message holds producer bytes, which are shown escaped, never decoded."""
    sk = keys.session(session_id)
    raw = await undecoded(redis, "HGETALL", sk.state)
    fields = {shown(k): v for k, v in (raw or {}).items()}
    holder = await redis.get(sk.lock)
    ttl_ms = await redis.pttl(sk.lock)
    due = await redis.zscore(keys.ready, session_id)
    state = json.loads(fields["d"]) if "d" in fields else None
    applied = int(fields.get("a", 0))
    now = _now_ms()
    waiting = []
    for name, value in sorted(
        ((n, v) for n, v in fields.items() if n[:1] == "q" and n[1:].isdigit()),
        key=lambda item: int(item[0][1:]),
    ):
        held = unpack_custody(value)
        if held is not None:
            entry_id, message = held
            msg_id = message.get(b"msg_id")
            present = True
        else:  # sequenced before custody: a plain entry id, the message still in the stream
            entry_id = shown(value)
            entry = await reader.one(keys.stream, entry_id) if _ENTRY_ID.match(value) else None
            msg_id = entry.raw("msg_id") if entry else None
            present = entry is not None
        waiting.append(
            {
                "seq": int(name[1:]),
                "entry_id": entry_id,
                "msg_id": shown(msg_id) if msg_id is not None else entry_id if present else None,
                "age_s": entry_age_s(entry_id, now),
                "present": present,
            }
        )
    want = session_id.encode()
    letters = await reader.scan(
        keys.dlq, limit=SCAN_LIMIT, keep=lambda e: e.raw("session_id") == want
    )
    dead = [
        {
            "id": e.id,
            "seq": _int(e.get("seq")),
            "msg_id": e.get("msg_id"),
            "error_kind": e.get("error_kind"),
            "error": e.get("error"),
        }
        for e in letters
    ]
    last_error = fields.get("e")
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
                "last_error": shown(last_error) if last_error is not None else None,
            }
            if int(fields.get("s", 0)) > applied
            else None
        ),
        # None too while a worker's lease covers it (HELD_PLACE_MS): it is looked at when that
        # lease lapses.
        "next_look_in_s": (
            round((float(due) - now) / 1000, 3)
            if due is not None and float(due) < HELD_PLACE_MS
            else None
        ),
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


async def message_in_progress(redis: Redis, keys: Keys, session_id: str) -> str | None:
    """The msg_id of the message the session answers now: its first sequenced message not
    applied yet (running, waiting for its turn or for a person), or None when it has none (a
    message still unread in the inbound stream is not known here). Two reads, no script: a
    commit between them moves the session on, and the next message is looked at (at most a few
    times: a session committing that fast answers nothing for long)."""
    state = keys.session(session_id).state
    for _ in range(3):
        applied, last = await undecoded(redis, "HMGET", state, "a", "s")
        done, sequenced = _int_bytes(applied), _int_bytes(last)
        if done is None or sequenced is None or sequenced <= done:
            return None
        raw = await undecoded(redis, "HGET", state, f"q{done + 1}")
        if raw is None:
            continue  # committed meanwhile
        held = unpack_custody(raw)
        if held is None:
            return None
        entry_id, fields = held
        msg_id = fields.get(b"msg_id") or entry_id.encode()  # msg_id defaults to the entry id
        try:
            return msg_id.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def _int_bytes(value: bytes | None) -> int | None:
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        return None
