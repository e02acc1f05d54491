"""Session-scoped tokens for browsers: what a chat page may do with one session, and until
when, signed by the application with ``DIALOG_HTTP_SIGNING_KEY``.

The application's server (which knows its user) mints a token for that user's session
(`DialogClient.session_token`, or ``dialog-worker token``) and hands it to the page; the
gateway accepts it for that session and those actions only, until it expires. Nothing is
stored: rotating the signing key revokes every token minted with the old one.

A token is ``v1.<payload>.<signature>``: the payload is base64url JSON ``{"s": session id,
"a": [actions], "e": expiry (unix seconds)}``, the signature base64url HMAC-SHA256 of
``v1.<payload>`` under the key. Anyone can read a payload (the session id is in it); nobody
without the key can make or change one.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import time
from collections.abc import Iterable

from dialog_worker.errors import ValidationError

# What a token may allow, one per gateway route.
ACTIONS = ("send", "stream", "cancel", "events", "pending", "resume")
VERSION = "v1"
MAX_TTL_S = 7 * 86400
MAX_TOKEN_CHARS = 4096
# A key shorter than this is refused: HMAC is only as strong as its key.
MIN_KEY_BYTES = 32


class TokenRefused(Exception):
    """Why a token is not accepted: ``status`` 401 (missing, malformed, tampered, expired) or
    403 (valid, but for another session or action)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class SessionGrant:
    session_id: str
    actions: tuple[str, ...]
    expires_at: int


def mint(
    key: str,
    session_id: str,
    ttl_s: float = 3600,
    actions: Iterable[str] | None = None,
    now: float | None = None,
) -> str:
    """A token for ``session_id`` allowing ``actions`` (all of `ACTIONS` when None) for
    ``ttl_s`` seconds."""
    _check_key(key)
    if not isinstance(session_id, str) or not session_id:
        raise ValidationError("session_id must be a non-empty string")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_TTL_S:
        raise ValidationError(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S}]")
    chosen = tuple(ACTIONS if actions is None else actions)
    unknown = [a for a in chosen if a not in ACTIONS]
    if unknown or not chosen:
        raise ValidationError(f"actions must be some of {', '.join(ACTIONS)}, got {chosen!r}")
    expires = int((time.time() if now is None else now) + ttl_s)
    body = json.dumps(
        {"s": session_id, "a": sorted(set(chosen)), "e": expires},
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode("utf-8", "surrogatepass")
    head = f"{VERSION}.{_b64(body)}"
    return f"{head}.{_b64(_sign(key, head))}"


def verify(key: str, token: str, now: float | None = None) -> SessionGrant:
    """The grant a token carries; `TokenRefused` (401) when it is malformed, not signed with
    ``key``, or expired."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
        raise TokenRefused(401, "missing or malformed token")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        raise TokenRefused(401, "missing or malformed token")
    head = f"{parts[0]}.{parts[1]}"
    try:
        signature = _unb64(parts[2])
        body = _unb64(parts[1])
    except ValueError:
        raise TokenRefused(401, "missing or malformed token") from None
    if not hmac.compare_digest(signature, _sign(key, head)):
        raise TokenRefused(401, "the token's signature does not match (tampered, or another key)")
    try:
        claims = json.loads(body.decode("utf-8", "surrogatepass"))
        session_id, actions, expires = claims["s"], claims["a"], claims["e"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        raise TokenRefused(401, "missing or malformed token") from None
    if (
        not isinstance(session_id, str)
        or not isinstance(actions, list)
        or not all(isinstance(a, str) for a in actions)
        or isinstance(expires, bool)
        or not isinstance(expires, int)
    ):
        raise TokenRefused(401, "missing or malformed token")
    if expires <= (time.time() if now is None else now):
        raise TokenRefused(401, "the token has expired: ask the application for a new one")
    return SessionGrant(session_id, tuple(actions), expires)


def check(grant: SessionGrant, session_id: str, action: str) -> None:
    """`TokenRefused` (403) unless ``grant`` covers ``action`` on ``session_id``."""
    if grant.session_id != session_id:
        raise TokenRefused(403, "the token is for another session")
    if action not in grant.actions:
        raise TokenRefused(403, f"the token does not allow {action!r}")


def _check_key(key: str) -> None:
    if not isinstance(key, str) or len(key.encode()) < MIN_KEY_BYTES:
        raise ValidationError(
            f"DIALOG_HTTP_SIGNING_KEY must be set, at least {MIN_KEY_BYTES} bytes "
            "(for example: openssl rand -hex 32)"
        )


def _sign(key: str, head: str) -> bytes:
    return hmac.new(key.encode(), head.encode("ascii"), hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if not text.isascii():
        raise ValueError("not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url") from None
