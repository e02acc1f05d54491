"""Changing the shard count offline: sessions continue where they were; reshard refuses a
live or undrained deployment, acts only with --yes, keeps TTLs, skips keys that expired, and
can be run again after being stopped at any write without copying anything twice."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from typing import Any

import anyio
import pytest
import redis.asyncio
from queue_checks import wait_consumers_idle as idle
from redis_server import wait_until_async

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings, load_settings
from dialog_worker.ops.reshard import (
    Interrupted,
    ReshardReport,
    idle_threshold_ms,
    reshard,
    stop_after,
)
from dialog_worker.ops.verify import Sent, check, send_bursts, wait_applied
from dialog_worker.store.keys import Topology

pytestmark = pytest.mark.integration

# A worker that reads and reclaims this often makes a consumer count as idle after
# 2 x 200 ms (dialog_worker.ops.reshard.idle_threshold_ms); reshard is given the same settings.
QUICK_IDLE = {"DIALOG_RECLAIM_INTERVAL_MS": "200", "DIALOG_READ_BLOCK_MS": "200"}
# Sessions whose ids exercise the escaping of the key names.
ODD_IDS = ["a{b}c", "x:lock", "100%", "}{"]


def run(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", *args],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )


async def wait_consumers_idle(settings: Settings) -> None:
    """Until the stopped workers' consumers look gone to reshard."""
    r = redis.asyncio.Redis.from_url(settings.redis_url)
    try:
        await idle(r, Topology.from_settings(settings).shards, idle_threshold_ms(settings))
    finally:
        await r.aclose()


async def shard_count(settings: Settings) -> str | None:
    r = redis.asyncio.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        return await r.get(f"{settings.prefix}:shards")
    finally:
        await r.aclose()


# ---------------------------------------------------------------------------------------------
# end to end, with workers


async def test_reshard_1_to_3_and_back_keeps_every_session_going(env, workers):
    env = {**env, **QUICK_IDLE}
    texts = ["nama saya Budi", "keluhan satu"]
    sessions = [f"r{i}" for i in range(40)] + ODD_IDS
    sent: list[Sent] = []

    async def phase(extra: dict[str, str], text: str, msg_id: str | None = None) -> None:
        settings = load_settings(environ={**env, **extra})
        async with DialogClient(settings=settings, max_connections=100) as c:
            seq = len(sent) // len(sessions) + 1
            new = []
            for sid in sessions:
                r = await c.send(sid, text, msg_id=f"{sid}-{msg_id}" if msg_id else None)
                new.append(Sent(sid, seq, r.msg_id, text))
            sent.extend(new)
            procs = workers.start(1, **QUICK_IDLE, **extra)
            assert await wait_applied(c, sent, timeout_s=30)
            # Replies of earlier phases stay in the old layout's reply streams (not moved).
            assert await check(c, new) == []
            for w in procs:
                assert await anyio.to_thread.run_sync(w.terminate) == 0
        await wait_consumers_idle(settings)

    await phase({}, texts[0], msg_id="first")  # with msg_ids: every session has a dedupe key
    # A dead letter, which must follow its session to the new shard.
    async with DialogClient(settings=load_settings(environ=env)) as c:
        await c.redis.xadd(c.keys.dlq, {"session_id": "a{b}c", "text": "old", "error": "x"})

    moved = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "3", "--yes"))
    assert moved.returncode == 0, moved.stderr
    report = json.loads(moved.stdout)
    assert (report["sessions"], report["dedupe_keys"], report["dead_letters"]) == (
        len(sessions),
        len(sessions),
        1,
    )
    assert (report["dry_run"], report["expired"], report["already_moved"]) == (False, 0, 0)
    three = {"DIALOG_SHARDS": "3"}
    assert await shard_count(load_settings(environ=env)) == "3"

    await phase(three, texts[1])  # seq 2 of every session, applied after seq 1: state moved
    listed = await anyio.to_thread.run_sync(lambda: run(env, "dlq", "list", **three))
    assert [json.loads(line)["session_id"] for line in listed.stdout.splitlines()] == ["a{b}c"]
    # The dedupe keys moved with the states: a producer's retry of a first-phase message is
    # still recognised.
    async with DialogClient(settings=load_settings(environ={**env, **three})) as c:
        await c.send("a{b}c", texts[0], msg_id="a{b}c-first")
        keys = c.keys_for("a{b}c")

        async def duplicate_answered() -> bool:
            replies = await c.redis.xrange(keys.replies)
            return any(f["outcome"] == "duplicate" and f["seq"] == "1" for _, f in replies)

        workers.start(1, **QUICK_IDLE, **three)
        await wait_until_async(duplicate_answered, 20, "the retry answered as a duplicate")
        workers.stop_all()
    await wait_consumers_idle(load_settings(environ={**env, **three}))

    back = await anyio.to_thread.run_sync(
        lambda: run(env, "reshard", "--to", "1", "--yes", **three)
    )
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout)["sessions"] == len(sessions)
    await phase({}, "keluhan dua")
    async with DialogClient(settings=load_settings(environ=env)) as c:
        state = await c.state("a{b}c")
        assert [t["seq"] for t in state["history"]] == [1, 2, 3]
        assert state["memory"]["userName"] == "Budi"


async def test_reshard_refuses_a_queue_that_is_not_drained(env, client):
    await client.send("busy", "nama saya Budi")
    result = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "2", "--yes"))
    assert result.returncode == 1
    assert "not drained" in result.stderr and "stream_length" in result.stderr
    assert await client.state("busy") is None
    assert await client.redis.xlen(client.keys.stream) == 1
    assert await client.redis.get(f"{client.settings.prefix}:shards") is None


async def test_reshard_refuses_while_a_worker_is_live_and_force_overrides(env, client, workers):
    [w] = workers.start(1, metrics=True)
    sent = await send_bursts(client, ["live"], ["nama saya Budi"])
    assert await wait_applied(client, sent, timeout_s=20)
    state_key = client.keys.session("live").state

    refused = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "2", "--yes"))
    assert refused.returncode == 1
    assert "active" in refused.stderr and w.name in refused.stderr
    assert await client.redis.get(f"{client.settings.prefix}:shards") == "1"
    assert await client.redis.exists(state_key) == 1

    # Stopped a moment ago: its consumer was active within the threshold (2 x 5 s, the
    # defaults), so reshard still refuses; --force says the operator knows it is gone.
    assert await anyio.to_thread.run_sync(w.terminate) == 0
    again = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "2", "--yes"))
    assert again.returncode == 1 and "active" in again.stderr
    forced = await anyio.to_thread.run_sync(
        lambda: run(env, "reshard", "--to", "2", "--yes", "--force")
    )
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["sessions"] == 1
    assert await client.redis.exists(state_key) == 0
    assert await client.redis.get(f"{client.settings.prefix}:shards") == "2"


async def test_reshard_without_yes_reports_what_it_would_do_and_changes_nothing(env, client):
    r = client.redis
    sk = client.keys.session("quiet")
    await r.hset(sk.state, mapping={"a": "1", "s": "1", "v": "1", "d": "{}"})
    await r.expire(sk.state, 600)
    await r.set(sk.dedupe("m1"), "1", ex=600)
    await r.xadd(client.keys.dlq, {"session_id": "quiet", "text": "t", "error": "e"})
    before = {k: await r.dump(k) for k in await _all_keys(r)}

    dry = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "4"))
    assert dry.returncode == 0, dry.stderr
    assert "--yes" in dry.stderr
    report = json.loads(dry.stdout)
    assert report["dry_run"] is True
    # Every dead-letter stream of the sharded layout is another stream than dialog-dlq.
    assert (report["sessions"], report["dedupe_keys"], report["dead_letters"]) == (1, 1, 1)
    assert {k: await r.dump(k) for k in await _all_keys(r)} == before


# ---------------------------------------------------------------------------------------------
# in process: TTLs, expiry, interruption at every write


async def _deployment(env: dict[str, str], workers: Any) -> Settings:
    """A drained plain deployment made by a real worker: sessions (some with odd ids) with
    state, dedupe keys (explicit msg_ids) and dead letters (the engine refuses "fatal")."""
    settings = load_settings(environ=env)
    async with DialogClient(settings=settings) as c:
        sent = []
        for sid in ["s1", "s2", *ODD_IDS]:
            for n, text in enumerate(["nama saya Budi", "fatal input", "keluhan"], start=1):
                r = await c.send(sid, text, msg_id=f"{sid}-{n}")
                sent.append(Sent(sid, n, r.msg_id, text))
        workers.start(1, DIALOG_ENGINE="fault_engine:make")
        assert await wait_applied(c, sent, timeout_s=30)
        workers.stop_all()
        assert await c.redis.xlen(c.keys.dlq) == 6
    return settings


async def _all_keys(r: Any) -> list[Any]:
    return sorted([k async for k in r.scan_iter(match="*", count=1000)])


async def _canonical(r: Any) -> dict[Any, Any]:
    """Every key's type and value, ignoring stream entry ids, plus whether it has a TTL."""
    view: dict[Any, Any] = {}
    for key in await _all_keys(r):
        kind = (await r.type(key)).decode()
        if kind == "string":
            value: Any = await r.get(key)
        elif kind == "hash":
            value = await r.hgetall(key)
        elif kind == "stream":
            value = Counter(tuple(sorted(f.items())) for _, f in await r.xrange(key))
        elif kind == "set":
            value = await r.smembers(key)
        else:
            value = await r.zrange(key, 0, -1, withscores=True)
            if key.endswith(b":letters"):  # a session's dead-letter entry ids: new ones each run
                value = len(value)
        view[key] = (kind, value, await r.pttl(key) > 0)
    return view


async def _snapshot(r: Any) -> list[tuple[Any, int, bytes]]:
    return [(k, max(await r.pttl(k), 0), await r.dump(k)) for k in await _all_keys(r)]


async def _restore(r: Any, snapshot: list[tuple[Any, int, bytes]]) -> None:
    await r.flushall()
    for key, ttl_ms, payload in snapshot:
        await r.restore(key, ttl_ms, payload)


async def test_reshard_keeps_ttls_and_skips_a_key_that_expired_meanwhile(env, workers):
    old = await _deployment(env, workers)
    new = old.replace(shards=3)
    r = redis.asyncio.Redis.from_url(old.redis_url)
    try:
        plain = Topology.from_settings(old).shards[0]
        ttls = {
            (sid, role): await r.pttl(getattr(plain.session(sid), role))
            for sid in ["s1", *ODD_IDS]
            for role in ("state",)
        }
        ttls |= {
            (sid, "m2"): await r.pttl(plain.session(sid).dedupe(f"{sid}-2")) for sid in ODD_IDS
        }
        assert all(ttl > 0 for ttl in ttls.values()), ttls
        doomed = plain.session("s2").dedupe("s2-1")

        def expire_one(report: ReshardReport) -> Any:
            async def checkpoint() -> None:
                # Before the first write, after every key was listed: one of them expires.
                if await r.exists(doomed):
                    await r.pexpire(doomed, 1)
                    await wait_until_async(
                        lambda: _gone(r, doomed), 5, "the key to expire", interval_s=0.005
                    )

            return checkpoint

        started = anyio.current_time()
        report = await reshard(r, old, new, force=True, checkpoint=expire_one)
        elapsed_ms = (anyio.current_time() - started) * 1000
        assert report.expired == 1
        assert (report.sessions, report.dedupe_keys) == (6, 6 * 3 - 1)
        after = Topology.from_settings(new)
        assert await r.exists(after.for_session("s2").session("s2").dedupe("s2-1")) == 0
        assert await r.exists(doomed) == 0
        for (sid, what), ttl in ttls.items():
            sk = after.for_session(sid).session(sid)
            key = sk.state if what == "state" else sk.dedupe(f"{sid}-2")
            moved_ttl = await r.pttl(key)
            assert ttl - elapsed_ms - 50 <= moved_ttl <= ttl, (sid, what, ttl, moved_ttl)
        assert await r.get(f"{old.prefix}:shards") == b"3"
    finally:
        await r.aclose()


async def _gone(r: Any, key: str) -> bool:
    return not await r.exists(key)


async def test_rerun_after_a_stop_at_any_write_copies_nothing_twice(env, workers):
    old = await _deployment(env, workers)
    new = old.replace(shards=3)
    r = redis.asyncio.Redis.from_url(old.redis_url)
    try:
        snapshot = await _snapshot(r)
        # The reference: one uninterrupted run, counting its writes.
        writes = 0

        def count(report: ReshardReport) -> Any:
            async def checkpoint() -> None:
                nonlocal writes
                writes += 1

            return checkpoint

        full = await reshard(r, old, new, force=True, checkpoint=count)
        expected = await _canonical(r)
        totals = (full.sessions, full.dedupe_keys, full.dead_letters)
        assert totals == (6, 18, 6) and full.already_moved == 0
        # A set-up with no two keys in one place would prove little: the dead letters went to
        # three streams and no key kept its name.
        assert full.unchanged == 0

        for k in range(writes):
            await _restore(r, snapshot)
            with pytest.raises(Interrupted) as stopped:
                await reshard(r, old, new, force=True, checkpoint=stop_after(k))
            first = stopped.value.report
            if k:
                # Nothing may run while a reshard is half done.
                assert (await r.get(f"{old.prefix}:shards")).startswith(b"resharding")
            second = await reshard(r, old, new, force=True)
            assert second.resumed == (k > 0)
            done = tuple(
                a + b
                for a, b in zip(
                    (first.sessions, first.dedupe_keys, first.dead_letters),
                    (second.sessions, second.dedupe_keys, second.dead_letters),
                    strict=True,
                )
            )
            assert done == totals, (k, first, second)
            assert second.already_moved <= 1, (k, second)  # the one copied before the stop
            assert await _canonical(r) == expected, f"stopped after {k} writes"
        print(f"\n[reshard] stopped after each of 0..{writes - 1} writes, then run again: same end")
    finally:
        await r.aclose()


async def test_cli_stopped_mid_run_blocks_workers_until_run_again(env, workers):
    old = await _deployment(env, workers)
    await wait_consumers_idle(old)
    stopped = await anyio.to_thread.run_sync(
        lambda: run(env, "reshard", "--to", "2", "--yes", DIALOG_RESHARD_STOP_AFTER="7")
    )
    assert stopped.returncode == 1 and "interrupted" in stopped.stderr
    # Neither layout may start while the move is half done.
    for shards in ("1", "2"):
        refused = await anyio.to_thread.run_sync(
            lambda shards=shards: run(env, "send", "s1", "halo", DIALOG_SHARDS=shards)
        )
        assert refused.returncode != 0 and "reshard is in progress" in refused.stderr
    again = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "2", "--yes"))
    assert again.returncode == 0, again.stderr
    first, second = json.loads(stopped.stdout), json.loads(again.stdout)
    assert second["resumed"] is True
    assert first["sessions"] + second["sessions"] == 6
    assert first["dedupe_keys"] + second["dedupe_keys"] == 18
    # And the new layout works: a worker applies the sessions' next messages in order.
    two = load_settings(environ={**env, "DIALOG_SHARDS": "2"})
    async with DialogClient(settings=two) as c:
        sent = [Sent(sid, 4, (await c.send(sid, "lagi")).msg_id, "lagi") for sid in ODD_IDS]
        workers.start(1, DIALOG_SHARDS="2")
        assert await wait_applied(c, sent, timeout_s=30)
        for sid in ODD_IDS:
            state = await c.state(sid)
            assert [t["seq"] for t in state["history"]] == [1, 2, 3, 4]


async def test_reshard_refuses_while_a_worker_holds_a_shards_waiter_role(env, client, workers):
    """An idle pool's workers may not touch the inbound group for a long time (one waiter
    blocks on the stream, and on Redis 7.0 a read that returns nothing leaves XINFO CONSUMERS'
    idle as it was; the others block on the wake stream): a live waiter role counts as a live
    worker. Without that, reshard moved the keys of a pool idle for 2 x the reclaim interval."""
    r, k = client.redis, client.keys
    # A real idle pool: its consumer looks idle (fast settings: 2 x 100 ms) while it lives.
    fast = {"DIALOG_RECLAIM_INTERVAL_MS": "100", "DIALOG_READ_BLOCK_MS": "100"}
    [w] = workers.start(1, **fast)
    await client.ask("idle", "halo", timeout=20)
    await idle(r, [k], 1000)
    live = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "2", **fast))
    assert live.returncode == 1, live.stdout
    assert "active" in live.stderr and w.name in live.stderr
    assert await anyio.to_thread.run_sync(w.terminate) == 0  # gives its waiter role up
    stopped = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "2", **fast))
    assert stopped.returncode == 0, stopped.stderr

    await r.set(k.waiter, "w-waiting", px=60_000)
    refused = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "2", "--yes"))
    assert refused.returncode == 1, refused.stdout
    assert "active" in refused.stderr and "w-waiting" in refused.stderr
    assert await r.get(f"{client.settings.prefix}:shards") == "1"  # as the worker left it
