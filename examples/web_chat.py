"""A web chat endpoint: each POST waits for the bot's answer with DialogClient.ask.

    REDIS_URL=redis://... uvicorn web_chat:app --app-dir examples --port 8080
    curl -s localhost:8080/chat -d '{"session_id": "u42", "text": "nama saya Budi"}'
    {"reply": "Halo Budi, ada yang bisa dibantu?", "outcome": "applied", "seq": 1, "msg_id": "..."}

One DialogClient serves every request of the process: all waiting requests share one reader
of the reply stream. Answers:
- 200 with the reply; ``outcome`` is ``applied``, or ``dead_lettered`` (the reply is then the
  fallback apology), or ``duplicate`` (this msg_id was sent before);
- 400 for a request the client must fix (not JSON, missing or invalid session_id or text);
- 504 when no reply came within ASK_TIMEOUT_S (default 25): the message was sent and may
  still be answered; posting again with the returned ``msg_id`` waits for that same message
  (never applied twice);
- 503 when Redis cannot be reached; when the message may have been sent all the same (the
  connection broke or timed out during the append) the body carries its ``msg_id``: post
  again with it once the service is back (applied once either way).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import redis.exceptions
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from dialog_worker import DialogClient, ReplyStreamError, ReplyTimeout, UncertainSendError
from dialog_worker.errors import ValidationError

ASK_TIMEOUT_S = float(os.environ.get("ASK_TIMEOUT_S", "25"))


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with DialogClient() as client:
        app.state.client = client
        yield


async def chat(request: Request) -> JSONResponse:
    client: DialogClient = request.app.state.client
    try:
        body: Any = await request.json()
    except ValueError:
        return JSONResponse({"error": "the body must be JSON"}, status_code=400)
    if not isinstance(body, dict):
        return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
    session_id, text, msg_id = body.get("session_id"), body.get("text"), body.get("msg_id")
    if not (isinstance(session_id, str) and isinstance(text, str)):
        return JSONResponse({"error": "session_id and text must be strings"}, status_code=400)
    if msg_id is not None and not isinstance(msg_id, str):
        return JSONResponse({"error": "msg_id must be a string"}, status_code=400)
    try:
        reply = await client.ask(session_id, text, msg_id=msg_id, timeout=ASK_TIMEOUT_S)
    except ValidationError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    except ReplyTimeout as exc:
        return JSONResponse({"error": "no reply in time", "msg_id": exc.msg_id}, status_code=504)
    except UncertainSendError as exc:
        return JSONResponse(
            {
                "error": "the chat service is unavailable; retry with this msg_id",
                "msg_id": exc.msg_id,
            },
            status_code=503,
        )
    except (redis.exceptions.RedisError, ReplyStreamError):
        return JSONResponse({"error": "the chat service is unavailable"}, status_code=503)
    return JSONResponse(
        {"reply": reply.text, "outcome": reply.outcome, "seq": reply.seq, "msg_id": reply.msg_id}
    )


async def healthz(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


app = Starlette(
    routes=[Route("/chat", chat, methods=["POST"]), Route("/healthz", healthz)],
    lifespan=lifespan,
)
