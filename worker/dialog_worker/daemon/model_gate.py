"""Model calls, the worker's side: limit keys shared by the fleet, token budgets, usage.

`ModelGate` is one per worker: it caches each limit key's limits and pause (refreshed at most
every `RUNTIME_REFRESH_S`, so a key with no limit costs no Redis call per model call, and a
pause or a `limits set` reaches every worker within that time) and the tenants' settings.
`Attempt` is one per attempt of a step, bound to it as the engine's `Calls`
(dialog_worker/engine/model_calls.py): `model_call` enters through `acquire` and leaves through
`settle`; what the attempt reports is gathered there and committed with its reply by the
pipeline (`usage_arg`, `event_usage`, `state_usage`), or counted as wasted when the attempt
does not commit (`ModelGate.waste`).

Waiting for a turn (lua/acquire-3.lua): a turn at most DIALOG_MODEL_CALL_MAX_WAIT_MS away is
waited for inside the step; a later one is kept for the call and the message goes back to its
turn until then (`LimitWait`, no attempt spent). On a key with a rate, a call that cannot go
soon waits in its tenant's queue at the key, and the turns go to the tenants by weight (their
settings) and to a tenant's calls by their message's priority: the message goes back until
the script's estimate of its turn, and comes back to claim it. A call id names the call the
same way on every attempt that a hand-back gives back (session, seq, attempt number, the
key's n-th call in the step), so the message that comes back finds its kept turn.

Pauses: a provider's 429 pauses its key (`ModelGate.pause`: within a floor that grows with 429s
in a row and DIALOG_MAX_PROVIDER_PAUSE_S, lua/pause-1.lua); a call that succeeds ends the run.
The messages a worker hands back while a key is paused are remembered, and brought to their
turn within `PAUSE_WATCH_S` when an operator reopens the key (`wake_resumed`).

Budgets (store/tenants.py): a call under a tenant's budget holds its estimate, checked against
what the tenant's day used (the usage counters the commit writes); at its end the hold becomes
what it reported (or goes: it used nothing), and once the attempt's usage is counted (its
commit, or `waste`) the pipeline drops its calls' holds (`Attempt.land`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections import Counter
from typing import Any

import anyio
import redis.exceptions
import structlog

from dialog_worker.config import Settings
from dialog_worker.engine import emit
from dialog_worker.engine.model_calls import Usage
from dialog_worker.errors import BudgetExceeded, LimitWait, RateLimited
from dialog_worker.metrics import Metrics
from dialog_worker.store import tenants
from dialog_worker.store.keys import Keys, Topology
from dialog_worker.store.limits import Answer, LimitConfig, LimitStore, Runtime
from dialog_worker.store.scripts import Scripts, Turn

log = structlog.get_logger("dialog_worker.daemon.model_gate")

# How stale a worker's view of a key's limits and pause may be: the bound on how late a pause
# (a 429 seen by another worker, an operator's) or a `limits set` reaches this worker for a key
# it calls without a Redis round trip (a key with limits asks Redis at every call anyway).
RUNTIME_REFRESH_S = 0.1
TENANTS_REFRESH_S = 1.0
# The most keys cached at once (keys are the engine's choice: bounded here).
MAX_CACHED_KEYS = 1000
# max_in_flight full: how long a message waits outside its step before trying again.
BUSY_HAND_BACK_S = 1.0
# How often a worker looks whether a key it handed messages back for was reopened early
# (`limits resume`): the bound on how late those messages learn of it.
PAUSE_WATCH_S = 1.0
# A wait for a turn inside the step at least this long is shown to the answer's readers (a
# `waiting` event); a shorter one is not worth a line on their page.
WAIT_SHOWN_MS = 200
# The most messages a worker remembers as waiting for paused keys (beyond it, the oldest are
# forgotten: they wait for the pause's planned end).
MAX_PAUSE_WAITERS = 100_000


@dataclasses.dataclass(frozen=True, slots=True)
class PauseWaiter:
    """A message handed back until its key's pause ends (ModelGate.wait_for_pause)."""

    keys: Keys  # its shard's
    session_id: str
    reopens: int  # the key's reopenings count when it went back
    due: float  # time.monotonic() when it comes back anyway


@dataclasses.dataclass(slots=True)
class Grant:
    call_id: str
    tokens: int
    charged: int | None  # tokens acquire charged (None: the key has no limit, no slot held)
    budget: bool  # the tokens were reserved from the tenant's budget


class ModelGate:
    def __init__(self, settings: Settings, scripts: Scripts, metrics: Metrics) -> None:
        self.settings = settings
        self.scripts = scripts
        self.redis = scripts.commit.redis
        self.metrics = metrics
        self.limits = LimitStore(self.redis, scripts, settings)
        self.keys = Keys.from_settings(settings)  # the deployment's global keys
        self.topology = Topology.from_settings(settings)  # each shard's usage counters
        self.lease_ms = int(settings.step_timeout_s * 1000) + settings.lock_ttl_ms
        self._runtime: dict[str, tuple[float, Runtime]] = {}
        self._tenants: dict[str, tenants.TenantSettings] = {}
        self._tenants_until = 0.0
        # key -> (shard, session id) -> a message handed back for the key's pause
        self._pause_waiters: dict[str, dict[tuple[int, str], PauseWaiter]] = {}

    # --- what a key and a tenant are limited to (cached) ---

    async def effective(self, key: str) -> tuple[LimitConfig, bool]:
        """The key's limits in force and whether it is paused, as this worker knows them."""
        runtime = await self._cached(key)
        limits = runtime.effective(self.limits.base.get(key, LimitConfig()))
        return limits, runtime.paused_until_ms > time.time() * 1000

    async def _cached(self, key: str) -> Runtime:
        now = time.monotonic()
        cached = self._runtime.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        runtime = await self.limits.runtime(key)
        if len(self._runtime) >= MAX_CACHED_KEYS:
            self._runtime.clear()
        self._runtime[key] = (now + RUNTIME_REFRESH_S, runtime)
        return runtime

    async def tenant_settings(self, tenant: str) -> tenants.TenantSettings | None:
        """The tenant's settings as this worker knows them (None: none set)."""
        now = time.monotonic()
        if now >= self._tenants_until:
            self._tenants = await tenants.load_all(self.redis, self.keys)
            self._tenants_until = now + TENANTS_REFRESH_S
        return self._tenants.get(tenant)

    async def tenant_budget(self, tenant: str) -> int:
        own = await self.tenant_settings(tenant)
        default = self.settings.tenant_daily_tokens
        return default if own is None else own.budget(default)

    async def over_budget(self, tenant: str, state: dict[str, Any]) -> BudgetExceeded | None:
        """Before a step: the tenant's or the session's budget of the day already spent."""
        day = tenants.today()
        session_budget = self.settings.session_daily_tokens
        if session_budget:
            used = session_tokens_today(state, day)
            if used >= session_budget:
                return BudgetExceeded(
                    "session", str(state.get("session_id", "")), session_budget, used
                )
        budget = await self.tenant_budget(tenant)
        if budget:
            used, _ = await tenants.used_today(self.redis, self.topology, self.keys, tenant, day)
            if used >= budget:
                return BudgetExceeded("tenant", tenant, budget, used)
        return None

    async def pause(self, key: str, retry_after_s: float | None, reason: str) -> int:
        """A provider's 429 on ``key``: pause it for every worker, for its Retry-After within
        the key's floor and DIALOG_MAX_PROVIDER_PAUSE_S (LimitStore.provider_pause); ms until
        it opens."""
        opens_in = await self.limits.provider_pause(key, retry_after_s, reason)
        self._runtime.pop(key, None)
        self.metrics.llm_rate_limited.labels(key).inc()
        return opens_in

    async def succeeded(self, key: str) -> None:
        """A call on ``key`` that held no slot succeeded: if the key's provider had refused
        calls in a row (as this worker last read the key), that run is over. Costs a command
        only then (a call through a slot ends the run in settle's own script)."""
        cached = self._runtime.get(key)
        if cached is None or not cached[1].refusals:
            return
        try:
            await self.limits.clear_refusals(key)
        except redis.exceptions.RedisError as exc:  # the next success tries again
            log.warning("model_call_refusals_not_cleared", key=key, error=str(exc))
            return
        self._runtime.pop(key, None)

    async def wait_for_pause(self, key: str, keys: Keys, session_id: str, delay_ms: int) -> None:
        """A message went back until its turn on ``key`` (in ``delay_ms``): if the key is
        paused (its turn is after the pause, whatever the turn waited for last), it is
        remembered, so that an operator reopening the key early brings it back then
        (`wake_resumed`)."""
        try:
            runtime = await self._cached(key)
        except redis.exceptions.RedisError as exc:  # it waits for its turn as planned
            log.warning("pause_waiter_not_noted", key=key, error=str(exc))
            return
        if runtime.paused_until_ms <= time.time() * 1000:
            return
        if sum(len(w) for w in self._pause_waiters.values()) >= MAX_PAUSE_WAITERS:
            oldest = min(self._pause_waiters, key=lambda k: min(
                w.due for w in self._pause_waiters[k].values()))  # fmt: skip
            del self._pause_waiters[oldest]
        waiter = PauseWaiter(keys, session_id, runtime.reopens, time.monotonic() + delay_ms / 1000)
        self._pause_waiters.setdefault(key, {})[(keys.shard, session_id)] = waiter

    async def wake_resumed(self) -> float:
        """One look at the keys this worker handed messages back for: where an operator
        reopened one (its reopenings count moved on, lua/reopen-1.lua), their sessions come to
        their turn now (the ready set's score lowered to now, where they still wait), instead of
        at the pause's planned end. Those whose pause ended are forgotten. One HMGET per key
        with messages waiting; none while there are none. Seconds until the next look."""
        now = time.monotonic()
        for key in list(self._pause_waiters):
            waiting = {at: w for at, w in self._pause_waiters[key].items() if w.due > now}
            if not waiting:
                del self._pause_waiters[key]
                continue
            self._pause_waiters[key] = waiting
            runtime = await self.limits.runtime(key)
            woken = [at for at, w in waiting.items() if runtime.reopens > w.reopens]
            if not woken:
                continue
            self._runtime[key] = (now + RUNTIME_REFRESH_S, runtime)
            by_ready: dict[str, dict[str, int]] = {}
            now_ms = int(time.time() * 1000)
            for at in woken:
                w = waiting.pop(at)
                by_ready.setdefault(w.keys.ready, {})[w.session_id] = now_ms
            for ready, sessions in by_ready.items():
                # Only sessions still there (XX), only sooner (LT): one taken up meanwhile, or
                # due sooner anyway, is left as it is.
                await self.redis.zadd(ready, sessions, xx=True, lt=True)
            log.info("pause_ended_early", key=key, sessions=len(woken))
        return PAUSE_WATCH_S

    def attempt(
        self,
        keys: Keys,
        session_id: str,
        seq: int,
        attempt: int,
        tenant: str,
        state: dict[str, Any],
        priority: int = 5,
    ) -> Attempt:
        day = tenants.today()
        return Attempt(self, keys, session_id, seq, attempt, tenant, day,
                       session_tokens_today(state, day), priority)  # fmt: skip

    async def waste(self, attempt: Attempt) -> None:
        """Usage of an attempt that did not commit: counted apart (best effort: a failure is
        logged; a worker killed here counts nothing, never twice)."""
        totals = attempt.take()
        if totals is None:
            return
        try:
            usage_key = attempt.keys.usage(attempt.day)
            state_key = attempt.keys.session(attempt.session_id).state
            t = attempt.tenant
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(usage_key, f"{t}:win", totals["input_tokens"])
                pipe.hincrby(usage_key, f"{t}:wout", totals["output_tokens"])
                pipe.hincrby(usage_key, f"{t}:wcost", cost_units(totals["cost"]))
                pipe.hincrby(usage_key, f"{t}:wcalls", totals["calls"])
                pipe.expire(usage_key, 40 * 86400)
                # The session's wasted usage, beside its state (read by DialogClient.usage).
                pipe.hincrby(state_key, "wi", totals["input_tokens"])
                pipe.hincrby(state_key, "wo", totals["output_tokens"])
                pipe.hincrby(state_key, "wc", cost_units(totals["cost"]))
                pipe.hincrby(state_key, "wn", totals["calls"])
                await pipe.execute()
        except redis.exceptions.RedisError as exc:
            log.warning("wasted_usage_not_counted", error=str(exc), **totals)


class Attempt:
    """One attempt of one step: the engine's `Calls` (dialog_worker/engine/model_calls.py)."""

    def __init__(
        self,
        gate: ModelGate,
        keys: Keys,
        session_id: str,
        seq: int,
        attempt: int,
        tenant: str,
        day: str,
        session_today: int,
        priority: int = 5,
    ) -> None:
        self.gate = gate
        self.priority = priority  # the message's, inside its tenant (a key's fair turns)
        self.keys = keys
        self.session_id = session_id
        self.seq = seq
        self.attempt = attempt
        self.tenant = tenant
        self.day = day
        self.session_today = session_today
        self._lock = threading.Lock()  # plain def steps report from their thread
        self._reports: list[Usage] = []
        self._held: list[str] = []  # call ids holding tokens on the tenant's budget
        self._calls = 0
        self._index: Counter[str] = Counter()

    # --- Calls ---

    async def acquire(self, key: str, tokens: int) -> object:
        gate, settings = self.gate, self.gate.settings
        with self._lock:
            index = self._index[key]
            self._index[key] += 1
        call_id = f"{self.session_id}\n{self.seq}\n{self.attempt}\n{index}"
        if settings.session_daily_tokens:
            used = self.session_today + self._tokens()
            if used + tokens > settings.session_daily_tokens:
                raise BudgetExceeded(
                    "session", self.session_id, settings.session_daily_tokens, used
                )
        budget = await gate.tenant_budget(self.tenant)
        reserved = False
        if budget:
            got = await _shielded(
                tenants.reserve(
                    gate.redis, gate.scripts, gate.topology, gate.keys, self.tenant, self.day,
                    call_id, tokens, budget, gate.lease_ms,
                )
            )  # fmt: skip
            if not got.granted:
                raise BudgetExceeded("tenant", self.tenant, budget, got.used + got.reserved)
            reserved = True
            with self._lock:
                self._held.append(call_id)  # its hold goes when the attempt's usage is counted
        grant = Grant(call_id, tokens, None, reserved)
        try:
            limits, paused = await gate.effective(key)
            if limits.limited or paused:
                grant.charged = await self._turn(key, grant)
        except BaseException as exc:
            if reserved:  # no call was made: its reservation goes back
                await self._spend(grant, 0)
            if isinstance(exc, LimitWait):
                gate.metrics.llm_deferred.labels(key, exc.why).inc()
            raise
        gate.metrics.llm_calls.labels(key).inc()
        return grant

    async def _turn(self, key: str, grant: Grant) -> int:
        """The key's turn for this call: waited for here, or `LimitWait`; the tokens charged."""
        gate = self.gate
        max_wait = gate.settings.model_call_max_wait_ms
        own = await gate.tenant_settings(self.tenant)
        weight = 1.0 if own is None else own.weight
        waited = 0.0
        while True:
            answer: Answer = await _shielded(
                gate.limits.acquire(
                    key, grant.call_id, grant.tokens, gate.lease_ms, max_wait,
                    self.tenant, weight, self.priority,
                )
            )  # fmt: skip
            await self._announce_wait(answer, first=waited == 0)
            if answer.turn is Turn.GRANTED:
                if answer.wait_ms > 0:
                    try:
                        await anyio.sleep(answer.wait_ms / 1000)
                    except BaseException:  # cancelled while waiting: the slot goes back
                        with anyio.CancelScope(shield=True):
                            await self._settle_limit(key, grant.call_id, answer.tokens, 0)
                        raise
                return answer.tokens
            if answer.turn is Turn.RESERVED:
                raise LimitWait(key, answer.wait_ms / 1000, answer.why)
            # BUSY: max_in_flight reached. Poll a little, jittered; then wait outside the step.
            pause_ms = answer.wait_ms * random.uniform(0.5, 1.5)
            if waited + pause_ms > max_wait:
                raise LimitWait(key, BUSY_HAND_BACK_S * random.uniform(0.5, 1.5), answer.why)
            await anyio.sleep(pause_ms / 1000)
            waited += pause_ms

    async def _announce_wait(self, answer: Answer, first: bool) -> None:
        """The step waits for its key inside the step: a turn at least WAIT_SHOWN_MS away, or
        the key's calls in flight full (BUSY, the first poll: when it goes is not known).
        The answer's readers then get a `waiting` event (why, and when it expects to go), in
        order with its text. A hand-back tells them in the pipeline (`PartialReplies.waiting`)."""
        waiting = getattr(emit.current_writer(), "waiting", None)  # the worker's writer
        if waiting is None:
            return
        if answer.turn is Turn.GRANTED and answer.wait_ms >= WAIT_SHOWN_MS:
            await waiting(answer.why, answer.wait_ms)
        elif answer.turn is Turn.BUSY and first:
            await waiting(answer.why, None)

    async def settle(
        self, key: str, grant: object, reports: list[Usage], error: BaseException | None
    ) -> None:
        assert isinstance(grant, Grant)
        used: int | None = sum(r.tokens for r in reports) if reports else None
        if used is None and isinstance(error, RateLimited):
            used = 0  # refused by the provider: nothing used
        if grant.charged is not None:
            await self._settle_limit(key, grant.call_id, grant.charged, used, error is None)
        elif error is None:
            await self.gate.succeeded(key)
        if grant.budget:
            # What it reported; a failure that reported nothing (an outage, a refusal, a 429)
            # used nothing and gives its estimate back now; a success that reported nothing
            # is charged its estimate (None).
            await self._spend(grant, used if used is not None or error is None else 0)
        with self._lock:
            self._calls += 1
            self._reports.extend(reports)
        for r in reports:
            self._count_tokens(r)

    def record(self, report: Usage) -> None:
        with self._lock:
            self._calls += 1
            self._reports.append(report)
        self._count_tokens(report)

    # --- what the pipeline commits ---

    def totals(self) -> dict[str, Any] | None:
        """The attempt's usage (None: no model call): tokens, cost (None if no call gave
        one) and calls."""
        with self._lock:
            if not self._calls:
                return None
            costs = [r.cost for r in self._reports if r.cost is not None]
            return {
                "input_tokens": sum(r.input_tokens for r in self._reports),
                "output_tokens": sum(r.output_tokens for r in self._reports),
                "cost": round(sum(costs), 6) if costs else None,
                "calls": self._calls,
            }

    def take(self) -> dict[str, Any] | None:
        """`totals`, once: what a commit or `waste` counts is not counted again."""
        totals = self.totals()
        with self._lock:
            self._calls = 0
            self._reports = []
        return totals

    async def land(self) -> None:
        """The attempt's usage is counted (committed with its reply, or as wasted): the holds
        its calls kept on the tenant's budget go (best effort: a failure is logged, and the
        holds lapse with their leases)."""
        with self._lock:
            held, self._held = self._held, []
        if not held:
            return
        try:
            await _shielded(
                tenants.land(self.gate.scripts, self.gate.keys, self.tenant, self.day, held)
            )
        except redis.exceptions.RedisError as exc:
            log.warning("budget_land_failed", error=str(exc), calls=len(held))

    # --- helpers ---

    def _tokens(self) -> int:
        with self._lock:
            return sum(r.tokens for r in self._reports)

    def _count_tokens(self, r: Usage) -> None:
        tokens = self.gate.metrics.llm_tokens
        tokens.labels(r.model, "input").inc(r.input_tokens)
        tokens.labels(r.model, "output").inc(r.output_tokens)

    async def _settle_limit(
        self, key: str, call_id: str, charged: int, used: int | None, succeeded: bool = False
    ) -> None:
        try:
            await _shielded(self.gate.limits.settle(key, call_id, charged, used, succeeded))
        except redis.exceptions.RedisError as exc:  # its lease gives the slot back
            log.warning("model_call_settle_failed", key=key, error=str(exc))

    async def _spend(self, grant: Grant, used: int | None) -> None:
        gate = self.gate
        try:
            await _shielded(
                tenants.spend(gate.scripts, gate.keys, self.tenant, self.day, grant.call_id, used)
            )
        except redis.exceptions.RedisError as exc:  # its lease ends the hold
            log.warning("budget_spend_failed", error=str(exc), tokens=used)


def session_tokens_today(state: dict[str, Any], day: str) -> int:
    """The tokens the session's committed replies used today (its state's usage)."""
    usage = state.get("usage")
    if not isinstance(usage, dict) or usage.get("day") != day:
        return 0
    value = usage.get("day_tokens", 0)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return int(value) if ok else 0


def cost_units(cost: float | None) -> int:
    return 0 if cost is None else round(cost * tenants.COST_UNIT)


def merged_state_usage(old: object, totals: dict[str, Any], day: str) -> dict[str, Any]:
    """The state's usage after a committed attempt: the session's totals and today's tokens."""
    base: dict[str, Any] = dict(old) if isinstance(old, dict) else {}

    def whole(name: str) -> int:
        v = base.get(name, 0)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

    cost = base.get("cost")
    old_cost = float(cost) if isinstance(cost, int | float) and not isinstance(cost, bool) else 0.0
    tokens = totals["input_tokens"] + totals["output_tokens"]
    today = (whole("day_tokens") if base.get("day") == day else 0) + tokens
    return {
        "input_tokens": whole("input_tokens") + totals["input_tokens"],
        "output_tokens": whole("output_tokens") + totals["output_tokens"],
        "cost": round(old_cost + (totals["cost"] or 0.0), 6),
        "calls": whole("calls") + totals["calls"],
        "day": day,
        "day_tokens": today,
    }


def usage_arg(attempt: Attempt, totals: dict[str, Any]) -> str:
    """The commit's usage argument (lua/commit-5.lua)."""
    return json.dumps(
        {
            "t": attempt.tenant,
            "d": attempt.day,
            "i": totals["input_tokens"],
            "o": totals["output_tokens"],
            "m": cost_units(totals["cost"]),
            "n": totals["calls"],
        },
        ensure_ascii=False,
    )


def event_usage(totals: dict[str, Any]) -> str:
    """The reply event's ``usage`` field."""
    return json.dumps(
        {
            "input_tokens": totals["input_tokens"],
            "output_tokens": totals["output_tokens"],
            "cost": totals["cost"],
        }
    )


async def _shielded(call: Any) -> Any:
    """A script call is never cancelled half-way (its answer would be lost with its effect)."""
    with anyio.CancelScope(shield=True):
        return await call
