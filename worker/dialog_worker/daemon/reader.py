"""Intake: one reader per shard takes new entries of the inbound stream (lua/intake-5.lua:
deliver, give each its seq, lock the session), as many as the shard has free slots, and
starts their sessions; when the stream is empty it waits for the next append, one blocked
reader per shard for the whole pool (the waiter role, see Reader.idle_wait)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
import redis.exceptions
import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from dialog_worker.config import Settings
from dialog_worker.daemon.sessions import IN_DOUBT_ERRORS, Sessions
from dialog_worker.daemon.shard import Shard
from dialog_worker.store.codec import MAX_EXTRA_FIELDS
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Scripts
from dialog_worker.version import __version__

log = structlog.get_logger("dialog_worker.daemon.reader")

# Most entries one intake call reads (the script refuses more).
INTAKE_BATCH = 1000
# Entries a reader's intake call reads at least, whatever its free slots: the sessions that
# may start beyond them join their tenants' queues (lua/_common.lua, the tenants), where a
# slot freed by any worker's commit finds the one owed it.
READ_BATCH_SHORT_OF_SLOTS = 64
# Where tenants are in use, a reader with no free slot still reads new entries into their
# sessions and queues (so the scheduler sees every tenant's messages, not only the backlog
# ahead of them), once a slot frees or after this long, whichever comes first: under a backlog
# the calls read batches. Without tenants it waits for a slot, as the unread backlog stays in
# the stream, where an autoscaler reads it (XLEN).
READ_WITHOUT_SLOTS_S = 0.02
# How often a reader with no free slot asks whether the shard has tenants in use (named by an
# entry, or given settings: Reader.tenants_in_use): one EXISTS.
TENANTS_RECHECK_S = 1.0
# The waiter role of a shard (see Reader.idle_wait): a lease at least this long (and three
# blocking reads), renewed when half of it is left; a worker that waits on the wake stream asks
# whether the role is free this often (a waiter that died leaves it to expire), and blocks
# on the wake stream as long in between (WAKE_BLOCK_MAX_MS at most).
WAITER_LEASE_MS = 3000
# Below the connections' socket timeout (5 s, redis_conn.py): a blocking read that outlasts
# it fails.
WAKE_BLOCK_MAX_MS = 3000
# Shutdown ends a blocked read with an intake call behind it by an entry on the wake stream
# (Reader.end_reads_ahead); one that reached Redis before the read did is sent again after this.
READ_END_WAIT_S = 0.05
# The wake stream's consumer group (one per shard, readers of every worker join it).
WAKE_GROUP = "readers"
# A worker that finished a message this recently is active: it blocks on the inbound stream
# itself, waiter or not, so a pool under steady traffic reads in parallel (each woken reader
# finds work) and no message waits for a hand-over; after this long without work it goes back
# to the wake stream.
ACTIVE_WINDOW_S = 2.0
# An idle waiter runs an intake call this often even when its blocking read saw nothing: the
# group's position can move back (docs/runbook.md: a pushed-ahead stream's recovery resets it),
# and a read from the old position would never return.
IDLE_RECHECK_S = 5.0


class Reader:
    """The intake of every shard of one worker."""

    def __init__(
        self,
        settings: Settings,
        raw: Redis,
        redis: Redis,
        scripts: Scripts,
        shards: list[Shard],
        sessions: Sessions,
        stopping: anyio.Event,
        on_ready: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.raw = raw
        self.redis = redis
        self.scripts = scripts
        self.shards = shards
        self.sessions = sessions
        self.stopping = stopping
        self.on_ready = on_ready  # every shard's group is there

    async def ensure_group(self, shard: Shard) -> None:
        keys = shard.keys
        try:
            await self.redis.xgroup_create(keys.stream, keys.group, id="0", mkstream=True)
            log.info("group_created", stream=keys.stream, group=keys.group)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        await self.ensure_wake_group(keys)
        shard.group_ready = True
        if all(s.group_ready for s in self.shards):
            self.on_ready()

    async def ensure_wake_group(self, keys: Keys) -> None:
        try:
            await self.raw.xgroup_create(keys.wake, WAKE_GROUP, id="$", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def take_free_slots(self, shard: Shard) -> int:
        return shard.slots.take(shard.slots.free)

    def intake_call(
        self, shard: Shard, count: int, claim_idle_ms: int = 0, free: int | None = None
    ) -> tuple[list[str], list[Any]]:
        """The intake script's keys and arguments (lua/intake-5.lua): read up to `count`
        entries, hand out up to `free` slots (default: `count`)."""
        k, s = shard.keys, self.settings
        return [k.stream, k.ready, k.session_prefix, k.dlq, k.replies], [
            k.group,
            s.consumer,
            min(count, INTAKE_BATCH),
            self.sessions.token_base(k.shard),
            self.sessions.lock_ttl_ms(k.shard),
            s.dedupe_ttl_s,
            s.max_message_bytes,
            MAX_EXTRA_FIELDS,
            s.reply_maxlen,
            __version__,
            claim_idle_ms,
            s.fallback_reply,
            k.shard,
            len(self.shards),
            s.multitask,
            s.echo_fields,
            count if free is None else free,
            s.tenant_lua_pattern,
            s.partial_ttl_s,
            s.merge_spec,
            s.lock_ttl_ms,  # when outstanding work without a place is looked at
        ]

    async def intake(
        self, shard: Shard, count: int, claim_idle_ms: int = 0, free: int | None = None
    ) -> list[Any]:
        keys, args = self.intake_call(shard, count, claim_idle_ms, free)
        # Shielded: entries the script delivered are ours (locked or queued), so the reply
        # must be seen and its jobs started, whatever is cancelled meanwhile; a reply lost
        # on the way is asked for again.
        reply = await self.sessions.in_doubt(
            shard.keys.shard, lambda: self.scripts.intake(keys=keys, args=args)
        )
        return cast(list[Any], reply)

    async def read_once(self, shard: Shard, work: anyio.abc.TaskGroup) -> float:
        if not shard.group_ready:
            await self.ensure_group(shard)
        await self.sessions.ensure_lease(shard.keys)  # before the first lock it takes
        if shard.slots.free == 0 and shard.lease_until:
            await self.hand_over(shard)  # busy: another worker waits for new entries
        slots = self.take_free_slots(shard)
        if not slots and not await self.tenants_in_use(shard):
            await shard.slots.acquire()
            slots = 1 + self.take_free_slots(shard)
        elif not slots:
            with anyio.move_on_after(READ_WITHOUT_SLOTS_S):
                await shard.slots.acquire()
                slots = 1 + self.take_free_slots(shard)
        # With free slots a call reads about as many entries (a batch at least); with none it
        # reads what there is, up to INTAKE_BATCH: those sessions wait in their tenants'
        # queues, and the next slot freed anywhere goes to the one owed it.
        entries = max(slots, READ_BATCH_SHORT_OF_SLOTS) if slots else INTAKE_BATCH
        try:
            reply = await self.intake(shard, entries, free=slots)
        except redis.exceptions.ResponseError as exc:
            self.sessions.give_slots(shard, slots)
            if "NOGROUP" in str(exc):
                # The stream or group vanished (a Redis restart without persistence, a
                # deleted key): create them again rather than spin.
                shard.group_ready = False
                return 0
            raise
        except BaseException:
            self.sessions.give_slots(shard, slots)
            raise
        last_id, read = reply[0], int(reply[1])
        waiting = self.sessions.start(shard, work, reply, slots)
        if waiting and read and not shard.slots.free:
            await self.wake_one(shard)  # sessions wait for slots another worker may have
        if read < min(entries, INTAKE_BATCH):
            # The stream had no more: wait (a blocking read from the last id returns at once
            # if something came meanwhile) rather than run another intake call to find out.
            await self.commits_first(read)
            await self.idle_wait(shard, last_id, work)
        return 0

    async def tenants_in_use(self, shard: Shard) -> bool:
        """Whether tenants share this shard: DIALOG_TENANT_PATTERN is set, an entry named a
        tenant lately (the shard's mark, set by the intake), or some tenant has settings
        (`dialog-worker tenants set`); looked up every TENANTS_RECHECK_S, one command for
        both."""
        if self.settings.tenant_pattern:
            return True
        now = time.monotonic()
        if now - shard.tenants_checked_at >= TENANTS_RECHECK_S:
            shard.tenants_checked_at = now
            found = await self.raw.exists(shard.keys.tenant_settings, shard.keys.tenants_named)
            shard.tenants_configured = bool(found)
        return shard.tenants_configured

    @staticmethod
    async def commits_first(started: int) -> None:
        """After an intake call that started sessions, before the reader's next call: the
        sessions go first. In one turn of the event loop each runs its step (one that awaits
        nothing, as the built-in engine's) up to its commit, in the next the committer sends
        it. A lone message's commit then leaves before this reader's next call, not behind
        it."""
        if started:
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()

    async def idle_wait(
        self, shard: Shard, last_id: bytes, work: anyio.abc.TaskGroup | None = None
    ) -> None:
        """Nothing to read: wait until there is. One reader per shard, the waiter (the holder
        of a short lease on the shard's waiter key), blocks on the inbound stream itself, so
        an append wakes one worker, not every replica. The other readers block on the shard's
        wake stream in a consumer group: Redis hands each entry appended there to exactly one
        of them. The waiter keeps its role while it has nothing in flight (a lone message costs
        no hand-over); woken while busy, it hands the role on (deletes the key, appends to the
        wake stream) before it reads, so one more worker joins. A worker that finished a
        message within ACTIVE_WINDOW_S blocks on the stream too, waiter or not: under steady
        traffic the active workers read in parallel, as many as the rate keeps busy, and an
        idle pool is back to one blocked reader within that window. A waiter that dies leaves the
        key to expire (the lease); the others ask for it that often. A wait that times out
        waits again without an intake call (the waiter runs one every IDLE_RECHECK_S). It
        returns once another loop's Redis failure asked for a fresh group check.
        With `work` and two free slots or more, a read on the inbound stream carries its
        intake call behind it (see read_ahead)."""
        keys = shard.keys
        block = self.settings.read_block_ms
        since = time.monotonic()
        while True:
            if not shard.group_ready:
                # Another loop met a Redis failure: the group check is the reader's to make
                # (read_once), and the resumer and the timers wait for it.
                return
            waiter = await self.take_waiter_role(shard)
            if waiter or time.monotonic() - self.sessions.last_finished < ACTIVE_WINDOW_S:
                if work is not None and self.can_read_ahead(shard):
                    next_id = await self.read_ahead(shard, work, last_id, waiter)
                    if next_id is None:
                        return
                    last_id = next_id
                    continue
                # From the last delivered id, not "$": an entry appended between the empty
                # intake and this call would be missed until the next timeout.
                got = await self.raw.xread({keys.stream: last_id}, count=1, block=block)
                if not got:
                    if time.monotonic() - since >= IDLE_RECHECK_S:
                        return
                    continue
                if waiter and self.sessions.leases:
                    await self.hand_over(shard)
                return
            try:
                woken = await self.raw.xreadgroup(
                    WAKE_GROUP,
                    self.settings.consumer,
                    {keys.wake: ">"},
                    count=1,
                    block=self.wake_block_ms(),
                    noack=True,
                )
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.ensure_wake_group(keys)
                continue
            if woken:
                # The waiter was busy when entries came: read now, then ask for the role.
                shard.lease_checked_at = 0.0
                return

    def can_read_ahead(self, shard: Shard) -> bool:
        # One slot stays free for the resumer (a due session is not kept waiting by a read
        # that blocks); the Cluster client sends a pipeline its own way: it reads, then calls.
        return (
            shard.slots.free >= 2
            and not isinstance(self.raw, RedisCluster)
            and not self.stopping.is_set()  # a stopping reader's read may be cancelled
        )

    async def read_ahead(
        self, shard: Shard, work: anyio.abc.TaskGroup, last_id: bytes, waiter: bool
    ) -> bytes | None:
        """A blocking read on the inbound stream with the intake call queued behind it on the
        same connection, in one write: Redis runs the intake the moment the read returns, an
        entry's arrival or the read's timeout, with no round trip back to this process in
        between: a lone message costs the woken worker two round trips, not three, and loses
        the Python between the read and the call. The intake reads as many entries as the
        free slots less the one left for the resumer, which are taken until it answers. Each
        read that times out runs its intake call (an idle pool's price: 15 commands with
        those the script runs, per DIALOG_READ_BLOCK_MS).

        Returns the id to wait from next, or None when the plain intake call should follow:
        the intake filled every slot it had (more may be waiting), or it failed (the plain
        call meets the same error and handles it: NOSCRIPT, NOGROUP, out of memory).
        Shielded, as every intake call: the read also watches the shard's wake stream (from
        its end), where shutdown appends one entry to end it at once (end_reads_ahead)."""
        count = shard.slots.take(min(shard.slots.free - 1, INTAKE_BATCH))
        k = shard.keys
        keys, args = self.intake_call(shard, count, free=count)
        done = shard.read_ahead_done = anyio.Event()
        try:
            try:
                with anyio.CancelScope(shield=True):
                    async with self.raw.pipeline(transaction=False) as pipe:
                        pipe.xread(
                            {k.stream: last_id, k.wake: "$"},
                            count=1,
                            block=self.settings.read_block_ms,
                        )
                        pipe.evalsha(self.scripts.intake.sha, len(keys), *keys, *args)
                        _, reply = await pipe.execute(raise_on_error=False)
            except IN_DOUBT_ERRORS:  # the intake may have run: asked for again, alone
                reply = await self.sessions.in_doubt(
                    k.shard, lambda: self.scripts.intake(keys=keys, args=args)
                )
        except BaseException:
            self.sessions.give_slots(shard, count)
            raise
        finally:
            done.set()
        if isinstance(reply, Exception):
            self.sessions.give_slots(shard, count)
            return None
        busy = bool(self.sessions.leases)
        self.sessions.start(shard, work, reply, count)
        read = int(reply[1])
        await self.commits_first(read)
        if read and waiter and busy:
            await self.hand_over(shard)  # woken while busy: one more worker joins
        return None if read >= count else cast(bytes, reply[0])

    def lease_ms(self) -> int:
        # At least three blocking reads long: a lease renewed with half of it left outlasts
        # the read that follows.
        return max(WAITER_LEASE_MS, 3 * self.settings.read_block_ms)

    def wake_block_ms(self) -> int:
        # A reader on the wake stream asks for the waiter role once a lease: blocking that
        # long in between (not one read_block_ms) costs one read per check, not three.
        return max(self.settings.read_block_ms, min(self.lease_ms(), WAKE_BLOCK_MAX_MS))

    async def take_waiter_role(self, shard: Shard) -> bool:
        now = time.monotonic()
        lease_s = self.lease_ms() / 1000
        if shard.lease_until - now > lease_s / 2:
            return True
        if not shard.lease_until and now - shard.lease_checked_at < lease_s:
            return False  # another worker waits; it hands over through the wake stream
        shard.lease_checked_at = now
        me = self.settings.consumer.encode()
        holder = await self.raw.set(shard.keys.waiter, me, nx=True, px=self.lease_ms(), get=True)
        if holder == me:
            await self.raw.pexpire(shard.keys.waiter, self.lease_ms())
        elif holder is not None:
            shard.lease_until = 0.0
            # Alive until we ask again (a lease from now) and a wake-stream read after that.
            shard.waiter_seen_until = now + 2 * lease_s
            return False
        shard.lease_until = now + lease_s
        shard.waiter_seen_until = 0.0
        return True

    async def wake_one(self, shard: Shard) -> None:
        """Wake one other reader of the shard (it reads, and hands out its free slots to the
        sessions waiting in the queues): the waiter hands its role over, any other reader
        appends to the wake stream."""
        if shard.lease_until:
            await self.hand_over(shard)
        else:
            await self.raw.xadd(
                shard.keys.wake, {"from": self.settings.consumer}, maxlen=1, approximate=False
            )

    async def hand_over(self, shard: Shard) -> None:
        """Give up the waiter role and wake one other reader (it takes the role if free)."""
        if not shard.lease_until:
            return
        shard.lease_until = 0.0
        shard.lease_checked_at = time.monotonic()
        async with self.raw.pipeline(transaction=False) as pipe:
            pipe.delete(shard.keys.waiter)
            pipe.xadd(
                shard.keys.wake, {"from": self.settings.consumer}, maxlen=1, approximate=False
            )
            await pipe.execute()

    async def end_reads_ahead(self) -> None:
        """At shutdown: a read that carries an intake call is never cancelled (the call could
        run after the reader gave up on its reply): the read also watches the wake stream, and
        one entry there ends it now, not after DIALOG_READ_BLOCK_MS. Another worker's wake read
        may take the entry as well: it looks for new entries, as at any hand-over. An entry
        that reached Redis before the read did (from "$" on) does not end it: another one goes
        after READ_END_WAIT_S."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            for shard in self.shards:
                while shard.read_ahead_done is not None and not shard.read_ahead_done.is_set():
                    try:
                        await self.raw.xadd(
                            shard.keys.wake,
                            {"from": self.settings.consumer},
                            maxlen=1,
                            approximate=False,
                        )
                    except redis.exceptions.RedisError as exc:
                        log.warning("read_not_ended", error=str(exc), shard=shard.label)
                        break
                    with anyio.move_on_after(READ_END_WAIT_S):
                        await shard.read_ahead_done.wait()

    async def leave_waiter_roles(self) -> None:
        """At shutdown: another worker takes over waiting at once, not when the lease ends."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            for shard in self.shards:
                try:
                    await self.hand_over(shard)
                    await self.raw.xgroup_delconsumer(
                        shard.keys.wake, WAKE_GROUP, self.settings.consumer
                    )
                except redis.exceptions.RedisError as exc:
                    log.warning("waiter_hand_over_failed", error=str(exc), shard=shard.label)
