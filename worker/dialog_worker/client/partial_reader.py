"""Streamed replies, the reader's side: the events of one message's answer as it is written
(`DialogClient.stream`, the HTTP gateway).

A message's partial stream (``<session keys>:partial:<msg_id>``, written by
dialog_worker/daemon/partial_writer.py through lua/emit-2.lua) holds entries ``a`` (attempt), ``p``
(position in
that attempt's answer, 0, 1, 2...), ``s`` (the message's seq), ``k`` (``d`` text, ``e`` end),
``t`` (the text, or the committed reply), and sometimes ``f`` (the whole text up to this
entry: a snapshot for readers that fell behind the stream's trimmed start) and ``o`` (the
outcome of an end). Its entry ids are ``<attempt + 1>-<pos>``, and ``18446744073709551615-0``
for the end (clock ids in a stream an earlier version wrote): readers use them only to order
entries and to go on reading where they stopped, never as a cursor. A message rejected at
intake (``multitask=reject``) is never sequenced: intake writes its end, seq 0, with ``i``,
the rejected entry's id (lua/intake-5.lua).

Readers see `StreamEvent`s:

- ``delta``: more text; append it.
- ``reset``: a new attempt started the answer again; clear what you show (then deltas follow).
- ``resync``: you missed text that is no longer stored piece by piece; replace what you show
  with ``text`` (the whole answer so far).
- ``end``: the message is finished; ``outcome`` and ``text``, the committed reply, which
  replaces whatever was shown. Always the last event.
- ``event``: a typed event the step emitted beside its text (``dialog_worker.emit_event``):
  ``event_kind`` and ``data`` (any JSON), in order with the deltas, under the same cursor
  rules (a new attempt's ``reset`` drops it with the text). ``event_kind`` ``awaiting`` is the
  worker's: the step waits for a person (``data``: ``interrupt_id`` and ``payload``); the
  stream goes on once the interrupt is resumed (a ``reset``, then the new attempt's answer).
  A reader that fell behind the stream's trimmed start resyncs the text; the events it
  missed are not replayed.
- ``waiting``: the worker's: the message waits for something outside its step, ``data``
  ``{"reason": "rate"|"paused"|"slots"|"tenant_cap", "until_ms": N|null}`` (when it expects
  to go, epoch ms). Show it until the next event; it is not kept in the message's history.
  Before the answer has text the worker writes it as an entry ``k`` ``w`` at no position
  (its id just below the attempt's own): no cursor, nothing of the reader's place moves.

A reader resumes from the ``cursor`` of the last event it handled
(``<msg_id>:<attempt>:<pos>``, never a Redis entry id): it gets every later piece once.

The end never depends on one write: the worker appends an end entry after the commit, but a
reader also ends when the reply event arrives (`DialogClient` registers for it before it reads)
or when the session's state says the message's seq was applied (one HGET, checked at start,
unless the message was just sent, and after every 2 s without new entries); the committed
reply then comes from the state's history.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, cast

import structlog
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.client.replies import UNAPPLIED_MARKS, Reply, entry_key
from dialog_worker.errors import ValidationError

log = structlog.get_logger("dialog_worker.client.partial_reader")

EVENT_KINDS = ("delta", "reset", "resync", "end", "event", "waiting")
# Largest event data a reader decodes (a worker writes at most 16 KiB; anyone with XADD can
# write anything).
MAX_EVENT_DATA_CHARS = 65_536
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
    previous event's cursor: you get the reset again). ``outcome`` only on ``end``;
    ``event_kind`` only on ``event``, ``data`` on ``event`` and ``waiting``."""

    kind: str
    msg_id: str
    attempt: int
    text: str
    cursor: str | None
    pos: int | None = None
    outcome: str | None = None
    event_kind: str | None = None
    data: Any = None

    def as_dict(self) -> dict[str, Any]:
        shown = dataclasses.asdict(self)
        if self.kind != "event":
            del shown["event_kind"]
            if self.kind != "waiting":
                del shown["data"]
        return shown


# An entry's fields: a mapping, or a flat list of names and values as Redis sent them.
Fields = Mapping[bytes, bytes] | list[bytes]


def _values(fields: Fields) -> tuple[bytes | None, ...]:
    """The raw ``a``, ``p``, ``s``, ``k``, ``t``, ``f``, ``o``, ``i`` and ``n`` of an entry. A
    text entry as lua/emit-2.lua writes it (its first five names, in that order) is read by
    position: no dict per entry; any other list (an end, an event, a snapshot, anything forged)
    goes through a dict (the last of repeated names wins, as in a mapping)."""
    if not fields:
        return (None,) * 9
    if type(fields) is list:
        if (
            len(fields) == 10
            and fields[0] == b"a"
            and fields[2] == b"p"
            and fields[4] == b"s"
            and fields[6] == b"k"
            and fields[8] == b"t"
        ):
            return fields[1], fields[3], fields[5], fields[7], fields[9], None, None, None, None
        fields = _pairs(fields)
    get = cast(Mapping[bytes, bytes], fields).get
    return (
        get(b"a"),
        get(b"p"),
        get(b"s"),
        get(b"k"),
        get(b"t"),
        get(b"f"),
        get(b"o"),
        get(b"i"),
        get(b"n"),
    )


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "replace")


def _int(value: bytes | None) -> int | None:
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
        self.end_seq: int | None = None  # the seq the last end entry named
        self.behind = False  # a gap: waiting for a snapshot
        self.top = (0, -1)  # the newest (attempt, pos) of the stream, whatever the cursor
        # Entries of a lower seq belong to an earlier message sent under the same msg_id
        # (see `forget_older`): skipped.
        self.min_seq = 0
        # Entries of a lower seq are skipped from the start too: the msg_id names this seq now
        # (its dedupe key), or this client sent it again and what the stream held then was an
        # earlier message's (`_first_seq`). ``skipped``: some were.
        self.floor = 0
        self.skipped = False
        self.shown = False  # an earlier message's pieces were yielded: reset before ours
        # A piece of a later seq than those read, with no end between: the message runs again
        # under a new seq (a redrive into its held session moved it up), and its stream was
        # started anew below the ids read so far: the reader forgets what it has and reads the
        # stream again from its start (`follow`).
        self.renumbered = 0

    def forget_older(self, seq: int) -> None:
        """Everything read so far (up to an end of ``seq``) was an earlier message's, sent
        under the same msg_id before it ended unapplied: from now on only entries of a later
        seq count, and the first of them is preceded by a ``reset`` if anything was shown."""
        self.min_seq = seq + 1
        self.shown = self.shown or self.attempt is not None
        self.attempt, self.pos, self.seq, self.end_seq = None, -1, None, None
        self.renumbered = 0
        self.behind, self.top, self.after = False, (0, -1), None

    def feed(self, fields: Fields) -> Iterator[StreamEvent]:
        a, p, s, kind, t, f, o, _, n = _values(fields)
        attempt, pos, seq = _int(a), _int(p), _int(s)
        if kind == b"w":
            yield from self._transient(attempt, seq, n, t)
            return
        if attempt is None or pos is None or (kind != b"d" and kind != b"e" and kind != b"v"):
            return  # not ours (anyone with XADD can write anything): skipped
        lowest = max(self.min_seq, self.floor)
        if lowest and (seq is None or seq < lowest):
            self.skipped = True
            return  # an earlier message's, under the same msg_id
        if kind == b"d" and seq is not None and self.seq is not None and seq > self.seq:
            self.renumbered = seq
            return
        if seq is not None and seq > 0:
            self.seq = seq
        if kind != b"e":
            self.top = max(self.top, (attempt, pos))
        else:
            self.end_seq = seq
            yield self.end(_text(o) or "applied", _text(t) or "")
            return
        if self.attempt is not None and attempt < self.attempt:
            return
        if self.attempt is None or attempt > self.attempt:
            if self.attempt is not None or self.shown:
                self.shown = False
                yield StreamEvent("reset", self.msg_id, attempt, "", None)
            self.attempt, self.pos, self.behind = attempt, -1, False
        if pos <= self.pos:
            return
        text = _text(t) or ""
        if pos != self.pos + 1:
            full = _text(f)
            if full is None:
                self.behind = True  # trimmed past our place: wait for the next snapshot
                return
            self.pos, self.behind = pos, False
            yield StreamEvent("resync", self.msg_id, attempt, full, self._cursor(), pos)
            if kind == b"d":
                return
        self.pos, self.behind = pos, False
        if kind == b"v":
            yield _event(self.msg_id, attempt, self._cursor(), pos, _text(n) or "", text)
            return
        yield StreamEvent("delta", self.msg_id, attempt, text, self._cursor(), pos)

    def _transient(
        self, attempt: int | None, seq: int | None, n: bytes | None, t: bytes | None
    ) -> Iterator[StreamEvent]:
        """A transient entry (kind ``w``, a ``waiting`` the worker wrote at no position): no
        cursor, nothing of the reader's place changes; skipped when it is an earlier
        message's or an older attempt's than the one read."""
        lowest = max(self.min_seq, self.floor)
        if attempt is None or n != b"waiting" or (lowest and (seq is None or seq < lowest)):
            return
        if self.attempt is not None and attempt < self.attempt:
            return
        data = _text(t) or ""
        try:
            value = json.loads(data) if len(data) <= MAX_EVENT_DATA_CHARS else None
        except (ValueError, RecursionError):
            value = None
        yield StreamEvent("waiting", self.msg_id, attempt, "", None, data=_waiting_data(value))

    def _cursor(self) -> str:
        return f"{self.msg_id}:{self.attempt or 0}:{self.pos}"  # str(Cursor(...)), per delta

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


def _event(msg_id: str, attempt: int, cursor: str, pos: int, kind: str, data: str) -> StreamEvent:
    """An ``event`` entry's StreamEvent; its data decoded (None when it is not JSON). Kind
    ``waiting`` is the worker's own (a step cannot emit it): a ``waiting`` event."""
    try:
        value = json.loads(data) if len(data) <= MAX_EVENT_DATA_CHARS else None
    except (ValueError, RecursionError):
        value = None
    if kind == "waiting":
        return StreamEvent("waiting", msg_id, attempt, "", cursor, pos, data=_waiting_data(value))
    return StreamEvent("event", msg_id, attempt, "", cursor, pos, event_kind=kind, data=value)


def _waiting_data(value: Any) -> dict[str, Any]:
    """A ``waiting`` event's data as readers get it, whatever the entry held."""
    got = value if isinstance(value, dict) else {}
    reason = got.get("reason")
    until = got.get("until_ms")
    whole = isinstance(until, int) and not isinstance(until, bool) and 0 <= until < 2**53
    return {
        "reason": reason if reason in ("rate", "paused", "slots", "tenant_cap") else "rate",
        "until_ms": until if whole else None,
    }


def reply_from_history(doc: bytes | None, msg_id: str, seq: int | None) -> tuple[str, str] | None:
    """(outcome, the bot's reply) of ``msg_id``'s turn in a stored state document, or None when
    the turn is not kept (any more). A turn marked ``cancelled``, ``superseded`` or
    ``expired`` ended so; any other turn was applied; a message named in a turn's ``merged``
    list was answered with that turn (``merged``). Nothing read from Redis is trusted to be
    well-formed."""
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
            ended = next(
                (o for o in UNAPPLIED_MARKS if turn.get(o) is True),
                "applied",
            )
            return ended, str(turn["bot"])
        merged = turn.get("merged") if isinstance(turn, dict) else None
        if isinstance(merged, list) and msg_id in merged and isinstance(turn.get("bot"), str):
            # An earlier part of a merged burst: answered by the turn's message.
            ended = next((o for o in UNAPPLIED_MARKS if turn.get(o) is True), "merged")
            return ended, str(turn["bot"])
    return None


# ---------------------------------------------------------------------------------------------
# Following one message's answer

# The id of an end entry (lua/emit-2.lua, and intake's for a rejected message).
END_ID = "18446744073709551615-0"
# Entries read per call: a reader catching up reads in bounded pieces, never all at once.
PAGE = 64
# While nothing arrives, how often a reader looks at the session's state for the commit (the
# reply event and the end entry normally end it sooner).
IDLE_CHECK_S = 2.0
# Once the reply says the message is finished, how long a follower waits for the router to
# bring the rest of its text (normally the end entry comes within milliseconds) before it
# reads the rest itself.
SYNC_WAIT_S = 0.3

Entry = tuple[bytes, Fields]


# While the partial stream holds an earlier message's answer under the same msg_id (see
# `Tracker.forget_older`), how often it is read again for this message's first pieces (the
# writer starts the stream anew with them, below the ids already read).
STALE_POLL_S = 0.2


@dataclasses.dataclass(frozen=True, slots=True)
class MessageKeys:
    partial: str
    state: str
    dedupe: str
    # Where a message without a known seq may be (`_finished`): the inbound stream (unread),
    # the session's msg_id index (sequenced) and its timers (deliver_at). Empty: not looked at.
    inbound: str = ""
    group: str = ""
    ids: str = ""
    timers: str = ""


async def follow(
    redis: Redis,
    router: PartialRouter,
    keys: MessageKeys,
    msg_id: str,
    after: Cursor | None,
    reply: asyncio.Future[Reply],
    deadline: float | None,
    just_sent: bool = False,
    sent: bool = False,
    sent_entry: str | None = None,
) -> AsyncIterator[StreamEvent]:
    """The events of one message's answer from ``after`` on, ending with ``end``.

    Catches up with XRANGE in pieces, then takes new entries from ``router`` (one blocking
    read for every answer this client follows), and reads again by itself whenever the router
    says it fell behind. ``reply`` is a waiter for the message's reply event, registered
    before this is called (so a commit that lands meanwhile cannot be missed). ``deadline``
    (``loop.time()``) bounds the wait: `TimeoutError` after it. ``redis`` returns bytes.
    ``just_sent``: the message was sent just now under a new msg_id, so it cannot be finished
    yet: the state is first looked at after `IDLE_CHECK_S` without news, not at once, and
    its stream (empty or nearly) is read from its start by the router, not by an XRANGE.
    ``sent``: this caller sent the message just now (``ask_stream``): an end entry already in
    the stream may be an earlier message's under the same msg_id, so it counts only once the
    message's seq (its dedupe key, or its reply event) says it is this message's.
    ``sent_entry``: the entry id this client last sent the msg_id with (lately), if it did:
    while that entry waits to be read, what the stream holds is an earlier message's
    (`_first_seq`), and once it was read a message without a dedupe key ended (`_finished`).

    An end entry names its message's seq: one of a lower seq than the msg_id's current one
    belongs to an earlier message sent under the same msg_id (it ended unapplied, which frees
    the msg_id): its pieces are dropped (`Tracker.forget_older`) and the stream is read again
    for this message's.

    Once the message is known to be finished, every piece its step emitted is in the stream
    already (they are written before the commit): the follower takes them from the router's
    next read (usually with the end entry) or, failing that within `SYNC_WAIT_S`, reads them
    itself.
    """
    tracker = Tracker(msg_id, after)
    last_id: tuple[int, int] | None = None  # the newest entry handled
    loop = asyncio.get_running_loop()
    # The state is looked at once at start (unless just sent), then after every IDLE_CHECK_S
    # without new entries (not every IDLE_CHECK_S of a long answer).
    checked = just_sent
    next_check = loop.time() + IDLE_CHECK_S if just_sent else 0.0
    catch_up = not just_sent
    read_to_end = False
    ended: tuple[str, str] | None = None  # (outcome, reply) once the message is finished
    sync: tuple[int, float] | None = None  # (router read, give up at) once ended
    stale = False  # the stream holds an earlier message's answer: read it again from its start
    held_end: StreamEvent | None = None  # an end not known yet to be this message's (``sent``)
    start_seq: int | None = None  # the dedupe key's seq read at start, for the first check
    if not just_sent and not sent:
        tracker.floor, known = await _first_seq(redis, keys, msg_id, sent_entry)
        start_seq = tracker.floor if known else None
    watch = router.watch(keys.partial)
    reply.add_done_callback(lambda _: watch.wake())
    if just_sent:
        watch.listen_after(None)
    try:
        while True:
            rows: list[Entry] = []
            if catch_up:
                start = "-" if last_id is None else f"({last_id[0]}-{last_id[1]}"
                rows = cast(
                    list[Entry],
                    await redis.xrange(keys.partial, min=start, max="+", count=PAGE),
                )
                catch_up = len(rows) == PAGE
                if not catch_up and not read_to_end and not stale:
                    watch.listen_after(last_id if not rows else _entry_id(rows[-1][0]))
            else:
                rows, behind = watch.take()
                if behind:
                    catch_up = True
                    # Finished already: this reading reaches the end.
                    read_to_end = ended is not None
            if rows and checked:
                next_check = loop.time() + IDLE_CHECK_S
            restart = False
            for entry_id, fields in rows:
                parsed = _entry_id(entry_id)
                if last_id is not None and parsed <= last_id:
                    continue  # the router's read overlapped what we had
                last_id = parsed
                for event in tracker.feed(fields):
                    if event.kind != "end":
                        yield event
                        continue
                    own = await _own_end(redis, keys, tracker.end_seq, sent, reply)
                    if own:
                        if not tracker.resumed_at_end():
                            yield event
                        return
                    # An earlier message's end (or, for ``sent``, not known yet to be ours).
                    held_end = event if own is None else None
                    tracker.forget_older(tracker.end_seq or 0)
                    stale = restart = True
                    next_check = loop.time()
                    watch.close()
                    watch = router.watch(keys.partial)
                    break
                if tracker.renumbered:
                    # This message under a later seq: its stream starts anew (a reset first).
                    tracker.forget_older(tracker.renumbered - 1)
                    restart = True
                    watch.close()
                    watch = router.watch(keys.partial)
                if restart:
                    break
            if tracker.skipped and tracker.seq is None and not stale:
                # An earlier message's answer: this one's starts the stream anew, below the
                # ids read, which the router would not bring: read it again from its start.
                stale = True
                next_check = loop.time()
                watch.close()
                watch = router.watch(keys.partial)
            if stale and tracker.seq is not None:
                stale = False  # this message's own entries are there now: follow them
                watch.listen_after(last_id)
            if restart:
                last_id, catch_up = None, True
                await asyncio.sleep(0)
                continue
            if catch_up or rows:
                continue
            # Nothing new: is the message finished?
            if reply.done() and (reply.cancelled() or reply.exception() is not None):
                # The reply reader failed: the state checks below still end the wait.
                reply = loop.create_future()
            if ended is None and reply.done() and reply.result().outcome == "awaiting":
                # Not an end: the step waits for a person (its "awaiting" event is in the
                # stream); the answer follows a resume, and its end entry (or the state) ends
                # this reader.
                reply = loop.create_future()
            if ended is None and reply.done():
                got = reply.result()
                if held_end is not None and got.seq == tracker.min_seq - 1:
                    yield held_end  # it was this message's end after all
                    return
                ended = (got.outcome, got.text)
            if ended is None and loop.time() >= next_check:
                seq = tracker.seq if tracker.seq is not None else start_seq
                start_seq = None
                ended = await _finished(redis, keys, msg_id, seq, tracker.min_seq, sent_entry)
                next_check, checked = loop.time() + IDLE_CHECK_S, True
            wait_until = next_check
            if ended is not None and not read_to_end:
                # Everything the step emitted was written before its commit: take it all
                # before the end. From the router, when it read this stream after now (the
                # end entry, written just after the commit, usually comes first and ends the
                # loop above); else read it here. A step that streamed nothing seen so far
                # is read at once (it may leave no end entry to wake the router with).
                if sync is None and watch.listening and tracker.top != (0, -1):
                    sync = (router.sync(watch), loop.time() + SYNC_WAIT_S)
                if sync is not None and router.synced(watch, sync[0]):
                    read_to_end = True
                elif sync is None or loop.time() >= sync[1] or not watch.listening:
                    read_to_end = catch_up = True
                    watch.close()
                    continue
                else:
                    if router.done >= sync[0]:  # it left some unread: the next read then
                        sync = (router.sync(watch), sync[1])
                    wait_until = sync[1]
            if ended is not None and read_to_end:
                end = tracker.end(*ended)
                if not tracker.resumed_at_end():
                    yield end
                return
            wait_s = max(0.0, wait_until - loop.time())
            if stale:
                wait_s = min(wait_s, STALE_POLL_S)
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                wait_s = min(wait_s, left)
            await watch.wait(wait_s)
            if stale:
                last_id, catch_up = None, True
    finally:
        watch.close()


def _entry_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.partition(b"-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return (0, 0)


# A follower's entries not taken yet, at most: past this it reads by itself (bounded memory
# whatever a slow follower does).
WATCH_BACKLOG = 256
# The router's longest blocking read: a newly watched stream joins the read within this.
ROUTER_BLOCK_MS = 100
# Least time between two reads while entries keep coming: each read carries more streams'
# entries (fewer commands per token), for at most this much added latency.
ROUTER_GATHER_S = 0.01


class Watch:
    """One follower's place at the router: entries of its stream as they come."""

    def __init__(self, router: PartialRouter, key: str) -> None:
        self.router = router
        self.key = key
        self.raw_key = key.encode()  # as XREAD answers it
        self._entries: list[Entry] = []
        self._behind = False
        self._event = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None  # ends a `wait` at the latest
        self.listening = False
        self.full_at = 0  # the router's last read that left entries of this stream unread

    def listen_after(self, last: tuple[int, int] | None) -> None:
        """Caught up to ``last``: the router delivers what comes after it."""
        self.router.listen(self, last)
        self.listening = True

    def push(self, entries: list[Entry]) -> None:
        if self._behind:
            return
        if len(self._entries) + len(entries) > WATCH_BACKLOG:
            self._entries, self._behind = [], True
        else:
            self._entries += entries
        self._event.set()

    def fell_behind(self) -> None:
        self._entries, self._behind = [], True
        self._event.set()

    def take(self) -> tuple[list[Entry], bool]:
        entries, behind = self._entries, self._behind
        self._entries, self._behind = [], False
        self._event.clear()
        if behind:
            self.router.unlisten(self)
            self.listening = False
        return entries, behind

    def wake(self) -> None:
        self._event.set()

    async def wait(self, timeout_s: float) -> None:
        """Until something comes or ``timeout_s`` passed; it may return sooner (the caller
        looks again). A follower waits once per delivery: instead of a timeout per wait
        (`wait_for` even makes a task), one timer is kept while it ends early enough."""
        if self._event.is_set():
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        until = now + timeout_s
        timer = self._timer
        if timer is None or timer.when() <= now or timer.when() > until:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(until, self._event.set)
        await self._event.wait()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.router.unlisten(self)
        self.listening = False


class PartialRouter:
    """One blocking XREAD for every partial stream a client follows (of one shard: their keys
    share its slot), its entries handed to each stream's followers in memory. A thousand
    followed answers cost one read loop, not a thousand blocked connections.

    Its reads are numbered: a follower that knows its message is finished asks for the number
    of the next read (`sync`); once that read is done and left nothing of its stream unread
    (`synced`), the follower has every entry written before it asked."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._unparsed = _unparsed(redis)
        self._watches: dict[bytes, set[Watch]] = {}
        # Where the next read of each stream starts: the id of the last entry handed out.
        self._positions: dict[bytes, bytes] = {}
        self._started = 0  # reads started
        self._done = 0  # the last read whose entries were handed out
        self._reading = False
        self._moved_back: set[bytes] = set()  # streams a follower joined behind, mid-read
        self._syncing: dict[Watch, int] = {}  # followers woken when that read is done
        self._task: asyncio.Task[None] | None = None

    def watch(self, key: str) -> Watch:
        return Watch(self, key)

    def listen(self, watch: Watch, last: tuple[int, int] | None) -> None:
        key = watch.raw_key
        self._watches.setdefault(key, set()).add(watch)
        mine = b"%d-%d" % (last or (0, 0))
        known = self._positions.get(key)
        # Read from the oldest place any follower needs: the others skip what they have.
        if known is None or _entry_id(mine) < _entry_id(known):
            self._positions[key] = mine
            if self._reading:
                # The read under way may start after this follower's place: what it brings
                # for this stream is not handed out (it could leave a gap); the next read
                # starts from here.
                self._moved_back.add(key)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="dialog-partial-router"
            )

    def unlisten(self, watch: Watch) -> None:
        self._syncing.pop(watch, None)
        watches = self._watches.get(watch.raw_key)
        if watches is None:
            return
        watches.discard(watch)
        if not watches:
            del self._watches[watch.raw_key]
            self._positions.pop(watch.raw_key, None)

    def sync(self, watch: Watch) -> int:
        """The number of the next read to start: ``watch`` is woken when it is done."""
        read = self._started + 1
        self._syncing[watch] = read
        return read

    @property
    def done(self) -> int:
        """The number of the last read whose entries were handed out."""
        return self._done

    def synced(self, watch: Watch, read: int) -> bool:
        """Read ``read`` (or a later one) is done and left nothing of ``watch``'s stream
        unread: the follower has taken every entry written before it asked."""
        return self._done >= read and watch.full_at != self._done and watch.listening

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _run(self) -> None:
        pause = 0.05
        while self._watches:
            keys = list(self._positions)
            self._started += 1
            number = self._started
            self._reading = True
            try:
                got = await self._read([*keys, *self._positions.values()])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # followers read by themselves meanwhile
                log.warning("partial_router_read_failed", error=str(exc))
                self._moved_back.clear()  # every follower reads by itself, then listens again
                for watches in self._watches.values():
                    for watch in watches:
                        watch.fell_behind()
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
                continue
            finally:
                self._reading = False
            pause = 0.05
            for key, entries in _streams(got):
                followers = self._watches.get(key)
                if not entries or followers is None:
                    continue
                if key in self._moved_back:
                    for watch in followers:
                        watch.full_at = number
                    continue
                self._positions[key] = entries[-1][0]
                full = len(entries) >= PAGE
                for watch in followers:
                    watch.push(entries)
                    if full:
                        watch.full_at = number
            self._moved_back.clear()
            self._done = number
            if self._syncing:
                for watch in [w for w, read in self._syncing.items() if read <= number]:
                    del self._syncing[watch]
                    watch.wake()
            if got:
                await asyncio.sleep(ROUTER_GATHER_S)

    async def _read(self, streams: list[bytes]) -> Any:
        """XREAD of ``streams`` (keys, then the id to read after for each)."""
        if self._unparsed is not None:
            return await self._unparsed.execute_command(  # type: ignore[no-untyped-call]  # redis-py: untyped
                "XREAD", "COUNT", PAGE, "BLOCK", ROUTER_BLOCK_MS, "STREAMS", *streams
            )
        half = len(streams) // 2
        return await self.redis.xread(
            dict(zip(streams[:half], streams[half:], strict=True)),
            count=PAGE,
            block=ROUTER_BLOCK_MS,
        )


def _unparsed(redis: Redis) -> Redis | None:
    """A client on ``redis``'s connections whose XREAD answers stay as Redis sent them: the
    router takes each entry's fields from the flat list itself, instead of redis-py making a
    dict and a tuple per entry and then reshaping the answer again (5-13% of the reading
    process's samples in profiles at a thousand answers). None for a cluster client (its
    answers come reshaped; the router reads both forms)."""
    if type(redis) is not Redis:
        return None
    unparsed = Redis(connection_pool=redis.connection_pool)
    unparsed.set_response_callback("XREAD", _as_sent)
    return unparsed


def _as_sent(response: Any, **options: Any) -> Any:
    return response


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    it = iter(flat)
    return dict(zip(it, it, strict=False))


def _streams(got: Any) -> list[tuple[bytes, list[Any]]]:
    """XREAD's answer as (key, entries) pairs: a list of pairs (RESP2, or reshaped by
    redis-py) or a dict (RESP3), whose values older redis-py versions wrap in one more list.
    An entry is ``[id, [field, value, ...]]`` as sent, or ``(id, {field: value})``."""
    if not got:
        return []
    if isinstance(got, dict):
        return [(k, _unwrapped(v)) for k, v in got.items()]
    return [(k, v) for k, v in got]


def _unwrapped(entries: list[Any]) -> list[Any]:
    first = entries[0] if entries else None
    if isinstance(first, list) and first and not isinstance(first[0], bytes | str):
        return first  # [[entry, entry, ...]]
    return entries


async def _own_end(
    redis: Redis, keys: MessageKeys, end_seq: int | None, sent: bool, reply: asyncio.Future[Reply]
) -> bool | None:
    """Is an end entry of ``end_seq`` this message's? True, False (an earlier message's under
    the same msg_id: its msg_id now names a later seq), or None (``sent``: the message is not
    sequenced yet, or it ended unapplied, which frees its msg_id: its reply event will say)."""
    if end_seq is None:
        return True  # written by an earlier version: no seq to tell
    current = await _dedupe_seq(redis, keys)
    if current is not None:
        return current == end_seq
    if not sent:
        return True
    if reply.done() and not reply.cancelled() and reply.exception() is None:
        return reply.result().seq == end_seq
    return None


async def _first_seq(
    redis: Redis, keys: MessageKeys, msg_id: str, sent_entry: str | None
) -> tuple[int, bool]:
    """The lowest seq whose entries are this message's, for a reader that starts while the
    stream may hold an earlier message's answer under the same msg_id (one that ended
    unapplied, which frees the msg_id, or a message a redrive moved up): the seq its dedupe key
    names; else, when this client sent the msg_id again and that entry is not read yet, one
    past the seq of the stream's first entry (one message's at a time: a new one starts the
    stream anew). 0: any. And whether it is the dedupe key's seq."""
    current = await _dedupe_seq(redis, keys)
    if current is not None:
        return current, True
    if sent_entry is None or not await _waiting(redis, keys, msg_id, sent_entry):
        return 0, False
    first = cast(list[Entry], await redis.xrange(keys.partial, min="-", max="+", count=1))
    seq = _int(_values(first[0][1])[2]) if first else None
    return (seq + 1 if seq is not None else 0), False


async def _dedupe_seq(redis: Redis, keys: MessageKeys) -> int | None:
    raw = cast(bytes | None, await redis.get(keys.dedupe))
    return int(raw) if raw is not None and 0 < len(raw) <= 18 and raw.isdigit() else None


def _looks_like_entry_id(value: str) -> bool:
    ms, sep, seq = value.partition("-")
    return bool(sep) and _digits(ms) and _digits(seq)


async def _finished(
    redis: Redis,
    keys: MessageKeys,
    msg_id: str,
    seq: int | None,
    min_seq: int = 0,
    sent_entry: str | None = None,
) -> tuple[str, str] | None:
    """(outcome, reply) when the session's state says the message was applied (two O(1)
    reads while it is not; its history is read once, at the end). ``min_seq``: an earlier
    message under the same msg_id had a lower seq (its turn does not answer for this one).
    ``sent_entry``: the entry this client sent the msg_id with lately."""
    if seq is None:
        seq = await _dedupe_seq(redis, keys)
        if seq is None and sent_entry is not None and keys.inbound:
            return await _finished_sent(redis, keys, msg_id, sent_entry)
        if seq is None and min_seq:
            return None  # sent again and not sequenced yet: its dedupe key will say
        if seq is None:
            return await _finished_without_seq(redis, keys, msg_id)
    applied, last, doc = cast(list[bytes | None], await redis.hmget(keys.state, ["a", "s", "d"]))
    applied_seq = int(applied) if applied is not None and applied.isdigit() else 0
    if _outstanding(applied_seq, last, seq):
        return None  # the session has it outstanding
    found = reply_from_history(doc, msg_id, seq)
    if found is not None:
        return found
    # Not its turn: the message may have a later seq now (a redrive into its held session
    # moves the waiting messages up; their dedupe keys follow, their stream entries do not).
    current = await _dedupe_seq(redis, keys)
    if current is not None and current != seq:
        if _outstanding(applied_seq, last, current):
            return None
        found = reply_from_history(doc, msg_id, current)
    elif current is None and _looks_like_entry_id(msg_id) and keys.ids and keys.timers:
        return await _finished_without_seq(redis, keys, msg_id)  # no dedupe key to follow
    # A state that expired, or a turn no longer kept: finished, its text is gone.
    return found or ("expired", "")


def _outstanding(applied_seq: int, last: bytes | None, seq: int) -> bool:
    """Does the session's state have ``seq`` sequenced and not applied? A last seq below it
    is another incarnation's (the session was deleted and written to again): not there."""
    if applied_seq >= seq or last is None:
        return False
    return not last.isdigit() or int(last) >= seq


async def _finished_sent(
    redis: Redis, keys: MessageKeys, msg_id: str, sent_entry: str
) -> tuple[str, str] | None:
    """(outcome, reply) of a message this client sent as ``sent_entry`` whose msg_id has no
    dedupe key: not finished while the entry is unread or waits as a timer (deliver_at).
    Read, it was sequenced (intake sets the dedupe key in the same step) or rejected (its end
    is in its stream), and the key went: it ended unapplied (its turn says how) or its
    session was deleted (``expired``, no text)."""
    if await _waiting(redis, keys, msg_id, sent_entry):
        return None
    if await _dedupe_seq(redis, keys) is not None:
        return None  # sequenced between the two reads: the next look follows it
    ends = cast(list[Entry], await redis.xrange(keys.partial, min=END_ID, max="+", count=1))
    if ends:
        _, _, s, kind, _, _, outcome, entry, _ = _values(ends[0][1])
        if s == b"0" and kind == b"e" and outcome == b"rejected" and entry is not None:
            if entry_key(entry) >= entry_key(sent_entry):
                return "rejected", ""  # rejected again (its end came after our last read)
    doc = cast(bytes | None, await redis.hget(keys.state, "d"))
    return reply_from_history(doc, msg_id, None) or ("expired", "")


async def _waiting(redis: Redis, keys: MessageKeys, msg_id: str, sent_entry: str) -> bool:
    """Is the message this client sent as ``sent_entry`` still waiting to be read: unread in
    the inbound stream, or a timer of its session (deliver_at)? Without an inbound stream to
    look at (a caller that gave no keys for it), it is taken as read."""
    if keys.inbound and await _unread(redis, keys, sent_entry):
        return True
    return bool(keys.timers) and bool(await redis.hexists(keys.timers, "t:msg:" + msg_id))


async def _finished_without_seq(
    redis: Redis, keys: MessageKeys, msg_id: str
) -> tuple[str, str] | None:
    """(outcome, reply) of a message whose seq nobody recorded: one sent by a plain XADD
    without a msg_id (its msg_id is its entry id, and no dedupe key is kept for it), or one
    whose dedupe key outlived `DIALOG_DEDUPE_TTL_S`. Its history turn answers while it is kept;
    past that, it is finished unless it is still somewhere a message waits: unread in the
    inbound stream (looked at first, by the workers' group's last-delivered id: intake
    delivers and moves an entry into its session atomically, so a message delivered is in
    the session's keys by the time they are read), a timer of its
    session (deliver_at), or among its session's outstanding messages. Finished with its turn
    gone, it ends ``expired`` with no text, as one with a known seq does."""
    if keys.inbound and _looks_like_entry_id(msg_id) and await _unread(redis, keys, msg_id):
        return None
    # Where it was sequenced is read before whether anything is outstanding: sequenced by then
    # and nothing outstanding after means applied (the other order could see the state
    # before an intake and the index after it, and call a message just taken finished).
    # A timer first (one that fires meanwhile is in the index by the next read).
    if keys.timers and await redis.hexists(keys.timers, "t:msg:" + msg_id):
        return None  # delivered later (deliver_at)
    indexed = bool(keys.ids) and await redis.zscore(keys.ids, msg_id) is not None
    applied, last, doc = cast(list[bytes | None], await redis.hmget(keys.state, ["a", "s", "d"]))
    found = reply_from_history(doc, msg_id, None)
    if found is not None or not (keys.ids and keys.timers):
        return found
    outstanding = (
        last is not None
        and applied is not None
        and applied.isdigit()
        and last.isdigit()
        and int(applied) < int(last)
    )
    if indexed and outstanding:
        return None  # it may be one of the session's waiting messages
    if not indexed and not _looks_like_entry_id(msg_id):
        return None  # a msg_id of its own may still be unread: nothing here tells
    return "expired", ""


async def _unread(redis: Redis, keys: MessageKeys, entry_id: str) -> bool:
    """Is the inbound entry ``entry_id`` still unread by the workers' group? Intake delivers
    and sequences in one step, so an entry past the group's last-delivered id is unread. From
    the group's bookkeeping (XINFO GROUPS), not the stream: the application's user may not
    read other sessions' messages."""
    try:
        groups = cast(list[dict[Any, Any]], await redis.xinfo_groups(keys.inbound))
    except ResponseError:  # no stream yet
        return True
    for group in groups:
        name = group.get("name", group.get(b"name"))
        if name in (keys.group, keys.group.encode()):
            delivered = group.get("last-delivered-id", group.get(b"last-delivered-id"))
            return entry_key(delivered or b"0-0") < entry_key(entry_id)
    return True  # no worker has read the stream yet
