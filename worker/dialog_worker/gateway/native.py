"""The gateway's own routes: a thin HTTP face of `DialogClient`.

    POST /sessions/{session_id}/messages                     send; 202 with the msg_id
    GET  /sessions/{session_id}/messages/{msg_id}/stream     the answer as server-sent events
    POST /sessions/{session_id}/messages/{msg_id}/cancel     stop the answer (idempotent)
    GET  /sessions/{session_id}/events                       the session's turns, as they land
    GET  /sessions/{session_id}/pending                      what the session waits on (a person)
    POST /sessions/{session_id}/interrupts/{interrupt_id}/resume  answer it ({"value": ...}), once

Who may call and how bad input is refused: dialog_worker/gateway/shared.py. Bad input is a 4xx
with ``{"error": "..."}``; Redis out of reach a 503.

Each SSE connection holds one task that follows the answer (`DialogClient.stream`) and a
channel of at most `QUEUE_EVENTS` events between it and the response: a slow browser slows its
own reader, never the server's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import redis.exceptions
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from dialog_worker import tracing
from dialog_worker.client.dialog_client import CancelResult, DialogClient
from dialog_worker.client.interrupts import ResumeResult
from dialog_worker.client.partial_reader import StreamEvent
from dialog_worker.client.session_events import parse_session_cursor
from dialog_worker.errors import ReplyStreamError, ValidationError
from dialog_worker.gateway import openapi
from dialog_worker.gateway.native_models import Health, MessageIn, Pending, ResumeIn, Sent
from dialog_worker.gateway.shared import (
    CONNECTION_MAX_S,
    FIRST_EVENT_WAIT_S,
    HEARTBEAT_S,
    QUEUE_EVENTS,
    RETRY_MS,
    SSE_HEADERS,
    error,
    pump,
    read_json,
    refuse,
    refused,
    sse,
    trace_context,
)
from dialog_worker.store.codec import check_id

log = structlog.get_logger("dialog_worker.gateway")

_NOTHING_YET = TimeoutError("no event yet")
# The OpenAPI document's names for these routes (gateway/openapi.py).
TAG = "Sessions"
RESUMABLE = {
    "after": "the cursor of the last event handled (as Last-Event-ID)",
    "access_token": "the token, for EventSource (which cannot set headers)",
}
FROM_CURSOR = {"Last-Event-ID": "the cursor of the last event handled"}


def routes() -> list[BaseRoute]:
    return [
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
    ]


@openapi.operation("Gateway", "Liveness, without a token", responses={200: Health})
async def healthz(request: Request) -> Response:
    return JSONResponse({"ok": True})


@openapi.operation(
    TAG, "Send a message to the session", body=MessageIn, responses={202: Sent, 413: None}
)
async def post_message(request: Request) -> Response:
    """Body ``{"text": "...", "msg_id", "meta" {name: text}, "multitask", "expires_at",
    "deliver_at"}`` (all but text optional, as for `DialogClient.send`); answers 202
    ``{"session_id", "msg_id", "entry_id", "stream"}``. The msg_id is made before the send: a
    503 names it too, so posting again with it cannot apply the message twice."""
    denied = await refused(request, "send")
    if denied is not None:
        return denied
    client: DialogClient = request.app.state.client
    body = await read_json(request)
    if isinstance(body, Response):
        return body
    session_id = request.path_params["session_id"]
    text, msg_id, meta = body.get("text"), body.get("msg_id"), body.get("meta")
    if not isinstance(text, str):
        return refuse(request, 400, "bad_input", "text must be a string")
    if msg_id is not None and not isinstance(msg_id, str):
        return refuse(request, 400, "bad_input", "msg_id must be a string")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        return refuse(request, 400, "bad_input", "meta must be an object of strings")
    multitask = body.get("multitask")
    if multitask is not None and not isinstance(multitask, str):
        return refuse(request, 400, "bad_input", "multitask must be a string")
    times: dict[str, float] = {}
    for name in ("expires_at", "deliver_at"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            return refuse(request, 400, "bad_input", f"{name} must be a number (unix seconds)")
        times[name] = float(value)
    msg_id = msg_id if msg_id is not None else uuid.uuid4().hex
    try:
        # The request's own traceparent header (a browser's, a caller's) is the parent of the
        # send's span, so the message's trace starts where the request's did.
        with tracing.attached(trace_context(request)):
            sent = await client.send(
                session_id,
                text,
                msg_id=msg_id,
                meta=meta,
                multitask=multitask,
                expires_at=times.get("expires_at"),
                deliver_at=times.get("deliver_at"),
            )
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except (redis.exceptions.RedisError, OSError):
        return error(
            503, "the chat service is unavailable; post again with this msg_id", msg_id=msg_id
        )
    stream = request.url_for("stream_answer", session_id=session_id, msg_id=sent.msg_id)
    return JSONResponse({**sent.as_dict(), "stream": stream.path}, status_code=202)


@openapi.operation(TAG, "Cancel one message (idempotent)", responses={200: CancelResult})
async def cancel_message(request: Request) -> Response:
    """Cancel one message (`DialogClient.cancel`): 200 with ``{"session_id", "msg_id",
    "status", "seq", "outcome"}``, ``status`` ``cancelled`` (it will end so), ``finished``
    (it had ended: ``outcome`` says how when the history knows) or ``pending`` (not found yet:
    the cancel is kept and ends it if it comes). No body; as often as you like."""
    denied = await refused(request, "cancel")
    if denied is not None:
        return denied
    client: DialogClient = request.app.state.client
    session_id, msg_id = request.path_params["session_id"], request.path_params["msg_id"]
    try:
        result = await client.cancel(session_id, msg_id)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except (redis.exceptions.RedisError, OSError):
        return error(503, "the chat service is unavailable; cancel again", msg_id=msg_id)
    return JSONResponse(result.as_dict())


@openapi.operation(TAG, "What the session waits on (a person)", responses={200: Pending})
async def pending_interrupts(request: Request) -> Response:
    """What the session waits on (`DialogClient.pending`): 200 with ``{"session_id",
    "pending": [{"interrupt_id", "msg_id", "seq", "payload", "created_at", "timeout_at"}]}``
    (at most one; empty when nothing waits). A page shows it again after a reload."""
    denied = await refused(request, "pending")
    if denied is not None:
        return denied
    client: DialogClient = request.app.state.client
    session_id = request.path_params["session_id"]
    try:
        found = await client.pending(session_id)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except (redis.exceptions.RedisError, OSError):
        return error(503, "the chat service is unavailable")
    return JSONResponse({"session_id": session_id, "pending": [p.as_dict() for p in found]})


# How a resume's status answers over HTTP: applied now or before (a double click) is a 200;
# ended otherwise (timed out, cancelled) a 409; no such interrupt a 404.
RESUME_STATUS = {"resumed": 200, "already_resumed": 200, "unknown": 404}


@openapi.operation(
    TAG,
    "Answer the session's interrupt (applied once)",
    body=ResumeIn,
    responses={200: ResumeResult, 404: None, 409: None},
)
async def resume_interrupt(request: Request) -> Response:
    """Answer an interrupt (`DialogClient.resume`): body ``{"value": <any JSON>}``; ``{
    "session_id", "interrupt_id", "status"}`` with 200 (``resumed``, or ``already_resumed``:
    applied once however often it is posted), 409 (``timed_out``, ``cancelled``,
    ``superseded``: it ended without this answer) or 404 (``unknown``)."""
    denied = await refused(request, "resume")
    if denied is not None:
        return denied
    client: DialogClient = request.app.state.client
    body = await read_json(request)
    if isinstance(body, Response):
        return body
    if "value" not in body:
        return refuse(request, 400, "bad_input", 'the body must be {"value": ...}')
    session_id = request.path_params["session_id"]
    interrupt_id = request.path_params["interrupt_id"]
    try:
        result = await client.resume(session_id, interrupt_id, body["value"])
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except (redis.exceptions.RedisError, OSError):
        return error(503, "the chat service is unavailable; resume again (applied once)")
    return JSONResponse(result.as_dict(), status_code=RESUME_STATUS.get(result.status, 409))


@openapi.operation(
    TAG,
    "The answer to one message as server-sent events (delta, reset, resync, event, end)",
    responses={200: openapi.EVENT_STREAM, 204: None},
    query=RESUMABLE,
    headers=FROM_CURSOR,
)
async def stream_answer(request: Request) -> Response:
    """The answer as server-sent events: ``id:`` is the cursor (absent on ``reset``),
    ``event:`` the kind, ``data:`` the event as JSON. Resumes from ``Last-Event-ID`` or
    ``?after=``. 204 when the cursor is already at the end: nothing is live for you."""
    denied = await refused(request, "stream")
    if denied is not None:
        return denied
    client: DialogClient = request.app.state.client
    session_id, msg_id = request.path_params["session_id"], request.path_params["msg_id"]
    after = request.headers.get("last-event-id") or request.query_params.get("after") or None
    events = client.stream(session_id, msg_id, after=after, timeout=CONNECTION_MAX_S)
    queue: asyncio.Queue[StreamEvent | BaseException | None] = asyncio.Queue(QUEUE_EVENTS)
    # The reader's dialog.stream span starts in the pump task, which inherits the request's
    # trace context (its traceparent header) from here.
    with tracing.attached(trace_context(request)):
        reader = asyncio.create_task(pump(events, queue))
    first: StreamEvent | BaseException | None = None
    try:
        # Long enough to learn that a finished answer has nothing more for this cursor (204),
        # or that the request is bad (400); short enough that the stream opens at once.
        first = await asyncio.wait_for(queue.get(), FIRST_EVENT_WAIT_S)
    except TimeoutError:
        first = _NOTHING_YET
    except BaseException:
        reader.cancel()
        raise
    if first is None:
        return Response(status_code=204, headers={"Cache-Control": "no-cache"})
    if first is _NOTHING_YET:
        # Nothing within the first second (the answer has not started): open the stream now.
        # Checked first: a TimeoutError is also an OSError, which would read as Redis away.
        return StreamingResponse(
            sse([], queue, reader, render), media_type="text/event-stream", headers=SSE_HEADERS
        )
    if isinstance(first, ValidationError):
        return refuse(request, 400, "bad_input", str(first))
    if isinstance(first, (redis.exceptions.RedisError, OSError, ReplyStreamError)):
        return error(503, "the chat service is unavailable")
    if isinstance(first, BaseException):
        raise first
    return StreamingResponse(
        sse([first], queue, reader, render), media_type="text/event-stream", headers=SSE_HEADERS
    )


def render(event: StreamEvent) -> tuple[str, bool]:
    return format_event(event), event.kind == "end"


def format_event(event: StreamEvent) -> str:
    data = json.dumps(_public(event.as_dict()), ensure_ascii=False)
    head = f"id: {event.cursor}\n" if event.cursor is not None else ""
    return f"{head}event: {event.kind}\ndata: {data}\n\n"


def _public(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


@openapi.operation(
    TAG,
    "Every turn of the session as server-sent events (turn, awaiting, resync)",
    responses={200: openapi.EVENT_STREAM},
    query=RESUMABLE,
    headers=FROM_CURSOR,
)
async def session_events(request: Request) -> Response:
    """The session's turns as server-sent events (`DialogClient.events`): ``turn`` (a message's
    end: ``seq``, ``msg_id``, ``outcome``, ``user``, ``bot``) and ``resync`` (replace what you
    show with ``turns``: after a gap in the reply stream, or when the session started over).
    ``id:`` is the cursor (``<ms>-<n>:<seq>``); ``Last-Event-ID`` / ``?after=`` resumes from it
    (a bare seq, the cursor of earlier versions, starts from the kept turns above it)."""
    denied = await refused(request, "events")
    if denied is not None:
        return denied
    client: DialogClient = request.app.state.client
    session_id = request.path_params["session_id"]
    raw_after = request.headers.get("last-event-id") or request.query_params.get("after") or None
    try:
        check_id("session_id", session_id)
        if raw_after is not None:
            parse_session_cursor(raw_after)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
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
