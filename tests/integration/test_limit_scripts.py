"""The model-call scripts on a real redis-server, called as the worker calls them (through
dialog_worker/store/limits.py and store/tenants.py): turns on a limit key (rpm, tpm, pause,
in-flight leases, limits changed at runtime, kept turns), the budget meter, and the usage the
commit writes with a reply."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.config import Settings
from dialog_worker.store import tenants
from dialog_worker.store.keys import Keys, Topology
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


async def test_a_tpm_set_at_runtime_corrects_a_calls_charge_by_what_it_used(r: Redis):
    """No tpm in the settings, 600 set at runtime (`limits set --tpm`): a call charged 60
    tokens (6 s of the rate) that used none gives them back, so the next call goes at once
    (the settle read only the settings' tpm: the next call waited 6 s)."""
    s = store(r)
    await s.set(KEY, tpm=600)
    first = await s.acquire(KEY, "a", 60, LEASE_MS, 0)
    assert (first.turn, first.tokens) == (Turn.GRANTED, 60)
    assert await s.settle(KEY, "a", 60, 0) is True
    nxt = await s.acquire(KEY, "b", 6, LEASE_MS, 0)
    assert nxt.turn is Turn.GRANTED and nxt.wait_ms <= 100, nxt


async def test_limits_shows_the_last_whole_minutes_calls_and_tokens(r: Redis):
    """The `limits` line's calls_last_minute and tokens_last_minute are the last whole
    minute's: while the calls are in the running minute they are not shown (that minute is not
    over), and a minute on they are, calls as calls and tokens as tokens."""
    s = store(r, **{KEY: {"rpm": 60_000}})
    if time.time() % 60 > 55:  # the calls and the first look in one minute
        await anyio.sleep(60 - time.time() % 60 + 0.1)
    for call in ("a", "b", "c"):
        assert (await s.acquire(KEY, call, 100, LEASE_MS, 1000)).turn is Turn.GRANTED
    row = await s.view(KEY)
    assert (row["calls_last_minute"], row["tokens_last_minute"]) == (0, 0), "running minute"
    # A minute on (the counts' minute moved back one, as the clock moving on one would).
    await r.hincrby(s.keys(KEY).config, "mb", -1)
    row = await s.view(KEY)
    assert (row["calls_last_minute"], row["tokens_last_minute"]) == (3, 300)
    await r.hincrby(s.keys(KEY).config, "mb", -1)
    row = await s.view(KEY)
    assert (row["calls_last_minute"], row["tokens_last_minute"]) == (0, 0), "two minutes on"


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


@pytest.mark.parametrize("retry_after_s", [None, 0.0, 0.2])
async def test_a_providers_429_pauses_a_floor_that_doubles_with_each_429_after_it_reopens(
    r: Redis, retry_after_s: float | None
):
    """No wait named (None: a negative or unreadable Retry-After; 0 or a past date), or a
    shorter one: the first 429 pauses 1 s, a 429 after the key reopened 2 s, then 4 s; a 429
    while the key is paused (a call already under way) is the same pause."""
    s = store(r)
    first = await s.provider_pause(KEY, retry_after_s, "429")
    assert 990 <= first <= 1000
    assert 990 <= await s.provider_pause(KEY, retry_after_s, "429 of a call under way") <= 1000
    assert (await s.view(KEY))["provider_429s_in_a_row"] == 1
    for doubled in (2000, 4000):
        await r.hset(s.keys(KEY).config, "pu", await server_ms(r) - 1)  # the key reopened
        assert doubled - 10 <= await s.provider_pause(KEY, retry_after_s, "429") <= doubled


async def test_a_providers_retry_after_is_kept_between_the_floor_and_the_cap(r: Redis):
    s = LimitStore(r, Scripts.register(r), Settings(max_provider_pause_s=30.0))
    assert 4990 <= await s.provider_pause(KEY, 5.0, "429") <= 5000
    await r.hset(s.keys(KEY).config, "pu", 0)
    assert 29_990 <= await s.provider_pause(KEY, 86_400.0, "429, a day") <= 30_000


async def test_a_call_that_succeeds_ends_the_providers_run_of_429s(r: Redis):
    s = store(r, **{KEY: {"rpm": 60_000}})
    for _ in range(3):
        await r.hset(s.keys(KEY).config, "pu", 0)
        await s.provider_pause(KEY, 0.0, "429")
    assert (await s.view(KEY))["provider_429s_in_a_row"] == 3
    await r.hset(s.keys(KEY).config, "pu", 0)
    failed = await s.acquire(KEY, "failed", 10, LEASE_MS, 1000)
    await s.settle(KEY, "failed", failed.tokens, None, succeeded=False)
    assert (await s.view(KEY))["provider_429s_in_a_row"] == 3, "a failed call ends nothing"
    ok = await s.acquire(KEY, "ok", 10, LEASE_MS, 1000)
    await s.settle(KEY, "ok", ok.tokens, 12, succeeded=True)
    assert (await s.view(KEY))["provider_429s_in_a_row"] == 0
    assert 990 <= await s.provider_pause(KEY, 0.0, "429") <= 1000, "the first floor again"


async def test_pause_refuses_bad_arguments_and_writes_nothing(r: Redis):
    scripts, conf = Scripts.register(r), store(r).keys(KEY).config
    for args in (
        [-1, "why", "operator"],
        [1000, "why", "other"],
        [1000, "why", "provider", 0, 10, 10],
        [1000, "why", "provider", 10, 5, 10],
        [1000, "why", "provider", 10, 10, 8 * 86_400_000],
        [1000, "x" * 501, "operator"],
    ):
        with pytest.raises(ResponseError, match="bad arguments"):
            await scripts.pause(keys=[conf], args=args)
    assert await r.exists(conf) == 0


async def test_a_reopened_key_lets_its_waiting_calls_go_from_now_in_their_order(r: Redis):
    """A 60 s pause with three callers queued after it (rpm 600: 100 ms apart): reopened, their
    kept turns come from now, still in order and 100 ms apart, and a new caller goes after
    them; the pause, its reason and the provider's 429s in a row are gone."""
    s = store(r, **{KEY: {"rpm": 600}})
    await s.provider_pause(KEY, 60.0, "429")
    kept = [await s.acquire(KEY, f"c{i}", 10, LEASE_MS, 1000) for i in range(3)]
    assert [a.turn for a in kept] == [Turn.RESERVED] * 3 and kept[0].wait_ms > 59_000
    early = await s.reopen(KEY)
    assert 59_000 < early <= 60_000
    view = await s.view(KEY)
    assert (view["paused_until"], view["pause_reason"], view["provider_429s_in_a_row"]) == (
        None, "", 0)  # fmt: skip
    back = [await s.acquire(KEY, f"c{i}", 999, LEASE_MS, 1000) for i in range(3)]
    assert [(a.turn, a.why) for a in back] == [(Turn.GRANTED, "reserved")] * 3
    waits = [a.wait_ms for a in back]
    assert waits[0] <= 50 and 80 <= waits[1] - waits[0] <= 120 and 80 <= waits[2] - waits[1] <= 120
    new = await s.acquire(KEY, "new", 10, LEASE_MS, 1000)
    # Its turn, 300 ms away, is beyond the key's horizon (250 ms): it waits in its tenant's
    # queue, told to come back then.
    assert new.turn is Turn.RESERVED and new.wait_ms >= waits[2] + 80, "after those who waited"
    assert (await s.runtime(KEY)).reopens == 1


async def test_a_reopened_key_without_a_rate_lets_its_kept_turns_go_from_now(r: Redis):
    """A key with no rate keeps a turn for each call refused during a pause, one caller every
    50 ms after its end (the only place such turns are kept: a key with a rate queues them
    by tenant): reopened, those turns come from now, in order and still 50 ms apart."""
    s = store(r, **{KEY: {}})
    await s.provider_pause(KEY, 60.0, "429")
    kept = [await s.acquire(KEY, f"c{i}", 10, LEASE_MS, 1000) for i in range(3)]
    assert [a.turn for a in kept] == [Turn.RESERVED] * 3 and kept[0].wait_ms > 59_000
    assert 59_000 < await s.reopen(KEY) <= 60_000
    back = [await s.acquire(KEY, f"c{i}", 999, LEASE_MS, 1000) for i in range(3)]
    assert [(a.turn, a.why) for a in back] == [(Turn.GRANTED, "reserved")] * 3
    waits = [a.wait_ms for a in back]
    assert waits[0] <= 50 and 30 <= waits[1] - waits[0] <= 70 and 30 <= waits[2] - waits[1] <= 70


async def test_reopening_a_key_that_is_not_paused_writes_nothing(r: Redis):
    s = store(r, **{KEY: {"rpm": 600}})
    assert await s.reopen(KEY) == 0
    assert await r.exists(s.keys(KEY).config) == 0
    await s.acquire(KEY, "a", 10, LEASE_MS, 1000)
    before = await r.hgetall(s.keys(KEY).config)
    assert await s.reopen(KEY) == 0
    assert await r.hgetall(s.keys(KEY).config) == before, "sent twice: the second does nothing"


async def test_a_turn_kept_before_a_pause_that_covers_it_is_queued_again_after_it(r: Redis):
    s = store(r, **{KEY: {"rpm": 600}})
    await s.acquire(KEY, "a", 10, LEASE_MS, 0)
    kept = await s.acquire(KEY, "b", 10, LEASE_MS, 0)
    assert kept.turn is Turn.RESERVED and kept.wait_ms <= 100
    await s.pause(KEY, 1.0, "429")
    again = await s.acquire(KEY, "b", 10, LEASE_MS, 5000)
    # Queued after the pause (its turn is beyond the key's horizon): told to come back then.
    assert again.turn is Turn.RESERVED and again.wait_ms >= 980 and again.why == "paused"
    assert await r.hget(s.keys(KEY).config, "r:b") is None, "its old turn is gone"


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


async def test_limits_stops_counting_a_crashed_callers_slot_in_flight_when_its_lease_ends(
    r: Redis,
):
    """`limits` in_flight is the calls holding a slot now: a caller that died with its slot
    (never settled) counts until its lease ends, not until the key's next call (before: a
    key nobody called again showed it in flight for good)."""
    s = store(r, **{KEY: {"max_in_flight": 2}})
    assert (await s.acquire(KEY, "a", 10, LEASE_MS, 0)).turn is Turn.GRANTED
    assert (await s.acquire(KEY, "b", 10, 200, 0)).turn is Turn.GRANTED  # a short lease
    assert (await s.view(KEY))["in_flight"] == 2
    await anyio.sleep(0.3)  # "b"'s holder never settled (killed): its lease ended
    assert (await s.view(KEY))["in_flight"] == 1


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
    await r.delete(k.in_flight)
    await r.set(f"{k.config}:q:acme", "not a queue")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await s.acquire(KEY, "a", 1, LEASE_MS, 0, tenant="acme")
    assert await r.exists(k.config, k.reserved, k.in_flight) == 0


async def test_another_tenants_queue_of_another_type_fails_no_call(r: Redis):
    """A tenant's queue at the key written by hand as another type: that tenant is passed
    over, and the other tenants' calls go on."""
    s = store(r, **{KEY: {"rpm": 600}})
    for i in range(3):
        await s.acquire(KEY, f"c{i}", 10, LEASE_MS, 1000)
    conf = s.keys(KEY).config
    await r.zadd(f"{conf}:fair", {"bad": 0})
    await r.set(f"{conf}:q:bad", "not a queue")
    queued = await s.acquire(KEY, "x", 10, LEASE_MS, 1000, tenant="ok")
    assert queued.turn is Turn.RESERVED
    await r.hset(conf, "tr", 0)
    back = await s.acquire(KEY, "x", 10, LEASE_MS, 1000, tenant="ok")
    assert back.turn is Turn.GRANTED


# --- budgets -------------------------------------------------------------------------------


class Budget:
    """A tenant's budget of today as the worker meets it: holds on its meter, and the usage
    counters a commit writes (``commit``: what the calls of an attempt used, then their holds
    go, as the pipeline does)."""

    def __init__(self, r: Redis, tenant: str = "acme", budget: int = 1000) -> None:
        self.r, self.tenant, self.budget = r, tenant, budget
        self.scripts, self.keys = Scripts.register(r), Keys.from_settings(Settings())
        self.topology = Topology.from_settings(Settings())
        self.day = tenants.today()

    async def reserve(
        self, call: str, tokens: int, lease_ms: int = LEASE_MS
    ) -> tenants.Reservation:
        return await tenants.reserve(
            self.r, self.scripts, self.topology, self.keys, self.tenant, self.day, call, tokens,
            self.budget, lease_ms,
        )  # fmt: skip

    async def spend(self, call: str, used: int | None) -> None:
        await tenants.spend(self.scripts, self.keys, self.tenant, self.day, call, used)

    async def commit(self, calls: list[str], tokens: int, wasted: bool = False) -> None:
        field = f"{self.tenant}:{'win' if wasted else 'in'}"
        await self.r.hincrby(self.keys.usage(self.day), field, tokens)
        await tenants.land(self.scripts, self.keys, self.tenant, self.day, calls)

    async def used(self) -> tuple[int, int]:
        return await tenants.used_today(self.r, self.topology, self.keys, self.tenant, self.day)


async def test_a_budget_holds_estimates_and_counts_what_the_day_used(r: Redis):
    b = Budget(r)
    assert (await b.reserve("a", 600)).granted
    refused = await b.reserve("b", 600)
    assert (refused.granted, refused.used, refused.reserved) == (False, 0, 600)
    assert await b.used() == (0, 600), "a refused call holds nothing"
    await b.spend("a", 500)
    await b.spend("a", 500)  # sent twice: counted once
    assert await b.used() == (0, 500), "it ended: its hold is what it used, until counted"
    assert (await b.reserve("b", 500)).granted
    assert not (await b.reserve("c", 1)).granted, "500 held + 500 held"
    await b.commit(["a"], 500)
    assert await b.used() == (500, 500), "counted by the commit: a's hold went"
    await b.commit(["a"], 0)  # its land sent twice: nothing more goes
    assert await b.used() == (500, 500)
    assert await r.ttl(b.keys.budget("acme", b.day).meter) > 86400


@pytest.mark.parametrize("outcome", ["outage", "reported", "unreported"])
async def test_a_call_that_used_nothing_gives_its_hold_back_at_once(r: Redis, outcome: str):
    """An outage, a refusal, a 429 (nothing reported: 0): the estimate comes back at once. A
    call that reported usage keeps it held until its attempt is counted; one that succeeded
    reporting nothing is charged its estimate for the day (unreported)."""
    b = Budget(r, budget=1000)
    assert (await b.reserve("a", 800)).granted
    used = {"outage": 0, "reported": 300, "unreported": None}[outcome]
    await b.spend("a", used)
    await b.spend("a", used)  # sent twice (a lost reply): counted once
    want = {"outage": (0, 0), "reported": (0, 300), "unreported": (800, 0)}[outcome]
    assert await b.used() == want
    assert (await b.reserve("b", 1000 - sum(want))).granted
    assert not (await b.reserve("c", 1)).granted


async def test_a_budget_set_late_sees_what_the_day_committed_before_it(r: Redis):
    b = Budget(r, budget=360)
    await r.hset(b.keys.usage(b.day), mapping={"acme:in": 300, "acme:out": 146, "other:in": 9})
    assert await b.used() == (446, 0)
    assert not (await b.reserve("a", 1)).granted
    b.budget = 500
    assert (await b.reserve("a", 54)).granted
    assert not (await b.reserve("b", 1)).granted


async def test_a_lapsed_hold_gives_an_estimate_back_and_charges_what_an_ended_call_used(
    r: Redis,
):
    """A worker died: its call in flight gives its estimate back; its call that had ended
    (usage reported, never counted: its attempt died with it) is charged what it reported."""
    b = Budget(r)
    assert (await b.reserve("flying", 400, lease_ms=100)).granted
    assert (await b.reserve("ended", 300, lease_ms=100)).granted
    await b.spend("ended", 250)
    assert await b.used() == (0, 650)
    await anyio.sleep(0.15)
    assert (await b.reserve("next", 10)).granted
    assert await b.used() == (250, 10)


async def test_a_hold_lapses_by_its_lease_while_its_meter_is_kept(r: Redis):
    """A meter kept 5 s (a day and more in the worker) and a hold of 100 ms: the hold lapses
    after its lease and its estimate comes back, because its lease is kept as long as the
    meter (a lease list kept 5 ms, the keep taken as ms, lost the hold: its estimate stayed
    held for good)."""
    b = Budget(r)
    meter = b.keys.budget("acme", b.day)
    await b.scripts.reserve(keys=[meter.meter, meter.leases], args=["a", 400, 100, 5])
    await anyio.sleep(0.2)
    unreported, held = await b.scripts.reserve(
        keys=[meter.meter, meter.leases], args=["b", 10, 60_000, 5]
    )
    assert (int(unreported), int(held)) == (0, 10)


async def test_concurrent_calls_pass_a_budget_by_no_more_than_what_they_used_beyond_estimates(
    r: Redis,
):
    b = Budget(r, tenant="t", budget=10_000)
    estimate, actual = 500, 600
    granted: list[str] = []

    async def call(i: int) -> None:
        got = await b.reserve(f"c{i}", estimate)
        if got.granted:
            granted.append(f"c{i}")
            await anyio.sleep(0.01)
            await b.spend(f"c{i}", actual)
            await b.commit([f"c{i}"], actual)

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(call, i)
    spent, held = await b.used()
    assert held == 0
    assert b.budget // actual <= len(granted) <= b.budget // estimate
    assert spent == len(granted) * actual
    assert spent - b.budget <= len(granted) * (actual - estimate)


async def test_budget_scripts_refuse_bad_arguments_and_write_nothing(r: Redis):
    b = Budget(r)
    meter = b.keys.budget("acme", b.day)
    for script, args in (
        (b.scripts.reserve, ["", 10, 1000, 60]),
        (b.scripts.reserve, ["a", -1, 1000, 60]),
        (b.scripts.spend, ["a", -2, 60]),
        (b.scripts.spend, ["a", 1.5, 60]),
        (b.scripts.land, []),
        (b.scripts.land, [""]),
    ):
        with pytest.raises(ResponseError, match="bad arguments"):
            await script(keys=[meter.meter, meter.leases], args=args)
    assert await r.exists(meter.meter, meter.leases) == 0


async def queue_behind_three(s: LimitStore) -> None:
    """rpm 600 (100 ms apart, horizon 250 ms): three calls take the next turns, and the key's
    further turns are beyond its horizon."""
    for i in range(3):
        assert (await s.acquire(KEY, f"c{i}", 10, LEASE_MS, 1000)).turn is Turn.GRANTED


async def test_a_queued_call_whose_caller_is_gone_is_dropped_when_its_turn_comes(r: Redis):
    """A queued call holds no turn: when the key's next turn comes and its caller is long past
    the time it was told to come back (crashed), it is dropped, and the turn goes to the next
    call in the fair order, not to nobody."""
    s = store(r, **{KEY: {"rpm": 600}})
    await queue_behind_three(s)
    gone = await s.acquire(KEY, "gone", 10, LEASE_MS, 1000, tenant="t")
    assert gone.turn is Turn.RESERVED and gone.tokens == 0, "queued, charged nothing"
    conf = s.keys(KEY).config
    await r.hset(f"{conf}:calls", "gone", "10 1")  # its caller is past its grace
    await r.hset(conf, "tr", 0)  # the key's next turn is now
    came = await s.acquire(KEY, "came", 10, LEASE_MS, 1000, tenant="t")
    assert came.turn is Turn.GRANTED and came.wait_ms < 50, "the turn goes to a live call"
    assert await r.hget(conf, "r:gone") is None and await r.zcard(f"{conf}:q:t") == 0
    assert await r.zcard(f"{conf}:fair") == 0, "no tenant left waiting"


async def test_priority_orders_a_tenants_queued_calls_at_the_key(r: Redis):
    """Inside a tenant, a queued call of a higher priority gets the key's next turn before an
    earlier one of a lower priority; the other is handed the turn after it."""
    s = store(r, **{KEY: {"rpm": 600}})
    await queue_behind_three(s)  # (names: a tie of places would go to "a-low")
    low = await s.acquire(KEY, "a-low", 10, LEASE_MS, 1000, tenant="t", priority=5)
    high = await s.acquire(KEY, "z-high", 10, LEASE_MS, 1000, tenant="t", priority=9)
    assert (low.turn, high.turn) == (Turn.RESERVED, Turn.RESERVED)
    assert high.wait_ms <= low.wait_ms + 5, "first in its tenant's queue: no later than low"
    conf = s.keys(KEY).config
    await r.hset(conf, "tr", 0)  # the key's next turn is now
    back = await s.acquire(KEY, "z-high", 10, LEASE_MS, 1000, tenant="t", priority=9)
    assert back.turn is Turn.GRANTED and back.wait_ms < 50
    kept = await r.hget(conf, "r:a-low")
    assert kept is not None, "the next turn is handed to the queued call"


async def test_a_tenant_behind_anothers_queue_gets_the_next_turn(r: Redis):
    """Tenant a has calls queued at the key; b's first call waits only for the turns already
    handed out within the key's horizon, then goes before a's other queued calls (b's virtual
    time is the key's clock, a's moved on with each turn a was given)."""
    s = store(r, **{KEY: {"rpm": 600}})
    await queue_behind_three(s)
    for i in range(6):
        await s.acquire(KEY, f"a{i}", 10, LEASE_MS, 1000, tenant="a")
    conf = s.keys(KEY).config
    await r.hset(conf, "tr", 0)
    first = await s.acquire(KEY, "a0", 10, LEASE_MS, 1000, tenant="a")
    assert first.turn is Turn.GRANTED  # a's turns within the horizon: a0, a1, a2
    b = await s.acquire(KEY, "b0", 10, LEASE_MS, 1000, tenant="b")
    assert b.turn is Turn.RESERVED and b.wait_ms <= 350, "b behind the turns handed, only"
    await r.hset(conf, "tr", 0)
    back = await s.acquire(KEY, "b0", 10, LEASE_MS, 1000, tenant="b")
    assert back.turn is Turn.GRANTED and back.wait_ms < 50, "b before a's other queued calls"


async def test_a_tie_of_virtual_times_goes_to_the_tenant_that_waited(r: Redis):
    """Tenant a's calls went at once (a was never served from the queue), then tenant z's call
    waits, then a's next call finds z waiting and waits too: both start at the key's clock, and
    the next turn goes to z, which waited first, not to a by its name."""
    s = store(r, **{KEY: {"rpm": 600}})
    for i in range(3):
        await s.acquire(KEY, f"a{i}", 10, LEASE_MS, 1000, tenant="a")
    z = await s.acquire(KEY, "z0", 10, LEASE_MS, 1000, tenant="z")
    a = await s.acquire(KEY, "a3", 10, LEASE_MS, 1000, tenant="a")
    assert (z.turn, a.turn) == (Turn.RESERVED, Turn.RESERVED)
    await r.hset(s.keys(KEY).config, "tr", 0)  # the key's next turn is now
    back = await s.acquire(KEY, "z0", 10, LEASE_MS, 1000, tenant="z")
    assert back.turn is Turn.GRANTED and back.wait_ms < 50, "z waited: the turn is z's"
