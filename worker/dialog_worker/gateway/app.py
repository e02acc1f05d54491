"""The gateway's ASGI app (Starlette): the front doors, composed with CORS.

- the gateway's own routes (dialog_worker/gateway/native.py): send, stream an answer, cancel,
  a session's turns, what it waits on, resume;
- the Vercel AI SDK's UI message stream for `useChat` (dialog_worker/gateway/ai_sdk.py);
- the LangGraph Agent Protocol subset under ``/langgraph`` (dialog_worker/gateway/langgraph.py);
- ``/openapi.json``, the document of every route (dialog_worker/gateway/openapi.py);
- what every door shares (dialog_worker/gateway/shared.py): who may call, the checks of
  untrusted input, the plumbing of server-sent events.

Every request carries a token (``Authorization: Bearer <token>``, or ``?access_token=`` for
``EventSource``, which cannot set headers) unless the app was built without auth: the server
token (``DIALOG_HTTP_TOKEN``, for the application's servers: any session), or a session token
minted by the application (dialog_worker/client/session_tokens.py: one session, some actions,
until it expires), or whatever the ``DIALOG_HTTP_AUTHORIZE`` hook lets through. 401 without a
valid one, 403 for a valid session token of another session or action, or with the hook's
reason when it refuses with one. Pages on the origins of
``DIALOG_HTTP_CORS_ORIGINS`` may call it from their own origin. ``GET /metrics``: the requests
it refused, by status and reason (one log line each too).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import redis.exceptions
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.gateway import ai_sdk, langgraph, native, openapi
from dialog_worker.gateway.shared import BODY_SLACK_BYTES, Refusals, load_hook

log = structlog.get_logger("dialog_worker.gateway")


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
        *native.routes(),
        *ai_sdk.routes(),
        Mount("/langgraph", routes=langgraph.routes()),
        Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *(extra_routes or []),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=_cors(settings))
    app.state.token = token
    app.state.settings = settings
    app.state.signing_key = settings.http_signing_key
    app.state.authorize = load_hook(settings.http_authorize) if settings.http_authorize else None
    app.state.max_body = settings.max_message_bytes + BODY_SLACK_BYTES
    app.state.refusals = Refusals()
    return app


@openapi.operation("Gateway", "The gateway's own metrics (Prometheus text), without a token")
async def metrics(request: Request) -> Response:
    """The gateway's own metrics (Prometheus text): the requests it refused, by status and
    reason. No token, like /healthz: no label holds anything a client sent."""
    registry = request.app.state.refusals.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _cors(settings: Settings) -> list[Middleware]:
    origins = [o for o in settings.http_cors_origins.split(",") if o]
    if not origins:
        return []
    # Pages on these origins may call the gateway: preflights are answered, and the answers
    # name the origin. Credentials are tokens in a header, never cookies.
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=[
                "Authorization",
                "x-api-key",  # the LangGraph SDKs' token header
                "Content-Type",
                "Last-Event-ID",
                "traceparent",
                "tracestate",
            ],
            # Where a LangGraph run is (its id) and where to reconnect to it.
            expose_headers=["Content-Location", "Location"],
            allow_credentials=False,
            max_age=600,
        )
    ]
