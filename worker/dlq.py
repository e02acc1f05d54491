"""Dead-letter stream tools: list, show, redrive, purge.

A dead letter keeps the original entry's fields byte for byte, which need not be UTF-8 (that
may be why it was dead-lettered): the stream is read as bytes and shown with undecodable
bytes escaped (``\\xff``); such a letter cannot be redriven as it is and stays for a human.

Redrive re-sends a dead letter to the stream it came from (its ``source_stream`` field; the
configured stream when the field is absent) through `send` with the msg_id
``redrive:<dead-letter id>``:
- a dead letter from another deployment's stream (a DLQ shared on purpose) is skipped and
  stays: this deployment's engine must not answer it;
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
from collections.abc import Sequence
from typing import Any, cast

import anyio
from redis.asyncio import Redis

from dialog_worker.client import DialogClient
from dialog_worker.codec import RESERVED_FIELDS
from dialog_worker.errors import ValidationError
from dialog_worker.keys import Keys

# What the worker adds to a dead letter (see lua/commit-5.lua and lua/intake-5.lua); the rest
# are the original entry's fields.
LETTER_FIELDS = frozenset(
    {
        "error",
        "error_kind",
        "attempts",
        "first_failed_at",
        "last_failed_at",
        "consumer",
        "worker_version",
        "source_stream",
        "source_entry_id",
        "raw_entry",
    }
)
Row = tuple[str, dict[str, str]]

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


async def list_entries(
    shards: Sequence[Keys], client: DialogClient, limit: int
) -> list[dict[str, Any]]:
    rows = []
    for keys in shards:
        rows += [
            {**summary(i, f), "shard": keys.shard}
            for i, f in await _rows(client, keys.dlq, count=limit)
        ]
    return sorted(rows, key=lambda r: _id_key(r["id"]))[:limit]


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, n = entry_id.partition("-")
    return int(ms), int(n or 0)


async def find(
    shards: Sequence[Keys], client: DialogClient, entry_id: str
) -> tuple[Keys, dict[str, str]] | None:
    for keys in shards:
        rows = await _rows(client, keys.dlq, entry_id, entry_id)
        if rows:
            return keys, rows[0][1]
    return None


async def show(
    shards: Sequence[Keys], client: DialogClient, entry_id: str
) -> dict[str, Any] | None:
    found = await find(shards, client, entry_id)
    return None if found is None else {"id": entry_id, "shard": found[0].shard, **found[1]}


async def redrive(
    shards: Sequence[Keys],
    client: DialogClient,
    limit: int | None,
    rate_per_s: float | None,
    only_id: str | None,
) -> dict[str, int]:
    """Re-send dead letters (oldest first per shard), at most `rate_per_s` per second."""
    done = skipped = 0
    interval = 1 / rate_per_s if rate_per_s else 0.0
    total = sum([int(await client.redis.xlen(k.dlq)) for k in shards])
    last_progress = time.monotonic()
    for keys in shards:
        # Only what is there now: a redriven message that fails again while we run comes back
        # as a new dead letter, which this run must not redrive again.
        newest = await _raw(client).xrevrange(keys.dlq, count=1)
        if not newest:
            continue
        end = _text(cast(bytes, newest[0][0]))
        cursor = "-"
        while limit is None or done + skipped < limit:
            if only_id is not None:
                rows = await _rows(client, keys.dlq, only_id, only_id)
            else:
                rows = await _rows(client, keys.dlq, cursor, end, 100)
            if not rows:
                break
            for entry_id, fields in rows:
                if limit is not None and done + skipped >= limit:
                    break
                started = time.monotonic()
                try:
                    await resend(client, keys, entry_id, fields)
                except ValidationError as exc:
                    # Cannot be re-sent as it is (no session, oversized): it stays for a human.
                    skipped += 1
                    print(f"dialog-worker: dlq {entry_id} not redriven: {exc}", file=sys.stderr)
                    continue
                await client.redis.xdel(keys.dlq, entry_id)
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


async def resend(client: DialogClient, keys: Keys, entry_id: str, fields: dict[str, str]) -> None:
    """Send one dead letter back to its source stream. Raises ValidationError when it cannot
    be re-sent as it is."""
    source = fields.get("source_stream") or keys.stream
    own = {k.stream for k in client.topology.shards}
    if source not in own:
        raise ValidationError(
            f"it came from stream {source!r}, not from this deployment's "
            f"({', '.join(sorted(own))}): redrive it with DIALOG_STREAM set to its deployment"
        )
    if "raw_entry" in fields:
        raise ValidationError("it had too many fields and is kept whole in raw_entry")
    meta = {k: v for k, v in fields.items() if k not in RESERVED_FIELDS | LETTER_FIELDS}
    if any(_escaped(v) for v in (fields.get("session_id", ""), fields.get("text", ""))) or any(
        _escaped(k) or _escaped(v) for k, v in meta.items()
    ):
        raise ValidationError("some of its fields are not UTF-8 text")
    await client.send(
        fields.get("session_id", ""),
        fields.get("text", ""),
        msg_id=f"redrive:{entry_id}",
        meta=meta,
    )


async def purge(shards: Sequence[Keys], client: DialogClient, only_id: str | None) -> int:
    count = 0
    for keys in shards:
        if only_id is not None:
            count += int(await client.redis.xdel(keys.dlq, only_id))
        else:
            count += int(await client.redis.xlen(keys.dlq))
            await client.redis.delete(keys.dlq)
    return count


def _raw(client: DialogClient) -> Redis:
    return client.raw


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


_UNDECODED = "\ufffd"  # marks a field that was not UTF-8 (see _rows)


def _escaped(value: str) -> bool:
    return value.startswith(_UNDECODED)


async def _rows(
    client: DialogClient, stream: str, start: str = "-", end: str = "+", count: int | None = None
) -> list[Row]:
    """Entries read as bytes, each field decoded alone: UTF-8 as it is, anything else with
    its bytes escaped and marked (so it is shown, and never re-sent as if it were text)."""
    rows = cast(
        list[tuple[bytes, dict[bytes, bytes]]],
        await _raw(client).xrange(stream, min=start, max=end, count=count),
    )
    out: list[Row] = []
    for entry_id, fields in rows:
        decoded: dict[str, str] = {}
        for name, value in fields.items():
            decoded[_field(name)] = _field(value)
        out.append((_text(entry_id), decoded))
    return out


def _field(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return _UNDECODED + value.decode("utf-8", "backslashreplace")
