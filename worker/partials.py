"""Streamed replies, the reader's side: the events of one message's answer as it is written
(`DialogClient.stream`, the HTTP gateway).

A message's partial stream (``<session keys>:partial:<msg_id>``, written by
worker/streaming.py through lua/emit-2.lua) holds entries ``a`` (attempt), ``p`` (position in
that attempt's answer, 0, 1, 2...), ``s`` (the message's seq), ``k`` (``d`` text, ``e`` end),
``t`` (the text, or the committed reply), and sometimes ``f`` (the whole text up to this
entry: a snapshot for readers that fell behind the stream's trimmed start) and ``o`` (the
outcome of an end).

Readers see `StreamEvent`s:

- ``delta``: more text; append it.
- ``reset``: a new attempt started the answer again; clear what you show (then deltas follow).
- ``resync``: you missed text that is no longer stored piece by piece; replace what you show
  with ``text`` (the whole answer so far).
- ``end``: the message is finished; ``outcome`` and ``text``, the committed reply, which
  replaces whatever was shown. Always the last event.

A reader resumes from the ``cursor`` of the last event it handled
(``<msg_id>:<attempt>:<pos>``, never a Redis entry id): it gets every later piece once.

The end never depends on one write: the worker appends an end entry after the commit, but a
reader also ends when the reply event arrives (`DialogClient` registers for it before it reads)
or when the session's state says the message's seq was applied (one HGET, checked at start and
while idle); the committed reply then comes from the state's history.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, cast

from redis.asyncio import Redis

from dialog_worker.errors import ValidationError
from dialog_worker.replies import Reply

EVENT_KINDS = ("delta", "reset", "resync", "end")
_MAX_NUMBER_DIGITS = 18


@dataclasses.dataclass(frozen=True, slots=True)
class Cursor:
    msg_id: str
    attempt: int
    pos: int

    def __str__(self) -> str:
        return f"{self.msg_id}:{self.attempt}:{self.pos}"


def parse_cursor(value: str, msg_id: str) -> Cursor:
    """``<msg_id>:<attempt>:<pos>`` of this message (the msg_id may itself contain colons)."""
    if not isinstance(value, str) or len(value) > 1024:
        raise ValidationError("cursor must be text of at most 1024 characters")
    head, sep1, pos = value.rpartition(":")
    name, sep2, attempt = head.rpartition(":")
    if not (sep1 and sep2) or not _digits(attempt) or not _digits(pos):
        raise ValidationError(f"cursor must look like <msg_id>:<attempt>:<pos>, got {value!r}")
    if name != msg_id:
        raise ValidationError(f"cursor {value!r} belongs to another message than {msg_id!r}")
    return Cursor(msg_id, int(attempt), int(pos))


def _digits(value: str) -> bool:
    return 0 < len(value) <= _MAX_NUMBER_DIGITS and value.isascii() and value.isdigit()


@dataclasses.dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a streamed answer. ``cursor`` is None for ``reset`` (resume from the
    previous event's cursor: you get the reset again). ``outcome`` only on ``end``."""

    kind: str
    msg_id: str
    attempt: int
    text: str
    cursor: str | None
    pos: int | None = None
    outcome: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field(fields: Mapping[bytes, bytes], name: bytes) -> str | None:
    value = fields.get(name)
    return None if value is None else value.decode("utf-8", "replace")


def _number(fields: Mapping[bytes, bytes], name: bytes) -> int | None:
    value = fields.get(name)
    if value is None or not 0 < len(value) <= _MAX_NUMBER_DIGITS or not value.isdigit():
        return None
    return int(value)


class Tracker:
    """Turns partial-stream entries into events for one reader, from its cursor on. Pure: no
    I/O, so every resume case is testable without Redis."""

    def __init__(self, msg_id: str, after: Cursor | None = None) -> None:
        self.msg_id = msg_id
        self.attempt: int | None = after.attempt if after else None
        self.pos = after.pos if after else -1
        self.after = after
        self.seq: int | None = None
        self.behind = False  # a gap: waiting for a snapshot
        self.top = (0, -1)  # the newest (attempt, pos) of the stream, whatever the cursor

    def feed(self, fields: Mapping[bytes, bytes]) -> Iterator[StreamEvent]:
        attempt, pos, kind = _number(fields, b"a"), _number(fields, b"p"), _field(fields, b"k")
        seq = _number(fields, b"s")
        if attempt is None or pos is None or kind not in ("d", "e"):
            return  # not ours (anyone with XADD can write anything): skipped
        if seq is not None and seq > 0:
            self.seq = seq
        if kind == "d":
            self.top = max(self.top, (attempt, pos))
        if kind == "e":
            yield self.end(_field(fields, b"o") or "applied", _field(fields, b"t") or "")
            return
        if self.attempt is not None and attempt < self.attempt:
            return
        if self.attempt is None or attempt > self.attempt:
            if self.attempt is not None:
                yield StreamEvent("reset", self.msg_id, attempt, "", None)
            self.attempt, self.pos, self.behind = attempt, -1, False
        if pos <= self.pos:
            return
        text = _field(fields, b"t") or ""
        if pos == self.pos + 1:
            self.pos, self.behind = pos, False
            yield StreamEvent("delta", self.msg_id, attempt, text, self._cursor(), pos)
            return
        full = _field(fields, b"f")
        if full is None:
            self.behind = True  # trimmed past our place: wait for the next snapshot
            return
        self.pos, self.behind = pos, False
        yield StreamEvent("resync", self.msg_id, attempt, full, self._cursor(), pos)

    def _cursor(self) -> str:
        return str(Cursor(self.msg_id, self.attempt or 0, self.pos))

    def end_cursor(self) -> Cursor:
        """Where the end is: one past the stream's newest piece. Every reader that read the
        stream computes the same, so a reader resuming from it knows it has everything."""
        return Cursor(self.msg_id, self.top[0], self.top[1] + 1)

    def end(self, outcome: str, text: str) -> StreamEvent:
        cursor = self.end_cursor()
        return StreamEvent(
            "end", self.msg_id, cursor.attempt, text, str(cursor), cursor.pos, outcome
        )

    def resumed_at_end(self) -> bool:
        """The reader's cursor is the end cursor: it has everything already."""
        return self.after is not None and self.after == self.end_cursor()


def reply_from_history(doc: bytes | None, msg_id: str, seq: int | None) -> str | None:
    """The bot's reply to ``msg_id`` in a stored state document, or None when the turn is not
    kept (any more). Nothing read from Redis is trusted to be well-formed."""
    if not doc:
        return None
    try:
        state = json.loads(doc)
    except (ValueError, UnicodeDecodeError):
        return None
    history = state.get("history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        return None
    for turn in reversed(history):
        if (
            isinstance(turn, dict)
            and turn.get("msg_id") == msg_id
            and (seq is None or turn.get("seq") == seq)
            and isinstance(turn.get("bot"), str)
        ):
            return str(turn["bot"])
    return None


# ---------------------------------------------------------------------------------------------
# Following one message's answer

# Entries read per call: a reader catching up reads in bounded pieces, never all at once.
PAGE = 64
# While nothing arrives, how often a reader looks at the session's state for the commit (the
# reply event and the end entry normally end it sooner).
IDLE_CHECK_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class MessageKeys:
    partial: str
    state: str
    dedupe: str


async def follow(
    redis: Redis,
    keys: MessageKeys,
    msg_id: str,
    after: Cursor | None,
    reply: asyncio.Future[Reply],
    deadline: float | None,
    block_ms: int,
) -> AsyncIterator[StreamEvent]:
    """The events of one message's answer from ``after`` on, ending with ``end``.

    ``reply`` is a waiter for the message's reply event, registered before this is called (so
    a commit that lands while we read cannot be missed). ``deadline`` (``loop.time()``) bounds
    the wait: `TimeoutError` after it. ``redis`` returns bytes.
    """
    tracker = Tracker(msg_id, after)
    last_id = b"-"
    loop = asyncio.get_running_loop()
    next_check = 0.0
    while True:
        rows = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await redis.xrange(keys.partial, min=last_id, max="+", count=PAGE),
        )
        for entry_id, fields in rows:
            last_id = b"(" + entry_id
            for event in tracker.feed(fields):
                if event.kind == "end":
                    if not tracker.resumed_at_end():
                        yield event
                    return
                yield event
        if len(rows) == PAGE:
            continue
        # Caught up with the stream: is the message finished?
        if reply.done() and (reply.cancelled() or reply.exception() is not None):
            # The reply reader failed: the state checks below still end the wait.
            reply = loop.create_future()
        if reply.done():
            got = reply.result()
            end = tracker.end(got.outcome, got.text)
            if not tracker.resumed_at_end():
                yield end
            return
        if loop.time() >= next_check:
            found = await _finished(redis, keys, msg_id, tracker)
            if found is not None:
                if not tracker.resumed_at_end():
                    yield found
                return
            next_check = loop.time() + IDLE_CHECK_S
        wait_s = min(block_ms / 1000, max(0.0, next_check - loop.time()))
        if deadline is not None:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            wait_s = min(wait_s, left)
        await _wait_for_more(redis, keys.partial, last_id, reply, wait_s)


async def _finished(
    redis: Redis, keys: MessageKeys, msg_id: str, tracker: Tracker
) -> StreamEvent | None:
    """The end, when the session's state says the message was applied (two O(1) reads while
    it is not; its history is read once, at the end)."""
    seq = tracker.seq
    if seq is None:
        raw = cast(bytes | None, await redis.get(keys.dedupe))
        seq = int(raw) if raw is not None and 0 < len(raw) <= 18 and raw.isdigit() else None
        if seq is None:
            # No seq known (an answer that emitted nothing, sent without an explicit msg_id):
            # the history alone can tell.
            doc = cast(bytes | None, await redis.hget(keys.state, "d"))
            text = reply_from_history(doc, msg_id, None)
            return None if text is None else tracker.end("applied", text)
    applied, last, doc = cast(list[bytes | None], await redis.hmget(keys.state, ["a", "s", "d"]))
    applied_seq = int(applied) if applied is not None and applied.isdigit() else 0
    if applied_seq < seq and last is not None:
        return None  # the session has it outstanding
    text = reply_from_history(doc, msg_id, seq)
    # A state that expired, or a turn no longer kept: finished, its text is gone.
    return tracker.end("applied" if text is not None else "expired", text or "")


async def _wait_for_more(
    redis: Redis, key: str, last_id: bytes, reply: asyncio.Future[Reply], wait_s: float
) -> None:
    """Until the partial stream grows, the reply event arrives, or ``wait_s`` is over."""
    block_ms = max(1, int(wait_s * 1000))
    start = "0-0" if last_id == b"-" else last_id[1:]
    read: asyncio.Future[Any] = asyncio.ensure_future(
        redis.xread({key: start}, count=1, block=block_ms)
    )
    either: set[asyncio.Future[Any]] = {read, reply}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not read.done():
            # The reply came first: the blocked read is given up (redis-py drops that
            # connection; it only happens at the end of an answer that emitted nothing).
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await read
    if read.done() and not read.cancelled():
        read.result()  # a Redis error surfaces here
