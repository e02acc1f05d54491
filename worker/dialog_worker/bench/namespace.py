"""Where a bench run writes, and what it leaves behind: nothing.

By default each system runs in a namespace of the bench's own: stream `bench` (or
`bench-<system>` when several systems are compared), with the group, reply and dead-letter
streams and key prefix derived from it, so no deployment's reply consumer, stats or dead
letters ever see the bench. A stream with a consumer group (another bench, or a deployment
reading it) is refused unless it was named with `--namespace`; naming the stream of running
workers is how `--workers 0` measures them.

At the end (unless `--keep-data`) the bench removes what it wrote. A namespace in which
nothing existed before goes whole. In one that did (a live deployment's, or leftovers of a
bench killed with -9) only the bench's own traces go: its sessions' keys, the entries of its
sessions in the inbound, reply and dead-letter streams, and the consumers of the workers it
started; everything else stays byte for byte.
"""

from __future__ import annotations

import dataclasses

import redis.exceptions
from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.errors import ValidationError
from dialog_worker.store.keys import Keys, escape_tag
from dialog_worker.store.stream_entries import xrange, xrevrange

DEFAULT = "bench"


def settings_for(settings: Settings, base: str, system: str, several: bool) -> Settings:
    """The names one system runs with. The configured stream keeps its configured names."""
    ns = f"{base}-{system}" if several else base
    if ns == settings.stream:
        return settings
    return settings.replace(
        stream=ns,
        group=f"{ns}-workers",
        reply_stream=f"{ns}-replies",
        dlq_stream=f"{ns}-dlq",
        key_prefix=ns,
    )


async def consumer_groups(r: Redis, stream: str) -> list[str]:
    """Every group reading `stream`. Any of them may be live: an idle worker blocked in
    XREADGROUP on an empty stream does not even show as a consumer on Redis 7.0, so there is
    no telling a live group from an abandoned one; the bench refuses both unless named."""
    try:
        groups = await r.xinfo_groups(stream)
    except redis.exceptions.ResponseError:  # no such stream
        return []
    return [str(group["name"]) for group in groups]


@dataclasses.dataclass
class Namespace:
    keys: Keys
    groups: list[str]  # consumer groups on the stream when the bench started
    own: bool  # removed whole at the end
    marks: dict[str, str]  # stream -> its last entry id before the bench wrote anything


async def claim(r: Redis, settings: Settings, explicit: bool) -> Namespace:
    """Check the namespace may be used and note what is there before the bench writes."""
    keys = Keys.from_settings(settings)
    groups = await consumer_groups(r, keys.stream)
    if groups and not explicit:
        raise ValidationError(
            f"stream {keys.stream!r} has consumer group(s) {', '.join(groups)}: a deployment "
            f"or another bench may be reading it; choose another --namespace, or name it with "
            f"--namespace {keys.stream} to run there anyway (the bench removes what it writes)"
        )
    streams = (keys.stream, keys.replies, keys.dlq)
    existed = bool(await r.exists(*streams))
    async for _ in r.scan_iter(match=f"{glob_escape(keys.prefix)}:*", count=1000):
        existed = True
        break
    marks = {}
    for stream in streams:
        last = await xrevrange(r, stream, count=1)
        marks[stream] = last[0][0] if last else "0-0"
    return Namespace(keys, groups, own=not existed, marks=marks)


async def clean(
    r: Redis, ns: Namespace, session_prefix: str, consumers: list[str]
) -> dict[str, int]:
    """Remove what the bench wrote (see the module docstring). `session_prefix` starts every
    session id the bench used; `consumers` are the names of the workers it started."""
    k = ns.keys
    if ns.own:
        keys = [k.stream, k.replies, k.dlq, k.ready]
        pattern = f"{glob_escape(k.prefix)}:*"
        keys += [key async for key in r.scan_iter(match=pattern, count=1000)]
        return {"keys": int(await r.unlink(*keys))}
    removed = {"keys": 0, "entries": 0, "consumers": 0}
    # Its sessions' keys: `<prefix>:{<tag>}:s:{<session id>}:...`, ids starting with the prefix.
    pattern = glob_escape(f"{k.session_prefix}{{{escape_tag(session_prefix)}") + "*"
    async for key in r.scan_iter(match=pattern, count=1000):
        removed["keys"] += int(await r.unlink(key))
    # The console's indexes name its sessions in values and members, not in key names: the
    # msg_id -> session hashes, and the recent-sessions buckets (lua/intake-5.lua).
    async for key in r.scan_iter(match=glob_escape(f"{k.ready}:msgs:") + "*", count=1000):
        if await r.type(key) not in (b"hash", "hash"):
            continue
        async for field, value in r.hscan_iter(key, count=1000):
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            if text.startswith(session_prefix):
                await r.hdel(key, field)
    first = session_prefix.encode()
    async for key in r.scan_iter(match=glob_escape(f"{k.ready}:sessions:") + "*", count=1000):
        if await r.type(key) in (b"zset", "zset"):
            await r.zremrangebylex(key, b"[" + first, b"[" + first + b"\xff")
    for stream, mark in ns.marks.items():
        ids = [
            entry_id
            for entry_id, fields in await _entries_after(r, stream, mark)
            if fields.get("session_id", "").startswith(session_prefix)
        ]
        for start in range(0, len(ids), 500):
            removed["entries"] += int(await r.xdel(stream, *ids[start : start + 500]))
    for name in consumers:
        try:
            pending = await r.xpending_range(k.stream, k.group, "-", "+", 1, consumername=name)
            if not pending:
                removed["consumers"] += int(await r.xgroup_delconsumer(k.stream, k.group, name))
        except redis.exceptions.ResponseError:  # no such group
            pass
    return removed


def glob_escape(text: str) -> str:
    """`text` matched literally by SCAN MATCH."""
    return "".join(f"\\{c}" if c in "\\*?[]" else c for c in text)


async def _entries_after(r: Redis, stream: str, mark: str) -> list[tuple[str, dict[str, str]]]:
    found: list[tuple[str, dict[str, str]]] = []
    start = f"({mark}"
    while True:
        page = await xrange(r, stream, start, "+", 1000)
        found += page
        if len(page) < 1000:
            return found
        start = f"({page[-1][0]}"
