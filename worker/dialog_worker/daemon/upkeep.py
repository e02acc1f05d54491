"""The shards' upkeep: sessions of the ready set that are due (a crashed holder's lease ran
out, a retry's backoff is over: lua/resume-3.lua), due timers (lua/fire-3.lua), entries left
pending in the group by anything else, and consumers that left."""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.abc
import structlog
from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.daemon.pipeline import Job
from dialog_worker.daemon.reader import INTAKE_BATCH, Reader
from dialog_worker.daemon.sessions import Sessions
from dialog_worker.daemon.shard import Shard
from dialog_worker.metrics import Metrics
from dialog_worker.store.keys import HELD_PLACE_MS, Keys
from dialog_worker.store.scripts import Scripts

log = structlog.get_logger("dialog_worker.daemon.upkeep")

# How long the resumer sleeps when no session waits in the ready set (or only sessions held
# under live worker leases): what is added later kicks it (a release, a hand-back, a lapsed
# worker lease's sessions) or is due a lock lease from then.
RESUME_IDLE_S = 1.0
# The resumer takes a slot for a session due this soon by this worker's clock (the script
# decides by Redis's): a clock a little behind Redis's costs a poll interval, no more.
DUE_SLACK_MS = 50
# The resumer compares the ready set's scores (Redis's clock) with this worker's clock plus
# the difference between the two, learnt with one TIME call at most this often, and only while
# the first session waits for a later time: a Redis clock that stepped ahead (an hour, say)
# must not leave due sessions looking an hour away to every resumer.
CLOCK_CHECK_S = 1.0
# How often the worker doing a shard's upkeep (Shard.does_upkeep) looks for due timers (one
# ZRANGE of the first; the fire script only when one is due): the most a timer is appended
# after it is due, while that worker lives.
TIMER_POLL_S = 0.25


class Upkeep:
    """The resumer, the timers and the reclaimer of every shard of one worker."""

    def __init__(
        self,
        settings: Settings,
        raw: Redis,
        redis: Redis,
        scripts: Scripts,
        housekeeping: Scripts,
        metrics: Metrics,
        sessions: Sessions,
        reader: Reader,
    ) -> None:
        self.settings = settings
        self.raw = raw
        self.redis = redis
        self.scripts = scripts
        self.housekeeping = housekeeping
        self.metrics = metrics
        self.sessions = sessions
        self.reader = reader
        self.redis_ahead_ms = 0.0  # Redis's clock minus this worker's, as last learnt
        self.clock_checked = -CLOCK_CHECK_S  # time.monotonic() of that

    def redis_now_ms(self) -> float:
        """Redis's clock as this worker last learnt it (see CLOCK_CHECK_S)."""
        return time.time() * 1000 + self.redis_ahead_ms

    async def learn_redis_clock(self) -> None:
        seconds, micros = await self.raw.time()
        self.redis_ahead_ms = seconds * 1000 + micros / 1000 - time.time() * 1000
        self.clock_checked = time.monotonic()

    async def resume_once(self, shard: Shard, work: anyio.abc.TaskGroup) -> float:
        """Take up due sessions of the ready set, as many as there are free slots. Waits for
        one slot first, ahead of the reader (see SlotGate), and no commit fills a freed slot
        from the queues while it waits: a due session is taken up within one poll interval
        plus the time until the next slot frees up, whatever the backlog. Nothing due, it
        still hands free slots to sessions waiting in the tenants' queues (a slot a release
        freed, say), without waiting for one."""
        if not shard.group_ready:
            return self.settings.promote_interval_ms / 1000
        k, s = shard.keys, self.settings
        await self.sessions.ensure_lease(k)  # before the first lock it takes
        head = await self.raw.zrange(k.ready, 0, 0, withscores=True)
        if not head or float(head[0][1]) >= HELD_PLACE_MS:
            # One cheap look instead of a script call while idle, then a wait on the kick
            # list, where a resume of a parked session (lua/resolve-2.lua), an interrupt's
            # timeout (lua/fire-3.lua) or a lapsed worker lease's sessions (lua/lease-2.lua)
            # wake an idle resumer at once. Sessions held under live worker leases need no
            # look: thousands of steps in flight cost one blocking call a second, not ten
            # looks.
            await self.wait_for_kick(shard)
            return 0
        ahead_ms = float(head[0][1]) - self.redis_now_ms()
        if ahead_ms > DUE_SLACK_MS and time.monotonic() - self.clock_checked >= CLOCK_CHECK_S:
            await self.learn_redis_clock()
            ahead_ms = float(head[0][1]) - self.redis_now_ms()
        if ahead_ms <= DUE_SLACK_MS:
            await shard.slots.acquire(priority=True)
            slots = 1 + self.reader.take_free_slots(shard)
        elif shard.slots.free and await self.raw.exists(k.tenants_active):
            slots = self.reader.take_free_slots(shard)
        else:
            # Nothing due yet (sessions in flight are there until their leases end).
            return min(s.promote_interval_ms, ahead_ms) / 1000
        args: list[Any] = [
            min(slots, INTAKE_BATCH),
            self.sessions.token_base(k.shard),
            self.sessions.lock_ttl_ms(k.shard),
            int(s.gap_timeout_s * 1000),
            s.tenant_lua_pattern,
            s.merge_spec,
        ]
        try:
            rows, wait_ms = await self.sessions.in_doubt(  # shielded, asked again if lost
                k.shard,
                lambda: self.scripts.resume(keys=[k.stream, k.ready, k.session_prefix], args=args),
            )
            jobs = [Job.from_script(k, row[1:], gap=row[0] == b"g") for row in rows]
        except BaseException:
            self.sessions.give_slots(shard, slots)
            raise
        self.sessions.give_slots(shard, slots - len(jobs))
        for job in jobs:
            # Taken over from a holder whose lease ran out: an earlier delivery was counted
            # (attempts > 1) and neither committed nor released with an error. A hand-back at
            # shutdown gives its attempt back or records why it kept it, and a failed attempt
            # records its error, so none counts; nor does a session resumed only because its
            # next entry was missing at hand-off time.
            if not job.gap and job.attempts > 1 and not job.last_error:
                self.metrics.reclaimed.inc()
            work.start_soon(self.sessions.run_session, shard, job)
        if jobs and len(jobs) == slots:
            return 0
        if int(wait_ms) < 0:
            return RESUME_IDLE_S
        return min(s.promote_interval_ms, max(int(wait_ms), 5)) / 1000

    async def wait_for_kick(self, shard: Shard) -> None:
        """Block on the shard's kick list for at most `RESUME_IDLE_S`: an element pushed since
        this resumer's look at the ready set is still there (a kick keeps one), so none is
        missed; one idle resumer takes it, and the others look at their next round."""
        await self.raw.blpop([shard.keys.kick], timeout=RESUME_IDLE_S)

    async def fire_once(self, shard: Shard) -> float:
        """Append the shard's due timers to its inbound stream (lua/fire-3.lua: each timer
        exactly once, whichever workers call it). Upkeep (Shard.does_upkeep): the waiter, or
        every worker that knows of none, looks every `TIMER_POLL_S`; a timer is appended at
        most about that long after it is due (about 2 waiter leases if the waiter dies), then
        sequenced like any message (the reader wakes for it like for any append)."""
        if not shard.group_ready or not shard.does_upkeep():
            return TIMER_POLL_S
        k = shard.keys
        first = await self.raw.zrange(k.timers, 0, 0, withscores=True)
        if not first or float(first[0][1]) > time.time() * 1000 + TIMER_POLL_S * 1000:
            return TIMER_POLL_S  # one cheap look instead of a script call
        with anyio.CancelScope(shield=True):
            fired, wait_ms = await self.scripts.fire(
                keys=[k.stream, k.ready, k.session_prefix], args=[INTAKE_BATCH]
            )
        if int(fired):
            log.info("timers_fired", shard=shard.label, fired=int(fired))
        if int(fired) == INTAKE_BATCH:
            return 0
        if int(wait_ms) < 0:
            return TIMER_POLL_S
        return min(TIMER_POLL_S, max(int(wait_ms), 5) / 1000)

    async def reclaim_once(self, shard: Shard, work: anyio.abc.TaskGroup) -> float:
        """Entries pending in the group past the visibility timeout. The intake acks what it
        delivers in the same step, so only something else leaves entries pending (another
        reader of the group, an older version): they are sequenced like new ones. Upkeep
        (Shard.does_upkeep): run by the waiter, or by every worker that knows of none."""
        if not shard.group_ready or not shard.does_upkeep():
            return self.settings.reclaim_interval_ms / 1000
        consumers = await self.redis.xinfo_consumers(shard.keys.stream, shard.keys.group)
        slots = (
            self.reader.take_free_slots(shard) if any(int(c["pending"]) for c in consumers) else 0
        )
        if slots:
            try:
                reply = await self.reader.intake(shard, slots, self.settings.visibility_timeout_ms)
            except BaseException:
                self.sessions.give_slots(shard, slots)
                raise
            if int(reply[1]):
                self.metrics.reclaimed.inc(int(reply[1]))
                log.info("reclaimed", count=int(reply[1]), shard=shard.keys.shard)
            self.sessions.start(shard, work, reply, slots)
        await self.delete_idle_consumers(shard.keys, consumers)
        return self.settings.reclaim_interval_ms / 1000

    async def delete_idle_consumers(self, keys: Keys, consumers: list[Any]) -> None:
        idle_ms = self.settings.consumer_idle_delete_s * 1000
        for consumer in consumers:
            name = consumer["name"]
            if (
                name != self.settings.consumer
                and int(consumer["pending"]) == 0
                and int(consumer["idle"]) >= idle_ms
            ):
                deleted = await self.housekeeping.delconsumer(
                    keys=[keys.stream], args=[keys.group, name, idle_ms]
                )
                if int(deleted):
                    log.info("consumer_deleted", deleted_consumer=name, shard=keys.shard)
