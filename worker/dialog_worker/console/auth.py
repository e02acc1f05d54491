"""Who is asking, and may they act.

Users come from the settings (`DIALOG_CONSOLE_OPERATORS`, `DIALOG_CONSOLE_VIEWERS`, each
``name:token,...``). A request signs in with HTTP basic auth (name and token) or
``Authorization: Bearer <token>``; there are no default credentials and no sign-in page, so
no session cookie a forged page could ride on except the browser's own basic-auth cache.

That cache is why every mutation also carries a form token (CSRF): an HMAC of the user's name
and the time it was issued, keyed by a secret derived from the configured credentials (every
console replica with the same settings accepts it; changing a token invalidates them all).
A forged cross-site form cannot read it, so it cannot send it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import time
from enum import StrEnum

from dialog_worker.config import Settings

FORM_TOKEN_TTL_S = 12 * 3600


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"


@dataclasses.dataclass(frozen=True, slots=True)
class User:
    name: str
    role: Role

    @property
    def can_act(self) -> bool:
        return self.role is Role.OPERATOR


class NoUsers(ValueError):
    """Neither role names anyone: the console must not start."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Credential:
    user: User
    token: bytes


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        creds: list[_Credential] = []
        for role, listed in (
            (Role.OPERATOR, settings.console_operators),
            (Role.VIEWER, settings.console_viewers),
        ):
            for item in (i.strip() for i in listed.split(",") if i.strip()):
                name, _, token = item.partition(":")
                creds.append(_Credential(User(name, role), token.encode()))
        if not creds:
            raise NoUsers(
                "the console has no users: set DIALOG_CONSOLE_OPERATORS and/or "
                "DIALOG_CONSOLE_VIEWERS (name:token, tokens of 16+ characters)"
            )
        self._creds = tuple(creds)
        material = "\n".join(f"{c.user.role}:{c.user.name}:{c.token.hex()}" for c in creds)
        self._key = hashlib.sha256(
            b"dialog-worker console form token\n" + material.encode()
        ).digest()

    def authenticate(self, authorization: str | None) -> User | None:
        """The user an Authorization header names, or None. Every configured token is
        compared in constant time, so timing tells nothing about which one came close."""
        if not authorization:
            return None
        scheme, _, value = authorization.strip().partition(" ")
        name: str | None = None
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return None
            name, sep, token = decoded.partition(":")
            if not sep:
                return None
        elif scheme.lower() == "bearer":
            token = value.strip()
        else:
            return None
        found: User | None = None
        given = token.encode()
        for cred in self._creds:
            same = hmac.compare_digest(cred.token, given)
            if same and (name is None or hmac.compare_digest(cred.user.name, name)):
                found = found or cred.user
        return found

    # -- form tokens (CSRF) ------------------------------------------------------------------

    def form_token(self, user: User, now_s: float | None = None) -> str:
        issued = int(time.time() if now_s is None else now_s)
        return f"{issued}.{self._mac(user, issued)}"

    def check_form_token(self, user: User, token: str | None, now_s: float | None = None) -> bool:
        if not token:
            return False
        issued_raw, _, mac = token.partition(".")
        if not issued_raw.isdigit() or not mac:
            return False
        issued = int(issued_raw)
        now = time.time() if now_s is None else now_s
        if not 0 <= now - issued <= FORM_TOKEN_TTL_S:
            return False
        return hmac.compare_digest(mac, self._mac(user, issued))

    def _mac(self, user: User, issued: int) -> str:
        message = f"{user.role}\n{user.name}\n{issued}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()
