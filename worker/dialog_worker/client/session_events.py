"""Every turn of one session as it lands, for a chat page on several devices
(`DialogClient.events`, the gateway's ``GET /sessions/{id}/events``).

A reader follows the session's shard's reply stream, which has one event per message however
many land between two reads, filtered to the session (the client's `ReplyRouter` reads the
stream once for all of its readers; a reader that falls behind reads it itself from its
cursor). It never polls the state's history, which keeps only ``DIALOG_HISTORY_LIMIT`` turns.

Events (`SessionEvent`):

- ``turn``: one message's end: ``seq``, ``msg_id``, ``outcome``, ``bot`` (the reply), ``user``
  (the message's text while the session's history keeps its turn, else None).
- ``awaiting``: a message's step waits for a person (``dialog_worker.interrupt``): ``seq``,
  ``msg_id``, ``interrupt_id``, ``payload``. Not a turn: the message's turn comes after the
  resume. After a reload, ``DialogClient.pending`` says what is still waited on.
- ``resync``: replace everything you show with ``turns`` (the history the session keeps now,
  oldest first; empty after a restart, the new turns follow). ``reason`` ``gap``: the reader's
  cursor is older than what the reply stream still holds (events after it were trimmed or
  deleted); ``restart``: the session started over (a turn with a seq at or below one already
  shown: it was deleted, and its seq began again at 1; a reset keeps the seq going; a
  ``duplicate`` carries the original seq and is no restart).

A reader that starts without a cursor first gets the turns the history keeps as ``turn``
events (only the last carries a cursor), then the new ones. A turn that lands while those are
read may come twice (once from the history, once from the stream): the same ``msg_id`` and
``seq``, shown once.

A reader resumes from the ``cursor`` of the last event it handled: ``<reply event id>:<seq>``
(the highest seq it was shown, so that a restart of the session is recognised across a
reconnect). The cursor is a place in the reply stream, not a seq: turns applied while the
reader was away are all delivered, however many, and so are the turns of a session deleted
and started again meanwhile.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.client.replies import (
    UNAPPLIED_MARKS,
    RawFields,
    ReplyRouter,
    entry_key,
    last_event_id,
)
from dialog_worker.errors import ValidationError

# Entries of the reply stream read per call while catching up.
PAGE = 500
# How long a reader waits for news before it gives the caller a chance to send a keep-alive.
IDLE_WAKE_S = 5.0
# Largest awaiting payload a reader decodes (a worker writes at most 16 KiB).
MAX_PAYLOAD_BYTES = 65_536
_MAX_DIGITS = 18


@dataclasses.dataclass(frozen=True, slots=True)
class SessionEvent:
    """One event of a session's feed; ``cursor`` None for events that are not a place to
    resume from. ``kind`` ``idle`` is yielded after `IDLE_WAKE_S` without news (nothing to
    show: a chance to send a keep-alive)."""

    kind: str
    cursor: str | None
    data: dict[str, Any]


@dataclasses.dataclass(slots=True)
class SessionCursor:
    event_id: tuple[int, int]
    seq: int

    def __str__(self) -> str:
        return f"{self.event_id[0]}-{self.event_id[1]}:{self.seq}"


def parse_session_cursor(value: str) -> SessionCursor | int:
    """``<ms>-<n>:<seq>`` (this feed's cursor), or a bare seq (the cursor of earlier versions,
    answered with a fresh start from the turns above it)."""
    if not isinstance(value, str) or len(value) > 64 or not value.isascii():
        raise ValidationError(f"the cursor of /events looks like <ms>-<n>:<seq>, got {value!r}")
    if value.isdigit() and len(value) <= _MAX_DIGITS:
        return int(value)
    place, sep, seq = value.partition(":")
    event_id = entry_key(place)
    if not sep or event_id == (-1, -1) or not (seq.isdigit() and len(seq) <= _MAX_DIGITS):
        raise ValidationError(f"the cursor of /events looks like <ms>-<n>:<seq>, got {value!r}")
    return SessionCursor(event_id, int(seq))


async def follow_session(
    redis: Redis,
    router: ReplyRouter,
    stream: str,
    state_key: str,
    session_id: str,
    after: SessionCursor | int | None,
) -> AsyncIterator[SessionEvent]:
    """The session's events from ``after`` on, until the caller stops iterating. ``redis``
    returns bytes; ``router`` reads ``stream`` (started here)."""
    await router.start()
    feed = router.subscribe(session_id)
    try:
        if isinstance(after, SessionCursor):
            cursor = after
            if await _gap_after(redis, stream, cursor.event_id):
                newest = entry_key(await last_event_id(redis, stream))
                turns = await _kept_turns(redis, state_key, 0)
                cursor = SessionCursor(newest, max([cursor.seq, *(t["seq"] for t in turns)]))
                yield SessionEvent("resync", str(cursor), {"reason": "gap", "turns": turns})
        else:
            # A fresh start: what the history keeps, then everything after this place.
            newest = entry_key(await last_event_id(redis, stream))
            turns = await _kept_turns(redis, state_key, after or 0)
            cursor = SessionCursor(newest, max([after or 0, *(t["seq"] for t in turns)]))
            for i, turn in enumerate(turns):
                last = i == len(turns) - 1
                yield SessionEvent("turn", str(cursor) if last else None, turn)
        behind = True  # catch up from the cursor by reading the stream
        while True:
            if behind:
                async for event in _read_after(redis, stream, state_key, session_id, cursor):
                    yield event
            items, behind = feed.take()
            fresh = [(i, f) for i, f in items if entry_key(i) > cursor.event_id]
            if fresh:
                for event in await _turn_events(redis, state_key, fresh, cursor):
                    yield event
            elif not behind:
                await feed.wait(IDLE_WAKE_S)
                if not feed.items and not feed.behind and feed.error is None:
                    yield SessionEvent("idle", None, {})
    finally:
        router.unsubscribe(session_id, feed)


async def _read_after(
    redis: Redis, stream: str, state_key: str, session_id: str, cursor: SessionCursor
) -> AsyncIterator[SessionEvent]:
    """Every event of the session after ``cursor`` still in the stream (``cursor`` moves)."""
    wanted = session_id.encode("utf-8", "surrogatepass")
    while True:
        start = f"({cursor.event_id[0]}-{cursor.event_id[1]}"
        rows = cast(
            list[tuple[bytes, RawFields]],
            await redis.xrange(stream, min=start, max="+", count=PAGE),
        )
        mine = [(i, f) for i, f in rows if f.get(b"session_id") == wanted]
        if mine:
            for event in await _turn_events(redis, state_key, mine, cursor):
                yield event
        if rows:
            cursor.event_id = max(cursor.event_id, entry_key(rows[-1][0]))
        if len(rows) < PAGE:
            return


async def _turn_events(
    redis: Redis,
    state_key: str,
    entries: list[tuple[bytes, RawFields]],
    cursor: SessionCursor,
) -> list[SessionEvent]:
    """``turn`` events of reply events (oldest first), with the user's text from the history
    while it keeps the turn (one read for the lot); a ``resync`` first when the session
    started over. Moves ``cursor``."""
    doc = cast(bytes | None, await redis.hget(state_key, "d"))
    kept = {(t["msg_id"], t["seq"]): t for t in _history(doc)}
    events: list[SessionEvent] = []
    for event_id, fields in entries:
        turn = _turn(fields)
        cursor.event_id = max(cursor.event_id, entry_key(event_id))
        if turn["outcome"] == "awaiting":
            # Not a turn: the message waits for a person; its turn comes after the resume.
            events.append(SessionEvent("awaiting", str(cursor), _awaiting(turn, fields)))
            continue
        sequenced = turn["seq"] > 0 and turn["outcome"] != "duplicate"
        if sequenced and turn["seq"] <= cursor.seq:
            # A seq already shown: the session was deleted or reset and started over.
            cursor.seq = turn["seq"]
            events.append(SessionEvent("resync", None, {"reason": "restart", "turns": []}))
        if sequenced:
            cursor.seq = max(cursor.seq, turn["seq"])
        known = kept.get((turn["msg_id"], turn["seq"]))
        turn["user"] = known["user"] if known is not None else None
        events.append(SessionEvent("turn", str(cursor), turn))
    return events


async def _gap_after(redis: Redis, stream: str, event_id: tuple[int, int]) -> bool:
    """May events after ``event_id`` have been removed from the stream? By XDEL (Redis keeps
    the largest id it deleted) or by trimming (MAXLEN removes the oldest: the first entry now
    kept is past ``event_id``, or, with none kept, the last one ever added is). A removed
    event right after the cursor cannot be told from none: that reader resyncs for nothing."""
    try:
        info = cast(dict[Any, Any], await redis.xinfo_stream(stream))
    except ResponseError:  # no stream yet (nothing was answered): no gap
        return False

    def get(name: str) -> Any:
        return info.get(name, info.get(name.encode()))

    if entry_key(get("max-deleted-entry-id") or b"0-0") > event_id:
        return True
    added, length = get("entries-added"), get("length")
    if not isinstance(added, int) or not isinstance(length, int) or added <= length:
        return False  # nothing was ever removed
    if length == 0:
        return entry_key(get("last-generated-id") or b"0-0") > event_id
    first = get("first-entry")
    first_id = first[0] if isinstance(first, list | tuple) and first else b"0-0"
    return entry_key(first_id) > event_id


async def _kept_turns(redis: Redis, state_key: str, after: int) -> list[dict[str, Any]]:
    doc = cast(bytes | None, await redis.hget(state_key, "d"))
    turns = [t for t in _history(doc) if t["seq"] > after]
    return sorted(turns, key=lambda t: int(t["seq"]))


def _history(doc: bytes | None) -> list[dict[str, Any]]:
    """The kept turns of a stored state document (nothing read from Redis is trusted to be
    well-formed)."""
    try:
        state = json.loads(doc) if doc else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []
    history = state.get("history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        return []
    turns = []
    for t in history:
        if (
            isinstance(t, dict)
            and isinstance(t.get("seq"), int)
            and not isinstance(t.get("seq"), bool)
        ):
            ended = next(
                (o for o in UNAPPLIED_MARKS if t.get(o) is True),
                "applied",
            )
            turns.append(
                {
                    "seq": t["seq"],
                    "msg_id": t.get("msg_id"),
                    "user": t.get("user"),
                    "bot": t.get("bot"),
                    "outcome": ended,
                }
            )
    return turns


def _awaiting(turn: dict[str, Any], fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    raw = fields.get(b"payload", b"null")
    try:
        payload = json.loads(raw) if len(raw) <= MAX_PAYLOAD_BYTES else None
    except (ValueError, RecursionError):
        payload = None
    return {
        "seq": turn["seq"],
        "msg_id": turn["msg_id"],
        "interrupt_id": fields.get(b"interrupt_id", b"").decode("utf-8", "replace"),
        "payload": payload,
    }


def _turn(fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    def text(name: bytes) -> str:
        return fields.get(name, b"").decode("utf-8", "replace")

    seq = text(b"seq")
    return {
        "seq": int(seq) if seq.isdigit() and len(seq) <= _MAX_DIGITS else 0,
        "msg_id": text(b"msg_id"),
        "user": None,
        "bot": text(b"reply"),
        "outcome": text(b"outcome"),
    }
