"""The Lua scripts (one file per atomic operation in lua/) and the codes they return."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from functools import cache
from pathlib import Path
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import NoScriptError


class Code(enum.IntEnum):
    """What the scripts answer (see each lua/ file's header)."""

    HANDOFF = 2
    COMMITTED = 6
    RELEASED = 7
    FENCED_TOKEN = -1
    FENCED_VERSION = -2
    INVALID = -3  # commit-5.lua: this commit's arguments cannot be written (the others are)
    CANCELLED = -4  # commit-5.lua: the message was cancelled meanwhile; commit it as cancelled
    JOURNALED = 8  # journal-1.lua: the result is recorded
    JOURNAL_HAD = 9  # journal-1.lua: the name had a result already (it is answered)
    PARKED = 10  # interrupt-3.lua: the session waits for a person
    JOURNAL_FULL = -5  # journal-1.lua: past DIALOG_JOURNAL_MAX_BYTES; nothing written


class Turn(enum.IntEnum):
    """What acquire-3.lua answers for a model call on a limited key."""

    GRANTED = 1  # go after the wait (inside the step)
    RESERVED = 2  # a turn is kept for this call id after the wait: hand the message back
    BUSY = 3  # max_in_flight reached: nothing charged, try again after the wait


class Release(enum.StrEnum):
    """How release-2.lua gives a held message back (its ARGV[6]; anything else is refused)."""

    FAILED = "1"  # a failed attempt: the error is recorded, the attempt stays counted
    HAND_BACK = "0"  # shutdown: the attempt is given back
    HAND_BACK_STREAMED = "2"  # shutdown after partial text: the next attempt needs a new number
    # Waiting for a model's limit key after partial text: a new number for the next attempt,
    # yet no attempt spent (counted in the message's journal, beside the awaited ones).
    HAND_BACK_UNSPENT = "3"


def lua_dir() -> Path:
    """The installed wheel carries the scripts in dialog_worker/lua; a checkout has them in lua/."""
    installed = Path(__file__).resolve().parent.parent / "lua"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[3] / "lua"


# The flags each script declares in its `#!lua` line (Redis >= 7.0). Any flag line makes Redis
# refuse a script before it runs when memory is over `maxmemory` (an OOM error, nothing
# written) instead of failing at its first write half-way through, or letting it overrun the
# limit once it has written. Every script here writes, so none is `no-writes`; only renew and
# lease, which extend leases (and bring lapsed ones' sessions back) and add almost nothing, may
# run out of memory (`allow-oom`), so a holder waiting for room to commit keeps its lease.
# `allow-stale` and `no-cluster` are not wanted.
FLAGS: dict[str, str] = {"renew": "allow-oom", "lease": "allow-oom"}


@cache
def source(name: str) -> str:
    """The script's text: its flags, then the shared prelude (lua/_common.lua) its helpers
    come from, then its own file."""
    matches = sorted(lua_dir().glob(f"{name}-*.lua"))
    if len(matches) != 1:
        raise FileNotFoundError(f"expected one lua/{name}-N.lua in {lua_dir()}, found {matches}")
    prelude = (lua_dir() / "_common.lua").read_text(encoding="utf-8")
    shebang = f"#!lua flags={FLAGS.get(name, '')}"
    return shebang + "\n" + prelude + "\n" + matches[0].read_text(encoding="utf-8")


class Script:
    """A script called by SHA, loaded again when the server has lost it (a restart, a failover
    to a replica: replicas do not receive SCRIPT LOAD).

    Like redis-py's AsyncScript, but the reload is single-flight: after a failover hundreds of
    coroutines meet NOSCRIPT at once, and redis-py's cluster client, asked for SCRIPT LOAD on
    every primary by all of them together, broke a connection mid-handshake (AttributeError
    on a closed writer, redis-py 8.1, seen with 200 concurrent callers)."""

    def __init__(self, redis: Redis, source: str) -> None:
        self.redis = redis
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()
        self._lock = anyio.Lock()
        self._loads = 0

    async def __call__(self, keys: list[str], args: list[str | bytes | int | float]) -> Any:
        try:
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self._reload(self._loads)
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)

    async def _reload(self, seen: int) -> None:
        async with self._lock:
            if self._loads == seen:  # nobody reloaded while we waited
                await self.redis.script_load(self.source)
                self._loads += 1


@dataclasses.dataclass(frozen=True, slots=True)
class Scripts:
    """One Script per lua/ file, built once per client."""

    intake: Script
    resume: Script
    commit: Script
    release: Script
    renew: Script
    lease: Script
    delconsumer: Script
    cancel: Script
    fire: Script
    erase: Script
    journal: Script
    interrupt: Script
    resolve: Script
    # Model-provider limits and budgets (dialog_worker/store/limits.py, store/tenants.py).
    acquire: Script
    settle: Script
    pause: Script
    reopen: Script
    reserve: Script
    spend: Script
    land: Script

    @classmethod
    def register(cls, redis: Redis) -> Scripts:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: Script(redis, source(n)) for n in names})
