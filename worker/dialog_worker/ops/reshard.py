"""Offline change of the shard count (`dialog-worker reshard --to N --yes`).

Session keys carry their shard's hash tag, so a new shard count gives every session new key
names. The procedure is offline: stop producers, let the workers drain every shard, stop the
workers, run this (without --yes it only reports what it would do), then start workers (and
producers) with the new DIALOG_SHARDS.

It refuses, having changed nothing:
- while a worker may be live: a consumer of an old shard's group was active recently (XINFO
  CONSUMERS idle below `idle_threshold_ms`), or a worker holds an old shard's waiter role
  (every live idle pool has one; its lease lapses a few seconds after the worker is gone, and
  a worker that stops gives it up), unless forced;
- a shard that is not drained: entries in its inbound stream or pending list, sessions in its
  ready set, timers waiting, a session lock, a session with a sequenced message it has not
  applied;
- when the recorded shard count (keys.shards_key) is neither the configured one nor a reshard
  to the same target that was interrupted.

What moves, one key at a time, so that a run killed at any point can simply be run again and
copies nothing twice:
- each session's state hash (state, version, applied and last seq: a session continues where
  it was) and its dedupe keys: DUMP, RESTORE with the remaining PTTL, DEL of the old key. A
  key that expired meanwhile is skipped, never recreated without its TTL. A new key that
  exists already with the same value was copied by an interrupted run: only the old one is
  deleted. One with another value is a conflict: both are kept, and the run fails at the end.
  The session's msg_id index moves the same way.
- dead letters, every field pair as stored, re-added to their session's new shard (their IDs
  change) in a MULTI/EXEC that records the source entry in the target shard's progress set in
  the same step, then deleted from the old stream.
- Not moved: reply streams (outputs: let their consumers finish reading the old ones).
  Deleted: the old inbound streams (empty, with their groups) and ready sets, the progress
  sets. Last, the new shard count is recorded.

While it runs, the shard count key holds "resharding <old>-><new>": every worker and client,
whatever its DIALOG_SHARDS, refuses to start until a run completes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from dialog_worker.config import Settings
from dialog_worker.store.keys import Keys, Topology, shards_key
from dialog_worker.store.stream_entries import Entry, StreamReader

_UNESCAPE = re.compile(r"%(25|7B|7D)")
_CHARS = {"25": "%", "7B": "{", "7D": "}"}
# A page of dead letters read at a time.
LETTER_PAGE = 500


def unescape_tag(escaped: str) -> str:
    return _UNESCAPE.sub(lambda m: _CHARS[m.group(1)], escaped)


def in_progress_marker(old: int, new: int) -> str:
    """What the shard count key holds while a reshard from `old` to `new` runs."""
    return f"resharding {old}->{new}"


def idle_threshold_ms(settings: Settings) -> int:
    """A consumer idle for less than this may belong to a live worker: the shard's waiter
    (one per idle pool) looks for messages to reclaim every DIALOG_RECLAIM_INTERVAL_MS and
    reads every DIALOG_READ_BLOCK_MS. A read that returns nothing does not count as activity on
    Redis 7.0 (XINFO CONSUMERS idle moves only when entries are delivered or claimed), and the
    other workers of an idle pool block on the shard's wake stream: `_check_idle` also looks
    at the waiter role itself."""
    return 2 * max(settings.reclaim_interval_ms, settings.read_block_ms)


@dataclasses.dataclass
class ReshardReport:
    sessions: int = 0  # state hashes copied
    dedupe_keys: int = 0  # dedupe keys copied
    dead_letters: int = 0  # dead letters re-added to another shard
    unchanged: int = 0  # sessions whose keys keep their names in the new layout
    expired: int = 0  # keys that were gone when their turn came (skipped)
    already_moved: int = 0  # keys and dead letters an interrupted run had copied already
    conflicts: list[str] = dataclasses.field(default_factory=list)
    resumed: bool = False  # an interrupted run to the same shard count was continued
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Refused(Exception):
    """The deployment is not in a state to reshard; nothing was changed."""


class NotDrained(Refused):
    """The queue still holds messages (or a lock): resharding now would strand them."""


class ConsumersActive(Refused):
    """A consumer of the group was active recently: a worker may be running."""


class Interrupted(Exception):
    """Raised by a checkpoint to stop a run between two writes (fault injection); the partial
    report says what was done."""

    def __init__(self, report: ReshardReport) -> None:
        super().__init__(f"stopped after {report}")
        self.report = report


# Called before every write; it may raise (Interrupted) to stop the run right there.
Checkpoint = Callable[[], Awaitable[None]]


async def _no_checkpoint() -> None:
    return None


def stop_after(writes: int) -> Callable[[ReshardReport], Checkpoint]:
    """A checkpoint factory that stops a run once `writes` writes are done."""

    def make(report: ReshardReport) -> Checkpoint:
        done = 0

        async def checkpoint() -> None:
            nonlocal done
            if done >= writes:
                raise Interrupted(report)
            done += 1

        return checkpoint

    return make


async def reshard(
    redis: Redis,
    old: Settings,
    new: Settings,
    *,
    dry_run: bool = False,
    force: bool = False,
    checkpoint: Callable[[ReshardReport], Checkpoint] | None = None,
) -> ReshardReport:
    """Move a drained deployment from `old.shards` to `new.shards` shards. `redis` must
    return bytes (decode_responses off): dead letters keep their fields byte for byte."""
    before, after = Topology.from_settings(old), Topology.from_settings(new)
    report = ReshardReport(dry_run=dry_run)
    step = (checkpoint or (lambda _: _no_checkpoint))(report)
    report.resumed = await _check_recorded_count(redis, old, new)
    if not force:
        await _check_idle(redis, before.shards, idle_threshold_ms(old))
    # Every old key is listed (and checked) before anything moves: an old and a new shard can
    # share a tag, and keys moved into it must not be met again as old ones.
    found = [(keys, await _session_keys(redis, keys)) for keys in before.shards]
    for keys, session_keys in found:
        await _check_drained(redis, keys, session_keys)
    if not dry_run:
        await step()
        await redis.set(shards_key(old), in_progress_marker(old.shards, new.shards))
    mover = _Mover(redis, report, step, dry_run)
    for _, session_keys in found:
        for key, session_id, role in session_keys:
            await mover.session_key(key, after.for_session(session_id).session(session_id), role)
    for keys in before.shards:
        await mover.dead_letters(keys, after)
    if not dry_run:
        await mover.letter_indexes(found, after)
    if report.conflicts:
        raise Refused(
            f"{len(report.conflicts)} key(s) exist in both layouts with different values, "
            f"e.g. {report.conflicts[:3]}: both kept; resolve them and run again"
        )
    if dry_run:
        return report
    new_streams = {k.stream for k in after.shards}
    new_dlqs = {k.dlq for k in after.shards}
    for keys in before.shards:
        if keys.stream not in new_streams:
            await step()
            await redis.delete(keys.stream, keys.ready, keys.inbound, keys.ages)
        if keys.dlq not in new_dlqs:
            await step()
            await redis.delete(keys.dlq)
    for keys in after.shards:
        await step()
        await redis.delete(keys.reshard_moved)
    await step()
    await redis.set(shards_key(old), new.shards)
    return report


async def _check_recorded_count(redis: Redis, old: Settings, new: Settings) -> bool:
    """True when this run continues an interrupted one."""
    if old.shards == new.shards:
        raise Refused(f"the deployment is configured with {old.shards} shard(s) already")
    key = shards_key(old)
    raw = await redis.get(key)
    recorded = _text(raw) if raw is not None else None
    if recorded in (None, str(old.shards)):
        return False
    if recorded == in_progress_marker(old.shards, new.shards):
        return True
    raise Refused(
        f"Redis key {key!r} says {recorded!r}, not {old.shards} shard(s) as configured "
        f"(DIALOG_SHARDS): run reshard with the deployment's own shard count"
    )


async def _check_idle(redis: Redis, shards: Iterable[Keys], threshold_ms: int) -> None:
    active = []
    for keys in shards:
        try:
            consumers = await redis.xinfo_consumers(keys.stream, keys.group)
        except ResponseError:  # no stream or no group: nobody reads it
            consumers = []
        for c in consumers:
            if int(c["idle"]) < threshold_ms:
                active.append(f"{_text(c['name'])} (shard {keys.shard}, {int(c['idle'])} ms ago)")
        waiter = await redis.get(keys.waiter)
        if waiter is not None:
            left = int(await redis.pttl(keys.waiter))
            active.append(
                f"{_text(waiter)} (shard {keys.shard}, waiting for its messages; "
                f"that role lapses in {max(left, 0)} ms if the worker is gone)"
            )
    if active:
        raise ConsumersActive(
            f"{len(active)} worker(s) may be live (a consumer of the group active less than "
            f"{threshold_ms} ms ago, or a shard's waiter): {', '.join(active[:5])}; stop every "
            "worker first (--force if they are gone)"
        )


async def _check_drained(
    redis: Redis, keys: Keys, session_keys: list[tuple[bytes, str, str]]
) -> None:
    busy: dict[str, int] = {}
    length = int(await redis.xlen(keys.stream))
    if length:
        busy["stream_length"] = length
    try:
        for group in await redis.xinfo_groups(keys.stream):
            if _text(group["name"]) == keys.group and int(group["pending"]):
                busy["pending"] = int(group["pending"])
    except ResponseError:
        pass  # no stream: nothing pending
    ready = int(await redis.zcard(keys.ready))
    if ready:
        busy["ready"] = ready
    timers = int(await redis.zcard(keys.timers))
    if timers:
        busy["timers"] = timers  # they would fire into the old shard's stream
    locks = sum(1 for _, _, role in session_keys if role == "lock")
    if locks:
        busy["locks"] = locks
    outstanding = 0
    for key, _, role in session_keys:
        if role == "state":
            applied, last = await redis.hmget(key, "a", "s")
            outstanding += int(last or 0) > int(applied or 0)
    if outstanding:
        busy["sessions_with_unapplied_messages"] = outstanding
    if busy:
        raise NotDrained(f"shard {keys.shard} ({keys.stream}) is not drained: {busy}")


def _session_pattern(keys: Keys) -> str:
    # SCAN's glob treats [ and ] and \\ specially; the prefix is a plain name without them.
    return f"{keys.session_prefix}{{*"


async def _session_keys(redis: Redis, keys: Keys) -> list[tuple[bytes, str, str]]:
    """(key, session id, role) of every session key of the shard, once each (a cluster scan
    can meet a key twice). Keys that do not parse as a session key are left alone."""
    scan_kwargs: dict[str, Any] = {}
    if isinstance(redis, RedisCluster):
        scan_kwargs["target_nodes"] = RedisCluster.PRIMARIES
    head = keys.session_prefix.encode() + b"{"
    found = {
        key
        async for key in redis.scan_iter(match=_session_pattern(keys), count=1000, **scan_kwargs)
    }
    parsed = []
    for key in sorted(found):
        escaped, sep, role = key[len(head) :].partition(b"}:")
        if not sep or not key.startswith(head):
            continue
        try:
            parsed.append((key, unescape_tag(escaped.decode()), role.decode()))
        except UnicodeDecodeError:  # not written by a worker: ids are checked UTF-8
            continue
    return parsed


@dataclasses.dataclass
class _Mover:
    redis: Redis
    report: ReshardReport
    step: Checkpoint
    dry_run: bool

    async def session_key(self, key: bytes, target: Any, role: str) -> None:
        report = self.report
        if role == "state":
            new_key = target.state
        elif role.startswith("msg:"):
            new_key = target.dedupe(role[len("msg:") :])
        elif role == "ids":
            new_key = target.ids  # the msg_id index delete uses
        else:
            return  # a lock: refused by the drained check
        if new_key.encode() == key:
            if role == "state":
                report.unchanged += 1
            return
        r = self.redis
        async with r.pipeline(transaction=False) as pipe:
            pipe.pttl(key)
            pipe.dump(key)
            ttl_ms, payload = await pipe.execute()
        if payload is None or ttl_ms == -2:
            report.expired += 1
            return
        if not self.dry_run:
            await self.step()
            try:
                await r.restore(new_key, max(int(ttl_ms), 0), payload)
            except ResponseError as exc:
                if "BUSYKEY" not in str(exc):
                    raise
                if not await self._same(key, new_key, role):
                    report.conflicts.append(_text(key))
                    return
                report.already_moved += 1  # copied by an interrupted run
                await self.step()
                await r.delete(key)
                return
        # Counted as soon as the copy exists (a run stopped before the DEL did copy it).
        if role == "state":
            report.sessions += 1
        elif role != "ids":
            report.dedupe_keys += 1
        if not self.dry_run:
            await self.step()
            await r.delete(key)

    async def _same(self, key: bytes, new_key: str, role: str) -> bool:
        r = self.redis
        if role == "state":
            return bool(await r.hgetall(key) == await r.hgetall(new_key))
        if role == "ids":  # a sorted set (the msg_id index)
            old = await r.zrange(key, 0, -1, withscores=True)
            return bool(old == await r.zrange(new_key, 0, -1, withscores=True))
        return bool(await r.get(key) == await r.get(new_key))

    async def letter_indexes(
        self, found: list[tuple[Keys, list[tuple[bytes, str, str]]]], after: Topology
    ) -> None:
        """Each session's dead-letter index (SessionKeys.letters) in the new layout: every
        letter of the new shards added to its session's index (ZADD again of the same id is
        harmless, so a run stopped here and run again ends the same), then the old layout's
        index keys removed. Reads every letter once, as moving them did."""
        reader = StreamReader(self.redis)
        for keys in after.shards:
            cursor = "-"
            while True:
                rows = await reader.range(keys.dlq, cursor, "+", LETTER_PAGE)
                for entry in rows:
                    raw = entry.raw("session_id")
                    try:
                        session_id = raw.decode("utf-8") if raw else None
                    except UnicodeDecodeError:
                        session_id = None
                    if session_id is None or after.for_session(session_id).dlq != keys.dlq:
                        continue
                    index = keys.session(session_id).letters
                    if await self.redis.zscore(index, entry.id) is None:
                        await self.step()
                        with contextlib.suppress(ResponseError):  # another type, by hand
                            await self.redis.zadd(index, {entry.id: int(entry.id.split("-")[0])})
                if len(rows) < LETTER_PAGE:
                    break
                cursor = f"({rows[-1].id}"
        for _, session_keys in found:
            for key, session_id, role in session_keys:
                new_key = after.for_session(session_id).session(session_id).letters
                if role == "letters" and key != new_key.encode():
                    await self.step()
                    await self.redis.delete(key)

    async def dead_letters(self, keys: Keys, after: Topology) -> None:
        """Re-add each dead letter of the shard to its session's new shard, if that is
        another stream; the letters of a stream that stays in the new layout and belong to
        it stay where they are."""
        r = self.redis
        # Every field pair as stored, repeated names included (a malformed entry's letter).
        reader = StreamReader(r)
        cursor = "-"
        while True:
            rows = await reader.range(keys.dlq, cursor, "+", LETTER_PAGE)
            for entry in rows:
                target = _letter_target(entry, after)
                if target.dlq == keys.dlq:
                    continue
                if self.dry_run:
                    self.report.dead_letters += 1
                    continue
                await self.step()
                if await self._add_letter(target, f"{keys.dlq} {entry.id}", entry):
                    self.report.dead_letters += 1
                else:
                    self.report.already_moved += 1
                await self.step()
                await r.xdel(keys.dlq, entry.id)
            if len(rows) < LETTER_PAGE:
                return
            cursor = f"({rows[-1].id}"

    async def _add_letter(self, target: Keys, source: str, entry: Entry) -> bool:
        """Re-add one dead letter to its session's new shard at most once: the source (old
        stream and entry id) is recorded in the target shard's progress set in the same
        MULTI/EXEC as the XADD (both keys carry the target's hash tag), so a run killed after
        it and before the old entry's deletion re-adds nothing when run again. WATCH makes a
        second run at the same time (never meant to happen) fail the EXEC instead of adding a
        copy. A transaction, not a script: the operator needs no SCRIPT LOAD / EVALSHA."""
        async with self.redis.pipeline(transaction=True) as pipe:
            await pipe.watch(target.reshard_moved)
            if await pipe.sismember(target.reshard_moved, source):
                return False
            start_transaction: Callable[[], None] = pipe.multi  # untyped in redis-py
            start_transaction()
            pipe.execute_command("XADD", target.dlq, "*", *entry.flat())
            pipe.sadd(target.reshard_moved, source)
            await pipe.execute()
        return True


def _letter_target(entry: Entry, after: Topology) -> Keys:
    raw = entry.raw("session_id")
    try:
        session_id = raw.decode("utf-8") if raw else ""
    except UnicodeDecodeError:
        session_id = ""
    return after.for_session(session_id) if session_id else after.shards[0]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
