"""The gateway counts and logs what it refuses (docs/operations.md, "The gateway's refusals"):
``dialog_gateway_refusals_total{status, reason}`` on its /metrics, and one log line per
refusal, neither with a token, a session id or anything else the client sent."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest
from structlog.testing import capture_logs

from dialog_worker.client import session_tokens
from dialog_worker.config import load_settings
from dialog_worker.gateway.app import create_app

pytestmark = pytest.mark.integration

SERVER_TOKEN = "refusals-server-token"
KEY = "r" * 40
SECRET_SESSION = "secret-session-7f3a"


def alg_none(claims: dict[str, object]) -> str:
    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    return f"{b64(json.dumps({'alg': 'none'}).encode())}.{b64(json.dumps(claims).encode())}."


async def test_each_refusal_is_counted_by_status_and_reason_and_logged_once_without_secrets(
    env: dict[str, str],
):
    settings = load_settings(environ={**env, "DIALOG_HTTP_SIGNING_KEY": KEY})
    app = create_app(settings, SERVER_TOKEN)
    expired = session_tokens.mint(KEY, SECRET_SESSION, 60, now=time.time() - 120)
    reader = session_tokens.mint(KEY, SECRET_SESSION, 60, actions=["stream"])
    other = session_tokens.mint(KEY, "someone-else", 60)
    unsigned = alg_none({"sub": SECRET_SESSION, "scope": "send", "exp": int(time.time()) + 60})
    server = {"Authorization": f"Bearer {SERVER_TOKEN}"}
    messages = f"/sessions/{SECRET_SESSION}/messages"

    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    requests = [  # (method, path, headers, body, status, reason)
        ("POST", messages, {}, {"text": "x"}, 401, "missing_token"),
        ("POST", messages, bearer("not-the-token"), {"text": "x"}, 401, "wrong_token"),
        ("POST", messages, bearer(expired), {"text": "x"}, 401, "expired"),
        ("POST", messages, bearer(unsigned), {"text": "x"}, 401, "bad_algorithm"),
        ("POST", messages, bearer(expired[:-4] + "AAAA"), {"text": "x"}, 401, "bad_signature"),
        ("POST", messages, bearer("v1.e30.AAAA"), {"text": "x"}, 401, "old_format"),
        ("POST", messages, bearer(other), {"text": "x"}, 403, "other_session"),
        ("POST", messages, bearer(reader), {"text": "x"}, 403, "action_not_allowed"),
        ("POST", "/sessions/%FF/messages", server, {"text": "x"}, 400, "path_not_utf8"),
        ("POST", messages, server, b"{not json", 400, "body_not_json"),
        ("POST", messages, server, {"text": ""}, 400, "bad_input"),
        ("POST", messages, server, {"text": "x" * 200_000}, 413, "body_too_large"),
        (
            "POST",
            "/ai-sdk/chat",
            server,
            {"id": SECRET_SESSION, "messages": []},
            400,
            "bad_message",
        ),
        (
            "POST",
            "/ai-sdk/chat",
            bearer(other),
            {
                "id": SECRET_SESSION,
                "messages": [{"id": "m", "role": "user", "parts": [{"type": "text", "text": "x"}]}],
            },
            403,
            "other_session",
        ),
        # The LangGraph door refuses through the same accounting.
        ("GET", f"/langgraph/threads/{SECRET_SESSION}/state", {}, None, 401, "missing_token"),
        (
            "GET",
            f"/langgraph/threads/{SECRET_SESSION}/state",
            bearer(other),
            None,
            403,
            "other_session",
        ),
        (
            "POST",
            f"/langgraph/threads/{SECRET_SESSION}/runs/wait",
            server,
            {"assistant_id": 5},
            400,
            "bad_input",
        ),
    ]
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http,
    ):
        with capture_logs() as logs:
            for method, path, headers, body, status, _ in requests:
                content = (
                    body
                    if isinstance(body, bytes)
                    else b""
                    if body is None
                    else json.dumps(body).encode()
                )
                got = await http.request(method, path, headers=headers, content=content)
                assert got.status_code == status, (path, got.text)
            accepted = await http.post(messages, headers=server, json={"text": "fine"})
            assert accepted.status_code == 202
        scraped = (await http.get("/metrics")).text
    counted = {
        (line.split('status="')[1].split('"')[0], line.split('reason="')[1].split('"')[0]): float(
            line.rsplit(" ", 1)[1]
        )
        for line in scraped.splitlines()
        if line.startswith("dialog_gateway_refusals_total{")
    }
    expected: dict[tuple[str, str], float] = {}
    for *_, status, reason in requests:
        expected[(str(status), reason)] = expected.get((str(status), reason), 0) + 1
    assert counted == expected
    refused = [e for e in logs if e["event"] == "gateway_refused"]
    assert [(e["status"], e["reason"]) for e in refused] == [(r[4], r[5]) for r in requests]
    assert refused[0]["route"] == "post_message" and refused[0]["method"] == "POST"
    shown = scraped + json.dumps(logs, default=str)
    for secret in (SECRET_SESSION, "someone-else", SERVER_TOKEN, KEY, expired, other, unsigned):
        assert secret not in shown
