"""The gateway's ASGI app (Starlette): a thin HTTP face of `DialogClient`.

    POST /sessions/{session_id}/messages                     send; 202 with the msg_id
    GET  /sessions/{session_id}/messages/{msg_id}/stream     the answer as server-sent events
    POST /sessions/{session_id}/messages/{msg_id}/cancel     stop the answer (idempotent)
    GET  /sessions/{session_id}/events                       the session's turns, as they land
    GET  /sessions/{session_id}/pending                      what the session waits on (a person)
    POST /sessions/{session_id}/interrupts/{interrupt_id}/resume  answer it ({"value": ...}), once

Every request carries a token (``Authorization: Bearer <token>``, or ``?access_token=`` for
``EventSource``, which cannot set headers) unless the app was built without auth: the server
token (``DIALOG_HTTP_TOKEN``, for the application's servers: any session), or a session token
minted by the application (dialog_worker/client/session_tokens.py: one session, some actions, until
it expires), or whatever the ``DIALOG_HTTP_AUTHORIZE`` hook lets through. 401 without a valid
one, 403 for a valid session token of another session or action. Pages on the origins of
``DIALOG_HTTP_CORS_ORIGINS`` may call it from their own origin. Bad input is
a 4xx with ``{"error": "..."}``; Redis out of reach a 503.

Each SSE connection holds one task that follows the answer (`DialogClient.stream`) and a
channel of at most `QUEUE_EVENTS` events between it and the response: a slow browser slows its
own reader, never the server's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import inspect
import json
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, cast

import redis.exceptions
import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from dialog_worker import tracing
from dialog_worker.client import session_tokens
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.partial_reader import StreamEvent
from dialog_worker.client.session_events import parse_session_cursor
from dialog_worker.config import Settings
from dialog_worker.errors import ConfigError, ReplyStreamError, ValidationError
from dialog_worker.store.codec import check_id

log = structlog.get_logger("dialog_worker.gateway")

# Events buffered per connection between the reader and a slow browser.
QUEUE_EVENTS = 16
# A comment line this often while nothing else is sent: proxies keep the connection open and
# the browser learns soon when it is gone.
HEARTBEAT_S = 15.0
# What the browser waits before it reconnects (SSE `retry:`).
RETRY_MS = 1000
# One connection follows an answer this long at most; the browser then reconnects from its
# cursor (bounds what a never-answered message holds).
CONNECTION_MAX_S = 600.0
# How long a request waits for its first event before the stream opens without one.
FIRST_EVENT_WAIT_S = 1.0
# Largest request body: the message and its fields, with room for JSON quoting.
BODY_SLACK_BYTES = 16_384
_NOTHING_YET = TimeoutError("no event yet")
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx and others would hold the last event otherwise
    "Connection": "keep-alive",
}


def load_hook(spec: str) -> Callable[..., Any]:
    """``package.module:function`` (DIALOG_HTTP_AUTHORIZE): called as ``function(request,
    session_id, action)`` when a request carries neither the server token nor a session token
    that allows it; True (or an awaitable of True) lets it through."""
    module_name, _, name = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("DIALOG_HTTP_AUTHORIZE", f"cannot load {spec!r}: {exc}") from None
    if not callable(hook):
        raise ConfigError("DIALOG_HTTP_AUTHORIZE", f"{spec!r} is not callable")
    return cast(Callable[..., Any], hook)


def create_app(
    settings: Settings,
    token: str | None,
    client: DialogClient | None = None,
    extra_routes: list[BaseRoute] | None = None,
    max_connections: int = 128,
) -> Starlette:
    """The app. ``token`` None means no auth (only for a loopback listener: `serve` checks).
    ``client`` is made (and closed) by the app's lifespan unless given. ``extra_routes`` are
    mounted next to the gateway's (a chat page, your own API)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if client is not None:
            app.state.client = client
            yield
            return
        # Streams share one blocking read (dialog_worker/client/partial_reader.py); connections
        # serve the sends and each stream's catch-up reads.
        async with DialogClient(settings=settings, max_connections=max_connections) as made:
            # Read replies from the start: a message rejected between its POST and the GET of
            # its stream is known only by its reply event.
            try:
                await made.follow_replies()
            except (redis.exceptions.RedisError, OSError) as exc:  # started at first use then
                log.warning("reply_follow_deferred", error=str(exc))
            app.state.client = made
            yield

    routes: list[BaseRoute] = [
        Route("/sessions/{session_id}/messages", post_message, methods=["POST"]),
        Route("/sessions/{session_id}/messages/{msg_id}/stream", stream_answer, methods=["GET"]),
        Route("/sessions/{session_id}/messages/{msg_id}/cancel", cancel_message, methods=["POST"]),
        Route("/sessions/{session_id}/events", session_events, methods=["GET"]),
        Route("/sessions/{session_id}/pending", pending_interrupts, methods=["GET"]),
        Route(
            "/sessions/{session_id}/interrupts/{interrupt_id}/resume",
            resume_interrupt,
            methods=["POST"],
        ),
        Route("/healthz", healthz, methods=["GET"]),
        *(extra_routes or []),
    ]
    middleware = []
    origins = [o for o in settings.http_cors_origins.split(",") if o]
    if origins:
        # Pages on these origins may call the gateway: preflights are answered, and the
        # answers name the origin. Credentials are tokens in a header, never cookies.
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST"],
                allow_headers=[
                    "Authorization",
                    "Content-Type",
                    "Last-Event-ID",
                    "traceparent",
                    "tracestate",
                ],
                allow_credentials=False,
                max_age=600,
            )
        )
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.token = token
    app.state.signing_key = settings.http_signing_key
    app.state.authorize = load_hook(settings.http_authorize) if settings.http_authorize else None
    app.state.max_body = settings.max_message_bytes + BODY_SLACK_BYTES
    return app


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def _given_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.query_params.get("access_token", "")


async def _refused(request: Request, action: str) -> JSONResponse | None:
    """None when the request may do ``action`` (one of session_tokens.ACTIONS) on the path's
    session: the server token (any session), a session token for this session and action,
    or the ``authorize`` hook's yes. Else 401 (no valid credential) or 403 (a valid session
    token for another session or action), saying which."""
    state = request.app.state
    if state.token is None:
        return _undecodable(request)  # built without auth (a loopback listener)
    given = _given_token(request)
    if state.token and given and hmac.compare_digest(given.encode(), state.token.encode()):
        return _undecodable(request)
    session_id = request.path_params.get("session_id", "")
    refusal = session_tokens.TokenRefused(
        401, "missing or wrong token (Authorization: Bearer <token>)"
    )
    if state.signing_key and given.startswith(session_tokens.VERSION + "."):
        try:
            grant = session_tokens.verify(state.signing_key, given)
            session_tokens.check(grant, session_id, action)
            return _undecodable(request)
        except session_tokens.TokenRefused as exc:
            refusal = exc
    if state.authorize is not None:
        verdict = state.authorize(request, session_id, action)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        if verdict is True:
            return _undecodable(request)
    return _error(refusal.status, refusal.reason)


def _undecodable(request: Request) -> JSONResponse | None:
    """A 400 when a path parameter is not UTF-8 once percent-decoded. The router decodes the
    path with replacement characters, so ``%FF`` and ``%FE`` would both name the session
    ``\ufffd`` (two users in one conversation): the raw path is checked instead."""
    raw = request.scope.get("raw_path")
    if not isinstance(raw, bytes):
        return None
    for segment in raw.split(b"?", 1)[0].split(b"/"):
        try:
            urllib.parse.unquote_to_bytes(segment).decode("utf-8")
        except UnicodeDecodeError:
            return _error(400, "the path must be UTF-8 once percent-decoded")
    return None


async def healthz(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def post_message(request: Request) -> Response:
    """Body ``{"text": "...", "msg_id", "meta" {name: text}, "multitask", "expires_at",
    "deliver_at"}`` (all but text optional, as for `DialogClient.send`); answers 202
    ``{"session_id", "msg_id", "entry_id", "stream"}``. The msg_id is made before the send: a
    503 names it too, so posting again with it cannot apply the message twice."""
    refused = await _refused(request, "send")
    if refused is not None:
        return refused
    client: DialogClient = request.app.state.client
    body = await _read_json(request)
    if isinstance(body, Response):
        return body
    session_id = request.path_params["session_id"]
    text, msg_id, meta = body.get("text"), body.get("msg_id"), body.get("meta")
    if not isinstance(text, str):
        return _error(400, "text must be a string")
    if msg_id is not None and not isinstance(msg_id, str):
        return _error(400, "msg_id must be a string")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        return _error(400, "meta must be an object of strings")
    multitask = body.get("multitask")
    if multitask is not None and not isinstance(multitask, str):
        return _error(400, "multitask must be a string")
    times: dict[str, float] = {}
    for name in ("expires_at", "deliver_at"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            return _error(400, f"{name} must be a number (unix seconds)")
        times[name] = float(value)
    msg_id = msg_id if msg_id is not None else uuid.uuid4().hex
    try:
        # The request's own traceparent header (a browser's, a caller's) is the parent of the
        # send's span, so the message's trace starts where the request's did.
        with tracing.attached(tracing.from_headers(request.headers)):
            sent = await client.send(
                session_id, text, msg_id=msg_id, meta=meta, multitask=multitask, **times
            )
    except ValidationError as exc:
        return _error(400, str(exc))
    except (redis.exceptions.RedisError, OSError):
        return _error(
            503, "the chat service is unavailable; post again with this msg_id", msg_id=msg_id
        )
    stream = request.url_for("stream_answer", session_id=session_id, msg_id=sent.msg_id)
    return JSONResponse({**sent.as_dict(), "stream": stream.path}, status_code=202)


async def cancel_message(request: Request) -> Response:
    """Cancel one message (`DialogClient.cancel`): 200 with ``{"session_id", "msg_id",
    "status", "seq", "outcome"}``, ``status`` ``cancelled`` (it will end so), ``finished``
    (it had ended: ``outcome`` says how when the history knows) or ``pending`` (not found yet:
    the cancel is kept and ends it if it comes). No body; as often as you like."""
    refused = await _refused(request, "cancel")
    if refused is not None:
        return refused
    client: DialogClient = request.app.state.client
    session_id, msg_id = request.path_params["session_id"], request.path_params["msg_id"]
    try:
        result = await client.cancel(session_id, msg_id)
    except ValidationError as exc:
        return _error(400, str(exc))
    except (redis.exceptions.RedisError, OSError):
        return _error(503, "the chat service is unavailable; cancel again", msg_id=msg_id)
    return JSONResponse(result.as_dict())


async def pending_interrupts(request: Request) -> Response:
    """What the session waits on (`DialogClient.pending`): 200 with ``{"session_id",
    "pending": [{"interrupt_id", "msg_id", "seq", "payload", "created_at", "timeout_at"}]}``
    (at most one; empty when nothing waits). A page shows it again after a reload."""
    refused = await _refused(request, "pending")
    if refused is not None:
        return refused
    client: DialogClient = request.app.state.client
    session_id = request.path_params["session_id"]
    try:
        found = await client.pending(session_id)
    except ValidationError as exc:
        return _error(400, str(exc))
    except (redis.exceptions.RedisError, OSError):
        return _error(503, "the chat service is unavailable")
    return JSONResponse({"session_id": session_id, "pending": [p.as_dict() for p in found]})


# How a resume's status answers over HTTP: applied now or before (a double click) is a 200;
# ended otherwise (timed out, cancelled) a 409; no such interrupt a 404.
RESUME_STATUS = {"resumed": 200, "already_resumed": 200, "unknown": 404}


async def resume_interrupt(request: Request) -> Response:
    """Answer an interrupt (`DialogClient.resume`): body ``{"value": <any JSON>}``; ``{
    "session_id", "interrupt_id", "status"}`` with 200 (``resumed``, or ``already_resumed``:
    applied once however often it is posted), 409 (``timed_out``, ``cancelled``,
    ``superseded``: it ended without this answer) or 404 (``unknown``)."""
    refused = await _refused(request, "resume")
    if refused is not None:
        return refused
    client: DialogClient = request.app.state.client
    body = await _read_json(request)
    if isinstance(body, Response):
        return body
    if "value" not in body:
        return _error(400, 'the body must be {"value": ...}')
    session_id = request.path_params["session_id"]
    interrupt_id = request.path_params["interrupt_id"]
    try:
        result = await client.resume(session_id, interrupt_id, body["value"])
    except ValidationError as exc:
        return _error(400, str(exc))
    except (redis.exceptions.RedisError, OSError):
        return _error(503, "the chat service is unavailable; resume again (applied once)")
    return JSONResponse(result.as_dict(), status_code=RESUME_STATUS.get(result.status, 409))


async def _read_json(request: Request) -> dict[str, Any] | Response:
    limit: int = request.app.state.max_body
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return _error(413, f"the body must be at most {limit} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            return _error(413, f"the body must be at most {limit} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: nesting deeper than the parser's stack (a body of "[[[[...").
        return _error(400, "the body must be JSON")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


async def stream_answer(request: Request) -> Response:
    """The answer as server-sent events: ``id:`` is the cursor (absent on ``reset``),
    ``event:`` the kind, ``data:`` the event as JSON. Resumes from ``Last-Event-ID`` or
    ``?after=``. 204 when the cursor is already at the end: nothing is live for you."""
    refused = await _refused(request, "stream")
    if refused is not None:
        return refused
    client: DialogClient = request.app.state.client
    session_id, msg_id = request.path_params["session_id"], request.path_params["msg_id"]
    after = request.headers.get("last-event-id") or request.query_params.get("after") or None
    events = client.stream(session_id, msg_id, after=after, timeout=CONNECTION_MAX_S)
    queue: asyncio.Queue[StreamEvent | BaseException | None] = asyncio.Queue(QUEUE_EVENTS)
    # The reader's dialog.stream span starts in the pump task, which inherits the request's
    # trace context (its traceparent header) from here.
    with tracing.attached(tracing.from_headers(request.headers)):
        pump = asyncio.create_task(_pump(events, queue))
    first: StreamEvent | BaseException | None = None
    try:
        # Long enough to learn that a finished answer has nothing more for this cursor (204),
        # or that the request is bad (400); short enough that the stream opens at once.
        first = await asyncio.wait_for(queue.get(), FIRST_EVENT_WAIT_S)
    except TimeoutError:
        first = _NOTHING_YET
    except BaseException:
        pump.cancel()
        raise
    if first is None:
        return Response(status_code=204, headers={"Cache-Control": "no-cache"})
    if first is _NOTHING_YET:
        # Nothing within the first second (the answer has not started): open the stream now.
        # Checked first: a TimeoutError is also an OSError, which would read as Redis away.
        return StreamingResponse(
            _sse(None, queue, pump), media_type="text/event-stream", headers=SSE_HEADERS
        )
    if isinstance(first, ValidationError):
        return _error(400, str(first))
    if isinstance(first, (redis.exceptions.RedisError, OSError, ReplyStreamError)):
        return _error(503, "the chat service is unavailable")
    if isinstance(first, BaseException):
        raise first
    return StreamingResponse(
        _sse(first, queue, pump), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _pump(
    events: AsyncIterator[StreamEvent], queue: asyncio.Queue[StreamEvent | BaseException | None]
) -> None:
    """Reads the answer into the connection's bounded queue; ends it with None (the end) or
    the error that stopped it."""
    try:
        async for event in events:
            await queue.put(event)
        await queue.put(None)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        await queue.put(exc)
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]


async def _sse(
    first: StreamEvent | None,
    queue: asyncio.Queue[StreamEvent | BaseException | None],
    pump: asyncio.Task[None],
) -> AsyncIterator[str]:
    try:
        yield f"retry: {RETRY_MS}\n\n"
        pending = [first] if first is not None else []
        while True:
            for event in pending:
                yield format_event(event)
                if event.kind == "end":
                    return
            try:
                item = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
            except TimeoutError:
                yield ": keep-alive\n\n"
                pending = []
                continue
            if not isinstance(item, StreamEvent):
                return  # the reader stopped (an error, or this connection's time is up):
                # the browser reconnects from its cursor
            pending = [item]
    finally:
        pump.cancel()
        with contextlib.suppress(BaseException):
            await pump


def format_event(event: StreamEvent) -> str:
    data = json.dumps(_public(event.as_dict()), ensure_ascii=False)
    head = f"id: {event.cursor}\n" if event.cursor is not None else ""
    return f"{head}event: {event.kind}\ndata: {data}\n\n"


def _public(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


async def session_events(request: Request) -> Response:
    """The session's turns as server-sent events (`DialogClient.events`): ``turn`` (a message's
    end: ``seq``, ``msg_id``, ``outcome``, ``user``, ``bot``) and ``resync`` (replace what you
    show with ``turns``: after a gap in the reply stream, or when the session started over).
    ``id:`` is the cursor (``<ms>-<n>:<seq>``); ``Last-Event-ID`` / ``?after=`` resumes from it
    (a bare seq, the cursor of earlier versions, starts from the kept turns above it)."""
    refused = await _refused(request, "events")
    if refused is not None:
        return refused
    client: DialogClient = request.app.state.client
    session_id = request.path_params["session_id"]
    raw_after = request.headers.get("last-event-id") or request.query_params.get("after") or None
    try:
        check_id("session_id", session_id)
        if raw_after is not None:
            parse_session_cursor(raw_after)
    except ValidationError as exc:
        return _error(400, str(exc))
    return StreamingResponse(
        _turns(client, session_id, raw_after), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _turns(client: DialogClient, session_id: str, after: str | None) -> AsyncIterator[str]:
    yield f"retry: {RETRY_MS}\n\n"
    loop = asyncio.get_running_loop()
    ends = loop.time() + CONNECTION_MAX_S
    quiet_since = loop.time()
    events = client.events(session_id, after)
    try:
        async for event in events:
            if event.kind != "idle":
                data = json.dumps(event.data, ensure_ascii=False)
                head = f"id: {event.cursor}\n" if event.cursor is not None else ""
                yield f"{head}event: {event.kind}\ndata: {data}\n\n"
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= HEARTBEAT_S:
                yield ": keep-alive\n\n"
                quiet_since = loop.time()
            if loop.time() >= ends:
                return  # the browser reconnects from its cursor
    except (redis.exceptions.RedisError, OSError, ReplyStreamError) as exc:
        log.warning("session_events_stopped", error=str(exc))
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
