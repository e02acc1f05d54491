"""A page on an origin of DIALOG_HTTP_CORS_ORIGINS resumes answers through every front door:
the browser's preflight is answered, with the headers a resuming reader sends allowed
(docs/http.md, "Another origin"). Preflights never reach a route: no Redis is needed. The
same in a real browser: tests/integration/test_gateway_cors_browser.py."""

from __future__ import annotations

import httpx
import pytest

from dialog_worker.config import load_settings
from dialog_worker.gateway.app import create_app

PAGE_ORIGIN = "https://chat.example.com"

# The routes a page reads an answer or a session from, again after a drop, and the token
# header its client sends: the gateway's own (fetch-based readers send Last-Event-ID
# themselves; an EventSource sends it when it reconnects), useChat's resume, the LangGraph
# SDK's join (x-api-key, and Last-Event-ID from `join_stream(..., last_event_id=...)`).
RESUMES = [
    ("/sessions/s1/messages/m1/stream", "authorization"),
    ("/sessions/s1/events", "authorization"),
    ("/ai-sdk/chat/s1/stream", "authorization"),
    ("/langgraph/threads/s1/runs/m1/stream", "x-api-key"),
]


def preflight(path: str, headers: str, origin: str = PAGE_ORIGIN) -> httpx.Request:
    return httpx.Request(
        "OPTIONS",
        f"http://gw{path}",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": headers,
        },
    )


@pytest.mark.parametrize(("path", "token_header"), RESUMES)
async def test_a_preflight_to_resume_an_answer_from_another_origin_allows_last_event_id(
    path: str, token_header: str
):
    app = create_app(load_settings(environ={"DIALOG_HTTP_CORS_ORIGINS": PAGE_ORIGIN}), "t0ken")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
        answer = await http.send(preflight(path, f"{token_header},last-event-id"))
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == PAGE_ORIGIN
        allowed = {
            h.strip().lower() for h in answer.headers["access-control-allow-headers"].split(",")
        }
        assert {token_header, "last-event-id"} <= allowed
        assert "GET" in answer.headers["access-control-allow-methods"]
        assert "access-control-allow-credentials" not in answer.headers
        # Another origin is still refused, whatever it asks for.
        other = await http.send(preflight(path, "last-event-id", "https://evil.example"))
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
