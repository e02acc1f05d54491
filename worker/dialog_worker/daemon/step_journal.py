"""The step journal, the worker's side: what `dialog_worker.once` and `dialog_worker.interrupt`
(dialog_worker/engine/journal.py, engine/interrupts.py) read and write for one attempt of one
message.

The journal is read once per attempt, at the first call that needs it (one HGETALL; bounded by
DIALOG_JOURNAL_MAX_BYTES), and kept in memory for the attempt; an interrupt's answer is read
from the session's interrupts hash (one HGET per interrupt() call); each new result is recorded
by lua/journal-1.lua, fenced by the lease and the session's applied seq, before `once` returns
it. A refusal by the fence means the attempt lost its message: the step is stopped like one
whose lease the heartbeat found lost.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar, cast

import structlog
from redis.asyncio import Redis

from dialog_worker.engine.interrupts import interrupt_id
from dialog_worker.errors import JournalFull
from dialog_worker.metrics import Metrics
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, Script

T = TypeVar("T")

log = structlog.get_logger("dialog_worker.daemon.step_journal")

# How long a plain step's thread waits for one journal call on the event loop before it gives
# up (the call itself takes a round trip; the step's own timeout usually ends it first).
THREAD_WAIT_S = 60.0


class Job(Protocol):
    """What the journal needs of the message in hand (the pipeline's Job)."""

    keys: Keys
    session_id: str
    token: str
    seq: int
    msg_id: str
    attempts: int

    @property
    def first_seq(self) -> int: ...


class JournalFenced(Exception):
    """The journal write was refused: the lock is not this attempt's any more, or its message
    is no longer the session's next one. The step's result could not be committed either."""


class AttemptJournal:
    """The journal of one attempt of one message (bound for the step by the pipeline)."""

    def __init__(
        self,
        redis: Redis,
        script: Script,
        job: Job,
        max_bytes: int,
        ttl_s: int,
        metrics: Metrics | None = None,
    ) -> None:
        self.redis = redis
        self.metrics = metrics
        self.script = script
        self.job = job
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.loop = asyncio.get_running_loop()
        self._entries: dict[bytes, bytes] | None = None
        self._loading: asyncio.Lock | None = None
        self._lock = threading.Lock()
        self.asked = 0  # interrupt() calls of this attempt
        self.answered = 0  # of those, how many got their value (or their timeout)
        self.recorded = 0  # results this attempt recorded (the others came from the journal)
        # Each once() of this attempt: (name, answered from the journal), for the message's
        # life (dialog_worker/daemon/message_life.py); bounded there.
        self.calls: list[tuple[str, bool]] = []

    @property
    def key(self) -> str:
        return self.job.keys.session(self.job.session_id).journal(self.job.msg_id)

    async def _load(self) -> dict[bytes, bytes]:
        if self._entries is None:
            if self._loading is None:
                self._loading = asyncio.Lock()
            async with self._loading:
                if self._entries is None:
                    raw = await self.redis.hgetall(self.key)  # bytes: the worker's raw client
                    self._entries = cast(dict[bytes, bytes], raw)
        return self._entries

    async def result(self, name: str) -> str | None:
        found = (await self._load()).get(b"o:" + name.encode("utf-8", "surrogatepass"))
        if found is None:
            return None
        self.calls.append((name, True))
        if self.metrics is not None:
            self.metrics.journal_calls.labels("replayed").inc()
        # An earlier attempt's call (a crash, a retry, the run after a resume) answered without
        # calling again: said in the log, so "why did my tool not run?" has an answer. The
        # name only: the result may hold what the log must not.
        log.info(
            "journal_replayed",
            once=name,
            session_id=self.job.session_id,
            msg_id=self.job.msg_id,
            attempt=self.job.attempts,
        )
        return found.decode("utf-8", "replace")

    async def record(self, name: str, value: str) -> str:
        job = self.job
        raw = await asyncio.shield(
            self.script(
                keys=[job.keys.session_prefix],
                args=[
                    job.token,
                    job.session_id,
                    job.first_seq,  # the scripts fence by it (a merged burst's first part)
                    job.msg_id,
                    name,
                    value,
                    self.max_bytes,
                    self.ttl_s,
                ],
            )
        )
        code = Code(int(raw[0]))
        entries = await self._load()
        field = b"o:" + name.encode("utf-8", "surrogatepass")
        if code is Code.JOURNALED:
            entries[field] = value.encode("utf-8", "surrogatepass")
            self.recorded += 1
            self.calls.append((name, False))
            if self.metrics is not None:
                self.metrics.journal_calls.labels("recorded").inc()
            return value
        if code is Code.JOURNAL_HAD:
            entries[field] = raw[1]
            return bytes(raw[1]).decode("utf-8", "replace")
        if code is Code.JOURNAL_FULL:
            raise JournalFull(
                f"the result of once({name!r}) is {len(value.encode())} bytes; the message's "
                f"journal holds {int(raw[1])} of at most {self.max_bytes} "
                "(DIALOG_JOURNAL_MAX_BYTES)"
            )
        raise JournalFenced(f"journal write refused ({code.name.lower()}): the lease is lost")

    async def interrupt_ended(self, n: int) -> dict[str, Any] | None:
        """How the step's ``n``-th interrupt ended: the session's interrupts hash (written by
        the resume, or by the worker at its timeout; lua/resolve-2.lua, resume-3.lua)."""
        job = self.job
        found = await self.redis.hget(
            job.keys.session(job.session_id).interrupts, self.interrupt_id(n)
        )
        if found is None:
            return None
        try:
            ended = json.loads(found)
        except ValueError:
            return None
        return ended if isinstance(ended, dict) else None

    def interrupt_id(self, n: int) -> str:
        return interrupt_id(self.job.msg_id, self.job.seq, n)

    def next_interrupt(self) -> int:
        with self._lock:
            self.asked += 1
            return self.asked

    def interrupt_answered(self) -> None:
        with self._lock:
            self.answered += 1

    def run_sync(self, call: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(call, self.loop).result(THREAD_WAIT_S)

    async def unspent_attempts(self) -> int:
        """How many earlier attempts of the message ended awaiting a person (the journal's
        w) or handed back for its model's limit key after streaming (r, lua/release-2.lua):
        they are not counted against DIALOG_MAX_ATTEMPTS."""
        journal = await self._load()
        return sum(_count(journal.get(field)) for field in (b"w", b"r"))


def _count(raw: bytes | None) -> int:
    """A journal's counter (written by the scripts, read as untrusted): 0 unless digits."""
    return int(raw) if raw is not None and raw.isdigit() and len(raw) <= 9 else 0
