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
turn until then (`LimitWait`, no attempt spent). A call id names the call the same way on every
attempt that a hand-back gives back (session, seq, attempt number, the key's n-th call in the
step), so the message that comes back finds its kept turn.
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
from dialog_worker.engine.model_calls import Usage
from dialog_worker.errors import BudgetExceeded, LimitWait, RateLimited
from dialog_worker.metrics import Metrics
from dialog_worker.store import tenants
from dialog_worker.store.keys import Keys
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
# A provider 429 without Retry-After pauses its key this long.
DEFAULT_PAUSE_S = 1.0


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
        self.lease_ms = int(settings.step_timeout_s * 1000) + settings.lock_ttl_ms
        self._runtime: dict[str, tuple[float, Runtime]] = {}
        self._tenants: dict[str, tenants.TenantSettings] = {}
        self._tenants_until = 0.0

    # --- what a key and a tenant are limited to (cached) ---

    async def effective(self, key: str) -> tuple[LimitConfig, bool]:
        """The key's limits in force and whether it is paused, as this worker knows them."""
        now = time.monotonic()
        cached = self._runtime.get(key)
        if cached is None or cached[0] <= now:
            runtime = await self.limits.runtime(key)
            if len(self._runtime) >= MAX_CACHED_KEYS:
                self._runtime.clear()
            self._runtime[key] = (now + RUNTIME_REFRESH_S, runtime)
        else:
            runtime = cached[1]
        limits = runtime.effective(self.limits.base.get(key, LimitConfig()))
        return limits, runtime.paused_until_ms > time.time() * 1000

    async def tenant_budget(self, tenant: str) -> int:
        now = time.monotonic()
        if now >= self._tenants_until:
            self._tenants = await tenants.load_all(self.redis, self.keys)
            self._tenants_until = now + TENANTS_REFRESH_S
        own = self._tenants.get(tenant)
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
            spent = await tenants.spent(self.redis, self.keys, tenant, day)
            if spent >= budget:
                return BudgetExceeded("tenant", tenant, budget, spent)
        return None

    async def pause(self, key: str, retry_after_s: float | None, reason: str) -> int:
        """A provider's 429 on ``key``: pause it for every worker; ms until it opens."""
        for_s = DEFAULT_PAUSE_S if retry_after_s is None else retry_after_s
        opens_in = await self.limits.pause(key, min(for_s, 86400.0), reason)
        self._runtime.pop(key, None)
        self.metrics.llm_rate_limited.labels(key).inc()
        return opens_in

    def attempt(
        self,
        keys: Keys,
        session_id: str,
        seq: int,
        attempt: int,
        tenant: str,
        state: dict[str, Any],
    ) -> Attempt:
        day = tenants.today()
        return Attempt(self, keys, session_id, seq, attempt, tenant, day,
                       session_tokens_today(state, day))  # fmt: skip

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
    ) -> None:
        self.gate = gate
        self.keys = keys
        self.session_id = session_id
        self.seq = seq
        self.attempt = attempt
        self.tenant = tenant
        self.day = day
        self.session_today = session_today
        self._lock = threading.Lock()  # plain def steps report from their thread
        self._reports: list[Usage] = []
        self._unmetered: list[Usage] = []  # reported outside a model_call: not on the budget yet
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
                    gate.scripts, gate.keys, self.tenant, self.day, call_id, tokens, budget,
                    gate.lease_ms,
                )
            )  # fmt: skip
            if not got.granted:
                raise BudgetExceeded("tenant", self.tenant, budget, got.spent + got.reserved)
            reserved = True
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
        waited = 0.0
        while True:
            answer: Answer = await _shielded(
                gate.limits.acquire(key, grant.call_id, grant.tokens, gate.lease_ms, max_wait)
            )
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

    async def settle(
        self, key: str, grant: object, reports: list[Usage], error: BaseException | None
    ) -> None:
        assert isinstance(grant, Grant)
        used: int | None = sum(r.tokens for r in reports) if reports else None
        if used is None and isinstance(error, RateLimited):
            used = 0  # refused by the provider: nothing used
        if grant.charged is not None:
            await self._settle_limit(key, grant.call_id, grant.charged, used)
        if grant.budget:
            await self._spend(grant, grant.tokens if used is None else used)
        with self._lock:
            self._calls += 1
            self._reports.extend(reports)
        for r in reports:
            self._count_tokens(r)

    def record(self, report: Usage) -> None:
        with self._lock:
            self._calls += 1
            self._reports.append(report)
            self._unmetered.append(report)
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

    async def spend_unmetered(self) -> None:
        """Usage reported outside a `model_call` goes on the tenant's budget after the attempt
        (calls through a key are on it as they end)."""
        with self._lock:
            unmetered, self._unmetered = self._unmetered, []
        tokens = sum(r.tokens for r in unmetered)
        if not tokens or not await self.gate.tenant_budget(self.tenant):
            return
        try:
            await tenants.spend(
                self.gate.scripts, self.gate.keys, self.tenant, self.day, "", tokens
            )
        except redis.exceptions.RedisError as exc:
            log.warning("budget_spend_failed", error=str(exc), tokens=tokens)

    # --- helpers ---

    def _tokens(self) -> int:
        with self._lock:
            return sum(r.tokens for r in self._reports)

    def _count_tokens(self, r: Usage) -> None:
        tokens = self.gate.metrics.llm_tokens
        tokens.labels(r.model, "input").inc(r.input_tokens)
        tokens.labels(r.model, "output").inc(r.output_tokens)

    async def _settle_limit(self, key: str, call_id: str, charged: int, used: int | None) -> None:
        try:
            await _shielded(self.gate.limits.settle(key, call_id, charged, used))
        except redis.exceptions.RedisError as exc:  # its lease gives the slot back
            log.warning("model_call_settle_failed", key=key, error=str(exc))

    async def _spend(self, grant: Grant, tokens: int) -> None:
        gate = self.gate
        try:
            await _shielded(
                tenants.spend(gate.scripts, gate.keys, self.tenant, self.day, grant.call_id, tokens)
            )
        except redis.exceptions.RedisError as exc:  # its lease gives the reservation back
            log.warning("budget_spend_failed", error=str(exc), tokens=tokens)


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
