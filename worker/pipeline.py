"""The life of one message, top to bottom.

    decode -> acquire and load (one script: lock + state, or park) -> order check (in the
    script) -> engine step -> fenced commit (one script: state, reply, ack, then the lock
    goes on to the session's next message or is released) -> that next message, if the
    commit kept the lock for it: a parked one it handed off, or the worker's own next entry
    of the session from the same read (no acquire needed).

Failures branch off: a refused entry is dead-lettered; an engine error is retried with
backoff until the attempt limit, then dead-lettered in order; a lost lease gives the result
up. Everything that may run twice after a crash (acquire, step, commit) is safe to run twice.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import secrets
import time
from collections.abc import Awaitable
from typing import Any

import anyio
import redis.exceptions
import structlog

from worker import __version__
from worker.codec import MalformedEntry, Message, decode_entry, decode_parked, pairs
from worker.config import Settings
from worker.engine import Engine, initial_state, run_step
from worker.errors import PermanentError
from worker.keys import Keys, SessionKeys, shard_of
from worker.metrics import Metrics
from worker.scripts import Code, LockReply, Scripts

log = structlog.get_logger("dialog_worker.pipeline")

# How much of a refused text is kept in the session history (the dead letter keeps it whole).
HISTORY_TEXT_LIMIT = 1024


def backoff_ms(attempt: int, base_ms: int, max_ms: int, rng: random.Random | None = None) -> int:
    """Capped exponential backoff with equal jitter: half fixed, half random, so retries of a
    burst spread out but never come back sooner than half the step."""
    ceiling = min(max_ms, base_ms * 2 ** max(0, attempt - 1))
    return int(ceiling / 2 + (rng or random).uniform(0, ceiling / 2))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclasses.dataclass(slots=True)
class Lease:
    """A lock we hold while a step runs; the heartbeat loop renews it (see daemon.py)."""

    keys: SessionKeys
    shard: Keys  # the stream, delayed set and streams of the session's shard
    token: str
    source: str  # "s": a stream entry we own in the PEL, "d": a handed-off delayed message
    source_id: str
    renewed_at: float = dataclasses.field(default_factory=time.monotonic)
    lost: bool = False
    scope: anyio.CancelScope | None = None
    # Entries of the same session read with this one and waiting their turn behind it: the
    # heartbeat keeps them fresh too, so a long step does not get them reclaimed meanwhile.
    waiting: dict[int, tuple[str, Message]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class Job:
    msg: Message
    lease: Lease
    state: dict[str, Any]
    version: int
    attempts: int
    first_failed_at: str
    last_error: str
    # Not-yet-started entries of the same session from the same read, by seq: a commit can
    # carry the lock straight to the next one (see commit-8.lua, ARGV[15]).
    upcoming: dict[int, tuple[str, Message]] = dataclasses.field(default_factory=dict)


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        scripts: Scripts,
        engine: Engine,
        metrics: Metrics,
        leases: dict[str, Lease],
    ) -> None:
        self.settings = settings
        self.shards = settings.shards
        self.scripts = scripts
        self.engine = engine
        self.metrics = metrics
        self.leases = leases
        # Set at shutdown: a message handed on by a commit is returned to the queue at once
        # instead of being started.
        self.stopping = False

    # ------------------------------------------------------------------------------------
    # Entry point

    async def handle_entries(self, keys: Keys, entries: list[tuple[str, dict[str, str]]]) -> None:
        """Process entries of shard `keys` (one session's entries from one read, in stream
        order) and whatever the commits hand on. A commit whose next seq is among these
        entries keeps the lock for it, which saves that entry's acquire round trip.

        Never raises: a Redis failure leaves the rest pending (reclaim delivers them again),
        anything else is logged."""
        try:
            upcoming: dict[int, tuple[str, Message]] = {}
            ready: list[tuple[str, Message]] = []
            copies: set[str] = set()  # a second entry with a seq already seen: never chained
            for entry_id, fields in entries:
                msg = await self._decode(keys, entry_id, fields)
                if msg is not None:
                    ready.append((entry_id, msg))
                    if msg.seq in upcoming:
                        copies.add(entry_id)
                    else:
                        upcoming[msg.seq] = (entry_id, msg)
            for entry_id, msg in ready:
                if entry_id not in copies:
                    if upcoming.get(msg.seq, ("",))[0] != entry_id:
                        continue  # already processed: a commit carried the lock to it
                    del upcoming[msg.seq]
                structlog.contextvars.bind_contextvars(entry_id=entry_id)
                job = await self._acquire(keys, entry_id, msg, upcoming)
                while job is not None:
                    job = await self._process(job)
                structlog.contextvars.clear_contextvars()
        except redis.exceptions.RedisError as exc:
            log.warning("redis_error", error=repr(exc), note="left pending; delivered again")
        except Exception:
            log.exception("unexpected_error", note="left pending; delivered again")
        finally:
            structlog.contextvars.clear_contextvars()

    async def _decode(self, keys: Keys, entry_id: str, fields: dict[str, str]) -> Message | None:
        """The message, or None after dead-lettering an entry no session order can take."""
        try:
            msg = decode_entry(fields, self.settings.max_message_bytes)
            if shard_of(msg.session_id, self.shards) != keys.shard:
                # Only a producer that bypasses `send` can do this; its session's keys live
                # in another slot, so no script here could take its lock.
                raise MalformedEntry(
                    f"session belongs to shard {shard_of(msg.session_id, self.shards)}, "
                    f"not {keys.shard}",
                    None,
                )
        except MalformedEntry as exc:
            structlog.contextvars.bind_contextvars(entry_id=entry_id)
            await self._deadletter_malformed(keys, entry_id, fields, exc)
            structlog.contextvars.clear_contextvars()
            return None
        return msg

    # ------------------------------------------------------------------------------------
    # 1. acquire and load, or park

    async def _acquire(
        self,
        keys: Keys,
        entry_id: str,
        msg: Message,
        upcoming: dict[int, tuple[str, Message]],
    ) -> Job | None:
        structlog.contextvars.bind_contextvars(
            session_id=msg.session_id, msg_id=msg.msg_id, seq=msg.seq
        )
        sk = keys.session(msg.session_id)
        token = secrets.token_hex(16)
        # A parked message is normally handed on by its predecessor's commit the moment that
        # lands; its own due time is only the safety net (for a lost hand-off or a stale copy),
        # so it waits at least one lock lease: a shorter timer would only cycle it through the
        # stream and park it again, costing round trips and nothing gained.
        park_delay = self.settings.lock_ttl_ms + backoff_ms(
            msg.requeues + 1, self.settings.backoff_base_ms, self.settings.backoff_max_ms
        )
        raw = await _shielded(
            self.scripts.acquire(
                keys=[
                    sk.lock,
                    sk.state,
                    sk.parked,
                    keys.delayed,
                    keys.delayed_data,
                    keys.stream,
                ],
                args=[
                    token,
                    self.settings.lock_ttl_ms,
                    keys.group,
                    entry_id,
                    msg.seq,
                    park_delay,
                    self.settings.state_ttl_s,
                ],
            )
        )
        reply = LockReply.parse(raw)
        if reply.code is Code.DUPLICATE:
            self.metrics.messages.labels("duplicate").inc()
            log.info("duplicate", outcome="duplicate", applied_seq=reply.applied_seq)
            return None
        if reply.code is Code.CONTENDED:
            self.metrics.lock_contended.inc()
            self.metrics.retries.labels("contended").inc()
            log.debug("parked", outcome="contended", delay_ms=park_delay)
            return None
        if reply.code is Code.OUT_OF_ORDER:
            self.metrics.retries.labels("out_of_order").inc()
            log.debug("parked", outcome="out_of_order", applied_seq=reply.applied_seq)
            return None
        if reply.code is Code.HANDOFF:
            # Our entry parked (out of order); the lock came with its predecessor instead.
            self.metrics.retries.labels("out_of_order").inc()
        state = json.loads(reply.state_json) if reply.state_json else initial_state(msg.session_id)
        return self._job_from(reply, msg, state, sk, keys, token, entry_id, upcoming)

    def _job_from(
        self,
        reply: LockReply,
        msg: Message,
        state: dict[str, Any],
        sk: SessionKeys,
        shard: Keys,
        token: str,
        entry_id: str,
        upcoming: dict[int, tuple[str, Message]],
    ) -> Job:
        source, source_id = "s", entry_id
        if reply.code is Code.HANDOFF:
            self.metrics.handoffs.inc()
            msg = decode_parked(reply.handoff_fields, self.settings.max_message_bytes)
            source, source_id = "d", reply.handoff_id
        lease = Lease(sk, shard, token, source, source_id, waiting=upcoming)
        self.leases[token] = lease
        structlog.contextvars.bind_contextvars(
            msg_id=msg.msg_id, seq=msg.seq, attempt=reply.attempts, entry_id=source_id
        )
        return Job(
            msg,
            lease,
            state,
            reply.version,
            reply.attempts,
            reply.first_failed_at,
            reply.last_error,
            upcoming,
        )

    # ------------------------------------------------------------------------------------
    # 2. step, then commit or fail

    async def _process(self, job: Job) -> Job | None:
        started = time.perf_counter()
        msg, settings = job.msg, self.settings
        try:
            if self.stopping and job.lease.source == "d":
                await self.hand_back(job.lease)
                return None
            if msg.problem is not None:
                return await self._deadletter(job, "permanent", msg.problem)
            if job.attempts > settings.max_attempts:
                error = job.last_error or (
                    f"delivered {job.attempts - 1} times without finishing "
                    "(worker killed or lease lost during the step)"
                )
                # This delivery is not an attempt: the step is not run again.
                return await self._deadletter(job, "exhausted", error, job.attempts - 1)
            try:
                new_state, reply = await self._step(job)
            except anyio.get_cancelled_exc_class():
                # Shutdown grace is over: give the message back (not a failed attempt).
                with anyio.CancelScope(shield=True):
                    await self.hand_back(job.lease)
                log.info("handed_back", outcome="handed_back")
                raise
            except PermanentError as exc:
                return await self._deadletter(job, "permanent", _describe(exc))
            except Exception as exc:
                if job.lease.lost:
                    # The heartbeat found the lock taken over and cancelled the step: the
                    # result is given up, as the fenced commit would refuse it.
                    self.metrics.fencing_rejections.inc()
                    log.warning("lease_lost", outcome="abandoned")
                    return None
                if job.attempts >= settings.max_attempts:
                    return await self._deadletter(job, "exhausted", _describe(exc))
                await self._retry(job, _describe(exc))
                return None
            if job.lease.lost:
                # The fenced commit would refuse it anyway; do not even try.
                self.metrics.fencing_rejections.inc()
                log.warning("lease_lost", outcome="abandoned")
                return None
            return await self._commit(job, new_state, reply, started)
        finally:
            if self.leases.get(job.lease.token) is job.lease:
                del self.leases[job.lease.token]

    async def _step(self, job: Job) -> tuple[dict[str, Any], str]:
        with anyio.CancelScope() as scope:
            job.lease.scope = scope
            new_state, reply = await run_step(self.engine, job.state, job.msg.as_engine_input())
            return new_state, reply
        # Only a lost lease cancels this scope (the heartbeat does it).
        raise LeaseLost()

    async def _commit(
        self,
        job: Job,
        new_state: dict[str, Any],
        reply: str,
        started: float,
        dead_letter: dict[str, str] | None = None,
    ) -> Job | None:
        msg, lease, settings = job.msg, job.lease, self.settings
        turn = {"seq": msg.seq, "msg_id": msg.msg_id, "user": msg.text, "bot": reply}
        if dead_letter is not None and len(msg.text) > HISTORY_TEXT_LIMIT:
            turn["user"] = msg.text[:HISTORY_TEXT_LIMIT] + "…"
        history = [*job.state.get("history", []), turn][-settings.history_limit :]
        if not settings.history_limit:
            history = []
        new_state = {
            **new_state,
            "session_id": msg.session_id,
            "history": history,
            "applied_seq": msg.seq,
            "version": job.version + 1,
        }
        try:
            state_json = json.dumps(new_state, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            return await self._deadletter(job, "permanent", f"engine state is not JSON: {exc}")
        sk = lease.keys
        chained = job.upcoming.get(msg.seq + 1)
        raw = await _shielded(
            self.scripts.commit(
                keys=[
                    sk.lock,
                    sk.state,
                    sk.parked,
                    lease.shard.delayed,
                    lease.shard.delayed_data,
                    lease.shard.stream,
                    lease.shard.replies,
                    lease.shard.dlq,
                ],
                args=[
                    lease.token,
                    job.version,
                    msg.seq,
                    state_json,
                    settings.state_ttl_s,
                    lease.source,
                    lease.source_id,
                    lease.shard.group,
                    msg.session_id,
                    msg.msg_id,
                    reply,
                    settings.lock_ttl_ms,
                    settings.reply_maxlen,
                    pairs(dead_letter) if dead_letter is not None else "",
                    chained[0] if chained is not None else "",
                ],
            )
        )
        result = LockReply.parse(raw)
        if result.code in (Code.FENCED_TOKEN, Code.FENCED_VERSION):
            self.metrics.fencing_rejections.inc()
            log.warning("commit_fenced", outcome="fenced", reason=result.code.name.lower())
            return None
        outcome = "dead_lettered" if dead_letter is not None else "applied"
        self.metrics.messages.labels(outcome).inc()
        self.metrics.processing.observe(time.perf_counter() - started)
        if msg.enqueued_at_ms:
            self.metrics.end_to_end.observe(max(0.0, (now_ms() - msg.enqueued_at_ms) / 1000))
        log.info(
            "committed",
            outcome=outcome,
            duration_ms=round((time.perf_counter() - started) * 1000, 3),
        )
        if result.code is Code.HANDOFF:
            return self._job_from(
                result,
                msg,
                new_state,
                sk,
                lease.shard,
                lease.token,
                lease.source_id,
                job.upcoming,
            )
        if result.code is Code.ACQUIRED and chained is not None:
            # The lock stayed with us for our own next entry: no acquire round trip.
            del job.upcoming[msg.seq + 1]
            entry_id, next_msg = chained
            return self._job_from(
                result,
                next_msg,
                new_state,
                sk,
                lease.shard,
                lease.token,
                entry_id,
                job.upcoming,
            )
        return None

    # ------------------------------------------------------------------------------------
    # 3. failure paths

    async def _retry(self, job: Job, error: str) -> None:
        lease, settings = job.lease, self.settings
        delay = backoff_ms(job.attempts, settings.backoff_base_ms, settings.backoff_max_ms)
        code = await self._requeue(lease, delay, error, counts=True)
        if code is Code.REQUEUED:
            self.metrics.retries.labels("error").inc()
            log.warning("retry", outcome="retry", error=error, delay_ms=delay)
        else:
            self.metrics.fencing_rejections.inc()
            log.warning("retry_fenced", outcome="fenced", error=error)
        return None

    async def hand_back(self, lease: Lease) -> None:
        """Shutdown: return a message we hold to the queue at once, attempt not counted."""
        await self._requeue(lease, 0, "", counts=False)

    async def _requeue(self, lease: Lease, delay_ms: int, error: str, counts: bool) -> Code:
        sk = lease.keys
        raw = await _shielded(
            self.scripts.retry(
                keys=[
                    sk.lock,
                    sk.state,
                    lease.shard.delayed,
                    lease.shard.delayed_data,
                    lease.shard.stream,
                ],
                args=[
                    lease.token,
                    lease.source,
                    lease.source_id,
                    lease.shard.group,
                    delay_ms,
                    error,
                    "1" if counts else "0",
                ],
            )
        )
        return Code(int(raw))

    async def _deadletter(
        self, job: Job, kind: str, error: str, attempts: int | None = None
    ) -> Job | None:
        """Dead-letter in the session's order: a fallback reply, a history turn and the
        applied_seq advance, so the session's later messages go on."""
        failed_at = str(now_ms())
        letter = {
            **job.msg.fields,
            "error": error,
            "error_kind": kind,
            "attempts": str(max(job.attempts if attempts is None else attempts, 1)),
            "first_failed_at": job.first_failed_at or failed_at,
            "last_failed_at": failed_at,
            "consumer": self.settings.consumer,
            "worker_version": __version__,
            "source_entry_id": job.lease.source_id,
        }
        log.warning("dead_letter", outcome="dead_lettered", error=error, error_kind=kind)
        return await self._commit(
            job,
            copy.deepcopy(job.state),
            self.settings.fallback_reply,
            time.perf_counter(),
            dead_letter=letter,
        )

    async def _deadletter_malformed(
        self, keys: Keys, entry_id: str, fields: dict[str, str], exc: MalformedEntry
    ) -> None:
        failed_at = str(now_ms())
        letter = {
            **fields,
            "error": exc.reason,
            "error_kind": "permanent",
            "attempts": "1",
            "first_failed_at": failed_at,
            "last_failed_at": failed_at,
            "consumer": self.settings.consumer,
            "worker_version": __version__,
            "source_entry_id": entry_id,
        }
        reply = ""
        if exc.session_id is not None:
            reply = pairs(
                {
                    "session_id": exc.session_id,
                    "msg_id": fields.get("msg_id", ""),
                    "seq": fields.get("seq", ""),
                    "reply": self.settings.fallback_reply,
                }
            )
        done = await _shielded(
            self.scripts.deadletter(
                keys=[keys.stream, keys.dlq, keys.replies],
                args=[keys.group, entry_id, pairs(letter), reply, self.settings.reply_maxlen],
            )
        )
        if int(done):
            self.metrics.messages.labels("dead_lettered").inc()
            log.warning(
                "dead_letter", outcome="dead_lettered", error=exc.reason, error_kind="permanent"
            )


class LeaseLost(Exception):
    """The heartbeat found the lock taken over while the step ran."""


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + "…"


async def _shielded(call: Awaitable[Any]) -> Any:
    """Never cancel a script call half-way: the connection would be left out of step and the
    outcome unknown. Socket timeouts bound how long the shield can hold."""
    with anyio.CancelScope(shield=True):
        return await call
