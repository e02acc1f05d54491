"""Streamed replies, the worker's side: `emit` for engines, and the writer that batches what a
step emits into its message's partial stream (lua/emit-2.lua).

A step calls ``dialog_worker.emit(text)`` as its answer grows; the committed reply is still
the text the step returns. The pipeline runs each step inside `PartialReplies.run`, which puts
a `PartialWriter` in a context variable: an ``async def`` step sees it directly, a plain
``def`` step in its worker thread too (``anyio.to_thread.run_sync`` copies the context).

The writer never makes one Redis call per token: text is gathered for
``DIALOG_PARTIAL_FLUSH_MS`` (or until ``DIALOG_PARTIAL_FLUSH_CHARS``) and appended as one
entry by one script call, fenced by the session lock, so a worker that lost its lease writes
nothing. After the commit the pipeline appends the end entry (outcome and committed reply);
readers do not depend on it (worker/partials.py derives the end from the commit too).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import threading
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import redis.exceptions
import structlog
from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.scripts import Script, source

if TYPE_CHECKING:
    from dialog_worker.codec import Message
    from dialog_worker.pipeline import Job

log = structlog.get_logger("dialog_worker.streaming")

T = TypeVar("T")

# Largest text of one entry: a huge emit is split, so no reader ever reads one huge entry.
MAX_ENTRY_CHARS = 16_384
# Codes of lua/emit-2.lua.
APPENDED, ALREADY, FENCED, STALE = 1, 0, -1, -3

_current: contextvars.ContextVar[PartialWriter | None] = contextvars.ContextVar(
    "dialog_worker_partial_writer", default=None
)
# Flush tasks left to finish on their own (a failed step does not wait for them).
_background: set[asyncio.Task[None]] = set()


def emit(text: str) -> None:
    """Add ``text`` to the reply this step is streaming (readers see it within about
    ``DIALOG_PARTIAL_FLUSH_MS``). Call it from a step, ``async def`` or plain ``def``; outside a
    step (a unit test calling ``step`` directly) it does nothing. It never blocks and never
    talks to Redis itself. The committed reply is what the step returns, not what it emitted."""
    if not isinstance(text, str):
        raise TypeError(f"emit() takes text (str), got {type(text).__name__}")
    writer = _current.get()
    if writer is not None and text:
        writer.add(text)


class PartialWriter:
    """The partial stream of one attempt of one message: gathers emitted text (from the loop or
    from the step's thread) and appends it in batches, in order, from one flush task."""

    def __init__(self, replies: PartialReplies, job: Job, msg_id: str, attempt: int) -> None:
        self.replies = replies
        self.settings = replies.settings
        session = job.keys.session(job.session_id)
        self.keys = [session.lock, session.partial(msg_id)]
        self.token = job.token
        self.seq = job.seq
        self.attempt = attempt
        self.pos = 0  # position of the next entry
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._pending_chars = 0
        self._sent: list[str] = []  # the text written so far, for snapshots
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closed = False
        self.fenced = False
        self._snapshot_every = max(1, self.settings.partial_maxlen // 2)

    @property
    def wrote(self) -> bool:
        return self.pos > 0

    def add(self, text: str) -> None:
        with self._lock:
            if self.closed or self.fenced:
                return
            self._pending.append(text)
            self._pending_chars += len(text)
            first = len(self._pending) == 1
            urgent = self._pending_chars >= self.settings.partial_flush_chars
        if first or urgent:
            if threading.get_ident() == self._loop_thread:
                self._kick(urgent)
            else:
                self.loop.call_soon_threadsafe(self._kick, urgent)

    def _kick(self, urgent: bool) -> None:
        if self._task is None:
            self._task = self.loop.create_task(self._run(), name="dialog-partial-writer")
            _background.add(self._task)
            self._task.add_done_callback(_background.discard)
        self._wake.set()
        if urgent:
            self._urgent.set()

    async def _run(self) -> None:
        interval = self.settings.partial_flush_ms / 1000
        while True:
            await self._wake.wait()
            if not self._urgent.is_set() and interval > 0:
                # Gather: one call per interval, not one per token.
                try:
                    await asyncio.wait_for(self._urgent.wait(), interval)
                except TimeoutError:
                    pass
            self._wake.clear()
            self._urgent.clear()
            await self._flush()
            if self.closed:
                return

    async def _flush(self) -> None:
        with self._lock:
            parts, self._pending, self._pending_chars = self._pending, [], 0
        if not parts or self.fenced:
            return
        text = "".join(parts)
        for start in range(0, len(text), MAX_ENTRY_CHARS):
            piece = text[start : start + MAX_ENTRY_CHARS]
            if not await self._append(piece):
                with self._lock:  # written later, in order, or dropped if the step ends first
                    self._pending.insert(0, text[start:])
                    self._pending_chars += len(text) - start
                return

    async def _append(self, piece: str) -> bool:
        """One entry; False when it must be tried again later (Redis failed)."""
        pos = self.pos
        full = ""
        if pos and pos % self._snapshot_every == 0:
            full = "".join(self._sent) + piece
        try:
            code = await self.replies.call(
                self.keys, "d", self.token, self.attempt, pos, self.seq, piece, full, ""
            )
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("partial_write_failed", error=str(exc), note="retried at the next flush")
            return False
        if code in (FENCED, STALE):
            self.fenced = True  # the lease is lost: the commit will be fenced as well
            return True
        self._sent.append(piece)
        self.pos = pos + 1
        return True

    async def finish(self) -> None:
        """The step returned: write what is still gathered, then stop."""
        with self._lock:
            self.closed = True
        if self._task is not None:
            self._wake.set()
            self._urgent.set()
            await self._task

    def abandon(self) -> None:
        """The step failed or was cancelled: what is gathered is dropped; a write in flight
        completes on its own (the next attempt's entries tell readers to start over)."""
        with self._lock:
            self.closed = True
            self._pending, self._pending_chars = [], 0
        self._wake.set()
        self._urgent.set()


@dataclasses.dataclass(slots=True)
class _Ended:
    keys: list[str]
    attempt: int
    pos: int
    seq: int


class PartialReplies:
    """The pipeline's handle on partial streams: runs steps with a writer in context, and
    appends the end entry after a commit."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.settings = settings
        self.script = Script(redis, source("emit"))
        # Steps that wrote, waiting for their commit (bounded: a commit that never comes,
        # fenced or failed, must not leak its entry).
        self._written: collections.OrderedDict[tuple[str, int], _Ended] = collections.OrderedDict()
        self._written_cap = 4 * settings.concurrency + 16

    async def call(self, keys: list[str], *args: str | int) -> int:
        s = self.settings
        raw = await asyncio.shield(
            self.script(keys=keys, args=[*args, s.partial_maxlen, s.partial_ttl_s])
        )
        return int(raw)

    async def run(self, job: Job, msg: Message, step: Awaitable[T]) -> T:
        """Await ``step`` (the engine step of ``msg``) with a writer for what it emits."""
        writer = PartialWriter(self, job, msg.msg_id, job.attempts)
        token = _current.set(writer)
        try:
            result = await step
        except BaseException:
            writer.abandon()
            raise
        finally:
            _current.reset(token)
        await writer.finish()
        if writer.wrote and not writer.fenced:
            self._written[(job.token, job.seq)] = _Ended(
                writer.keys, writer.attempt, writer.pos, job.seq
            )
            while len(self._written) > self._written_cap:
                self._written.popitem(last=False)
        return result

    async def committed(self, job: Job, msg_id: str, outcome: str, reply: str) -> None:
        """The commit of ``job`` was written: end its partial stream, if its step wrote one
        (a dead letter always looks, since earlier attempts may have written). A failure is
        logged only: readers derive the end from the commit."""
        ended = self._written.pop((job.token, job.seq), None)
        if ended is None:
            if outcome == "applied":
                return
            session = job.keys.session(job.session_id)
            ended = _Ended([session.lock, session.partial(msg_id)], job.attempts, 0, job.seq)
        try:
            await self.call(
                ended.keys, "e", "", ended.attempt, ended.pos, ended.seq, reply, "", outcome
            )
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("partial_end_failed", error=str(exc), note="readers take the commit")


def current_writer() -> Any:
    """The writer of the step running in this context (None outside a step); for tests."""
    return _current.get()
