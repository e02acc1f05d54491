"""Session tokens and CORS at the gateway (`dialog-worker serve` as a real process): a page
holds a token for its own session only, never the server token."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest
from gateway_proc import GatewayProc
from structlog.testing import capture_logs

from dialog_worker.client import session_tokens
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.gateway.app import create_app

pytestmark = pytest.mark.integration

SERVER_TOKEN = "server-side-only-token"
KEY = "k" * 40
PAGE_ORIGIN = "http://127.0.0.2:8123"

# Every session route: (method, path for session S, action).
ROUTES = [
    ("POST", "/sessions/{s}/messages", "send"),
    ("GET", "/sessions/{s}/messages/m1/stream", "stream"),
    ("POST", "/sessions/{s}/messages/m1/cancel", "cancel"),
    ("GET", "/sessions/{s}/events", "events"),
    ("GET", "/sessions/{s}/pending", "pending"),
    ("POST", "/sessions/{s}/interrupts/m1:1:1/resume", "resume"),
]


@pytest.fixture
def gateway(env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProc]:
    proc = GatewayProc(
        {
            **env,
            "DIALOG_HTTP_TOKEN": SERVER_TOKEN,
            "DIALOG_HTTP_SIGNING_KEY": KEY,
            "DIALOG_HTTP_CORS_ORIGINS": PAGE_ORIGIN,
        },
        tmp_path,
    )
    yield proc
    proc.stop()


async def status(http: httpx.AsyncClient, method: str, path: str, token: str) -> int:
    """The status of one request (an SSE route's headers only: its body may never end)."""
    headers = {"Authorization": f"Bearer {token}"}
    body = {"json": {"text": "halo"}} if path.endswith("/messages") else {}
    if path.endswith("/resume"):
        body = {"json": {"value": True}}
    async with http.stream(method, path, headers=headers, **body) as response:
        return response.status_code


def let_through(code: int) -> bool:
    """Past auth: a resume of an interrupt nobody waits on is a 404, not a refusal."""
    return code not in (401, 403)


async def test_a_session_token_opens_its_own_session_and_no_other_on_every_route(
    gateway: GatewayProc, env: dict[str, str]
):
    async with DialogClient(
        settings=load_settings(environ={**env, "DIALOG_HTTP_SIGNING_KEY": KEY})
    ) as c:
        mine = c.session_token("alice", ttl_s=60)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for method, path, action in ROUTES:
            assert let_through(await status(http, method, path.format(s="alice"), mine)), action
            other = await http.request(
                method, path.format(s="bob"), headers={"Authorization": f"Bearer {mine}"}
            )
            assert other.status_code == 403, (action, other.text)
            assert "another session" in other.json()["error"]
        # EventSource cannot set headers: the token in the query opens its SSE routes.
        async with http.stream("GET", f"/sessions/alice/events?access_token={mine}") as r:
            assert r.status_code == 200


async def test_a_token_limited_to_some_actions_is_refused_the_others(gateway: GatewayProc):
    reader = session_tokens.mint(KEY, "carol", 60, actions=["events", "stream"])
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for method, path, action in ROUTES:
            got = await status(http, method, path.format(s="carol"), reader)
            if action in ("events", "stream"):
                assert let_through(got), action
            else:
                assert got == 403, action


def unsigned(claims: dict[str, object]) -> str:
    """A JWT with ``alg: none``: no signature at all."""
    head = base64url(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{head}.{base64url(json.dumps(claims).encode())}."


def base64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


DAVE = {"sub": "dave", "scope": "send stream", "exp": int(time.time()) + 600}


@pytest.mark.parametrize(
    ("token", "says"),
    [
        (session_tokens.mint(KEY, "dave", 60, now=time.time() - 120), "expired"),
        (session_tokens.mint("another-key-" + "x" * 30, "dave", 60), "signature"),
        (unsigned(DAVE), "HS256"),
        (jwt.encode(DAVE, KEY + KEY, algorithm="HS512"), "HS256"),
        (jwt.encode({**DAVE, "exp": int(time.time()) - 1}, KEY, algorithm="HS256"), "expired"),
        (jwt.encode({"sub": "dave", "exp": DAVE["exp"]}, KEY, algorithm="HS256"), "malformed"),
        ("v1.e30.AAAA", "format before JWTs"),
        ("a.b.c", "malformed"),
        ("not-a-token", "wrong token"),
        ("", "wrong token"),
    ],
)
async def test_expired_tampered_and_foreign_tokens_are_401_and_say_why(
    gateway: GatewayProc, token: str, says: str
):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for method, path, _ in ROUTES:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            response = await http.request(method, path.format(s="dave"), headers=headers)
            assert response.status_code == 401, (path, response.text)
            assert says in response.json()["error"]


async def test_a_payload_changed_to_another_session_is_refused(gateway: GatewayProc):
    token = session_tokens.mint(KEY, "erin", 60)
    head, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    forged = base64url(json.dumps({**claims, "sub": "frank"}).encode())
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        response = await http.post(
            "/sessions/frank/messages",
            json={"text": "x"},
            headers={"Authorization": f"Bearer {head}.{forged}.{signature}"},
        )
    assert response.status_code == 401
    assert "signature" in response.json()["error"]


async def test_a_jwt_minted_by_another_library_opens_its_session(gateway: GatewayProc):
    """Any backend mints a token with its usual JWT library: here PyJWT called directly, with
    the claims http.md names (the Node library test is in test_ai_sdk_door.py)."""
    claims = {"sub": "gus", "scope": "send events", "exp": int(time.time()) + 60}
    token = jwt.encode(claims, KEY, algorithm="HS256")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        assert await status(http, "POST", "/sessions/gus/messages", token) == 202
        assert await status(http, "POST", "/sessions/gus/messages/m1/cancel", token) == 403
        assert await status(http, "POST", "/sessions/hal/messages", token) == 403


async def test_cors_preflight_is_answered_for_the_allowed_origin_only(gateway: GatewayProc):
    asked = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        ok = await http.options("/sessions/a/messages", headers={"Origin": PAGE_ORIGIN, **asked})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == PAGE_ORIGIN
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in ok.headers
        bad = await http.options(
            "/sessions/a/messages", headers={"Origin": "http://evil.example", **asked}
        )
        assert bad.status_code == 400
        assert "access-control-allow-origin" not in bad.headers
        token = session_tokens.mint(KEY, "a", 60)
        posted = await http.post(
            "/sessions/a/messages",
            json={"text": "x"},
            headers={"Origin": PAGE_ORIGIN, "Authorization": f"Bearer {token}"},
        )
        assert posted.status_code == 202
        assert posted.headers["access-control-allow-origin"] == PAGE_ORIGIN


def test_cli_token_prints_a_token_the_gateway_accepts(env: dict[str, str]):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dialog_worker",
            "token",
            "gina",
            "--ttl",
            "30",
            "--actions",
            "events",
        ],
        env={**env, "DIALOG_HTTP_SIGNING_KEY": KEY},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    grant = session_tokens.verify(KEY, printed["token"])
    assert (grant.session_id, grant.actions) == ("gina", ("events",))
    assert printed["expires_at"] == grant.expires_at and grant.expires_at <= time.time() + 31
    missing = subprocess.run(
        [sys.executable, "-m", "dialog_worker", "token", "gina"],
        env={k: v for k, v in env.items() if k != "DIALOG_HTTP_SIGNING_KEY"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 2 and "DIALOG_HTTP_SIGNING_KEY" in missing.stderr
    assert KEY not in missing.stderr + result.stderr


# Each door's request for session S, with a body where it takes one: the gateway's own route,
# useChat's door, the LangGraph door.
DOORS = [
    ("POST", "/sessions/{s}/messages", {"text": "halo"}),
    (
        "POST",
        "/ai-sdk/chat",
        {
            "id": "{s}",
            "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "halo"}]}],
        },
    ),
    ("GET", "/langgraph/threads/{s}/state", None),
]


def door_request(method: str, path: str, body: object, session: str) -> dict[str, object]:
    filled = json.loads(json.dumps(body).replace("{s}", session)) if body else None
    return {"method": method, "url": path.format(s=session), "json": filled}


@pytest.mark.parametrize("hook", ["authorize_hooks:by_cookie", "authorize_hooks:by_cookie_async"])
async def test_the_authorize_hooks_reason_is_a_403_on_every_door_and_only_true_lets_through(
    env: dict[str, str], client: DialogClient, hook: str
):
    """A team's own sign-in (DIALOG_HTTP_AUTHORIZE, sync or async): True opens the request,
    a reason refuses it with 403 and that reason, anything else is the gateway's own 401."""
    settings = load_settings(environ={**env, "DIALOG_HTTP_AUTHORIZE": hook})
    app = create_app(settings, SERVER_TOKEN, client=client)
    signed_in = {"Cookie": "user=ann"}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10
        ) as http,
    ):
        for method, path, body in DOORS:
            theirs = await http.request(
                **door_request(method, path, body, "chat-bob"), headers=signed_in
            )
            assert theirs.status_code == 403, (path, theirs.text)
            assert theirs.json()["error"] == "ann is not a member of this chat"
            nobody = await http.request(**door_request(method, path, body, "chat-ann"))
            assert nobody.status_code == 401, (path, nobody.text)
            assert "token" in nobody.json()["error"]
        # Her own chat (the useChat door would stream its answer: the other two say enough).
        sent = await http.post(
            "/sessions/chat-ann/messages", json={"text": "halo"}, headers=signed_in
        )
        assert sent.status_code == 202, sent.text
        state = await http.get("/langgraph/threads/chat-ann/state", headers=signed_in)
        assert state.status_code not in (401, 403), state.text
        refusals = (await http.get("/metrics")).text
    assert 'reason="authorize_refused",status="403"' in refusals
    assert "ann" not in refusals
    # Only her message reached the stream.
    entries = await client.redis.xrange(client.keys.stream)
    assert [fields["session_id"] for _, fields in entries] == ["chat-ann"]


async def test_an_authorize_hook_that_raises_refuses_with_503_on_every_door_and_logs_no_secret(
    env: dict[str, str], client: DialogClient
):
    """A hook that fails (its own store down) fails closed: 503 with a JSON error on every
    door, never a 500 and never the request let through; one log line names the exception's
    type, not its message (which may hold what the hook knew)."""
    settings = load_settings(environ={**env, "DIALOG_HTTP_AUTHORIZE": "authorize_hooks:broken"})
    app = create_app(settings, SERVER_TOKEN, client=client)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10
        ) as http,
    ):
        with capture_logs() as logs:
            for method, path, body in DOORS:
                got = await http.request(**door_request(method, path, body, "chat-ann"))
                assert got.status_code == 503, (path, got.text)
                assert "authoriz" in got.json()["error"]
    failed = [e for e in logs if e["event"] == "authorize_hook_failed"]
    assert len(failed) == len(DOORS)
    assert failed[0]["error_type"] == "RuntimeError"
    assert "hunter2" not in json.dumps(logs, default=str)
    assert await client.redis.xlen(client.keys.stream) == 0
