"""What every front door of the gateway shares: who may call (the server token, session
tokens, the ``DIALOG_HTTP_AUTHORIZE`` hook), the checks of untrusted input (the raw path, the
body), refusals, and the plumbing of a server-sent event stream (a bounded channel between the
reader of an answer and a slow browser, heartbeats, the reconnect delay).

A front door (dialog_worker/gateway/native.py, and the protocol modules beside it) is a list of
routes whose handlers start with `refused` and read their body with `read_json`; app.py
composes them with CORS.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import inspect
import json
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import structlog
from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request
from starlette.responses import JSONResponse

from dialog_worker import tracing
from dialog_worker.client import session_tokens
from dialog_worker.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context

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
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx and others would hold the last event otherwise
    "Connection": "keep-alive",
}

Item = TypeVar("Item")

log = structlog.get_logger("dialog_worker.gateway")


class Refusals:
    """Requests the gateway refused (``401``, ``403``, ``400``, ``413``; docs/operations.md,
    "The gateway's refusals"), counted by status and reason (a word from a fixed list: never a
    token, a session id or anything else a client sent), each also one log line without
    secrets."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.counter = Counter(
            "dialog_gateway_refusals",
            "Requests the gateway refused, by HTTP status and reason",
            ["status", "reason"],
            registry=self.registry,
        )

    def count(self, request: Request, status: int, reason: str) -> None:
        self.counter.labels(str(status), reason).inc()
        endpoint = request.scope.get("endpoint")
        log.info(
            "gateway_refused",
            status=status,
            reason=reason,
            method=request.method,
            route=getattr(endpoint, "__name__", "?"),
        )


def refuse(request: Request, status: int, reason: str, message: str, **extra: Any) -> JSONResponse:
    """A refusal (4xx) of this request: ``{"error": message}``, counted and logged by
    ``reason`` (the message, which may quote what the client sent, is not logged)."""
    refusals: Refusals | None = getattr(request.app.state, "refusals", None)
    if refusals is not None:
        refusals.count(request, status, reason)
    return error(status, message, **extra)


def load_hook(spec: str) -> Callable[..., Any]:
    """``package.module:function`` (DIALOG_HTTP_AUTHORIZE): called as ``function(request,
    session_id, action)`` when a request carries neither the server token nor a session token
    that allows it (`ask_hook`)."""
    module_name, _, name = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("DIALOG_HTTP_AUTHORIZE", f"cannot load {spec!r}: {exc}") from None
    if not callable(hook):
        raise ConfigError("DIALOG_HTTP_AUTHORIZE", f"{spec!r} is not callable")
    return cast(Callable[..., Any], hook)


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def given_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.query_params.get("access_token", "")


async def refused(
    request: Request, action: str, session_id: str | None = None
) -> JSONResponse | None:
    """None when the request may do ``action`` (one of session_tokens.ACTIONS) on the
    session (the path's, unless the body named it: ``session_id``): the server token (any
    session), a session token for this session and action, or the ``authorize`` hook's yes.
    Else 403 with the hook's reason when it gave one, or 401 (no valid credential) or 403 (a
    valid session token for another session or action), saying which."""
    state = request.app.state
    if state.token is None:
        return undecodable(request)  # built without auth (a loopback listener)
    given = given_token(request)
    if state.token and given and hmac.compare_digest(given.encode(), state.token.encode()):
        return undecodable(request)
    if session_id is None:
        session_id = request.path_params.get("session_id", "")
    refusal = session_tokens.TokenRefused(
        401,
        "missing or wrong token (Authorization: Bearer <token>)",
        "wrong_token" if given else "missing_token",
    )
    if state.signing_key and session_tokens.looks_like_one(given):
        try:
            grant = session_tokens.verify(state.signing_key, given)
            session_tokens.check(grant, session_id, action)
            return undecodable(request)
        except session_tokens.TokenRefused as exc:
            refusal = exc
    try:
        verdict = await ask_hook(request, session_id, action)
    except HookFailed:
        return hook_failed()
    if verdict is True:
        return undecodable(request)
    if verdict is not None:
        return refuse(request, 403, "authorize_refused", verdict)
    return refuse(request, refusal.status, refusal.code, refusal.reason)


class HookFailed(Exception):
    """The ``DIALOG_HTTP_AUTHORIZE`` hook raised: the request is refused with `hook_failed`."""


def hook_failed() -> JSONResponse:
    """The answer to a request whose authorize hook raised: 503 (fail closed; try again)."""
    return error(503, "authorization is unavailable (the application's authorize hook failed)")


async def ask_hook(request: Request, session_id: str, action: str) -> Literal[True] | str | None:
    """What the ``DIALOG_HTTP_AUTHORIZE`` hook says of a request no token lets through: True
    (only True, or an awaitable of it: a hook that returns a reason, or anything truthy by
    mistake, must not open a conversation), a reason to refuse it with (its string: a 403
    that says so, never logged), or None (no hook, or any other answer: the gateway's own
    refusal stands)."""
    hook = request.app.state.authorize
    if hook is None:
        return None
    try:
        verdict = hook(request, session_id, action)
        if inspect.isawaitable(verdict):
            verdict = await verdict
    except Exception as exc:
        # The application's own code failed (its session store down...): fail closed. Its
        # message may hold what the hook knew (a URL with a password, a user's id): only the
        # exception's type is logged.
        log.error(
            "authorize_hook_failed",
            error_type=type(exc).__name__,
            method=request.method,
            route=getattr(request.scope.get("endpoint"), "__name__", "?"),
        )
        raise HookFailed from None
    if verdict is True:
        return True
    if isinstance(verdict, str):
        return verdict or "refused by the application"
    return None


def trace_context(request: Request) -> Context | None:
    """The trace a request continues: its ``traceparent`` / ``tracestate`` headers, else the
    same names in its query (an ``EventSource`` cannot set headers: a page passes the trace of
    its message there, so the answer's stream joins the message's trace)."""
    return tracing.from_headers(request.headers) or tracing.from_headers(request.query_params)


def undecodable(request: Request) -> JSONResponse | None:
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
            return refuse(
                request, 400, "path_not_utf8", "the path must be UTF-8 once percent-decoded"
            )
    return None


async def read_json(request: Request, limit: int | None = None) -> dict[str, Any] | JSONResponse:
    """The body as a JSON object, or the 4xx that refuses it: larger than ``limit`` (the app's
    unless given; declared or counted as it arrives: a chunked body has no Content-Length),
    not JSON (nested deeper than the parser's stack included), not an object."""
    if limit is None:
        limit = cast(int, request.app.state.max_body)
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return refuse(request, 413, "body_too_large", f"the body must be at most {limit} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            return refuse(request, 413, "body_too_large", f"the body must be at most {limit} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: nesting deeper than the parser's stack (a body of "[[[[...").
        return refuse(request, 400, "body_not_json", "the body must be JSON")
    if not isinstance(body, dict):
        return refuse(request, 400, "body_not_json", "the body must be a JSON object")
    return body


async def pump(
    events: AsyncIterator[Item], queue: asyncio.Queue[Item | BaseException | None]
) -> None:
    """Reads an answer into the connection's bounded queue; ends it with None (the end) or
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


async def sse(
    first: list[Item],
    queue: asyncio.Queue[Item | BaseException | None],
    reader: asyncio.Task[None],
    render: Callable[[Item], tuple[str, bool]],
    ending: Callable[[BaseException | None], str] | None = None,
) -> AsyncIterator[str]:
    """The body of an event stream: the ``retry:`` line, ``first`` and then what the reader
    puts in ``queue``, each as ``render`` writes it (its text, and whether it was the last),
    a comment line every `HEARTBEAT_S` while nothing comes. It stops after the last event, or
    when the reader stops (an error, or the connection's time is up: the browser reconnects
    from its cursor), then writes ``ending(error or None)`` if given. The reader is cancelled
    on the way out, also when the browser leaves."""
    try:
        yield f"retry: {RETRY_MS}\n\n"
        pending = first
        while True:
            for event in pending:
                text, last = render(event)
                if text:
                    yield text
                if last:
                    return
            try:
                item = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
            except TimeoutError:
                yield ": keep-alive\n\n"
                pending = []
                continue
            if item is None or isinstance(item, BaseException):
                if ending is not None:
                    yield ending(item)
                return
            pending = [item]
    finally:
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader
