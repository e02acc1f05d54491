"""The LangGraph protocol's runs (gateway/langgraph.py mounts them): starting one (a message
sent, or an interrupt answered), and the routes of a run (status, join, its stream again,
cancel). How an answer reads as a run's parts: gateway/langgraph_runs.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.interrupts import ALREADY_RESUMED, RESUMED
from dialog_worker.client.partial_reader import parse_cursor
from dialog_worker.errors import ValidationError
from dialog_worker.gateway import langgraph_models as models
from dialog_worker.gateway import openapi
from dialog_worker.gateway.langgraph_access import (
    REDIS_DOWN,
    SERVER,
    TAG,
    Caller,
    body_of,
    client_of,
    credential,
    is_assistant,
    thread_of,
    unavailable,
)
from dialog_worker.gateway.langgraph_runs import RUN_STATUS, Frame, RunStream, snapshot
from dialog_worker.gateway.shared import (
    CONNECTION_MAX_S,
    HEARTBEAT_S,
    QUEUE_EVENTS,
    SSE_HEADERS,
    error,
    pump,
    refuse,
    sse,
)
from dialog_worker.store.codec import check_id

log = structlog.get_logger("dialog_worker.gateway.langgraph")

# How long a run id nobody here sent is looked for (its message may wait unread in the
# inbound stream, sent through another gateway) before it is answered 404.
RUN_LOOKUP_S = 2.0
RUN_LOOKUP_STEP_S = 0.1
# Run ids this process sent lately (found at once, before a worker reads them).
RECENT_RUNS = 4096
# How long GET of a run looks at its answer to tell running from finished.
STATUS_PROBE_S = 0.3


# --- runs: starting one ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Started:
    """A run this request started: a message sent (``human`` its text), or an interrupt
    answered (``resumed`` its id; the run is the waiting message's)."""

    thread_id: str
    run_id: str
    caller: Caller
    modes: frozenset[str]
    body: models.RunCreate
    human: str | None = None
    resumed: str | None = None

    def stream(self, client: DialogClient) -> RunStream:
        return RunStream(
            client,
            self.thread_id,
            self.run_id,
            self.modes,
            self.caller.server,
            human=self.human,
            resumed=self.resumed,
        )

    def run(self, status: str = "pending") -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "thread_id": self.thread_id,
            "assistant_id": self.body.assistant_id,
            "created_at": None,
            "updated_at": None,
            "status": status,
            "metadata": self.body.metadata or {},
            "multitask_strategy": self.body.multitask_strategy,
        }

    def headers(self, tail: str) -> dict[str, str]:
        """Where the run is, relative to the protocol's base URL (the SDKs join it to theirs):
        Content-Location names the run, Location where to reconnect."""
        run = f"/threads/{_quoted(self.thread_id)}/runs/{_quoted(self.run_id)}"
        headers = {"Content-Location": run}
        if tail:
            headers["Location"] = f"{run}/{tail}"
        return headers


def _quoted(value: str) -> str:
    return urllib.parse.quote(value, safe="")


# Fields a run may carry that this gateway cannot honour: refused rather than ignored.
UNSUPPORTED = {
    "checkpoint": "checkpoints by id are not kept (a session keeps its current state only)",
    "checkpoint_id": "checkpoints by id are not kept (a session keeps its current state only)",
    "interrupt_before": "node breakpoints do not exist here: the engine interrupts itself",
    "interrupt_after": "node breakpoints do not exist here: the engine interrupts itself",
    "webhook": "webhooks are not called: read the reply stream (DialogClient.replies)",
}


def _unsupported(body: models.RunCreate) -> str | None:
    for name, why in UNSUPPORTED.items():
        if getattr(body, name) not in (None, [], {}):
            return f"{name} is not supported: {why}"
    if body.multitask_strategy == "rollback":
        return (
            "multitask_strategy rollback is not supported: a cancelled message keeps its turn "
            "in the session's history (use interrupt, which cancels the running run)"
        )
    command = body.command
    if command is not None and (command.goto is not None or command.update is not None):
        return "command supports resume only (goto and update are not supported)"
    if command is not None and body.input is not None:
        return "give input or command.resume, not both"
    if command is None and body.input is None:
        return 'a run needs input ({"messages": [one user message]}) or command.resume'
    return None


def user_message(run_input: dict[str, Any]) -> tuple[str, str | None]:
    """The text (and id, when it has one) of the one user message of a run's input: a
    message dict (``role`` or ``type``; ``content`` a string or text blocks), a
    ``[role, content]`` pair, or a bare string."""
    extra = sorted(set(run_input) - {"messages"})
    if extra:
        raise ValidationError(f"input may hold messages only, not {', '.join(extra)}")
    messages = run_input.get("messages")
    if isinstance(messages, dict | str):
        messages = [messages]
    if not isinstance(messages, list) or len(messages) != 1:
        raise ValidationError(
            "input.messages must hold one user message (the thread keeps the conversation)"
        )
    message = messages[0]
    role: object
    content: object
    message_id: object
    if isinstance(message, str):
        role, content, message_id = "user", message, None
    elif isinstance(message, list) and len(message) == 2:
        role, content, message_id = message[0], message[1], None
    elif isinstance(message, dict):
        role = message.get("role", message.get("type"))
        content, message_id = message.get("content"), message.get("id")
    else:
        raise ValidationError("input.messages[0] must be a message")
    if role not in ("user", "human"):
        raise ValidationError(f"input.messages[0] must be a user message, not {role!r}")
    if message_id is not None:
        return _text(content), check_id("input.messages[0].id", message_id)
    return _text(content), None


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in content
    ):
        return "".join(b["text"] for b in content)
    raise ValidationError("a message's content must be text (a string or text blocks)")


def _meta(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    if not metadata:
        return None
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ValidationError("metadata values must be strings (they reach the engine as meta)")
    return dict(metadata)


async def _start(request: Request, action_for_stream: str | None) -> Started | Response:
    """Checks a run's request, then sends its message or answers the thread's interrupt.
    ``action_for_stream``: what else the caller's session token must allow (``stream``)."""
    body = await body_of(request, models.RunCreate)
    if isinstance(body, Response):
        return body
    action = "resume" if body.command is not None else "send"
    checked = await thread_of(request, action)
    if isinstance(checked, Response):
        return checked
    thread_id, caller = checked
    if action_for_stream is not None and caller is not SERVER:
        also = await credential(request, thread_id, action_for_stream)
        if isinstance(also, Response):
            return also
    if not is_assistant(request, body.assistant_id):
        return error(404, f"no such assistant {body.assistant_id!r}: see /assistants/search")
    problem = _unsupported(body)
    if problem is not None:
        return refuse(request, 400, "bad_input", problem)
    modes = body.stream_mode if isinstance(body.stream_mode, list) else [body.stream_mode]
    client = client_of(request)
    try:
        if body.command is not None:
            return await _resume(client, thread_id, caller, frozenset(modes), body)
        return await _send(request, client, thread_id, caller, frozenset(modes), body)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))


async def _send(
    request: Request,
    client: DialogClient,
    thread_id: str,
    caller: Caller,
    modes: frozenset[str],
    body: models.RunCreate,
) -> Started | Response:
    assert body.input is not None
    text, message_id = user_message(body.input)
    meta = _meta(body.metadata)
    run_id = message_id if message_id is not None else uuid.uuid4().hex
    deliver_at = time.time() + body.after_seconds if body.after_seconds else None
    try:
        if body.multitask_strategy == "reject" and await _busy(client, thread_id):
            # As the protocol's servers answer at once; a run that races another one in is
            # still rejected by the workers (its stream then ends with an error part).
            return error(409, "the thread is busy: its run was rejected (multitask_strategy)")
        await client.send(
            thread_id,
            text,
            msg_id=run_id,
            meta=meta,
            multitask=body.multitask_strategy,
            deliver_at=deliver_at,
        )
    except REDIS_DOWN:
        return unavailable(run_id=run_id)
    _remember(request, thread_id, run_id)
    return Started(thread_id, run_id, caller, modes, body, human=text)


async def _resume(
    client: DialogClient,
    thread_id: str,
    caller: Caller,
    modes: frozenset[str],
    body: models.RunCreate,
) -> Started | Response:
    assert body.command is not None
    try:
        pending = await client.pending(thread_id)
        if not pending:
            return error(409, "the thread waits on no interrupt: nothing to resume")
        waiting = pending[0]
        value = body.command.resume
        if isinstance(value, dict) and waiting.interrupt_id in value:
            value = value[waiting.interrupt_id]  # the protocol's {interrupt_id: value} form
        result = await client.resume(thread_id, waiting.interrupt_id, value)
    except REDIS_DOWN:
        return unavailable()
    if result.status not in (RESUMED, ALREADY_RESUMED):
        return error(409, f"the interrupt ended without this answer: {result.status}")
    return Started(thread_id, waiting.msg_id, caller, modes, body, resumed=waiting.interrupt_id)


async def _busy(client: DialogClient, thread_id: str) -> bool:
    return (await snapshot(client, thread_id)).status != "idle"


def _remember(request: Request, thread_id: str, run_id: str) -> None:
    recent: dict[tuple[str, str], None] | None = getattr(request.app.state, "langgraph_runs", None)
    if recent is None:
        recent = request.app.state.langgraph_runs = {}
    recent[(thread_id, run_id)] = None
    if len(recent) > RECENT_RUNS:
        del recent[next(iter(recent))]


# --- runs: the routes that start one -----------------------------------------------------


@openapi.operation(
    TAG,
    "Send a message (or answer the interrupt) and stream the run as server-sent events",
    body=models.RunCreate,
    responses={200: "text/event-stream", 409: None},
)
async def stream_run(request: Request) -> Response:
    started = await _start(request, "stream")
    if isinstance(started, Response):
        return started
    client = client_of(request)
    events = client.stream(started.thread_id, started.run_id, timeout=CONNECTION_MAX_S)
    frames = started.stream(client).frames(events, opening=True)
    abandon = None
    if started.body.on_disconnect == "cancel":
        abandon = _canceller(client, started.thread_id, started.run_id)
    return _sse_response(frames, started.headers("stream"), abandon)


@openapi.operation(
    TAG,
    "Send a message (or answer the interrupt) and wait for the run's end: the thread's values",
    body=models.RunCreate,
    responses={200: models.RunValues, 409: None},
)
async def wait_run(request: Request) -> Response:
    started = await _start(request, "stream")
    if isinstance(started, Response):
        return started
    client = client_of(request)
    return _json_when_done(_final_values(started.stream(client), client), started.headers("join"))


@openapi.operation(
    TAG,
    "Send a message (or answer the interrupt); the run goes on in the background",
    body=models.RunCreate,
    responses={200: models.Run, 409: None},
)
async def create_run(request: Request) -> Response:
    started = await _start(request, None)
    if isinstance(started, Response):
        return started
    return JSONResponse(started.run(), headers=started.headers(""))


# --- runs: the routes of a run -----------------------------------------------------------


async def _known_run(request: Request, action: str) -> tuple[str, str, Caller] | Response:
    """The path's thread and run, checked: a run id no message of the thread has (sent here
    lately, sequenced, or with an answer kept) is a 404 after `RUN_LOOKUP_S`."""
    checked = await thread_of(request, action)
    if isinstance(checked, Response):
        return checked
    thread_id, caller = checked
    run_id = request.path_params["run_id"]
    try:
        check_id("run_id", run_id)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    recent = getattr(request.app.state, "langgraph_runs", {})
    if (thread_id, run_id) in recent:
        return thread_id, run_id, caller
    client = client_of(request)
    session = client.keys_for(thread_id).session(thread_id)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + RUN_LOOKUP_S
    try:
        while not await client.redis.exists(session.dedupe(run_id), session.partial(run_id)):
            if loop.time() >= give_up:
                return error(404, f"thread {thread_id!r} has no run {run_id!r}")
            await asyncio.sleep(RUN_LOOKUP_STEP_S)
    except REDIS_DOWN:
        return unavailable()
    return thread_id, run_id, caller


def _run(thread_id: str, run_id: str, status: str) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "thread_id": thread_id,
        "assistant_id": None,
        "created_at": None,
        "updated_at": None,
        "status": status,
        "metadata": {},
        "multitask_strategy": None,
    }


@openapi.operation(
    TAG, "The run: pending, running, interrupted or how it ended", responses={200: models.Run}
)
async def get_run(request: Request) -> Response:
    known = await _known_run(request, "stream")
    if isinstance(known, Response):
        return known
    thread_id, run_id, _ = known
    client = client_of(request)
    try:
        status = await _run_status(client, thread_id, run_id)
    except REDIS_DOWN:
        return unavailable()
    return JSONResponse(_run(thread_id, run_id, status))


async def _run_status(client: DialogClient, thread_id: str, run_id: str) -> str:
    if any(p.msg_id == run_id for p in await client.pending(thread_id)):
        return "interrupted"
    events = client.stream(thread_id, run_id)
    status = "pending"
    try:
        with anyio.move_on_after(STATUS_PROBE_S):
            async for event in events:
                if event.kind == "end":
                    return RUN_STATUS.get(event.outcome or "applied", "error")
                status = "running"
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
    return status


@openapi.operation(
    TAG, "Wait for the run's end: the thread's values after it", responses={200: models.RunValues}
)
async def join_run(request: Request) -> Response:
    known = await _known_run(request, "stream")
    if isinstance(known, Response):
        return known
    thread_id, run_id, caller = known
    client = client_of(request)
    run = RunStream(client, thread_id, run_id, frozenset({"values"}), caller.server)
    return _json_when_done(_final_values(run, client), {})


@openapi.operation(
    TAG,
    "The run's stream again, from its start or from Last-Event-ID",
    responses={200: "text/event-stream"},
)
async def join_run_stream(request: Request) -> Response:
    known = await _known_run(request, "stream")
    if isinstance(known, Response):
        return known
    thread_id, run_id, caller = known
    modes = set(request.query_params.getlist("stream_mode")) - {""} or {"values"}
    unknown = modes - set(models.STREAM_MODES)
    if unknown:
        return error(
            400,
            f"stream_mode {', '.join(sorted(unknown))} is not supported "
            f"(supported: {', '.join(models.STREAM_MODES)})",
        )
    raw_after = request.headers.get("last-event-id") or None
    after = None if raw_after in (None, "-1", "0") else raw_after  # "-1": from the start
    try:
        if after is not None:
            parse_cursor(after, run_id)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    client = client_of(request)
    run = RunStream(client, thread_id, run_id, frozenset(modes), caller.server)
    events = client.stream(thread_id, run_id, after=after, timeout=CONNECTION_MAX_S)
    abandon = None
    if request.query_params.get("cancel_on_disconnect", "").lower() in ("1", "true"):
        abandon = _canceller(client, thread_id, run_id)
    return _sse_response(run.frames(events, opening=after is None), {}, abandon)


@openapi.operation(
    TAG,
    "Cancel the run (DialogClient.cancel); ?wait=1 answers once it ended",
    responses={202: None, 204: None},
)
async def cancel_run(request: Request) -> Response:
    action = request.query_params.get("action", "interrupt")
    if action != "interrupt":
        return error(
            400,
            f"action {action!r} is not supported: a cancelled message keeps its turn in the "
            "session's history (use interrupt)",
        )
    known = await _known_run(request, "cancel")
    if isinstance(known, Response):
        return known
    thread_id, run_id, caller = known
    client = client_of(request)
    try:
        await client.cancel(thread_id, run_id)
    except REDIS_DOWN:
        return unavailable(run_id=run_id)
    if request.query_params.get("wait", "0").lower() not in ("1", "true"):
        return Response(status_code=202)
    run = RunStream(client, thread_id, run_id, frozenset(), caller.server)
    with contextlib.suppress(*REDIS_DOWN, TimeoutError):
        await _final_values(run, client)
    return Response(status_code=204)


# --- answers that take a while ------------------------------------------------------------


async def _final_values(run: RunStream, client: DialogClient) -> dict[str, Any]:
    """Follows the run to its end (or its interrupt): the thread's values then."""
    events = client.stream(run.thread_id, run.run_id, timeout=CONNECTION_MAX_S)
    try:
        async for _ in run.frames(events, opening=False):
            pass
    except TimeoutError:
        pass
    values = dict(run.values or {})
    if run.status is None:
        values["__error__"] = {
            "error": "Timeout",
            "message": f"the run has not ended after {CONNECTION_MAX_S:.0f} s: join it again",
        }
    return values


def _json_when_done(values: Awaitable[dict[str, Any]], headers: dict[str, str]) -> Response:
    """A JSON answer that may take minutes: a newline every `HEARTBEAT_S` keeps proxies from
    closing the connection meanwhile (JSON allows leading whitespace), then the document."""

    async def body() -> AsyncIterator[str]:
        task = asyncio.ensure_future(values)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_S)
                if done:
                    break
                yield "\n"
            try:
                result = task.result()
            except REDIS_DOWN:
                result = {"__error__": {"error": "Unavailable", "message": "join it again"}}
            yield json.dumps(result, ensure_ascii=False)
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    return StreamingResponse(body(), media_type="application/json", headers=headers)


def _canceller(client: DialogClient, thread_id: str, run_id: str) -> Callable[[], Awaitable[Any]]:
    async def cancel() -> None:
        try:
            await client.cancel(thread_id, run_id)
        except REDIS_DOWN as exc:
            log.warning("langgraph_disconnect_cancel_failed", error=str(exc))

    return cancel


def _sse_response(
    frames: AsyncIterator[Frame],
    headers: dict[str, str],
    abandon: Callable[[], Awaitable[Any]] | None,
) -> Response:
    return StreamingResponse(
        _sse(frames, abandon),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **headers},
    )


def _render(frame: Frame) -> tuple[str, bool]:
    return frame.sse(), frame.event in ("end", "error")


async def _sse(
    frames: AsyncIterator[Frame], abandon: Callable[[], Awaitable[Any]] | None
) -> AsyncIterator[str]:
    """The run's parts as server-sent events (the gateway's SSE plumbing: at most
    `QUEUE_EVENTS` parts wait for a slow client, a comment line every `HEARTBEAT_S` of
    silence). ``abandon`` runs when the client goes away before the stream ended by itself
    (``on_disconnect: cancel``)."""
    queue: asyncio.Queue[Frame | BaseException | None] = asyncio.Queue(QUEUE_EVENTS)
    reader = asyncio.create_task(pump(frames, queue))
    finished = False
    try:
        async for text in sse([], queue, reader, _render):
            yield text
        # The run ended here, or this connection's time is up (the SDKs reconnect from their
        # Last-Event-ID), or Redis is away.
        finished = True
    finally:
        if not finished and abandon is not None:
            with anyio.CancelScope(shield=True):
                await abandon()
