"""dialog_worker.model_call / usage as an engine calls them (async with, plain with in a def
step, a decorator), checked before anything is recorded; the settings of limit keys and
tenants; what a reply event's usage field may hold."""

from __future__ import annotations

import json
from typing import Any

import pytest

import dialog_worker
from dialog_worker.client.replies import reply_from_entry
from dialog_worker.config import load_settings
from dialog_worker.daemon.model_gate import merged_state_usage, session_tokens_today
from dialog_worker.engine.model_calls import recording
from dialog_worker.engine.protocol import initial_state, run_step
from dialog_worker.errors import ConfigError, RateLimited, TransientError, ValidationError
from dialog_worker.store.limits import configured
from dialog_worker.store.tenants import TenantSettings, check_tenant


class AsyncBot:
    async def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        async with dialog_worker.model_call("openai:gpt", tokens=100) as call:
            call.usage(60, 20, cost=0.25)
        dialog_worker.usage("embedder", 7, 0)
        return state, "ok"


class ThreadBot:
    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        with dialog_worker.model_call("openai:gpt", tokens=10):
            dialog_worker.usage("gpt-4.1", 3, 4)  # inside the block: this call's usage
        return state, "ok"


@dialog_worker.model_call("openai:gpt", tokens=5)
async def decorated() -> str:
    dialog_worker.usage("gpt", 1, 2)
    return "done"


async def test_a_step_reports_usage_through_model_call_and_usage() -> None:
    with recording() as reports:
        await run_step(AsyncBot(), initial_state("s"), {"text": "hi"})
    assert reports == [
        {"key": "openai:gpt", "model": "openai:gpt", "input_tokens": 60, "output_tokens": 20,
         "cost": 0.25},
        {"key": None, "model": "embedder", "input_tokens": 7, "output_tokens": 0, "cost": None},
    ]  # fmt: skip


async def test_a_plain_def_step_uses_a_plain_with_from_its_thread() -> None:
    with recording() as reports:
        await run_step(ThreadBot(), initial_state("s"), {"text": "hi"})
    assert reports == [
        {"key": "openai:gpt", "model": "gpt-4.1", "input_tokens": 3, "output_tokens": 4,
         "cost": None},
    ]  # fmt: skip


async def test_the_decorator_makes_each_call_of_the_function_one_model_call() -> None:
    with recording() as reports:
        assert await decorated() == "done"
        assert await decorated() == "done"
    assert [r["output_tokens"] for r in reports] == [2, 2]


async def test_outside_a_worker_model_call_waits_for_nothing_and_usage_goes_nowhere() -> None:
    async with dialog_worker.model_call("k", tokens=1) as call:
        call.usage(1, 1)
    dialog_worker.usage("m", 1, 1)


async def test_a_plain_with_in_an_async_step_says_what_to_use() -> None:
    with recording(), pytest.raises(RuntimeError, match="async with"):
        with dialog_worker.model_call("k", tokens=1):
            pass


@pytest.mark.parametrize(
    ("key", "tokens"),
    [("", 1), ("a b", 1), ("x" * 201, 1), ("k", -1), ("k", 1.5), ("k", True), (None, 1)],
)
def test_a_bad_key_or_estimate_is_refused(key: Any, tokens: Any) -> None:
    with pytest.raises(ValidationError):
        dialog_worker.model_call(key, tokens=tokens)


@pytest.mark.parametrize(
    "args",
    [("", 1, 1, None), ("m", -1, 1, None), ("m", 1, 1.5, None), ("m", 1, 1, float("nan")),
     ("m", 1, 1, -0.1), ("m", True, 1, None)],
)  # fmt: skip
def test_bad_usage_is_refused_before_it_is_recorded(args: tuple[Any, ...]) -> None:
    with recording() as reports, pytest.raises(ValidationError):
        dialog_worker.usage(*args)
    assert reports == []


def test_rate_limited_is_a_transient_error_with_the_providers_retry_after() -> None:
    exc = RateLimited("openai:gpt", 2.5)
    assert isinstance(exc, TransientError)
    assert (exc.key, exc.retry_after_s, exc.retry_after) == ("openai:gpt", 2.5, 2.5)
    assert RateLimited("k", float("nan")).retry_after_s is None


def test_model_limits_come_from_json_or_a_config_table() -> None:
    settings = load_settings(
        environ={"DIALOG_MODEL_LIMITS": '{"openai:gpt": {"rpm": 60, "tpm": 1000}}'}
    )
    assert configured(settings)["openai:gpt"].as_dict() == {
        "rpm": 60,
        "tpm": 1000,
        "max_in_flight": 0,
    }
    table = load_settings().replace(model_limits={"k": {"max_in_flight": 4}})
    assert configured(table)["k"].max_in_flight == 4


@pytest.mark.parametrize(
    "raw",
    ["{", "[]", '{"a b": {}}', '{"k": {"rpm": -1}}', '{"k": {"rpm": 1.5}}', '{"k": {"rps": 1}}',
     '{"k": 5}'],
)  # fmt: skip
def test_bad_model_limits_fail_at_start_naming_the_setting(raw: str) -> None:
    with pytest.raises(ConfigError, match="DIALOG_MODEL_LIMITS"):
        load_settings(environ={"DIALOG_MODEL_LIMITS": raw})


def test_tenant_settings_are_checked_and_bad_stored_values_read_as_defaults() -> None:
    assert TenantSettings.from_json(None) == TenantSettings()
    assert TenantSettings.from_json("{nope") == TenantSettings()
    mixed = TenantSettings.from_json(json.dumps({"weight": "x", "max": 3, "daily_tokens": 50}))
    assert (mixed.weight, mixed.max, mixed.daily_tokens) == (1.0, 3, 50)
    # Field by field: a max below the min read before it is left out (no cap), not obeyed.
    assert TenantSettings.from_json(json.dumps({"min": 5, "max": 2})) == TenantSettings(min=5)
    for bad in ({"weight": 0}, {"min": -1}, {"max": 1.5}, {"min": 3, "max": 2}):
        with pytest.raises(ValidationError):
            TenantSettings(**bad)
    assert TenantSettings(daily_tokens=None).budget(7) == 7
    assert TenantSettings(daily_tokens=0).budget(7) == 0
    for name in ("", "a b", "x" * 65, "tab\t"):
        with pytest.raises(ValidationError):
            check_tenant(name)


def test_the_states_usage_adds_up_and_counts_today_apart() -> None:
    totals = {"input_tokens": 10, "output_tokens": 5, "cost": 0.5, "calls": 2}
    first = merged_state_usage(None, totals, "20260101")
    assert first == {"input_tokens": 10, "output_tokens": 5, "cost": 0.5, "calls": 2,
                     "day": "20260101", "day_tokens": 15}  # fmt: skip
    next_day = merged_state_usage(first, {**totals, "cost": None}, "20260102")
    assert (next_day["input_tokens"], next_day["cost"], next_day["day_tokens"]) == (20, 0.5, 15)
    assert session_tokens_today({"usage": next_day}, "20260102") == 15
    assert session_tokens_today({"usage": next_day}, "20260103") == 0
    assert session_tokens_today({"usage": {"day": "20260102", "day_tokens": "9"}}, "20260102") == 0


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(b'{"input_tokens": 3, "output_tokens": 4, "cost": 0.1}',
      {"input_tokens": 3, "output_tokens": 4, "cost": 0.1}),
     (b'{"input_tokens": 3, "output_tokens": 4, "cost": null}',
      {"input_tokens": 3, "output_tokens": 4, "cost": None}),
     (b'{"input_tokens": -3, "output_tokens": 4}', None), (b"[1]", None), (b"{", None),
     (b'{"input_tokens": true, "output_tokens": 4}', None)],
)  # fmt: skip
def test_a_reply_events_usage_is_read_or_left_out_never_raised_over(
    raw: bytes, expected: dict[str, Any] | None
) -> None:
    reply = reply_from_entry(b"1-0", {b"outcome": b"applied", b"usage": raw}, "s")
    assert reply.usage == expected
    assert "usage" not in reply.echo
    assert ("usage" in reply.as_dict()) is (expected is not None)
