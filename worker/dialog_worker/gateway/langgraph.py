"""A subset of the LangGraph Agent Protocol under ``/langgraph``: the ``langgraph-sdk`` and
``@langchain/langgraph-sdk`` clients (``get_client(url="<base>/langgraph")``) drive sessions
with their own calls (docs/http.md, "With the LangGraph SDK").

    GET  /info                                        what this server is
    POST /assistants/search, GET /assistants/{id}     the one assistant: the deployment's engine
    POST /threads                                     name a thread (a session): nothing is kept
    GET|DELETE /threads/{thread_id}                   the session; DELETE erases it
    GET  /threads/{thread_id}/state                   its state as the protocol's values
    POST /threads/{thread_id}/history                 the same, as a list (no older states kept)
    POST /threads/{thread_id}/runs[/stream|/wait]     send a message, or answer an interrupt
    GET  /threads/{thread_id}/runs/{run_id}           a run's status
    GET  /threads/{thread_id}/runs/{run_id}/join      wait for its end: the thread's values
    GET  /threads/{thread_id}/runs/{run_id}/stream    its stream again (Last-Event-ID resumes)
    POST /threads/{thread_id}/runs/{run_id}/cancel    cancel it (DialogClient.cancel)

A thread id is a session id and a run id a msg_id. This module has the info, assistant and
thread routes; the runs' are in gateway/langgraph_run_routes.py, who may call what in
gateway/langgraph_access.py, and how a state and an answer read as the protocol's values and
stream parts in gateway/langgraph_runs.py. ``multitask_strategy`` maps
onto the double-texting policies (reject, interrupt, enqueue; rollback is refused: a cancelled
message keeps its turn), ``command.resume`` onto `DialogClient.resume`. The tokens are the
native routes' (Authorization: Bearer, or the SDKs' ``x-api-key``): the server token, or a
session token for the thread's own session.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from dialog_worker.errors import ValidationError
from dialog_worker.gateway import langgraph_models as models
from dialog_worker.gateway import openapi
from dialog_worker.gateway.langgraph_access import (
    REDIS_DOWN,
    TAG,
    Caller,
    body_of,
    client_of,
    credential,
    engine_assistant,
    is_assistant,
    thread_of,
    unavailable,
)
from dialog_worker.gateway.langgraph_run_routes import (
    cancel_run,
    create_run,
    get_run,
    join_run,
    join_run_stream,
    stream_run,
    wait_run,
)
from dialog_worker.gateway.langgraph_runs import Snapshot, snapshot
from dialog_worker.gateway.shared import error, refuse
from dialog_worker.store.codec import check_id
from dialog_worker.version import __version__


@openapi.operation(TAG, "What this server is", responses={200: models.Info})
async def info(request: Request) -> Response:
    caller = await credential(request, None, "stream")
    if isinstance(caller, Response):
        return caller
    flags = {"assistants": True, "crons": False, "store": False, "langsmith": False}
    return JSONResponse({"version": __version__, "flags": flags, "metadata": {}})


@openapi.operation(
    TAG,
    "The one assistant (the deployment's engine), if it matches",
    body=models.AssistantSearch,
    responses={200: list[models.Assistant]},
)
async def search_assistants(request: Request) -> Response:
    caller = await credential(request, None, "stream")
    if isinstance(caller, Response):
        return caller
    query = await body_of(request, models.AssistantSearch)
    if isinstance(query, Response):
        return query
    assistant = engine_assistant(request)
    matches = (
        query.graph_id in (None, assistant["graph_id"])
        and query.name in (None, assistant["name"])
        and not query.metadata
        and query.offset == 0
        and query.limit > 0
    )
    return JSONResponse([assistant] if matches else [])


@openapi.operation(TAG, "The assistant, by its id or graph_id", responses={200: models.Assistant})
async def get_assistant(request: Request) -> Response:
    caller = await credential(request, None, "stream")
    if isinstance(caller, Response):
        return caller
    if not is_assistant(request, request.path_params["assistant_id"]):
        return error(404, "no such assistant: this server has one, its engine's")
    return JSONResponse(engine_assistant(request))


# --- threads -----------------------------------------------------------------------------


@openapi.operation(
    TAG,
    "Name a thread: a session, which exists as soon as it is named (nothing is stored)",
    body=models.ThreadCreate,
    responses={200: models.Thread, 409: None},
)
async def create_thread(request: Request) -> Response:
    body = await body_of(request, models.ThreadCreate)
    if isinstance(body, Response):
        return body
    thread_id = body.thread_id if body.thread_id is not None else str(uuid.uuid4())
    # A session token may name its own session only; minting threads is the server's.
    caller = await credential(request, thread_id, "send")
    if isinstance(caller, Response):
        return caller
    try:
        check_id("thread_id", thread_id)
        found = await snapshot(client_of(request), thread_id)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    except REDIS_DOWN:
        return unavailable()
    exists = found.state is not None or found.last_seq > 0
    if exists and body.thread_id is not None and body.if_exists != "do_nothing":
        return error(409, f"thread {thread_id!r} exists (if_exists: do_nothing returns it)")
    return JSONResponse(found.thread(caller.server))


@openapi.operation(
    TAG, "The thread: its status, values and interrupts", responses={200: models.Thread}
)
async def get_thread(request: Request) -> Response:
    found = await _snapshot(request, "events")
    if isinstance(found, Response):
        return found
    view, caller = found
    return JSONResponse(view.thread(caller.server))


@openapi.operation(
    TAG,
    "Erase the thread's session (DialogClient.delete): server token only",
    responses={204: None},
)
async def delete_thread(request: Request) -> Response:
    checked = await thread_of(request, "delete")
    if isinstance(checked, Response):
        return checked
    thread_id, _ = checked
    try:
        await client_of(request).delete(thread_id, who="gateway", reason="DELETE langgraph thread")
    except REDIS_DOWN:
        return unavailable()
    return Response(status_code=204)


@openapi.operation(TAG, "The thread's current state", responses={200: models.ThreadState})
async def thread_state(request: Request) -> Response:
    found = await _snapshot(request, "events")
    if isinstance(found, Response):
        return found
    view, caller = found
    return JSONResponse(view.thread_state(caller.server))


@openapi.operation(
    TAG,
    "The thread's states, newest first: only the current one is kept",
    body=models.HistoryRequest,
    responses={200: list[models.ThreadState]},
)
async def thread_history(request: Request) -> Response:
    query = await body_of(request, models.HistoryRequest)
    if isinstance(query, Response):
        return query
    found = await _snapshot(request, "events")
    if isinstance(found, Response):
        return found
    view, caller = found
    # Nothing older than the current state is kept, and it carries no metadata to filter on.
    none_older = query.before is not None or query.checkpoint or query.metadata
    if view.state is None or query.limit == 0 or none_older:
        return JSONResponse([])
    return JSONResponse([view.thread_state(caller.server)])


async def _snapshot(request: Request, action: str) -> tuple[Snapshot, Caller] | Response:
    checked = await thread_of(request, action)
    if isinstance(checked, Response):
        return checked
    thread_id, caller = checked
    try:
        return await snapshot(client_of(request), thread_id), caller
    except REDIS_DOWN:
        return unavailable()


def routes() -> list[BaseRoute]:
    """The protocol's routes, to mount under ``/langgraph``."""
    thread = "/threads/{thread_id}"
    run = thread + "/runs/{run_id}"
    return [
        Route("/info", info, methods=["GET"]),
        Route("/assistants/search", search_assistants, methods=["POST"]),
        Route("/assistants/{assistant_id}", get_assistant, methods=["GET"]),
        Route("/threads", create_thread, methods=["POST"]),
        Route(thread, get_thread, methods=["GET"]),
        Route(thread, delete_thread, methods=["DELETE"]),
        Route(thread + "/state", thread_state, methods=["GET"]),
        Route(thread + "/history", thread_history, methods=["POST"]),
        Route(thread + "/runs", create_run, methods=["POST"]),
        Route(thread + "/runs/stream", stream_run, methods=["POST"]),
        Route(thread + "/runs/wait", wait_run, methods=["POST"]),
        Route(run, get_run, methods=["GET"]),
        Route(run + "/join", join_run, methods=["GET"]),
        Route(run + "/stream", join_run_stream, methods=["GET"]),
        Route(run + "/cancel", cancel_run, methods=["POST"]),
    ]
