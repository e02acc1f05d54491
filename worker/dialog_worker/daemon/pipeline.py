"""The life of one message, top to bottom.

    intake (one script per read: deliver, give each entry its seq, lock the session or leave
    the entry queued) -> decode -> engine step -> fenced commit (group commit: state, reply
    event, entry deleted; the lock goes on to the session's next message, or is released)
    -> that next message, if the commit handed it on.

A session is worked by one task at a time: the one that holds its lock. Failures branch off:
content the engine cannot take is dead-lettered in its turn (malformed); an engine error is
retried with backoff (the session is released and comes back through the ready set) until the
attempt limit, then dead-lettered in order; a lost lease gives the result up. A cancelled or
superseded message ends in its turn without a step (the scripts say so when they hand it out);
a running step whose message is cancelled is stopped (`watch_cancels`), or its commit is
refused by the script and the message ends cancelled instead. Everything that
may run twice after a crash (step, commit) is safe to run twice: the commit is fenced by the
lock token and the state version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import redis.exceptions
import structlog
from redis.asyncio import Redis

from dialog_worker import tracing
from dialog_worker.config import Settings, limit_key_problem
from dialog_worker.daemon import message_life
from dialog_worker.daemon.failures import describe_failure, retry_after_of, retry_delay_ms
from dialog_worker.daemon.message_life import LifeCalls, MessageLife
from dialog_worker.daemon.model_gate import (
    Attempt,
    ModelGate,
    event_usage,
    merged_state_usage,
    usage_arg,
)
from dialog_worker.daemon.partial_writer import WAIT_REASONS, PartialReplies, PartialWriter
from dialog_worker.daemon.slots import TURN_AFTER_S, SlotGate
from dialog_worker.daemon.step_journal import AttemptJournal, JournalFenced
from dialog_worker.engine import cancellation, model_calls, timers
from dialog_worker.engine import journal as step_journal
from dialog_worker.engine.interrupts import Interrupted, awaiting_data, interrupt_id
from dialog_worker.engine.protocol import (
    CheckedReply,
    Engine,
    RichReply,
    initial_state,
    reply_text,
    run_step,
)
from dialog_worker.errors import BudgetExceeded, LimitWait, PermanentError, RateLimited
from dialog_worker.metrics import Metrics
from dialog_worker.store.checks import ledger, oom
from dialog_worker.store.codec import (
    MalformedEntry,
    Message,
    decode_message,
    fields_dict,
    json_bytes,
    json_loads,
    merged_message,
    priority_of,
    redis_text,
    text,
)
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, Release, Scripts
from dialog_worker.version import __version__

log = structlog.get_logger("dialog_worker.daemon.pipeline")

# A lock taken under a worker lease lives this many lock TTLs (5 s: 5 minutes): its holder's
# lease, not the lock's TTL, says whether it is alive (daemon/sessions.py's docstring).
HELD_LOCK_TTL_FACTOR = 60

# The last error a streamed hand-back records: its attempt stays counted, and a dead letter
# after DIALOG_MAX_ATTEMPTS of them says why rather than blaming a kill or a lost lease.
HANDED_BACK_STREAMED = "handed back at shutdown after streaming part of its answer"
# Writes of committed messages' lives under way (the loop keeps only weak references).
_life_writes: set[asyncio.Task[None]] = set()

# How much of a message's text a history turn keeps (the dead letter keeps it whole).
HISTORY_TEXT_LIMIT = 1024
# Most text a cancelled message keeps of what its step had streamed (its ending commit is not
# held to DIALOG_MAX_STATE_BYTES, so this bounds what it adds to the state).
SHOWN_TEXT_LIMIT = 16_384
# Most commits sent in one script call.
COMMIT_BATCH = 256


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclasses.dataclass(slots=True, eq=False)
class Job:
    """One message of one session whose lock we hold (a lease the heartbeat renews)."""

    keys: Keys
    session_id: str
    token: str
    seq: int
    entry_id: str  # "" for a gap
    fields: dict[bytes, bytes]
    doc: bytes  # the state JSON as stored ("" for a new session)
    version: int
    attempts: int
    first_failed_at: str
    last_error: str
    gap: bool = False
    state: dict[str, Any] | None = None  # parsed `doc`, when we already have it
    # Later entries of the session from the same read, by entry id in seq order: the commit
    # that reaches one need not send it back (shared by the jobs of one chain).
    held: dict[str, dict[bytes, bytes]] = dataclasses.field(default_factory=dict)
    renewed_at: float = dataclasses.field(default_factory=time.monotonic)
    lost: bool = False
    scope: anyio.CancelScope | None = None  # while the step runs
    # '' (run the step), 'cancelled' or 'superseded': the scripts found it ends without one.
    ending: str = ""
    msg_id: str = ""  # once decoded
    # Set when the message is cancelled while its step runs (dialog_worker.cancelled()).
    cancel_flag: threading.Event = dataclasses.field(default_factory=threading.Event)
    # What the step streams (dialog_worker/daemon/partial_writer.py), once it runs: a cancelled
    # message keeps the text it showed.
    partial: PartialWriter | None = None
    # What the step asked for with dialog_worker.schedule / cancel_timer (its last attempt).
    timer_ops: timers.TimerOps | None = None
    # The message's step journal for this attempt (dialog_worker.once / interrupt).
    journal: AttemptJournal | None = None
    # Handed out by a commit for a slot it freed (another session's message), not handed on
    # by its own session's commit: it starts without a turn being taken first.
    fresh: bool = False
    # Its cancel mark was looked at since its step started (Pipeline.watch_cancels).
    watched: bool = False
    # Its spans, while tracing is on (dialog_worker/tracing.py).
    trace: tracing.MessageTrace | None = None
    # Its attempt's model calls and their usage (dialog_worker/daemon/model_gate.py), until
    # they are committed with its reply or counted as wasted.
    calls: Attempt | None = None
    # What its attempt lived through, for the console's message page (message_life.py).
    life: MessageLife | None = None
    # A merged burst (multitask=merge): the parts before this one, (seq, entry id, fields)
    # each, in order; this job's own seq, entry and fields are the last part's (it answers).
    parts: list[tuple[int, str, dict[bytes, bytes]]] = dataclasses.field(default_factory=list)
    # Their msg_ids, once decoded.
    part_msg_ids: list[str] = dataclasses.field(default_factory=list)
    # Its cancel mark's key, built once: the cancel watch asks for it every interval.
    _mark: str = ""

    @classmethod
    def from_script(
        cls, keys: Keys, row: Sequence[Any], gap: bool = False, fresh: bool = False
    ) -> Job:
        """A job row of intake-5.lua, resume-3.lua (without resume's leading kind) or of a
        commit that handed its freed slot to a queued session (commit-5.lua, dispatch)."""
        sid, token, seq, entry_id, flat, doc, version, attempts, first, error, ending = row[:11]
        job = cls(
            keys=keys,
            session_id=sid.decode("utf-8"),
            token=text(token),
            seq=int(seq),
            entry_id=text(entry_id),
            fields=fields_dict(flat),
            doc=doc,
            version=int(version),
            attempts=int(attempts),
            first_failed_at=text(first),
            last_error=text(error),
            gap=gap,
            ending=text(ending),
            fresh=fresh,
        )
        if len(row) > 11 and row[11]:
            job.merge(row[11])
        return job

    def merge(self, later: Sequence[Any]) -> None:
        """The later parts of a merged burst, as the scripts list them ({seq, entry id,
        fields} each): this job becomes the last part's, the first ones its `parts`."""
        every = [(self.seq, self.entry_id, self.fields)]
        every += [(int(s), text(i), fields_dict(f)) for s, i, f in later]
        self.parts = every[:-1]
        self.seq, self.entry_id, self.fields = every[-1]

    @property
    def first_seq(self) -> int:
        """The seq the session's applied seq is one short of while this job runs: the first
        part's (the scripts fence a merged step's writes by it)."""
        return self.parts[0][0] if self.parts else self.seq

    def cancel_marks(self) -> list[str]:
        """The cancel marks that stop this job's step: its own, and a merged burst's every
        part's."""
        session = self.keys.session(self.session_id)
        return [self.cancel_mark(), *(session.cancel_mark(m) for m in self.part_msg_ids)]

    def cancel_mark(self) -> str:
        """The key of this message's cancel mark, built once its `msg_id` is known."""
        if not self._mark:
            mark = self.keys.session(self.session_id).cancel_mark(self.msg_id)
            if not self.msg_id:
                return mark  # not decoded yet: nothing to keep
            self._mark = mark
        return self._mark

    def load_state(self) -> dict[str, Any]:
        if self.state is None:
            self.state = json_loads(self.doc) if self.doc else initial_state(self.session_id)
        return self.state


class Committer:
    """Group commit for one shard: every commit submitted while a call is in flight goes in
    the next call, with no added wait. One task (`run`) sends; submitters wait shielded, since
    a commit once sent must be seen to its end.

    Each call also carries what the tenants' scheduling needs (lua/commit-5.lua): a commit
    that hands its session on gives the slot up when another session is owed it, and one that
    frees its slot fills it with the session owed it, in the same call, while `dispatching`
    (not once the worker stops) and the shard's resumer does not wait for a slot (a due
    session of the ready set, a crashed worker's, has first call on the next one)."""

    def __init__(
        self,
        scripts: Scripts,
        keys: Keys,
        settings: Settings,
        token_base: Callable[[], str] | None = None,
        slots: SlotGate | None = None,
        lock_ttl_ms: Callable[[], int] | None = None,
    ) -> None:
        self.scripts = scripts
        self.keys = keys
        self.settings = settings
        self.token_base = token_base
        # The TTL of the locks it extends and takes: a worker lease's held locks are long
        # (dialog_worker/daemon/sessions.py), the per-session lease's are the lock TTL.
        self.lock_ttl_ms = lock_ttl_ms or (lambda: settings.lock_ttl_ms)
        self.slots = slots
        self.dispatching = token_base is not None
        self._queue: list[tuple[list[Any], bool, _Slot]] = []
        self._wakeup = anyio.Event()

    async def commit(self, args: list[Any], slow: bool = False) -> list[Any]:
        """Send one commit (its 13 values); `slow`: its step took a while (TURN_AFTER_S), so
        the session takes turns with its tenant's waiting sessions."""
        slot = _Slot()
        self._queue.append((args, slow, slot))
        self._wakeup.set()
        with anyio.CancelScope(shield=True):
            await slot.done.wait()
        if slot.error is not None:
            raise slot.error
        return slot.result

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
            while self._queue:
                batch, self._queue = self._queue[:COMMIT_BATCH], self._queue[COMMIT_BATCH:]
                await self._send(batch)

    async def _send(self, batch: list[tuple[list[Any], bool, _Slot]]) -> None:
        k, s = self.keys, self.settings
        args: list[Any] = [self.lock_ttl_ms(), s.state_ttl_s, s.reply_maxlen, len(batch)]
        for commit_args, _, _ in batch:
            args += commit_args
        args.append(s.on_dead_letter)  # "hold": a dead letter holds its session
        if self.token_base is not None:
            resumer_waiting = self.slots is not None and self.slots.resumer_waiting
            args += [
                "1" if self.dispatching and not resumer_waiting else "0",
                self.token_base(),
                s.tenant_lua_pattern,
                "".join("1" if slow else "0" for _, slow, _ in batch),
                s.merge_spec,
            ]
        try:
            with anyio.CancelScope(shield=True):
                results = await oom.call(  # out of memory: wait for room, lease kept
                    "commit",
                    lambda: self.scripts.commit(
                        keys=[k.stream, k.ready, k.session_prefix, k.replies, k.dlq], args=args
                    ),
                )
        except Exception as exc:  # every waiter gets the failure; none is left hanging
            for _, _, slot in batch:
                slot.error = exc
                slot.done.set()
            return
        for (_, _, slot), result in zip(batch, results, strict=True):
            slot.result = result
            slot.done.set()


@dataclasses.dataclass(slots=True, eq=False)
class _Slot:
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    result: list[Any] = dataclasses.field(default_factory=list)
    error: Exception | None = None


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        scripts: Scripts,
        engine: Engine,
        metrics: Metrics,
        leases: dict[str, Job],
        committers: dict[int, Committer],
    ) -> None:
        self.settings = settings
        self.scripts = scripts
        self.engine = engine
        self.metrics = metrics
        self.leases = leases
        self.committers = committers
        # Set at shutdown: a message handed on by a commit goes back at once, unstarted.
        self.stopping = False
        # Plain `def` steps run in threads, at most one per message slot.
        self.step_limiter = anyio.CapacityLimiter(settings.concurrency)
        # What steps emit (dialog_worker.emit) goes to their messages' partial streams.
        self.partials = PartialReplies(scripts.commit.redis, settings)
        # Per shard, the cancel count as the cancel watch last read it (watch_cancels), the
        # last cancel note it read, and when (monotonic s) a cancel last came.
        self._cancels_seen: dict[int, object] = {}
        self._notes_seen: dict[int, bytes] = {}
        self._cancel_came_at = 0.0
        # Producer fields copied onto every reply event of their message (DIALOG_ECHO_FIELDS).
        self.echo_names = [n.encode() for n in settings.echo_fields.split(",") if n]
        # Model calls: limit keys shared by the fleet, budgets, usage.
        self.gate = ModelGate(settings, scripts, metrics)

    # ------------------------------------------------------------------------------------
    # Entry point

    async def run_session(
        self, job: Job | None, between: Callable[[float], Awaitable[None]] | None = None
    ) -> None:
        """Work one session while we hold its lock: this job, then whatever its commits hand
        on. ``between(seconds the last message took)`` runs before each handed-on message,
        with its lease kept (the daemon gives the slot to a waiting reader there). Never
        raises: after a Redis failure the lock runs out and the session comes back through
        the ready set; anything else is logged."""
        try:
            while job is not None:
                structlog.contextvars.bind_contextvars(
                    session_id=job.session_id,
                    seq=job.seq,
                    entry_id=job.entry_id,
                    attempt=job.attempts,
                )
                started = time.perf_counter()
                job = await self._process(job)
                if job is not None and not job.fresh and between is not None:
                    self.leases[job.token] = job  # renewed by the heartbeat while it waits
                    try:
                        await between(time.perf_counter() - started)
                    finally:
                        if self.leases.get(job.token) is job:
                            del self.leases[job.token]
        except redis.exceptions.RedisError as exc:
            log.warning(
                "redis_error",
                error=str(exc),
                error_type=type(exc).__name__,
                note="the session is given back",
            )
            if job is not None:
                await self._give_back_unfinished(job, f"Redis failed ({type(exc).__name__})")
        except Exception as exc:
            log.exception("unexpected_error", note="the session is given back")
            if job is not None:
                await self._give_back_unfinished(job, f"the worker failed ({type(exc).__name__})")
        finally:
            structlog.contextvars.clear_contextvars()

    async def _give_back_unfinished(self, job: Job, error: str) -> None:
        """Our work on a session ended mid-way (a Redis failure, a bug) while this worker lives
        on. Under a worker lease the session's lock outlives that, and the session stays at
        this worker's place in the ready set for as long as its lease is renewed: give it back
        as a lapse of the lease would (due now, the attempt counted), at the seq its state is
        at (a commit whose answer was lost may have gone through and handed the lock on).
        Nothing is written unless the lock is still ours. Tried again while Redis does not
        answer, for as long as the lock can live; a lapse of our lease, or our stop, sweeps
        it otherwise."""
        state = job.keys.session(job.session_id).state
        deadline = time.monotonic() + self.settings.lock_ttl_ms * HELD_LOCK_TTL_FACTOR / 1000
        wait_s = 0.05
        while True:
            try:
                applied = await _shielded(self.scripts.commit.redis.hget(state, "a"))
                seq = int(applied or 0) + 1
                code = await self._release(job, 0, error, Release.HAND_BACK_STREAMED, seq)
                log.warning("unfinished_given_back", seq=seq, given_back=code is Code.RELEASED)
                return
            except (redis.exceptions.RedisError, OSError) as exc:
                if time.monotonic() + wait_s > deadline:
                    log.error("unfinished_not_given_back", error_type=type(exc).__name__)
                    return
            except ValueError:  # its state's applied seq is not a number: resume will say so
                log.error("unfinished_not_given_back", error="state 'a' is not a number")
                return
            await anyio.sleep(wait_s)
            wait_s = min(wait_s * 2, 1.0)

    async def _process(self, job: Job) -> Job | None:
        started = time.perf_counter()
        settings = self.settings
        self.leases[job.token] = job
        try:
            if self.stopping:
                await self.hand_back(job)
                return None
            if tracing.enabled and not job.gap:
                job.trace = tracing.message_trace(
                    job.fields,
                    job.session_id,
                    job.entry_id,
                    job.seq,
                    job.attempts,
                    job.keys.stream,
                    self.metrics.trace_context_invalid.inc,
                    failed_before=bool(job.first_failed_at or job.last_error),
                )
            if job.ending:
                return await self._end(job, job.ending)
            if job.gap:
                return await self._deadletter(
                    job,
                    None,
                    "gap",
                    f"message {job.seq} of the session is missing from the stream "
                    f"(deleted or lost); skipped after {settings.gap_timeout_s:g} s",
                )
            try:
                msg = decode_message(
                    job.session_id,
                    job.seq,
                    job.entry_id,
                    job.attempts,
                    job.fields,
                    self.settings.tenant_pattern,
                )
                if job.parts:
                    earlier = [
                        decode_message(
                            job.session_id, s, e, job.attempts, f, self.settings.tenant_pattern
                        )
                        for s, e, f in job.parts
                    ]
                    job.part_msg_ids = [m.msg_id for m in earlier]
                    msg = merged_message([*earlier, msg])
            except MalformedEntry as exc:
                return await self._deadletter(job, None, "malformed", exc.reason)
            structlog.contextvars.bind_contextvars(msg_id=msg.msg_id)
            job.msg_id = msg.msg_id
            if self._expired(msg):
                # Its turn came too late (expires_at, or DIALOG_MESSAGE_TTL_S): no step.
                return await self._end(job, "expired", msg)
            job.journal = AttemptJournal(
                self.scripts.journal.redis,
                self.scripts.journal,
                job,
                settings.journal_max_bytes,
                settings.state_ttl_s,
                self.metrics,
            )
            exhausted = False
            if job.attempts > settings.max_attempts:
                # Runs that ended waiting for a person (dialog_worker.interrupt) do not count.
                exhausted = await self._spent(job) > settings.max_attempts
            if exhausted:
                error = job.last_error or (
                    f"delivered {job.attempts - 1} times without finishing "
                    "(worker killed or lease lost during the step)"
                )
                # This delivery is not an attempt: the step is not run again.
                return await self._deadletter(job, msg, "exhausted", error, job.attempts - 1)
            over = await self.gate.over_budget(msg.tenant, job.load_state())
            if over is not None:
                # Its tenant's (or session's) tokens of the day are spent: no step, no call.
                log.info("budget_exceeded", scope=over.scope, budget=over.budget, used=over.used)
                return await self._end(job, "budget_exceeded", msg, settings.budget_reply)
            if job.trace is not None:
                job.trace.begin_step()
            try:
                new_state, reply = await self.partials.run(job, msg, self._step(job, msg))
            except anyio.get_cancelled_exc_class():
                # Shutdown grace is over: give the message back (not a failed attempt).
                with anyio.CancelScope(shield=True):
                    await self._wasted(job)
                    await self.hand_back(job)
                log.info("handed_back", outcome="handed_back")
                raise
            except PermanentError as exc:
                log.warning("step_refused", error=_describe(exc), exc_info=exc)
                return await self._deadletter(job, msg, "permanent", describe_failure(exc))
            except StepCancelled:
                log.info("step_cancelled")
                return await self._end(job, "cancelled", msg, await self._shown(job))
            except Interrupted as asked:
                # Waits for a person: the session is parked, no attempt spent, no dead letter.
                # What its model calls used is spent against the budgets now (counted apart,
                # as wasted: the run after the resume commits only its own usage).
                await self._wasted(job)
                if job.parts:
                    # A merged burst parks on no one message: refused, as the docs say.
                    return await self._deadletter(
                        job,
                        msg,
                        "permanent",
                        "interrupt() is not supported in a step of merged messages "
                        "(multitask=merge)",
                    )
                return await self._interrupt(job, msg, asked)
            except (LeaseLost, JournalFenced):
                self.metrics.fencing_rejections.inc()
                log.warning("lease_lost", outcome="abandoned")
                await self._wasted(job)
                return None
            except Exception as exc:
                if job.cancel_flag.is_set() and not job.lost:
                    log.info("step_cancelled", error=_describe(exc))
                    return await self._end(job, "cancelled", msg, await self._shown(job))
                if job.lost:
                    self.metrics.fencing_rejections.inc()
                    log.warning("lease_lost", outcome="abandoned")
                    await self._wasted(job)
                    return None
                if isinstance(exc, BudgetExceeded):
                    # model_call found the budget spent: the message ends without the call,
                    # with what the attempt used before it committed alongside.
                    log.info("budget_exceeded", scope=exc.scope, budget=exc.budget, used=exc.used)
                    return await self._end(job, "budget_exceeded", msg, settings.budget_reply)
                if isinstance(exc, RateLimited) and limit_key_problem(exc.key) is None:
                    await self._rate_limited(job, exc)
                    return None
                log.warning("step_failed", error=_describe(exc), exc_info=exc)
                if job.attempts >= settings.max_attempts:
                    if await self._spent(job) >= settings.max_attempts:
                        return await self._deadletter(job, msg, "exhausted", describe_failure(exc))
                await self._retry(job, describe_failure(exc), retry_after_of(exc))
                return None
            if job.lost:
                self.metrics.fencing_rejections.inc()
                log.warning("lease_lost", outcome="abandoned")
                await self._wasted(job)
                return None
            return await self._commit(job, msg, new_state, reply, started)
        finally:
            if self.leases.get(job.token) is job:
                del self.leases[job.token]
            if job.trace is not None:
                job.trace.end(lost=job.lost)

    def _expired(self, msg: Message) -> bool:
        deadline = msg.expires_at_ms
        if deadline is None and self.settings.message_ttl_s > 0 and msg.enqueued_at_ms:
            deadline = msg.enqueued_at_ms + round(self.settings.message_ttl_s * 1000)
        return deadline is not None and now_ms() >= deadline

    def _reply_extras(self, job: Job, reply: CheckedReply) -> list[str]:
        """The reply event's fields besides the ones every event has: a rich reply's, then
        the echoed producer fields (as text: invalid UTF-8 is replaced)."""
        extras = reply.event_fields() if isinstance(reply, RichReply) else []
        for name in self.echo_names:
            value = job.fields.get(name)
            if value is not None:
                extras += [name.decode(), redis_text(value.decode("utf-8", "replace"))]
        if job.trace is not None and tracing.TRACEPARENT not in extras[::2]:
            extras += job.trace.reply_fields()  # reply consumers continue the trace
        return extras

    async def _step(self, job: Job, msg: Message) -> tuple[dict[str, Any], CheckedReply]:
        flag = cancellation.bind(job.cancel_flag)
        job.timer_ops = timers.TimerOps()  # a new attempt starts with none
        timer_token = timers.bind(job.timer_ops)
        job.calls = self.gate.attempt(
            job.keys, job.session_id, job.seq, job.attempts, msg.tenant, job.load_state(),
            priority_of(msg.meta.get("priority")),
        )  # fmt: skip
        job.life = MessageLife(job.attempts, msg.enqueued_at_ms)
        calls_token = model_calls.bind(LifeCalls(job.calls, job.life))
        journal_token = step_journal.bind(job.journal)
        # One scope for the step timeout and for the two who stop a step from outside (one
        # scope less per message than fail_after inside a scope of its own).
        deadline = anyio.current_time() + self.settings.step_timeout_s
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                job.scope = scope
                result = await run_step(
                    self.engine, job.load_state(), msg.as_engine_input(), limiter=self.step_limiter
                )
                if job.journal is not None and job.journal.asked != job.journal.answered:
                    # An interrupt() whose wait was never awaited: going on without the
                    # person's answer is what interrupt() is there to prevent.
                    raise PermanentError(
                        "the step called dialog_worker.interrupt() without awaiting it "
                        "(await it in an async def step) and returned"
                    )
                return result
        finally:
            job.scope = None
            step_journal.unbind(journal_token)
            model_calls.unbind(calls_token)
            timers.unbind(timer_token)
            cancellation.unbind(flag)
        # Cancelled: a lost lease (the heartbeat), a cancel (watch_cancels), else the deadline.
        if job.lost:
            raise LeaseLost()
        if job.cancel_flag.is_set():
            raise StepCancelled()
        raise StepTimeout(f"step did not finish within {self.settings.step_timeout_s:g} s")

    async def watch_cancels(self, redis: Redis) -> float:
        """One look at the cancel marks of the steps running here: a marked one is stopped,
        and its message ends cancelled. Called every `cancellation.WATCH_INTERVAL_S`, the bound
        on how late a running step learns of its cancel (the commit script checks the mark
        too, so a missed look costs time, never an outcome). Per shard with steps running, one
        GET of the shard's cancel count, and the marks (one MGET) only of the steps that
        started since the last look, or of all of them when the count moved: thousands of
        long steps in flight cost one key per look, not thousands.

        Quiet: when the steps run on one shard, each was looked at once, and no cancel came
        for `cancellation.QUIET_S`, it blocks on the shard's cancel notes instead (at most
        `cancellation.WATCH_BLOCK_MS`) and looks at the marks as soon as one comes: steps held
        in flight cost one blocking read a second, not twenty looks. (A cancel that came just
        before its step started is caught by the looks that follow any cancel.)"""
        by_shard = self._running_by_shard()
        if len(by_shard) == 1 and time.monotonic() - self._cancel_came_at >= cancellation.QUIET_S:
            [(shard, jobs)] = by_shard.items()
            cursor = self._notes_seen.get(shard)
            if cursor is not None and all(j.watched for j in jobs):
                if await self._wait_for_notes(redis, jobs[0].keys, cursor):
                    return 0
                by_shard = self._running_by_shard()  # none came: one look at the count too
        for shard, jobs in by_shard.items():
            keys = jobs[0].keys
            if shard not in self._notes_seen:  # where a wait on the notes starts (read first)
                last: Any = await redis.xrevrange(keys.cancel_notes, count=1)
                self._notes_seen[shard] = bytes(last[0][0]) if last else b"0-0"
            count = await redis.get(keys.cancels)
            if count != self._cancels_seen.get(shard, b"unread"):
                if shard in self._cancels_seen:
                    self._cancel_came_at = time.monotonic()
                self._cancels_seen[shard] = count
            else:
                jobs = [j for j in jobs if not j.watched]
            await self._look_at_marks(redis, jobs)
        return cancellation.WATCH_INTERVAL_S

    def _running_by_shard(self) -> dict[int, list[Job]]:
        by_shard: dict[int, list[Job]] = {}
        for job in list(self.leases.values()):
            if job.scope is not None and job.msg_id and not job.cancel_flag.is_set():
                by_shard.setdefault(job.keys.shard, []).append(job)
        return by_shard

    async def _wait_for_notes(self, redis: Redis, keys: Keys, cursor: bytes) -> bool:
        """Block until a cancel note comes after `cursor`, then look at the marks of every step
        running on the shard then; False when none came (the caller reads the count too, so
        a note lost some other way costs a second, not the cancel)."""
        got: Any = await redis.xread(
            {keys.cancel_notes: cursor}, count=64, block=cancellation.WATCH_BLOCK_MS
        )
        if not got:
            return False
        self._notes_seen[keys.shard] = bytes(got[0][1][-1][0])
        self._cancel_came_at = time.monotonic()
        await self._look_at_marks(redis, self._running_by_shard().get(keys.shard, []))
        return True

    @staticmethod
    async def _look_at_marks(redis: Redis, jobs: list[Job]) -> None:
        """One MGET of the jobs' cancel marks: a marked one's step is stopped."""
        if not jobs:
            return
        wanted = [j.cancel_marks() for j in jobs]
        marks = iter(await redis.mget([m for ms in wanted for m in ms]))
        for job, mine in zip(jobs, wanted, strict=True):
            job.watched = True
            found = [next(marks) for _ in mine]
            if any(m is not None for m in found) and job.scope is not None:
                job.cancel_flag.set()
                job.scope.cancel()

    # ------------------------------------------------------------------------------------
    # commit

    async def _commit(
        self,
        job: Job,
        msg: Message | None,
        new_state: dict[str, Any],
        reply: CheckedReply,
        started: float,
        dead_letter: dict[str, str] | None = None,
        ending: str = "",
    ) -> Job | None:
        settings = self.settings
        held = job.held
        # The message's own msg_id for every outcome; a gap's is what survives of it (the
        # entry id of a message sequenced before custody, else nothing).
        msg_id = (
            msg.msg_id
            if msg is not None
            else job.fields.get(b"msg_id", job.entry_id.encode()).decode("utf-8", "replace")
        )
        turn: dict[str, Any] = {
            "seq": job.seq,
            "msg_id": msg_id,
            "user": _clip(msg.text if msg is not None else ""),
            "bot": reply_text(reply),
        }
        if isinstance(reply, RichReply):
            turn.update(reply.history_fields())  # "bubbles": [...] / "no_reply": true
        if not ending and dead_letter is None and job.partial is not None and job.partial.kept:
            turn["events"] = list(job.partial.kept)  # emit_event(..., keep=True)
        if ending:
            turn[ending] = True  # "cancelled" / "superseded" / "expired": true
        if job.part_msg_ids:
            turn["merged"] = list(job.part_msg_ids)  # the parts this turn answered too
        old = job.load_state()
        history = [*old.get("history", []), turn][-settings.history_limit :]
        if not settings.history_limit:
            history = []
        new_state = {
            **new_state,
            "session_id": job.session_id,
            "history": history,
            "applied_seq": job.seq,
            "version": job.version + 1,
        }
        # The attempt's model usage goes with its reply: the session's totals in the state
        # (worker-owned: what the engine returned there is replaced), the event's usage
        # field, the tenant's counters of the day (written by the commit script).
        calls = job.calls
        totals = calls.totals() if calls is not None else None
        if calls is not None and totals is not None:
            new_state["usage"] = merged_state_usage(old.get("usage"), totals, calls.day)
        elif "usage" in old:
            new_state["usage"] = old["usage"]
        else:
            new_state.pop("usage", None)
        try:
            doc = json_bytes(new_state)
            reply_bytes = redis_text(reply_text(reply)).encode("utf-8")
            extras = self._reply_extras(job, reply)
            if totals is not None:
                extras += ["usage", event_usage(totals)]
            extras_json = json_bytes(extras) if extras else b""
        except (TypeError, ValueError) as exc:
            if dead_letter is not None or ending:
                raise
            return await self._deadletter(
                job, msg, "permanent", f"engine state is not JSON text: {exc}"
            )
        if dead_letter is None and not ending and len(doc) > settings.max_state_bytes:
            return await self._deadletter(
                job,
                msg,
                "permanent",
                f"engine state is {len(doc)} bytes; at most {settings.max_state_bytes} "
                "(DIALOG_MAX_STATE_BYTES) are allowed",
            )
        # The next entry of the session, if this read gave it to us already.
        known_next = next(iter(held), "") if held else ""
        outcome = ending or ("dead_lettered" if dead_letter is not None else "applied")
        args = [
            job.token,
            job.session_id,
            job.seq,
            job.version,
            doc,
            redis_text(msg_id),
            reply_bytes,
            outcome,
            job.entry_id,
            json_bytes(_flat(dead_letter)) if dead_letter is not None else "",
            known_next,
            extras_json,
            # The step's timers go with its applied result only (a dead letter or an ending
            # without a step keeps none).
            job.timer_ops.encoded() if outcome == "applied" and job.timer_ops else "",
            usage_arg(calls, totals) if calls is not None and totals is not None else "",
            # A merged burst: its first part's seq (every part is answered by this commit).
            str(job.first_seq) if job.parts else "",
        ]
        if job.trace is not None:
            job.trace.begin_commit(outcome, dead_letter["error"] if dead_letter else "")
        slow = time.perf_counter() - started >= TURN_AFTER_S
        result = await self.committers[job.keys.shard].commit(args, slow)
        code = Code(int(result[0]))
        if job.trace is not None:
            job.trace.end_commit(code.name.lower())
        if code in (Code.COMMITTED, Code.HANDOFF) and calls is not None:
            job.calls = None  # committed: counted once, with the reply
            await calls.land()
        if code in (Code.COMMITTED, Code.HANDOFF) and self._telling(job):
            # Not waited for: the session's next message goes on meanwhile.
            task = asyncio.get_running_loop().create_task(self._life(job, outcome))
            _life_writes.add(task)
            task.add_done_callback(_life_writes.discard)
        if code is Code.INVALID:
            # Refused by the script for this commit alone (the others of the call were
            # written): nothing was written for it. A normal result is dead-lettered; a dead
            # letter that cannot be written is a failed attempt, retried with backoff.
            why = text(result[1])
            log.error("commit_invalid", error=why)
            if dead_letter is None:
                return await self._deadletter(
                    job, msg, "permanent", f"the commit was refused by Redis: {why}"
                )
            await self._retry(job, f"the dead letter was refused by Redis: {why}", None)
            return None
        if code in (Code.FENCED_TOKEN, Code.FENCED_VERSION):
            self.metrics.fencing_rejections.inc()
            log.warning("commit_fenced", outcome="fenced", reason=code.name.lower())
            await self._wasted(job)
            return None
        if code is Code.CANCELLED:
            # Cancelled while it ran (the cancel reached Redis before this commit): nothing
            # was written; it ends cancelled instead, so it has exactly one outcome.
            return await self._end(job, "cancelled", msg, await self._shown(job))
        ledger.committed(job.keys.session(job.session_id).state, job.version + 1)
        self.metrics.messages.labels(outcome).inc()
        if job.parts:  # a merged burst's earlier parts: answered with it, or ended as it did
            self.metrics.messages.labels("merged" if outcome == "applied" else outcome).inc(
                len(job.parts)
            )
        self.metrics.processing.observe(time.perf_counter() - started)
        if msg is not None and msg.enqueued_at_ms:
            self.metrics.end_to_end.observe(max(0.0, (now_ms() - msg.enqueued_at_ms) / 1000))
        log.info(
            "committed",
            outcome=outcome,
            duration_ms=round((time.perf_counter() - started) * 1000, 3),
        )
        await self.partials.committed(job, msg_id, outcome, reply_text(reply))
        if code is not Code.HANDOFF:
            if len(result) > 2:
                # The slot this commit freed went to the session owed it: work that one now.
                self.metrics.dispatches.inc()
                return Job.from_script(job.keys, result[2], fresh=True)
            return None
        self.metrics.handoffs.inc()
        version, next_seq, next_id, flat, next_ending = (
            int(result[1]),
            int(result[2]),
            text(result[3]),
            result[4],
            text(result[5]),
        )
        fields = held.pop(next_id, None)
        if fields is None:
            fields = fields_dict(flat)
        nxt = Job(
            keys=job.keys,
            session_id=job.session_id,
            token=job.token,
            seq=next_seq,
            entry_id=next_id,
            fields=fields,
            doc=doc,
            version=version,
            attempts=1,
            first_failed_at="",
            last_error="",
            state=new_state,
            held=held,
            ending=next_ending,
        )
        if len(result) > 6 and result[6]:
            nxt.merge(result[6])  # a burst to merge whose window has closed: one step
            for _, entry_id, _ in [*nxt.parts, (nxt.seq, nxt.entry_id, nxt.fields)]:
                held.pop(entry_id, None)
        return nxt

    # ------------------------------------------------------------------------------------
    # waiting for a person

    async def _interrupt(self, job: Job, msg: Message, asked: Interrupted) -> Job | None:
        """The step called dialog_worker.interrupt(): park the session on its message, with
        a durable ``awaiting`` reply event (lua/interrupt-3.lua). The attempt is not spent;
        the message runs again when the interrupt is resumed (or times out, or is
        cancelled)."""
        keys, settings = job.keys, self.settings
        iid = interrupt_id(msg.msg_id, job.seq, asked.n)
        extras = self._reply_extras(job, "")
        raw = await _shielded(
            oom.call(  # out of memory: wait for room, lease kept
                "interrupt",
                lambda: self.scripts.interrupt(
                    keys=[keys.ready, keys.session_prefix, keys.replies],
                    args=[
                        job.token,
                        job.session_id,
                        job.seq,
                        redis_text(msg.msg_id),
                        job.entry_id,
                        iid,
                        asked.n,
                        asked.payload,
                        asked.timeout_ms,
                        settings.reply_maxlen,
                        json_bytes(extras) if extras else "",
                        settings.state_ttl_s,
                        awaiting_data(iid, asked.payload),
                        job.attempts,
                        job.partial.pos if job.partial is not None else 0,
                        settings.partial_maxlen,
                        settings.partial_ttl_s,
                    ],
                ),
            )
        )
        code = Code(int(raw[0]))
        if code is not Code.PARKED:
            self.metrics.fencing_rejections.inc()
            log.warning("interrupt_fenced", outcome="fenced", reason=code.name.lower())
            return None
        self.metrics.interrupts.inc()
        log.info("awaiting", outcome="awaiting", interrupt_id=iid)
        return None

    async def _spent(self, job: Job) -> int:
        """Attempts the message has spent: its deliveries less those that ended waiting for a
        person or went back for its model's limit key after streaming (asked only when the
        count matters: at DIALOG_MAX_ATTEMPTS)."""
        if job.journal is None:
            return job.attempts
        return job.attempts - await job.journal.unspent_attempts()

    # ------------------------------------------------------------------------------------
    # failure paths

    async def _retry(self, job: Job, error: str, retry_after_s: float | None) -> None:
        settings = self.settings
        await self._wasted(job)
        delay = retry_delay_ms(
            job.attempts, settings.backoff_base_ms, settings.backoff_max_ms, retry_after_s
        )
        if job.trace is not None:
            job.trace.failed(error)
        code = await self._release(job, delay, error, Release.FAILED)
        if code is Code.RELEASED:
            self.metrics.retries.labels("error").inc()
            log.warning("retry", outcome="retry", error=error, delay_ms=delay)
            await self._life(job, "retry", error)
        else:
            self.metrics.fencing_rejections.inc()
            log.warning("retry_fenced", outcome="fenced", error=error)

    async def _rate_limited(self, job: Job, exc: RateLimited) -> None:
        """The step waits for its limit key: a provider's 429 (the key is paused for every
        worker until its Retry-After) or a turn further away than a step waits (`LimitWait`).
        The message goes back to its session's turn until the key opens, its attempt given
        back (kept only when the step had streamed text: the next attempt needs a new
        number); the session's later messages wait behind it, so its order holds."""
        if isinstance(exc, LimitWait):
            delay_ms, why = round((exc.retry_after_s or 0) * 1000), exc.why
        else:
            why = "paused"
            delay_ms = await _shielded(
                self.gate.pause(exc.key, exc.retry_after_s, _describe(exc)[:500])
            )
            log.warning(
                "rate_limited", key=exc.key, retry_after_s=exc.retry_after_s, opens_in_ms=delay_ms
            )
        await self._wasted(job)
        # Its readers see why it waits (which makes it "streamed" as below).
        await self.partials.waiting(job, why, delay_ms)
        if job.life is not None:
            reason = WAIT_REASONS.get(why, "rate")
            job.life.wait(reason, delay_ms, exc.key, message_life.now_ms() + delay_ms)
        # Streamed: the next attempt needs a new number (its readers start over), yet a wait
        # for the model's quota spends no attempt, after text as before it.
        shown = job.partial is not None and job.partial.used
        mode = Release.HAND_BACK_UNSPENT if shown else Release.HAND_BACK
        error = f"waited for {exc.key} ({why})"  # kept either way: the next attempt knows
        code = await self._release(job, max(1, delay_ms), error, mode)
        if code is Code.RELEASED:
            self.metrics.retries.labels("rate_limited").inc()
            log.info("handed_back", outcome="handed_back", key=exc.key, why=why, delay_ms=delay_ms)
            await self._life(job, "waiting")
            # Back when its turn comes; sooner if the key is paused and an operator reopens it.
            await self.gate.wait_for_pause(exc.key, job.keys, job.session_id, delay_ms)
        else:
            self.metrics.fencing_rejections.inc()
            log.warning("hand_back_fenced", outcome="fenced", key=exc.key)

    def _telling(self, job: Job) -> bool:
        """Whether the attempt of ``job`` has more to tell than "answered at first try"."""
        life = job.life
        journaled = job.journal is not None and bool(job.journal.calls)
        # last_error: an earlier attempt failed, or went back to wait (release-2.lua keeps why).
        return life is not None and (life.telling() or journaled or bool(job.last_error))

    async def _life(self, job: Job, outcome: str, error: str = "") -> None:
        """The attempt's record in its message's life (message_life.py); best effort."""
        life = job.life
        if life is None:
            return
        if job.journal is not None:
            for name, replayed in job.journal.calls:
                life.journaled(name, replayed)
            job.journal.calls = []
        await message_life.write(
            self.scripts.commit.redis, job.keys, job.session_id, job.msg_id, life, outcome,
            self.settings.dedupe_ttl_s, error,
        )  # fmt: skip

    async def _wasted(self, job: Job) -> None:
        """The attempt's usage did not commit: counted apart (once)."""
        calls, job.calls = job.calls, None
        if calls is not None:
            await self.gate.waste(calls)
            await calls.land()

    async def hand_back(self, job: Job) -> None:
        """Shutdown: give a message we hold back at once, its attempt not counted, unless its
        step streamed text: those entries carry the attempt's number, and the next attempt
        must have a new one, or readers would take its first pieces for ones they have."""
        streamed = job.partial is not None and job.partial.used
        if job.trace is not None:
            job.trace.handed_back(counted=streamed)
        if streamed:  # the reason is kept: shutdowns alone can use up the attempts
            await self._release(job, 0, HANDED_BACK_STREAMED, Release.HAND_BACK_STREAMED)
        else:
            await self._release(job, 0, "", Release.HAND_BACK)

    async def _release(
        self, job: Job, delay_ms: int, error: str, mode: Release, seq: int | None = None
    ) -> Code:
        keys = job.keys
        args: list[Any] = [
            job.token,
            job.session_id,
            job.first_seq if seq is None else seq,  # a merged burst goes back whole: its first
            delay_ms,
            redis_text(error),
            mode.value,
        ]
        if mode is Release.HAND_BACK_UNSPENT:  # counted in the message's journal
            args += [redis_text(job.msg_id), self.settings.state_ttl_s]
        raw = await _shielded(
            oom.call(  # out of memory: wait for room (the release writes the error)
                "release",
                lambda: self.scripts.release(keys=[keys.ready, keys.session_prefix], args=args),
            )
        )
        return Code(int(raw))

    async def _deadletter(
        self,
        job: Job,
        msg: Message | None,
        kind: str,
        error: str,
        attempts: int | None = None,
    ) -> Job | None:
        """Dead-letter in the session's order: the dead letter (the original fields and the seq
        are added by the commit script, byte for byte), a fallback reply, a history turn and the
        applied_seq advance, so the session's later messages go on."""
        failed_at = str(now_ms())
        letter = {
            "error": error,
            "error_kind": kind,
            "attempts": str(max(job.attempts if attempts is None else attempts, 1)),
            "first_failed_at": job.first_failed_at or failed_at,
            "last_failed_at": failed_at,
            "consumer": self.settings.consumer,
            "worker_version": __version__,
        }
        log.warning("dead_letter", outcome="dead_lettered", error=error, error_kind=kind)
        state = job.load_state()
        kept = {k: v for k, v in state.items() if k not in ("history",)}
        return await self._commit(
            job,
            msg,
            kept,
            self.settings.fallback_reply,
            time.perf_counter(),
            dead_letter=letter,
        )

    async def _end(
        self, job: Job, outcome: str, msg: Message | None = None, shown: str = ""
    ) -> Job | None:
        """End a message without applying it (``cancelled``, ``superseded``, ``expired``), in
        its turn: the state is left as it was, the history gains the turn marked so, one reply
        event; the commit frees its msg_id, so a re-send is applied. ``shown`` is what its step
        had streamed to readers when it was stopped: the turn's bot text and the event's reply
        (cut to `SHOWN_TEXT_LIMIT`), so the history keeps what the user saw."""
        if msg is None:
            try:
                msg = decode_message(
                    job.session_id,
                    job.seq,
                    job.entry_id,
                    job.attempts,
                    job.fields,
                    self.settings.tenant_pattern,
                )
            except MalformedEntry:
                msg = None  # ended all the same: the turn keeps what can be read
        log.info("message_ended", outcome=outcome)
        state = job.load_state()
        kept = {k: v for k, v in state.items() if k != "history"}
        if len(shown) > SHOWN_TEXT_LIMIT:
            shown = shown[:SHOWN_TEXT_LIMIT] + "…"
        return await self._commit(job, msg, kept, shown, time.perf_counter(), ending=outcome)

    async def _shown(self, job: Job) -> str:
        """What the cancelled step of ``job`` had streamed to readers ('' if nothing)."""
        return "" if job.partial is None else await job.partial.shown()


class LeaseLost(Exception):
    """The heartbeat found the lock taken over while the step ran."""


class StepCancelled(Exception):
    """The step's message was cancelled while it ran: it ends cancelled."""


class StepTimeout(Exception):
    """The step ran past DIALOG_STEP_TIMEOUT_S: a failed attempt."""


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + "…"


def _clip(value: str) -> str:
    return value if len(value) <= HISTORY_TEXT_LIMIT else value[:HISTORY_TEXT_LIMIT] + "…"


def _flat(fields: dict[str, str]) -> list[str]:
    flat: list[str] = []
    for name, value in fields.items():
        flat += [name, value]
    return flat


async def _shielded(call: Awaitable[Any]) -> Any:
    """Never cancel a script call half-way: the connection would be left out of step and the
    outcome unknown. Socket timeouts bound how long the shield can hold."""
    with anyio.CancelScope(shield=True):
        return await call
