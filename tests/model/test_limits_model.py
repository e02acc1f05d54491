"""Model-checked limit keys and budgets: random interleavings of acquire, settle, pause (one
limit key) and reserve, spend (one tenant's budget of the day) on a real redis-server,
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
- a pause never shortens one in force;
- the budget: a reservation is granted exactly when spent + reserved + estimate <= budget;
  the meter's reserved is the sum of the live reservations, its spent the sum of what was
  spent (once per call id); a lapsed reservation comes back.
"""

from __future__ import annotations

import os
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
        self.k = limit_keys("t", KEY)
        self.b = budget_keys("t", "acme", "20260101")
        self.shift = 0  # ms the model's clock is ahead of Redis's (time_passes)
        self.calls = [0] * CALLERS  # each caller's current call number (its call id)
        # caller -> (tokens charged, its lease's end) of a granted call not settled yet
        self.in_flight: dict[int, tuple[int, int]] = {}
        # call id -> lease end (model time) of a dead call (a caller may die more than once)
        self.crashed: dict[str, int] = {}
        self.kept: dict[int, tuple[float, int]] = {}  # caller -> (turn, tokens) kept for it
        self.tr = self.tt = 0.0  # arrival times (model time) as the model predicts them
        self.pu = 0  # paused until (model time)
        self.reserved: dict[str, int] = {}  # budget reservations: call id -> tokens
        self.budget_leases: dict[str, int] = {}  # call id -> lease end (model time)
        self.spent = 0
        self.bcalls = [0] * CALLERS  # each caller's budget call number

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
        if c in self.in_flight or c in self.kept:
            return
        self.calls[c] += 1
        self._acquire(c, tokens, wait_s * 1000)

    @rule(c=callers, wait_s=st.sampled_from([0, 20]))
    def come_back(self, c: int, wait_s: int) -> None:
        """A caller whose turn was kept comes back (early, on time or late)."""
        if c in self.kept:
            self._acquire(c, 999, wait_s * 1000)

    def _acquire(self, c: int, tokens: int, max_wait: int) -> None:
        before = self.now()
        # Slots whose lease ended come back; kept turns nobody came back for lapse.
        self.in_flight = {k: v for k, v in self.in_flight.items() if v[1] > before}
        self.crashed = {k: end for k, end in self.crashed.items() if end > before}
        self.kept = {k: v for k, v in self.kept.items() if v[0] > before - GRACE_MS}
        full = self.mif > 0 and len(self.in_flight) + len(self.crashed) >= self.mif
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
        # A fresh turn: the latest of now, the pause, the request and token arrival times.
        floor = max(self.pu, self.tr if self.rpm else 0, self.tt if self.tpm else 0)
        score = self.r.zscore(self.k.reserved, self.call_id(c))
        if self.rpm:
            at = self.stored("tr") - 60000 / self.rpm
        elif self.tpm:
            at = self.stored("tt") - tokens * 60000 / self.tpm
        elif score is not None:
            at = score + self.shift
        else:
            at = float(before + wait)
        if self.rpm or self.tpm or not self.pu > before:
            assert at >= floor - 1, f"a turn at {at} before {floor}"
            assert at <= max(floor, after) + 1, f"a turn at {at} later than needed ({floor})"
            assert abs((at - wait) - before) <= (after - before) + 2, "its wait says its turn"
        else:  # an unlimited key in a pause: one caller at a time, after the pause
            assert at >= self.pu - 1, "a turn inside the pause"
        if self.rpm:
            self.tr = self.stored("tr")
        if self.tpm:
            self.tt = self.stored("tt")
        if turn is Turn.GRANTED:
            assert wait <= max_wait
            self._granted(c, tokens)
        else:
            assert turn is Turn.RESERVED and wait > max_wait
            assert score is not None and abs(score + self.shift - at) < 1, "its turn is kept"
            self.kept[c] = (score + self.shift, tokens)

    def _granted(self, c: int, tokens: int) -> None:
        score = self.r.zscore(self.k.in_flight, self.call_id(c))
        assert score is not None, "a granted call holds a slot"
        self.in_flight[c] = (tokens, int(score) + self.shift)

    @rule(c=callers, used=st.sampled_from([None, 0, 40, 500]), twice=st.booleans())
    def settle(self, c: int, used: int | None, twice: bool) -> None:
        if c not in self.in_flight:
            return
        charged, lease_end = self.in_flight.pop(c)
        held = lease_end > self.now()  # its lease may have ended (time passed)
        tt = self.stored("tt")
        for n in range(2 if twice else 1):
            got = self.settle_script(
                keys=[self.k.config, self.k.in_flight],
                args=[self.call_id(c), charged, -1 if used is None else used, self.tpm],
            )
            if held or n:
                assert int(got) == (1 if n == 0 else 0), "settled once, then nothing"
        note(f"settle {self.call_id(c)} charged={charged} used={used}{' (twice)' * twice}")
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
        opens_in = int(self.pause_script(keys=[self.k.config], args=[for_s * 1000, "429"]))
        after = self.now()
        want = max(self.pu, before + for_s * 1000)
        assert (
            want - (after - before) - 1 <= before + opens_in <= max(self.pu, after + for_s * 1000)
        )
        assert after + opens_in >= self.pu - 1, "a pause never shortens one in force"
        self.pu = int(self.stored("pu"))
        note(f"pause {for_s} s -> opens in {opens_in} ms")

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
        for key in (self.k.in_flight, self.k.reserved, self.b.leases):
            for member, score in self.r.zrange(key, 0, -1, withscores=True):
                self.r.zadd(key, {member: score - ms})
        self.shift += ms
        note(f"time passes {ms} ms")

    # --- the budget ---

    @rule(c=callers, tokens=st.sampled_from([100, 400, 700]), short=st.booleans())
    def reserve(self, c: int, tokens: int, short: bool) -> None:
        now = self.now()
        for call, end in list(self.budget_leases.items()):
            if end <= now:  # lapsed: comes back
                del self.budget_leases[call]
                del self.reserved[call]
        call = f"b{c}#{self.bcalls[c]}"
        lease = 5_000 if short else BUDGET_LEASE_MS
        got = self.reserve_script(
            keys=[self.b.meter, self.b.leases], args=[call, tokens, BUDGET, lease, 86400]
        )
        note(f"reserve {call} {tokens} -> {got}")
        if call in self.reserved:
            assert int(got[0]) == 1, "sent twice: reserved already"
            return
        fits = self.spent + sum(self.reserved.values()) + tokens <= BUDGET
        assert int(got[0]) == int(fits), f"spent {self.spent} reserved {self.reserved}"
        if fits:
            self.reserved[call] = tokens
            self.budget_leases[call] = now + lease

    @rule(c=callers, used=st.sampled_from([0, 90, 800]), twice=st.booleans())
    def spend(self, c: int, used: int, twice: bool) -> None:
        call = f"b{c}#{self.bcalls[c]}"
        if call not in self.reserved or self.budget_leases[call] <= self.now():
            return
        for _ in range(2 if twice else 1):
            self.spend_script(keys=[self.b.meter, self.b.leases], args=[call, used, 86400])
        del self.reserved[call], self.budget_leases[call]
        self.spent += used
        self.bcalls[c] += 1
        note(f"spend {call} {used}{' (twice)' * twice}")

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
        assert int(meter.get(b"spent", 0)) == self.spent, "spent: each call's usage once"
        held = int(meter.get(b"reserved", 0))
        lapsed = sum(
            t for call, t in self.reserved.items() if self.budget_leases[call] <= self.now()
        )
        assert sum(self.reserved.values()) - lapsed <= held <= sum(self.reserved.values())


@pytest.fixture(scope="module")
def limits_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    server = RedisServer(Path(tmp_path_factory.mktemp("limits-redis"))).start()
    r = redis.Redis.from_url(server.url)
    yield r
    r.close()
    server.stop()


def test_limit_keys_and_budgets_keep_their_promises(limits_redis: redis.Redis) -> None:
    run_state_machine_as_test(lambda: LimitScripts(limits_redis), settings=SETTINGS)
