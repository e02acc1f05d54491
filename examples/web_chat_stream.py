"""A chat page whose answers appear as they are written: the HTTP gateway
(`dialog_worker.gateway`) plus one page (``GET /``) and the endpoint that hands the page its
session token (``POST /session-token``).

    PYTHONPATH=examples DIALOG_ENGINE=web_chat_stream:Typist dialog-worker run &
    python examples/web_chat_stream.py                              # http://127.0.0.1:8080/

`Typist` is a demo engine that writes its answer word by word; examples/llm_engine.py streams
a real model's answer the same way.

This server stands for your application's server: it knows who its user is and gives the
page a **session token** for that user's session only (`DialogClient.session_token`), never
the server token. Here the "user" is a random id in an HttpOnly cookie (a stand-in for your
login): each browser gets a conversation of its own, and a token that opens nothing else.
The gateway checks every request of the page against that token (docs/http.md, "Putting a
bot on a public page").

- ``DIALOG_HTTP_SIGNING_KEY`` signs the tokens; without it a random key is made at start
  (tokens then end with the process: the page fetches a new one by itself).
- ``DIALOG_HTTP_TOKEN``, the server token, opens every session for your servers; without it a
  random one is made and never shown.
- ``WEB_CHAT_TOKEN_TTL_S`` (default 900): how long a page's token lasts; the page fetches a new
  one before it expires, and again after a refusal.
- ``WEB_CHAT_HOST`` / ``WEB_CHAT_PORT`` (default 127.0.0.1 / 8080).

The page (web_chat_stream.html) follows the session's turns (``GET /sessions/{id}/events``):
on load it shows the conversation the session keeps, and later it shows what the server
starts too (a timer's nudge, a message delivered later, an operator's redrive). It follows
each of its own answers as it is written (``GET .../messages/{msg_id}/stream``), also across
a reload, and its Stop button cancels the answer being written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from dialog_worker import DialogClient, emit
from dialog_worker.config import load_settings
from dialog_worker.gateway import create_app

# The page: one file next to this one, served as it is.
PAGE = (Path(__file__).resolve().parent / "web_chat_stream.html").read_text(encoding="utf-8")
# The cookie that stands for your login: which user this browser is.
USER_COOKIE = "chat_user"
_USER_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
TOKEN_TTL_S = int(os.environ.get("WEB_CHAT_TOKEN_TTL_S", "900"))


class Typist:
    """A demo engine: answers by repeating the message back, one word every 80 ms."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        words = f"You said: {message['text']}".split()
        answer = ""
        for word in words:
            await asyncio.sleep(0.08)
            piece = word if not answer else f" {word}"
            emit(piece)
            answer += piece
        return {**state, "step": "CHATTING"}, answer


async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(PAGE, headers={"Cache-Control": "no-cache"})


async def session_token(request: Request) -> Response:
    """``{"session_id", "token", "expires_at"}``: a token for this browser's own session, for
    the four actions of a chat page. The user comes from the cookie (made on first visit); in
    your application, from your login."""
    user = request.cookies.get(USER_COOKIE, "")
    fresh = not _USER_ID.fullmatch(user)
    if fresh:
        user = secrets.token_urlsafe(18)
    session_id = f"web-{user}"
    client: DialogClient = request.app.state.client
    token = client.session_token(session_id, ttl_s=TOKEN_TTL_S)
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
    # For your servers only; the page never sees it (it gets a session token instead).
    server_token = settings.http_token or secrets.token_hex(16)
    return create_app(
        settings,
        token=server_token,
        extra_routes=[
            Route("/", page),
            Route("/session-token", session_token, methods=["POST"]),
        ],
    )


app = build_app()

if __name__ == "__main__":
    uvicorn.run(
        app,
        host=os.environ.get("WEB_CHAT_HOST", "127.0.0.1"),
        port=int(os.environ.get("WEB_CHAT_PORT", "8080")),
    )
