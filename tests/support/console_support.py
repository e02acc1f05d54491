"""Helpers of the console's tests (tests/console): one operator and one viewer, and how to
sign in and post a form. Their fixtures (console_settings, http) are in tests/conftest.py:
a conftest.py of their own would shadow the suite's `conftest` module that tests import
`worker_env` from."""

from __future__ import annotations

import base64
import re

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
