"""The worker's side of model calls (dialog_worker/daemon/model_gate.py) on a real redis-server:
an engine's `model_call` blocks run against a step's attempt as the pipeline binds it, and what
they leave is read as operators read it, the `limits` and `tenants` lines
(dialog_worker/ops/model_limits.py). Slots and budget holds last the step's whole lease, come
back when a call is cancelled or handed back, and each call of a step holds its own; a call
refused with a 429 used nothing, one that reported nothing is charged its estimate."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

import dialog_worker
from dialog_worker.config import Settings
from dialog_worker.daemon.model_gate import Attempt, ModelGate
from dialog_worker.engine import model_calls
from dialog_worker.errors import LimitWait, RateLimited
from dialog_worker.metrics import Metrics
from dialog_worker.ops.model_limits import list_limits, list_tenants
from dialog_worker.store import tenants
from dialog_worker.store.scripts import Scripts

pytestmark = pytest.mark.integration

KEY = "llm:gate"
OTHER = "llm:free"  # a key without limits


@pytest_asyncio.fixture
async def r(redis_server) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


class Gate:
    """One worker's gate with its settings, and the operator's view of what it left."""

    def __init__(self, r: Redis, limits: dict[str, Any] | None = None, **settings: Any) -> None:
        if limits:
            settings["model_limits"] = json.dumps(limits)
        self.r, self.settings = r, Settings(**settings)
        self.gate = ModelGate(self.settings, Scripts.register(r), Metrics(CollectorRegistry()))

    def attempt(self, session_id: str, seq: int = 1, attempt: int = 1) -> Attempt:
        return self.gate.attempt(self.gate.keys, session_id, seq, attempt, "default", {})

    async def limits_line(self, key: str = KEY) -> dict[str, Any]:
        [row] = [row for row in await list_limits(self.r, self.settings) if row["key"] == key]
        return row

    async def budget(self, daily_tokens: int) -> None:
        """`tenants set default --daily-tokens N`."""
        await tenants.set_settings(self.r, self.gate.keys, "default", daily_tokens=daily_tokens)

    async def tenants_line(self) -> dict[str, Any]:
        [row] = [r for r in await list_tenants(self.r, self.settings) if r["tenant"] == "default"]
        return row


async def in_step(attempt: Attempt, body: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``body`` as a step's code runs: with the attempt bound for `model_call`."""
    token = model_calls.bind(attempt)
    try:
        return await body()
    finally:
        model_calls.unbind(token)


async def one_call(
    attempt: Attempt, key: str, tokens: int, used: int | None = None, hold_s: float = 0.0
) -> None:
    async def body() -> None:
        async with dialog_worker.model_call(key, tokens=tokens) as call:
            await anyio.sleep(hold_s)
            if used is not None:
                call.usage(used, 0)

    await in_step(attempt, body)


async def test_a_calls_slot_lasts_the_steps_whole_lease_not_a_few_seconds(r: Redis):
    """max_in_flight 1, a lease of step timeout + lock TTL (5 s here): a call holding its
    slot for 2 s keeps the next session's call waiting until it ends (a lease counted in the
    wrong unit, about 1 s here, let it in while the first was still in flight)."""
    g = Gate(r, {KEY: {"max_in_flight": 1}}, step_timeout_s=4, lock_ttl_ms=1000,
             visibility_timeout_ms=30_000)  # fmt: skip
    order: list[str] = []

    async def first() -> None:
        await one_call(g.attempt("a"), KEY, 10, used=10, hold_s=2.0)
        order.append("first ended")

    async def second() -> None:
        await anyio.sleep(1.3)

        async def body() -> None:
            async with dialog_worker.model_call(KEY, tokens=10):
                order.append("second entered")

        await in_step(g.attempt("b"), body)

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        tg.start_soon(second)
    assert order == ["first ended", "second entered"]
    assert (await g.limits_line())["max_in_flight"] == 1


async def test_a_call_handed_back_for_its_turn_gives_its_budget_hold_back(r: Redis):
    """rpm 1: the second call's turn is a minute away, so it is handed back (LimitWait).
    Its estimate is not held while it waits: `tenants` shows only the first call's tokens
    held, and a third call (another key) fits the budget (before: refused for a minute)."""
    g = Gate(r, {KEY: {"rpm": 1}})
    await g.budget(250)
    await one_call(g.attempt("a"), KEY, 100, used=100)
    with pytest.raises(LimitWait):
        await one_call(g.attempt("b"), KEY, 100, used=100)
    assert (await g.tenants_line())["reserved_now"] == 100
    await one_call(g.attempt("c"), OTHER, 100, used=100)  # 100 held + 100 <= 250
    assert (await g.tenants_line())["reserved_now"] == 200


async def test_a_call_refused_with_a_429_used_no_tokens_of_the_keys_rate(r: Redis):
    """tpm 600, an estimate of 30 tokens (3 s of the rate): a call the provider refused with
    a 429 used nothing, so the next call goes at once (before: the refused call was charged
    its estimate, and the next call was handed back for 3 s)."""
    g = Gate(r, {KEY: {"tpm": 600}}, model_call_max_wait_ms=0)

    async def refused() -> None:
        async with dialog_worker.model_call(KEY, tokens=30):
            raise RateLimited(KEY, 1)

    with pytest.raises(RateLimited):
        await in_step(g.attempt("a"), refused)
    await one_call(g.attempt("b"), KEY, 30, used=30)  # no LimitWait: the key's rate is free


async def test_a_call_that_reported_no_usage_is_charged_its_estimate(r: Redis):
    """A call that succeeded without reporting usage: the key's rate and the tenant's budget
    keep its estimate (30 tokens: `tenants` shows them used today, and the next call on a tpm
    of 600 waits 3 s for its turn: handed back). Settled as 0 tokens, the next calls went
    early and the budget lost the tokens."""
    g = Gate(r, {KEY: {"tpm": 600}}, model_call_max_wait_ms=0)
    await g.budget(1000)
    await one_call(g.attempt("a"), KEY, 30, used=None)
    assert (await g.tenants_line())["used_today"] == 30
    with pytest.raises(LimitWait) as waited:
        await one_call(g.attempt("b"), KEY, 30, used=30)
    assert waited.value.why == "tpm"


async def test_two_calls_of_one_step_on_one_key_each_hold_a_slot_and_a_budget_hold(r: Redis):
    """One step, two calls at once on one key: each holds a slot (`limits` in_flight 2) and
    its own estimate (`tenants` reserved_now 2 x 40). Sharing the first's call id, the second
    held neither."""
    g = Gate(r, {KEY: {"max_in_flight": 2}})
    await g.budget(1000)
    attempt = g.attempt("a")
    inside = anyio.Event()
    both = anyio.Event()
    seen: dict[str, Any] = {}

    async def call() -> None:
        async with dialog_worker.model_call(KEY, tokens=40):
            if inside.is_set():
                seen["limits"] = await g.limits_line()
                seen["tenants"] = await g.tenants_line()
                both.set()
            inside.set()
            await both.wait()

    async def step() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await inside.wait()
            tg.start_soon(call)

    with anyio.fail_after(10):
        await in_step(attempt, step)
    assert seen["limits"]["in_flight"] == 2
    assert seen["tenants"]["reserved_now"] == 80


async def test_a_step_cancelled_inside_a_call_gives_its_slot_and_hold_back_at_once(r: Redis):
    """A step cancelled (a cancel, a step timeout) while its call is in flight: the slot
    (max_in_flight 1) and the budget hold come back at once, not when the lease ends: the next
    session's call goes, and `tenants` shows nothing held."""
    g = Gate(r, {KEY: {"max_in_flight": 1}}, model_call_max_wait_ms=0)
    await g.budget(1000)
    inside = anyio.Event()

    async def body() -> None:
        async with dialog_worker.model_call(KEY, tokens=40):
            inside.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(in_step, g.attempt("a"), body)
        await inside.wait()
        tg.cancel_scope.cancel()
    assert (await g.tenants_line())["reserved_now"] == 0
    await one_call(g.attempt("b"), KEY, 40, used=40)  # its slot is free: no LimitWait
