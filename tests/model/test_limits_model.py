"""Model-checked limit keys and budgets: random interleavings of acquire, settle, pause (one
limit key) and reserve, spend, land (one tenant's budget of the day) on a real redis-server,
checked after every call against a model of what the scripts promise.

Callers c0..c5 make model calls: acquire a turn (with or without a wait inside the step),
come back for a kept turn, settle (sometimes twice, as after a lost reply; sometimes never: a
crashed caller), and reserve from / spend on the budget. Operators and 429s pause the key.
The limits (rpm, tpm, max_in_flight) are drawn per example, and changed at runtime.

Time: the scripts read Redis TIME. `time_passes` moves the key's and the budget's clock by
shifting every time they store back by the same amount (arrival times, the pause, kept turns,
leases), which is what the clock moving on would do; the model keeps the same offset. Real
time passing during an example (milliseconds) is far below every interval used (seconds).

Checked (from what Redis holds and what each call answered):
- a turn handed out fresh is never before the pause in force, nor less than 60000/rpm ms after
  the previous fresh turn, nor before the key's token time (tpm); its charge moves the
  arrival times exactly; settle corrects the token time by used - charged, once per call;
- a kept turn is granted to its own call only, without a second charge, unless a later pause
  covers it (it is queued again after the pause);
- never more than max_in_flight calls hold a slot (a BUSY answer only when it is full); a
  crashed caller's slot comes back when its lease ends;
- a pause never shortens one in force; a provider's pause lasts at least the floor (doubling
  with each 429 after the key reopened, back to the first after a call succeeded) and at most
  the cap, whatever its Retry-After says; a 429 while paused neither moves the floor nor
  lengthens the pause beyond what its Retry-After asks;
- the budget counts the day: a call is granted exactly when the tenant's usage counters of the
  day (committed and wasted, whenever they were written: with or without a budget set, which
  changes at any time) + unreported + what calls hold + its estimate stay within the budget;
  the meter holds each call's estimate while it runs, what it reported until its attempt's
  usage is in the counters, and gives back at once what a call that used nothing held; a
  success that reported nothing is charged its estimate, once; a lapsed hold gives an estimate
  back and charges what an ended call reported.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from redis_server import RedisServer

from dialog_worker.store.keys import budget_keys, limit_keys
from dialog_worker.store.scripts import Turn, source

pytestmark = pytest.mark.integration

KEY = "prov:model"
LEASE_MS = 20_000
BUDGET = 1000
BUDGET_LEASE_MS = 30_000
CALLERS = 6
FLOOR_MS, FLOOR_MAX_MS, CAP_MS = 1_000, 60_000, 600_000  # a provider's pause: floor and cap
TOL_MS = 1000  # real time an example may take, at most (every interval is far above it)
GRACE_MS = 600_000 - TOL_MS  # acquire-3.lua's RESERVATION_GRACE_MS, less the fuzz

SETTINGS = settings(
    max_examples=int(os.environ.get("MODEL_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    derandomize=not os.environ.get("MODEL_EXPLORE"),
    database=None,
    print_blob=True,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
    # MODEL_NO_SHRINK=1 (the mutation check's setting): the first failing example as found.
    **(
        {"phases": [Phase.explicit, Phase.reuse, Phase.generate]}
        if os.environ.get("MODEL_NO_SHRINK")
        else {}
    ),
)

callers = st.integers(0, CALLERS - 1)


class LimitScripts(RuleBasedStateMachine):
    def __init__(self, r: redis.Redis) -> None:
        super().__init__()
        self.r = r
        r.flushall()
        self.acquire = r.register_script(source("acquire"))
        self.settle_script = r.register_script(source("settle"))
        self.pause_script = r.register_script(source("pause"))
        self.reserve_script = r.register_script(source("reserve"))
        self.spend_script = r.register_script(source("spend"))
        self.land_script = r.register_script(source("land"))
        self.k = limit_keys("t", KEY)
        self.b = budget_keys("t", "acme", "20260101")
        self.shift = 0  # ms the model's clock is ahead of Redis's (time_passes)
        self.calls = [0] * CALLERS  # each caller's current call number (its call id)
        # caller -> (tokens charged, its lease's end) of a granted call not settled yet
        self.in_flight: dict[int, tuple[int, int]] = {}
        # call id -> lease end (model time) of a dead call (a caller may die more than once)
        self.crashed: dict[str, int] = {}
        self.kept: dict[int, tuple[float, int]] = {}  # caller -> (turn, tokens) kept for it
        self.queued: dict[int, int] = {}  # caller -> tokens: waits in the key's queue
        self.tr = self.tt = 0.0  # arrival times (model time) as the model predicts them
        self.pu = 0  # paused until (model time)
        self.reserved: dict[str, int] = {}  # holds of calls in flight: call id -> estimate
        self.ended: dict[str, int] = {}  # holds of ended calls not counted yet: id -> used
        self.budget_leases: dict[str, int] = {}  # call id -> lease end (model time)
        self.unreported = 0  # charged outside the counters (reported nothing, or lost)
        self.counted = 0  # the tenant's usage counters of the day
        self.budget = 1000
        self.usage = "t:{0}:ready:usage:20260101"  # a shard's usage counters of the day
        self.bcalls = [0] * CALLERS  # each caller's budget call number
        self.refusals = 0  # the provider's 429s in a row (lua/pause-1.lua)

    @initialize(
        rpm=st.sampled_from([0, 1, 2]),
        tpm=st.sampled_from([0, 600, 6000]),
        mif=st.sampled_from([0, 1, 2]),
    )
    def limits(self, rpm: int, tpm: int, mif: int) -> None:
        self.rpm, self.tpm, self.mif = rpm, tpm, mif
        note(f"limits rpm={rpm} tpm={tpm} max_in_flight={mif}")

    # --- helpers ---

    def now(self) -> int:
        sec, usec = self.r.time()
        return int(sec) * 1000 + int(usec) // 1000 + self.shift

    def call_id(self, c: int) -> str:
        return f"c{c}#{self.calls[c]}"

    def stored(self, name: str) -> float:
        value = self.r.hget(self.k.config, name)
        return float(value) + self.shift if value is not None else 0.0

    def live_in_flight(self) -> int:
        return int(self.r.zcount(self.k.in_flight, self.now() - self.shift, "+inf"))

    # --- the key ---

    @rule(c=callers, tokens=st.sampled_from([0, 50, 300]), wait_s=st.sampled_from([0, 20]))
    def acquire_turn(self, c: int, tokens: int, wait_s: int) -> None:
        if c in self.in_flight or c in self.kept or c in self.queued:
            return
        self.calls[c] += 1
        self._acquire(c, tokens, wait_s * 1000)

    @rule(c=callers, wait_s=st.sampled_from([0, 20]))
    def come_back(self, c: int, wait_s: int) -> None:
        """A caller whose turn was kept, or who waits in the key's queue, comes back (early,
        on time or late)."""
        if c in self.kept:
            self._acquire(c, 999, wait_s * 1000)
        elif c in self.queued:
            self._acquire(c, self.queued[c], wait_s * 1000)

    def _acquire(self, c: int, tokens: int, max_wait: int) -> None:
        before = self.now()
        # Slots whose lease ended come back; kept turns nobody came back for lapse.
        self.in_flight = {k: v for k, v in self.in_flight.items() if v[1] > before}
        self.crashed = {k: end for k, end in self.crashed.items() if end > before}
        self.kept = {k: v for k, v in self.kept.items() if v[0] > before - GRACE_MS}
        full = self.mif > 0 and len(self.in_flight) + len(self.crashed) >= self.mif
        kept_before = self.kept_turns()
        code, wait, why, charged = self.acquire(
            keys=[self.k.config, self.k.in_flight, self.k.reserved],
            args=[self.call_id(c), tokens, self.rpm, self.tpm, self.mif, LEASE_MS, max_wait],
        )
        after = self.now()
        turn, why = Turn(int(code)), why.decode()
        note(f"acquire {self.call_id(c)} tokens={tokens} max_wait={max_wait} -> "
             f"{turn.name} wait={wait} {why}")  # fmt: skip
        kept = self.kept.get(c)
        if kept is not None and self.pu > before and kept[0] < self.pu:
            del self.kept[c]  # voided by the pause: queued again as a fresh call
            kept = None
        if kept is not None:
            at, kept_tokens = kept
            if at - after > max_wait + TOL_MS:
                assert (turn, why) == (Turn.RESERVED, "reserved"), "back early: told again"
            elif at - before < max_wait - TOL_MS and full:
                assert turn is Turn.BUSY, "max_in_flight full"
            elif turn is Turn.GRANTED:
                assert (why, int(charged)) == ("reserved", kept_tokens), "not charged again"
                del self.kept[c]
                self._granted(c, kept_tokens)
            else:  # its turn right at the edge of the wait: told again, or BUSY
                assert turn in (Turn.RESERVED, Turn.BUSY) and abs(at - before - max_wait) < TOL_MS
            return
        if full:
            assert (turn, int(charged)) == (Turn.BUSY, 0), f"max_in_flight {self.mif} full"
            return
        assert turn is not Turn.BUSY, "BUSY while slots were free"
        if self.rpm or self.tpm:
            self._fair_turns(c, tokens, max_wait, before, after, turn, int(wait), kept_before)
            return
        # A fresh turn on a key without a rate: after the pause, if any.
        score = self.r.zscore(self.k.reserved, self.call_id(c))
        at = score + self.shift if score is not None else float(before + wait)
        if not self.pu > before:
            assert abs((at - wait) - before) <= (after - before) + 2, "its wait says its turn"
        else:  # an unlimited key in a pause: one caller at a time, after the pause
            assert at >= self.pu - 1, "a turn inside the pause"
        if turn is Turn.GRANTED:
            assert wait <= max_wait
            self._granted(c, tokens)
        else:
            assert turn is Turn.RESERVED and wait > max_wait
            assert score is not None and abs(score + self.shift - at) < 1, "its turn is kept"
            self.kept[c] = (score + self.shift, tokens)

    def kept_turns(self) -> dict[str, tuple[float, int]]:
        """The turns the key keeps for calls (r:<call id> = '<turn>:<tokens>'), model time."""
        out = {}
        for field, value in self.r.hgetall(self.k.config).items():
            if field.startswith(b"r:"):
                turn, tokens = value.split(b":")
                out[field[2:].decode()] = (float(turn) + self.shift, int(tokens))
        return out

    def _fair_turns(
        self,
        c: int,
        tokens: int,
        max_wait: int,
        before: int,
        after: int,
        turn: Turn,
        wait: int,
        kept_before: dict[str, tuple[float, int]],
    ) -> None:
        """A key with a rate: this call took the next turn, was handed one from the queue, or
        waits in it; the turns the call handed out (to it and to queued callers) are each
        after the pause and the previous turn's rates, within the key's horizon, and move the
        arrival times exactly."""
        me = self.call_id(c)
        new = {k: v for k, v in self.kept_turns().items() if k not in kept_before}
        charged: list[tuple[float, int]] = sorted(new.values())
        if turn is Turn.GRANTED:
            charged = sorted([*charged, (float(before + wait), tokens)])
        horizon = max(250, 60000 / self.rpm) if self.rpm else 250
        floor_rpm, floor_tpm = self.tr, self.tt
        fuzz = (after - before) + 2  # this call's own turn is known to within its call's time
        for at, n in charged:
            floor = max(self.pu, floor_rpm if self.rpm else 0, floor_tpm if self.tpm else 0)
            assert at >= floor - TOL_MS / 10, f"a turn at {at} before {floor}"
            assert at <= after + horizon + 1, f"a turn at {at}: beyond the horizon"
            floor_rpm = at + 60000 / self.rpm if self.rpm else 0
            floor_tpm = at + n * 60000 / self.tpm if self.tpm else 0
        if self.rpm:
            self.tr = self.stored("tr")
            if charged:
                assert abs(self.tr - floor_rpm) < fuzz, "the request time moves by the turns handed"
        if self.tpm:
            self.tt = self.stored("tt")
            if charged:
                assert abs(self.tt - floor_tpm) < fuzz, "the token time moves by the turns handed"
        by_id = {self.call_id(k): k for k in range(CALLERS)}
        for cid, (at, n) in new.items():
            other = by_id.get(cid)
            if other is not None and other != c and other in self.queued:
                assert n == self.queued.pop(other), "a queued call's turn charges its tokens"
                self.kept[other] = (at, n)
        self.queued.pop(c, None)
        if turn is Turn.GRANTED:
            assert wait <= max_wait
            self._granted(c, tokens)
        elif me in new:
            assert wait > max_wait and new[me][1] == tokens
            self.kept[c] = new[me]
        else:  # queued: told to come back later, charged nothing
            assert turn is Turn.RESERVED and wait > 0
            self.queued[c] = tokens

    def _granted(self, c: int, tokens: int) -> None:
        score = self.r.zscore(self.k.in_flight, self.call_id(c))
        assert score is not None, "a granted call holds a slot"
        self.in_flight[c] = (tokens, int(score) + self.shift)

    @rule(
        c=callers,
        used=st.sampled_from([None, 0, 40, 500]),
        twice=st.booleans(),
        ok=st.booleans(),
    )
    def settle(self, c: int, used: int | None, twice: bool, ok: bool) -> None:
        if c not in self.in_flight:
            return
        charged, lease_end = self.in_flight.pop(c)
        held = lease_end > self.now()  # its lease may have ended (time passed)
        tt = self.stored("tt")
        for n in range(2 if twice else 1):
            got = self.settle_script(
                keys=[self.k.config, self.k.in_flight],
                args=[self.call_id(c), charged, -1 if used is None else used, self.tpm, int(ok)],
            )
            if held or n:
                assert int(got) == (1 if n == 0 else 0), "settled once, then nothing"
        if ok:
            self.refusals = 0  # a call that succeeded ends the provider's run of 429s
        note(f"settle {self.call_id(c)} charged={charged} used={used} ok={ok}"
             f"{' (twice)' * twice}")  # fmt: skip
        if self.tpm and used is not None and tt and held:
            want = tt + (used - charged) * 60000 / self.tpm
            assert abs(self.stored("tt") - want) < 1, "corrected by used - charged, once"
            self.tt = self.stored("tt")

    @rule(c=callers)
    def crash(self, c: int) -> None:
        """The caller's worker dies mid-call: its slot comes back when its lease ends."""
        if c in self.in_flight:
            self.crashed[self.call_id(c)] = self.in_flight.pop(c)[1]
            note(f"crash {self.call_id(c)}")

    @rule(for_s=st.sampled_from([10, 90]))
    def pause(self, for_s: int) -> None:
        before = self.now()
        opens_in = int(
            self.pause_script(keys=[self.k.config], args=[for_s * 1000, "429", "operator"])
        )
        after = self.now()
        want = max(self.pu, before + for_s * 1000)
        assert (
            want - (after - before) - 1 <= before + opens_in <= max(self.pu, after + for_s * 1000)
        )
        assert after + opens_in >= self.pu - 1, "a pause never shortens one in force"
        self.pu = int(self.stored("pu"))
        note(f"pause {for_s} s -> opens in {opens_in} ms")

    @rule(asked_ms=st.sampled_from([-1, 500, 7_000, 172_800_000]))
    def provider_pause(self, asked_ms: int) -> None:
        """A provider's 429 (Retry-After: none usable, short, long, two days): at least the
        floor, which doubles with each 429 after the key reopened, at most the cap; a 429
        while paused is the same pause (the floor does not move)."""
        before = self.now()
        reopened = self.pu <= before
        if reopened:
            self.refusals = min(self.refusals + 1, 64)
            floor = min(FLOOR_MS * 2 ** (self.refusals - 1), FLOOR_MAX_MS, CAP_MS)
            want = min(max(asked_ms, floor), CAP_MS)
        else:  # a call under way when the key was paused: the same pause, unless asked longer
            want = min(max(asked_ms, 0), CAP_MS)
        opens_in = int(
            self.pause_script(
                keys=[self.k.config],
                args=[asked_ms, "429", "provider", FLOOR_MS, FLOOR_MAX_MS, CAP_MS],
            )
        )
        after = self.now()
        note(f"provider pause asked {asked_ms} ms -> opens in {opens_in} ms "
             f"(429s in a row: {self.refusals})")  # fmt: skip
        assert int(self.r.hget(self.k.config, "ps") or 0) == self.refusals
        assert after + opens_in >= self.pu - 1, "a pause never shortens one in force"
        if reopened:
            assert want - (after - before) - 1 <= opens_in <= want, f"{want} ms wanted"
        else:
            assert opens_in <= max(self.pu - before, want), "the same pause, not a longer one"
        self.pu = int(self.stored("pu"))

    @rule(rpm=st.sampled_from([0, 1, 2]))
    def change_rpm(self, rpm: int) -> None:
        """`limits set --rpm` at runtime: it wins over the settings' value."""
        self.r.hset(self.k.config, "rpm", rpm)
        self.rpm = rpm
        self.tr = self.stored("tr")

    @rule(ms=st.sampled_from([5_000, 31_000, 61_000, 600_000]))
    def time_passes(self, ms: int) -> None:
        """The clock moves on by ``ms``: every time stored is moved back by as much."""
        conf = self.r.hgetall(self.k.config)
        for name in (b"tr", b"tt", b"pu", b"nf"):
            if name in conf:
                self.r.hset(self.k.config, name, repr(float(conf[name]) - ms))
        for field, value in conf.items():
            if field.startswith(b"r:"):
                turn, tokens = value.split(b":")
                self.r.hset(self.k.config, field, f"{float(turn) - ms:.3f}:{int(tokens)}")
        for field, value in self.r.hgetall(f"{self.k.config}:calls").items():
            n, lease_end = value.split()
            self.r.hset(f"{self.k.config}:calls", field, f"{int(n)} {int(lease_end) - ms}")
        for key in (self.k.in_flight, self.k.reserved, self.b.leases, f"{self.k.config}:q:default"):
            for member, score in self.r.zrange(key, 0, -1, withscores=True):
                self.r.zadd(key, {member: score - ms})
        self.shift += ms
        note(f"time passes {ms} ms")

    # --- the budget ---

    def _purge_lapsed(self, now: int) -> None:
        """What reserve-2.lua does first: a lapsed hold of a call in flight comes back; one
        of a call that had ended (its usage never counted) is charged as unreported."""
        for call, end in list(self.budget_leases.items()):
            if end <= now:
                del self.budget_leases[call]
                if call in self.ended:
                    self.unreported += self.ended.pop(call)
                else:
                    del self.reserved[call]

    def counted_today(self) -> int:
        """The tenant's usage counters of the day (committed and wasted tokens)."""
        fields = [f"acme:{kind}" for kind in ("in", "out", "win", "wout")]
        return sum(int(v or 0) for v in self.r.hmget(self.usage, fields))

    def held(self) -> int:
        return sum(self.reserved.values()) + sum(self.ended.values())

    @rule(c=callers, tokens=st.sampled_from([100, 400, 700]), short=st.booleans())
    def reserve(self, c: int, tokens: int, short: bool) -> None:
        """tenants.reserve: hold, then read the day's counters; over the budget, give back."""
        call = f"b{c}#{self.bcalls[c]}"
        if call in self.reserved or call in self.ended:
            return  # a caller's call in flight
        self._purge_lapsed(self.now())
        lease = 5_000 if short else BUDGET_LEASE_MS
        unreported, held = self.reserve_script(
            keys=[self.b.meter, self.b.leases], args=[call, tokens, lease, 86400]
        )
        assert (int(unreported), int(held)) == (self.unreported, self.held() + tokens)
        used = self.counted_today() + int(unreported)
        fits = used + int(held) <= self.budget
        note(f"reserve {call} {tokens} -> used {used} held {held}: "
             f"{'granted' if fits else 'refused'} (budget {self.budget})")  # fmt: skip
        if fits:
            self.reserved[call] = tokens
            self.budget_leases[call] = self.now() + lease
        else:
            self.spend_script(keys=[self.b.meter, self.b.leases], args=[call, 0, 86400])
            self.bcalls[c] += 1
        wanted = self.counted + self.unreported + self.held() + (0 if fits else tokens)
        assert fits == (wanted <= self.budget), "the check sees the day, whenever it was set"

    @rule(c=callers, used=st.sampled_from([-1, 0, 90, 800]), twice=st.booleans())
    def spend(self, c: int, used: int, twice: bool) -> None:
        """The call ended: what it reported (0: it used nothing, an outage: given back at once;
        -1: it succeeded reporting nothing, charged its estimate)."""
        call = f"b{c}#{self.bcalls[c]}"
        if call not in self.reserved or self.budget_leases[call] <= self.now():
            return
        for _ in range(2 if twice else 1):
            self.spend_script(keys=[self.b.meter, self.b.leases], args=[call, used, 86400])
        estimate = self.reserved.pop(call)
        if used > 0:
            self.ended[call] = used
        else:
            del self.budget_leases[call]
            self.bcalls[c] += 1
            self.unreported += estimate if used < 0 else 0
        note(f"spend {call} {used}{' (twice)' * twice}")

    @rule(c=callers, wasted=st.booleans(), twice=st.booleans())
    def commit(self, c: int, wasted: bool, twice: bool) -> None:
        """The call's attempt commits (or is counted as wasted): its usage goes into the
        counters, then its hold goes (land-2.lua; sent twice, nothing more)."""
        call = f"b{c}#{self.bcalls[c]}"
        if call not in self.ended or self.budget_leases[call] <= self.now():
            return
        used = self.ended.pop(call)
        self.r.hincrby(self.usage, "acme:win" if wasted else "acme:out", used)
        self.counted += used
        for _ in range(2 if twice else 1):
            self.land_script(keys=[self.b.meter, self.b.leases], args=[call])
        del self.budget_leases[call]
        self.bcalls[c] += 1
        note(f"commit {call} {used}{' as wasted' * wasted}")

    @rule(tokens=st.sampled_from([50, 300]))
    def committed_without_a_budget(self, tokens: int) -> None:
        """Usage committed while no budget was set (no hold): the budget counts it all the
        same."""
        self.r.hincrby(self.usage, "acme:in", tokens)
        self.counted += tokens

    @rule(budget=st.sampled_from([300, 1000, 5000]))
    def set_budget(self, budget: int) -> None:
        """`tenants set --daily-tokens` at any time of the day."""
        self.budget = budget
        note(f"budget {budget}")

    # --- what Redis holds ---

    @invariant()
    def redis_matches_the_model(self) -> None:
        live = self.live_in_flight()
        now = self.now()
        holding = sum(1 for _, end in self.in_flight.values() if end > now + TOL_MS)
        maybe = len(self.in_flight) + sum(1 for end in self.crashed.values() if end > now - TOL_MS)
        assert holding <= live <= maybe, f"{live} slots held; the model: {holding}..{maybe}"
        if self.mif:
            assert live <= self.mif, f"{live} calls hold a slot, max_in_flight {self.mif}"
        kept = {m.decode() for m in self.r.zrange(self.k.reserved, 0, -1)}
        now = self.now()
        assert {self.call_id(c) for c, v in self.kept.items() if v[0] > now - GRACE_MS} <= kept
        if self.pu:
            assert abs(self.stored("pu") - self.pu) < 1
        meter = self.r.hgetall(self.b.meter)
        assert int(meter.get(b"unreported", 0)) == self.unreported, "charged once per call"
        assert int(meter.get(b"reserved", 0)) == self.held(), "each live hold, once"
        assert self.counted_today() == self.counted
        holds = {k.decode()[2:] for k in meter if k.startswith(b"r:")}
        assert holds == set(self.reserved) | set(self.ended), f"holds {holds}"


@pytest.fixture(scope="module")
def limits_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    server = RedisServer(Path(tmp_path_factory.mktemp("limits-redis"))).start()
    r = redis.Redis.from_url(server.url)
    yield r
    r.close()
    server.stop()


def test_limit_keys_and_budgets_keep_their_promises(limits_redis: redis.Redis) -> None:
    run_state_machine_as_test(lambda: LimitScripts(limits_redis), settings=SETTINGS)


# --- tenant-fair turns at a key --------------------------------------------------------------
#
# A simulation against the real script: callers of tenants come back exactly when they are
# told (a RESERVED answer's wait), and a granted caller makes its next call at its turn; the
# clock is moved the way `time_passes` moves it. The key has a rate of one call a second.

FAIR_RPM = 60
PRIORITY_STEP_MS = 10_000  # lua/_common.lua: a priority level moves a call this much
INTERVAL_MS = 60_000 / FAIR_RPM


class FairKey:
    def __init__(self, r: redis.Redis) -> None:
        r.flushall()
        self.r = r
        self.acquire = r.register_script(source("acquire"))
        self.k = limit_keys("t", KEY)
        self.shift = 0

    def now(self) -> int:
        sec, usec = self.r.time()
        return int(sec) * 1000 + int(usec) // 1000 + self.shift

    def advance(self, ms: float) -> None:
        """The clock moves on by ``ms``: every time the key stores is moved back by as much."""
        ms = int(ms)
        if ms <= 0:
            return
        conf = self.r.hgetall(self.k.config)
        for name, value in conf.items():
            if name in (b"tr", b"tt", b"pu", b"nf"):
                self.r.hset(self.k.config, name, repr(float(value) - ms))
            elif name.startswith(b"r:"):
                turn, tokens = value.split(b":")
                self.r.hset(self.k.config, name, f"{float(turn) - ms:.3f}:{int(tokens)}")
        calls = f"{self.k.config}:calls"
        for field, value in self.r.hgetall(calls).items():
            n, lease_end = value.split()
            self.r.hset(calls, field, f"{int(n)} {int(lease_end) - ms}")
        zsets = [self.k.in_flight, self.k.reserved]
        zsets += [k.decode() for k in self.r.keys(f"{self.k.config}:q:*")]
        for key in zsets:
            for member, score in self.r.zrange(key, 0, -1, withscores=True):
                self.r.zadd(key, {member: score - ms})
        self.shift += ms

    def call(self, call_id: str, tenant: str, weight: float, priority: int) -> tuple[Turn, int]:
        code, wait, _, _ = self.acquire(
            keys=[self.k.config, self.k.in_flight, self.k.reserved],
            args=[call_id, 0, FAIR_RPM, 0, 0, 20_000, 2_000, tenant, repr(weight), priority],
        )
        return Turn(int(code)), int(wait)


def simulate(
    key: FairKey,
    callers: dict[str, int],
    weights: dict[str, float],
    priorities: list[int],
    until_ms: float,
    late: dict[str, float] | None = None,
) -> tuple[list[tuple[float, str]], dict[str, float]]:
    """Callers (tenant -> how many, each always with a next call) until ``until_ms`` of model
    time; the turns granted (time, tenant) and each call's longest wait from its first
    acquire to its turn (call id -> ms). ``late``: tenant -> when its callers start."""
    import heapq

    start = key.now()
    due: list[tuple[float, int, str, str, int]] = []  # (when, order, tenant, call id, prio)
    order = 0
    for tenant, n in callers.items():
        for i in range(n):
            at = start + (late or {}).get(tenant, 0)
            prio = priorities[order % len(priorities)]
            heapq.heappush(due, (at, order, tenant, f"{tenant}{i}#0", prio))
            order += 1
    first_seen: dict[str, float] = {}
    waits: dict[str, float] = {}
    granted: list[tuple[float, str]] = []
    while due:
        at, o, tenant, call_id, prio = heapq.heappop(due)
        if at > start + until_ms:
            break
        key.advance(at - key.now())
        now = key.now()
        first_seen.setdefault(call_id, now)
        turn, wait = key.call(call_id, tenant, weights[tenant], prio)
        if turn is Turn.GRANTED:
            granted.append((now + wait, tenant))
            waits[call_id] = now + wait - first_seen[call_id]
            name, n = call_id.split("#")
            heapq.heappush(due, (now + wait, o, tenant, f"{name}#{int(n) + 1}", prio))
        else:
            assert turn is Turn.RESERVED and wait > 0
            heapq.heappush(due, (now + wait, o, tenant, call_id, prio))
    return sorted(granted), waits


FAIR_SETTINGS = settings(SETTINGS, max_examples=int(os.environ.get("MODEL_EXAMPLES", "150")) // 10)


def test_weighted_tenants_share_the_keys_turns_by_weight_when_both_wait(
    limits_redis: redis.Redis,
) -> None:
    """Two tenants with backlogs at the key, weights drawn: over 120 turns each tenant gets its
    weight's share within 10 %, whatever the number of callers of each and their priorities;
    the key's rate holds (turns one interval apart); no call waits more than a bound."""
    from hypothesis import given

    @FAIR_SETTINGS
    @given(
        wa=st.sampled_from([1, 2, 3]),
        wb=st.sampled_from([1, 2]),
        na=st.integers(4, 12),
        nb=st.integers(4, 12),
        priorities=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    )
    def run(wa: int, wb: int, na: int, nb: int, priorities: list[int]) -> None:
        key = FairKey(limits_redis)
        granted, waits = simulate(
            key, {"a": na, "b": nb}, {"a": wa, "b": wb}, priorities, 125 * INTERVAL_MS
        )
        turns = granted[:120]
        times = [t for t, _ in turns]
        # The key's rate: turns are handed one interval apart; a call that comes back after
        # the turn handed to it goes at once, so any 10 intervals see at most one call more
        # (give or take the simulation's own reading of the clock).
        assert all(b - a >= 9 * INTERVAL_MS - 50 for a, b in zip(times, times[10:], strict=False))
        assert times[-1] - times[0] <= 119 * INTERVAL_MS * 1.05, "work-conserving"
        got = Counter(t for _, t in turns)
        want = wa / (wa + wb)
        assert abs(got["a"] / len(turns) - want) <= 0.1 * want, f"{got} for weights {wa}:{wb}"
        # Every call of a tenant goes within its place in the fair order: no starvation.
        bound = (na + nb) * INTERVAL_MS * max(wa, wb) + 10 * PRIORITY_STEP_MS
        assert max(waits.values()) <= bound, f"a call waited {max(waits.values())} ms"

    run()


def test_a_tenant_alone_gets_the_whole_rate_and_a_latecomer_its_turn_at_once(
    limits_redis: redis.Redis,
) -> None:
    """Work-conserving: a tenant alone at the key (any number of callers) takes every turn,
    one interval apart. A tenant that arrives behind its backlog is given a turn within the
    horizon and the next interval, not after the backlog."""
    from hypothesis import given

    @FAIR_SETTINGS
    @given(na=st.integers(1, 30), nb=st.integers(1, 3))
    def run(na: int, nb: int) -> None:
        key = FairKey(limits_redis)
        granted, _ = simulate(key, {"a": na}, {"a": 1.0}, [5], 60 * INTERVAL_MS)
        times = [t for t, _ in granted][:50]
        assert (len(times) - 1) * INTERVAL_MS / (times[-1] - times[0]) >= 0.95, "the whole rate"
        key = FairKey(limits_redis)
        late_at = 20 * INTERVAL_MS
        granted, _ = simulate(
            key, {"a": na, "b": nb}, {"a": 1.0, "b": 1.0}, [5], 40 * INTERVAL_MS, {"b": late_at}
        )
        first_b = min(t for t, tenant in granted if tenant == "b")
        start = min(t for t, _ in granted)
        assert first_b - (start + late_at) <= 2 * INTERVAL_MS + 100, "b behind a's backlog"

    run()
