"""The Vercel AI SDK's front door: a stock ``useChat`` with ``DefaultChatTransport({api:
"<gateway>/ai-sdk/chat", headers: {Authorization: "Bearer <token>"}})`` talks to it unchanged.

    POST /ai-sdk/chat                     {id, messages, trigger, messageId} -> the answer
    GET  /ai-sdk/chat/{session_id}/stream the answer in progress, replayed (204: none)
    POST /ai-sdk/chat/{session_id}/stop   stop it (or the message named in the body)

The chat ``id`` is the session. The last message of a POST is the message: a user message's
text is sent with its ``id`` as the msg_id (a retried POST is the same message, answered
once), or an assistant message whose question (``dialog_worker.interrupt``) the person
answered resumes it. The answer streams back as the UI message stream protocol
(dialog_worker/gateway/ui_stream.py). Same tokens, CORS, limits and double-texting policy
(``multitask`` in the body, else ``DIALOG_MULTITASK``) as the gateway's own routes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import redis.exceptions
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from dialog_worker import tracing
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.partial_reader import StreamEvent
from dialog_worker.errors import ReplyStreamError, ValidationError
from dialog_worker.gateway import openapi
from dialog_worker.gateway.ai_sdk_models import ChatIn, StopIn, Stopped
from dialog_worker.gateway.shared import (
    CONNECTION_MAX_S,
    FIRST_EVENT_WAIT_S,
    QUEUE_EVENTS,
    SSE_HEADERS,
    error,
    pump,
    read_json,
    refuse,
    refused,
    sse,
    trace_context,
)
from dialog_worker.gateway.ui_stream import INTERRUPT_TOOL, UIMessageWriter, answered_msg_id
from dialog_worker.store.codec import check_id
from dialog_worker.store.queue_view import message_in_progress

# useChat sends the whole conversation with every message: a larger body than the gateway's
# own routes take, of which only the last message is read.
MAX_BODY_BYTES = 1_048_576
HEADERS = {**SSE_HEADERS, "x-vercel-ai-ui-message-stream": "v1"}
# A replay (GET .../stream) first reads what is already written, at most this many events or
# until the reader is quiet this long, and shows only its last attempt.
BACKLOG_EVENTS = 256
BACKLOG_QUIET_S = 0.05
ANSWERED_STATES = ("approval-responded", "output-available")


def routes() -> list[BaseRoute]:
    return [
        Route("/ai-sdk/chat", post_chat, methods=["POST"]),
        Route("/ai-sdk/chat/{session_id}/stream", resume_stream, methods=["GET"]),
        Route("/ai-sdk/chat/{session_id}/stop", stop_answer, methods=["POST"]),
    ]


class BadMessage(ValueError):
    """The last message of a POST cannot be read (a 400 that says why)."""


TAG = "AI SDK (useChat)"
UI_STREAM = {"x-vercel-ai-ui-message-stream": "v1: the AI SDK's UI message stream protocol"}


@openapi.operation(
    TAG,
    "Send the chat's last user message and stream its answer (UI message stream)",
    body=ChatIn,
    responses={200: openapi.EVENT_STREAM, 413: None},
)
async def post_chat(request: Request) -> Response:
    """Send the last user message and stream its answer; or, when the last message is the
    assistant's with a question the person answered, resume it and stream the rest."""
    body = await read_json(request, MAX_BODY_BYTES)
    if isinstance(body, Response):
        return body
    try:
        session_id = check_id("session_id", body.get("id"))
        message = _last_message(body)
        multitask = body.get("multitask")
        if multitask is not None and not isinstance(multitask, str):
            raise BadMessage("multitask must be a string")
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except BadMessage as exc:
        return refuse(request, 400, "bad_message", str(exc))
    if message["role"] == "assistant":
        return await _answer_question(request, session_id, message)
    denied = await refused(request, "send", session_id)
    if denied is not None:
        return denied
    try:
        msg_id = check_id("msg_id", message.get("id"))
        text = _user_text(message)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except BadMessage as exc:
        return refuse(request, 400, "bad_message", str(exc))
    client: DialogClient = request.app.state.client
    trace = trace_context(request)
    try:
        with tracing.attached(trace):
            await client.send(session_id, text, msg_id=msg_id, multitask=multitask)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except (redis.exceptions.RedisError, OSError):
        return error(503, "the chat service is unavailable; send the message again")
    return await _stream(request, UIMessageWriter(session_id, msg_id), replay=False)


async def _answer_question(request: Request, session_id: str, message: dict[str, Any]) -> Response:
    """The person's answer to a question (a tool part ``interrupt`` answered with
    `addToolApprovalResponse`: the value is ``approved``; with `addToolOutput`: the output):
    resumed once, then the rest of the answer streams into the same assistant message."""
    denied = await refused(request, "resume", session_id)
    if denied is not None:
        return denied
    msg_id = answered_msg_id(str(message.get("id", "")))
    answered = _answered_question(message)
    if msg_id is None or answered is None:
        return refuse(
            request,
            400,
            "bad_message",
            "the last message is neither a user message nor an answered question",
        )
    interrupt_id, value = answered
    client: DialogClient = request.app.state.client
    try:
        check_id("msg_id", msg_id)
        result = await client.resume(session_id, interrupt_id, value)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except (redis.exceptions.RedisError, OSError):
        return error(503, "the chat service is unavailable; answer again (applied once)")
    if result.status not in ("resumed", "already_resumed"):
        status = 404 if result.status == "unknown" else 409
        return error(status, f"the question cannot be answered: {result.status}")
    writer = UIMessageWriter(session_id, msg_id, silent_until=interrupt_id, answer=value)
    return await _stream(request, writer, replay=False)


@openapi.operation(
    TAG,
    "Resume the answer the chat is writing now (replayed from its start)",
    responses={200: openapi.EVENT_STREAM, 204: None},
)
async def resume_stream(request: Request) -> Response:
    """The answer the session is writing now, replayed from its start (what `useChat` asks
    for on load with ``resume: true``); 204 when it is writing none."""
    denied = await refused(request, "stream")
    if denied is not None:
        return denied
    client: DialogClient = request.app.state.client
    session_id = request.path_params["session_id"]
    try:
        check_id("session_id", session_id)
        msg_id = await message_in_progress(client.redis, client.keys_for(session_id), session_id)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except (redis.exceptions.RedisError, OSError):
        return error(503, "the chat service is unavailable")
    if msg_id is None:
        return Response(status_code=204, headers={"Cache-Control": "no-cache"})
    return await _stream(request, UIMessageWriter(session_id, msg_id), replay=True)


@openapi.operation(
    TAG, "Stop the chat's answer (idempotent)", body=StopIn, responses={200: Stopped}
)
async def stop_answer(request: Request) -> Response:
    """Stop an answer (a stop button: `DialogClient.cancel`): the message named in the body
    (``{"messageId": <user or assistant message id>}``, or the AI SDK's ``{"assistantMessage":
    {...}}``), else the one the session is answering now. The answer's stream then ends with
    the text so far (outcome ``cancelled``). Safe to repeat."""
    denied = await refused(request, "cancel")
    if denied is not None:
        return denied
    client: DialogClient = request.app.state.client
    session_id = request.path_params["session_id"]
    named = None
    if _has_body(request):  # a stop button may post none
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        named = _named_message(body)
    try:
        check_id("session_id", session_id)
        msg_id = named or await message_in_progress(
            client.redis, client.keys_for(session_id), session_id
        )
        if msg_id is None:
            return JSONResponse({"session_id": session_id, "msg_id": None, "status": "none"})
        result = await client.cancel(session_id, msg_id)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except (redis.exceptions.RedisError, OSError):
        return error(503, "the chat service is unavailable; stop again")
    return JSONResponse(result.as_dict())


# -- the body ---------------------------------------------------------------------------------


def _last_message(body: dict[str, Any]) -> dict[str, Any]:
    """The message of a POST: ``message`` (a transport that sends only the last one), else the
    last of ``messages`` (`DefaultChatTransport` sends them all)."""
    message = body.get("message")
    if message is None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadMessage("the body must have messages: a list of UI messages")
        message = messages[-1]
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise BadMessage("the last message must be a user or assistant UI message")
    if not isinstance(message.get("parts"), list):
        raise BadMessage("a UI message has parts: a list")
    return message


def _user_text(message: dict[str, Any]) -> str:
    texts = [
        p["text"]
        for p in message["parts"]
        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    ]
    if not texts or not "".join(texts).strip():
        raise BadMessage("the last user message has no text")
    return "\n".join(texts)


def _answered_question(message: dict[str, Any]) -> tuple[str, Any] | None:
    """The interrupt id and the person's answer in an assistant message's parts, if any."""
    for part in reversed(message["parts"]):
        if not isinstance(part, dict):
            continue
        is_ours = (
            part.get("type") == "dynamic-tool" and part.get("toolName") == INTERRUPT_TOOL
        ) or part.get("type") == f"tool-{INTERRUPT_TOOL}"
        interrupt_id = part.get("toolCallId")
        if not is_ours or not isinstance(interrupt_id, str):
            continue
        if part.get("state") == "approval-responded":
            approval = part.get("approval")
            if isinstance(approval, dict) and isinstance(approval.get("approved"), bool):
                return interrupt_id, approval["approved"]
        elif part.get("state") == "output-available" and "output" in part:
            return interrupt_id, part["output"]
    return None


def _has_body(request: Request) -> bool:
    chunked = "chunked" in request.headers.get("transfer-encoding", "")
    return chunked or request.headers.get("content-length", "0") != "0"


def _named_message(body: dict[str, Any]) -> str | None:
    """The msg_id a stop body names: a user message's id, or an assistant message's."""
    named = body.get("messageId")
    assistant = body.get("assistantMessage")
    if named is None and isinstance(assistant, dict):
        named = assistant.get("id")
    if not isinstance(named, str) or not named:
        return None
    return answered_msg_id(named) or named


# -- the answer -------------------------------------------------------------------------------


async def _stream(request: Request, writer: UIMessageWriter, replay: bool) -> Response:
    """The answer as a UI message stream, through the same bounded channel as the gateway's
    own streams. A replay starts from what is already written, of which only the last attempt
    is shown (the client rebuilds the message from it)."""
    client: DialogClient = request.app.state.client
    events = client.stream(writer.session_id, writer.msg_id, timeout=CONNECTION_MAX_S)
    queue: asyncio.Queue[StreamEvent | BaseException | None] = asyncio.Queue(QUEUE_EVENTS)
    with tracing.attached(trace_context(request)):
        reader = asyncio.create_task(pump(events, queue))
    try:
        backlog = await _backlog(queue) if replay else []
    except BaseException:
        reader.cancel()
        raise
    failed = backlog[-1] if backlog and not isinstance(backlog[-1], StreamEvent) else None
    if isinstance(failed, ValidationError):
        reader.cancel()
        return refuse(request, 400, "bad_input", str(failed))
    if isinstance(failed, (redis.exceptions.RedisError, OSError, ReplyStreamError)):
        reader.cancel()
        return error(503, "the chat service is unavailable")
    shown = _last_attempt([e for e in backlog if isinstance(e, StreamEvent)])

    def render(event: StreamEvent) -> tuple[str, bool]:
        chunks, last = writer.feed(event)
        return _chunks(chunks, last), last

    def ending(failure: BaseException | None) -> str:
        return _chunks(writer.cut(failure), True)

    async def body() -> AsyncIterator[str]:
        yield _chunks(writer.begin(), False)
        if failed is not None or (backlog and backlog[-1] is None):
            for event in shown:
                text, last = render(event)
                yield text
                if last:
                    return
            yield ending(failed)
            return
        async for text in sse(shown, queue, reader, render, ending):
            yield text

    return StreamingResponse(body(), media_type="text/event-stream", headers=HEADERS)


async def _backlog(
    queue: asyncio.Queue[StreamEvent | BaseException | None],
) -> list[StreamEvent | BaseException | None]:
    """What the reader finds already written: events until it is quiet for `BACKLOG_QUIET_S`,
    at most `BACKLOG_EVENTS` or `FIRST_EVENT_WAIT_S`; stops after an end, an error or the
    reader's end (None)."""
    found: list[StreamEvent | BaseException | None] = []
    loop = asyncio.get_running_loop()
    until = loop.time() + FIRST_EVENT_WAIT_S
    while len(found) < BACKLOG_EVENTS and loop.time() < until:
        try:
            item = await asyncio.wait_for(queue.get(), BACKLOG_QUIET_S)
        except TimeoutError:
            break
        found.append(item)
        if not isinstance(item, StreamEvent) or item.kind == "end":
            break
    return found


def _last_attempt(events: list[StreamEvent]) -> list[StreamEvent]:
    """From the last ``reset`` on: earlier attempts were replaced by it."""
    for i in range(len(events) - 1, -1, -1):
        if events[i].kind == "reset":
            return events[i:]
    return events


def _chunks(chunks: list[dict[str, Any]], done: bool) -> str:
    text = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks)
    return text + ("data: [DONE]\n\n" if done else "")
