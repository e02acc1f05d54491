"""The model-call scripts on a real redis-server, called as the worker calls them (through
dialog_worker/store/limits.py and store/tenants.py): turns on a limit key (rpm, tpm, pause,
in-flight leases, limits changed at runtime, kept turns), the budget meter, and the usage the
commit writes with a reply."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.config import Settings
from dialog_worker.store import tenants
from dialog_worker.store.keys import Keys
from dialog_worker.store.limits import LimitStore
from dialog_worker.store.scripts import Scripts, Turn

pytestmark = pytest.mark.integration

LEASE_MS = 60_000
KEY = "openai:gpt-test"


@pytest_asyncio.fixture
async def r(redis_server) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


def store(r: Redis, **limits: dict[str, int]) -> LimitStore:
    settings = Settings(model_limits=json.dumps(limits)) if limits else Settings()
    return LimitStore(r, Scripts.register(r), settings)


async def server_ms(r: Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


# --- rates ---------------------------------------------------------------------------------


async def test_rpm_gives_every_caller_its_own_turn_one_interval_apart(r: Redis):
    s = store(r, **{KEY: {"rpm": 600}})  # one call every 100 ms
    answers = [await s.acquire(KEY, f"c{i}", 10, LEASE_MS, 0) for i in range(5)]
    assert answers[0].turn is Turn.GRANTED and answers[0].wait_ms == 0
    assert [a.turn for a in answers[1:]] == [Turn.RESERVED] * 4
    waits = [a.wait_ms for a in answers[1:]]
    for i, wait in enumerate(waits, 1):
        assert i * 100 - 20 <= wait <= i * 100, waits  # a few ms pass between the calls
    assert {a.why for a in answers[1:]} == {"rpm"}


async def test_a_turn_within_the_steps_wait_is_granted_with_its_wait(r: Redis):
    s = store(r, **{KEY: {"rpm": 600}})
    first = await s.acquire(KEY, "a", 10, LEASE_MS, 1000)
    second = await s.acquire(KEY, "b", 10, LEASE_MS, 1000)
    assert (first.turn, second.turn) == (Turn.GRANTED, Turn.GRANTED)
    assert 80 <= second.wait_ms <= 100
    assert await r.zcard(s.keys(KEY).in_flight) == 2, "both hold an in-flight slot"


async def test_tpm_charges_the_estimate_and_settle_corrects_it_by_what_was_used(r: Redis):
    s = store(r, **{KEY: {"tpm": 60_000}})  # one token a ms
    await s.acquire(KEY, "a", 100, LEASE_MS, 0)
    nxt = await s.acquire(KEY, "b", 100, LEASE_MS, 0)
    assert nxt.turn is Turn.RESERVED and 80 <= nxt.wait_ms <= 100 and nxt.why == "tpm"
    # "a" used 1,100 tokens, not 100: the key's token time moves on by the 1,000 more.
    assert await s.settle(KEY, "a", 100, 1100) is True
    third = await s.acquire(KEY, "c", 100, LEASE_MS, 0)
    assert 1150 <= third.wait_ms <= 1200, third
    # Sent twice (a lost reply): corrected once.
    assert await s.settle(KEY, "a", 100, 1100) is False
    fourth = await s.acquire(KEY, "d", 100, LEASE_MS, 0)
    assert 1250 <= fourth.wait_ms <= 1300, fourth


async def test_a_kept_turn_is_granted_to_its_call_without_a_second_charge(r: Redis):
    s = store(r, **{KEY: {"rpm": 600}})
    await s.acquire(KEY, "a", 10, LEASE_MS, 0)
    kept = await s.acquire(KEY, "b", 10, LEASE_MS, 0)
    assert kept.turn is Turn.RESERVED
    early = await s.acquire(KEY, "b", 10, LEASE_MS, 0)
    assert (early.turn, early.why) == (Turn.RESERVED, "reserved"), "back too early: told again"
    tr_before = await r.hget(s.keys(KEY).config, "tr")
    await anyio.sleep(kept.wait_ms / 1000 + 0.01)
    back = await s.acquire(KEY, "b", 99, LEASE_MS, 0)
    assert (back.turn, back.why, back.tokens) == (Turn.GRANTED, "reserved", 10)
    assert await r.hget(s.keys(KEY).config, "tr") == tr_before, "not charged again"
    assert await r.zcard(s.keys(KEY).reserved) == 0
    assert await r.hget(s.keys(KEY).config, "r:b") is None


# --- pauses --------------------------------------------------------------------------------


async def test_a_pause_refuses_every_caller_and_queues_them_in_order_after_it(r: Redis):
    s = store(r, **{KEY: {"rpm": 600}})
    opens_in = await s.pause(KEY, 2.0, "429 from the provider")
    assert 1990 <= opens_in <= 2000
    answers = [await s.acquire(KEY, f"c{i}", 10, LEASE_MS, 1000) for i in range(3)]
    assert [a.turn for a in answers] == [Turn.RESERVED] * 3
    assert answers[0].why == "paused"
    waits = [a.wait_ms for a in answers]
    assert waits[0] >= 1980 and waits == sorted(waits)
    assert waits[1] - waits[0] >= 95 and waits[2] - waits[1] >= 95, "one turn apart, in order"


async def test_an_unlimited_key_reopens_one_caller_at_a_time(r: Redis):
    s = store(r)
    await s.pause(KEY, 1.0, "429")
    waits = [(await s.acquire(KEY, f"c{i}", 10, LEASE_MS, 0)).wait_ms for i in range(3)]
    assert waits[0] >= 980
    assert waits[1] - waits[0] >= 45 and waits[2] - waits[1] >= 45


async def test_a_pause_never_shortens_one_in_force(r: Redis):
    s = store(r)
    await s.pause(KEY, 5.0, "long")
    assert await s.pause(KEY, 1.0, "short") >= 4900
    view = await s.view(KEY)
    assert view["pause_reason"] == "long" and view["paused_until"] is not None


async def test_a_turn_kept_before_a_pause_that_covers_it_is_queued_again_after_it(r: Redis):
    s = store(r, **{KEY: {"rpm": 600}})
    await s.acquire(KEY, "a", 10, LEASE_MS, 0)
    kept = await s.acquire(KEY, "b", 10, LEASE_MS, 0)
    assert kept.turn is Turn.RESERVED and kept.wait_ms <= 100
    await s.pause(KEY, 1.0, "429")
    again = await s.acquire(KEY, "b", 10, LEASE_MS, 5000)
    assert again.turn is Turn.GRANTED and again.wait_ms >= 980 and again.why == "paused"


# --- in flight and runtime limits ------------------------------------------------------------


async def test_max_in_flight_refuses_without_a_charge_and_a_crashed_callers_slot_comes_back(
    r: Redis,
):
    s = store(r, **{KEY: {"max_in_flight": 2}})
    assert (await s.acquire(KEY, "a", 10, LEASE_MS, 0)).turn is Turn.GRANTED
    assert (await s.acquire(KEY, "b", 10, 200, 0)).turn is Turn.GRANTED  # a short lease
    busy = await s.acquire(KEY, "c", 10, LEASE_MS, 0)
    assert (busy.turn, busy.why, busy.tokens) == (Turn.BUSY, "in_flight", 0)
    await s.settle(KEY, "a", 10, 10)
    assert (await s.acquire(KEY, "c", 10, LEASE_MS, 0)).turn is Turn.GRANTED
    assert (await s.acquire(KEY, "d", 10, LEASE_MS, 0)).turn is Turn.BUSY
    await anyio.sleep(0.25)  # "b"'s holder never settled (killed): its lease ends
    assert (await s.acquire(KEY, "d", 10, LEASE_MS, 0)).turn is Turn.GRANTED


async def test_limits_set_at_runtime_win_over_the_settings(r: Redis):
    s = store(r, **{KEY: {"rpm": 60}})  # one call a second
    await s.acquire(KEY, "a", 10, LEASE_MS, 0)
    slow = await s.acquire(KEY, "b", 10, LEASE_MS, 0)
    assert slow.wait_ms >= 900
    now_limits = await s.set(KEY, rpm=0)  # no rpm limit now, for every worker
    assert now_limits.as_dict() == {"rpm": 0, "tpm": 0, "max_in_flight": 0}
    assert (await s.acquire(KEY, "c", 10, LEASE_MS, 0)).wait_ms == 0
    await s.set(KEY, max_in_flight=1)
    assert (await s.acquire(KEY, "d", 10, LEASE_MS, 0)).turn is Turn.BUSY
    assert KEY in await s.known()
    assert (await s.view(KEY))["source"] == "runtime"


async def test_acquire_refuses_bad_arguments_and_writes_nothing(r: Redis):
    s = store(r)
    k = s.keys(KEY)
    for args in (["", 1, 0, 0, 0, 100, 0], ["a", -1, 0, 0, 0, 100, 0], ["a", 1.5, 0, 0, 0, 100, 0],
                 ["a", 1, "x", 0, 0, 100, 0], ["a", 1, 0, 0, 0, 0, 0]):  # fmt: skip
        with pytest.raises(ResponseError, match="bad arguments"):
            await s.scripts.acquire(keys=[k.config, k.in_flight, k.reserved], args=args)
    await r.set(k.in_flight, "not a set")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await s.acquire(KEY, "a", 1, LEASE_MS, 0)
    assert await r.exists(k.config, k.reserved) == 0


# --- budgets -------------------------------------------------------------------------------


async def test_a_budget_reserves_estimates_and_spends_what_calls_used(r: Redis):
    scripts, keys = Scripts.register(r), Keys.from_settings(Settings())
    day = tenants.today()

    async def reserve(call: str, tokens: int, lease_ms: int = LEASE_MS) -> tenants.Reservation:
        return await tenants.reserve(scripts, keys, "acme", day, call, tokens, 1000, lease_ms)

    assert (await reserve("a", 600)).granted
    refused = await reserve("b", 600)
    assert (refused.granted, refused.spent, refused.reserved) == (False, 0, 600)
    assert await tenants.spend(scripts, keys, "acme", day, "a", 500) == 500
    assert await tenants.spend(scripts, keys, "acme", day, "a", 500) == 500, "counted once"
    assert (await reserve("b", 500)).granted
    assert not (await reserve("c", 1)).granted, "500 spent + 500 reserved"
    assert await tenants.spent(r, keys, "acme", day) == 500
    # A reservation whose caller died lapses with its lease.
    await tenants.spend(scripts, keys, "acme", day, "b", 0)
    assert (await reserve("d", 400, lease_ms=100)).granted
    assert not (await reserve("e", 400)).granted
    await anyio.sleep(0.15)
    assert (await reserve("e", 400)).granted
    assert await r.ttl(keys.budget("acme", day).meter) > 86400


async def test_concurrent_calls_pass_a_budget_by_no_more_than_what_they_used_beyond_estimates(
    r: Redis,
):
    scripts, keys = Scripts.register(r), Keys.from_settings(Settings())
    day, budget, estimate, actual = tenants.today(), 10_000, 500, 600
    granted: list[str] = []

    async def call(i: int) -> None:
        got = await tenants.reserve(scripts, keys, "t", day, f"c{i}", estimate, budget, LEASE_MS)
        if got.granted:
            granted.append(f"c{i}")
            await anyio.sleep(0.01)
            await tenants.spend(scripts, keys, "t", day, f"c{i}", actual)

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(call, i)
    spent = await tenants.spent(r, keys, "t", day)
    assert budget // actual <= len(granted) <= budget // estimate
    assert spent == len(granted) * actual
    assert spent - budget <= len(granted) * (actual - estimate)
