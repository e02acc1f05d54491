"""The audit stream: one entry per operator action, appended before the action runs (no
action without its record) and one after it with the outcome. Kept in Redis, so the history
survives restarts of the console and is the same for every replica; capped with MAXLEN ~."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, cast

from redis.asyncio import Redis

from dialog_worker.console.auth import User

FIELDS = ("at_ms", "who", "role", "action", "target", "reason", "outcome", "detail", "ref")


@dataclasses.dataclass(frozen=True, slots=True)
class AuditLog:
    redis: Redis  # a client decoding responses to str, for XADD
    raw: Redis  # a bytes client, for reading
    key: str
    maxlen: int

    async def append(
        self,
        user: User,
        action: str,
        target: str,
        reason: str,
        outcome: str,
        detail: dict[str, Any] | None = None,
        ref: str = "",
    ) -> str:
        fields = {
            "at_ms": str(int(time.time() * 1000)),
            "who": user.name,
            "role": str(user.role),
            "action": action,
            "target": target,
            "reason": reason,
            "outcome": outcome,
            "detail": json.dumps(detail or {}, ensure_ascii=False, sort_keys=True),
            "ref": ref,
        }
        entry_id = await self.redis.xadd(
            self.key,
            cast(Any, fields),
            maxlen=self.maxlen,
            approximate=True,
        )
        return str(entry_id)

    async def page(self, before: str | None, count: int) -> list[dict[str, str]]:
        """Newest first; `before`: the id the previous page ended at (exclusive). Read as
        bytes and decoded field by field: an entry someone else wrote cannot break the page."""
        high = f"({before}" if before else "+"
        rows = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await self.raw.xrevrange(self.key, max=high, min="-", count=count),
        )
        out = []
        for entry_id, fields in rows:
            text = {_text(k): _text(v) for k, v in fields.items()}
            out.append({"id": _text(entry_id), **{k: text.get(k, "") for k in FIELDS}})
        return out


def _text(value: bytes) -> str:
    return value.decode("utf-8", "backslashreplace")
