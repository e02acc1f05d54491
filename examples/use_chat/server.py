"""The backend of the useChat example page: the HTTP gateway (`dialog_worker.gateway`, whose
``/ai-sdk/chat`` routes the page's `useChat` talks to) plus the page, its bundle, and the
endpoint that gives the page a session token for its own session.

    cd examples/use_chat && npm ci && npm run build        # the page: dist/app.js
    PYTHONPATH=examples DIALOG_ENGINE=web_chat_stream:Assistant dialog-worker run &
    python examples/use_chat/server.py                      # http://127.0.0.1:8080/

This server stands for your application's server: it knows its user (here a random id in an
HttpOnly cookie, a stand-in for your login) and hands the page a session token for that
user's session only (`DialogClient.session_token`, a JWT any backend can mint), never the
server token.

- ``DIALOG_HTTP_SIGNING_KEY`` signs the tokens; without it a random key is made at start.
- ``USE_CHAT_TOKEN_TTL_S`` (default 900): how long a page's token lasts (the page fetches a
  new one before it expires).
- ``USE_CHAT_HOST`` / ``USE_CHAT_PORT`` (default 127.0.0.1 / 8080).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from dialog_worker import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.gateway import create_app

HERE = Path(__file__).resolve().parent
BUNDLE = HERE / "dist" / "app.js"
USER_COOKIE = "use_chat_user"
_USER_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
TOKEN_TTL_S = int(os.environ.get("USE_CHAT_TOKEN_TTL_S", "900"))
# What useChat does with its session: send, resume after a reload, stop, answer questions.
PAGE_ACTIONS = ("send", "stream", "cancel", "resume")


async def page(request: Request) -> Response:
    if not BUNDLE.exists():
        return HTMLResponse(
            "<p>Build the page first: <code>cd examples/use_chat && npm ci && npm run build"
            "</code></p>",
            status_code=503,
        )
    return FileResponse(HERE / "index.html", headers={"Cache-Control": "no-cache"})


async def bundle(request: Request) -> Response:
    return FileResponse(BUNDLE, media_type="text/javascript", headers={"Cache-Control": "no-cache"})


async def session_token(request: Request) -> Response:
    """``{"session_id", "token", "expires_at"}`` for this browser's own session (the user
    comes from the cookie, made on the first visit; in your application, from your login)."""
    user = request.cookies.get(USER_COOKIE, "")
    fresh = not _USER_ID.fullmatch(user)
    if fresh:
        user = secrets.token_urlsafe(18)
    session_id = f"chat-{user}"
    client: DialogClient = request.app.state.client
    token = client.session_token(session_id, ttl_s=TOKEN_TTL_S, actions=PAGE_ACTIONS)
    answer = JSONResponse(
        {"session_id": session_id, "token": token, "expires_at": int(time.time()) + TOKEN_TTL_S},
        headers={"Cache-Control": "no-store"},
    )
    if fresh:
        answer.set_cookie(
            USER_COOKIE, user, max_age=365 * 86400, httponly=True, samesite="strict", path="/"
        )
    return answer


def build_app() -> Starlette:
    settings = load_settings()
    settings = dataclasses.replace(
        settings, http_signing_key=settings.http_signing_key or secrets.token_hex(32)
    )
    return create_app(
        settings,
        # The server token opens every session: for your servers only, never the page.
        token=settings.http_token or secrets.token_hex(16),
        extra_routes=[
            Route("/", page),
            Route("/app.js", bundle),
            Route("/session-token", session_token, methods=["POST"]),
        ],
    )


app = build_app()

if __name__ == "__main__":
    uvicorn.run(
        app,
        host=os.environ.get("USE_CHAT_HOST", "127.0.0.1"),
        port=int(os.environ.get("USE_CHAT_PORT", "8080")),
    )
