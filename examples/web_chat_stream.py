"""A chat page whose answers appear as they are written: the HTTP gateway
(`dialog_worker.gateway`) plus one page (``GET /``) with an EventSource client.

    REDIS_URL=redis://... python examples/web_chat_stream.py       # http://127.0.0.1:8080/

Run workers with a streaming engine next to it (examples/llm_engine.py streams a model's
answer). It listens on 127.0.0.1 without a token, for a local demo; in production run
``dialog-worker serve`` with ``DIALOG_HTTP_TOKEN`` and serve your own page (docs/http.md).

The page shows each answer as it grows (``delta``), clears it when a retried attempt starts
over (``reset``), replaces it when told (``resync``) and with the committed reply at the
``end``. When the connection drops, the browser's EventSource reconnects by itself with the
last cursor (``Last-Event-ID``) and the answer goes on without a piece twice. The stop button
stays disabled: the gateway has no cancel route yet.
"""

from __future__ import annotations

import os
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from dialog_worker.config import load_settings
from dialog_worker.gateway import create_app

# The page: one file next to this one, served as it is.
PAGE = (Path(__file__).resolve().parent / "web_chat_stream.html").read_text(encoding="utf-8")


async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(PAGE)


def build_app() -> Starlette:
    settings = load_settings()
    return create_app(settings, token=None, extra_routes=[Route("/", page)])


app = build_app()

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("WEB_CHAT_PORT", "8080")))
