"""Session-scoped tokens for browsers: what a chat page may do with one session, and until
when, signed by the application with ``DIALOG_HTTP_SIGNING_KEY``.

The application's server (which knows its user) mints a token for that user's session
(`DialogClient.session_token`, ``dialog-worker token``, or any JWT library) and hands it to the
page; the gateway accepts it for that session and those actions only, until it expires.
Nothing is stored: rotating the signing key revokes every token minted with the old one.

A token is a JWT (RFC 7519) signed with HS256 under the key, with the claims ``sub`` (the
session id), ``scope`` (the actions it allows, space-separated) and ``exp`` (unix seconds), so
a backend in any language mints one with its usual library. Any other ``alg`` (``none``
included) is refused. Anyone can read the claims (the session id is in them); nobody without
the key can make or change a token. Tokens of the format before JWTs (``v1.``) are refused
with a 401 that says so.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import jwt

from dialog_worker.errors import ValidationError

# What a token may allow, one per gateway route.
ACTIONS = ("send", "stream", "cancel", "events", "pending", "resume")
ALGORITHM = "HS256"
# The format before JWTs: ``v1.<payload>.<signature>``.
OLD_VERSION = "v1"
# Longest lifetime of a token: a page holds it, and nothing but a new key revokes it.
MAX_TTL_S = 7 * 86400
MAX_TOKEN_CHARS = 4096
# A key shorter than this is refused: HMAC is only as strong as its key.
MIN_KEY_BYTES = 32


class TokenRefused(Exception):
    """Why a token is not accepted: ``status`` 401 (missing, malformed, tampered, expired) or
    403 (valid, but for another session or action); ``code`` names the reason in a word (the
    gateway counts refusals by it)."""

    def __init__(self, status: int, reason: str, code: str = "bad_token") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.code = code


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
        raise ValidationError(
            f"a session token's lifetime (ttl_s) must be above 0 and at most {MAX_TTL_S} s "
            f"(7 days), got {ttl_s!r}"
        )
    chosen = tuple(ACTIONS if actions is None else actions)
    unknown = [a for a in chosen if a not in ACTIONS]
    if unknown or not chosen:
        raise ValidationError(f"actions must be some of {', '.join(ACTIONS)}, got {chosen!r}")
    issued = int(time.time() if now is None else now)
    claims = {
        "sub": session_id,
        "scope": " ".join(sorted(set(chosen))),
        "iat": issued,
        "exp": int(issued + ttl_s),
    }
    return jwt.encode(claims, key, algorithm=ALGORITHM)


def verify(key: str, token: str, now: float | None = None) -> SessionGrant:
    """The grant a token carries; `TokenRefused` (401) when it is malformed, not an HS256 JWT
    signed with ``key``, or expired."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
        raise TokenRefused(401, "missing or malformed token", "malformed")
    if token.startswith(OLD_VERSION + "."):
        raise TokenRefused(
            401,
            "this token is in the format before JWTs (v1.): ask the application for a new one",
            "old_format",
        )
    try:
        claims = jwt.decode(
            token,
            key=key,
            algorithms=[ALGORITHM],
            # Expiry is checked below against the caller's clock (tests, the CLI); `iat` is
            # not checked: a backend whose clock runs a second ahead still mints good tokens.
            options={"require": ["sub", "scope", "exp"], "verify_exp": False, "verify_iat": False},
        )
    except jwt.InvalidAlgorithmError:  # alg "none" too
        raise TokenRefused(
            401, f"the token must be signed with {ALGORITHM}", "bad_algorithm"
        ) from None
    except jwt.InvalidSignatureError:
        raise TokenRefused(
            401, "the token's signature does not match (tampered, or another key)", "bad_signature"
        ) from None
    except jwt.InvalidTokenError:
        raise TokenRefused(401, "missing or malformed token", "malformed") from None
    session_id, scope, expires = claims["sub"], claims["scope"], claims["exp"]
    if (
        not isinstance(session_id, str)
        or not isinstance(scope, str)
        or isinstance(expires, bool)
        or not isinstance(expires, int)
    ):
        raise TokenRefused(401, "missing or malformed token", "malformed")
    if expires <= (time.time() if now is None else now):
        raise TokenRefused(
            401, "the token has expired: ask the application for a new one", "expired"
        )
    return SessionGrant(session_id, tuple(scope.split()), expires)


def check(grant: SessionGrant, session_id: str, action: str) -> None:
    """`TokenRefused` (403) unless ``grant`` covers ``action`` on ``session_id``."""
    if grant.session_id != session_id:
        raise TokenRefused(403, "the token is for another session", "other_session")
    if action not in grant.actions:
        raise TokenRefused(403, f"the token does not allow {action!r}", "action_not_allowed")


def looks_like_one(token: str) -> bool:
    """Whether a bearer value is meant as a session token (a JWT's three parts, or the old
    format), not a wrong server token."""
    return token.count(".") == 2 or token.startswith(OLD_VERSION + ".")


def _check_key(key: str) -> None:
    if not isinstance(key, str) or len(key.encode()) < MIN_KEY_BYTES:
        raise ValidationError(
            f"DIALOG_HTTP_SIGNING_KEY must be set, at least {MIN_KEY_BYTES} bytes "
            "(for example: openssl rand -hex 32)"
        )
