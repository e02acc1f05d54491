"""A chat page whose answers appear as they are written: the HTTP gateway
(`dialog_worker.gateway`) plus one page (``GET /``) with an EventSource client.

    PYTHONPATH=examples DIALOG_ENGINE=web_chat_stream:Typist dialog-worker run &
    python examples/web_chat_stream.py                              # http://127.0.0.1:8080/

`Typist` is a demo engine that writes its answer word by word; examples/llm_engine.py streams
a real model's answer the same way. The page listens on 127.0.0.1 without a token, for a
local demo; in production run ``dialog-worker serve`` with ``DIALOG_HTTP_TOKEN`` and serve your
own page (docs/http.md).

The page shows each answer as it grows (``delta``), clears it when a retried attempt starts
over (``reset``), replaces it when told (``resync``) and with the committed reply at the
``end``. When the connection drops, the browser's EventSource reconnects by itself with the
last cursor (``Last-Event-ID``) and the answer goes on without a piece twice. The stop button
cancels the answer being written (``POST .../cancel``): it ends ``cancelled``, keeping the text
shown so far.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from dialog_worker import emit
from dialog_worker.config import load_settings
from dialog_worker.gateway import create_app

# The page: one file next to this one, served as it is.
PAGE = (Path(__file__).resolve().parent / "web_chat_stream.html").read_text(encoding="utf-8")


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
    return HTMLResponse(PAGE)


def build_app() -> Starlette:
    settings = load_settings()
    return create_app(settings, token=None, extra_routes=[Route("/", page)])


app = build_app()

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("WEB_CHAT_PORT", "8080")))
