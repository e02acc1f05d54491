"""Who may sign in and what a form token proves, without Redis."""

from __future__ import annotations

import base64

import pytest

from dialog_worker.config import Settings
from dialog_worker.console.auth import FORM_TOKEN_TTL_S, Authenticator, NoUsers, Role, User

OPS = "olga:operator-token-0001,omar:operator-token-0002"
VIEWERS = "vic:viewer-token-000001"


def auth(**extra: str) -> Authenticator:
    return Authenticator(Settings(console_operators=OPS, console_viewers=VIEWERS, **extra))


def basic(name: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{name}:{token}".encode()).decode()


def test_no_users_no_console() -> None:
    with pytest.raises(NoUsers):
        Authenticator(Settings())


def test_each_user_signs_in_with_their_own_name_and_token_only() -> None:
    a = auth()
    assert a.authenticate(basic("olga", "operator-token-0001")) == User("olga", Role.OPERATOR)
    assert a.authenticate(basic("vic", "viewer-token-000001")) == User("vic", Role.VIEWER)
    assert a.authenticate("Bearer operator-token-0002") == User("omar", Role.OPERATOR)
    for header in (
        None,
        "",
        basic("olga", "operator-token-0002"),  # another operator's token
        basic("vic", "operator-token-0001"),
        basic("olga", ""),
        "Basic b2xnYQ==",  # "olga" without a colon
        "Basic ***",
        "Bearer ",
        "Digest operator-token-0001",
    ):
        assert a.authenticate(header) is None, header


def test_a_form_token_is_bound_to_its_user_and_expires() -> None:
    a = auth()
    olga, omar = User("olga", Role.OPERATOR), User("omar", Role.OPERATOR)
    token = a.form_token(olga, now_s=1_000_000)
    assert a.check_form_token(olga, token, now_s=1_000_000 + 60)
    assert not a.check_form_token(omar, token, now_s=1_000_000 + 60)
    assert not a.check_form_token(olga, token, now_s=1_000_000 + FORM_TOKEN_TTL_S + 1)
    assert not a.check_form_token(olga, token, now_s=1_000_000 - 10)  # issued in the future
    issued, _, mac = token.partition(".")
    assert not a.check_form_token(olga, f"{int(issued) + 1}.{mac}", now_s=1_000_000 + 60)
    for bad in (None, "", ".", "abc.def", f"{issued}.", f"x{issued}.{mac}"):
        assert not a.check_form_token(olga, bad, now_s=1_000_000 + 60)


def test_changing_the_credentials_invalidates_form_tokens() -> None:
    olga = User("olga", Role.OPERATOR)
    token = auth().form_token(olga, now_s=1_000_000)
    other = Authenticator(Settings(console_operators="olga:operator-token-9999"))
    assert not other.check_form_token(olga, token, now_s=1_000_000)
    assert auth().check_form_token(olga, token, now_s=1_000_000)  # same settings: same key
