"""Model-provider limit keys in Redis: what acquire, settle, pause and reopen
(lua/acquire-3.lua, lua/settle-2.lua, lua/pause-1.lua, lua/reopen-1.lua) are called with, the
limits set at runtime, and what operators read.

A limit key (``openai:gpt-4.1``) has ``rpm``, ``tpm`` and ``max_in_flight`` (0: none). Its
values come, highest first, from `dialog-worker limits set` (the key's hash in Redis, for every
worker at once), then the settings (``DIALOG_MODEL_LIMITS`` or the config file's
``model_limits``), then none. Its keys are global, not per shard: every worker and shard of
a deployment meets the same limit.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.config import (
    MAX_LIMIT_VALUE,
    Settings,
    limit_key_problem,
    parse_model_limits,
    whole_number,
)
from dialog_worker.errors import ValidationError
from dialog_worker.store.codec import DEFAULT_TENANT, text
from dialog_worker.store.keys import LimitKeys, limit_keys, limits_index
from dialog_worker.store.scripts import Scripts, Turn

# The hash fields of the limits set at runtime (acquire-3.lua reads them).
RUNTIME_FIELDS = {"rpm": "rpm", "tpm": "tpm", "max_in_flight": "mif"}
MAX_PAUSE_S = 7 * 86400
MAX_REASON_CHARS = 500
# A provider's 429 that names no wait (Retry-After 0, negative, unreadable, in the past) pauses
# its key this long, doubling with each 429 in a row after the key reopened, up to the most
# (and never past DIALOG_MAX_PROVIDER_PAUSE_S): no hot loop against a refusing provider.
PAUSE_FLOOR_MS = 1000
PAUSE_FLOOR_MAX_MS = 60_000


@dataclasses.dataclass(frozen=True, slots=True)
class LimitConfig:
    rpm: int = 0
    tpm: int = 0
    max_in_flight: int = 0

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_in_flight)

    def as_dict(self) -> dict[str, int]:
        return {"rpm": self.rpm, "tpm": self.tpm, "max_in_flight": self.max_in_flight}


def configured(settings: Settings) -> dict[str, LimitConfig]:
    """The limit keys of the settings (DIALOG_MODEL_LIMITS / the config file)."""
    if not settings.model_limits:
        return {}
    parsed = parse_model_limits("DIALOG_MODEL_LIMITS", settings.model_limits)
    return {key: LimitConfig(**spec) for key, spec in parsed.items()}


def check_key(key: object) -> str:
    problem = limit_key_problem(key)
    if problem:
        raise ValidationError(f"{problem}, got {str(key)[:60]!r}")
    assert isinstance(key, str)
    return key


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """acquire-3.lua's answer."""

    turn: Turn
    wait_ms: int
    why: str
    tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Runtime:
    """What a worker caches of a key: the limits set at runtime (None: not set), the pause,
    and the provider's 429s in a row (lua/pause-1.lua: a call that succeeds ends the run)."""

    rpm: int | None
    tpm: int | None
    max_in_flight: int | None
    paused_until_ms: int
    refusals: int = 0
    reopens: int = 0  # how often an operator ended a pause early (lua/reopen-1.lua)

    def effective(self, base: LimitConfig) -> LimitConfig:
        return LimitConfig(
            rpm=base.rpm if self.rpm is None else self.rpm,
            tpm=base.tpm if self.tpm is None else self.tpm,
            max_in_flight=base.max_in_flight if self.max_in_flight is None else self.max_in_flight,
        )


def _count(value: Any) -> int | None:
    """A whole number >= 0 read from Redis, or None (absent or not one: never trusted)."""
    if value is None:
        return None
    try:
        number = int(float(text(value)))
    except (ValueError, OverflowError):
        return None
    return number if number >= 0 else None


class LimitStore:
    """The Redis side of the limit keys for one deployment (a bytes client)."""

    def __init__(self, redis: Redis, scripts: Scripts, settings: Settings) -> None:
        self.redis = redis
        self.scripts = scripts
        self.settings = settings
        self.prefix = settings.prefix
        self.base = configured(settings)

    def keys(self, key: str) -> LimitKeys:
        return limit_keys(self.prefix, key)

    async def acquire(
        self,
        key: str,
        call_id: str,
        tokens: int,
        lease_ms: int,
        max_wait_ms: int,
        tenant: str = DEFAULT_TENANT,
        weight: float = 1.0,
        priority: int = 5,
    ) -> Answer:
        """One call's turn; on a key with a rate, turns are shared between the tenants by
        ``weight``, ``priority`` first inside a tenant (lua/acquire-3.lua)."""
        base = self.base.get(key, LimitConfig())
        k = self.keys(key)
        raw = await self.scripts.acquire(
            keys=[k.config, k.in_flight, k.reserved],
            args=[
                call_id,
                tokens,
                base.rpm,
                base.tpm,
                base.max_in_flight,
                lease_ms,
                max_wait_ms,
                tenant,
                repr(float(weight)),
                priority,
            ],
        )
        return Answer(Turn(int(raw[0])), int(raw[1]), text(raw[2]), int(raw[3]))

    async def settle(
        self, key: str, call_id: str, charged: int, used: int | None, succeeded: bool = False
    ) -> bool:
        k = self.keys(key)
        base = self.base.get(key, LimitConfig())
        raw = await self.scripts.settle(
            keys=[k.config, k.in_flight],
            args=[call_id, charged, -1 if used is None else used, base.tpm, int(succeeded)],
        )
        return bool(int(raw))

    async def pause(self, key: str, for_s: float, reason: str) -> int:
        """An operator's pause: close the key for every worker for ``for_s`` seconds (never
        shortening a pause in force); the ms until it opens again."""
        if not 0 <= for_s <= MAX_PAUSE_S:
            raise ValidationError(f"a pause lasts 0 to {MAX_PAUSE_S} seconds, got {for_s!r}")
        raw = await self.scripts.pause(
            keys=[self.keys(key).config],
            args=[int(for_s * 1000), _clip(reason), "operator"],
        )
        return int(raw)

    async def provider_pause(self, key: str, retry_after_s: float | None, reason: str) -> int:
        """A provider's 429: close the key for every worker for its ``Retry-After`` (None or
        0: it named no wait), but at least the key's floor, which grows with the provider's
        429s in a row, and at most DIALOG_MAX_PROVIDER_PAUSE_S (lua/pause-1.lua); the ms
        until it opens again."""
        cap_ms = round(self.settings.max_provider_pause_s * 1000)
        asked = -1
        if retry_after_s is not None and retry_after_s > 0:
            asked = min(round(retry_after_s * 1000), MAX_PAUSE_S * 1000)  # the script caps it
        raw = await self.scripts.pause(
            keys=[self.keys(key).config],
            args=[asked, _clip(reason), "provider", PAUSE_FLOOR_MS, PAUSE_FLOOR_MAX_MS, cap_ms],
        )
        # Listed by `dialog-worker limits` and the console from now on, even a key named in no
        # setting: a paused key is one an operator may want to see and resume.
        await self.redis.sadd(limits_index(self.prefix), key)
        return int(raw)

    async def reopen(self, key: str) -> int:
        """End the key's pause now, for every worker; the calls waiting for it go from now,
        in the order they were refused (lua/reopen-1.lua). The ms the pause was cut short by
        (0: it was not paused)."""
        return int(await self.scripts.reopen(keys=[self.keys(key).config], args=[]))

    async def clear_refusals(self, key: str) -> None:
        """A call on ``key`` succeeded without a slot (a key without limits): the provider's
        run of 429s is over (the next one pauses for the first floor again)."""
        await self.redis.hdel(self.keys(key).config, "ps")

    async def runtime(self, key: str) -> Runtime:
        rpm, tpm, mif, pu, ps, ro = await self.redis.hmget(
            self.keys(key).config, "rpm", "tpm", "mif", "pu", "ps", "ro"
        )
        return Runtime(
            _count(rpm), _count(tpm), _count(mif), _count(pu) or 0, _count(ps) or 0, _count(ro) or 0
        )

    async def set(
        self,
        key: str,
        rpm: int | None = None,
        tpm: int | None = None,
        max_in_flight: int | None = None,
    ) -> LimitConfig:
        """Set some of the key's limits for every worker (a partial update); the limits in
        force after it."""
        check_key(key)
        changes = {"rpm": rpm, "tpm": tpm, "max_in_flight": max_in_flight}
        fields: dict[str, int] = {}
        for name, value in changes.items():
            if value is None:
                continue
            try:
                fields[RUNTIME_FIELDS[name]] = whole_number(value, 0, MAX_LIMIT_VALUE)
            except ValueError as exc:
                raise ValidationError(f"{name}: {exc}") from None
        if not fields:
            raise ValidationError("give at least one of --rpm, --tpm, --max-in-flight")
        await self.redis.hset(
            self.keys(key).config, mapping=cast(Any, fields)
        )  # redis-py's Mapping is invariant
        await self.redis.sadd(limits_index(self.prefix), key)
        return (await self.runtime(key)).effective(self.base.get(key, LimitConfig()))

    async def known(self) -> list[str]:
        """The settings' keys and those set or paused at runtime, sorted."""
        try:
            listed = await self.redis.smembers(limits_index(self.prefix))
        except ResponseError:  # a reader without SMEMBERS (the operator ACL user)
            listed = set()
        names = set(self.base) | {text(n) for n in listed}
        return sorted(n for n in names if limit_key_problem(n) is None)

    async def view(self, key: str) -> dict[str, Any]:
        """One key as `dialog-worker limits` shows it."""
        k = self.keys(key)
        fields = ("rpm", "tpm", "mif", "pu", "pr", "mb", "mc", "mt", "pc", "pt", "ps")
        values = dict(zip(fields, await self.redis.hmget(k.config, *fields), strict=True))
        now_ms = int(time.time() * 1000)
        # Slots whose lease has not ended: a crashed caller's counts until its lease ends (acquire
        # drops it only at the key's next call).
        in_flight = await self.redis.zcount(k.in_flight, now_ms, "+inf")
        runtime = Runtime(_count(values["rpm"]), _count(values["tpm"]), _count(values["mif"]), 0)
        limits = runtime.effective(self.base.get(key, LimitConfig()))
        paused_until = _count(values["pu"]) or 0
        minute = now_ms // 60_000
        mb = _count(values["mb"])
        if mb == minute:
            last = (_count(values["pc"]) or 0, _count(values["pt"]) or 0)
        elif mb == minute - 1:
            last = (_count(values["mc"]) or 0, _count(values["mt"]) or 0)
        else:
            last = (0, 0)
        return {
            "key": key,
            **limits.as_dict(),
            "in_flight": int(in_flight),
            "paused_until": paused_until / 1000 if paused_until > now_ms else None,
            "pause_reason": text(values["pr"]) if paused_until > now_ms and values["pr"] else "",
            "provider_429s_in_a_row": _count(values["ps"]) or 0,
            "calls_last_minute": last[0],
            "tokens_last_minute": last[1],
            "source": _source(runtime, key in self.base),
        }


def _source(runtime: Runtime, in_settings: bool) -> str:
    """Where the key's limits come from: set at runtime, the settings, or nowhere."""
    if (runtime.rpm, runtime.tpm, runtime.max_in_flight) != (None, None, None):
        return "runtime"
    return "settings" if in_settings else "none"


def _clip(reason: str) -> str:
    data = reason.encode("utf-8", "replace")
    if len(data) <= MAX_REASON_CHARS:
        return data.decode("utf-8")
    return data[: MAX_REASON_CHARS - 3].decode("utf-8", "ignore") + "…"
