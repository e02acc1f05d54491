"""`SyncDialogClient`: `send`, `ask`, `state`, `reset` and `delete` for code without an event
loop (Flask, Django, a script, a Celery task, an admin tool).

How: it runs a `DialogClient` on an event loop of its own, in a private thread (an anyio
blocking portal), and each call waits for its result there. Chosen over a second
implementation on redis-py's synchronous client so that both clients are one: the same
checks of ids and text, the same shard routing and topology check, the same ask (its waiter
registered before the send, one reply reader shared by every waiting call). The cost is a
thread hop per call (tens of microseconds, small beside the Redis round trip).

Threads: one client serves every thread of the process at once (a Flask or Django app under a
threaded server): calls from several threads run concurrently on its loop. Make it once, at
module level, and `close` it at exit (or use ``with``). Processes: a pre-forking server
(gunicorn, uWSGI) forks after the module was imported; a forked child does not inherit the
loop thread, so the client notices the new process id at its first call there and starts a
loop of its own (the parent's connections are never used by the child).

Do not call it from inside a running event loop (an ``async def`` view): it would block that
loop for the whole wait. Use `DialogClient` there.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, TypeVar, cast

import anyio.from_thread

from dialog_worker import tracing
from dialog_worker.client import session_tokens
from dialog_worker.client.dialog_client import CancelResult, DialogClient, SendResult
from dialog_worker.client.erasure import EraseResult
from dialog_worker.client.interrupts import PendingInterrupt, ResumeResult
from dialog_worker.client.partial_reader import StreamEvent
from dialog_worker.client.replies import Reply
from dialog_worker.config import Settings, client_settings
from dialog_worker.store.codec import check_id

T = TypeVar("T")

# Clients to close at interpreter exit, while their loop threads still run: left to the
# interpreter's final clean-up, a portal would wait for a thread that is already gone.
_LIVE: weakref.WeakSet[SyncDialogClient] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for client in list(_LIVE):
        client.close()


class SyncDialogClient:
    """`DialogClient`'s `send`, `ask`, `state`, `cancel`, `reset`, `delete` and
    `session_token`, as plain blocking calls, and `stream` / `ask_stream` as plain iterators
    (for Flask, Django and scripts without an event loop).

    ``SyncDialogClient(url=None, *, settings=None, max_connections=64, **overrides)`` takes
    what `DialogClient` takes and reads the same settings (``REDIS_URL``, ``DIALOG_*``) when
    constructed. It connects at the first call.
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
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._pid = 0
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._client: DialogClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        _LIVE.add(self)

    def __enter__(self) -> SyncDialogClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def send(
        self,
        session_id: str,
        text: str,
        msg_id: str | None = None,
        meta: Mapping[str, str] | None = None,
        expires_at: float | None = None,
        *,
        multitask: str | None = None,
        deliver_at: float | None = None,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> SendResult:
        """Enqueue one message and return at once (`DialogClient.send`)."""
        return self._call(
            lambda c: c.send(
                session_id,
                text,
                msg_id,
                meta,
                multitask=multitask,
                expires_at=expires_at,
                deliver_at=deliver_at,
                tenant=tenant,
                priority=priority,
            )
        )

    def ask(
        self,
        session_id: str,
        text: str,
        msg_id: str | None = None,
        timeout: float = 30,
        expires_at: float | None = None,
        *,
        multitask: str | None = None,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> Reply:
        """Send and wait up to ``timeout`` seconds for the reply (`DialogClient.ask`): raises
        `ReplyTimeout` (ask again with its ``msg_id`` to keep waiting)."""
        return self._call(
            lambda c: c.ask(
                session_id,
                text,
                msg_id,
                timeout=timeout,
                multitask=multitask,
                expires_at=expires_at,
                tenant=tenant,
                priority=priority,
            )
        )

    def state(self, session_id: str) -> dict[str, Any] | None:
        """The session's dialog state, or None (`DialogClient.state`)."""
        return self._call(lambda c: c.state(session_id))

    def reset(self, session_id: str, *, who: str = "client", reason: str = "") -> EraseResult:
        """Start the session over (`DialogClient.reset`): its state becomes the initial one
        (history cleared); its waiting messages and timers are kept. Fenced against a running
        step; one ``session_reset`` event in the audit stream (``who``, ``reason``)."""
        return self._call(lambda c: c.reset(session_id, who=who, reason=reason))

    def delete(
        self, session_id: str, *, who: str = "client", reason: str = "", replies: bool = False
    ) -> EraseResult:
        """Erase everything the workers keep about the session (`DialogClient.delete`):
        state, history, waiting messages, timers, dedupe keys and its dead letters; with
        ``replies=True`` its reply events too. Fenced against a running step; one
        ``session_delete`` event in the audit stream (``who``, ``reason``)."""
        return self._call(lambda c: c.delete(session_id, who=who, reason=reason, replies=replies))

    def stream(
        self, session_id: str, msg_id: str, after: str | None = None, timeout: float | None = None
    ) -> Iterator[StreamEvent]:
        """The answer to one message as it is written (`DialogClient.stream`): a plain
        iterator of `StreamEvent`s, each handed over as it arrives. Stop iterating (or close
        it) to stop reading."""
        return self._iterate(lambda c: c.stream(session_id, msg_id, after=after, timeout=timeout))

    def ask_stream(
        self,
        session_id: str,
        text: str,
        msg_id: str | None = None,
        timeout: float = 60,
        meta: Mapping[str, str] | None = None,
        expires_at: float | None = None,
        *,
        tenant: str | None = None,
        priority: int | None = None,
    ) -> Iterator[StreamEvent]:
        """Send a message and iterate over its answer's events (`DialogClient.ask_stream`)."""
        return self._iterate(
            lambda c: c.ask_stream(
                session_id,
                text,
                msg_id=msg_id,
                timeout=timeout,
                meta=meta,
                expires_at=expires_at,
                tenant=tenant,
                priority=priority,
            )
        )

    def cancel(self, session_id: str, msg_id: str) -> CancelResult:
        """Stop one message, waiting or running (`DialogClient.cancel`)."""
        return self._call(lambda c: c.cancel(session_id, msg_id))

    def pending(self, session_id: str) -> list[PendingInterrupt]:
        """The interrupts the session waits on (`DialogClient.pending`)."""
        return self._call(lambda c: c.pending(session_id))

    def resume(self, session_id: str, interrupt_id: str, value: Any) -> ResumeResult:
        """Answer an interrupt with ``value``, applied once (`DialogClient.resume`)."""
        return self._call(lambda c: c.resume(session_id, interrupt_id, value))

    def session_token(
        self, session_id: str, ttl_s: float = 3600, actions: Iterable[str] | None = None
    ) -> str:
        """A token for a browser, for this session only (`DialogClient.session_token`)."""
        check_id("session_id", session_id)
        return session_tokens.mint(self.settings.http_signing_key, session_id, ttl_s, actions)

    def close(self) -> None:
        """Close the connections and stop the loop thread; a later call starts them again."""
        with self._lock:
            if self._portal is not None and self._pid == os.getpid():
                client, portal = self._client, self._portal
                if client is not None:
                    portal.call(client.aclose)
                assert self._portal_cm is not None
                self._portal_cm.__exit__(None, None, None)
            else:
                self._abandon_parents()
            self._portal_cm = self._portal = self._client = self._loop = None

    # ------------------------------------------------------------------------------------

    def _call(self, call: Callable[[DialogClient], Coroutine[Any, Any, T]]) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop in this thread: the normal case
        else:
            raise RuntimeError(
                "SyncDialogClient called from inside an event loop, which it would block: "
                "use DialogClient (async) there"
            )
        portal, client = self._started()
        carried = tracing.current()
        # The caller's trace goes on in the loop thread (recent anyio versions copy the
        # calling thread's context into the portal's task as well; older ones do not).
        if carried is not None:
            return cast(T, portal.call(_in_context, carried, call, client))
        return cast(T, portal.call(call, client))

    def _iterate(self, make: Callable[[DialogClient], AsyncIterator[T]]) -> Iterator[T]:
        """An async iterator of the client's, pulled one item at a time through the loop
        thread; closed there when the caller stops."""
        self._call(_nothing)  # the same refusal inside an event loop, at the call
        portal, client = self._started()
        events = portal.call(make, client)
        carried = tracing.current()
        try:
            if carried is not None:  # the reader's span starts in the caller's trace
                try:
                    yield portal.call(_in_context, carried, _first_of, events)
                except StopAsyncIteration:
                    return
            while True:
                try:
                    yield portal.call(events.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                portal.call(close)

    def _started(self) -> tuple[anyio.from_thread.BlockingPortal, DialogClient]:
        with self._lock:
            if self._portal is None or self._pid != os.getpid():
                # First use, or a forked child: the parent's loop thread does not exist here.
                self._abandon_parents()
                portal_cm = anyio.from_thread.start_blocking_portal()
                portal = portal_cm.__enter__()
                try:
                    self._client = portal.call(self._open)
                except BaseException:
                    portal_cm.__exit__(None, None, None)  # no thread left behind
                    raise
                self._portal_cm, self._portal, self._pid = portal_cm, portal, os.getpid()
            assert self._client is not None
            return self._portal, self._client

    def _abandon_parents(self) -> None:
        """In a forked child: drop the parent's portal without waiting for its thread, which
        the fork did not copy. Closing it as usual (or letting it be collected, which closes
        it too) would ask that thread to stop and wait for ever. Marked not running, anyio
        skips the stop; the parent's connections are left to the parent."""
        if self._portal_cm is not None and self._pid != os.getpid():
            assert self._portal is not None and self._loop is not None
            # The parent's loop shares its epoll instance with the parent (fork copies the
            # descriptor, not the instance): closing it, as its finaliser would once the
            # references below are dropped, unregisters the parent's descriptors there and
            # the parent's loop never wakes again. Marked closed, it is only freed.
            self._loop._closed = True  # type: ignore[attr-defined]
            self._portal._event_loop_thread_id = None  # anyio's "not running": no stop()
            self._portal_cm.__exit__(None, None, None)
        self._portal_cm = self._portal = self._client = self._loop = None

    async def _open(self) -> DialogClient:
        self._loop = asyncio.get_running_loop()
        client = DialogClient(settings=self.settings, max_connections=self._max_connections)
        return await client.__aenter__()


async def _nothing(client: DialogClient) -> None:
    return None


async def _in_context(carried: Any, call: Callable[[Any], Coroutine[Any, Any, T]], arg: Any) -> T:
    """``call(arg)`` on the loop with the calling thread's trace context current: the loop's
    tasks do not inherit the caller's context variables."""
    with tracing.attached(carried):
        return await call(arg)


async def _first_of(events: AsyncIterator[T]) -> T:
    return await events.__anext__()
