"""The application's side: send messages, ask and wait for the reply, read replies, read
session state (``DialogClient``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dialog_worker import tracing
from dialog_worker.client import interrupts, session_tokens
from dialog_worker.client.erasure import Eraser, EraseResult, erase
from dialog_worker.client.interrupts import PendingInterrupt, ResumeResult
from dialog_worker.client.partial_reader import (
    Cursor,
    MessageKeys,
    PartialRouter,
    StreamEvent,
    follow,
    parse_cursor,
)
from dialog_worker.client.replies import Reply, ReplyRouter, ReplySubscription
from dialog_worker.client.session_events import SessionEvent, follow_session, parse_session_cursor
from dialog_worker.config import Settings, client_settings
from dialog_worker.engine.timers import deliver_at_ms
from dialog_worker.errors import ReplyTimeout, UncertainSendError, ValidationError
from dialog_worker.store import tenants
from dialog_worker.store.codec import (
    MAX_EXTRA_FIELDS,
    RESERVED_FIELDS,
    check_expires_at,
    check_id,
    check_meta,
    check_priority,
    check_tenant,
    check_text,
)
from dialog_worker.store.connection import check_topology, connect, prepare
from dialog_worker.store.keys import Keys, Topology
from dialog_worker.store.scripts import Script, source
from dialog_worker.store.stream_entries import StreamReader

# The standard library's logger: an application's own logging setup decides where a client's
# warning goes (without one, Python prints warnings to stderr, never to stdout).
log = logging.getLogger("dialog_worker.client.dialog_client")

# How long `replies()` lets another consumer's event sit unacknowledged before taking it over.
DEFAULT_CLAIM_IDLE_MS = 60_000
# The entry each msg_id was last sent with, kept this long (at most this many): a `stream` of
# it soon after (the gateway's POST, then the GET of its stream) must not take an earlier
# rejection of the same msg_id for its message's end (`follow`'s ``sent_entry``).
SENT_KEPT, SENT_KEPT_S = 4096, 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class SendResult:
    session_id: str
    msg_id: str  # the given one, or the one the client generated
    entry_id: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class CancelResult:
    """What `DialogClient.cancel` found. ``status``:

    - ``cancelled``: the message is waiting or running; it ends ``cancelled`` (one reply event),
      a running step is stopped.
    - ``finished``: it had already ended; ``seq`` is its seq and ``outcome`` is
      ``cancelled``, ``superseded``, ``expired`` or ``budget_exceeded`` when its history turn
      says so, else None (applied or dead-lettered: its reply event tells which).
    - ``pending``: no outstanding message with this msg_id was found (not arrived yet, or
      sent without a msg_id); the cancel is kept for DIALOG_DEDUPE_TTL_S and ends the
      message ``cancelled`` if it is outstanding or arrives meanwhile.
    """

    session_id: str
    msg_id: str
    status: str
    seq: int | None = None
    outcome: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MULTITASK_POLICIES = ("enqueue", "reject", "interrupt", "coalesce", "merge")


class DialogClient:
    """Sends messages, waits for or reads their replies, and reads session state.

    Reads the same settings as the worker from the environment when constructed; keyword
    arguments override them (``DialogClient(url, stream="other")``). Safe to share between
    hundreds of coroutines: the pool blocks for a free connection instead of failing. Use it
    as ``async with`` (or call `aclose`): reply readers run as background tasks until then.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: Settings | None = None,
        max_connections: int = 64,
        **overrides: Any,
    ) -> None:
        self.settings = settings = client_settings(url, settings, overrides)
        self.topology = Topology.from_settings(settings)
        # The first (in the plain layout, the only) shard's names, for callers that do not
        # shard; anything per session goes through `keys_for`.
        self.keys: Keys = self.topology.shards[0]
        self.redis: Redis = connect(settings, max_connections)
        self._prepared = False
        self._checked = False
        self._max_connections = max_connections
        # Reply streams are read as bytes on their own client (see
        # dialog_worker/client/replies.py), made
        # on first use; blocked reads there never hold up sends.
        self._reader: Redis | None = None
        self._reader_prepared = False
        self._entries: StreamReader | None = None
        self._entries_client: Redis | None = None
        self._routers: dict[str, ReplyRouter] = {}
        self._subscriptions: set[ReplySubscription] = set()
        # Per inbound stream: whether the workers' consumer group was there at the first send
        # (checked once; see `_check_readers`).
        self._read_by_group: dict[str, bool] = {}
        self._cancel_script = Script(self.redis, source("cancel"))
        self._erase_script = Script(self.redis, source("erase"))
        self._resolve_script = Script(self.redis, source("resolve"))
        # (session_id, msg_id) -> (when, entry id) of its last send (SENT_KEPT), oldest first.
        self._sent_entries: dict[tuple[str, str], tuple[float, str]] = {}

        self._partial_routers: dict[
            int, PartialRouter
        ] = {}  # per shard (dialog_worker/client/partial_reader.py)

    async def __aenter__(self) -> DialogClient:
        await self._prepare()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for subscription in list(self._subscriptions):
            await subscription.aclose()
        for router in self._routers.values():
            await router.aclose()
        for partials in self._partial_routers.values():
            await partials.aclose()
        if self._reader is not None:
            await self._reader.aclose()
        if self._entries_client is not None:
            await self._entries_client.aclose()
        await self.redis.aclose()

    async def send(
        self,
        session_id: str,
        text: str,
        msg_id: str | None = None,
        meta: Mapping[str, str] | None = None,
        multitask: str | None = None,
        expires_at: float | None = None,
        deliver_at: float | None = None,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> SendResult:
        """Enqueue one message: one plain XADD to the session's stream (its shard's in a
        sharded deployment), what any producer in any language does. Raises
        ``ValidationError`` before touching Redis if the session id, message id, text or
        extra fields are refused. A ``msg_id`` already seen inside the dedupe window is
        answered by the workers with a ``duplicate`` reply event.

        Without ``msg_id`` the client generates one before sending. If the connection breaks
        or times out during the append, whether it landed is unknown: ``UncertainSendError``
        then carries the ``msg_id``; send again with it (applied once either way).

        ``multitask`` (``enqueue`` | ``reject`` | ``interrupt`` | ``coalesce`` | ``merge``)
        overrides DIALOG_MULTITASK for this message: what it does if its session already has a
        message in progress, or, for ``merge``, which messages reach one step together
        (docs/guarantees.md).

        ``expires_at`` (unix seconds): if the message's turn comes later than that, it ends
        ``expired`` without a step (one reply event).

        ``deliver_at`` (seconds since the epoch, like ``time.time()``; at most 366 days
        ahead): the message waits in its session as a timer and joins the session's order
        when due (its ``meta`` then carries ``timer``: ``msg:<msg_id>``); sending again with
        the same msg_id before then replaces it. Still one XADD (a ``deliver_at`` field, unix
        seconds).

        ``tenant``: the customer the message belongs to (its ``tenant`` field: 1 to 64 bytes
        without spaces or control characters), for the fair share of slots, model-call turns
        and budgets between tenants; without it, DIALOG_TENANT_PATTERN's group in the session
        id, else ``default``. ``priority``: 0 to 9, higher first (default 5): where the
        session waits in its tenant's queue; it never reorders one session's messages. A
        value intake would ignore is refused here (``ValidationError``)."""
        check_id("session_id", session_id)
        if multitask is not None and multitask not in MULTITASK_POLICIES:
            raise ValidationError(
                f"multitask must be one of {', '.join(MULTITASK_POLICIES)}, got {multitask!r}"
            )
        if msg_id is not None:
            check_id("msg_id", msg_id)
        check_text(text, self.settings.max_message_bytes)
        if msg_id is None:
            # Generated here, not left to the entry id: a send whose outcome is unknown must
            # be retried with the same msg_id, or a retry may apply the message twice.
            msg_id = uuid.uuid4().hex
        fields: dict[str, str] = {"session_id": session_id, "text": text, "msg_id": msg_id}
        if multitask is not None:
            fields["multitask"] = multitask
        if expires_at is not None:
            fields["expires_at"] = check_expires_at(expires_at)
        if deliver_at is not None:
            fields["deliver_at"] = f"{deliver_at_ms(deliver_at) / 1000:.3f}"
        fields.update(_tenancy(tenant, priority, meta))
        for name, value in (meta or {}).items():
            if name in RESERVED_FIELDS or name in ("deliver_at", "timer"):
                raise ValidationError(f"meta field {name!r} is reserved")
            fields[name] = check_meta(name, value)
        if (
            len(fields) - 3 - (multitask is not None) - (expires_at is not None) > MAX_EXTRA_FIELDS
        ):  # deliver_at counts
            raise ValidationError(f"at most {MAX_EXTRA_FIELDS} meta fields are allowed")
        size = sum(len(k.encode()) + len(v.encode()) for k, v in fields.items())
        if size > self.settings.max_message_bytes:
            raise ValidationError(
                f"text and fields are {size} bytes in all; at most "
                f"{self.settings.max_message_bytes} are allowed (DIALOG_MAX_MESSAGE_BYTES)"
            )
        keys = self.keys_for(session_id)
        stream = keys.stream
        router = self._routers.get(keys.replies)
        if router is not None:
            router.sent(session_id, msg_id)
        with self._cluster_errors("send"):
            await self._ready()
        await self._check_readers(stream)
        # A dialog.send span around the append while tracing is on; its context goes in the
        # entry's traceparent / tracestate fields when they fit the message's limits.
        with tracing.producing(stream, session_id, msg_id) as carried:
            if carried:
                # As intake counts them: every field but session_id, text, msg_id, multitask.
                extras = len(fields) - 3 - (multitask is not None)
                tracing.fit_fields(
                    fields,
                    carried,
                    MAX_EXTRA_FIELDS - extras,
                    self.settings.max_message_bytes - size,
                )
            try:
                with self._cluster_errors("send"):
                    entry_id = await self.redis.xadd(stream, fields)  # type: ignore[arg-type]
            except (RedisConnectionError, RedisTimeoutError) as exc:
                raise UncertainSendError(session_id, msg_id, exc) from exc
        entry = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        sent = self._sent_entries
        sent.pop((session_id, msg_id), None)
        sent[(session_id, msg_id)] = (time.monotonic(), entry)
        if len(sent) > SENT_KEPT:
            del sent[next(iter(sent))]
        return SendResult(session_id, msg_id, entry)

    async def ask(
        self,
        session_id: str,
        text: str,
        msg_id: str | None = None,
        # A parameter, not a cancel scope around the call: the timeout must not cut a send
        # short, and its error names the msg_id to ask again with.
        timeout: float = 30,  # noqa: ASYNC109
        multitask: str | None = None,
        expires_at: float | None = None,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> Reply:
        """Send a message and wait for its reply event: whatever the outcome (``applied``,
        ``dead_lettered`` with the fallback text, ``duplicate`` when ``msg_id`` was seen
        before, or ``cancelled`` / ``rejected`` / ``superseded`` / ``expired``). Raises
        `ReplyTimeout` after ``timeout`` seconds (send included); the message may still be
        processed, and asking again with the same ``msg_id`` waits for it (a resend of a seen
        ``msg_id`` is never applied twice: its event says ``duplicate``). ``multitask``,
        ``expires_at``, ``tenant`` and ``priority`` as for `send`.

        Every ask of a client shares one reader per reply stream: waiting costs a dictionary
        entry, not a connection. The waiter is registered before the message is sent, so a
        fast reply cannot be missed.
        """
        check_id("session_id", session_id)
        msg_id = check_id("msg_id", msg_id) if msg_id is not None else uuid.uuid4().hex
        check_text(text, self.settings.max_message_bytes)
        _tenancy(tenant, priority, None)
        if isinstance(timeout, bool) or not (
            isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0
        ):
            raise ValidationError(f"timeout must be a positive number of seconds, got {timeout!r}")
        deadline = anyio.current_time() + timeout
        stream = self.keys_for(session_id).stream
        router = self._router(self.keys_for(session_id).replies)
        # Sending: an event of this msg_id read before the send is known (an earlier message's
        # that ended unapplied, read late) must not answer it.
        waiter = router.expect(session_id, msg_id, sending=True)
        try:
            await router.start()
            sent = await self.send(
                session_id,
                text,
                msg_id=msg_id,
                multitask=multitask,
                expires_at=expires_at,
                tenant=tenant,
                priority=priority,
            )
            router.sent_as(waiter, sent.entry_id)
            with anyio.move_on_after(deadline - anyio.current_time()):
                return await waiter
            raise ReplyTimeout(
                session_id, msg_id, timeout, await self._timeout_note(router, stream)
            )
        finally:
            router.forget(session_id, msg_id, waiter)

    async def _check_readers(self, stream: str) -> None:
        """Once per stream and client: warn when no consumer group of the configured name
        reads the stream (a wrong DIALOG_STREAM or DIALOG_GROUP, or no worker started yet).
        The message is still sent: workers started later process it."""
        if stream in self._read_by_group:
            return
        present = await self._group_reads(stream)
        self._read_by_group[stream] = present
        if not present:
            log.warning(
                "no consumer group %r reads stream %r: messages wait unread until a worker "
                "with this DIALOG_STREAM and DIALOG_GROUP starts (check both if workers run)",
                self.settings.group,
                stream,
            )

    async def _group_reads(self, stream: str) -> bool:
        """Whether the configured consumer group exists on `stream`; True when this user may
        not ask (a producer's ACL allows XADD only): nothing to warn about then."""
        try:
            with self._cluster_errors("send"):
                groups = await self.redis.xinfo_groups(stream)
        except RedisConnectionError:
            raise
        except RedisError as exc:
            return "no such key" not in str(exc).lower()
        return any(g.get("name") == self.settings.group for g in groups)

    async def _timeout_note(self, router: ReplyRouter, stream: str) -> str:
        notes = [router.problem()]
        if not self._read_by_group.get(stream, True):
            with contextlib.suppress(RedisError):
                if not await self._group_reads(stream):
                    notes.append(
                        f"no consumer group {self.settings.group!r} reads stream {stream!r}: "
                        "is a worker running with the same DIALOG_STREAM and DIALOG_GROUP?"
                    )
        return "; ".join(n for n in notes if n)

    async def stream(
        self,
        session_id: str,
        msg_id: str,
        after: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - bounds the whole iteration
    ) -> AsyncIterator[StreamEvent]:
        """The answer to one message as it is written: `StreamEvent`s ``delta`` (append),
        ``reset`` (a new attempt: clear), ``resync`` (replace with the whole text so far) and
        finally ``end`` (outcome and the committed reply, which replaces what was shown).

        ``after`` is the ``cursor`` of the last event you handled (``<msg_id>:<attempt>:<pos>``):
        you get every later piece once. A finished message yields its ``end`` at once; resumed
        from the end's own cursor, nothing. Raises `ReplyTimeout` after ``timeout`` seconds
        without the end (the message may still be answered: stream it again)."""
        check_id("session_id", session_id)
        check_id("msg_id", msg_id)
        cursor = parse_cursor(after, msg_id) if after is not None else None
        deadline = _deadline(timeout)
        router = self._router(self.keys_for(session_id).replies)
        waiter = router.expect(session_id, msg_id)
        trace = tracing.stream_trace(session_id, msg_id, resumed=cursor is not None)
        failure: BaseException | None = None
        try:
            await router.start()
            rejected = router.rejected(session_id, msg_id)
            if rejected is not None and not waiter.done():
                waiter.set_result(rejected)
            sent = self._sent_entries.get((session_id, msg_id))
            sent_entry = sent[1] if sent and time.monotonic() - sent[0] <= SENT_KEPT_S else None
            if sent_entry is not None:
                router.sent_as(waiter, sent_entry)  # its event, not an earlier message's
            async for event in self._follow(
                session_id, msg_id, cursor, waiter, deadline, sent_entry=sent_entry
            ):
                if trace is not None:
                    trace.saw(event.kind, event.outcome)
                yield event
        except TimeoutError:
            failure = ReplyTimeout(session_id, msg_id, timeout or 0, router.problem())
            raise failure from None
        except Exception as exc:
            failure = exc
            raise
        finally:
            router.forget(session_id, msg_id, waiter)
            if trace is not None:
                trace.end(failure, _answer_traceparent(waiter))

    async def ask_stream(
        self,
        session_id: str,
        text: str,
        msg_id: str | None = None,
        timeout: float = 60,  # noqa: ASYNC109 - bounds the whole iteration
        meta: Mapping[str, str] | None = None,
        expires_at: float | None = None,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Send a message and stream its answer (events as `stream`). The msg_id is made before
        the send (a uuid unless given) and is on every event: after a failed send or a
        timeout, stream it again (or resend with the same msg_id) instead of sending anew.
        ``expires_at``, ``tenant`` and ``priority`` as for `send`."""
        check_id("session_id", session_id)
        _tenancy(tenant, priority, meta)  # refused before anything is read or sent
        # A msg_id of our own was never sent before: it cannot be finished already (a given one
        # may be a resend of a finished message, whose state is looked at at once).
        new = msg_id is None
        msg_id = check_id("msg_id", msg_id) if msg_id is not None else uuid.uuid4().hex
        deadline = _deadline(timeout)
        router = self._router(self.keys_for(session_id).replies)
        waiter = router.expect(session_id, msg_id, sending=True)  # as in `ask`
        # One trace for the whole exchange: the send (and the worker's spans) hang from the
        # reader's dialog.stream span.
        trace = tracing.stream_trace(session_id, msg_id)
        failure: BaseException | None = None
        try:
            await router.start()
            with tracing.active(trace):
                sent = await self.send(
                    session_id,
                    text,
                    msg_id=msg_id,
                    meta=meta,
                    expires_at=expires_at,
                    tenant=tenant,
                    priority=priority,
                )
            router.sent_as(waiter, sent.entry_id)
            # The entry it was sent as: what the msg_id's stream and turn held before it was
            # read are an earlier message's, never this one's end.
            async for event in self._follow(
                session_id, msg_id, None, waiter, deadline, new, sent=True, sent_entry=sent.entry_id
            ):
                if trace is not None:
                    trace.saw(event.kind, event.outcome)
                yield event
        except TimeoutError:
            failure = ReplyTimeout(session_id, msg_id, timeout, router.problem())
            raise failure from None
        except Exception as exc:
            failure = exc
            raise
        finally:
            router.forget(session_id, msg_id, waiter)
            if trace is not None:
                trace.end(failure, _answer_traceparent(waiter))

    def session_token(
        self, session_id: str, ttl_s: float = 3600, actions: Iterable[str] | None = None
    ) -> str:
        """A token for a browser that allows ``actions`` (some of ``send``, ``stream``,
        ``cancel``, ``events``, ``pending``, ``resume``; all when None) on this session only,
        for ``ttl_s`` seconds,
        signed with ``DIALOG_HTTP_SIGNING_KEY`` (the gateway checks it with the same key).
        Mint it in your server for the user you know, hand it to their page; rotate the key to
        revoke every token. See docs/http.md."""
        check_id("session_id", session_id)
        return session_tokens.mint(self.settings.http_signing_key, session_id, ttl_s, actions)

    async def events(
        self, session_id: str, after: str | None = None
    ) -> AsyncIterator[SessionEvent]:
        """Every turn of the session as it lands, from ``after`` (the ``cursor`` of the last
        event you handled) on, until you stop iterating: `SessionEvent`s ``turn``, ``resync``
        (replace what you show) and ``idle`` (nothing new for a while). See
        dialog_worker/client/session_events.py; the HTTP gateway's ``/events`` is this."""
        check_id("session_id", session_id)
        cursor = parse_session_cursor(after) if after is not None else None
        shard = self.keys_for(session_id)
        await self._prepare_reader()
        async for event in follow_session(
            self._reader_client(),
            self._router(shard.replies),
            shard.replies,
            shard.session(session_id).state,
            session_id,
            cursor,
        ):
            yield event

    async def follow_replies(self) -> None:
        """Start reading every shard's reply stream now, not at the first `ask` or `stream`:
        a `stream` that begins after its message was ``rejected`` (which leaves no trace but
        its reply event) then still ends, if this client read the event within the last
        minute. The HTTP gateway calls it at start."""
        for keys in self.topology.shards:
            await self._router(keys.replies).start()

    def _follow(
        self,
        session_id: str,
        msg_id: str,
        after: Cursor | None,
        waiter: asyncio.Future[Reply],
        deadline: float | None,
        just_sent: bool = False,
        sent: bool = False,
        sent_entry: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        shard = self.keys_for(session_id)
        session = shard.session(session_id)
        keys = MessageKeys(
            session.partial(msg_id),
            session.state,
            session.dedupe(msg_id),
            inbound=shard.stream,
            group=shard.group,
            ids=session.ids,
            timers=session.timers,
        )
        router = self._partial_routers.get(shard.shard)
        if router is None:
            router = self._partial_routers[shard.shard] = PartialRouter(self._reader_client())
        reader = self._reader_client()
        return follow(
            reader, router, keys, msg_id, after, waiter, deadline, just_sent, sent, sent_entry
        )

    @property
    def waiting_replies(self) -> int:
        """How many `ask` calls are waiting for their reply right now."""
        return sum(router.waiting for router in self._routers.values())

    def replies(
        self,
        group: str | None = None,
        consumer: str | None = None,
        *,
        start: str = "$",
        follow: bool = True,
        count: int = 100,
        claim_idle_ms: int = DEFAULT_CLAIM_IDLE_MS,
        block_ms: int | None = None,
    ) -> ReplySubscription:
        """Reply events of every shard, as an async iterator of `Reply`.

        With ``group``: a consumer group on the reply stream(s), created when the iteration
        starts (``start="$"``: events from then on; ``"0"``: also those the stream still
        holds). Each event goes to one consumer of the group; acknowledge it with `ack` once
        handled. An event not acknowledged within ``claim_idle_ms`` (a consumer died) is
        delivered to another consumer: at least once. ``consumer`` names this reader
        (default ``DIALOG_CONSUMER``, i.e. hostname-pid); a stable name (a pod name) gets
        its own unacknowledged events back right after a restart.

        Without ``group``: every event after ``start`` (``"$"`` now, ``"0"`` the oldest kept,
        or an event id), to every reader; nothing to acknowledge.

        ``follow=False`` ends the iteration once nothing more is there.
        """
        if group is not None:
            check_id("group", group)
        consumer = check_id(
            "consumer", consumer if consumer is not None else self.settings.consumer
        )
        if not _is_stream_id(start):
            raise ValidationError(
                f"start must be $, 0 or an event id like 1700000000000-0, got {start!r}"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValidationError(f"count must be a positive integer, got {count!r}")
        if (
            isinstance(claim_idle_ms, bool)
            or not isinstance(claim_idle_ms, int)
            or claim_idle_ms < 1
        ):
            raise ValidationError(
                f"claim_idle_ms must be a positive integer, got {claim_idle_ms!r}"
            )
        subscription = ReplySubscription(
            self._reader_client(),
            [keys.replies for keys in self.topology.shards],
            group=group,
            consumer=consumer,
            start=start,
            follow=follow,
            count=count,
            block_ms=block_ms if block_ms is not None else self.settings.read_block_ms,
            claim_idle_ms=claim_idle_ms,
            prepare=self._prepare_reader,
            on_close=self._subscriptions.discard,
        )
        self._subscriptions.add(subscription)
        return subscription

    async def ack(self, *replies: Reply) -> int:
        """Acknowledge replies read through a consumer group (`replies`); returns how many
        were still pending. Acknowledge only once the reply is fully handled: until then a
        crash hands it to another consumer."""
        done = 0
        for reply in replies:
            if reply.group is None:
                raise ValidationError(
                    f"reply {reply.id} was read without a consumer group: nothing to acknowledge"
                )
            done += int(await self._reader_client().xack(reply.stream, reply.group, reply.id))
        return done

    async def cancel(self, session_id: str, msg_id: str) -> CancelResult:
        """Cancel one message, found by its msg_id: durable (kept in Redis, whatever happens
        to workers and to this client) and idempotent (cancel as often as you like). A waiting
        message ends ``cancelled`` in its turn without a step; a running one is stopped
        (an ``async def`` step within 0.2 s, typically 30-50 ms; a plain ``def`` step sees
        ``dialog_worker.cancelled()`` turn True and its result is discarded); either way one
        ``cancelled`` reply event, and the session goes on. A running step's message keeps
        what it had streamed (`emit`) as its reply and history text. See `CancelResult`."""
        check_id("session_id", session_id)
        check_id("msg_id", msg_id)
        keys = self.keys_for(session_id)
        with self._cluster_errors("cancel"):
            await self._ready()
            status, seq, outcome = await self._cancel_script(
                keys=[keys.session_prefix],
                args=[session_id, msg_id, self.settings.dedupe_ttl_s],
            )
        status = status.decode() if isinstance(status, bytes) else str(status)
        outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if status == "cancelled":
            # Waiting for a person (dialog_worker.interrupt): it ends now, not when the wait
            # would have.
            with self._cluster_errors("cancel"):
                await interrupts.wake_if_parked(self._resolve_script, keys, session_id, msg_id)
        return CancelResult(
            session_id,
            msg_id,
            status,
            int(seq) if int(seq) > 0 else None,
            outcome or None,
        )

    async def pending(self, session_id: str) -> list[PendingInterrupt]:
        """The interrupts the session waits on (a step called ``dialog_worker.interrupt``):
        at most one, since the session's later messages wait behind it. Read from Redis: it
        survives a page reload and a worker restart. See `PendingInterrupt`."""
        check_id("session_id", session_id)
        with self._cluster_errors("pending"):
            await self._ready()
            return await interrupts.pending(self.redis, self.keys_for(session_id), session_id)

    async def resume(self, session_id: str, interrupt_id: str, value: Any) -> ResumeResult:
        """Answer the interrupt ``interrupt_id`` of the session with ``value`` (any JSON, at
        most 64 KiB): the step runs again, what it did through ``once`` is answered by its
        journal, and its ``interrupt()`` returns ``value``. Applied once: a second resume of
        the same interrupt (a double click, a retry after a timeout) changes nothing and is
        answered ``already_resumed``; a wrong id ``unknown``. See `ResumeResult`."""
        check_id("session_id", session_id)
        interrupts.check_interrupt_id(interrupt_id)
        with self._cluster_errors("resume"):
            await self._ready()
            return await interrupts.resume(
                self._resolve_script,
                self.keys_for(session_id),
                session_id,
                interrupt_id,
                value,
            )

    async def reset(self, session_id: str, *, who: str = "client", reason: str = "") -> EraseResult:
        """Start the session over: its state becomes the initial one (history cleared); the
        messages waiting in it are kept and processed from there, in order; its timers are
        kept. A step running for it is fenced: its commit is refused and it runs again on the
        new state. One ``session_reset`` event in the audit stream (``who``, ``reason``)."""
        check_id("session_id", session_id)
        with self._cluster_errors("reset"):
            await self._ready()
            return await erase(
                self._eraser(session_id), session_id, "reset", who=who, reason=reason
            )

    async def delete(
        self, session_id: str, *, who: str = "client", reason: str = "", replies: bool = False
    ) -> EraseResult:
        """Erase everything the workers keep about the session: state, history, waiting
        messages, timers, dedupe keys, cancel marks, partial-reply streams and its dead
        letters (read from the shard's dead-letter stream in chunks). A step running for it is
        fenced: its commit is refused and writes nothing. A later message starts a new
        session. Reply events stay in the reply stream until it is trimmed (MAXLEN), unless
        ``replies=True`` removes them too (a read of the whole reply stream). One
        ``session_delete`` event in the audit stream (``who``, ``reason``)."""
        check_id("session_id", session_id)
        with self._cluster_errors("delete"):
            await self._ready()
            return await erase(
                self._eraser(session_id),
                session_id,
                "delete",
                who=who,
                reason=reason,
                replies=replies,
            )

    async def state(self, session_id: str) -> dict[str, Any] | None:
        check_id("session_id", session_id)
        with self._cluster_errors("state"):
            await self._ready()
            doc = await self.redis.hget(self.keys_for(session_id).session(session_id).state, "d")
        return None if doc is None else json.loads(doc)

    async def usage(self, session_id: str) -> dict[str, Any]:
        """What the session's model calls used: the totals of its committed replies
        (``input_tokens``, ``output_tokens``, ``cost``, ``calls``; all 0 for a session without
        any) and, under ``wasted``, those of attempts that did not commit (failed, handed
        back, fenced)."""
        check_id("session_id", session_id)
        with self._cluster_errors("usage"):
            await self._ready()
            state_key = self.keys_for(session_id).session(session_id).state
            doc, wi, wo, wc, wn = await self.redis.hmget(state_key, "d", "wi", "wo", "wc", "wn")
        committed: dict[str, Any] = {}
        if doc is not None:
            try:
                parsed = json.loads(doc)
                if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
                    committed = parsed["usage"]
            except ValueError:
                pass
        fields = {
            "in": _count(committed.get("input_tokens")),
            "out": _count(committed.get("output_tokens")),
            "cost": round(_cost(committed.get("cost")) * tenants.COST_UNIT),
            "calls": _count(committed.get("calls")),
            "win": _count(wi),
            "wout": _count(wo),
            "wcost": _count(wc),
            "wcalls": _count(wn),
        }
        return {"session_id": session_id, **tenants.usage_totals(fields)}

    async def tenant_usage(self, tenant: str, day: str | None = None) -> dict[str, Any]:
        """What a tenant's model calls used on one UTC day (``yyyymmdd``; default today),
        summed over the shards: committed (counted with the replies, exactly once) and
        ``wasted`` (attempts that did not commit)."""
        with self._cluster_errors("tenant_usage"):
            await self._ready()
            return await tenants.tenant_usage(
                self.raw, self.topology, tenant, day or tenants.today()
            )

    @contextlib.contextmanager
    def _cluster_errors(self, operation: str) -> Iterator[None]:
        """During a failover redis-py's cluster client raises RedisClusterException (not a
        RedisError) while no node it knows answers, and, in 8.1, sometimes an AttributeError
        from a connection torn down mid-write. Both mean "not done, try again": callers get
        the one error type that says so (a send is retried with the same msg_id)."""
        try:
            yield
        except (RedisClusterException, AttributeError) as exc:
            if self.settings.redis_mode != "cluster":
                raise
            raise RedisConnectionError(f"cluster unavailable during {operation}: {exc}") from exc

    async def _prepare(self) -> None:
        """Learn the cluster's slot map (no-op standalone), then, before the first command
        that needs it, check the deployment's shard count (a client configured otherwise
        would send sessions to the wrong streams)."""
        if not self._prepared:
            await prepare(self.redis)
            self._prepared = True

    async def _ready(self) -> None:
        await self._prepare()
        if not self._checked:
            await check_topology(self.redis, self.settings, record=False)
            self._checked = True

    @property
    def raw(self) -> Redis:
        """A client of the same server that returns bytes (for streams whose values need not
        be UTF-8, such as dead letters)."""
        return self._reader_client()

    @property
    def entries(self) -> StreamReader:
        """The operator tools' reader of stream entries (dead letters, the inbound stream):
        bytes, every field pair kept (dialog_worker/store/stream_entries.py). Its own client, made
        on first use."""
        if self._entries is None:
            self._entries_client = connect(self.settings, 8, decode_responses=False)
            self._entries = StreamReader(self._entries_client)
        return self._entries

    def _eraser(self, session_id: str) -> Eraser:
        return Eraser(
            self.redis, self.raw, self._erase_script, self.settings, self.keys_for(session_id)
        )

    def _reader_client(self) -> Redis:
        if self._reader is None:
            self._reader = connect(self.settings, self._max_connections, decode_responses=False)
        return self._reader

    async def _prepare_reader(self) -> None:
        if not self._reader_prepared:
            await prepare(self._reader_client())
            self._reader_prepared = True

    def _router(self, stream: str) -> ReplyRouter:
        router = self._routers.get(stream)
        if router is None:
            router = ReplyRouter(
                self._reader_client(),
                stream,
                block_ms=self.settings.read_block_ms,
                prepare=self._prepare_reader,
            )
            self._routers[stream] = router
        return router

    def keys_for(self, session_id: str) -> Keys:
        """The shard a session belongs to (the only one in the plain layout)."""
        return self.topology.for_session(session_id)


def _answer_traceparent(waiter: asyncio.Future[Reply]) -> str:
    """The traceparent of the reply event a stream ended on ('' if none came)."""
    if not waiter.done() or waiter.cancelled() or waiter.exception() is not None:
        return ""
    return waiter.result().traceparent


def _tenancy(
    tenant: str | None, priority: int | None, meta: Mapping[str, str] | None
) -> dict[str, str]:
    """The ``tenant`` and ``priority`` fields of a message, checked as intake reads them
    (a value intake would ignore is refused), and not given again in ``meta``."""
    fields: dict[str, str] = {}
    if tenant is not None:
        fields["tenant"] = check_tenant(tenant)
    if priority is not None:
        fields["priority"] = check_priority(priority)
    for name in fields:
        if meta and name in meta:
            raise ValidationError(f"{name!r} is given twice: as an argument and in meta")
    return fields


def _deadline(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not (
        isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0
    ):
        raise ValidationError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return asyncio.get_running_loop().time() + timeout


def _is_stream_id(value: object) -> bool:
    if value in ("$", "0"):
        return True
    if not isinstance(value, str):
        return False
    ms, _, seq = value.partition("-")
    return ms.isascii() and ms.isdigit() and (not seq or (seq.isascii() and seq.isdigit()))


def _count(value: Any) -> int:
    """A whole number >= 0 from a state or a hash field, else 0 (never trusted)."""
    if isinstance(value, bytes | str):
        try:
            value = int(value)
        except ValueError:
            return 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _cost(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else 0.0
