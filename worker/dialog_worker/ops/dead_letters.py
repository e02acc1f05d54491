"""Dead-letter stream tools: list, show, redrive, purge.

A dead letter keeps the original entry's fields byte for byte, which need not be UTF-8 (that
may be why it was dead-lettered) and may repeat a name (a malformed entry): letters are read
through the one stream reader (dialog_worker/store/stream_entries.py) and shown with undecodable
bytes escaped (``\\xff``); such a letter cannot be redriven as it is and stays for a human.

Handles. Entry ids are unique within one stream only: with N shards, N dead-letter streams can
hold the same id. A letter's handle is its entry id in a deployment of one shard, and
``<shard>:<entry id>`` with several (``dlq list`` prints it). A bare entry id is still accepted
when exactly one shard holds it; one held by several is refused (ValidationError, exit 2) and
the message names the handles to use.

Redrive re-sends a dead letter to the stream it came from (its ``source_stream`` field; the
configured stream when the field is absent) through `send` with the msg_id
``redrive:<handle>``:
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

import argparse
import contextlib
import dataclasses
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from redis.exceptions import ResponseError

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.errors import ValidationError
from dialog_worker.store.codec import RESERVED_FIELDS
from dialog_worker.store.keys import Keys
from dialog_worker.store.stream_entries import Entry

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

PAGE = 100


class NoSuchLetter(RuntimeError):
    """No dead letter has this handle (the CLI exits 1, as `dlq show` does)."""


# ---------------------------------------------------------------------------------------------
# handles

_HANDLE = re.compile(r"(?:(\d{1,5}):)?(\d{1,20}(?:-\d{1,20})?)")


@dataclasses.dataclass(frozen=True, slots=True)
class Handle:
    shard: int | None  # None: a bare entry id
    entry_id: str

    @classmethod
    def parse(cls, raw: str) -> Handle:
        match = _HANDLE.fullmatch(raw)
        if match is None:
            raise ValidationError(
                f"not a dead-letter id (like 1718000000000-0, or 1:1718000000000-0 with "
                f"shards): {raw!r}"
            )
        shard, entry_id = match.groups()
        return cls(None if shard is None else int(shard), entry_id)


def handle_arg(raw: str) -> str:
    """argparse type of a dead-letter id: refused at parse time, kept as given."""
    try:
        Handle.parse(raw)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return raw


def handle_of(client: DialogClient, keys: Keys, entry_id: str) -> str:
    return entry_id if len(client.topology.shards) == 1 else f"{keys.shard}:{entry_id}"


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)?")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_arg(raw: str) -> float:
    """argparse type of `--older-than`: seconds, or a number with s, m, h or d."""
    match = _DURATION.fullmatch(raw.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected a duration like 90s, 15m, 2h or 7d, got {raw!r}"
        )
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


# ---------------------------------------------------------------------------------------------
# reading


def summary(handle: str, entry: Entry) -> dict[str, Any]:
    return {"id": handle, **{k: entry.get(k) for k in SUMMARY_FIELDS}}


async def list_entries(
    shards: Sequence[Keys], client: DialogClient, limit: int
) -> list[dict[str, Any]]:
    rows = []
    for keys in shards:
        rows += [
            (
                _id_key(e.id),
                {**summary(handle_of(client, keys, e.id), e), "shard": keys.shard},
            )
            for e in await client.entries.range(keys.dlq, count=limit)
        ]
    return [row for _, row in sorted(rows, key=lambda r: r[0])][:limit]


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, n = entry_id.partition("-")
    return int(ms), int(n or 0)


async def find(shards: Sequence[Keys], client: DialogClient, raw_handle: str) -> tuple[Keys, Entry]:
    """The one letter a handle names. Raises NoSuchLetter when none does, ValidationError
    when a bare entry id is held by several shards."""
    handle = Handle.parse(raw_handle)
    candidates = [k for k in shards if handle.shard is None or k.shard == handle.shard]
    found = []
    for keys in candidates:
        entry = await client.entries.one(keys.dlq, handle.entry_id)
        if entry is not None:
            found.append((keys, entry))
    if not found:
        raise NoSuchLetter(f"no dead letter {raw_handle}")
    if len(found) > 1:
        names = " or ".join(f"{k.shard}:{handle.entry_id}" for k, _ in found)
        raise ValidationError(
            f"dead-letter id {raw_handle} is in {len(found)} shards: give it as {names}"
        )
    return found[0]


async def show(shards: Sequence[Keys], client: DialogClient, raw_handle: str) -> dict[str, Any]:
    """Every field of one letter; when a name repeats, `all_fields` lists every pair as
    stored (the top-level key shows the first value)."""
    keys, entry = await find(shards, client, raw_handle)
    shown: dict[str, Any] = {
        "id": handle_of(client, keys, entry.id),
        "shard": keys.shard,
        **entry.fields,
    }
    if entry.names_repeat:
        shown["all_fields"] = entry.shown_pairs()
    return shown


# ---------------------------------------------------------------------------------------------
# redrive


async def redrive(
    shards: Sequence[Keys],
    client: DialogClient,
    limit: int | None,
    rate_per_s: float | None,
    only_id: str | None,
) -> dict[str, int]:
    """Re-send dead letters (oldest first per shard), at most `rate_per_s` per second."""
    if only_id is not None:
        keys, entry = await find(shards, client, only_id)
        return await _redrive_pages(client, _one(keys, entry), limit, rate_per_s)
    return await _redrive_pages(client, _all_letters(shards, client), limit, rate_per_s)


Pages = AsyncIterator[tuple[Keys, list[Entry]]]


async def _one(keys: Keys, entry: Entry) -> Pages:
    yield keys, [entry]


async def _all_letters(shards: Sequence[Keys], client: DialogClient) -> Pages:
    for keys in shards:
        # Only what is there now: a redriven message that fails again while we run comes back
        # as a new dead letter, which this run must not redrive again.
        newest = await client.entries.revrange(keys.dlq, 1)
        if not newest:
            continue
        cursor = "-"
        while True:
            page = await client.entries.range(keys.dlq, cursor, newest[0].id, PAGE)
            if not page:
                break
            yield keys, page
            if len(page) < PAGE:
                break
            cursor = f"({page[-1].id}"


async def _redrive_pages(
    client: DialogClient, pages: Pages, limit: int | None, rate_per_s: float | None
) -> dict[str, int]:
    done = skipped = 0
    interval = 1 / rate_per_s if rate_per_s else 0.0
    last_progress = time.monotonic()
    async for keys, page in pages:
        for entry in page:
            if limit is not None and done + skipped >= limit:
                return {"redriven": done, "skipped": skipped}
            started = time.monotonic()
            handle = handle_of(client, keys, entry.id)
            try:
                await resend(client, keys, handle, entry)
            except ValidationError as exc:
                # Cannot be re-sent as it is (no session, oversized): it stays for a human.
                skipped += 1
                print(f"dialog-worker: dlq {handle} not redriven: {exc}", file=sys.stderr)
                continue
            await client.redis.xdel(keys.dlq, entry.id)
            await unindex(client, keys, [entry])
            done += 1
            if time.monotonic() - last_progress >= 1:
                last_progress = time.monotonic()
                print(f"redrive: {done} re-sent, {skipped} skipped", file=sys.stderr)
            if interval:
                await anyio.sleep(max(0.0, interval - (time.monotonic() - started)))
    return {"redriven": done, "skipped": skipped}


async def resend(client: DialogClient, keys: Keys, handle: str, entry: Entry) -> None:
    """Send one dead letter back to its source stream. Raises ValidationError when it cannot
    be re-sent as it is."""
    await client.send(**resend_fields(client, keys, handle, entry))


def resend_fields(client: DialogClient, keys: Keys, handle: str, entry: Entry) -> dict[str, Any]:
    """What re-sending a dead letter sends: `DialogClient.send`'s arguments (session_id,
    text, msg_id, meta). Raises ValidationError when it cannot be re-sent as it is."""
    fields = entry.fields
    source = fields.get("source_stream") or keys.stream
    own = {k.stream for k in client.topology.shards}
    if source not in own:
        raise ValidationError(
            f"it came from stream {source!r}, not from this deployment's "
            f"({', '.join(sorted(own))}): redrive it with DIALOG_STREAM set to its deployment"
        )
    if "raw_entry" in fields:
        raise ValidationError("it had too many fields and is kept whole in raw_entry")
    if not entry.is_text:
        raise ValidationError("some of its fields are not UTF-8 text")
    if entry.names_repeat:
        raise ValidationError("a field name appears more than once in it")
    meta = {k: v for k, v in fields.items() if k not in RESERVED_FIELDS | LETTER_FIELDS}
    return dict(
        session_id=fields.get("session_id", ""),
        text=fields.get("text", ""),
        msg_id=f"redrive:{handle}",
        meta=meta,
    )


# ---------------------------------------------------------------------------------------------
# the sessions' letter indexes


async def unindex(client: DialogClient, keys: Keys, entries: Sequence[Entry]) -> None:
    """Remove deleted letters from their sessions' letter indexes (SessionKeys.letters,
    written with each letter by the scripts). A letter without a UTF-8 session_id was never
    indexed."""
    by_session: dict[str, list[str]] = {}
    for entry in entries:
        raw = entry.raw("session_id")
        try:
            session_id = raw.decode("utf-8") if raw is not None else None
        except UnicodeDecodeError:
            continue
        if session_id:
            by_session.setdefault(session_id, []).append(entry.id)
    for session_id, ids in by_session.items():
        with contextlib.suppress(ResponseError):  # a key of another type, written by hand
            await client.redis.zrem(keys.session(session_id).letters, *ids)


# ---------------------------------------------------------------------------------------------
# purge


async def purge(
    shards: Sequence[Keys],
    client: DialogClient,
    only_id: str | None,
    *,
    session_id: str | None = None,
    older_than_s: float | None = None,
) -> int:
    """Delete one letter (`only_id`), the letters of a session and/or those dead-lettered
    more than `older_than_s` ago, or, with none of these, every letter."""
    if only_id is not None:
        keys, entry = await find(shards, client, only_id)
        removed = int(await client.redis.xdel(keys.dlq, entry.id))
        await unindex(client, keys, [entry])
        return removed
    if session_id is None and older_than_s is None:
        count = 0
        for keys in shards:
            count += int(await client.redis.xlen(keys.dlq))
            await client.redis.delete(keys.dlq)
        return count
    end = "+"
    if older_than_s is not None:
        cutoff_ms = int(time.time() * 1000 - older_than_s * 1000)
        if cutoff_ms <= 0:
            return 0
        end = f"({cutoff_ms}-0"
    want = session_id.encode() if session_id is not None else None
    keep: Callable[[Entry], bool] | None = (
        None if want is None else (lambda e: e.raw("session_id") == want)
    )
    count = 0
    for keys in shards:
        cursor = "-"
        while True:
            page = await client.entries.range(keys.dlq, cursor, end, PAGE)
            gone = [e for e in page if keep is None or keep(e)]
            if gone:
                count += int(await client.redis.xdel(keys.dlq, *[e.id for e in gone]))
                await unindex(client, keys, gone)
            if len(page) < PAGE:
                break
            cursor = f"({page[-1].id}"
    return count
