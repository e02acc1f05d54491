"""Session tokens and CORS at the gateway (`dialog-worker serve` as a real process): a page
holds a token for its own session only, never the server token."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_proc import GatewayProc

from dialog_worker.client import session_tokens
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings

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


@pytest.mark.parametrize(
    ("token", "says"),
    [
        (session_tokens.mint(KEY, "dave", 60, now=time.time() - 120), "expired"),
        (session_tokens.mint("another-key-" + "x" * 30, "dave", 60), "signature"),
        ("v1.e30.AAAA", "signature"),
        ("v1." + "A" * 10, "malformed"),
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
    version, payload, signature = token.split(".")
    claims = json.loads(session_tokens._unb64(payload))
    forged = session_tokens._b64(json.dumps({**claims, "s": "frank"}).encode())
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        response = await http.post(
            "/sessions/frank/messages",
            json={"text": "x"},
            headers={"Authorization": f"Bearer {version}.{forged}.{signature}"},
        )
    assert response.status_code == 401


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
