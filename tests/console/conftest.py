"""Fixtures of the console's tests: settings with one operator and one viewer, and the app
served in-process over httpx (the HTTP-level tests) against the suite's real redis-server."""

from __future__ import annotations

import base64
import re
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from dialog_worker.client import DialogClient
from dialog_worker.config import Settings, load_settings

OPERATOR = ("olga", "operator-token-0001")
VIEWER = ("vic", "viewer-token-000001")


def console_env(env: dict[str, str], **extra: str) -> dict[str, str]:
    return {
        **env,
        "DIALOG_CONSOLE_OPERATORS": f"{OPERATOR[0]}:{OPERATOR[1]}",
        "DIALOG_CONSOLE_VIEWERS": f"{VIEWER[0]}:{VIEWER[1]}",
        "DIALOG_CONSOLE_REDACT_FIELDS": "card_number",
        **extra,
    }


def basic(user: tuple[str, str]) -> dict[str, str]:
    raw = base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode()
    return {"authorization": f"Basic {raw}"}


def form_token(html: str) -> str:
    match = re.search(r'name="form_token" value="([^"]+)"', html)
    assert match, "the page has no form token"
    return match.group(1)


@pytest.fixture
def console_settings(env: dict[str, str]) -> Settings:
    return load_settings(environ=console_env(env))


@pytest_asyncio.fixture
async def http(
    console_settings: Settings, client: DialogClient
) -> AsyncIterator[httpx.AsyncClient]:
    from dialog_worker.console.app import create_app

    app = create_app(console_settings, client)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console.test") as c:
        yield c
