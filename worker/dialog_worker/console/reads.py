"""What the console shows, read from Redis and never from its own memory. Every read is
bounded: O(1) commands for the overview, one session's keys (and its shard's dead letters,
scanned as `session_view` does) for a timeline, and at most `LETTER_SCAN_PER_PAGE` dead
letters per shard for one page of the dead-letter list. Nothing here writes."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.errors import ValidationError
from dialog_worker.ops import model_limits
from dialog_worker.store.codec import check_id, unpack_timer
from dialog_worker.store.keys import Keys
from dialog_worker.store.queue_view import (
    aggregate_stats,
    entry_age_s,
    reply_group_lags,
    session_view,
)
from dialog_worker.store.stream_entries import StreamReader

PAGE_DEFAULT = 50
PAGE_MAX = 200
# Dead letters read per shard to fill one filtered page; a page that stops here says so and
# offers to go on from where it stopped.
LETTER_SCAN_PER_PAGE = 5_000
REDACTED = "[redacted]"
# The newest dead letters of a shard the session page reads for the session's own (about
# 100 ms for 10,000 on a laptop-class core).
SESSION_LETTER_SCAN = 10_000
# A session's indexed dead letters the session page shows, newest first.
SESSION_LETTERS_SHOWN = 200
# A session's timers the session page shows (the scripts keep at most 64; more were written
# by hand).
TIMERS_SHOWN = 100


# ---------------------------------------------------------------------------------------------
# redaction


@dataclasses.dataclass(frozen=True, slots=True)
class Redactor:
    """Hides the values of the configured field names wherever they appear: message and
    dead-letter fields, and keys of the state at any depth."""

    names: frozenset[str]

    @classmethod
    def from_setting(cls, listed: str) -> Redactor:
        return cls(frozenset(n.strip() for n in listed.split(",") if n.strip()))

    def fields(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        return {k: (REDACTED if k in self.names else v) for k, v in fields.items()}

    def value(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (REDACTED if k in self.names else self.value(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value


# ---------------------------------------------------------------------------------------------
# overview

# The figures of `stats` the overview shows first, with their labels; any others follow.
HEADLINE = (
    ("stream_length", "inbound depth"),
    ("oldest_pending_age_s", "oldest age (s)"),
    ("pending", "in flight"),
    ("lag", "unread"),
    ("delayed", "ready set"),
    ("dlq_length", "dead letters"),
)


async def overview(client: DialogClient) -> dict[str, Any]:
    shards = client.topology.shards
    stats = await aggregate_stats(client.redis, shards)
    reply_lag: dict[str, int] = {}
    workers: list[dict[str, Any]] = []
    for keys in shards:
        for group, lag in (await reply_group_lags(client.redis, keys)).items():
            reply_lag[group] = reply_lag.get(group, 0) + lag
        workers += await _consumers(client.redis, keys)
    workers.sort(key=lambda w: (w["gone"], not w["waiting"], w["idle_ms"] or 0, w["name"]))
    return {
        "at_ms": int(time.time() * 1000),
        "headline": [{"key": k, "label": label, "value": stats.get(k)} for k, label in HEADLINE],
        "stats": {k: v for k, v in stats.items() if k != "shards"},
        "reply_group_lag": reply_lag,
        "workers": workers,
    }


async def _consumers(redis: Redis, keys: Keys) -> list[dict[str, Any]]:
    """The workers' consumers: `idle_ms` is the time since each was last handed entries of
    the stream. That is no heartbeat: an idle pool has one worker per shard waiting for
    messages (`waiting`: it holds the shard's waiter role, a lease it renews while it lives);
    the others wait on the shard's wake stream, and Redis moves `idle` only when a read
    delivers something. `gone`: its worker stopped or died (its presence key is gone,
    dialog_worker/daemon/presence.py) while another worker of the shard announces its own; a
    worker of a version that announces nothing is not told apart (never gone)."""
    try:
        rows = await redis.xinfo_consumers(keys.stream, keys.group)
    except ResponseError:
        rows = []  # no stream or group yet
    waiter = await redis.get(keys.waiter)
    consumers = [
        {
            "name": str(r.get("name")),
            "shard": keys.shard,
            "pending": int(r.get("pending", 0)),
            "idle_ms": int(r.get("idle", 0)),
            "inactive_ms": r.get("inactive"),
            "waiting": waiter is not None and str(r.get("name")) == str(waiter),
            "gone": False,
        }
        for r in rows
    ]
    if consumers:
        present = await _present(redis, keys, [str(c["name"]) for c in consumers])
        if any(present):  # workers of this shard announce themselves: the others are gone
            for consumer, alive in zip(consumers, present, strict=True):
                consumer["gone"] = not alive and not consumer["waiting"]
    if waiter is not None and not any(c["waiting"] for c in consumers):
        # Its consumer was deleted as idle (DIALOG_CONSUMER_IDLE_DELETE_S) or it has never
        # been handed an entry: it is live all the same.
        consumers.append(
            {
                "name": str(waiter),
                "shard": keys.shard,
                "pending": 0,
                "idle_ms": None,
                "inactive_ms": None,
                "waiting": True,
                "gone": False,
            }
        )
    return consumers


async def _present(redis: Redis, keys: Keys, names: list[str]) -> list[bool]:
    """Whether each worker's presence key exists (one round trip)."""
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.exists(keys.presence(name))
        return [bool(n) for n in await pipe.execute()]


# ---------------------------------------------------------------------------------------------
# one session


def session_id_arg(raw: str | None) -> str:
    """A session id from a request, checked as the client checks it (ValidationError)."""
    return check_id("session_id", raw if raw is not None else "")


async def timeline(client: DialogClient, session_id: str, redact: Redactor) -> dict[str, Any]:
    keys = client.keys_for(session_id)
    # `session_view` would read the shard's whole dead-letter stream (up to 100,000 entries,
    # most of a second) for this session's letters; it is given a stream name that holds
    # nothing, and the letters are read below, newest first and bounded.
    view: dict[str, Any] = {}
    view_error = None
    try:
        view = await session_view(
            client.redis,
            dataclasses.replace(keys, dlq=keys.dlq + ":none"),
            session_id,
            _entry_reader(client),
        )
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        # Bookkeeping that does not parse must not hide the rest (state, dead letters).
        view_error = f"{type(exc).__name__}: {exc}"
    state = await client.state(session_id)
    held_raw = await client.raw.hget(keys.session(session_id).state, "h")
    held = None if held_raw is None else _text(held_raw)
    history = state.get("history") if isinstance(state, dict) else None
    found_letters, scanned, complete = await session_letters(client, keys, session_id)
    indexed = scanned == 0
    now = int(time.time() * 1000)
    letters = []
    for entry_id, fields in found_letters:
        row: dict[str, Any] = {**_summary(fields), "seq": _int(fields.get("seq"))}
        row["age_s"] = round(entry_age_s(entry_id, now), 1)
        letters.append(redact.fields(row) | {"handle": handle(keys, entry_id), "id": entry_id})
    letters.sort(key=original_order)
    timers, timers_complete = await session_timers(client, keys, session_id, redact, now)
    # A step that waits for a person (dialog_worker.interrupt): one GET of the await key.
    awaiting = [
        {**p.as_dict(), "payload": redact.value(p.payload)}
        for p in await client.pending(session_id)
    ]
    found = bool(
        state is not None or view.get("last_seq") or view.get("waiting") or letters or timers
    )
    waits = None if held is not None or awaiting else await waits_for(client, session_id, view)
    return {
        "session_id": session_id,
        "shard": keys.shard,
        "found": found or view_error is not None or held is not None,
        "held": held,
        "view_error": view_error,
        "view": {k: v for k, v in view.items() if k not in ("dead_letters", "waiting")},
        "lock": view.get("lock") or {},
        "in_flight": view.get("in_flight"),
        "waiting": [redact.fields(w) for w in view.get("waiting", [])],
        "dead_letters": letters,
        "letters_scanned": scanned,
        "letters_complete": complete,
        "letters_indexed": indexed,
        "timers": timers,
        "timers_complete": timers_complete,
        "awaiting": awaiting,
        "waits_for": waits,
        "history": redact.value(history) if isinstance(history, list) else [],
        "state_json": (
            None
            if state is None
            else json.dumps(redact.value(state), indent=2, ensure_ascii=False, sort_keys=True)
        ),
    }


async def session_timers(
    client: DialogClient, keys: Keys, session_id: str, redact: Redactor, now_ms: int
) -> tuple[list[dict[str, Any]], bool]:
    """The session's timers (its timers hash, see lua/_common.lua set_timer), soonest first,
    at most TIMERS_SHOWN, and whether that is all of them. A payload that does not parse is
    listed by name with `unreadable` set, never hiding the others."""
    key = keys.session(session_id).timers
    raw: dict[bytes, bytes] = {}
    complete = True
    try:
        cursor = 0
        while True:
            cursor, batch = await client.raw.hscan(key, cursor, match="t:*", count=100)
            raw.update(cast(dict[bytes, bytes], batch))
            if len(raw) > TIMERS_SHOWN:
                complete = False
                break
            if not cursor:
                break
    except ResponseError:
        return [], True  # a key of another type, written by hand
    timers: list[dict[str, Any]] = []
    for field, value in raw.items():
        name = _text(field)[2:]
        unpacked = unpack_timer(value)
        if unpacked is None:
            timers.append({"name": name, "unreadable": True, "due_ms": None})
            continue
        due_ms, on_message, fields = unpacked
        text_fields = {_text(k): _text(v) for k, v in fields.items()}
        meta = {
            k: v
            for k, v in text_fields.items()
            if k not in ("session_id", "text", "msg_id", "timer")
        }
        timers.append(
            {
                "name": name,
                "unreadable": False,
                "due_ms": due_ms,
                "due": _utc(due_ms),
                "in_s": round((due_ms - now_ms) / 1000, 1),
                "text": redact.fields({"text": text_fields.get("text")})["text"],
                "cancel_on_message": on_message,
                "meta": redact.fields(meta),
            }
        )
    timers.sort(key=lambda t: (t["due_ms"] is None, t["due_ms"] or 0, t["name"]))
    return timers[:TIMERS_SHOWN], complete


def _utc(ms: int) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))
    except (OverflowError, OSError, ValueError):
        return f"{ms} ms"  # out of the calendar's range: written by hand


async def session_letters(
    client: DialogClient, keys: Keys, session_id: str, scan: int | None = None
) -> tuple[list[tuple[str, dict[str, str]]], int, bool]:
    """The session's dead letters, how many letters of the stream were read for them
    (0: the index alone answered) and whether they are all there.

    The scripts index each session's letters as they write them (SessionKeys.letters; the
    newest SESSION_LETTERS_SHOWN are read, one XRANGE each). Letters older than the first
    indexed one (Keys.letters_since; all of them when nothing was ever indexed) were written
    before the index existed: they are looked for among the newest `scan`
    (SESSION_LETTER_SCAN) of that older part of the stream, and the dead-letter list
    (filtered by session) pages through the rest."""
    found, complete = await _indexed_letters(client, keys, session_id)
    since = await client.raw.get(keys.letters_since)
    high = "+" if since is None else f"({_text(since)}"
    older, scanned, older_complete = await _scan_session_letters(
        client, keys, session_id, high, SESSION_LETTER_SCAN if scan is None else scan
    )
    seen = {entry_id for entry_id, _ in found}
    found += [(i, f) for i, f in older if i not in seen]
    return found, scanned, complete and older_complete


async def _indexed_letters(
    client: DialogClient, keys: Keys, session_id: str
) -> tuple[list[tuple[str, dict[str, str]]], bool]:
    index = keys.session(session_id).letters
    try:
        raw_ids = cast(list[bytes], await client.raw.zrevrange(index, 0, SESSION_LETTERS_SHOWN))
        ids = [_text(i) for i in raw_ids]
    except ResponseError:
        return [], True  # a key of another type, written by hand: the stream is read instead
    pipe = client.raw.pipeline(transaction=False)
    for entry_id in ids[:SESSION_LETTERS_SHOWN]:
        if _is_entry_id(entry_id):
            pipe.xrange(keys.dlq, min=entry_id, max=entry_id)
    rows = cast(list[list[tuple[bytes, dict[bytes, bytes]]]], await pipe.execute())
    want = session_id.encode("utf-8")
    found = [
        (_text(row[0][0]), {_text(k): _text(v) for k, v in row[0][1].items()})
        for row in rows
        if row and row[0][1].get(b"session_id") == want  # gone: purged by hand
    ]
    return found, len(ids) <= SESSION_LETTERS_SHOWN


async def _scan_session_letters(
    client: DialogClient, keys: Keys, session_id: str, high: str, bound: int
) -> tuple[list[tuple[str, dict[str, str]]], int, bool]:
    want = session_id.encode("utf-8")
    found: list[tuple[str, dict[str, str]]] = []
    scanned = 0
    while scanned < bound:
        count = min(1000, bound - scanned)
        batch = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await client.raw.xrevrange(keys.dlq, max=high, min="-", count=count),
        )
        scanned += len(batch)
        for raw_id, raw_fields in batch:
            if raw_fields.get(b"session_id") == want:
                found.append((_text(raw_id), {_text(k): _text(v) for k, v in raw_fields.items()}))
        if len(batch) < count:
            return found, scanned, True
        high = f"({_text(batch[-1][0])}"
    more = await client.raw.xrevrange(keys.dlq, max=high, min="-", count=1)
    return found, scanned, not more


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def _entry_reader(client: DialogClient) -> Any:
    """What `session_view` reads stream entries with: the client's one reader of producer
    bytes where it has one (`entries`), else its bytes client."""
    return getattr(client, "entries", None) or client.raw


def original_order(letter: Mapping[str, Any]) -> tuple[int, int, int]:
    """A session's dead letters in the order their messages were sequenced (seq), those
    without a seq after, each group in dead-letter order."""
    seq = letter.get("seq")
    ms, n = id_key(str(letter.get("id", "0-0")))
    return (0, int(seq), 0) if isinstance(seq, int) else (1, ms, n)


PREFIX_MATCHES = 50


async def sessions_by_prefix(client: DialogClient, prefix: str) -> tuple[list[str], bool]:
    """Session ids starting with `prefix` (byte-wise) among the sessions that received a
    message in the current or the previous DIALOG_DEDUPE_TTL_S, sorted, at most
    PREFIX_MATCHES, and whether there were more: one ZRANGEBYLEX per bucket and shard."""
    window_ms = client.settings.dedupe_ttl_s * 1000
    now = int(time.time() * 1000) // window_ms
    low = b"[" + prefix.encode("utf-8")
    high = b"[" + prefix.encode("utf-8") + b"\xff"
    found: set[str] = set()
    for keys in client.topology.shards:
        for bucket in (now, now - 1):
            try:
                raw = cast(
                    list[bytes],
                    await client.raw.zrangebylex(
                        keys.sessions_seen(bucket), low, high, start=0, num=PREFIX_MATCHES + 1
                    ),
                )
            except ResponseError:
                continue  # a key of another type, written by hand
            found.update(_text(v) for v in raw)
    ids = sorted(found)
    return ids[:PREFIX_MATCHES], len(ids) > PREFIX_MATCHES


async def find_message(client: DialogClient, msg_id: str) -> list[dict[str, Any]]:
    """The sessions (one per shard at most) a message with this msg_id was sequenced for in
    the last DIALOG_DEDUPE_TTL_S (and up to a quarter more): per shard, an HGET of each
    quarter's hash intake keeps (Keys.msg_sessions), the newest first, until it is found."""
    quarter = int(time.time() * 1000) // (client.settings.dedupe_ttl_s * 250)
    found = []
    for keys in client.topology.shards:
        for q in range(quarter, quarter - 5, -1):
            try:
                raw = await client.raw.hget(keys.msg_sessions(q), msg_id)
            except ResponseError:
                continue  # a key of another type, written by hand
            if raw is not None:
                found.append({"session_id": _text(raw), "shard": keys.shard})
                break
    return found


# ---------------------------------------------------------------------------------------------
# dead letters


def handle(keys: Keys, entry_id: str) -> str:
    """The console's name of one dead letter: its shard and its entry id (entry ids are
    unique within one shard's stream only)."""
    return f"{keys.shard}:{entry_id}"


def parse_handle(client: DialogClient, raw: str) -> tuple[Keys, str]:
    shard, sep, entry_id = raw.partition(":")
    if not sep or not shard.isdigit() or not _is_entry_id(entry_id):
        raise ValidationError(f"not a dead-letter handle: {raw!r}")
    try:
        return client.topology.shard(int(shard)), entry_id
    except IndexError as exc:
        raise ValidationError(str(exc)) from None


def _is_entry_id(value: str) -> bool:
    ms, sep, n = value.partition("-")
    ok = ms.isascii() and ms.isdigit() and len(ms) <= 20
    return ok and (not sep or (n.isascii() and n.isdigit() and len(n) <= 20))


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, n = entry_id.partition("-")
    try:
        return int(ms), int(n or 0)
    except ValueError:
        return 0, 0


@dataclasses.dataclass(frozen=True, slots=True)
class LetterFilter:
    kind: str | None = None
    session_id: str | None = None
    older_than_s: float | None = None

    def matches(self, fields: Mapping[str, str]) -> bool:
        if self.kind is not None and fields.get("error_kind") != self.kind:
            return False
        return self.session_id is None or fields.get("session_id") == self.session_id


@dataclasses.dataclass(frozen=True, slots=True)
class LetterPage:
    rows: list[dict[str, Any]]
    next_cursor: str | None  # "<shard>:<entry id>" to continue after, or None: the end
    scanned: int


async def letters_page(
    client: DialogClient,
    flt: LetterFilter,
    cursor: str | None,
    limit: int,
    redact: Redactor,
    now_ms: int | None = None,
) -> LetterPage:
    """One page of dead letters over every shard, oldest first, after `cursor`. Each shard
    is read from the cursor's entry id for at most LETTER_SCAN_PER_PAGE entries; when a shard
    stops there, nothing past the point where it stopped is shown (another shard's later
    letters would otherwise jump ahead of its unread ones)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    after: tuple[int, int, int] | None = None
    start = "-"
    if cursor:
        keys, entry_id = parse_handle(client, cursor)
        ms, n = id_key(entry_id)
        after = (ms, n, keys.shard)
        start = entry_id
    end = "+"
    if flt.older_than_s is not None:
        cutoff = now - int(flt.older_than_s * 1000)
        if cutoff <= 0:
            return LetterPage([], None, 0)
        end = f"({cutoff}-0"
    if flt.session_id is not None:
        return await _session_page(client, flt, start, end, after, limit, redact, now)
    found: list[tuple[tuple[int, int, int], dict[str, Any]]] = []
    horizon: tuple[int, int, int] | None = None  # the first place a shard stopped early
    scanned = 0
    for keys in client.topology.shards:
        rows, stopped_at, count = await _scan(client.entries, keys, start, end, after, flt, limit)
        scanned += count
        found += rows
        if stopped_at is not None and (horizon is None or stopped_at < horizon):
            horizon = stopped_at
    found.sort(key=lambda r: r[0])
    if horizon is not None:
        found = [r for r in found if r[0] <= horizon]
    page = found[:limit]
    if len(found) > limit:
        next_cursor: str | None = page[-1][1]["handle"]
    elif horizon is not None:
        next_cursor = f"{horizon[2]}:{horizon[0]}-{horizon[1]}"
    else:
        next_cursor = None
    rows_out = []
    for _, row in page:
        row["age_s"] = round(entry_age_s(row["id"], now), 1)
        rows_out.append(redact.fields(row) | {"handle": row["handle"], "id": row["id"]})
    return LetterPage(rows_out, next_cursor, scanned)


# The session index keeps this many of a session's newest letters (lua/_common.lua).
LETTERS_KEPT = 1000


async def _session_page(
    client: DialogClient,
    flt: LetterFilter,
    start: str,
    end: str,
    after: tuple[int, int, int] | None,
    limit: int,
    redact: Redactor,
    now: int,
) -> LetterPage:
    """One page of one session's dead letters, oldest first: those the session's index
    (SessionKeys.letters) covers are read by entry id from it, and only the part of its
    shard's stream the index does not cover is read as the unfiltered list reads it, bounded
    by LETTER_SCAN_PER_PAGE. The index covers letters from Keys.letters_since on (nothing
    when it was never written), and from its own oldest entry on once it is full (older ones
    of the session were trimmed from it)."""
    assert flt.session_id is not None
    keys = client.keys_for(flt.session_id)
    index = keys.session(flt.session_id).letters
    since = await client.raw.get(keys.letters_since)
    boundary: tuple[int, int] | None = None  # letters from here on are in the index
    if since is not None and _is_entry_id(_text(since)):
        boundary = id_key(_text(since))
        try:
            if int(await client.raw.zcard(index)) >= LETTERS_KEPT:
                oldest = cast(list[bytes], await client.raw.zrange(index, 0, 0))
                if oldest and _is_entry_id(_text(oldest[0])):
                    boundary = max(boundary, id_key(_text(oldest[0])))
        except ResponseError:
            boundary = None  # a key of another type, written by hand: the stream is read
    after_id = None if after is None else (after[0], after[1])
    end_id = _end_id(end)
    found: list[tuple[tuple[int, int, int], dict[str, Any]]] = []
    scanned = 0
    if boundary is None or after_id is None or after_id < boundary:
        scan_end = end
        if boundary is not None and (end_id is None or boundary <= end_id):
            scan_end = f"({boundary[0]}-{boundary[1]}"
        rows, stopped_at, scanned = await _scan(
            client.entries, keys, start, scan_end, after, flt, limit
        )
        found += rows
        if stopped_at is not None:  # read its bound, or found more than a page
            page = found[:limit]
            cursor = page[-1][1]["handle"] if len(found) > limit else handle(keys, _id(stopped_at))
            return LetterPage(_rows(page, now, redact), cursor, scanned)
    if boundary is not None:
        # from the boundary's own letter on, or after the cursor's
        first = (boundary[0], boundary[1] - 1)
        low = first if after_id is None or after_id < boundary else after_id
        more, read = await _indexed_page(client, keys, index, low, end_id, flt, limit - len(found))
        found += more
        scanned += read
    page = found[:limit]
    next_cursor = page[-1][1]["handle"] if len(found) > limit else None
    return LetterPage(_rows(page, now, redact), next_cursor, scanned)


async def _indexed_page(
    client: DialogClient,
    keys: Keys,
    index: str,
    low: tuple[int, int],
    end: tuple[int, int] | None,
    flt: LetterFilter,
    want: int,
) -> tuple[list[tuple[tuple[int, int, int], dict[str, Any]]], int]:
    """Up to want + 1 matching letters the index names after `low` (and before `end`), each
    read by its entry id, and how many were read. Ids the stream no longer holds, or whose
    letter is another session's (written by hand), are passed over."""
    try:
        raw = cast(
            list[bytes],
            # ZRANGE ... BYSCORE: the command the operator's ACL grants (not ZRANGEBYSCORE)
            await client.raw.zrange(index, low[0], "+inf" if end is None else end[0], byscore=True),
        )
    except ResponseError:
        return [], 0
    ids = sorted(
        (i for i in (_text(m) for m in raw) if _is_entry_id(i)),
        key=id_key,
    )
    ids = [i for i in ids if id_key(i) > low and (end is None or id_key(i) < end)]
    out: list[tuple[tuple[int, int, int], dict[str, Any]]] = []
    read = 0
    while ids and len(out) <= want:
        chunk, ids = ids[: want + 1 - len(out)], ids[want + 1 - len(out) :]
        pipe = client.raw.pipeline(transaction=False)
        for entry_id in chunk:
            pipe.xrange(keys.dlq, min=entry_id, max=entry_id)
        rows = cast(list[list[tuple[bytes, dict[bytes, bytes]]]], await pipe.execute())
        read += len(chunk)
        for row in rows:
            if not row:
                continue  # redriven or purged since
            entry_id = _text(row[0][0])
            fields = {_text(k): _text(v) for k, v in row[0][1].items()}
            if flt.matches(fields):
                ms, n = id_key(entry_id)
                summary = {"id": entry_id, "handle": handle(keys, entry_id), "shard": keys.shard}
                out.append(((ms, n, keys.shard), summary | _summary(fields)))
    return out, read


def _end_id(end: str) -> tuple[int, int] | None:
    """The exclusive upper bound "(<ms>-0" letters_page reads to, or None for "+"."""
    return None if end == "+" else id_key(end.removeprefix("("))


def _id(at: tuple[int, int, int]) -> str:
    return f"{at[0]}-{at[1]}"


def _rows(
    page: list[tuple[tuple[int, int, int], dict[str, Any]]], now: int, redact: Redactor
) -> list[dict[str, Any]]:
    out = []
    for _, row in page:
        row["age_s"] = round(entry_age_s(row["id"], now), 1)
        out.append(redact.fields(row) | {"handle": row["handle"], "id": row["id"]})
    return out


async def _scan(
    reader: StreamReader,
    keys: Keys,
    start: str,
    end: str,
    after: tuple[int, int, int] | None,
    flt: LetterFilter,
    limit: int,
) -> tuple[list[tuple[tuple[int, int, int], dict[str, Any]]], tuple[int, int, int] | None, int]:
    """Matching letters of one shard (at most limit + 1), where it stopped reading early (or
    None when it reached the end) and how many it read."""
    out: list[tuple[tuple[int, int, int], dict[str, Any]]] = []
    scanned = 0
    cursor = start
    while True:
        want = min(1000, LETTER_SCAN_PER_PAGE - scanned)
        batch = await reader.range(keys.dlq, cursor, end, want)
        scanned += len(batch)
        last: tuple[int, int, int] | None = None
        for entry in batch:
            entry_id = entry.id
            ms, n = id_key(entry_id)
            last = (ms, n, keys.shard)
            if after is not None and last <= after:
                continue
            fields = entry.fields
            if flt.matches(fields):
                row = {"id": entry_id, "handle": handle(keys, entry_id), "shard": keys.shard}
                out.append((last, row | _summary(fields)))
                if len(out) > limit:
                    return out, last, scanned
        if len(batch) < want:
            return out, None, scanned
        if scanned >= LETTER_SCAN_PER_PAGE:
            return out, last, scanned
        cursor = f"({batch[-1].id}"


_SUMMARY = (
    "session_id",
    "msg_id",
    "seq",
    "error_kind",
    "error",
    "attempts",
    "last_failed_at",
    "text",
)


def _summary(fields: Mapping[str, str]) -> dict[str, str | None]:
    return {k: fields.get(k) for k in _SUMMARY}


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


async def letter_fields(client: DialogClient, keys: Keys, entry_id: str) -> dict[str, str] | None:
    """Every field of one dead letter (a repeated name's first value), or None when it is
    gone."""
    entry = await client.entries.one(keys.dlq, entry_id)
    return None if entry is None else entry.fields


def distinct(values: Iterable[str | None]) -> list[str]:
    return sorted({v for v in values if v})


# ---------------------------------------------------------------------------------------------
# one message's life, and what a session waits for

# Records of a message's life read at most (the worker keeps at most 32: more were written by
# hand) and the items of each shown.
LIFE_RECORDS_SHOWN = 64
LIFE_ITEMS_SHOWN = 32
WAIT_WORDS = {
    "rate": "the model's rate limit",
    "paused": "a paused model key",
    "slots": "a free worker slot",
    "tenant_cap": "its tenant's share",
}


async def message_life(
    client: DialogClient, session_id: str, msg_id: str, redact: Redactor
) -> dict[str, Any]:
    """One message's life on one page: each attempt the worker recorded (start, end, how it
    ended, its error), each wait (the rate, a pause) with its duration, the time between
    attempts (waited outside a step), each model call (key, tokens) and each journaled call;
    and its turn in the history, if kept. Two reads (HGETALL of its life hash, the state).
    Records that do not parse are counted, never trusted."""
    keys = client.keys_for(session_id)
    try:
        raw = cast(
            dict[bytes, bytes], await client.raw.hgetall(keys.session(session_id).life(msg_id))
        )
    except ResponseError:
        raw = {}  # a key of another type, written by hand
    records: list[dict[str, Any]] = []
    unreadable = 0
    for value in [v for k, v in raw.items() if k != b"n"][:LIFE_RECORDS_SHOWN]:
        record = _life_record(value)
        if record is None:
            unreadable += 1
        else:
            records.append(record)
    records.sort(key=lambda r: (r["start_ms"], r["attempt"]))
    before: int | None = None
    for r in records:
        r["between_s"] = None if before is None else round((r["start_ms"] - before) / 1000, 1)
        before = r["end_ms"]
        if r.get("error"):
            r["error"] = redact.fields({"error": r["error"]})["error"]
    state = await client.state(session_id)
    history = state.get("history") if isinstance(state, dict) else None
    turn = next(
        (
            t
            for t in reversed(history if isinstance(history, list) else [])
            if isinstance(t, dict) and t.get("msg_id") == msg_id
        ),
        None,
    )
    first, last = (records[0], records[-1]) if records else (None, None)
    return {
        "session_id": session_id,
        "msg_id": msg_id,
        "found": bool(records) or turn is not None,
        "attempts": records,
        "unreadable": unreadable,
        "took_s": round((last["end_ms"] - first["start_ms"]) / 1000, 1) if first and last else None,
        "queued_s": (
            round((first["start_ms"] - first["enqueued_ms"]) / 1000, 1)
            if first and first.get("enqueued_ms")
            else None
        ),
        "waited_s": round(
            sum(w["ms"] for r in records for w in r["waits"]) / 1000
            + sum(r["between_s"] or 0 for r in records),
            1,
        ),
        "turn": redact.value(turn) if turn is not None else None,
    }


def _life_record(value: bytes) -> dict[str, Any] | None:
    """One attempt's record as the worker writes it (dialog_worker/daemon/message_life.py),
    checked field by field; None when it is not one."""
    try:
        got = json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(got, dict):
        return None
    whole = {k: got.get(k) for k in ("attempt", "start_ms", "end_ms")}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in whole.values()):
        return None
    start, end = cast(int, whole["start_ms"]), cast(int, whole["end_ms"])
    enqueued = got.get("enqueued_ms")

    def rows(name: str) -> list[dict[str, Any]]:
        found = got.get(name)
        items = found[:LIFE_ITEMS_SHOWN] if isinstance(found, list) else []
        return [i for i in items if isinstance(i, dict)]

    waits = []
    for w in rows("waits"):
        ms = w.get("ms")
        until = w.get("until_ms")
        waits.append(
            {
                "reason": str(w.get("reason", "")),
                "words": WAIT_WORDS.get(str(w.get("reason", "")), str(w.get("reason", ""))),
                "key": str(w.get("key", "")),
                "ms": ms if isinstance(ms, int) and not isinstance(ms, bool) and ms >= 0 else 0,
                "until": _utc(until)
                if isinstance(until, int) and not isinstance(until, bool)
                else None,
            }
        )
    return {
        "attempt": whole["attempt"],
        "start_ms": start,
        "end_ms": end,
        "start": _utc(start),
        "end": _utc(end),
        "took_s": round((end - start) / 1000, 3),
        "enqueued_ms": enqueued
        if isinstance(enqueued, int) and not isinstance(enqueued, bool)
        else None,
        "outcome": str(got.get("outcome", "")),
        "error": str(got["error"]) if got.get("error") else None,
        "waits": waits,
        "calls": [
            {
                k: c.get(k)
                for k in ("key", "model", "tokens", "used", "error")
                if c.get(k) is not None
            }
            for c in rows("calls")
        ],
        "once": [
            {"name": str(o.get("name", "")), "replayed": o.get("replayed") is True}
            for o in rows("once")
        ],
    }


async def waits_for(
    client: DialogClient, session_id: str, view: Mapping[str, Any]
) -> dict[str, Any] | None:
    """What the session waits for now, in words, or None (nothing to do, or running): its
    next message handed back for the model (a paused key, with the pause's reason and
    reopening time, or its key's rate, with its turn), a retry's backoff, or a free worker
    slot (its tenant's share included). Reads the next message's life (one HGETALL) and, for
    a pause, the paused keys."""
    in_flight = view.get("in_flight")
    if not isinstance(in_flight, dict):
        return None
    lock = view.get("lock") or {}
    if lock.get("token"):
        return {"reason": "running", "words": f"its message (seq {in_flight['seq']}) is running"}
    nxt = next((w for w in view.get("waiting", []) if w.get("seq") == in_flight["seq"]), None)
    msg_id = nxt.get("msg_id") if nxt else None
    now = int(time.time() * 1000)
    last = None
    if isinstance(msg_id, str) and msg_id:
        life = await message_life(client, session_id, msg_id, Redactor(frozenset()))
        last = life["attempts"][-1] if life["attempts"] else None
    due_in = view.get("next_look_in_s")
    if last is not None and last["outcome"] == "waiting" and last["waits"]:
        wait = last["waits"][-1]
        row: dict[str, Any] = {"reason": wait["reason"], "msg_id": msg_id, "key": wait["key"]}
        if wait["reason"] == "paused":
            paused = [
                k
                for k in await model_limits.paused_keys(client.redis, client.settings)
                if k["key"] == wait["key"]
            ]
            if paused:
                p = paused[0]
                row["pause_reason"] = p.get("pause_reason") or ""
                row["until"] = _utc(int(p["paused_until"] * 1000))
                row["words"] = f"the model key {wait['key']} is paused"
                return row
        row["until"] = wait["until"]
        row["words"] = f"{WAIT_WORDS.get(wait['reason'], wait['reason'])} on {wait['key']}"
        return row
    if (
        last is not None
        and last["outcome"] == "retry"
        and isinstance(due_in, int | float)
        and due_in > 0
    ):
        return {
            "reason": "retry",
            "msg_id": msg_id,
            "words": f"a retry after a failed attempt, in {due_in:g} s",
            "until": _utc(now + int(due_in * 1000)),
        }
    if isinstance(due_in, int | float) and due_in > 0:
        return {"reason": "later", "msg_id": msg_id, "words": f"its turn, in {due_in:g} s"}
    return {
        "reason": "slots",
        "msg_id": msg_id,
        "words": WAIT_WORDS["slots"] + " (its tenant's share of the slots included)",
    }
