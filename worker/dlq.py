"""Dead-letter stream tools: list, show, redrive, purge.

Redrive re-sends a dead letter through `send` with the msg_id ``redrive:<dead-letter id>``:
- it gets a new seq, so it is applied after whatever the session received meanwhile (its
  original turn already holds the fallback reply and stays in history);
- the derived msg_id makes a repeated redrive of the same dead letter (a crash between the
  send and the removal) a duplicate, not a second message;
- the dead letter is removed only after the send was accepted; a redriven message that fails
  again is dead-lettered again, nothing is lost.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import anyio

from worker.client import DialogClient
from worker.errors import ValidationError
from worker.streams import xrange

SUMMARY_FIELDS = (
    "session_id",
    "msg_id",
    "seq",
    "error_kind",
    "error",
    "attempts",
    "first_failed_at",
    "last_failed_at",
    "source_entry_id",
)


def summary(entry_id: str, fields: dict[str, str]) -> dict[str, Any]:
    return {"id": entry_id, **{k: fields.get(k) for k in SUMMARY_FIELDS}}


async def list_entries(client: DialogClient, limit: int) -> list[dict[str, Any]]:
    rows = await xrange(client.redis, client.keys.dlq, count=limit)
    return [summary(i, f) for i, f in rows]


async def show(client: DialogClient, entry_id: str) -> dict[str, Any] | None:
    rows = await xrange(client.redis, client.keys.dlq, entry_id, entry_id)
    return {"id": rows[0][0], **rows[0][1]} if rows else None


async def redrive(
    client: DialogClient, limit: int | None, rate_per_s: float | None, only_id: str | None
) -> dict[str, int]:
    """Re-send dead letters (oldest first), at most `rate_per_s` per second."""
    done = skipped = 0
    interval = 1 / rate_per_s if rate_per_s else 0.0
    total = await client.redis.xlen(client.keys.dlq)
    last_progress = time.monotonic()
    cursor = "-"
    while limit is None or done + skipped < limit:
        if only_id is not None:
            rows = await xrange(client.redis, client.keys.dlq, only_id, only_id)
        else:
            rows = await xrange(client.redis, client.keys.dlq, cursor, "+", 100)
        if not rows:
            break
        for entry_id, fields in rows:
            if limit is not None and done + skipped >= limit:
                break
            started = time.monotonic()
            try:
                await client.send(
                    fields.get("session_id", ""),
                    fields.get("text", ""),
                    msg_id=f"redrive:{entry_id}",
                )
            except ValidationError as exc:
                # Cannot be re-sent as it is (no session, oversized): it stays for a human.
                skipped += 1
                print(f"dialog-worker: dlq {entry_id} not redriven: {exc}", file=sys.stderr)
                continue
            await client.redis.xdel(client.keys.dlq, entry_id)
            done += 1
            if time.monotonic() - last_progress >= 1:
                last_progress = time.monotonic()
                print(f"redrive: {done} re-sent, {skipped} skipped of {total}", file=sys.stderr)
            if interval:
                await anyio.sleep(max(0.0, interval - (time.monotonic() - started)))
        if only_id is not None:
            break
        cursor = f"({rows[-1][0]}"
    return {"redriven": done, "skipped": skipped}


async def purge(client: DialogClient, only_id: str | None) -> int:
    if only_id is not None:
        return int(await client.redis.xdel(client.keys.dlq, only_id))
    count = int(await client.redis.xlen(client.keys.dlq))
    await client.redis.delete(client.keys.dlq)
    return count
