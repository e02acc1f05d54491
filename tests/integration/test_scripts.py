"""The Lua scripts on a real redis-server: fencing, take-or-park, hand-off, duplicates."""

from __future__ import annotations

import json

import pytest

from worker.client import DialogClient
from worker.scripts import Code, LockReply, Scripts

pytestmark = pytest.mark.integration

TTL_MS = 5000


async def read_one(client: DialogClient, consumer: str = "c1") -> tuple[str, dict[str, str]]:
    k = client.keys
    await client.redis.xgroup_create(k.stream, k.group, id="0", mkstream=True)
    [(_, [(entry_id, fields)])] = await client.redis.xreadgroup(
        k.group, consumer, {k.stream: ">"}, count=1
    )
    return entry_id, fields


async def acquire(client, scripts, session, token, entry_id, seq) -> LockReply:
    sk, k = client.keys.session(session), client.keys
    raw = await scripts.acquire(
        keys=[sk.lock, sk.state, sk.parked, k.delayed, k.delayed_data, k.stream],
        args=[token, TTL_MS, k.group, entry_id, seq, 60_000, 3600],
    )
    return LockReply.parse(raw)


async def commit(
    client, scripts, session, token, version, seq, entry_id, doc, next_entry=""
) -> LockReply:
    sk, k = client.keys.session(session), client.keys
    raw = await scripts.commit(
        keys=[sk.lock, sk.state, sk.parked, k.delayed, k.delayed_data, k.stream, k.replies, k.dlq],
        args=[
            token,
            version,
            seq,
            json.dumps(doc),
            3600,
            "s",
            entry_id,
            k.group,
            session,
            "m",
            "reply",
            TTL_MS,
            0,
            "",
            next_entry,
        ],
    )
    return LockReply.parse(raw)


async def test_commit_with_stale_token_is_rejected_and_writes_nothing(client):
    scripts = Scripts.register(client.redis)
    await client.send("f", "nama saya Budi")
    entry_id, _ = await read_one(client)
    got = await acquire(client, scripts, "f", "token-a", entry_id, 1)
    assert got.code is Code.ACQUIRED and got.attempts == 1
    # The lease runs out (a paused holder) and another worker takes the lock.
    await client.redis.delete(client.keys.session("f").lock)
    assert (await acquire(client, scripts, "f", "token-b", entry_id, 1)).code is Code.ACQUIRED

    late = await commit(client, scripts, "f", "token-a", 0, 1, entry_id, {"late": True})
    assert late.code is Code.FENCED_TOKEN
    assert await client.state("f") is None
    assert await client.redis.xlen(client.keys.replies) == 0
    assert (await client.redis.xpending(client.keys.stream, client.keys.group))["pending"] == 1

    ok = await commit(client, scripts, "f", "token-b", 0, 1, entry_id, {"who": "b"})
    assert ok.code is Code.COMMITTED
    assert await client.state("f") == {"who": "b"}
    assert (await client.redis.xpending(client.keys.stream, client.keys.group))["pending"] == 0


async def test_commit_with_stale_version_is_rejected_even_with_the_right_token(client):
    scripts = Scripts.register(client.redis)
    await client.send("v", "hello")
    entry_id, _ = await read_one(client)
    assert (await acquire(client, scripts, "v", "tok", entry_id, 1)).code is Code.ACQUIRED
    # Someone wrote a newer state meanwhile (e.g. a lock key lost in a failover).
    await client.redis.hset(client.keys.session("v").state, mapping={"v": 7, "d": "{}"})
    got = await commit(client, scripts, "v", "tok", 0, 1, entry_id, {"stale": True})
    assert got.code is Code.FENCED_VERSION
    assert await client.state("v") == {}
    assert (await client.redis.xpending(client.keys.stream, client.keys.group))["pending"] == 1


async def test_contended_entry_parks_and_commit_hands_it_to_the_holder(client):
    scripts = Scripts.register(client.redis)
    k = client.keys
    await client.send("h", "one")
    await client.send("h", "two")
    await client.redis.xgroup_create(k.stream, k.group, id="0", mkstream=True)
    [(_, entries)] = await client.redis.xreadgroup(k.group, "c1", {k.stream: ">"}, count=2)
    (id1, _), (id2, _) = entries
    assert (await acquire(client, scripts, "h", "holder", id1, 1)).code is Code.ACQUIRED
    parked = await acquire(client, scripts, "h", "other", id2, 2)
    assert parked.code is Code.CONTENDED
    assert await client.redis.xlen(k.stream) == 1  # moved to the delayed set
    assert await client.redis.zcard(k.delayed) == 1

    got = await commit(client, scripts, "h", "holder", 0, 1, id1, {"n": 1})
    assert got.code is Code.HANDOFF
    fields = json.loads(got.handoff_fields)
    assert dict(zip(fields[::2], fields[1::2], strict=True))["text"] == "two"
    assert got.handoff_id == id2
    # The lock stays with the holder; the hand-off is a lease in the delayed set, not removed.
    assert await client.redis.get(k.session("h").lock) == "holder"
    assert await client.redis.zcard(k.delayed) == 1


async def test_out_of_order_entry_parks_and_releases_the_lock(client):
    scripts = Scripts.register(client.redis)
    k = client.keys
    await client.send("o", "one")
    await client.send("o", "two")
    await client.redis.xgroup_create(k.stream, k.group, id="0", mkstream=True)
    [(_, entries)] = await client.redis.xreadgroup(k.group, "c1", {k.stream: ">"}, count=2)
    (id1, _), (id2, _) = entries
    got = await acquire(client, scripts, "o", "t2", id2, 2)
    assert got.code is Code.OUT_OF_ORDER
    assert await client.redis.get(k.session("o").lock) is None
    # Its predecessor arrives; its commit hands seq 2 on.
    assert (await acquire(client, scripts, "o", "t1", id1, 1)).code is Code.ACQUIRED
    assert (await commit(client, scripts, "o", "t1", 0, 1, id1, {})).code is Code.HANDOFF


async def test_duplicate_seq_is_acked_without_taking_the_lock(client):
    scripts = Scripts.register(client.redis)
    k = client.keys
    await client.send("d", "one")
    entry_id, _ = await read_one(client)
    await client.redis.hset(k.session("d").state, mapping={"a": 1, "v": 1})
    got = await acquire(client, scripts, "d", "t", entry_id, 1)
    assert got.code is Code.DUPLICATE
    assert await client.redis.xlen(k.stream) == 0
    assert (await client.redis.xpending(k.stream, k.group))["pending"] == 0
    assert await client.redis.get(k.session("d").lock) is None


async def test_restarted_step_counts_attempts_across_deliveries(client):
    scripts = Scripts.register(client.redis)
    await client.send("a", "x")
    entry_id, _ = await read_one(client)
    for expected in (1, 2, 3):
        got = await acquire(client, scripts, "a", f"t{expected}", entry_id, 1)
        assert got.code is Code.ACQUIRED and got.attempts == expected
        await client.redis.delete(client.keys.session("a").lock)  # the worker "died"


async def test_commit_carries_the_lock_to_the_callers_own_next_entry(client):
    """A worker that read seq 1 and 2 together: committing 1 keeps the lock for 2, counts
    its start, and 2's own commit needs no acquire first."""
    scripts = Scripts.register(client.redis)
    k = client.keys
    await client.send("c", "one")
    await client.send("c", "two")
    await client.redis.xgroup_create(k.stream, k.group, id="0", mkstream=True)
    [(_, entries)] = await client.redis.xreadgroup(k.group, "c1", {k.stream: ">"}, count=2)
    (id1, _), (id2, _) = entries
    assert (await acquire(client, scripts, "c", "tok", id1, 1)).code is Code.ACQUIRED
    got = await commit(client, scripts, "c", "tok", 0, 1, id1, {"n": 1}, next_entry=id2)
    assert (got.code, got.version, got.attempts) == (Code.ACQUIRED, 1, 1)
    sk = k.session("c")
    assert await client.redis.get(sk.lock) == "tok"
    assert await client.redis.hget(sk.state, "ia_seq") == "2"
    done = await commit(client, scripts, "c", "tok", 1, 2, id2, {"n": 2})
    assert done.code is Code.COMMITTED
    assert await client.redis.get(sk.lock) is None
    assert await client.redis.xlen(k.stream) == 0
    assert await client.state("c") == {"n": 2}
