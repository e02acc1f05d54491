"""The message tasks of one worker: one per session whose lock it holds, each in a slot of its
shard, working the session through the pipeline (dialog_worker/daemon/pipeline.py); the
worker's lease on each shard, which covers all of them; and the sessions an intake call
locked beyond the free slots, which wait here for one.

Leases. Holding a step in flight costs Redis nothing per step: the worker renews one lease per
shard every third of DIALOG_LOCK_TTL_MS (lua/lease-2.lua), whatever the number of sessions it
holds. The locks it takes carry its number on the shard in their tokens, live
HELD_LOCK_TTL_FACTOR times the lock TTL, and keep their sessions out of the resumers' sight
until its lease lapses (the worker leases in lua/_common.lua). When it lapses (kill -9, a
pause, a partition) the next lease call of any worker of the pool brings its sessions back
through the ready set, where they are resumed as a lapsed per-session lease's were; the
token is still the fence of every write, so a paused worker's late commit is refused. A
worker that finds its own lease lapsed gives up every result held under it and takes a new
number. Only a step still running when its lock has lived a third of its long TTL is renewed
on its own (lua/renew-2.lua): rare, since DIALOG_STEP_TIMEOUT_S bounds a step."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.abc
import structlog
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dialog_worker.config import Settings
from dialog_worker.daemon.pipeline import HELD_LOCK_TTL_FACTOR, Job, Pipeline
from dialog_worker.daemon.shard import Shard
from dialog_worker.daemon.slots import take_turns
from dialog_worker.metrics import Metrics
from dialog_worker.store.codec import fields_dict, text
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Scripts

log = structlog.get_logger("dialog_worker.daemon.sessions")

# How long a call that hands out locks is sent again after its reply was lost: within the
# life of its receipt (RECEIPT_KEPT_MS in lua/_common.lua, 30 s), which gives its jobs back.
IN_DOUBT_S = 20.0
# A call's reply that was lost: the call may have run.
IN_DOUBT_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
T = TypeVar("T")
# Most sessions of one lapsed lease a lease call brings back (the next call brings the rest).
SWEEP_LIMIT = 1000
# The worker number in a token taken under a worker lease (holder_of in lua/_common.lua).
_HOLDER = re.compile(r":L(\d+)\.[0-9a-fA-F]+:\d+:d?\d+\Z")


def holder_of(token: str) -> int | None:
    match = _HOLDER.search(token)
    return int(match.group(1)) if match else None


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
        self._token_nonce = secrets.token_hex(6)
        self.started = 0  # session tasks started, ever
        self.last_finished = 0.0  # monotonic s: when a session task last ended
        self.malformed = MalformedNotice()
        # This worker's number on each shard (lua/lease-2.lua): in the tokens it hands out.
        self.worker_numbers: dict[int, int] = {}
        self._shard_keys: dict[int, Keys] = {}
        self._lease_lock = anyio.Lock()

    @staticmethod
    def give_slots(shard: Shard, n: int) -> None:
        shard.slots.release(n)

    def token_base(self, shard: int) -> str:
        """Unique per script call: the scripts number the tokens they hand out after it
        ("<consumer>:<nonce>:<call>"). Under the worker's lease on the shard, the nonce
        carries its number there ("L<n>.<nonce>": see holder_of in lua/_common.lua)."""
        self._token_counter += 1
        number = self.worker_numbers.get(shard)
        lease = f"L{number}." if number else ""
        return f"{self.settings.consumer}:{lease}{self._token_nonce}:{self._token_counter}"

    def lock_ttl_ms(self, shard: int) -> int:
        """The TTL of the locks taken with the shard's next token base."""
        if self.worker_numbers.get(shard):
            return self.settings.lock_ttl_ms * HELD_LOCK_TTL_FACTOR
        return self.settings.lock_ttl_ms

    async def ensure_lease(self, keys: Keys) -> None:
        """The worker's lease on the shard exists (taken once, before its first lock)."""
        if self.worker_numbers.get(keys.shard):
            return
        async with self._lease_lock:
            if not self.worker_numbers.get(keys.shard):
                await self._lease(keys)

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
        """Renew the worker's lease on each shard (one call per shard), then the locks of the
        rare steps that have held theirs a third of its long TTL."""
        ttl = self.settings.lock_ttl_ms
        async with self._lease_lock:
            for keys in list(self._shard_keys.values()):
                await self._lease(keys)
        await self._renew_long_held()
        return ttl / 3000

    async def _lease(self, keys: Keys) -> None:
        """One lease call for the shard: renewed, or a new number when it had lapsed (every
        result held under the old one is given up); lapsed leases' sessions brought back."""
        old = self.worker_numbers.get(keys.shard, 0)
        reply = await self.scripts.lease(
            keys=[keys.ready, keys.session_prefix],
            args=[old, self.settings.lock_ttl_ms, SWEEP_LIMIT],
        )
        number, lapsed, swept = (int(x) for x in reply)
        self.worker_numbers[keys.shard] = number
        self._shard_keys[keys.shard] = keys
        self.metrics.lease_renewals.inc()
        if lapsed:
            self._give_up(keys.shard, old)
        if swept:
            log.warning("lapsed_leases_swept", sessions=swept, stream=keys.stream)

    async def leave(self) -> None:
        """The worker stops, everything handed back: its leases are marked lapsed long ago, so
        the next lease call of another worker forgets them (and brings back anything left
        under them at once). Redis out of reach: they lapse by themselves."""
        for shard, keys in self._shard_keys.items():
            try:
                await self.raw.zadd(keys.workers, {str(self.worker_numbers[shard]): 0}, xx=True)
            except (RedisError, OSError) as exc:
                log.info("lease_left_to_lapse", stream=keys.stream, error=type(exc).__name__)
                return

    async def in_doubt(self, shard: int, call: Callable[[], Awaitable[T]]) -> T:
        """Send a call that hands out locks under this worker's lease on the shard (intake,
        resume). When its reply is lost (the connection broke or timed out once it was sent)
        it may have run and locked sessions under the lease, where nobody looks while the
        lease lives: send it again as it was until Redis answers (its receipt gives back the
        jobs it took, or it runs now). Past IN_DOUBT_S the worker gives its number on the
        shard up, with its results there: the number lapses, and any worker's lease call
        brings its sessions back."""
        deadline = time.monotonic() + IN_DOUBT_S
        wait_s = 0.05
        while True:
            try:
                with anyio.CancelScope(shield=True):  # a reply seen is jobs to start
                    return await call()
            except IN_DOUBT_ERRORS as exc:
                if time.monotonic() + wait_s > deadline:
                    self.give_up_number(shard)
                    raise
                log.info("call_in_doubt_sent_again", error_type=type(exc).__name__)
            await anyio.sleep(wait_s)
            wait_s = min(wait_s * 2, 1.0)

    def give_up_number(self, shard: int) -> None:
        """Stop renewing the lease on the shard and give up what was held under it; the next
        lease call takes a new number."""
        number = self.worker_numbers.get(shard, 0)
        if number:
            self.worker_numbers[shard] = 0
            self._give_up(shard, number)
            log.warning("lease_given_up", shard=shard, number=number)

    def _give_up(self, shard: int, number: int) -> None:
        """The worker's lease on the shard lapsed: its locks there may be anyone's now."""
        for job in list(self.leases.values()):
            if job.keys.shard == shard and holder_of(job.token) == number and not job.lost:
                job.lost = True
                if job.scope is not None:
                    job.scope.cancel()
                log.warning("lease_lost", session_id=job.session_id, seq=job.seq)

    async def _renew_long_held(self) -> None:
        """Extend the locks of steps still running near the end of theirs, one call per shard
        (and every lock taken without a worker lease, a third of the lock TTL after it)."""
        now = time.monotonic()
        by_call: dict[tuple[int, int], list[Job]] = {}
        for job in self.leases.values():
            ttl = self.settings.lock_ttl_ms
            if holder_of(job.token) is not None:
                ttl *= HELD_LOCK_TTL_FACTOR
            if job.renewed_at < now - ttl / 3000 and not job.lost:
                by_call.setdefault((job.keys.shard, ttl), []).append(job)
        for (_, ttl), jobs in by_call.items():
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
