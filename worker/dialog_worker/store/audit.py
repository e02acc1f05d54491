"""The audit stream's writer for actions taken outside the console (the CLI's `limits set`,
`limits pause`, `tenants set`): one entry per action, in the format the console's audit page
reads (dialog_worker/console/audit.py)."""

from __future__ import annotations

import json
import time
from typing import Any, cast

from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.store.keys import audit_key


async def record(
    redis: Redis,
    settings: Settings,
    who: str,
    action: str,
    target: str,
    reason: str,
    detail: dict[str, Any],
    *,
    role: str = "cli",
    outcome: str = "done",
) -> str:
    fields = {
        "at_ms": str(int(time.time() * 1000)),
        "who": who,
        "role": role,
        "action": action,
        "target": target,
        "reason": reason,
        "outcome": outcome,
        "detail": json.dumps(detail, ensure_ascii=False, sort_keys=True),
        "ref": "",
    }
    entry_id = await redis.xadd(
        audit_key(settings),
        cast(Any, fields),
        maxlen=settings.console_audit_maxlen,
        approximate=True,
    )
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
