"""Reset and delete one session (``DialogClient.reset`` / ``delete``, CLI ``session
reset|delete``): the fenced script (lua/erase-2.lua), the session's entries in the shard-wide
streams (dead letters; reply events on request), and one audit event per action in the audit
stream the console shows."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, cast

from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.engine.protocol import initial_state
from dialog_worker.store.keys import Keys, audit_key
from dialog_worker.store.scripts import Script

# Entries read per XRANGE call while looking for a session's entries in a shard-wide stream.
CHUNK = 500


@dataclasses.dataclass(frozen=True, slots=True)
class EraseResult:
    """What `DialogClient.reset` or `delete` did. ``found``: the session had a state or a
    lock. ``waiting``: messages waiting in it (kept by reset, removed by delete).
    ``running``: a step was running for it (its commit is refused). ``keys_deleted``,
    ``timers``, ``dead_letters``, ``reply_events``: what delete removed."""

    session_id: str
    action: str
    found: bool
    waiting: int
    running: bool
    keys_deleted: int = 0
    timers: int = 0
    dead_letters: int = 0
    reply_events: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class Eraser:
    """What erasing needs of a client: its connections (``raw`` returns bytes), the erase
    script registered on ``redis``, the settings and the session's shard."""

    redis: Redis
    raw: Redis
    script: Script
    settings: Settings
    keys: Keys


async def erase(
    eraser: Eraser,
    session_id: str,
    action: str,
    *,
    who: str,
    reason: str,
    replies: bool = False,
) -> EraseResult:
    keys, settings = eraser.keys, eraser.settings
    doc = json.dumps(initial_state(session_id), separators=(",", ":"))
    found, deleted, waiting, timers, running = await eraser.script(
        keys=[keys.ready, keys.session_prefix],
        args=[action, session_id, doc, settings.dedupe_ttl_s],
    )
    letters = events = 0
    if action == "delete":
        letters = await remove_entries(eraser.raw, keys.dlq, session_id)
        if replies:
            events = await remove_entries(eraser.raw, keys.replies, session_id)
    result = EraseResult(
        session_id,
        action,
        bool(int(found)),
        int(waiting),
        bool(int(running)),
        int(deleted),
        int(timers),
        letters,
        events,
    )
    await audit(
        eraser.redis, settings, who, f"session_{action}", session_id, reason, result.as_dict()
    )
    return result


async def remove_entries(raw: Redis, stream: str, session_id: str) -> int:
    """XDEL the entries of ``stream`` whose session_id field is ``session_id``, reading the
    stream in chunks of `CHUNK` (bounded by the stream's MAXLEN). An admin action: its cost
    is the stream's length, never a scan of the keyspace."""
    wanted = session_id.encode("utf-8")
    removed, start = 0, "-"
    while True:
        rows = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await raw.xrange(stream, min=start, max="+", count=CHUNK),
        )
        if not rows:
            return removed
        ids = [entry_id for entry_id, fields in rows if fields.get(b"session_id") == wanted]
        if ids:
            removed += int(await raw.xdel(stream, *ids))
        if len(rows) < CHUNK:
            return removed
        start = "(" + rows[-1][0].decode()


async def audit(
    redis: Redis,
    settings: Settings,
    who: str,
    action: str,
    target: str,
    reason: str,
    detail: dict[str, Any],
) -> None:
    """One event in the console's audit stream (dialog_worker/console/audit.py reads it)."""
    fields = {
        "at_ms": str(int(time.time() * 1000)),
        "who": who,
        "role": "client",
        "action": action,
        "target": target,
        "reason": reason,
        "outcome": "done",
        "detail": json.dumps(detail, ensure_ascii=False, sort_keys=True),
        "ref": "",
    }
    await redis.xadd(
        audit_key(settings),
        cast(Any, fields),
        maxlen=settings.console_audit_maxlen,
        approximate=True,
    )
