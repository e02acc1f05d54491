"""The message tasks of one worker: one per session whose lock it holds, each in a slot of its
shard, working the session through the pipeline (dialog_worker/daemon/pipeline.py); the
leases of those sessions, renewed here while their steps run; and the sessions an intake call
locked beyond the free slots, which wait here for one."""

from __future__ import annotations

import secrets
import time
from functools import partial
from typing import Any

import anyio
import anyio.abc
import structlog
from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.daemon.pipeline import Job, Pipeline
from dialog_worker.daemon.shard import Shard
from dialog_worker.daemon.slots import take_turns
from dialog_worker.metrics import Metrics
from dialog_worker.store.codec import fields_dict, text
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Scripts

log = structlog.get_logger("dialog_worker.daemon.sessions")


class MalformedNotice:
    """Entries intake refused (malformed: dead-lettered alone, with the reason and their raw
    fields) are logged, not only counted: the first at once, then at most one line every
    INTERVAL_S carrying how many were refused since the previous line, so a producer that
    floods bad entries cannot flood the log."""

    INTERVAL_S = 10.0

    def __init__(self) -> None:
        self.unlogged = 0
        self.logged_at = -self.INTERVAL_S

    def add(self, count: int, keys: Keys) -> None:
        self.unlogged += count
        now = time.monotonic()
        if now - self.logged_at >= self.INTERVAL_S:
            log.warning(
                "malformed_dead_lettered",
                count=self.unlogged,
                stream=keys.stream,
                dlq=keys.dlq,
                see="dialog-worker dlq list",
            )
            self.unlogged, self.logged_at = 0, now


class Sessions:
    """What one worker holds: the sessions it works, their leases and slots."""

    def __init__(
        self,
        settings: Settings,
        raw: Redis,
        scripts: Scripts,
        metrics: Metrics,
        pipeline: Pipeline,
        stopping: anyio.Event,
    ) -> None:
        self.settings = settings
        self.raw = raw
        self.scripts = scripts
        self.metrics = metrics
        self.pipeline = pipeline
        self.stopping = stopping
        self.leases: dict[str, Job] = pipeline.leases
        self._token_counter = 0
        # A restarted process may reuse its consumer name and pid (pid 1 in a container):
        # the nonce keeps its tokens apart from the locks its previous life still holds.
        self._token_nonce = f"{settings.consumer}:{secrets.token_hex(6)}"
        self.started = 0  # session tasks started, ever
        self.last_finished = 0.0  # monotonic s: when a session task last ended
        self.malformed = MalformedNotice()

    @staticmethod
    def give_slots(shard: Shard, n: int) -> None:
        shard.slots.release(n)

    def token_base(self) -> str:
        """Unique per script call: the scripts number the tokens they hand out after it."""
        self._token_counter += 1
        return f"{self._token_nonce}:{self._token_counter}"

    def start(self, shard: Shard, work: anyio.abc.TaskGroup, reply: list[Any], slots: int) -> bool:
        """One task per session whose lock the intake took (at most `slots`: the script hands
        out no more); its held entries go with it; the slots it did not fill go back.
        Synchronous: nothing may come between a script's reply and the start of its jobs.
        Returns whether sessions of the shard still wait in its tenants' queues."""
        _, _, rows, held_rows, counts = reply
        dups, refused, contended, trimmed, ahead, rejected, waiting = (int(c) for c in counts)
        if rejected:
            self.metrics.messages.labels("rejected").inc(rejected)
        if trimmed:
            self.metrics.inbound_trimmed.inc(trimmed)
            log.error("inbound_trimmed", count=trimmed, stream=shard.keys.stream)
        if ahead:
            self.metrics.inbound_id_ahead.inc()
            log.error("inbound_id_ahead", stream=shard.keys.stream)
        if dups:
            self.metrics.messages.labels("duplicate").inc(dups)
        if refused:
            self.metrics.messages.labels("dead_lettered").inc(refused)
            self.malformed.add(refused, shard.keys)
        if contended:
            self.metrics.lock_contended.inc(contended)
            self.metrics.retries.labels("contended").inc(contended)
        jobs = {}
        for row in rows:
            job = Job.from_script(shard.keys, row)
            jobs[job.session_id] = job
        for sid, _, entry_id, flat in held_rows:
            jobs[sid.decode("utf-8")].held[text(entry_id)] = fields_dict(flat)
        self.give_slots(shard, slots - len(jobs))
        for job in jobs.values():
            work.start_soon(self.run_session, shard, job)
        return waiting > 0

    async def run_session(self, shard: Shard, job: Job) -> None:
        self.started += 1
        self.metrics.in_flight.inc()
        try:
            await self.pipeline.run_session(job, partial(self.take_turns, shard))
        finally:
            self.metrics.in_flight.dec()
            self.give_slots(shard, 1)
            self.last_finished = time.monotonic()

    async def take_turns(self, shard: Shard, took_s: float) -> None:
        await take_turns(shard.slots, took_s, stopping=self.pipeline.stopping)

    async def renew_leases_once(self) -> float:
        """Renew the leases of steps still running, one call per shard."""
        ttl = self.settings.lock_ttl_ms
        due = time.monotonic() - ttl / 3000
        by_shard: dict[int, list[Job]] = {}
        for job in self.leases.values():
            if job.renewed_at < due and not job.lost:
                by_shard.setdefault(job.keys.shard, []).append(job)
        for jobs in by_shard.values():
            keys = jobs[0].keys
            args: list[Any] = [ttl]
            for job in jobs:
                args += [job.token, job.session_id]
            results = await self.scripts.renew(keys=[keys.ready, keys.session_prefix], args=args)
            now = time.monotonic()
            for job, ok in zip(jobs, results, strict=True):
                if int(ok):
                    job.renewed_at = now
                    self.metrics.lease_renewals.inc()
                else:
                    job.lost = True
                    if job.scope is not None:
                        job.scope.cancel()
                    log.warning("lease_lost", session_id=job.session_id, seq=job.seq)
        return ttl / 4000
