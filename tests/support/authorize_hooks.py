"""DIALOG_HTTP_AUTHORIZE hooks for the gateway's tests: a team's own sign-in, here a cookie
naming the user, whose one chat is the session ``chat-<user>`` (docs/http.md)."""

from __future__ import annotations

import asyncio
from typing import Any


def by_cookie(request: Any, session_id: str, action: str) -> bool | str:
    """True for the user's own chat; a reason for anyone else's; False when nobody signed in
    (the gateway then answers with its own 401)."""
    user = request.cookies.get("user")
    if not user:
        return False
    if session_id == f"chat-{user}":
        return True
    return f"{user} is not a member of this chat"


async def by_cookie_async(request: Any, session_id: str, action: str) -> bool | str:
    """The same, as a coroutine (a hook that asks its own session store)."""
    await asyncio.sleep(0)
    return by_cookie(request, session_id, action)


def broken(request: Any, session_id: str, action: str) -> bool:
    """A hook whose own store is down: it raises, with something secret in its message."""
    raise RuntimeError(f"session store unreachable at redis://:hunter2@store/0 for {session_id}")
