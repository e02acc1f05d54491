"""`SyncDialogClient` is `DialogClient`'s calls as blocking ones: every argument of every call
reaches the async call, under its own name, with the caller's value (a wrapper that drops one,
say `ask(timeout=...)`, `send(expires_at=...)` or `delete(replies=True)`, silently runs the
call with its default). One table over the whole wrapper, against a recording stand-in for
`DialogClient` (no Redis: the real calls are tested against workers in
tests/integration/test_sync_client.py)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pytest

from dialog_worker.client import session_tokens
from dialog_worker.client import sync as sync_module
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.sync import SyncDialogClient
from dialog_worker.config import Settings

# Every call the wrapper makes on a DialogClient (its public methods but `close` and
# `session_token`, which checked below, needs no client).
WRAPPED = (
    "send",
    "ask",
    "state",
    "reset",
    "delete",
    "stream",
    "ask_stream",
    "cancel",
    "pending",
    "resume",
)


class Recording:
    """Stands in for DialogClient: each wrapped call records its arguments by name (bound to
    DialogClient's own signature, defaults filled in) and returns a marker."""

    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def __init__(self, settings: Settings, max_connections: int) -> None:
        pass

    async def __aenter__(self) -> Recording:
        return self

    async def aclose(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name not in WRAPPED:
            raise AttributeError(name)
        signature = inspect.signature(getattr(DialogClient, name))

        def record(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            Recording.calls.append((name, dict(list(bound.arguments.items())[1:])))
            if inspect.isasyncgenfunction(getattr(DialogClient, name)):
                return _one(f"<{name} result>")
            return _result(f"<{name} result>")

        return record


async def _result(value: str) -> str:
    return value


async def _one(value: str) -> AsyncIterator[str]:
    yield value


def _values(name: str) -> dict[str, Any]:
    """A value for every parameter of DialogClient.<name>, each unlike any default."""
    params = list(inspect.signature(getattr(DialogClient, name)).parameters)[1:]
    return {p: f"<{name}.{p}>" for p in params}


@pytest.fixture
def wrapper(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(sync_module, "DialogClient", Recording)
    Recording.calls = []
    client = SyncDialogClient(settings=Settings())
    yield client
    client.close()


@pytest.mark.parametrize("name", WRAPPED)
def test_every_argument_of_every_call_reaches_the_async_call(wrapper: Any, name: str) -> None:
    """Each parameter DialogClient's call takes, the blocking call takes too, under the same
    name, and passes on as given: by keyword, and positionally where it is positional."""
    sync_params = inspect.signature(getattr(SyncDialogClient, name)).parameters
    async_params = inspect.signature(getattr(DialogClient, name)).parameters
    assert set(sync_params) == set(async_params), f"{name}: parameters left out"
    values = _values(name)
    result = getattr(wrapper, name)(**values)
    if inspect.isasyncgenfunction(getattr(DialogClient, name)):
        result = list(result)
        assert result == [f"<{name} result>"]
    else:
        assert result == f"<{name} result>"
    assert Recording.calls == [(name, values)]
    positional = [
        p
        for p, param in list(sync_params.items())[1:]
        if param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    Recording.calls = []
    result = getattr(wrapper, name)(*[values[p] for p in positional])
    if inspect.isasyncgenfunction(getattr(DialogClient, name)):
        list(result)
    [(_, got)] = Recording.calls
    assert {p: got[p] for p in positional} == {p: values[p] for p in positional}


def test_the_table_covers_the_whole_wrapper() -> None:
    public = {n for n, v in vars(SyncDialogClient).items() if callable(v) and not n.startswith("_")}
    assert public - {"close", "session_token"} == set(WRAPPED)


def test_session_token_keeps_its_lifetime_and_actions() -> None:
    """session_token needs no connection: it signs with the settings' key, for this session,
    for as long and for the actions asked."""
    import time

    key = "k" * 32
    client = SyncDialogClient(settings=Settings(http_signing_key=key))
    token = client.session_token("s1", ttl_s=120, actions=["stream"])
    grant = session_tokens.verify(key, token)
    assert grant.session_id == "s1" and grant.actions == ("stream",)
    assert 100 < grant.expires_at - time.time() <= 120
