"""Operators' view and changes of model-provider limit keys and tenants (`dialog-worker limits`,
`dialog-worker tenants`, the console's limits page): each change is checked, written, and
recorded in the audit stream."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.errors import ValidationError
from dialog_worker.store import audit, tenants
from dialog_worker.store.keys import Keys, Topology, limits_index
from dialog_worker.store.limits import LimitStore, check_key
from dialog_worker.store.scripts import Scripts


def limit_store(redis: Redis, settings: Settings) -> LimitStore:
    scripts = Scripts.register(redis)
    return LimitStore(redis, scripts, settings)


async def list_limits(redis: Redis, settings: Settings) -> list[dict[str, Any]]:
    """Every limit key (the settings' and those set or paused at runtime)."""
    store = limit_store(redis, settings)
    return [await store.view(key) for key in await store.known()]


async def set_limits(
    redis: Redis,
    settings: Settings,
    key: str,
    who: str,
    *,
    rpm: int | None = None,
    tpm: int | None = None,
    max_in_flight: int | None = None,
    reason: str = "",
) -> dict[str, Any]:
    store = limit_store(redis, settings)
    await store.set(check_key(key), rpm=rpm, tpm=tpm, max_in_flight=max_in_flight)
    asked = {k: v for k, v in {"rpm": rpm, "tpm": tpm, "max_in_flight": max_in_flight}.items()
             if v is not None}  # fmt: skip
    await audit.record(redis, settings, who, "limit_set", key, reason, asked)
    return await store.view(key)


async def pause_key(
    redis: Redis,
    settings: Settings,
    key: str,
    for_s: float,
    reason: str,
    who: str,
    role: str,
    *,
    record: bool = True,
) -> dict[str, Any]:
    """Close a key for every worker for ``for_s`` seconds (a pause in force is never
    shortened); its callers queue up and resume in order. ``record``: write the audit entry
    here (the console writes its own around the action)."""
    store = limit_store(redis, settings)
    check_key(key)
    if not reason.strip():
        raise ValidationError("a pause needs a reason (--reason)")
    if record:
        await audit.record(
            redis, settings, who, "limit_pause", key, reason, {"for_s": for_s}, role=role
        )
    await store.pause(key, for_s, f"{who}: {reason}")
    await redis.sadd(limits_index(settings.prefix), key)
    return await store.view(key)


async def resume_key(
    redis: Redis,
    settings: Settings,
    key: str,
    reason: str,
    who: str,
    role: str,
    *,
    record: bool = True,
) -> dict[str, Any]:
    """Reopen a paused key for every worker now (a provider's pause or an operator's): the
    calls waiting for it go from now, in the order they were refused, and the workers bring
    the messages they handed back for the pause to their turn within a second. ``record``:
    write the audit entry here (the console writes its own around the action)."""
    store = limit_store(redis, settings)
    check_key(key)
    if not reason.strip():
        raise ValidationError("a resume needs a reason (--reason)")
    if record:
        await audit.record(redis, settings, who, "limit_resume", key, reason, {}, role=role)
    early_ms = await store.reopen(key)
    return {**await store.view(key), "resumed_early_s": round(early_ms / 1000, 3)}


async def paused_keys(redis: Redis, settings: Settings) -> list[dict[str, Any]]:
    """The keys paused now (by a provider or an operator), soonest to reopen first."""
    rows = [row for row in await list_limits(redis, settings) if row["paused_until"]]
    return sorted(rows, key=lambda row: row["paused_until"])


async def list_tenants(redis: Redis, settings: Settings) -> list[dict[str, Any]]:
    """Tenants with settings, with usage today or with sessions waiting, one row each:
    `in_flight` and `waiting` are sessions (in flight, waiting for a slot), summed over the
    shards."""
    keys = Keys.from_settings(settings)
    topology = Topology.from_settings(settings)
    day = tenants.today()
    own = await tenants.load_all(redis, keys)
    names = sorted(
        set(own)
        | await tenants.tenants_with_usage(redis, topology, day)
        | await tenants.active(redis, topology)
    )
    rows = []
    for name in names:
        setting = own.get(name, tenants.TenantSettings())
        # What the budget check sees: the day's counters (committed and wasted) and calls that
        # reported nothing, whenever the budget was set; and what calls hold now.
        used, reserved = await tenants.used_today(redis, topology, keys, name, day)
        in_flight, waiting = await tenants.load(redis, topology, name)
        rows.append(
            {
                "tenant": name,
                "weight": setting.weight,
                "min": setting.min,
                "max": setting.max,
                "in_flight": in_flight,
                "waiting": waiting,
                "daily_tokens": setting.budget(settings.tenant_daily_tokens),
                "used_today": used,
                "reserved_now": reserved,
            }
        )
    return rows


async def set_tenant(
    redis: Redis, settings: Settings, tenant: str, who: str, reason: str = "", **changes: Any
) -> dict[str, Any]:
    keys = Keys.from_settings(settings)
    topology = Topology.from_settings(settings)
    updated = await tenants.set_settings(redis, keys, tenant, topology, **changes)
    asked = {k: v for k, v in changes.items() if v is not None}
    await audit.record(redis, settings, who, "tenant_set", tenant, reason, asked)
    return {"tenant": tenant, "weight": updated.weight, "min": updated.min, "max": updated.max,
            "daily_tokens": updated.budget(settings.tenant_daily_tokens)}  # fmt: skip
