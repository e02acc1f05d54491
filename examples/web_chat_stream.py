"""A chat page whose answers appear as they are written: the HTTP gateway
(`dialog_worker.gateway`) plus one page (``GET /``) and the endpoint that hands the page its
session token (``POST /session-token``).

    PYTHONPATH=examples DIALOG_ENGINE=web_chat_stream:Assistant dialog-worker run &
    python examples/web_chat_stream.py                              # http://127.0.0.1:8080/

`Typist` is a demo engine that writes its answer word by word; examples/llm_engine.py streams
a real model's answer the same way. `Assistant` answers as `Typist` does, except "refund 20":
it shows a tool's progress, asks for an approval (the page shows Approve / Reject), and on
approval sends the refund once (docs/engine.md, "Agents: tools, approvals and progress").

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
- ``WEB_CHAT_REFUNDS_FILE`` (for the worker running `Assistant`): where its pretend payment
  provider writes each refund it sends, one JSON line each (unset: nowhere).
- ``OTEL_*``: as for ``dialog-worker serve`` (docs/operations.md, traces): with
  ``dialog-worker[otel]`` installed and an exporter named, this server traces, and a message's
  trace continues the page's (the page sends a ``traceparent`` header with each message).

The page (web_chat_stream.html) follows the session's turns (``GET /sessions/{id}/events``):
on load it shows the conversation the session keeps, and later it shows what the server
starts too (a timer's nudge, a message delivered later, an operator's redrive). It follows
each of its own answers as it is written (``GET .../messages/{msg_id}/stream``), also across
a reload, and its Stop button cancels the answer being written. It shows an engine's typed
events (``dialog_worker.emit_event``: kind ``tool``, as a status line in the answer's bubble)
and its questions (``dialog_worker.interrupt``) with Approve / Reject buttons, also after a
reload (``GET /sessions/{id}/pending``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
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

from dialog_worker import DialogClient, emit, emit_event, interrupt, once, tracing
from dialog_worker.config import load_settings
from dialog_worker.gateway import create_app

# The page: one file next to this one, served as it is.
PAGE = (Path(__file__).resolve().parent / "web_chat_stream.html").read_text(encoding="utf-8")
# The cookie that stands for your login: which user this browser is.
USER_COOKIE = "chat_user"
_USER_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
TOKEN_TTL_S = int(os.environ.get("WEB_CHAT_TOKEN_TTL_S", "900"))
# What the page's token allows: everything the page does with its session.
PAGE_ACTIONS = ("send", "stream", "cancel", "events", "pending", "resume")


class Typist:
    """A demo engine: answers by repeating the message back, one word every 80 ms."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        return {**state, "step": "CHATTING"}, await type_out(f"You said: {message['text']}")


async def type_out(text: str) -> str:
    """Streams ``text`` to the page one word every 80 ms; returns it (the reply)."""
    answer = ""
    for word in text.split():
        await asyncio.sleep(0.08)
        piece = word if not answer else f" {word}"
        emit(piece)
        answer += piece
    return answer


REFUND = re.compile(r"refund (\d{1,6})", re.IGNORECASE)


def send_refund(msg_id: str, amount: int) -> dict[str, Any]:
    """The tool: a pretend payment provider. Money leaves: it must run once per message, which
    `once` sees to. It writes each refund it sends to ``WEB_CHAT_REFUNDS_FILE`` (when set)."""
    refund = {"refund_id": f"R-{msg_id[:8]}", "amount": amount}
    ledger = os.environ.get("WEB_CHAT_REFUNDS_FILE")
    if ledger:
        with open(ledger, "a", encoding="utf-8") as out:
            out.write(json.dumps({**refund, "msg_id": msg_id}) + "\n")
    return refund


class Assistant(Typist):
    """`Typist`, plus a small agent for "refund N": the tool's progress as typed events (the
    page shows them in the answer's bubble), a question for the person (Approve / Reject on
    the page), and the refund sent once, however often the step runs."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        asked = REFUND.fullmatch(message["text"].strip())
        if asked is None:
            return await super().step(state, message)
        amount = int(asked[1])
        new_state = {**state, "step": "CHATTING"}
        emit_event("tool", {"name": "refund", "status": "waiting for approval"})
        # The first run stops here: the message's answer waits, the page shows the question.
        # The run after the person's answer (POST .../interrupts/{id}/resume) starts again
        # from the top and gets the answer from this call.
        approved = await interrupt({"question": f"Send a refund of {amount}?"})
        if approved is not True:
            emit_event("tool", {"name": "refund", "status": "declined"})
            return new_state, await type_out("Okay, no refund was sent.")
        emit_event("tool", {"name": "refund", "status": "running"})
        # Once per message: a run of this step again (a crash, a retry) gets the recorded
        # refund instead of sending another one.
        refund = await once("send_refund", send_refund, message["msg_id"], amount)
        emit_event("tool", {"name": "refund", "status": "done"})
        return new_state, await type_out(
            f"Done: refund {refund['refund_id']} of {refund['amount']} is on its way."
        )


async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(PAGE, headers={"Cache-Control": "no-cache"})


async def session_token(request: Request) -> Response:
    """``{"session_id", "token", "expires_at"}``: a token for this browser's own session, for
    what a chat page does (`PAGE_ACTIONS`). The user comes from the cookie (made on first
    visit); in your application, from your login."""
    user = request.cookies.get(USER_COOKIE, "")
    fresh = not _USER_ID.fullmatch(user)
    if fresh:
        user = secrets.token_urlsafe(18)
    session_id = f"web-{user}"
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
    # Traces when the OTEL_* variables ask for them (nothing is imported otherwise): a message
    # posted by the page continues the trace of the page's traceparent header.
    traced = tracing.setup("web-chat")
    try:
        uvicorn.run(
            app,
            host=os.environ.get("WEB_CHAT_HOST", "127.0.0.1"),
            port=int(os.environ.get("WEB_CHAT_PORT", "8080")),
        )
    finally:
        if traced:
            tracing.shutdown()
