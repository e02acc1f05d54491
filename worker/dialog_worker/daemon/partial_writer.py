"""Streamed replies, the worker's side: the writer that batches what a step emits
(`dialog_worker.emit`, dialog_worker/engine/emit.py) into its message's partial stream
(lua/emit-2.lua).

A step calls ``dialog_worker.emit(text)`` as its answer grows; the committed reply is still
the text the step returns. The pipeline runs each step inside `PartialReplies.run`, which puts
a `PartialWriter` in a context variable: an ``async def`` step sees it directly, a plain
``def`` step in its worker thread too (``anyio.to_thread.run_sync`` copies the context).

The writer never makes one Redis call per token, nor one per answer: text is gathered for
``DIALOG_PARTIAL_FLUSH_MS`` (or until ``DIALOG_PARTIAL_FLUSH_CHARS``), then what every live
step of the worker emitted goes in one script call (one per shard), each answer's batch
fenced by its session lock, so a worker that lost its lease writes nothing. After the commit
the pipeline appends the end entry (outcome and committed reply); readers do not depend on it
(dialog_worker/client/partial_reader.py derives the end from the commit too).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, TypeVar

import redis.exceptions
import structlog
from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.engine import emit as emit_context
from dialog_worker.engine.interrupts import Interrupted
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Script, source

if TYPE_CHECKING:
    from dialog_worker.store.codec import Message


class Job(Protocol):
    """What the partial writer needs of a message in hand (the pipeline's Job): where its
    session's keys are, the lock token and seq that fence its writes, its attempt number,
    and the slot where the running step's writer is kept."""

    keys: Keys
    session_id: str
    token: str
    seq: int
    attempts: int
    partial: PartialWriter | None


log = structlog.get_logger("dialog_worker.daemon.partial_writer")

T = TypeVar("T")

# Largest text of one entry: a huge emit is split, so no reader ever reads one huge entry.
MAX_ENTRY_CHARS = 16_384
# Codes of lua/emit-2.lua, and the number of arguments of one batch.
APPENDED, ALREADY, FENCED, STALE, BAD = 1, 0, -1, -3, -4
BATCH_WIDTH = 9
# The script sets a stream's expiry at some entries only (lua/emit-2.lua): a writer asks for it
# when this share of DIALOG_PARTIAL_TTL_S has passed since its last ask, so a slow answer's
# stream cannot expire while it is still written.
REFRESH_SHARE = 1 / 8

# The flush tasks (held here: the loop keeps only weak references to tasks).
_background: set[asyncio.Task[None]] = set()


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """A typed event a step emitted (dialog_worker.emit_event): its kind and its data (JSON
    text). One entry of its own in the partial stream, in order with the text."""

    kind: str
    data: str


# The worker's own event on an answer's stream: the message waits for something outside its
# step (readers get a `waiting` event, dialog_worker/client/partial_reader.py). A step cannot
# emit this kind (engine/emit.py RESERVED_EVENT_KINDS).
WAITING = "waiting"
# Why a limit key made a call wait (lua/acquire-3.lua's `why`), as readers are told it: a
# pause is `paused`, a tenant's share cap at the key `tenant_cap`; a turn of the key's rates
# or of its max_in_flight (or one kept for it earlier) is `rate`.
WAIT_REASONS = {"paused": "paused", "tenant_cap": "tenant_cap", "slots": "slots"}


def waiting_data(why: str, wait_ms: float | None) -> str:
    """A `waiting` event's data (JSON): ``reason`` (`rate`, `paused`, `slots`, `tenant_cap`)
    and ``until_ms``, when it expects to go (epoch ms, this worker's clock; None: not known)."""
    until_ms = None if wait_ms is None else int(time.time() * 1000 + max(0.0, wait_ms))
    return json.dumps({"reason": WAIT_REASONS.get(why, "rate"), "until_ms": until_ms})


# What the writer gathers: runs of text, and events between them.
Item = str | Event
# Most events a history turn keeps (emit_event(..., keep=True)).
MAX_KEPT_EVENTS = 32


class PartialWriter:
    """The partial stream of one attempt of one message: gathers what the step emits (on the
    loop or in the step's thread). `PartialReplies` writes it, with every other live answer of
    the worker, in one call per flush interval."""

    def __init__(self, replies: PartialReplies, job: Job, msg_id: str, attempt: int) -> None:
        self.replies = replies
        self.job = job
        self.msg_id = msg_id
        self._keys: list[str] | None = None  # built on the first write: most steps emit nothing
        self.shard = job.keys.shard
        self.token = job.token
        self.seq = job.seq
        self.attempt = attempt
        self.pos = 0  # position of the next entry
        self._lock = threading.Lock()
        self._pending: list[Item] = []
        self._pending_chars = 0
        self._sent: list[str] = []  # the text written so far, for snapshots
        # Entries (pos, piece or event, snapshot) of a call whose answer was lost (the
        # connection broke): it may have run on the server, so they go again exactly as they
        # were, before anything emitted since (merged with it, a piece would reuse a position
        # the stream may have, be answered "already there", and the new text in it never
        # reach a reader).
        self.unsure: list[tuple[int, Item, str]] = []
        self.kept: list[dict[str, object]] = []  # events the step asked to keep in its turn
        self.closed = False
        self.used = False  # anything emitted at all (most steps emit nothing)
        self.fenced = False
        self.abandoned = False  # the step failed or was cancelled: nothing more is written
        self.inflight = 0  # batches of this writer in a call not answered yet
        self.refresh_at = 0.0  # loop.time() after which its next batch sets the expiry
        self.drained: asyncio.Event | None = None  # set by `finish`, set when all is written
        self.last_wait = ""  # the reason of its last `waiting` event (the message's life)

    @property
    def wrote(self) -> bool:
        return self.pos > 0

    @property
    def keys(self) -> list[str]:
        if self._keys is None:
            session = self.job.keys.session(self.job.session_id)
            self._keys = [session.lock, session.partial(self.msg_id)]
        return self._keys

    def add(self, text: str) -> None:
        self.used = True
        with self._lock:
            if self.closed or self.fenced:
                return
            self._pending.append(text)
            self._pending_chars += len(text)
            first = len(self._pending) == 1
            urgent = self._pending_chars >= self.replies.settings.partial_flush_chars
        if first or urgent:
            self.replies.wake(self, urgent)

    def add_event(self, kind: str, data: str, keep: bool = False) -> None:
        """A typed event (``data``: JSON text), written in order with the text."""
        self.used = True
        with self._lock:
            if self.closed or self.fenced:
                return
            self._pending.append(Event(kind, data))
            first = len(self._pending) == 1
            if keep and len(self.kept) < MAX_KEPT_EVENTS:
                self.kept.append({"kind": kind, "data": json.loads(data)})
        if first:
            self.replies.wake(self, False)

    async def waiting(self, why: str, wait_ms: float | None) -> None:
        """The step waits for its model (a call's turn, ``wait_ms`` away; None: not known):
        its readers get a `waiting` event. Once the answer has anything, in order with it (a
        position of its own); before that, as a transient entry that takes no position
        (`PartialReplies.transient`, one script call at once), so that an attempt that goes
        back to wait keeps its number (its model calls keep their kept turns)."""
        data = waiting_data(why, wait_ms)
        self.last_wait = WAIT_REASONS.get(why, "rate")
        with self._lock:
            clean = not (self.used or self.pos or self._pending or self.unsure or self.inflight)
        if not clean:
            self.add_event(WAITING, data)
            return
        await self.replies.transient(self, data)

    def take(self) -> list[Item]:
        """What was gathered since the last take: runs of text joined, events between them."""
        with self._lock:
            parts, self._pending, self._pending_chars = self._pending, [], 0
        items: list[Item] = []
        run: list[str] = []
        for part in parts:
            if isinstance(part, str):
                run.append(part)
                continue
            if run:
                items.append("".join(run))
                run = []
            items.append(part)
        if run:
            items.append("".join(run))
        return items

    def entries(self, items: list[Item]) -> list[tuple[int, Item, str]]:
        """What the next call sends for this answer: the entries of a call whose answer was
        lost, as they were, then those of ``items``."""
        return self.unsure + self.batches(items)

    def batches(self, items: list[Item] | str) -> list[tuple[int, Item, str]]:
        """(pos, piece or event, snapshot) for the entries of ``items``, after those written
        and those in doubt: a huge emit is split, and every `partial_maxlen // 2` entries
        carries the whole text so far."""
        if isinstance(items, str):
            items = [items]
        every = max(1, self.replies.settings.partial_maxlen // 2)
        out: list[tuple[int, Item, str]] = []
        pos = self.pos + len(self.unsure)
        # The text of the entries before the next one: those in doubt, then this batch's.
        done = "".join(p for _, p, _ in self.unsure if isinstance(p, str))
        for item in items:
            pieces: list[Item] = (
                [item]
                if isinstance(item, Event)
                else [item[s : s + MAX_ENTRY_CHARS] for s in range(0, len(item), MAX_ENTRY_CHARS)]
            )
            for piece in pieces:
                if isinstance(piece, str):
                    done += piece
                full = ""
                if pos and pos % every == 0:
                    full = "".join(self._sent) + done
                out.append((pos, piece, full))
                pos += 1
        return out

    def written(self, pieces: list[Item], codes: list[int]) -> None:
        """The answer to a call that carried ``pieces`` (the unsure ones first, if any)."""
        self.unsure = []
        for piece, code in zip(pieces, codes, strict=True):
            if code in (FENCED, STALE, BAD):
                # The lease is lost (the commit will be fenced as well), or the stream's key
                # is unusable: this answer streams no more; its end still comes from the commit.
                self.fenced = True
                return
            if isinstance(piece, str):
                self._sent.append(piece)
            self.pos += 1

    def idle(self) -> bool:
        with self._lock:
            return self.fenced or not (self._pending or self.inflight or self.unsure)

    async def finish(self) -> None:
        """The step returned: wait until what it emitted is written (the next flush, sent at
        once)."""
        if not self.used:  # the step has returned: nothing can be emitted any more
            self.closed = True
            return
        with self._lock:
            self.closed = True
        if self.idle():
            return
        self.drained = asyncio.Event()
        self.replies.wake(self, urgent=True)
        try:
            await asyncio.wait_for(self.drained.wait(), FINISH_WAIT_S)
        except TimeoutError:
            # Redis is slow or away: the commit goes on (readers take the end from it).
            log.warning("partial_write_late", note="committed without the last partial text")

    def abandon(self) -> None:
        """The step failed or was cancelled: what is gathered is dropped (the next attempt's
        entries tell readers to start over)."""
        with self._lock:
            self.closed = self.abandoned = True
            self._pending, self._pending_chars = [], 0

    async def shown(self) -> str:
        """The text readers were given: what was written, once the batches already on their
        way are answered (what a cancelled answer keeps; call after `abandon`)."""
        if not self.idle():
            self.drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drained.wait(), SHOWN_WAIT_S)
        return "".join(self._sent)


@dataclasses.dataclass(slots=True)
class _Ended:
    keys: list[str]
    attempt: int
    pos: int
    seq: int


# Longest wait, after a step returned, for its last partial text to be written.
FINISH_WAIT_S = 5.0
# Longest wait, after a step was cancelled, for the batches already sent (the text shown).
SHOWN_WAIT_S = 1.0
# Most batches in one script call.
FLUSH_BATCH = 256


class PartialReplies:
    """The pipeline's handle on partial streams: runs steps with a writer in context, writes
    what every live step emitted in one call per interval (per shard), and appends the end
    entry after a commit."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.settings = settings
        self.script = Script(redis, source("emit"))
        self._dirty: dict[PartialWriter, None] = {}  # writers with text to write, in order
        self._wakeup: asyncio.Event | None = None
        self._urgent: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        # Steps that wrote, waiting for their commit (bounded: a commit that never comes,
        # fenced or failed, must not leak its entry).
        self._written: collections.OrderedDict[tuple[str, int], _Ended] = collections.OrderedDict()
        self._written_cap = 4 * settings.concurrency + 16
        # End entries of committed messages, written by the next flush: (shard, keys, args).
        self._ends: list[tuple[int, list[str], list[str | int]]] = []

    def wake(self, writer: PartialWriter, urgent: bool) -> None:
        """From the loop or a step's thread: ``writer`` has text to write."""
        if threading.get_ident() == self._loop_thread:
            self._mark(writer, urgent)
        elif self._loop is not None:
            self._loop.call_soon_threadsafe(self._mark, writer, urgent)

    def _mark(self, writer: PartialWriter, urgent: bool) -> None:
        self._dirty[writer] = None
        self._want_flush(urgent)

    def _want_flush(self, urgent: bool) -> None:
        if self._task is None or self._task.done():
            self._wakeup, self._urgent = asyncio.Event(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="dialog-partial-writer"
            )
            _background.add(self._task)
            self._task.add_done_callback(_background.discard)
        assert self._wakeup is not None and self._urgent is not None
        self._wakeup.set()
        if urgent:
            self._urgent.set()

    async def _run(self) -> None:
        assert self._wakeup is not None and self._urgent is not None
        interval = self.settings.partial_flush_ms / 1000
        while True:
            await self._wakeup.wait()
            if not self._urgent.is_set() and interval > 0:
                # Gather: one call per interval for every live answer, not one per token.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), interval)
            self._wakeup.clear()
            self._urgent.clear()
            writers, self._dirty = list(self._dirty), {}
            ends, self._ends = self._ends, []
            try:
                await self._flush(writers)
                await self._write_ends(ends)
            except Exception:  # never let the writer task die: log, and go on
                log.exception("partial_flush_failed")

    async def _flush(self, writers: list[PartialWriter]) -> None:
        by_shard: dict[int, list[tuple[PartialWriter, list[Item]]]] = {}
        for writer in writers:
            text = writer.take()
            if (text or writer.unsure) and not writer.fenced:
                # Counted from now: a writer waiting in a later call is not idle either.
                writer.inflight += 1
                by_shard.setdefault(writer.shard, []).append((writer, text))
            elif writer.drained is not None and writer.idle():
                writer.drained.set()
        for batch in by_shard.values():
            for i in range(0, len(batch), FLUSH_BATCH):
                await self._send(batch[i : i + FLUSH_BATCH])

    async def _send(self, batch: list[tuple[PartialWriter, list[Item]]]) -> None:
        keys: list[str] = []
        args: list[str | int] = []
        plan: list[tuple[PartialWriter, list[tuple[int, Item, str]], list[Item], bool]] = []
        now = asyncio.get_running_loop().time()
        for writer, text in batch:
            pieces: list[Item] = []
            refresh = now >= writer.refresh_at  # asked by the answer's first entry of the call
            entries = writer.entries(text)
            for pos, piece, full in entries:
                keys += writer.keys
                if isinstance(piece, Event):  # "v": an event, its kind where an end's outcome is
                    args += ["v", writer.token, writer.attempt, pos, writer.seq, piece.data, full]
                    args.append(piece.kind)
                else:
                    args += ["d", writer.token, writer.attempt, pos, writer.seq, piece, full, ""]
                args.append("1" if refresh and not pieces else "")
                pieces.append(piece)
            plan.append((writer, entries, pieces, refresh))
        try:
            codes = await self.call(keys, args)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            log.warning("partial_write_failed", error=str(exc), note="retried at the next flush")
            # The call may have run on the server: its entries go again as they were.
            for writer, entries, _, _ in plan:
                writer.inflight -= 1
                if not writer.fenced:
                    writer.unsure = entries
                    self._dirty[writer] = None
            assert self._wakeup is not None
            self._wakeup.set()
            return
        except Exception as exc:  # e.g. Redis out of memory: these answers stream no more
            log.warning("partial_write_failed", error=str(exc), note="partial text dropped")
            for writer, _, _, _ in plan:
                writer.inflight -= 1
                writer.fenced = True
                if writer.drained is not None:
                    writer.drained.set()
            return
        at = 0
        every_s = self.settings.partial_ttl_s * REFRESH_SHARE
        for writer, _, pieces, refresh in plan:
            writer.inflight -= 1
            if refresh and codes[at] == APPENDED:
                writer.refresh_at = now + every_s
            writer.written(pieces, codes[at : at + len(pieces)])
            at += len(pieces)
            if writer.drained is not None and writer.idle():
                writer.drained.set()

    async def call(self, keys: list[str], args: list[str | int]) -> list[int]:
        s = self.settings
        raw = await asyncio.shield(
            self.script(
                keys=keys,
                args=[s.partial_maxlen, s.partial_ttl_s, len(args) // BATCH_WIDTH, *args],
            )
        )
        return [int(code) for code in raw]

    async def run(self, job: Job, msg: Message, step: Awaitable[T]) -> T:
        """Await ``step`` (the engine step of ``msg``) with a writer for what it emits."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        writer = job.partial = PartialWriter(self, job, msg.msg_id, job.attempts)
        token = emit_context.bind(writer)
        try:
            result = await step
        except Interrupted:
            # The step waits for a person: what it streamed is written first; the prompt (an
            # event "awaiting" at the writer's next position) goes in with the park itself
            # (lua/interrupt-3.lua), so a reader never sees a prompt it cannot answer yet.
            await writer.finish()
            raise
        except BaseException:
            writer.abandon()
            raise
        finally:
            emit_context.unbind(token)
        await writer.finish()
        if writer.wrote and not writer.fenced:
            self._written[(job.token, job.seq)] = _Ended(
                writer.keys, writer.attempt, writer.pos, job.seq
            )
            while len(self._written) > self._written_cap:
                self._written.popitem(last=False)
        return result

    async def waiting(self, job: Job, why: str, wait_ms: float) -> None:
        """``job``'s message goes back to wait outside its step (its limit key's turn is later
        than a step waits, or the key is paused): its readers get a `waiting` event now (one
        script call, only on this path). An answer that wrote nothing gets it as a transient
        entry (no position: the next attempt keeps this number, and its calls their kept
        turns); one that wrote gets it at its next position (its next attempt takes a new
        number anyway, and its readers a `reset`). Best effort: a failure is logged."""
        writer = job.partial
        if writer is None or writer.fenced:
            return
        writer.last_wait = WAIT_REASONS.get(why, "rate")
        if not writer.used:
            await self.transient(writer, waiting_data(why, wait_ms))
            return
        if not writer.idle():  # batches on their way come first (bounded wait)
            writer.drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(writer.drained.wait(), SHOWN_WAIT_S)
        if writer.fenced or writer.unsure or writer.inflight:
            return  # in doubt: no position to write at
        event = Event(WAITING, waiting_data(why, wait_ms))
        ((pos, _, full),) = writer.batches([event])
        args: list[str | int] = ["v", writer.token, writer.attempt, pos, writer.seq, event.data]
        args += [full, WAITING, ""]
        try:
            codes = await self.call(writer.keys, args)
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("waiting_not_shown", error=str(exc))
            return
        writer.written([event], codes)

    async def transient(self, writer: PartialWriter, data: str) -> None:
        """A `waiting` event at no position of the answer (lua/emit-2.lua kind "w"), fenced by
        the lock: not written (0) once the attempt wrote anything. Best effort."""
        args: list[str | int] = ["w", writer.token, writer.attempt, 0, writer.seq, data, ""]
        args += [WAITING, ""]
        try:
            await self.call(writer.keys, args)
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("waiting_not_shown", error=str(exc))

    async def committed(self, job: Job, msg_id: str, outcome: str, reply: str) -> None:
        """The commit of ``job`` was written: end its partial stream, if its step wrote one
        (a dead letter always looks, since earlier attempts may have written). The end goes
        with the ends of every other message committed meanwhile, in one call at once (a
        thousand answers finishing together were a thousand concurrent calls, each on a
        connection of its own). A failure is logged only: readers derive the end from the
        commit."""
        ended = self._written.pop((job.token, job.seq), None)
        if ended is None:
            if outcome == "applied":
                return
            session = job.keys.session(job.session_id)
            ended = _Ended([session.lock, session.partial(msg_id)], job.attempts, 0, job.seq)
        args: list[str | int] = ["e", "", ended.attempt, ended.pos, ended.seq, reply, ""]
        args += [outcome, ""]  # no refresh asked: an end always sets the expiry
        self._ends.append((job.keys.shard, ended.keys, args))
        self._want_flush(urgent=True)

    async def _write_ends(self, ends: list[tuple[int, list[str], list[str | int]]]) -> None:
        by_shard: dict[int, list[tuple[list[str], list[str | int]]]] = {}
        for shard, keys, args in ends:
            by_shard.setdefault(shard, []).append((keys, args))
        for batch in by_shard.values():
            for i in range(0, len(batch), FLUSH_BATCH):
                chunk = batch[i : i + FLUSH_BATCH]
                try:
                    await self.call(
                        [k for keys, _ in chunk for k in keys],
                        [a for _, args in chunk for a in args],
                    )
                except (redis.exceptions.RedisError, OSError) as exc:
                    log.warning(
                        "partial_end_failed", error=str(exc), note="readers take the commit"
                    )
