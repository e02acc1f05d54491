"""The agent framework adapters' parts that need no framework (dialog_worker.adapters): the
package imports none of them, a missing one is named with its extra, options are checked, the
conversation is trimmed to whole turns within its bounds, and a provider's 429 or the worker's
own signals come out of a framework's wrapping."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from dialog_worker.adapters import from_langgraph, from_openai_agent, from_pydantic_ai
from dialog_worker.adapters._common import (
    call_name,
    json_size,
    options,
    rate_limited,
    retry_after_s,
    trim_turns,
    worker_signal,
)
from dialog_worker.engine.interrupts import Interrupted
from dialog_worker.errors import RateLimited, ValidationError

FRAMEWORK_PACKAGES = ("agents", "pydantic_ai", "langgraph", "langchain_core", "openai")


def test_importing_the_adapters_imports_no_framework() -> None:
    code = (
        "import sys, dialog_worker, dialog_worker.adapters\n"
        f"print([m for m in sys.modules if m.split('.')[0] in {FRAMEWORK_PACKAGES!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("function", "package", "extra"),
    [
        ("from_openai_agent", "agents", "openai-agents"),
        ("from_pydantic_ai", "pydantic_ai", "pydantic-ai"),
        ("from_langgraph", "langgraph", "langgraph"),
    ],
)
def test_a_missing_framework_is_named_with_the_extra_that_installs_it(
    function: str, package: str, extra: str
) -> None:
    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        "import dialog_worker.adapters as a\n"
        f"try:\n    a.{function}(object())\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert f"pip install 'dialog-worker[{extra}]'" in out.stdout


@pytest.mark.parametrize(
    "bad",
    [
        {"limit_key": "has space"},
        {"memory_turns": 0},
        {"memory_bytes": True},
        {"answer_tokens": -1},
        {"interrupt_timeout_s": float("nan")},
    ],
)
@pytest.mark.parametrize("make", [from_openai_agent, from_pydantic_ai, from_langgraph])
def test_bad_options_are_refused_before_the_framework_is_touched(
    make: Any, bad: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError):
        make(object(), **bad)


def test_the_default_limit_key_names_the_model() -> None:
    assert options(None, 20, None, 0, None).key_for("gpt 4o") == "llm:gpt4o"
    assert options("openai:gpt-4.1", 20, None, 0, None).key_for("x") == "openai:gpt-4.1"


def turns(n: int) -> list[str]:
    """A system line, then n turns of a user's message, a tool call and an answer."""
    items = ["system"]
    for i in range(1, n + 1):
        items += [f"user {i}", f"call {i}", f"answer {i}"]
    return items


def is_user(item: str) -> bool:
    return item.startswith("user")


def test_the_conversation_keeps_the_last_whole_turns_and_what_came_before_the_first() -> None:
    kept = trim_turns(turns(5), is_user, 2, None, json_size)
    assert kept == ["system", "user 4", "call 4", "answer 4", "user 5", "call 5", "answer 5"]
    assert trim_turns(turns(2), is_user, 5, None, json_size) == turns(2)
    assert trim_turns(turns(3), is_user, None, None, json_size) == turns(3)


def test_the_conversation_drops_its_oldest_turns_past_its_bytes_and_keeps_the_latest() -> None:
    items = turns(10)
    bound = json_size(["system", *items[-6:]])  # the system line and the last two turns
    kept = trim_turns(items, is_user, None, bound, json_size)
    assert kept == ["system", *items[-6:]]
    assert json_size(kept) <= bound
    # A latest turn larger than the bound alone is still kept (the state's own cap applies).
    assert trim_turns(items, is_user, None, 1, json_size) == ["system", *items[-3:]]


def test_a_conversation_without_a_user_turn_is_kept_whole() -> None:
    assert trim_turns(["a", "b"], is_user, 1, 1, json_size) == ["a", "b"]


class Response:
    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status_code = status
        self.headers = headers


class ProviderError(Exception):
    def __init__(self, status: int, headers: dict[str, str]) -> None:
        super().__init__(f"HTTP {status}")
        self.response = Response(status, headers)


def test_a_429_under_a_frameworks_own_error_becomes_rate_limited_with_its_retry_after() -> None:
    try:
        try:
            raise ProviderError(429, {"retry-after": "7"})
        except ProviderError as inner:
            raise RuntimeError("the framework's wrapper") from inner
    except RuntimeError as outer:
        limited = rate_limited(outer, "llm:m")
    assert isinstance(limited, RateLimited)
    assert (limited.key, limited.retry_after_s) == ("llm:m", 7.0)
    assert rate_limited(ProviderError(500, {}), "llm:m") is None


def test_retry_after_reads_seconds_and_refuses_nonsense() -> None:
    assert retry_after_s({"retry-after": "2.5"}) == 2.5
    assert retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s(None) is None


def test_the_workers_own_signal_is_found_inside_an_exception_group() -> None:
    asked = Interrupted(1, "{}", 0)
    group = BaseExceptionGroup("run", [ValueError("x"), ExceptionGroup("inner", [KeyError()])])
    assert worker_signal(group) is None
    assert worker_signal(BaseExceptionGroup("run", [asked])) is asked


def test_a_long_tool_call_id_gets_a_short_journal_name() -> None:
    assert call_name("call_abc") == "tool:call_abc"
    long = call_name("x" * 500)
    assert long.startswith("tool:h") and len(long) < 64
    assert json.dumps(long)
