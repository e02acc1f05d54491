"""Offline change of the shard count (`dialog-worker reshard --to N`).

Session keys carry their shard's hash tag, so a new shard count gives every session new key
names. The procedure is offline: stop producers, let the workers drain every shard (nothing
in any stream, pending list or delayed set), stop the workers, run this, then start workers
(and producers) with the new DIALOG_SHARDS. It refuses to run on a queue that is not drained.

Moved: each session's state hash (state, version, applied_seq, last seq: a session continues
where it was) and its dedupe keys, with their remaining TTL; dead letters (re-added to the
new shard of their session, so their IDs change). Not moved: reply streams (outputs: let their
consumers finish reading the old ones), the emptied inbound streams and delayed sets (deleted).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from worker.config import Settings
from worker.keys import Keys, Topology
from worker.streams import scan_all
from worker.views import queue_stats

_UNESCAPE = re.compile(r"%(25|7B|7D)")
_CHARS = {"25": "%", "7B": "{", "7D": "}"}


def unescape_tag(escaped: str) -> str:
    return _UNESCAPE.sub(lambda m: _CHARS[m.group(1)], escaped)


@dataclasses.dataclass
class ReshardReport:
    sessions: int = 0
    dedupe_keys: int = 0
    dead_letters: int = 0
    unchanged: int = 0
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class NotDrained(Exception):
    """The queue still holds messages: resharding now would strand them."""


async def reshard(
    redis: Redis, old: Settings, new: Settings, dry_run: bool = False
) -> ReshardReport:
    before, after = Topology.from_settings(old), Topology.from_settings(new)
    for keys in before.shards:
        stats = await queue_stats(redis, keys)
        busy = {k: stats[k] for k in ("stream_length", "pending", "delayed") if stats[k]}
        if busy:
            raise NotDrained(f"shard {keys.shard} ({keys.stream}) is not drained: {busy}")
    report = ReshardReport(dry_run=dry_run)
    # Every old key is listed before anything moves: an old and a new shard can share a tag,
    # and keys moved into it must not be met again as old ones.
    found = [(keys, await _session_keys(redis, keys)) for keys in before.shards]
    for keys, session_keys in found:
        await _move_sessions(redis, keys, session_keys, after, report, dry_run)
    for keys in before.shards:
        await _move_dead_letters(redis, keys, after, report, dry_run)
        if not dry_run and keys.stream not in {k.stream for k in after.shards}:
            await redis.delete(keys.stream)
            await redis.delete(keys.ready)
    return report


def _session_pattern(keys: Keys) -> str:
    tag = f":{{{keys.tag}}}" if keys.tag else ""
    # SCAN's glob treats [ and ] and \\ specially; the prefix is a plain name without them.
    return f"{keys.prefix}{tag}:s:{{*"


async def _session_keys(redis: Redis, keys: Keys) -> set[str]:
    """A set, because a cluster scan could meet a key twice."""
    scan_kwargs: dict[str, Any] = {}
    if isinstance(redis, RedisCluster):
        scan_kwargs["target_nodes"] = RedisCluster.PRIMARIES
    pattern = _session_pattern(keys)
    return {key async for key in redis.scan_iter(match=pattern, count=1000, **scan_kwargs)}


async def _move_sessions(
    redis: Redis,
    keys: Keys,
    found: set[str],
    after: Topology,
    report: ReshardReport,
    dry_run: bool,
) -> None:
    head = _session_pattern(keys)[:-1]  # ends with ":s:{"
    for key in sorted(found):
        escaped, _, role = key[len(head) :].partition("}:")
        session_id = unescape_tag(escaped)
        target = after.for_session(session_id).session(session_id)
        if role == "state":
            new_key = target.state
            report.sessions += 1
        elif role.startswith("msg:"):
            new_key = target.dedupe(role[len("msg:") :])
            report.dedupe_keys += 1
        else:
            continue  # lock or parked index: none survive a drained queue
        if new_key == key:
            report.unchanged += 1
            continue
        if dry_run:
            continue
        ttl_ms = await redis.pttl(key)
        if role == "state":
            fields = cast(dict[str, str], await redis.hgetall(key))
            await redis.hset(new_key, mapping=cast(Any, fields))
        else:
            await redis.set(new_key, await redis.get(key) or "")
        if ttl_ms > 0:
            await redis.pexpire(new_key, ttl_ms)
        await redis.delete(key)


async def _move_dead_letters(
    redis: Redis, keys: Keys, after: Topology, report: ReshardReport, dry_run: bool
) -> None:
    if keys.dlq in {k.dlq for k in after.shards}:
        return
    for _, fields in await scan_all(redis, keys.dlq):
        report.dead_letters += 1
        session_id = fields.get("session_id", "")
        target = after.for_session(session_id) if session_id else after.shards[0]
        if not dry_run:
            await redis.xadd(target.dlq, cast(Any, dict(fields)))
    if not dry_run:
        await redis.delete(keys.dlq)
