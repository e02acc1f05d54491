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
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Scripts

log = structlog.get_logger("dialog_worker.daemon.upkeep")

# How long the resumer sleeps when no session waits in the ready set: anything added later is
# due a lock lease or a backoff from then, except a hand-back at shutdown.
RESUME_IDLE_S = 1.0
# The resumer takes a slot for a session due this soon by this worker's clock (the script
# decides by Redis's): a clock a little behind Redis's costs a poll interval, no more.
DUE_SLACK_MS = 50
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
        head = await self.raw.zrange(k.ready, 0, 0, withscores=True)
        if not head:
            # One cheap look instead of a script call while idle, then a wait on the kick
            # list, where a resume of a parked session (lua/resolve-2.lua) or an interrupt's
            # timeout (lua/fire-3.lua) wakes an idle resumer at once.
            await self.wait_for_kick(shard)
            return 0
        ahead_ms = float(head[0][1]) - time.time() * 1000
        if ahead_ms <= DUE_SLACK_MS:
            await shard.slots.acquire(priority=True)
            slots = 1 + self.reader.take_free_slots(shard)
        elif shard.slots.free and await self.raw.exists(k.tenants_active):
            slots = self.reader.take_free_slots(shard)
        else:
            # Nothing due yet (sessions in flight are there until their leases end).
            return min(s.promote_interval_ms, ahead_ms) / 1000
        try:
            with anyio.CancelScope(shield=True):
                rows, wait_ms = await self.scripts.resume(
                    keys=[k.stream, k.ready, k.session_prefix],
                    args=[
                        min(slots, INTAKE_BATCH),
                        self.sessions.token_base(),
                        s.lock_ttl_ms,
                        int(s.gap_timeout_s * 1000),
                        s.tenant_lua_pattern,
                        s.merge_spec,
                    ],
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
