"""The Lua scripts (one file per atomic operation in lua/) and the codes they return."""

from __future__ import annotations

import dataclasses
import enum
from functools import cache
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript


class Code(enum.IntEnum):
    ACQUIRED = 1
    HANDOFF = 2
    DUPLICATE = 3
    CONTENDED = 4
    OUT_OF_ORDER = 5
    COMMITTED = 6
    REQUEUED = 7
    FENCED_TOKEN = -1
    FENCED_VERSION = -2


@dataclasses.dataclass(frozen=True, slots=True)
class LockReply:
    """What acquire-6.lua and commit-8.lua return (see their headers)."""

    code: Code
    attempts: int
    version: int
    applied_seq: int
    state_json: str
    first_failed_at: str
    last_error: str
    handoff_id: str
    handoff_fields: str

    @classmethod
    def parse(cls, raw: list[Any]) -> LockReply:
        return cls(
            code=Code(int(raw[0])),
            attempts=int(raw[1]),
            version=int(raw[2]),
            applied_seq=int(raw[3]),
            state_json=raw[4] or "",
            first_failed_at=raw[5] or "",
            last_error=raw[6] or "",
            handoff_id=raw[7] or "",
            handoff_fields=raw[8] or "",
        )


def lua_dir() -> Path:
    """The installed wheel carries the scripts in worker/lua; a checkout has them in lua/."""
    installed = Path(__file__).resolve().parent / "lua"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "lua"


@cache
def source(name: str) -> str:
    matches = sorted(lua_dir().glob(f"{name}-*.lua"))
    if len(matches) != 1:
        raise FileNotFoundError(f"expected one lua/{name}-N.lua in {lua_dir()}, found {matches}")
    return matches[0].read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True, slots=True)
class Scripts:
    """Registered once per client; redis-py calls them by SHA and reloads on NOSCRIPT."""

    send: AsyncScript
    acquire: AsyncScript
    commit: AsyncScript
    retry: AsyncScript
    renew: AsyncScript
    promote: AsyncScript
    deadletter: AsyncScript
    delconsumer: AsyncScript

    @classmethod
    def register(cls, redis: Redis) -> Scripts:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: redis.register_script(source(n)) for n in names})
