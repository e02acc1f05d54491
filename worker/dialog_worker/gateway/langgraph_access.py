"""Who may call the LangGraph routes (gateway/langgraph.py, gateway/langgraph_run_routes.py),
and what each of them reads first: the path's thread, the body as its model, the deployment's
one assistant."""

from __future__ import annotations

import dataclasses
import hmac
import uuid
from typing import Any

import pydantic
import redis.exceptions
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dialog_worker.client import session_tokens
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.errors import ReplyStreamError, ValidationError
from dialog_worker.gateway.shared import (
    HookFailed,
    ask_hook,
    error,
    given_token,
    hook_failed,
    read_json,
    refuse,
    undecodable,
)
from dialog_worker.store.codec import check_id

REDIS_DOWN = (redis.exceptions.RedisError, OSError, ReplyStreamError)
TAG = "LangGraph"


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """A request's credential: the server token (or a gateway without auth) sees everything,
    including the engine's memory, and may erase threads; a session token (or the authorize
    hook's yes) acts on its own session only."""

    server: bool


SERVER = Caller(server=True)
SESSION = Caller(server=False)


def _given_token(request: Request) -> str:
    # The SDKs send their api_key / apiKey (and LANGGRAPH_API_KEY) as x-api-key.
    return given_token(request) or request.headers.get("x-api-key", "")


async def credential(request: Request, thread_id: str | None, action: str) -> Caller | Response:
    """The request's credential for ``action`` on ``thread_id`` (None: a route of no thread,
    which any valid token may call), or its refusal: 401 without a valid credential, 403 for
    a session token of another session or action, or with the authorize hook's reason."""
    bad_path = undecodable(request)
    if bad_path is not None:
        return bad_path
    state = request.app.state
    if state.token is None:
        return SERVER  # built without auth (a loopback listener)
    given = _given_token(request)
    if state.token and given and hmac.compare_digest(given.encode(), state.token.encode()):
        return SERVER
    refusal = session_tokens.TokenRefused(
        401,
        "missing or wrong token (Authorization: Bearer <token>, or x-api-key)",
        "wrong_token" if given else "missing_token",
    )
    if state.signing_key and "." in given:  # a session token's parts are dot-separated
        try:
            grant = session_tokens.verify(state.signing_key, given)
            if thread_id is not None:
                if action == "delete":
                    raise session_tokens.TokenRefused(
                        403, "erasing a thread takes the server token"
                    )
                session_tokens.check(grant, thread_id, action)
            return SESSION
        except session_tokens.TokenRefused as exc:
            refusal = exc
    try:
        verdict = await ask_hook(request, thread_id or "", action)
    except HookFailed:
        return hook_failed()
    if verdict is True:
        return SESSION
    if verdict is not None:
        return refuse(request, 403, "authorize_refused", verdict)
    return refuse(request, refusal.status, refusal.code, refusal.reason)


async def thread_of(request: Request, action: str) -> tuple[str, Caller] | Response:
    """The path's thread id, checked, and the caller's credential for ``action`` on it."""
    thread_id = request.path_params["thread_id"]
    caller = await credential(request, thread_id, action)
    if isinstance(caller, Response):
        return caller
    try:
        check_id("thread_id", thread_id)
    except ValidationError as exc:
        return refuse(request, 400, "bad_input", str(exc))
    return thread_id, caller


def client_of(request: Request) -> DialogClient:
    client: DialogClient = request.app.state.client
    return client


def unavailable(**extra: Any) -> JSONResponse:
    return error(503, "the chat service is unavailable", **extra)


async def body_of(request: Request, model: type[pydantic.BaseModel]) -> Any:
    """The JSON body as ``model``, or a 400/413 naming what is wrong (never a 422)."""
    raw = await read_json(request)
    if isinstance(raw, Response):
        return raw
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return refuse(request, 400, "bad_input", problems)


def engine_assistant(request: Request) -> dict[str, Any]:
    """The one assistant: the deployment's engine (DIALOG_ENGINE, else the built-in rules),
    under a stable id made from its name."""
    graph_id = request.app.state.settings.engine or "rules"
    return {
        "assistant_id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"dialog-worker:{graph_id}")),
        "graph_id": graph_id,
        "name": graph_id,
        "description": "the deployment's dialog engine",
        "config": {},
        "context": {},
        "metadata": {},
        "version": 1,
        "created_at": None,
        "updated_at": None,
    }


def is_assistant(request: Request, assistant_id: str) -> bool:
    known = engine_assistant(request)
    return assistant_id in (known["assistant_id"], known["graph_id"])
