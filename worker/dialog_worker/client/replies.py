"""The application's side of the reply streams.

Every message a worker finishes leaves one event on its shard's reply stream: ``session_id``,
``msg_id``, ``seq``, ``outcome`` (``applied`` | ``dead_lettered`` | ``duplicate``), ``reply``,
``produced_at`` (ms), ``entry_id`` (the inbound entry). Two readers live here:

- `ReplyRouter`: one per reply stream per client, for `DialogClient.ask`. It reads the stream
  without a consumer group (a group would hand a reply to one member only, maybe another
  process's) in one blocking loop, and hands each event to the waiters registered for its
  (session_id, msg_id). A thousand concurrent asks cost one loop, not a thousand.
- `ReplySubscription`: what `DialogClient.replies` returns, for the application's own
  consumers: a consumer group (at-least-once: unacknowledged events of a consumer that died
  are claimed by the others once idle), or a plain tail without a group.

Values are read as bytes and decoded field by field with ``errors="replace"``: anyone with XADD
can write to the stream, and one invalid byte must not stop a reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Literal, cast, get_args

import redis.exceptions
import structlog
from redis.asyncio import Redis

from dialog_worker.errors import ReplyStreamError

log = structlog.get_logger("dialog_worker.client.replies")

Outcome = Literal[
    "applied",
    "dead_lettered",
    "duplicate",
    "cancelled",
    "rejected",
    "superseded",
    "expired",
    "budget_exceeded",
    "awaiting",
    "merged",
]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
# What a history turn of a message that ended without being applied is marked with (true).
UNAPPLIED_MARKS = ("cancelled", "superseded", "expired", "budget_exceeded")
# The fields every event carries; the others are a rich reply's (bubbles, no_reply) or
# producer fields echoed by DIALOG_ECHO_FIELDS.
EVENT_FIELDS = frozenset(
    {b"session_id", b"msg_id", b"seq", b"outcome", b"reply", b"produced_at", b"entry_id"}
)
# An ``awaiting`` event's fields (dialog_worker.interrupt, lua/interrupt-3.lua).
INTERRUPT_FIELDS = frozenset({b"interrupt_id", b"payload"})
# Bounds on what a reader parses from one event (anyone with XADD can write the stream).
MAX_BUBBLES_FIELD_BYTES = 65536
MAX_ECHOED = 64

# Failures that a later read may not see again: wait and retry instead of failing waiters.
# RedisClusterException covers "no node answers" during a cluster failover.
RETRYABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
    OSError,
)
_RETRY_FIRST_S, _RETRY_MAX_S = 0.05, 2.0
# Rejected messages the router saw with nobody waiting, kept for a reader that starts to
# follow one a moment later (the HTTP gateway: POST, then GET its stream). A rejection leaves
# no other trace: the message was never sequenced and its msg_id is free again.
REJECTED_KEPT, REJECTED_KEPT_S = 4096, 60.0
# Events held for one waiter while its message is being sent (`ReplyRouter.expect`), at most:
# the newest are kept (its own event, if it came, is the newest of its msg_id).
HELD_PER_WAITER = 16
# Events one `SessionFeed` holds for its reader before it tells it to read the stream itself.
FEED_EVENTS = 256

RawFields = Mapping[bytes, bytes]


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """One reply event. ``text`` is the bot's answer (for ``dead_lettered``, the fallback
    apology; check ``outcome`` before showing it as an answer). ``id`` is the event's id on
    ``stream``; ``group`` is set when it was read through a consumer group, and then it must
    be acknowledged (`DialogClient.ack`). ``seq`` and ``produced_at`` are None when the event
    does not carry a valid number.

    ``bubbles`` is set when the engine answered with bubbles (a dict or a list of them, see
    docs/engine.md): each ``{"text": ..., "data": ...}``, ``text`` then being their texts
    joined by a blank line. ``no_reply`` is True when the engine chose not to answer (``text``
    is ""). ``echo`` holds the producer fields that DIALOG_ECHO_FIELDS copies onto events.
    ``usage`` is what the model calls of the committed step used (``input_tokens``,
    ``output_tokens``, ``cost``: None when unknown), None when it made none.

    ``awaiting`` is not an end: the step waits for a person (``dialog_worker.interrupt``);
    ``interrupt_id`` and ``payload`` (its JSON, decoded) say what for. Resume it with
    `DialogClient.resume`; the message's final event comes after."""

    session_id: str
    msg_id: str
    seq: int | None
    # One of OUTCOMES as the workers write it (an event forged by another writer of the
    # stream may carry anything: compare, do not index by it blindly).
    outcome: Outcome
    text: str
    id: str
    produced_at: int | None = None
    entry_id: str = ""
    stream: str = ""
    group: str | None = None
    bubbles: list[dict[str, Any]] | None = None
    no_reply: bool = False
    echo: dict[str, str] = dataclasses.field(default_factory=dict)
    # W3C trace context of the attempt that answered (tracing on in the worker), or "".
    traceparent: str = ""
    usage: dict[str, Any] | None = None
    interrupt_id: str | None = None
    payload: Any = None
    # A ``merged`` event: the msg_id of the message whose step answered it with the burst's
    # other messages (multitask=merge); "" otherwise.
    answered_by: str = ""

    def as_dict(self) -> dict[str, Any]:
        """All fields; ``bubbles``, ``no_reply``, ``echo``, ``traceparent``, ``usage``,
        ``interrupt_id`` and ``payload`` only when the event has them, so a plain reply prints
        as it always did (`dialog-worker ask`, `replies`)."""
        shown = dataclasses.asdict(self)
        if self.interrupt_id is None:
            del shown["interrupt_id"], shown["payload"]
        for name, empty in (
            ("bubbles", None),
            ("no_reply", False),
            ("echo", {}),
            ("traceparent", ""),
            ("usage", None),
            ("answered_by", ""),
        ):
            if shown[name] == empty:
                del shown[name]
        return shown


def reply_from_entry(
    event_id: bytes | str, fields: RawFields, stream: str, group: str | None = None
) -> Reply:
    """A `Reply` from one raw stream entry; never raises on odd content."""
    values = fields
    return Reply(
        session_id=_text(values.get(b"session_id")),
        msg_id=_text(values.get(b"msg_id")),
        seq=_number(values.get(b"seq")),
        outcome=cast(Outcome, _text(values.get(b"outcome"))),
        text=_text(values.get(b"reply")),
        id=_text(event_id),
        produced_at=_number(values.get(b"produced_at")),
        entry_id=_text(values.get(b"entry_id")),
        stream=stream,
        group=group,
        bubbles=_bubbles(values.get(b"bubbles")),
        no_reply=values.get(b"no_reply") == b"1",
        echo=_echoed(values),
        traceparent=_traceparent(values.get(b"traceparent")),
        usage=_usage(values.get(b"usage")),
        interrupt_id=_text(values[b"interrupt_id"]) if b"interrupt_id" in values else None,
        payload=_payload(values.get(b"payload")),
        answered_by=_text(values.get(b"answered_by")) if b"answered_by" in values else "",
    )


def _payload(value: bytes | None) -> Any:
    """An ``awaiting`` event's payload, decoded (None when absent or not JSON; never raises)."""
    if value is None or len(value) > MAX_BUBBLES_FIELD_BYTES:
        return None
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return None


def _usage(value: bytes | None) -> dict[str, Any] | None:
    """The usage field: whole token counts and a cost (a number or None), or None when absent
    or not that (never raises)."""
    if value is None or len(value) > 1024:
        return None
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    tokens = [parsed.get("input_tokens"), parsed.get("output_tokens")]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        return None
    cost = parsed.get("cost")
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, int | float)):
        return None
    return {"input_tokens": tokens[0], "output_tokens": tokens[1], "cost": cost}


def _bubbles(value: bytes | None) -> list[dict[str, Any]] | None:
    """The bubbles field as a list of dicts, or None when absent or not that (never raises)."""
    if value is None or len(value) > MAX_BUBBLES_FIELD_BYTES:
        return None
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, list) or not all(isinstance(b, dict) for b in parsed):
        return None
    return parsed


def _echoed(values: RawFields) -> dict[str, str]:
    echo: dict[str, str] = {}
    for name, value in values.items():
        if (
            name not in EVENT_FIELDS
            and name not in (b"bubbles", b"no_reply", b"traceparent", b"usage", b"answered_by")
            and name not in INTERRUPT_FIELDS
        ):
            if len(echo) >= MAX_ECHOED:
                break
            echo[_text(name)] = _text(value)
    return echo


def _traceparent(value: bytes | None) -> str:
    # Kept as written when it is short printable ASCII: readers parse it (tracing.py) or pass
    # it on; never a long or binary value from a forged event.
    if value is None or len(value) > 128 or not value.isascii():
        return ""
    text = value.decode("ascii")
    return text if text.isprintable() else ""


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _number(value: bytes | None) -> int | None:
    # At most 18 digits: any such number fits in 64 bits, and no length drives work.
    if value is None or not 0 < len(value) <= 18 or not value.isdigit():
        return None
    return int(value)


async def last_event_id(redis: Redis, stream: str) -> str:
    """The id of the stream's newest event ("0-0" for none): the place to read on from.
    Reading from an id captured before a send, rather than from ``$`` after it, is what
    guarantees that a reply written in between is not missed."""
    newest = cast(list[tuple[bytes, Any]], await redis.xrevrange(stream, count=1))
    return _text(newest[0][0]) if newest else "0-0"


# ---------------------------------------------------------------------------------------------
# ask: one router per reply stream


class ReplyRouter:
    """Reads one reply stream from a point captured before the first send and resolves the
    waiters registered for each event's (session_id, msg_id).

    Order of an ask (`DialogClient.ask`): `expect` (register), `start` (the loop runs; the
    first start captures the stream's newest id), send, `sent_as` (the entry it was sent as),
    await the future, `forget`. A waiter registered before its message is sent cannot miss the
    reply: the loop reads every event after its cursor, and the reply is appended after the
    send. Nor does it take an earlier message's: a msg_id that ended unapplied (cancelled,
    rejected...) may be sent again, and the loop, behind, may read the old event after the
    re-send's waiter registered. A waiter that is sending holds its events until `sent_as`,
    then takes only an event of that entry or a later one (a duplicate's, a merged part's and a
    timer's entries are later still), never one of an earlier entry.

    Connection failures are retried (waiters keep waiting, within their own timeouts, and
    learn the last error if they time out). Any other failure ends the loop and fails every
    current waiter with `ReplyStreamError`; the next `start` runs a new loop from where the
    old one stopped.
    """

    def __init__(
        self,
        redis: Redis,
        stream: str,
        block_ms: int,
        batch: int = 1000,
        prepare: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.block_ms = block_ms
        self.batch = batch
        self._prepare = prepare
        self._waiters: dict[tuple[str, str], list[asyncio.Future[Reply]]] = {}
        # Waiters of a message this client sends: the entry id it was sent as (an event of an
        # earlier entry is an earlier message's), None while the send is under way; and the
        # events read for them meanwhile.
        self._sent_as: dict[asyncio.Future[Reply], tuple[int, int] | None] = {}
        self._held: dict[asyncio.Future[Reply], list[Reply]] = {}
        self._rejected: dict[tuple[str, str], tuple[float, bytes, RawFields]] = {}
        self._feeds: dict[str, set[SessionFeed]] = {}
        self._cursor: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self.last_error: BaseException | None = None
        self.closed = False

    @property
    def waiting(self) -> int:
        return sum(len(futures) for futures in self._waiters.values())

    def expect(self, session_id: str, msg_id: str, sending: bool = False) -> asyncio.Future[Reply]:
        """A waiter for the next event of (session_id, msg_id). ``sending``: the caller sends
        the message now, then says as what entry (`sent_as`); events read before that are
        held, not given."""
        if self.closed:
            raise ReplyStreamError("the client is closed")
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault((session_id, msg_id), []).append(future)
        if sending:
            self._sent_as[future] = None
        return future

    def sent_as(self, future: asyncio.Future[Reply], entry_id: str) -> None:
        """``future``'s message is the inbound entry ``entry_id``: from now on only an event of
        that entry or a later one answers it, the events held meanwhile included."""
        floor = entry_key(entry_id)
        self._sent_as[future] = floor
        for reply in self._held.pop(future, []):
            if not future.done() and _answers(reply, floor):
                future.set_result(reply)

    def forget(self, session_id: str, msg_id: str, future: asyncio.Future[Reply]) -> None:
        self._sent_as.pop(future, None)
        self._held.pop(future, None)
        key = (session_id, msg_id)
        futures = self._waiters.get(key)
        if futures is None:
            return
        with contextlib.suppress(ValueError):
            futures.remove(future)
        if not futures:
            del self._waiters[key]

    def subscribe(self, session_id: str) -> SessionFeed:
        """Every event of ``session_id`` this router reads from now on (`DialogClient.events`).
        `unsubscribe` when done."""
        if self.closed:
            raise ReplyStreamError("the client is closed")
        feed = SessionFeed()
        self._feeds.setdefault(session_id, set()).add(feed)
        return feed

    def unsubscribe(self, session_id: str, feed: SessionFeed) -> None:
        feeds = self._feeds.get(session_id)
        if feeds is None:
            return
        feeds.discard(feed)
        if not feeds:
            del self._feeds[session_id]

    def rejected(self, session_id: str, msg_id: str) -> Reply | None:
        """The ``rejected`` event of ``msg_id`` if this router read it in the last
        ``REJECTED_KEPT_S`` seconds with nobody waiting, and this client has not sent the
        msg_id again since (`sent`)."""
        kept = self._rejected.get((session_id, msg_id))
        if kept is None or time.monotonic() - kept[0] > REJECTED_KEPT_S:
            return None
        return reply_from_entry(kept[1], kept[2], self.stream)

    def sent(self, session_id: str, msg_id: str) -> None:
        """``msg_id`` is sent again: an earlier rejection of it no longer answers it."""
        self._rejected.pop((session_id, msg_id), None)

    def problem(self) -> str:
        """What kept the loop from reading lately, for a timeout's message."""
        if self.last_error is None:
            return ""
        return f"reading {self.stream} failed lately: {_describe(self.last_error)}"

    async def start(self) -> None:
        if self._task is not None and not self._task.done():
            return
        async with self._starting:
            if self.closed:
                raise ReplyStreamError("the client is closed")
            if self._task is not None and not self._task.done():
                return
            if self._prepare is not None:
                await self._prepare()
            if self._cursor is None:
                self._cursor = await last_event_id(self.redis, self.stream)
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"dialog-reply-router:{self.stream}"
            )

    async def aclose(self) -> None:
        self.closed = True
        if self._task is not None:
            await _stop(self._task)
        self._fail_all(ReplyStreamError("the client was closed while waiting for a reply"))

    async def _run(self) -> None:
        assert self._cursor is not None
        pause = _RETRY_FIRST_S
        try:
            while True:
                try:
                    got = await self.redis.xread(
                        {self.stream: self._cursor}, count=self.batch, block=self.block_ms
                    )
                except RETRYABLE as exc:
                    if self.closed:
                        return  # a cancellation redis-py turned into a connection error
                    self.last_error = exc
                    log.warning("reply_read_failed", stream=self.stream, error=_describe(exc))
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, _RETRY_MAX_S)
                    continue
                self.last_error, pause = None, _RETRY_FIRST_S
                for _, entries in _stream_entries(got):
                    for event_id, fields in entries:
                        self._cursor = _text(event_id)
                        self._route(event_id, fields)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.last_error = exc
            log.error("reply_router_failed", stream=self.stream, error=_describe(exc))
            error = ReplyStreamError(f"reading replies from {self.stream} failed: {_describe(exc)}")
            error.__cause__ = exc
            self._fail_all(error)

    def _route(self, event_id: bytes, fields: RawFields) -> None:
        if not fields:
            return
        key = (_text(fields.get(b"session_id")), _text(fields.get(b"msg_id")))
        for feed in self._feeds.get(key[0], ()):
            feed.push(event_id, fields)
        futures = self._waiters.pop(key, None)
        if not futures:
            if fields.get(b"outcome") == b"rejected":
                self._rejected.pop(key, None)
                self._rejected[key] = (time.monotonic(), event_id, fields)
                while len(self._rejected) > REJECTED_KEPT:
                    del self._rejected[next(iter(self._rejected))]
            return
        reply = reply_from_entry(event_id, fields, self.stream)
        still = [f for f in futures if not f.done() and not self._give(f, reply)]
        if still:
            self._waiters[key] = still

    def _give(self, future: asyncio.Future[Reply], reply: Reply) -> bool:
        """Answer ``future`` with ``reply`` unless it is an earlier message's (or may be: held
        while the send is under way). Whether it was answered."""
        if future in self._sent_as:
            floor = self._sent_as[future]
            if floor is None:
                held = self._held.setdefault(future, [])
                held.append(reply)
                del held[:-HELD_PER_WAITER]
                return False
            if not _answers(reply, floor):
                return False
        future.set_result(reply)
        return True

    def _fail_all(self, error: BaseException) -> None:
        for feeds in self._feeds.values():
            for feed in feeds:
                feed.fail(error)
        waiters, self._waiters = self._waiters, {}
        self._sent_as.clear()
        self._held.clear()
        for futures in waiters.values():
            for future in futures:
                if not future.done():
                    future.set_exception(error)


class SessionFeed:
    """The events of one session that a `ReplyRouter` read since `ReplyRouter.subscribe`, for
    one reader. Bounded: a reader that falls more than `FEED_EVENTS` behind is told so
    (``behind``) and reads the stream itself from where it stopped."""

    def __init__(self) -> None:
        self.items: list[tuple[bytes, RawFields]] = []
        self.behind = False
        self.error: BaseException | None = None
        self._news = asyncio.Event()

    def push(self, event_id: bytes, fields: RawFields) -> None:
        if len(self.items) >= FEED_EVENTS:
            self.items.clear()
            self.behind = True
        else:
            self.items.append((event_id, fields))
        self._news.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._news.set()

    def take(self) -> tuple[list[tuple[bytes, RawFields]], bool]:
        items, behind = self.items, self.behind
        self.items, self.behind = [], False
        self._news.clear()
        if self.error is not None:
            raise self.error
        return items, behind

    async def wait(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._news.wait(), timeout_s)


def _answers(reply: Reply, sent_as: tuple[int, int]) -> bool:
    """Is ``reply`` the event of a message sent as entry ``sent_as`` (or of a later entry of
    it)? An event whose entry id is not one (anyone with XADD can write the stream) is not
    told apart: it answers, as it did before entry ids were compared."""
    entry = entry_key(reply.entry_id)
    return entry == (-1, -1) or entry >= sent_as


def entry_key(event_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as a pair to compare ((-1, -1) when it is not one)."""
    raw = event_id.decode("ascii", "replace") if isinstance(event_id, bytes) else event_id
    ms, sep, n = raw.partition("-")
    if not (sep and ms.isdigit() and n.isdigit() and len(ms) <= 20 and len(n) <= 20):
        return (-1, -1)
    return (int(ms), int(n))


# ---------------------------------------------------------------------------------------------
# replies(): consumer groups and tails


@dataclasses.dataclass(frozen=True, slots=True)
class _Done:
    """A stream's reader finished (not following) or failed."""

    error: BaseException | None = None


_CLOSED = _Done()  # put by aclose(): compared by identity


class ReplySubscription:
    """Reply events of every reply stream of a deployment, as an async iterator.

    With a ``group``: the group is created on each stream (at ``start``: ``$``, only events
    after its creation, or ``0``, everything the stream still holds) when the subscription
    starts; this consumer first gets its own unacknowledged events back (a restart under the
    same name), then new ones, and every ``claim_idle_ms / 2`` it claims the events other
    consumers read but did not acknowledge within ``claim_idle_ms`` (XAUTOCLAIM). Every event
    is delivered until someone acknowledges it: at least once, possibly more.

    Without a group: every event after ``start`` (``$``: from now on; ``0``: from the oldest
    retained), to every reader, nothing to acknowledge.

    ``follow=False`` stops once the streams hold nothing more for this reader. Starts on the
    first iteration, or on ``async with`` / `start` (do that before sending when the group is
    new and created at ``$``).
    """

    def __init__(
        self,
        redis: Redis,
        streams: list[str],
        *,
        group: str | None,
        consumer: str,
        start: str,
        follow: bool,
        count: int,
        block_ms: int,
        claim_idle_ms: int,
        prepare: Callable[[], Awaitable[None]] | None = None,
        on_close: Callable[[ReplySubscription], None] | None = None,
    ) -> None:
        self.redis = redis
        self.streams = streams
        self.group = group
        self.consumer = consumer
        self.start_id = start
        self.follow = follow
        self.count = count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self._prepare = prepare
        self._on_close = on_close
        self._queue: asyncio.Queue[Reply | _Done] = asyncio.Queue(maxsize=count)
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0
        self._started = False
        self._closed = False

    async def __aenter__(self) -> ReplySubscription:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> ReplySubscription:
        return self

    async def __anext__(self) -> Reply:
        if not self._started:
            await self.start()
        while not self._closed and (self._running or not self._queue.empty()):
            item = await self._queue.get()
            if isinstance(item, Reply):
                return item
            if item is _CLOSED:
                break
            self._running -= 1
            if item.error is not None:
                await self.aclose()
                raise ReplyStreamError(
                    f"reading replies failed: {_describe(item.error)}"
                ) from item.error
        await self.aclose()
        raise StopAsyncIteration

    async def start(self) -> None:
        """Create the group (if any) on every stream and start reading."""
        if self._started:
            return
        if self._closed:
            raise ReplyStreamError("this subscription is closed")
        self._started = True
        if self._prepare is not None:
            await self._prepare()
        loop = asyncio.get_running_loop()
        if self.group is not None:
            for stream in self.streams:
                await self._create_group(stream, self.group)
        cursors = {}
        if self.group is None and self.start_id == "$":
            for stream in self.streams:
                cursors[stream] = await last_event_id(self.redis, stream)
        for stream in self.streams:
            reader = (
                functools.partial(self._read_group, stream, self.group)
                if self.group is not None
                else functools.partial(self._tail, stream, cursors.get(stream, self.start_id))
            )
            self._tasks.append(loop.create_task(self._guard(reader), name=f"replies:{stream}"))
        self._running = len(self._tasks)

    async def aclose(self) -> None:
        """Stop reading. Events read but not yet handed out stay unacknowledged: a group
        delivers them again (to this consumer name on its next start, or to another once
        they are idle past ``claim_idle_ms``)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            await _stop(task)
        # Wake an iteration waiting in another task; a full queue wakes it anyway.
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_CLOSED)
        if self._on_close is not None:
            self._on_close(self)

    async def _guard(self, reader: Callable[[], Awaitable[None]]) -> None:
        try:
            await reader()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._queue.put(_Done(exc))
            return
        await self._queue.put(_Done())

    async def _create_group(self, stream: str, group: str) -> None:
        try:
            await self.redis.xgroup_create(stream, group, id=self.start_id, mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _read_group(self, stream: str, group: str) -> None:
        # 1. Events this consumer name read earlier and never acknowledged (a restart).
        cursor = "0"
        while True:
            got = await self._call(
                self.redis.xreadgroup, group, self.consumer, {stream: cursor}, count=self.count
            )
            entries = [e for _, batch in _stream_entries(got) for e in batch]
            if not entries:
                break
            for event_id, fields in entries:
                cursor = _text(event_id)
                await self._deliver(stream, group, event_id, fields)
        # 2. New events, and now and then the ones a dead consumer left behind.
        claim_every_s = max(self.claim_idle_ms / 2000, 0.05)
        next_claim = 0.0
        while True:
            if time.monotonic() >= next_claim:
                await self._claim(stream, group)
                next_claim = time.monotonic() + claim_every_s
            block: int | None = None
            if self.follow:
                until_claim_ms = math.ceil((next_claim - time.monotonic()) * 1000)
                block = max(1, min(self.block_ms, until_claim_ms))
            got = await self._call(
                self.redis.xreadgroup,
                group,
                self.consumer,
                {stream: ">"},
                count=self.count,
                block=block,
            )
            entries = [e for _, batch in _stream_entries(got) for e in batch]
            if not entries and not self.follow:
                return
            for event_id, fields in entries:
                await self._deliver(stream, group, event_id, fields)

    async def _claim(self, stream: str, group: str) -> None:
        """XAUTOCLAIM every event idle past claim_idle_ms. One call scans at most 10 x COUNT
        pending entries, so it may return an empty page with a non-zero cursor: loop until
        the cursor is back at 0-0. Events trimmed from the stream come back as deleted ids
        and are already dropped from the pending list by Redis."""
        cursor = "0-0"
        while True:
            got = await self._call(
                self.redis.xautoclaim,
                stream,
                group,
                self.consumer,
                self.claim_idle_ms,
                start_id=cursor,
                count=self.count,
            )
            cursor = _text(got[0])
            for event_id, fields in got[1]:
                await self._deliver(stream, group, event_id, fields)
            if cursor == "0-0":
                return

    async def _deliver(
        self, stream: str, group: str | None, event_id: bytes, fields: RawFields
    ) -> None:
        if not fields and group is not None:
            # Pending but trimmed from the stream since (an event always has fields): nothing
            # to hand out, and left unacknowledged it would come back on every restart.
            await self._call(self.redis.xack, stream, group, event_id)
            return
        await self._queue.put(reply_from_entry(event_id, fields, stream, group))

    async def _tail(self, stream: str, cursor: str) -> None:
        while True:
            got = await self._call(
                self.redis.xread,
                {stream: cursor},
                count=self.count,
                block=self.block_ms if self.follow else None,
            )
            entries = [e for _, batch in _stream_entries(got) for e in batch]
            if not entries and not self.follow:
                return
            for event_id, fields in entries:
                cursor = _text(event_id)
                await self._deliver(stream, None, event_id, fields)

    async def _call(self, command: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """Run a read; while following, a lost connection is waited out, not fatal."""
        pause = _RETRY_FIRST_S
        while True:
            try:
                return await command(*args, **kwargs)
            except RETRYABLE as exc:
                if not self.follow or self._closed:
                    raise
                log.warning("reply_read_failed", error=_describe(exc))
                await asyncio.sleep(pause)
                pause = min(pause * 2, _RETRY_MAX_S)


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel a reader task and wait for its end. A cancellation that lands in the middle of
    a read can come out of redis-py as a ConnectionError (it drops the connection, then reads
    EOF), which a loop that rides out connection errors would survive: so cancel again until
    the task is done (the loops also check their closed flag)."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.2)
    if not task.cancelled():
        task.exception()  # retrieved: asyncio would otherwise log it as never retrieved


def _describe(exc: BaseException) -> str:
    # redis-py 8's repr() of its errors hides the server's message ("server:ResponseError").
    return f"{type(exc).__name__}: {exc}"


def _stream_entries(got: Any) -> list[tuple[bytes, list[tuple[bytes, RawFields]]]]:
    """An XREAD / XREADGROUP reply (RESP2, as our connections speak) as (stream, entries)."""
    return cast(list[tuple[bytes, list[tuple[bytes, RawFields]]]], got or [])
