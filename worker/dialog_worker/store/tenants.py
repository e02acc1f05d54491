"""Tenants in Redis: their settings, their token budgets and their usage.

Settings: one hash for the deployment (`Keys.tenants`), field = tenant, value = a JSON object
with any of ``weight`` (float, default 1), ``min`` (int, default 0), ``max`` (int, 0: no cap)
and ``daily_tokens`` (int; absent: DIALOG_TENANT_DAILY_TOKENS; 0: no budget). Written by
`dialog-worker tenants set` (a partial update), read by every worker.

Usage: the per-shard, per-day counters the commit writes with each reply (`Keys.usage`),
summed here. Budgets count them: a tenant's day is what its counters say, whenever its budget
was set; a meter per tenant and UTC day (`Keys.budget`) holds what calls in flight reserved and
what calls that reported nothing were charged (lua/reserve-2.lua, spend-2.lua, land-2.lua).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, cast

from redis.asyncio import Redis

from dialog_worker.config import MAX_TOKENS_A_DAY
from dialog_worker.errors import ValidationError
from dialog_worker.store.codec import MAX_TENANT_BYTES, text
from dialog_worker.store.keys import Keys, Topology
from dialog_worker.store.scripts import Scripts

# A budget meter outlives its day by this much (s): yesterday's stays readable today.
BUDGET_KEEP_S = 3 * 86400
MAX_WEIGHT = 1_000_000.0
MAX_COUNT = MAX_TOKENS_A_DAY  # what DIALOG_TENANT_DAILY_TOKENS takes
USAGE_KINDS = ("in", "out", "cost", "calls")
WASTED_KINDS = ("win", "wout", "wcost", "wcalls")
# The counters of tokens (committed and wasted) a budget counts.
TOKEN_KINDS = ("in", "out", "win", "wout")
# Cost is counted in millionths (whole numbers: exact sums in Redis).
COST_UNIT = 1_000_000


def today(now_s: float | None = None) -> str:
    """The UTC day, ``yyyymmdd``: the day budgets and usage counters belong to."""
    return time.strftime("%Y%m%d", time.gmtime(time.time() if now_s is None else now_s))


def check_day(day: str) -> str:
    if not (isinstance(day, str) and len(day) == 8 and day.isascii() and day.isdigit()):
        raise ValidationError(f"a day is yyyymmdd (UTC), got {day!r}")
    return day


def check_tenant(name: object) -> str:
    """A tenant's name as messages give it (store/codec.tenant_of): 1 to 64 bytes of UTF-8
    without spaces or control characters."""
    raw = name.encode("utf-8", "surrogatepass") if isinstance(name, str) else b""
    if not 0 < len(raw) <= MAX_TENANT_BYTES or any(b <= 32 or b == 127 for b in raw):
        raise ValidationError(
            f"a tenant is 1 to {MAX_TENANT_BYTES} bytes without spaces or control characters, "
            f"got {str(name)[:80]!r}"
        )
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError("a tenant's name is UTF-8 text") from None
    assert isinstance(name, str)
    return name


@dataclasses.dataclass(frozen=True, slots=True)
class TenantSettings:
    weight: float = 1.0
    min: int = 0
    max: int = 0
    daily_tokens: int | None = None  # None: DIALOG_TENANT_DAILY_TOKENS

    def __post_init__(self) -> None:
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise ValidationError(f"weight is a number, got {w!r}")
        if not 0 < w <= MAX_WEIGHT:
            raise ValidationError(f"weight is above 0 and at most {MAX_WEIGHT:g}, got {w!r}")
        for name in ("min", "max", "daily_tokens"):
            value = getattr(self, name)
            if value is None and name == "daily_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
                raise ValidationError(
                    f"{name} is a whole number from 0 to {MAX_COUNT}, got {value!r}"
                )
        if self.max and self.min > self.max:
            raise ValidationError(f"min ({self.min}) is above max ({self.max})")

    def budget(self, default: int) -> int:
        """Tokens a day (0: no budget)."""
        return default if self.daily_tokens is None else self.daily_tokens

    def as_json(self) -> str:
        doc: dict[str, Any] = {"weight": float(self.weight), "min": self.min, "max": self.max}
        if self.daily_tokens is not None:
            doc["daily_tokens"] = self.daily_tokens
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> TenantSettings:
        """What a hash value holds; a value that cannot be read, or a field of it, counts as
        not set (the default), never as an error of the reader."""
        if raw is None:
            return cls()
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            return cls()
        if not isinstance(doc, dict):
            return cls()
        kept: dict[str, Any] = {}
        for name, default in (("weight", 1.0), ("min", 0), ("max", 0), ("daily_tokens", None)):
            if name not in doc:
                continue
            try:
                cls(**{**kept, name: doc[name]})
            except (ValidationError, TypeError):
                continue
            kept[name] = doc[name] if doc[name] is not None else default
        return cls(**kept)  # each field was checked with those before it


async def load_all(redis: Redis, keys: Keys) -> dict[str, TenantSettings]:
    raw = await redis.hgetall(keys.tenants)
    out: dict[str, TenantSettings] = {}
    for name, value in raw.items():
        tenant = text(name)
        try:
            check_tenant(tenant)
        except ValidationError:
            continue
        out[tenant] = TenantSettings.from_json(value)
    return out


async def load_one(redis: Redis, keys: Keys, tenant: str) -> TenantSettings:
    return TenantSettings.from_json(await redis.hget(keys.tenants, check_tenant(tenant)))


async def set_settings(
    redis: Redis, keys: Keys, tenant: str, topology: Topology | None = None, **changes: Any
) -> TenantSettings:
    """Change some of a tenant's settings (``weight``, ``min``, ``max``, ``daily_tokens``;
    None: unchanged), checked together; the settings after the change, also copied into
    every shard of `topology` (copy_to_shards). Two operators who change one tenant at the
    same moment: the later write wins whole."""
    check_tenant(tenant)
    unknown = set(changes) - {"weight", "min", "max", "daily_tokens"}
    if unknown:
        raise ValidationError(f"unknown tenant setting(s) {', '.join(sorted(unknown))}")
    given = {k: v for k, v in changes.items() if v is not None}
    if not given:
        raise ValidationError("give at least one of --weight, --min, --max, --daily-tokens")
    current = await load_one(redis, keys, tenant)
    updated = dataclasses.replace(current, **given)  # validated by __post_init__
    await redis.hset(keys.tenants, tenant, updated.as_json())
    if topology is not None:
        await copy_to_shards(redis, topology, tenant, updated)
    return updated


# --- the shards' copies (what the scheduling scripts read) --------------------------------


def share(setting: TenantSettings) -> str:
    """A tenant's share as each shard's `Keys.tenant_settings` holds it: "weight min max"
    (lua/_common.lua, tenant_conf)."""
    return f"{setting.weight!r} {setting.min} {setting.max}"


async def copy_to_shards(
    redis: Redis, topology: Topology, tenant: str, setting: TenantSettings
) -> None:
    """Write one tenant's share into every shard (the scripts of a shard read only keys of its
    own slot): its weight, minimum and maximum take effect at the next slot handed out."""
    for keys in topology.shards:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.tenant_settings, tenant, share(setting))
            if setting.min:
                pipe.zadd(keys.tenants_guaranteed, {tenant: setting.min})
            else:
                pipe.zrem(keys.tenants_guaranteed, tenant)
            await pipe.execute()


async def sync_shards(redis: Redis, topology: Topology, keys: Keys) -> int:
    """Make every shard's copy match the deployment's settings (a worker does it at start:
    after a reshard, or a copy lost with its shard's keys); returns how many tenants."""
    own = await load_all(redis, keys)
    for shard in topology.shards:
        stale = {text(t) for t in await redis.hkeys(shard.tenant_settings)} - set(own)
        async with redis.pipeline(transaction=False) as pipe:
            for tenant in stale:
                pipe.hdel(shard.tenant_settings, tenant)
                pipe.zrem(shard.tenants_guaranteed, tenant)
            for tenant, setting in own.items():
                pipe.hset(shard.tenant_settings, tenant, share(setting))
                if setting.min:
                    pipe.zadd(shard.tenants_guaranteed, {tenant: setting.min})
                else:
                    pipe.zrem(shard.tenants_guaranteed, tenant)
            await pipe.execute()
    return len(own)


async def load(redis: Redis, topology: Topology, tenant: str) -> tuple[int, int]:
    """(sessions in flight, sessions waiting for a slot) of a tenant, summed over the shards:
    the in-flight counts leave out leases that ran out (a crashed worker's)."""
    now_ms = int(time.time() * 1000)
    in_flight = waiting = 0
    for keys in topology.shards:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.zcount(keys.tenant_busy(tenant), now_ms, "+inf")
            pipe.zcard(keys.tenant_queue(tenant))
            busy, queued = await pipe.execute()
        in_flight += int(busy)
        waiting += int(queued)
    return in_flight, waiting


async def active(redis: Redis, topology: Topology) -> set[str]:
    """Tenants with sessions waiting for a slot in any shard."""
    found: set[str] = set()
    for keys in topology.shards:
        members = cast(list[bytes], await redis.zrange(keys.tenants_active, 0, -1))
        found |= {text(t) for t in members}
    return found


# --- budgets -----------------------------------------------------------------------------
#
# What a tenant used today is what the usage counters of the day say (the commit writes them
# with every reply, wasted attempts are counted beside them: whether a budget was set or not),
# plus the budget meter's ``unreported`` (calls that reported nothing, charged their
# estimate). Calls in flight, and ended calls whose attempt is not counted yet, hold tokens on
# the meter (``reserved``): a call may go when used + reserved, its estimate included, stays
# within the budget. Without a budget, nothing here runs.


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    granted: bool
    used: int  # today's usage counters + unreported
    reserved: int  # held by calls in flight, this one's included when granted


async def reserve(
    redis: Redis,
    scripts: Scripts,
    topology: Topology,
    keys: Keys,
    tenant: str,
    day: str,
    call_id: str,
    tokens: int,
    budget: int,
    lease_ms: int,
) -> Reservation:
    """Hold ``tokens`` for a call, then look at what the day used (the counters are read after
    the hold: a call's hold goes only once its usage is counted, so none is missed); over the
    budget, the hold is given back at once and the call refused."""
    b = keys.budget(tenant, day)
    unreported, held = await scripts.reserve(
        keys=[b.meter, b.leases], args=[call_id, tokens, lease_ms, BUDGET_KEEP_S]
    )
    used = await counted(redis, topology, tenant, day) + int(unreported)
    if used + int(held) <= budget:
        return Reservation(True, used, int(held))
    await spend(scripts, keys, tenant, day, call_id, 0)
    return Reservation(False, used, int(held) - tokens)


async def spend(
    scripts: Scripts, keys: Keys, tenant: str, day: str, call_id: str, used: int | None
) -> None:
    """A call ended: its hold becomes what it used (0: given back at once; None: it reported
    nothing, charged its estimate), until its attempt's usage is counted (`land`)."""
    b = keys.budget(tenant, day)
    await scripts.spend(
        keys=[b.meter, b.leases], args=[call_id, -1 if used is None else used, BUDGET_KEEP_S]
    )


async def land(scripts: Scripts, keys: Keys, tenant: str, day: str, call_ids: list[str]) -> None:
    """An attempt's usage is in the usage counters: its calls' holds go."""
    b = keys.budget(tenant, day)
    for start in range(0, len(call_ids), 1000):
        await scripts.land(keys=[b.meter, b.leases], args=list(call_ids[start : start + 1000]))


async def used_today(
    redis: Redis, topology: Topology, keys: Keys, tenant: str, day: str
) -> tuple[int, int]:
    """(tokens the tenant used on ``day``: the usage counters, committed and wasted, plus
    calls that reported nothing; tokens held now by calls whose usage is not counted yet): what
    `dialog-worker tenants` shows and what a budget is checked against."""
    unreported, reserved = await redis.hmget(
        keys.budget(tenant, day).meter, "unreported", "reserved"
    )
    return await counted(redis, topology, tenant, day) + _whole(unreported), _whole(reserved)


async def counted(redis: Redis, topology: Topology, tenant: str, day: str) -> int:
    """Input and output tokens of the tenant's committed and wasted attempts on ``day``, summed
    over the shards (one pipeline)."""
    names = [f"{tenant}:{kind}" for kind in TOKEN_KINDS]
    async with redis.pipeline(transaction=False) as pipe:
        for shard in topology.shards:
            pipe.hmget(shard.usage(day), names)
        rows = await pipe.execute()
    return sum(_whole(v) for row in rows for v in row)


# --- usage -------------------------------------------------------------------------------


def _whole(value: Any) -> int:
    if value is None:
        return 0
    try:
        return max(0, int(text(value)))
    except ValueError:
        return 0


def usage_totals(fields: dict[str, int]) -> dict[str, Any]:
    """Counters ``in out cost calls`` (and the wasted ones, ``w``-prefixed) as the client
    shows them."""

    def block(prefix: str) -> dict[str, Any]:
        return {
            "input_tokens": fields.get(prefix + "in", 0),
            "output_tokens": fields.get(prefix + "out", 0),
            "cost": fields.get(prefix + "cost", 0) / COST_UNIT,
            "calls": fields.get(prefix + "calls", 0),
        }

    return {**block(""), "wasted": block("w")}


async def tenant_usage(redis: Redis, topology: Topology, tenant: str, day: str) -> dict[str, Any]:
    """A tenant's usage of one day, summed over the shards: committed and wasted."""
    check_tenant(tenant)
    check_day(day)
    names = [*USAGE_KINDS, *WASTED_KINDS]
    sums = dict.fromkeys(names, 0)
    for keys in topology.shards:
        values = await redis.hmget(keys.usage(day), [f"{tenant}:{n}" for n in names])
        for name, value in zip(names, values, strict=True):
            sums[name] += _whole(value)
    return {"tenant": tenant, "day": day, **usage_totals(sums)}


async def tenants_with_usage(redis: Redis, topology: Topology, day: str) -> set[str]:
    """Tenants that have counters on ``day`` in any shard."""
    found: set[str] = set()
    for keys in topology.shards:
        for field in await redis.hkeys(keys.usage(day)):
            name, _, _ = text(field).rpartition(":")
            if name:
                found.add(name)
    return found
