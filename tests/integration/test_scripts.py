"""The Lua scripts on a real redis-server, called directly: sequencing at intake, refusals,
duplicates, fencing, hand-off, group commit, resume, gaps, release and renew."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dialog_worker.config import Settings
from dialog_worker.store.codec import json_bytes, unpack_custody
from dialog_worker.store.keys import Keys, shard_of
from dialog_worker.store.scripts import Code, Release, Scripts, source

pytestmark = pytest.mark.integration

TTL_MS = 5000
FALLBACK = "maaf"


class Harness:
    """The scripts with the worker's arguments, on a bytes client (as the worker reads)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.r = redis
        self.k = keys
        self.s = Scripts.register(redis)
        self.calls = 0

    async def group(self) -> None:
        await self.r.xgroup_create(self.k.stream, self.k.group, id="0", mkstream=True)

    async def intake(
        self, count: int = 100, claim_idle_ms: int = 0, max_bytes: int = 65536, maxlen: int = 0
    ) -> list[Any]:
        self.calls += 1
        k = self.k
        return await self.s.intake(
            keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
            args=[
                k.group, "c1", count, f"t{self.calls}", TTL_MS, 3600, max_bytes, 32, maxlen,
                "test", claim_idle_ms, FALLBACK,
            ],
        )  # fmt: skip

    async def resume(self, count: int = 100, gap_ms: int = 60_000) -> list[Any]:
        self.calls += 1
        k = self.k
        return await self.s.resume(
            keys=[k.stream, k.ready, k.session_prefix],
            args=[count, f"r{self.calls}", TTL_MS, gap_ms],
        )

    async def commit(self, *commits: list[Any], maxlen: int = 0) -> list[Any]:
        k = self.k
        args: list[Any] = [TTL_MS, 3600, maxlen, len(commits)]
        for c in commits:
            args += [*c, *[""] * (15 - len(c))]  # extras, timers, usage, first part (left out)
        return await self.s.commit(
            keys=[k.stream, k.ready, k.session_prefix, k.replies, k.dlq], args=args
        )

    async def release(self, token: str, sid: str, seq: int, delay: int, mode: Release) -> int:
        k = self.k
        error = {Release.FAILED: "boom", Release.HAND_BACK_STREAMED: "handed back"}.get(mode, "")
        return int(
            await self.s.release(
                keys=[k.ready, k.session_prefix], args=[token, sid, seq, delay, error, mode.value]
            )
        )

    async def state(self, sid: str) -> dict[bytes, bytes]:
        return await self.r.hgetall(self.k.session(sid).state)

    async def replies(self) -> list[dict[bytes, bytes]]:
        return [f for _, f in await self.r.xrange(self.k.replies)]

    async def dead(self) -> list[dict[bytes, bytes]]:
        return [f for _, f in await self.r.xrange(self.k.dlq)]


def commit_args(
    job: list[Any], doc: dict[str, Any] | None = None, *, version: int | None = None,
    token: bytes | None = None, dead: str = "", known_next: str = "", outcome: str = "applied",
    extras: str = "",
) -> list[Any]:  # fmt: skip
    sid, tok, seq, entry_id = job[0], job[1], int(job[2]), job[3]
    return [
        token if token is not None else tok, sid, seq,
        int(job[6]) if version is None else version,
        json.dumps(doc or {"seq": seq}), b"m", b"reply-%d" % seq, outcome, entry_id,
        dead, known_next, extras,
    ]  # fmt: skip


@pytest_asyncio.fixture
async def h(redis_server) -> AsyncIterator[Harness]:
    r = Redis.from_url(redis_server.url)
    await r.flushall()
    harness = Harness(r, Keys.from_settings(Settings()))
    await harness.group()
    yield harness
    await r.aclose()


async def xadd(h: Harness, sid: str | bytes, text: str | bytes = "hi", **extra: Any) -> bytes:
    return await h.r.xadd(h.k.stream, {"session_id": sid, "text": text, **extra})


async def server_ms(h: Harness) -> int:
    sec, usec = await h.r.time()
    return int(sec) * 1000 + int(usec) // 1000


# ---------------------------------------------------------------------------------------------
# intake


async def test_intake_sequences_plain_entries_in_stream_order_and_leaves_nothing_pending(h):
    ids = [await xadd(h, sid) for sid in ["a", "b", "a", "a", "b"]]
    last_id, read, jobs, held, _counts = await h.intake()
    assert (last_id, read) == (ids[-1], 5)
    assert [(j[0], int(j[2]), j[3]) for j in jobs] == [(b"a", 1, ids[0]), (b"b", 1, ids[1])]
    assert [(x[0], int(x[1]), x[2]) for x in held] == [(b"a", 2, ids[2]), (b"a", 3, ids[3]),
                                                       (b"b", 2, ids[4])]  # fmt: skip
    assert (await h.r.xpending(h.k.stream, h.k.group))["pending"] == 0
    state = await h.state("a")
    assert state[b"s"] == b"3" and unpack_custody(state[b"q2"]) == (
        ids[2].decode(), {b"session_id": b"a", b"text": b"hi"})  # fmt: skip
    assert await h.r.ttl(h.k.session("a").state) == -1  # persistent while outstanding
    assert await h.r.xlen(h.k.stream) == 0  # custody: the stream holds only unread entries
    assert await h.r.zscore(h.k.ready, "a") is not None


async def test_an_idle_intake_returns_the_last_delivered_id_to_block_from(h):
    first = await xadd(h, "a")
    await h.intake()
    last_id, read, *_ = await h.intake()
    assert (last_id, read) == (first, 0)
    assert await h.r.xread({h.k.stream: last_id}, block=10) == []
    await xadd(h, "b")
    assert await h.r.xread({h.k.stream: last_id}, block=10) != []


async def test_producer_written_internal_fields_do_not_change_the_seq(h):
    await xadd(h, "f", seq="-5", requeues=str(10**12), attempts="99")
    await xadd(h, "f", seq=str(10**23))
    _, _, jobs, held, _ = await h.intake()
    assert int(jobs[0][2]) == 1 and int(jobs[0][7]) == 1  # seq 1, attempt 1
    assert int(held[0][1]) == 2


@pytest.mark.parametrize(
    ("fields", "reason", "names_session"),
    [
        ({"text": "no session"}, b"session_id is missing", False),
        ({"session_id": "", "text": "x"}, b"session_id is empty", False),
        ({"session_id": "   ", "text": "x"}, b"session_id is blank", False),
        ({"session_id": "a\nb", "text": "x"}, b"control characters", False),
        ({"session_id": b"\xff\xfe", "text": "x"}, b"not valid UTF-8", False),
        ({"session_id": "x" * 257, "text": "x"}, b"257 bytes", False),
        ({"session_id": "s", "text": "   "}, b"text is empty", True),
        ({"session_id": "s"}, b"text is missing", True),
        ({"session_id": "s", "text": "x", "msg_id": "m\x00"}, b"msg_id contains", True),
        ({"session_id": "s", "text": "x" * 70_000}, b"at most 65536", True),
    ],
)
async def test_a_refused_entry_is_dead_lettered_alone_with_its_raw_fields(
    h, fields, reason, names_session
):
    bad = await h.r.xadd(h.k.stream, fields)
    good = await xadd(h, "good")
    _, read, jobs, _, counts = await h.intake()
    assert read == 2 and [j[3] for j in jobs] == [good]
    assert [int(c) for c in counts] == [0, 1, 0, 0, 0, 0, 0]
    [letter] = await h.dead()
    for name, value in fields.items():
        assert letter[name.encode()] == (value if isinstance(value, bytes) else value.encode())
    assert reason in letter[b"error"]
    assert letter[b"error_kind"] == b"malformed" and letter[b"source_entry_id"] == bad
    assert letter[b"source_stream"] == b"dialog"
    events = await h.replies()
    assert len(events) == (1 if names_session else 0)
    if names_session:
        assert events[0][b"outcome"] == b"dead_lettered" and events[0][b"seq"] == b"0"
    assert await h.r.xlen(h.k.stream) == 0  # the refused entry is gone, the good one moved


async def test_an_entry_with_5000_fields_is_kept_whole_in_its_dead_letter(h):
    fields = {f"f{i}": str(i) for i in range(5000)} | {"session_id": "s", "text": "x"}
    await h.r.xadd(h.k.stream, fields)
    good = await xadd(h, "good")
    _, _, jobs, _, _ = await h.intake()
    assert [j[3] for j in jobs] == [good]
    [letter] = await h.dead()
    flat = json.loads(letter[b"raw_entry"])
    assert dict(zip(flat[0::2], flat[1::2], strict=True)) == fields
    assert b"too many fields" in letter[b"error"]


async def test_33_extra_fields_are_refused_and_32_are_accepted(h):
    base = {"session_id": "s", "text": "x", "msg_id": "m"}
    await h.r.xadd(h.k.stream, base | {f"f{i}": "v" for i in range(33)})
    await h.r.xadd(h.k.stream, base | {"msg_id": "m2"} | {f"f{i}": "v" for i in range(32)})
    _, _, jobs, _, counts = await h.intake()
    assert len(jobs) == 1 and [int(c) for c in counts] == [0, 1, 0, 0, 0, 0, 0]


async def test_a_repeated_msg_id_gets_one_duplicate_event_with_the_original_seq_and_reply(h):
    await xadd(h, "d", "first", msg_id="m-1")
    _, _, [job], _, _ = await h.intake()
    doc = {"history": [{"seq": 1, "bot": "the answer"}]}
    assert (await h.commit(commit_args(job, doc)))[0][0] == Code.COMMITTED
    again = await xadd(h, "d", "first again", msg_id="m-1")
    _, _, jobs, _, counts = await h.intake()
    assert jobs == [] and [int(c) for c in counts] == [1, 0, 0, 0, 0, 0, 0]
    event = (await h.replies())[-1]
    assert (event[b"outcome"], event[b"seq"], event[b"reply"]) == (
        b"duplicate", b"1", b"the answer")  # fmt: skip
    assert event[b"entry_id"] == again
    assert await h.r.xlen(h.k.stream) == 0
    assert (await h.state("d"))[b"s"] == b"1"
    assert 0 < await h.r.ttl(h.k.session("d").dedupe("m-1")) <= 3600


async def test_intake_refuses_to_start_when_a_shared_key_has_the_wrong_type(h):
    await xadd(h, "a")
    await h.r.set(h.k.replies, "not a stream")
    with pytest.raises(Exception, match="WRONGTYPE"):
        await h.intake()
    assert (await h.r.xinfo_groups(h.k.stream))[0]["lag"] == 1  # nothing was delivered
    assert await h.state("a") == {}


async def snapshot(h: Harness) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key's serialized value (a stream's with its groups and pending entries) and
    whether it has an expiry: equal before and after a call that wrote nothing."""
    return {k: (await h.r.dump(k), await h.r.pttl(k) > 0) for k in await h.r.keys("*")}


SHARED_KEYS = {
    "stream": "stream", "ready": "zset", "dlq": "stream", "replies": "stream",
    "inbound": "hash", "ages": "zset", "timers": "zset",
}  # fmt: skip


async def spoil(h: Harness, name: str, kind: str) -> str:
    """Puts a value of the wrong type in the shared key `name`: a string, or (kind "other") a
    type that is a near miss for it (a set for a sorted set, a sorted set for a stream or a
    hash)."""
    key = getattr(h.k, name)
    await h.r.delete(key)
    if kind == "string":
        await h.r.set(key, "not mine")
    elif SHARED_KEYS[name] == "zset":
        await h.r.sadd(key, "a")
    else:
        await h.r.zadd(key, {"a": 1})
    return key


def wrong_type(key: str, kind: str, name: str) -> str:
    found = "string" if kind == "string" else "set" if SHARED_KEYS[name] == "zset" else "zset"
    return f"WRONGTYPE {key} is a {found}, expected a {SHARED_KEYS[name]}"


@pytest.mark.parametrize("kind", ["string", "other"])
@pytest.mark.parametrize("name", list(SHARED_KEYS))
async def test_intake_with_a_shared_key_of_the_wrong_type_fails_naming_it_and_writes_nothing(
    h, name, kind
):
    """Entries that would touch every shared key: a message, a refused entry (dead letter), one
    sent for later (timers); the inbound hash and the ready set hold what earlier calls left."""
    await xadd(h, "a")
    await h.intake()
    await xadd(h, "b", msg_id="m")
    await h.r.xadd(h.k.stream, {"session_id": "c"})  # no text: dead-lettered
    await xadd(h, "d", deliver_at=str(await server_ms(h) // 1000 + 3600))
    key = await spoil(h, name, kind)
    before = await snapshot(h)
    with pytest.raises(ResponseError) as raised:
        await h.intake()
    assert str(raised.value).startswith(wrong_type(key, kind, name))
    assert await snapshot(h) == before


@pytest.mark.parametrize("name", ["ready", "dlq", "replies", "ages", "timers"])
async def test_an_intake_with_nothing_to_read_leaves_keys_it_does_not_write_unchecked(h, name):
    """An empty stream: no entry is read, so nothing but the inbound hash is written."""
    await xadd(h, "a")
    await h.intake()
    key = await spoil(h, name, "string")
    _, read, jobs, _, _ = await h.intake()
    assert (read, jobs) == (0, [])
    assert await h.r.get(key) == b"not mine"


async def test_the_recent_sessions_bucket_gets_its_expiry_from_the_call_that_adds_a_session(h):
    await xadd(h, "a")
    await h.intake()
    [bucket] = await h.r.keys("*:sessions:*")
    assert 0 < await h.r.ttl(bucket) <= 2 * 3600 + 60
    await h.r.persist(bucket)
    await xadd(h, "a")
    await h.intake()  # "a" is there already: the expiry the first call set stays
    assert await h.r.ttl(bucket) == -1
    await xadd(h, "b")
    await h.intake()
    assert await h.r.ttl(bucket) > 0


async def commits_touching_every_shared_key(h: Harness) -> list[list[Any]]:
    """Commits that write the reply stream, the ready set and the ages (each), a dead letter,
    a timer, and delete a copy's entry from the inbound stream (and count it in the inbound
    hash)."""
    await xadd(h, "a", msg_id="m-a")
    await xadd(h, "b", msg_id="m-b")
    _, _, jobs, _, _ = await h.intake()
    ja, jb = sorted(jobs, key=lambda j: j[0])
    copy = await xadd(h, "a", msg_id="m-a")  # a copy, waiting for the original's commit
    await h.intake()
    # An entry still in the stream (read, as if by a version before custody): the commit
    # deletes it as the copy's entry and takes it off the inbound hash's length.
    kept = await h.r.xadd(h.k.stream, {"session_id": "a", "text": "x", "msg_id": "m-a"})
    await h.r.xgroup_setid(h.k.stream, h.k.group, id="$")
    await h.r.hset(h.k.session("a").state, "u1", b"%s,%s" % (copy, kept))
    timers = json.dumps([{"op": "set", "name": "t", "text": "x", "meta": [], "delay_ms": 60000}])
    return [
        [*commit_args(ja), timers],
        commit_args(jb, outcome="dead_lettered", dead=json.dumps(["error", "boom"])),
    ]


@pytest.mark.parametrize("kind", ["string", "other"])
@pytest.mark.parametrize("name", list(SHARED_KEYS))
async def test_commit_with_a_shared_key_of_the_wrong_type_fails_naming_it_and_writes_nothing(
    h, name, kind
):
    commits = await commits_touching_every_shared_key(h)
    key = await spoil(h, name, kind)
    before = await snapshot(h)
    with pytest.raises(ResponseError) as raised:
        await h.commit(*commits)
    assert str(raised.value).startswith(wrong_type(key, kind, name))
    assert await snapshot(h) == before


@pytest.mark.parametrize("name", ["stream", "dlq", "inbound", "timers"])
async def test_a_session_named_twice_in_one_commit_call_checks_every_shared_key_first(h, name):
    """The second commit of a session reads what the first one wrote, so the plan cannot see
    what it will do: a dead letter (or a timer) after the first commit's writes."""
    await xadd(h, "a", msg_id="m1")
    await xadd(h, "a", msg_id="m2")
    _, _, [job], [nxt], _ = await h.intake()
    second = [job[0], job[1], nxt[1], nxt[2], nxt[3], b"", int(job[6]) + 1]
    timers = json.dumps([{"op": "set", "name": "t", "text": "x", "meta": [], "delay_ms": 60000}])
    dead = json.dumps(["error", "boom"])
    commits = [
        commit_args(job),
        [*commit_args(second, outcome="dead_lettered", dead=dead), timers],
    ]
    key = await spoil(h, name, "string")
    before = await snapshot(h)
    with pytest.raises(ResponseError) as raised:
        await h.commit(*commits)
    assert str(raised.value).startswith(wrong_type(key, "string", name))
    assert await snapshot(h) == before


@pytest.mark.parametrize("name", ["stream", "dlq", "inbound", "timers"])
async def test_a_commit_checks_only_the_shared_keys_its_writes_touch(h, name):
    await xadd(h, "a")
    _, _, [job], _, _ = await h.intake()
    key = await spoil(h, name, "string")
    [(code, _)] = await h.commit(commit_args(job))
    assert code == Code.COMMITTED and await h.r.get(key) == b"not mine"


async def test_a_commit_call_whose_commits_are_all_fenced_checks_nothing(h):
    await xadd(h, "a")
    _, _, [job], _, _ = await h.intake()
    for name in SHARED_KEYS:
        if name != "stream":
            await spoil(h, name, "string")
    before = await snapshot(h)
    assert await h.commit(commit_args(job, token=b"not ours")) == [[Code.FENCED_TOKEN]]
    assert await snapshot(h) == before


async def test_lua_builds_the_same_session_keys_as_python(h):
    prelude = source("renew").split("\n--[[\n  renew")[0]
    for sid in ["a}b", "{x}", "%7D", "a:lock", "sesi-ñ-日本", "}" * 3, "%%{{"]:
        lua = await h.r.eval(
            prelude + "\nreturn session_key(KEYS[1], ARGV[1], 'state')",
            1, h.k.session_prefix, sid,
        )  # fmt: skip
        assert lua.decode() == h.k.session(sid).state


async def test_an_entry_that_names_a_field_twice_is_refused(h):
    await h.r.execute_command(
        "XADD", h.k.stream, "*", "session_id", "a", "text", "x", "session_id", "b"
    )
    _, read, jobs, _, counts = await h.intake()
    assert (read, jobs, [int(c) for c in counts]) == (1, [], [0, 1, 0, 0, 0, 0, 0])
    [letter] = await h.dead()
    assert b"session_id appears more than once" in letter[b"error"]
    assert await h.state("a") == {} and await h.state("b") == {}


async def test_a_copy_of_an_outstanding_message_is_answered_by_its_commit_after_it(h):
    first = await xadd(h, "cw", "nama saya Budi", msg_id="m-1")
    _, _, [job], _, _ = await h.intake()
    copy = await xadd(h, "cw", "nama saya Budi", msg_id="m-1")
    _, _, jobs, held, counts = await h.intake()
    assert (jobs, held, [int(c) for c in counts]) == ([], [], [1, 0, 0, 0, 0, 0, 0])
    assert await h.replies() == []  # not before the original's own event
    [r] = await h.commit(commit_args(job))
    assert int(r[0]) == Code.COMMITTED
    events = [(e[b"outcome"], e[b"seq"], e[b"entry_id"], e[b"reply"]) for e in await h.replies()]
    assert events == [(b"applied", b"1", first, b"reply-1"), (b"duplicate", b"1", copy, b"reply-1")]
    assert await h.r.xlen(h.k.stream) == 0
    assert b"u1" not in await h.state("cw")


async def test_copies_waiting_for_one_message_are_bounded_and_the_rest_answered_at_once(h):
    await xadd(h, "cb", "x", msg_id="m-1")
    await h.intake()
    for _ in range(100):
        await xadd(h, "cb", "x", msg_id="m-1")
    _, read, _, _, counts = await h.intake()
    assert (read, int(counts[0])) == (100, 100)
    waiting = (await h.state("cb"))[b"u1"]
    assert len(waiting) < 1100  # about 60 entry ids, joined by commas
    kept = waiting.count(b",") + 1
    answered = await h.replies()
    assert 0 < kept < 100 and len(answered) == 100 - kept
    assert {(e[b"outcome"], e[b"seq"]) for e in answered} == {(b"duplicate", b"1")}
    assert await h.r.xlen(h.k.stream) == 0  # copies too left the stream at intake


async def test_a_new_message_stops_the_idle_ttl_of_its_session(h):
    await xadd(h, "p")
    _, _, [job], _, _ = await h.intake()
    await h.commit(commit_args(job))
    assert await h.r.ttl(h.k.session("p").state) > 0  # idle: expires in time
    await xadd(h, "p")
    await h.intake()
    assert await h.r.ttl(h.k.session("p").state) == -1  # outstanding again: never expires


async def test_intake_leaves_a_lock_someone_else_holds_and_looks_again_when_it_ends(h):
    lock = h.k.session("l").lock
    await h.r.set(lock, "someone-else", px=3000)
    await xadd(h, "l")
    _, read, jobs, _, counts = await h.intake()
    assert (read, jobs, [int(c) for c in counts]) == (1, [], [0, 0, 1, 0, 0, 0, 0])
    assert await h.r.get(lock) == b"someone-else"
    now = await server_ms(h)
    due = await h.r.zscore(h.k.ready, "l")
    assert due is not None and now + 2000 < due <= now + 3000


async def test_a_queued_message_puts_its_session_in_the_ready_set_without_moving_it(h):
    await xadd(h, "q")
    await h.intake()  # taken: due when its lease ends
    await h.r.zrem(h.k.ready, "q")  # lost (written by hand, or lost in a failover)
    await xadd(h, "q")
    await h.intake()  # queued behind the holder: outstanding work has a place again
    due = await h.r.zscore(h.k.ready, "q")
    assert due is not None
    await xadd(h, "q")
    await h.intake()
    assert await h.r.zscore(h.k.ready, "q") == due  # NX: the holder's lease decides


async def test_entries_another_reader_left_pending_are_taken_over_and_sequenced(h):
    ids = [await xadd(h, "cl", f"m{i}") for i in range(2)]
    await h.r.xreadgroup(h.k.group, "other", {h.k.stream: ">"})  # read, never sequenced
    _, read, jobs, _, _ = await h.intake()
    assert (read, jobs) == (0, [])  # nothing new to read
    await anyio.sleep(0.05)  # let them go idle
    _, read, [job], held, _ = await h.intake(claim_idle_ms=20)
    assert read == 2 and (job[3], int(job[2])) == (ids[0], 1)
    assert [(x[2], int(x[1])) for x in held] == [(ids[1], 2)]
    assert (await h.r.xpending(h.k.stream, h.k.group))["pending"] == 0


async def test_reply_events_are_trimmed_to_about_the_reply_maxlen(h):
    for _ in range(300):  # refused (blank text), each with a dead_lettered event
        await h.r.xadd(h.k.stream, {"session_id": "t", "text": " "})
    await h.intake(count=300, maxlen=10)
    # MAXLEN ~ trims whole nodes of the stream (100 entries each by default), never below 10.
    assert 10 <= await h.r.xlen(h.k.replies) <= 200
    # The commit's event trims too.
    await xadd(h, "t", "ok")
    _, _, [job], _, _ = await h.intake()
    await h.r.delete(h.k.replies)
    for _ in range(150):
        await h.r.xadd(h.k.replies, {"filler": "x"})
    await h.commit(commit_args(job), maxlen=10)
    assert 10 <= await h.r.xlen(h.k.replies) <= 100


# ---------------------------------------------------------------------------------------------
# commit


async def test_commit_writes_state_event_and_removes_the_entry_then_releases(h):
    entry = await xadd(h, "c")
    _, _, [job], _, _ = await h.intake()
    [result] = await h.commit(commit_args(job, {"step": "X"}))
    assert [int(x) for x in result] == [Code.COMMITTED, 1]
    state = await h.state("c")
    assert (state[b"a"], state[b"v"], json.loads(state[b"d"])) == (b"1", b"1", {"step": "X"})
    assert not any(k.startswith(b"q") for k in state)
    assert 3500 < await h.r.ttl(h.k.session("c").state) <= 3600  # idle TTL starts now
    assert await h.r.exists(h.k.session("c").lock) == 0
    assert await h.r.zscore(h.k.ready, "c") is None
    assert await h.r.xlen(h.k.stream) == 0
    [event] = await h.replies()
    assert (event[b"outcome"], event[b"seq"], event[b"entry_id"]) == (b"applied", b"1", entry)


async def test_a_commit_with_a_stale_token_or_version_writes_nothing(h):
    await xadd(h, "f")
    _, _, [job], _, _ = await h.intake()
    before = await h.state("f")
    r1, r2 = await h.commit(commit_args(job, token=b"stolen"), commit_args(job, version=7))
    assert (int(r1[0]), int(r2[0])) == (Code.FENCED_TOKEN, Code.FENCED_VERSION)
    assert await h.state("f") == before
    assert await h.replies() == [] and b"q1" in await h.state("f")


async def test_group_commit_fences_each_commit_alone(h):
    for sid in ["g1", "g2"]:
        await xadd(h, sid)
    _, _, jobs, _, _ = await h.intake()
    r1, r2 = await h.commit(commit_args(jobs[0], token=b"stolen"), commit_args(jobs[1]))
    assert (int(r1[0]), int(r2[0])) == (Code.FENCED_TOKEN, Code.COMMITTED)
    assert (await h.state("g2"))[b"a"] == b"1" and b"d" not in await h.state("g1")


async def test_commit_hands_the_lock_to_the_next_entry_with_or_without_its_fields(h):
    ids = [await xadd(h, "h", f"m{i}") for i in range(3)]
    _, _, [job], _held, _ = await h.intake()
    await h.r.pexpire(h.k.session("h").lock, 200)  # the first step used most of its lease
    await h.r.zadd(h.k.ready, {"h": 0})
    [r] = await h.commit(commit_args(job, known_next=ids[1].decode()))
    assert (int(r[0]), int(r[2]), r[3], r[4]) == (Code.HANDOFF, 2, ids[1], [])
    # The next message gets a whole lease, and nobody resumes the session meanwhile.
    assert await h.r.pttl(h.k.session("h").lock) > TTL_MS - 1000
    assert await h.r.zscore(h.k.ready, "h") > await server_ms(h) + TTL_MS - 1000
    job2 = [b"h", job[1], 2, ids[1], [], b"", b"", r[1]]
    [r] = await h.commit(commit_args(job2, version=int(r[1])))
    assert (int(r[0]), int(r[2]), r[3]) == (Code.HANDOFF, 3, ids[2])
    assert dict(zip(r[4][0::2], r[4][1::2], strict=True))[b"text"] == b"m2"
    assert int((await h.state("h"))[b"n"]) == 1  # the next one's start is counted
    assert await h.r.pttl(h.k.session("h").lock) > TTL_MS - 1000


@pytest.mark.parametrize(
    "bad",
    ["[1, 2, 3", '["error"]', '["error", 1]', json.dumps(["f", "v"] * 33)],
)
async def test_a_commit_that_cannot_be_written_fails_alone_and_the_others_are_written(h, bad):
    for sid in ["v1", "v2", "v3"]:
        await xadd(h, sid)
    _, _, jobs, _, _ = await h.intake()
    r1, r2, r3 = await h.commit(
        commit_args(jobs[0]), commit_args(jobs[1], dead=bad, outcome="dead_lettered"),
        commit_args(jobs[2]),
    )  # fmt: skip
    assert (int(r1[0]), int(r2[0]), int(r3[0])) == (Code.COMMITTED, Code.INVALID, Code.COMMITTED)
    assert b"dead-letter fields" in r2[1]
    assert [e[b"session_id"] for e in await h.replies()] == [b"v1", b"v3"]
    assert b"d" not in await h.state("v2") and b"q1" in await h.state("v2")
    assert await h.dead() == [] and await h.r.get(h.k.session("v2").lock) == jobs[1][1]


@pytest.mark.parametrize(
    "bad",
    ["[1, 2", '["bubbles"]', '["no_reply", 1]', json.dumps(["f", "v"] * 33), '["reply", "x"]',
     '["outcome", "applied"]', '["channel", "wa", "seq", "9"]'],
)  # fmt: skip
async def test_reply_extras_that_cannot_be_written_fail_their_commit_alone(h, bad):
    """Reply extras (argument 12) are name/value pairs added to the message's events; pairs
    that are not strings, too many, or a name every event carries already are refused."""
    for sid in ["x1", "x2"]:
        await xadd(h, sid)
    _, _, jobs, _, _ = await h.intake()
    at_limit = json.dumps(["f", "v"] * 32)
    r1, r2 = await h.commit(commit_args(jobs[0], extras=bad), commit_args(jobs[1], extras=at_limit))
    assert (int(r1[0]), int(r2[0])) == (Code.INVALID, Code.COMMITTED)
    assert b"reply extras" in r1[1]
    [event] = await h.replies()
    assert event[b"session_id"] == b"x2" and event[b"f"] == b"v" and event[b"reply"] == b"reply-1"


async def test_reply_extras_ride_on_the_event_and_on_the_copies_the_commit_answers(h):
    await xadd(h, "c1", msg_id="m")
    _, _, [job], _, _ = await h.intake()
    await xadd(h, "c1", msg_id="m")  # a copy while the original is outstanding
    await h.intake()
    extras = json.dumps(["bubbles", '[{"text":"a"}]', "channel", "wa"])
    [r] = await h.commit(commit_args(job, extras=extras))
    assert int(r[0]) == Code.COMMITTED
    events = await h.replies()
    assert [e[b"outcome"] for e in events] == [b"applied", b"duplicate"]
    for e in events:
        assert (e[b"bubbles"], e[b"channel"]) == (b'[{"text":"a"}]', b"wa")


async def test_a_lone_surrogate_in_an_error_is_a_dead_letter_of_its_own_commit_only(h):
    """What the review saw: json.dumps writes a lone surrogate as the escape \\ud83d, which
    Redis' cjson refuses; the whole group commit failed. Each commit stands alone, and the
    worker's JSON never holds such an escape (json_bytes)."""
    for sid in ["s1", "s2"]:
        await xadd(h, sid)
    _, _, jobs, _, _ = await h.intake()
    error = "API said: cut \ud83d"
    refused = json.dumps(["error", error, "error_kind", "permanent"])
    [r1, r2] = await h.commit(
        commit_args(jobs[0], dead=refused, outcome="dead_lettered"), commit_args(jobs[1])
    )
    assert (int(r1[0]), int(r2[0])) == (Code.INVALID, Code.COMMITTED)
    clean = json_bytes(["error", error, "error_kind", "permanent"])
    [r1] = await h.commit(commit_args(jobs[0], dead=clean, outcome="dead_lettered"))
    assert int(r1[0]) == Code.COMMITTED
    [letter] = await h.dead()
    assert letter[b"error"] == b"API said: cut \\ud83d" and letter[b"seq"] == b"1"


async def test_a_dead_letter_commit_copies_the_original_fields_byte_for_byte(h):
    await xadd(h, "dl", b"\xff raw \x00 bytes", note=b"\xc3")
    _, _, [job], _, _ = await h.intake()
    extra = json.dumps(["error", "bad", "error_kind", "malformed"])
    [r] = await h.commit(commit_args(job, dead=extra, outcome="dead_lettered"))
    assert int(r[0]) == Code.COMMITTED
    [letter] = await h.dead()
    assert letter[b"text"] == b"\xff raw \x00 bytes" and letter[b"note"] == b"\xc3"
    assert letter[b"error_kind"] == b"malformed" and letter[b"source_entry_id"] == job[3]
    assert (await h.replies())[0][b"outcome"] == b"dead_lettered"


async def test_a_commit_for_a_seq_that_is_not_the_next_one_writes_nothing(h):
    await xadd(h, "o")
    second = await xadd(h, "o")
    _, _, [job], _, _ = await h.intake()
    skipping = [job[0], job[1], 2, second, [], b"", b"0"]  # seq 2 while seq 1 is in hand
    [r] = await h.commit(commit_args(skipping))
    assert int(r[0]) == Code.FENCED_VERSION
    assert b"d" not in await h.state("o") and await h.replies() == []
    assert {b"q1", b"q2"} <= set(await h.state("o"))


async def test_producer_commands_cannot_touch_a_sequenced_message(h):
    """Custody: once sequenced, a message lives in its session's keys. XDEL, XTRIM MAXLEN 0,
    MINID and XADD MAXLEN = 1 by a producer find nothing of it; it is handed on intact."""
    await xadd(h, "cu")
    second = await xadd(h, "cu", "kedua", msg_id="m-2", note=b"\xff")
    _, _, [job], _, _ = await h.intake()
    assert await h.r.xdel(h.k.stream, second) == 0
    await h.r.xtrim(h.k.stream, maxlen=0, approximate=False)
    await h.r.execute_command("XTRIM", h.k.stream, "MINID", "=", "9999999999999")
    await h.r.xadd(h.k.stream, {"session_id": "other", "text": "x"}, maxlen=1, approximate=False)
    [r] = await h.commit(commit_args(job))
    assert (int(r[0]), int(r[2]), r[3]) == (Code.HANDOFF, 2, second)
    fields = dict(zip(r[4][0::2], r[4][1::2], strict=True))
    assert fields == {b"session_id": b"cu", b"text": b"kedua", b"msg_id": b"m-2", b"note": b"\xff"}


async def test_a_commit_whose_next_message_is_missing_releases_and_leaves_the_session_due(h):
    await xadd(h, "mn")
    await xadd(h, "mn")
    _, _, [job], _, _ = await h.intake()
    await h.r.hdel(h.k.session("mn").state, "q2")  # deleted by hand, or lost
    [r] = await h.commit(commit_args(job))
    assert int(r[0]) == Code.COMMITTED
    assert await h.r.exists(h.k.session("mn").lock) == 0
    # Due at once: resume decides about the gap. The state keeps no TTL: seq 2 is outstanding.
    assert await h.r.zscore(h.k.ready, "mn") <= await server_ms(h)
    assert await h.r.ttl(h.k.session("mn").state) == -1


async def test_a_commit_clears_the_failure_record_of_the_message_it_applied(h):
    for _ in range(2):
        await xadd(h, "fr")
    _, _, [job], _, _ = await h.intake()
    assert await h.release(job[1].decode(), "fr", 1, 0, Release.FAILED) == Code.RELEASED
    [[row], _] = await h.resume()
    assert row[10] == b"boom" and row[9] != b""  # the error and when it first failed
    [r] = await h.commit(commit_args(row[1:]))
    assert int(r[0]) == Code.HANDOFF
    state = await h.state("fr")
    assert b"e" not in state and b"f" not in state  # seq 2 starts with a clean record


# ---------------------------------------------------------------------------------------------
# double-texting: interrupt and coalesce (intake's multitask), reset


async def commit_in_turn(h: Harness, job: list[Any], outcome: str = "applied") -> list[Any]:
    """Commit ``job`` ([sid, token, seq, entry id, ..., version at 6]) and return the reply."""
    [r] = await h.commit(commit_args(job, outcome=outcome))
    return list(r)


def next_job(job: list[Any], handoff: list[Any]) -> list[Any]:
    """The job a HANDOFF reply hands on: same session and token, the next seq and entry."""
    return [job[0], job[1], int(handoff[2]), handoff[3], handoff[4], b"", int(handoff[1])]


async def test_coalesce_supersedes_exactly_the_messages_waiting_before_it(h):
    """m1 runs; m2 and m3 wait; m4 arrives with multitask=coalesce: m2 and m3 (every waiting
    one before it, the last included) end superseded in their turn, m4 itself runs, and the
    running m1 is not touched."""
    for i in (1, 2, 3):
        await xadd(h, "co", f"t{i}", msg_id=f"m{i}")
    _, _, [job], held, _ = await h.intake()
    assert [int(x[1]) for x in held] == [2, 3]
    assert (int(job[2]), job[10]) == (1, b"")
    await xadd(h, "co", "t4", msg_id="m4", multitask="coalesce")
    _, _, jobs, _, _ = await h.intake()
    assert jobs == []  # m1 holds the lock
    assert (await h.state("co"))[b"xs"] == b"4"
    endings = []
    outcome = "applied"
    while True:
        r = await commit_in_turn(h, job, outcome)
        if int(r[0]) != Code.HANDOFF:
            assert int(r[0]) == Code.COMMITTED
            break
        endings.append((int(r[2]), r[5]))
        job = next_job(job, r)
        outcome = r[5].decode() or "applied"
    assert endings == [(2, b"superseded"), (3, b"superseded"), (4, b"")]
    got = [(e[b"seq"], e[b"outcome"]) for e in await h.replies()]
    assert got == [
        (b"1", b"applied"),
        (b"2", b"superseded"),
        (b"3", b"superseded"),
        (b"4", b"applied"),
    ]


async def test_interrupt_marks_the_running_message_and_cancels_the_waiting_ones(h):
    """m1 runs (its lock taken by an earlier call); m2 waits; m3 arrives with
    multitask=interrupt: the running m1 gets the cancel mark its worker watches (no other
    message does: not the waiting m2, never m3 itself), so m1's commit is refused; m2 ends
    cancelled in its turn and m3 runs."""
    for i in (1, 2):
        await xadd(h, "it", f"t{i}", msg_id=f"m{i}")
    _, _, [job], _, _ = await h.intake()
    await xadd(h, "it", "t3", msg_id="m3", multitask="interrupt")
    assert (await h.intake())[2] == []
    sk = h.k.session("it")
    marked = [m for m in ("m1", "m2", "m3") if await h.r.exists(sk.cancel_mark(m))]
    assert marked == ["m1"]
    assert (await h.state("it"))[b"xc"] == b"3"
    [r] = await h.commit(commit_args(job))
    assert int(r[0]) == Code.CANCELLED  # the worker commits it cancelled instead
    r = await commit_in_turn(h, job, "cancelled")
    assert (int(r[0]), int(r[2]), r[5]) == (Code.HANDOFF, 2, b"cancelled")
    job = next_job(job, r)
    r = await commit_in_turn(h, job, "cancelled")
    assert (int(r[0]), int(r[2]), r[5]) == (Code.HANDOFF, 3, b"")
    assert int((await commit_in_turn(h, next_job(job, r)))[0]) == Code.COMMITTED
    got = [(e[b"seq"], e[b"outcome"]) for e in await h.replies()]
    assert got == [(b"1", b"cancelled"), (b"2", b"cancelled"), (b"3", b"applied")]


async def test_an_interrupt_read_with_the_running_message_ends_that_one_without_a_step(h):
    """m1 and m2 (multitask=interrupt) come in one intake call: m1's job, handed out by this
    very call, ends cancelled without a step (its ending says so; no mark is needed), and m2
    runs next."""
    await xadd(h, "iu", "t1", msg_id="m1")
    await xadd(h, "iu", "t2", msg_id="m2", multitask="interrupt")
    _, _, [job], _, _ = await h.intake()
    assert (int(job[2]), job[10]) == (1, b"cancelled")
    r = await commit_in_turn(h, job, "cancelled")
    assert (int(r[0]), int(r[2]), r[5]) == (Code.HANDOFF, 2, b"")


async def test_a_reset_fences_a_commit_that_read_the_old_state_by_its_version_too(h):
    """Reset deletes the lock (the running step's commit is refused by its token) and moves
    the version on: a commit that read the state before the reset is refused by the version
    as well, even under a lock that is its own again (two fences, each enough alone). The
    message that was running waits again, due at once."""
    await xadd(h, "rv", "t1", msg_id="m1")
    _, _, [job], _, _ = await h.intake()
    k = h.k
    erase = await h.s.erase(
        keys=[k.ready, k.session_prefix], args=["reset", "rv", '{"step":"ROOT"}']
    )
    assert int(erase[0]) == 1 and int(erase[4]) == 1  # found, and a step was running
    # Its message waits again, due now (not when the fenced step's lease would have ended).
    assert await h.r.zscore(k.ready, "rv") <= await server_ms(h)
    [r] = await h.commit(commit_args(job))
    assert int(r[0]) == Code.FENCED_TOKEN
    await h.r.set(k.session("rv").lock, job[1], px=TTL_MS)  # the lock is the step's again
    [r] = await h.commit(commit_args(job))
    assert int(r[0]) == Code.FENCED_VERSION
    assert (await h.state("rv"))[b"d"] == b'{"step":"ROOT"}'
    assert await h.replies() == []


# ---------------------------------------------------------------------------------------------
# resume, release, renew


async def test_resume_takes_a_session_whose_holder_died_and_counts_the_attempt(h):
    await xadd(h, "r")
    _, _, [job], _, _ = await h.intake()
    await h.r.delete(h.k.session("r").lock)  # the holder's lease ran out
    await h.r.zadd(h.k.ready, {"r": 0})
    [rows, _] = await h.resume()
    [row] = rows
    assert (row[0], row[1], int(row[3]), row[4], int(row[8])) == (b"m", b"r", 1, job[3], 2)
    assert (await h.r.get(h.k.session("r").lock)) == row[2]


async def test_resume_leaves_a_held_session_alone_until_its_lease_ends(h):
    await xadd(h, "held")
    await h.intake()
    await h.r.zadd(h.k.ready, {"held": 0})
    [rows, wait] = await h.resume()
    assert rows == [] and TTL_MS - 1000 < int(wait) <= TTL_MS


async def test_a_missing_entry_is_a_gap_only_after_the_gap_timeout(h):
    await xadd(h, "gap")
    _, _, [_job], _, _ = await h.intake()
    await h.r.hdel(h.k.session("gap").state, "q1")  # deleted by hand, or lost
    await h.r.delete(h.k.session("gap").lock)
    await h.r.zadd(h.k.ready, {"gap": 0})
    [rows, _] = await h.resume(gap_ms=60_000)
    assert rows == [] and b"g" in await h.state("gap")
    await h.r.zadd(h.k.ready, {"gap": 0})
    [rows, _] = await h.resume(gap_ms=60_000)
    assert rows == []  # seen a moment ago: still waiting for the gap timeout
    await h.r.hset(h.k.session("gap").state, "g", 1)  # first seen long ago
    await h.r.zadd(h.k.ready, {"gap": 0})
    [[row], _] = await h.resume(gap_ms=60_000)
    assert (row[0], int(row[3])) == (b"g", 1)


async def test_release_records_the_error_or_gives_the_attempt_back(h):
    await xadd(h, "rel")
    _, _, [job], _, _ = await h.intake()
    token = job[1].decode()
    assert await h.release("not-mine", "rel", 1, 0, Release.FAILED) == Code.FENCED_TOKEN
    # Not the seq in hand:
    assert await h.release(token, "rel", 2, 0, Release.FAILED) == Code.FENCED_TOKEN
    assert (await h.state("rel")).get(b"e") is None
    assert await h.release(token, "rel", 1, 60_000, Release.FAILED) == Code.RELEASED
    state = await h.state("rel")
    assert (state[b"n"], state[b"e"]) == (b"1", b"boom")
    assert await h.r.exists(h.k.session("rel").lock) == 0
    assert await h.r.zscore(h.k.ready, "rel") > await server_ms(h) + 59_000  # the backoff
    await h.r.zadd(h.k.ready, {"rel": 0})
    [[row], _] = await h.resume()
    assert int(row[8]) == 2 and row[10] == b"boom"
    assert await h.release(row[2].decode(), "rel", 1, 0, Release.HAND_BACK) == Code.RELEASED
    assert (await h.state("rel"))[b"n"] == b"1"
    # A hand-back of a step that streamed keeps its attempt and records why (not a failure).
    [[row], _] = await h.resume()
    assert int(row[8]) == 2
    streamed = Release.HAND_BACK_STREAMED
    assert await h.release(row[2].decode(), "rel", 1, 0, streamed) == Code.RELEASED
    state = await h.state("rel")
    assert (state[b"n"], state[b"e"]) == (b"2", b"handed back")
    assert await h.r.exists(h.k.session("rel").lock) == 0
    assert await h.r.zscore(h.k.ready, "rel") <= await server_ms(h)


async def test_a_release_refuses_a_mode_it_does_not_know_and_writes_nothing(h):
    await xadd(h, "rm")
    _, _, [job], _, _ = await h.intake()
    token, before = job[1].decode(), await h.state("rm")
    due = await h.r.zscore(h.k.ready, "rm")  # the lease's deadline, for crash recovery
    refused: list[list[str | int]] = [[m] for m in ("", "4", "true", "1.0")]
    refused += [["3"], ["3", "", 60], ["3", "m1", 0]]  # "3" needs a msg_id and an expiry
    for mode in refused:
        with pytest.raises(ResponseError, match="release: bad arguments"):
            await h.s.release(
                keys=[h.k.ready, h.k.session_prefix], args=[token, "rm", 1, 0, "", *mode]
            )
    assert await h.state("rm") == before
    assert await h.r.get(h.k.session("rm").lock) == job[1]  # still held
    assert await h.r.zscore(h.k.ready, "rm") == due


async def test_renew_extends_only_locks_that_are_still_ours(h):
    for sid in ["n1", "n2"]:
        await xadd(h, sid)
    _, _, jobs, _, _ = await h.intake()
    await h.r.set(h.k.session("n2").lock, "someone-else")
    result = await h.s.renew(
        keys=[h.k.ready, h.k.session_prefix],
        args=[60_000, jobs[0][1], b"n1", jobs[1][1], b"n2"],
    )
    assert [int(x) for x in result] == [1, 0]
    assert await h.r.pttl(h.k.session("n1").lock) > 50_000
    # The session's place in the ready set moves with the lease: nobody looks at it meanwhile.
    assert await h.r.zscore(h.k.ready, "n1") > await server_ms(h) + 50_000


async def test_resume_breaks_a_lock_without_a_lease(h):
    await xadd(h, "nl")
    await h.intake()
    lock = h.k.session("nl").lock
    await h.r.set(lock, "by-hand")  # no PX: it would never expire
    await h.r.zadd(h.k.ready, {"nl": 0})
    [[row], _] = await h.resume()
    assert row[1] == b"nl" and await h.r.get(lock) == row[2]


async def test_resume_drops_a_session_with_nothing_outstanding_from_the_ready_set(h):
    await xadd(h, "done")
    _, _, [job], _, _ = await h.intake()
    await h.commit(commit_args(job))
    await h.r.zadd(h.k.ready, {"done": 0})
    [rows, wait] = await h.resume()
    assert rows == [] and int(wait) == -1
    assert await h.r.zscore(h.k.ready, "done") is None


async def test_delconsumer_deletes_only_an_idle_consumer_that_owns_nothing(h):
    await xadd(h, "dc")
    await h.r.xreadgroup(h.k.group, "owner", {h.k.stream: ">"})  # owns one pending entry
    await h.r.xgroup_createconsumer(h.k.stream, h.k.group, "empty")

    async def delete(name: str, idle_ms: int) -> int:
        return int(await h.s.delconsumer(keys=[h.k.stream], args=[h.k.group, name, idle_ms]))

    async def names() -> set[str]:
        return {
            c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            for c in await h.r.xinfo_consumers(h.k.stream, h.k.group)
        }

    assert await delete("owner", 0) == 0  # deleting it would drop its entry for good
    assert await delete("empty", 60_000) == 0  # not idle long enough
    assert await delete("unknown", 0) == 0
    assert await names() == {"owner", "empty"}
    assert await delete("empty", 0) == 1
    assert await names() == {"owner"}
    assert (await h.r.xpending(h.k.stream, h.k.group))["pending"] == 1


# ---------------------------------------------------------------------------------------------
# Every mutating script sent twice (a client that lost the reply re-sends the same call)


async def test_intake_sent_twice_returns_the_same_jobs_and_reads_nothing_more(h):
    first = [await xadd(h, "tw"), await xadd(h, "tw"), await xadd(h, "other")]
    h.calls = 0
    _, _, jobs, _, _ = await h.intake()
    later = await xadd(h, "late")
    h.calls = 0  # the same token base again
    _, read, again, _, _ = await h.intake()
    assert read == 0
    assert [(j[0], j[1], j[2], j[3], j[7]) for j in again] == [
        (j[0], j[1], j[2], j[3], j[7]) for j in jobs
    ]
    assert [j[3] for j in again] == [first[0], first[2]]
    assert (await h.state("tw"))[b"n"] == b"1"  # the attempt is not counted twice
    assert (await h.r.xinfo_groups(h.k.stream))[0]["lag"] == 1  # `later` is still unread
    assert later not in [j[3] for j in again]


async def test_intake_sent_twice_returns_only_the_jobs_whose_locks_are_still_its_own(h):
    for sid in ["kept", "lost"]:
        await xadd(h, sid)
    h.calls = 0
    _, _, jobs, _, _ = await h.intake()
    assert [j[0] for j in jobs] == [b"kept", b"lost"]
    await h.r.set(h.k.session("lost").lock, "the-next-holder")  # its lease ran out meanwhile
    h.calls = 0  # the same token base again
    _, _, again, _, _ = await h.intake()
    assert [(j[0], j[1]) for j in again] == [(jobs[0][0], jobs[0][1])]


async def test_resume_sent_twice_returns_the_same_jobs_and_counts_one_attempt(h):
    await xadd(h, "rs")
    await h.intake()
    await h.r.delete(h.k.session("rs").lock)
    await h.r.zadd(h.k.ready, {"rs": 0})
    h.calls = 10
    [rows, _] = await h.resume()
    h.calls = 10
    [again, _] = await h.resume()
    assert [r[:5] for r in again] == [r[:5] for r in rows]
    assert (await h.state("rs"))[b"n"] == b"2"


async def test_commit_sent_twice_writes_once_and_answers_the_same(h):
    ids = [await xadd(h, "ct", f"m{i}") for i in range(2)]
    _, _, [job], _, _ = await h.intake()
    [first] = await h.commit(commit_args(job))
    [again] = await h.commit(commit_args(job))
    assert (int(first[0]), first[3]) == (Code.HANDOFF, ids[1])
    assert [int(again[0]), int(again[1]), int(again[2]), again[3]] == [
        int(first[0]),
        int(first[1]),
        int(first[2]),
        first[3],
    ]
    assert len(await h.replies()) == 1
    assert (await h.state("ct"))[b"v"] == b"1"


async def test_release_sent_twice_releases_once(h):
    await xadd(h, "rl")
    _, _, [job], _, _ = await h.intake()
    token = job[1].decode()
    assert await h.release(token, "rl", 1, 0, Release.HAND_BACK) == Code.RELEASED
    assert await h.release(token, "rl", 1, 0, Release.HAND_BACK) == Code.FENCED_TOKEN
    assert (await h.state("rl"))[b"n"] == b"0"


async def test_resume_skips_a_session_whose_state_key_has_the_wrong_type(h):
    await xadd(h, "fine")
    await h.intake()
    await h.r.delete(h.k.session("fine").lock)
    await h.r.set(h.k.session("corrupt").state, "not a hash")
    await h.r.zadd(h.k.ready, {"corrupt": 0, "fine": 1})
    [rows, _] = await h.resume()
    assert [r[1] for r in rows] == [b"fine"]
    assert await h.r.zscore(h.k.ready, "corrupt") > 1  # looked at again later, alone


# ---------------------------------------------------------------------------------------------
# custody: what producer commands on the inbound stream can still do


async def test_unread_entries_removed_by_producer_commands_are_counted_at_intake(h):
    await xadd(h, "a")
    await h.intake()  # the first call sets the baseline
    for i in range(5):
        await xadd(h, "t", f"m{i}")
    await h.r.xtrim(h.k.stream, maxlen=2, approximate=False)  # 3 unread entries gone
    gone = await xadd(h, "t", "x")
    await h.r.xdel(h.k.stream, gone)  # 1 more
    await h.r.execute_command("XTRIM", h.k.stream, "MINID", "=", gone)  # the 2 before it
    await h.r.xadd(h.k.stream, {"session_id": "t", "text": "last"}, maxlen=1, approximate=False)
    _, read, _, _, counts = await h.intake()
    assert (read, int(counts[3])) == (1, 6)
    assert await h.r.hget(h.k.inbound, "trimmed") == b"6"
    # The intake's own deletions, duplicates and refusals are not trimming.
    await xadd(h, "t", "again", msg_id="d-1")
    await xadd(h, "t", "again", msg_id="d-1")
    await h.r.xadd(h.k.stream, {"text": "no session"})
    _, read, _, _, counts = await h.intake()
    assert (read, int(counts[3])) == (3, 0)
    assert await h.r.hget(h.k.inbound, "trimmed") == b"6"


async def test_an_idle_intake_leaves_the_inbound_hash_and_still_counts_a_trim_once(h):
    await xadd(h, "a")
    await h.intake()
    await h.r.config_resetstat()
    await h.intake()  # nothing came, nothing went: the hash says so already
    assert "hset" not in await commands_run(h)
    await xadd(h, "b")
    unread = await xadd(h, "c")
    await h.intake(count=1)  # c stays unread: counted in the hash's length
    await h.r.xdel(h.k.stream, unread)  # gone unread, by hand: nothing was added since
    for _ in range(3):
        await h.intake()
    assert await h.r.hget(h.k.inbound, "trimmed") == b"1"


async def test_the_find_hash_gets_its_expiry_from_the_call_that_made_it(h):
    """A msg_id sent to two sessions in the call that makes the hash: every field is new all
    the same. A later call does not set it again; a hash made again gets one."""
    await xadd(h, "a", msg_id="same")
    await xadd(h, "b", msg_id="same")
    await h.intake()
    [found] = await h.r.keys("*:msgs:*")
    assert 3600 * 5 // 4 < await h.r.ttl(found) <= 3600 * 5 // 4 + 60
    await h.r.persist(found)
    await xadd(h, "c", msg_id="other")
    await h.intake()
    assert await h.r.ttl(found) == -1 and await h.r.hget(found, "other") == b"c"
    await h.r.delete(found)
    await xadd(h, "d", msg_id="again")
    await h.intake()
    assert await h.r.ttl(found) > 0


async def test_a_last_id_pushed_ahead_is_reported_once(h):
    await xadd(h, "a")
    await h.intake()
    top = "18446744073709551615-18446744073709551615"
    await h.r.xadd(h.k.stream, {"session_id": "b", "text": "x"}, id=top)
    with pytest.raises(ResponseError, match="exhausted"):
        await xadd(h, "c")  # every producer's XADD * fails from now on
    _, read, _, _, counts = await h.intake()
    assert (read, int(counts[4])) == (1, 1)
    assert await h.r.hget(h.k.inbound, "ahead") == top.encode()
    _, _, _, _, counts = await h.intake()
    assert int(counts[4]) == 0  # reported once; the hash keeps saying it until it is over


async def test_a_gap_frees_its_msg_id_so_a_resend_is_applied(h):
    await xadd(h, "gm", "first")
    await xadd(h, "gm", "second", msg_id="m-2")
    _, _, [job], _, _ = await h.intake()
    [r] = await h.commit(commit_args(job))
    await h.r.hdel(h.k.session("gm").state, "q2")  # lost
    await h.r.delete(h.k.session("gm").lock)
    await h.r.zadd(h.k.ready, {"gm": 0})
    await h.r.hset(h.k.session("gm").state, "g", 1)  # seen long ago
    [[row], _] = await h.resume(gap_ms=1)
    assert (row[0], int(row[3])) == (b"g", 2)
    gap = [b"gm", row[2], 2, row[4], [], b"", int(row[7])]
    letter = json.dumps(["error", "gap", "error_kind", "gap"])
    args = commit_args(gap, dead=letter, outcome="dead_lettered")
    args[5] = b"m-2"  # the msg_id, when the worker knows it
    [r] = await h.commit(args)
    assert int(r[0]) == Code.COMMITTED
    assert not await h.r.exists(h.k.session("gm").dedupe("m-2"))
    [letter_fields] = await h.dead()
    assert (letter_fields[b"seq"], letter_fields[b"error_kind"]) == (b"2", b"gap")
    await xadd(h, "gm", "second again", msg_id="m-2")
    _, _, [job], _, counts = await h.intake()
    assert (int(job[2]), int(counts[0])) == (3, 0)  # sequenced anew, not a duplicate


async def test_an_oversized_entry_with_a_bad_msg_id_is_answered_under_its_entry_id(h):
    """The msg_id is checked before the size: the refusal's event never carries one that is
    unusable (here with a control character)."""
    bad = await h.r.xadd(h.k.stream, {"session_id": "s", "text": "x" * 70_000, "msg_id": "m\x01"})
    await h.intake()
    [event] = await h.replies()
    assert (event[b"msg_id"], event[b"outcome"]) == (bad, b"dead_lettered")
    [letter] = await h.dead()
    assert b"msg_id contains control characters" in letter[b"error"]


async def test_an_entry_appended_to_another_shards_stream_is_refused_without_a_second_state(h):
    shards = 3
    ids = [f"w{i}" for i in range(20)] + [f"sesi-ñ-日本-{i}" for i in range(20)] + ["{x}", "%7D"]
    for sid in ids:
        await xadd(h, sid)
    k = h.k
    reply = await h.s.intake(
        keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
        args=[k.group, "c1", 100, "t-shard", TTL_MS, 3600, 65536, 32, 0, "test", 0, FALLBACK,
              1, shards],
    )  # fmt: skip
    _, read, jobs, _, counts = reply
    mine = [sid for sid in ids if shard_of(sid, shards) == 1]  # the same CRC-32 as Python's
    assert 0 < len(mine) < len(ids)
    assert (read, [j[0].decode() for j in jobs]) == (len(ids), mine)
    assert int(counts[1]) == len(ids) - len(mine)
    letters = await h.dead()
    assert all(b"belongs to shard" in letter[b"error"] for letter in letters)
    for sid in set(ids) - set(mine):  # no second state, no place in this shard's ready set
        assert await h.state(sid) == {} and await h.r.zscore(k.ready, sid) is None


async def test_trim_detection_says_why_it_is_off_when_the_acl_refuses_xinfo_stream(h):
    """An ACL without XINFO STREAM (an old config/redis-acl.conf) must not stop intake, nor
    leave trim detection off without a word: the inbound hash says why."""
    await h.r.execute_command(
        "ACL", "SETUSER", "narrow", "on", "nopass", "~*", "+@all", "-xinfo|stream"
    )
    kw = h.r.connection_pool.connection_kwargs
    narrow = Redis(host=kw["host"], port=kw["port"], username="narrow", password="x")
    try:
        await xadd(h, "a")
        _, read, jobs, _, _ = await Harness(narrow, h.k).intake()
        assert (read, len(jobs)) == (1, 1)
        assert b"xinfo" in (await h.r.hget(h.k.inbound, "error") or b"").lower()
        h.calls += 1  # a token base of its own (t1 was the narrow call's)
        await h.intake()  # allowed again: the reason goes
        assert await h.r.hget(h.k.inbound, "error") is None
    finally:
        await narrow.aclose()
        await h.r.execute_command("ACL", "DELUSER", "narrow")


async def test_the_ages_say_when_each_sessions_next_message_was_appended(h):
    """The stream shows only unread entries; the ages show the oldest outstanding message."""

    def ms(entry_id: bytes) -> float:
        return float(entry_id.split(b"-")[0])

    a1, a2, b1 = await xadd(h, "a"), await xadd(h, "a"), await xadd(h, "b")
    _, _, [ja, jb], _, _ = await h.intake()
    assert dict(await h.r.zrange(h.k.ages, 0, -1, withscores=True)) == {b"a": ms(a1), b"b": ms(b1)}
    [r] = await h.commit(commit_args(ja))
    assert int(r[0]) == Code.HANDOFF and await h.r.zscore(h.k.ages, "a") == ms(a2)
    await h.commit(commit_args([b"a", ja[1], 2, a2, [], b"", int(r[1])]), commit_args(jb))
    assert await h.r.zcard(h.k.ages) == 0  # nothing outstanding


# ---------------------------------------------------------------------------------------------
# batch sizes: 1..1000 entries an intake reads, sessions a resume takes


async def test_an_intake_reads_at_most_1000_entries_and_refuses_to_be_asked_for_more(h):
    async with h.r.pipeline(transaction=False) as pipe:
        for i in range(1001):
            pipe.xadd(h.k.stream, {"session_id": f"b{i}", "text": "hi"})
        await pipe.execute()
    for count in (0, 1001):
        with pytest.raises(ResponseError, match="intake: bad arguments"):
            await h.intake(count=count)
    assert await h.r.xlen(h.k.stream) == 1001  # a refused call wrote nothing
    reply = await h.intake(count=1000)
    assert int(reply[1]) == 1000 and len(reply[2]) == 1000
    assert await h.r.xlen(h.k.stream) == 1


async def test_a_resume_takes_at_most_1000_sessions_and_refuses_to_be_asked_for_more(h):
    for count in (0, 1001):
        with pytest.raises(ResponseError, match="resume: bad arguments"):
            await h.resume(count=count)
    assert await h.resume(count=1000) is not None
    assert await h.resume(count=1) is not None


# ---------------------------------------------------------------------------------------------
# cost: what a session's messages share when one call reads several of them


async def commands_run(h: Harness) -> dict[str, int]:
    stats = await h.r.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def test_a_burst_read_in_one_call_writes_its_sessions_indexes_once_not_per_message(h):
    """40 messages of one session in one intake call: its msg_id index gets one ZADD and one
    PEXPIRE (and one prune, as the seqs pass 32), the timers it may cancel are looked at once,
    the recent-sessions bucket gets one ZADD for both sessions and the console's msg_id ->
    session hash one HSET for all 41 messages."""
    for i in range(1, 41):
        await xadd(h, "a", msg_id=f"m{i}")
    await xadd(h, "b")
    await h.r.config_resetstat()
    _, read, jobs, held, _ = await h.intake()
    ran = await commands_run(h)
    assert (int(read), len(jobs), len(held)) == (41, 2, 39)
    assert ran["pexpire"] == 2  # one per session's index, not one per message
    assert ran["zremrangebyscore"] == 1  # session a's seqs passed 32: its index is pruned
    assert ran["hget"] == 2 + 1  # one look at each session's timers, the tenant's settings once
    # ready set and ages (one each per session), one index ZADD per session, one bucket ZADD,
    # and each session counted in flight for its tenant
    assert ran["zadd"] == 2 + 2 + 2 + 1 + 2
    ids = await h.r.zrange(h.k.session("a").ids, 0, -1)
    assert sorted(ids) == sorted(f"m{i}".encode() for i in range(1, 41))
    assert await h.r.zrange(h.k.session("b").ids, 0, -1) == [jobs[1][3]]  # its entry id
    assert ran["set"] == 40 + 2 + 1  # a's dedupe keys, the locks, the receipt: no find keys
    assert ran["hset"] == 2 + 1 + 1  # the states, the inbound bookkeeping, the find hash
    quarter = await server_ms(h) // (3600 * 250)
    found = await h.r.hgetall(h.k.msg_sessions(quarter))
    made = {b"\n": b"1"}  # the mark of the call that made the hash (set its expiry)
    assert found == {**{f"m{i}".encode(): b"a" for i in range(1, 41)}, jobs[1][3]: b"b", **made}
    assert 3600 * 5 // 4 < await h.r.ttl(h.k.msg_sessions(quarter)) <= 3600 * 5 // 4 + 60


async def test_a_sessions_msg_id_index_expiry_moves_on_once_a_window_and_outlasts_every_member(h):
    """The index expires two dedupe windows (3600 s here) after the call that set it; calls
    before its newest member would outlive it leave it (noted in the state's ie field)."""
    ids, state = h.k.session("a").ids, h.k.session("a").state

    async def index_once() -> int:
        await xadd(h, "a", msg_id=f"m{h.calls}")
        await h.r.config_resetstat()
        await h.intake()
        return (await commands_run(h)).get("pexpire", 0)

    assert await index_once() == 1
    first = await h.r.pexpiretime(ids)
    assert 0 < first - int(await h.r.hget(state, "ie")) <= 1000 + 5  # it never overstates
    assert first - await server_ms(h) > 2 * 3600 * 1000 - 5000
    assert await index_once() == 0  # well before the newest member's end: nothing to do
    assert await h.r.pexpiretime(ids) == first
    await h.r.hset(state, "ie", await server_ms(h) + 3600 * 1000 - 1000)  # a window has passed
    assert await index_once() == 1
    assert await h.r.pexpiretime(ids) > first
    assert 0 < await h.r.pexpiretime(ids) - int(await h.r.hget(state, "ie")) <= 1000 + 5
    await h.r.delete(ids)  # by hand: the next call makes it again without an expiry ...
    assert await index_once() == 0 and await h.r.pttl(ids) == -1
    await h.r.hset(state, "ie", await server_ms(h) + 3600 * 1000 - 1000)  # ... for a window
    assert await index_once() == 1 and await h.r.pttl(ids) > 3600 * 1000


async def test_a_session_with_1000_messages_in_one_call_has_all_of_them_indexed(h):
    async with h.r.pipeline(transaction=False) as pipe:
        for i in range(1000):
            pipe.xadd(h.k.stream, {"session_id": "a", "text": "hi", "msg_id": f"m{i}"})
        await pipe.execute()
    reply = await h.intake(count=1000)
    assert int(reply[1]) == 1000 and len(reply[3]) == 999
    assert await h.r.zcard(h.k.session("a").ids) == 1000
    assert 3600 * 1000 < await h.r.pttl(h.k.session("a").ids) <= 2 * 3600 * 1000


async def test_a_user_message_cancels_a_nudge_after_the_state_that_noted_none_is_gone(h):
    """Intake notes in the state (tc) that a session has no timers a user message cancels, so
    its next messages skip the look; a commit that sets such a timer deletes the note, and a
    state that expired (its timers stay) has none: the user's next message cancels the nudge."""
    state, timers = h.k.session("a").state, h.k.session("a").timers
    await xadd(h, "a")
    _, _, [job], _, _ = await h.intake()
    assert await h.r.hget(state, "tc") == b"0"
    nudge = {"op": "set", "name": "nudge", "text": "still there?", "meta": [],
             "delay_ms": 60_000, "cancel_on_message": True}  # fmt: skip
    [r] = await h.commit([*commit_args(job), json.dumps([nudge])])
    assert int(r[0]) == Code.COMMITTED and await h.r.hexists(timers, "t:nudge")
    assert await h.r.hget(state, "tc") is None  # the next user message must look
    await h.r.delete(state)  # the state expired; its timers stay
    await xadd(h, "a")
    await h.intake()
    assert not await h.r.hexists(timers, "t:nudge")  # cancelled by the user's message
    assert await h.r.hget(state, "tc") == b"0"
    await xadd(h, "a")
    await h.r.config_resetstat()
    await h.intake()
    assert "hget" not in await commands_run(h)  # noted: no look at the timers


async def test_holding_a_session_that_does_not_exist_leaves_a_key_that_expires(
    client: Any,
):
    """An operator holds a session id before (or without) any message: the held state hash
    lives DIALOG_STATE_TTL_S like an idle session's, not for ever; a message arriving for it
    makes it persistent as any outstanding work does."""
    from dialog_worker.console import actions

    await actions.hold(client, "never-seen", "ops")
    state = client.keys.session("never-seen").state
    assert await client.redis.hget(state, "h")
    ttl = await client.redis.ttl(state)
    assert 0 < ttl <= client.settings.state_ttl_s
    # Held again (an existing session): its expiry is left as it is.
    await client.redis.expire(state, 50)
    await actions.hold(client, "never-seen", "ops")
    assert 0 < await client.redis.ttl(state) <= 50


# --- model usage committed with the reply (the 14th value of a commit group) --------------------


def usage_json(**over: Any) -> str:
    return json.dumps({"t": "acme", "d": "20260101", "i": 10, "o": 5, "m": 1500, "n": 1, **over})


async def test_a_commits_usage_is_counted_with_its_reply_and_once_when_the_call_is_sent_again(h):
    for sid in ["u1", "u2"]:
        await xadd(h, sid)
    _, _, jobs, _, _ = await h.intake()
    first = [*commit_args(jobs[0]), "", usage_json()]
    second = [*commit_args(jobs[1]), "", usage_json(i=1, o=2, m=0, n=3)]
    r1, r2 = await h.commit(first, second)
    assert (int(r1[0]), int(r2[0])) == (Code.COMMITTED, Code.COMMITTED)
    counters = await h.r.hgetall(h.k.usage("20260101"))
    assert counters == {b"acme:in": b"11", b"acme:out": b"7", b"acme:cost": b"1500",
                        b"acme:calls": b"4"}  # fmt: skip
    assert 39 * 86400 < await h.r.ttl(h.k.usage("20260101")) <= 40 * 86400
    [again] = await h.commit(first)  # the worker lost the reply and sent the call again
    assert int(again[0]) == Code.COMMITTED
    assert await h.r.hgetall(h.k.usage("20260101")) == counters


@pytest.mark.parametrize(
    "bad",
    ["{", "[]", usage_json(i=-1), usage_json(o=1.5), usage_json(d="2026-01-01"),
     usage_json(t=""), usage_json(t="x" * 65), usage_json(n="1"), usage_json(m=1e16)],
)  # fmt: skip
async def test_usage_that_cannot_be_counted_fails_its_commit_alone(h, bad):
    for sid in ["b1", "b2"]:
        await xadd(h, sid)
    _, _, jobs, _, _ = await h.intake()
    r1, r2 = await h.commit(
        [*commit_args(jobs[0]), "", bad], [*commit_args(jobs[1]), "", usage_json()]
    )
    assert (int(r1[0]), int(r2[0])) == (Code.INVALID, Code.COMMITTED)
    assert r1[1] == b"bad usage"
    assert await h.r.hget(h.k.usage("20260101"), "acme:in") == b"10"
    assert b"d" not in await h.state("b1")


async def test_a_usage_hash_of_the_wrong_type_fails_the_call_before_any_write(h):
    await xadd(h, "w1")
    _, _, [job], _, _ = await h.intake()
    await h.r.set(h.k.usage("20260101"), "not a hash")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await h.commit([*commit_args(job), "", usage_json()])
    assert await h.replies() == [] and b"d" not in await h.state("w1")


async def test_budget_exceeded_ends_a_message_unapplied_and_frees_its_msg_id(h):
    await xadd(h, "bx", msg_id="m1")
    _, _, [job], _, _ = await h.intake()
    assert await h.r.exists(h.k.session("bx").dedupe("m1")) == 1
    args = commit_args(job, outcome="budget_exceeded")
    args[5] = b"m1"  # its msg_id
    [r] = await h.commit(args)
    assert int(r[0]) == Code.COMMITTED
    [event] = await h.replies()
    assert event[b"outcome"] == b"budget_exceeded"
    assert await h.r.exists(h.k.session("bx").dedupe("m1")) == 0, "a re-send is applied"
