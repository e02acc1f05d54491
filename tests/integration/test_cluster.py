"""Redis Cluster: sharded streams, same guarantees, and a master failover mid-burst."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis.exceptions
from conftest import worker_env
from redis_cluster import RedisCluster
from redis_server import free_port, wait_until
from worker_procs import WorkerPool

from worker.client import DialogClient
from worker.config import load_settings
from worker.keys import key_slot
from worker.verify import Sent, check, send_bursts, wait_applied

pytestmark = pytest.mark.integration

SHARDS = "3"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    c = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture
def cluster_env(cluster: RedisCluster) -> dict[str, str]:
    for node in cluster.masters():
        node.client().flushall()
    return worker_env(cluster.url, DIALOG_REDIS_MODE="cluster", DIALOG_SHARDS=SHARDS)


@pytest_asyncio.fixture
async def cclient(cluster_env: dict[str, str]) -> AsyncIterator[DialogClient]:
    async with DialogClient(settings=load_settings(environ=cluster_env), max_connections=300) as c:
        yield c


async def test_burst_500x10_over_three_shards_exactly_once_in_order(
    cluster, cluster_env, cclient, tmp_path
):
    pool = WorkerPool(cluster_env, tmp_path)
    try:
        pool.start(2)
        texts = ["nama saya Budi"] + [f"pesan {i}" for i in range(2, 11)]
        started = time.monotonic()
        sent = await send_bursts(cclient, [f"s{i}" for i in range(500)], texts)
        assert await wait_applied(cclient, sent, timeout_s=180)
        elapsed = time.monotonic() - started
        assert await check(cclient, sent) == []
        per_master = cluster.keys_per_master()
        print(
            f"\ncluster 5000-message burst, 3 shards, 2 workers: {elapsed:.2f}s = "
            f"{5000 / elapsed:.0f} msg/s; keys per master {per_master}"
        )
        assert len(per_master) == 3 and all(n > 0 for n in per_master.values())
        for keys in cclient.topology.shards:
            assert await cclient.redis.xlen(keys.stream) == 0
            assert (await cclient.redis.xpending(keys.stream, keys.group))["pending"] == 0
        stats = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "worker", "stats"],
            env=cluster_env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        view = json.loads(stats.stdout)
        assert view["stream_length"] == 0 and len(view["shards"]) == 3
    finally:
        pool.stop_all()


@pytest.mark.parametrize("session_id", ["a{b}c", "{x}", "}{", "{}", "a}b{", "sesi-日本{1}"])
async def test_session_id_with_braces_lands_wholly_in_its_shards_slot(cluster, cclient, session_id):
    keys = cclient.keys_for(session_id)
    sk = keys.session(session_id)
    await cclient.send(session_id, "nama saya Budi", msg_id="m1")
    slot = key_slot(keys.stream)
    for key in (
        sk.state,
        sk.lock,
        sk.parked,
        sk.dedupe("m1"),
        keys.delayed,
        keys.replies,
        keys.dlq,
        keys.delayed_data,
    ):
        assert key_slot(key) == slot, key
    # And where Redis itself puts them: the node owning the slot holds the state key.
    node = cluster.node_for_slot(slot)
    assert node.client().exists(sk.state, sk.dedupe("m1")) == 2
    assert int(node.client().execute_command("CLUSTER", "KEYSLOT", sk.state)) == slot


async def test_master_killed_mid_burst_replica_takes_over_and_workers_continue(tmp_path):
    cluster = RedisCluster(tmp_path / "cluster").start()
    try:
        env = worker_env(
            cluster.url,
            DIALOG_REDIS_MODE="cluster",
            DIALOG_SHARDS=SHARDS,
            DIALOG_LOCK_TTL_MS="1000",
            DIALOG_VISIBILITY_TIMEOUT_MS="2000",
            DIALOG_RECLAIM_INTERVAL_MS="200",
        )
        pool = WorkerPool(env, tmp_path)
        procs = pool.start(2, metrics=True)
        # Ready means the worker has learnt the slot map: the kill below must not meet a
        # worker still bootstrapping from the node about to die (that case: next test).
        for w in procs:
            wait_until(lambda w=w: (w._get("/readyz") or (0,))[0] == 200, 30, what="ready")
        settings = load_settings(environ=env)
        accepted: list[Sent] = []
        errors = 0
        mid_burst = asyncio.Event()
        async with DialogClient(settings=settings, max_connections=300) as c:

            async def session(i: int) -> None:
                nonlocal errors
                sid = f"f{i}"
                for n in range(20):
                    await asyncio.sleep(0.05)  # pacing: a burst that spans the failover
                    text, msg_id = f"pesan {n}", f"{sid}-{n}"
                    deadline = time.monotonic() + 60
                    while True:
                        try:
                            r = await c.send(sid, text, msg_id=msg_id)
                            accepted.append(Sent(sid, r.seq, msg_id, text))
                            if len(accepted) >= 600:
                                mid_burst.set()
                            break
                        except (redis.exceptions.RedisError, OSError):
                            errors += 1
                            assert time.monotonic() < deadline, "send never accepted"
                            await asyncio.sleep(0.05)

            senders = asyncio.gather(*(session(i) for i in range(100)))
            await mid_burst.wait()
            victim = cluster.node_for_slot(key_slot(c.topology.shards[0].stream))
            await asyncio.to_thread(cluster.kill, victim)
            killed_at, accepted_at_kill = time.monotonic(), len(accepted)
            await asyncio.to_thread(cluster.wait_for_failover, victim.port, 20)
            failover_s = time.monotonic() - killed_at
            await senders

            # What survived: per session, the history must be a subsequence of what was
            # accepted, in send order, with no message twice. Accepted sends whose writes the
            # old master had not yet replicated are gone (async replication: documented).
            deadline = time.monotonic() + 120
            while True:
                lost, twice, disorder, pending = await survivors(c, accepted)
                if not pending or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        alive = [w.alive() for w in procs]
        print(
            f"\n[cluster failover] master :{victim.port} killed after {accepted_at_kill} accepted "
            f"sends; failover {failover_s:.2f}s; {errors} send errors retried; of 2000 accepted: "
            f"lost {lost}, applied twice {twice}, out of order {disorder}, "
            f"sessions not settled {pending}; workers alive {alive}"
        )
        assert twice == 0 and disorder == 0
        assert pending == 0, "sessions still waiting after the failover"
        assert all(alive)
        pool.stop_all()
    finally:
        cluster.stop()


def test_worker_started_while_its_startup_node_is_down_waits_instead_of_exiting(tmp_path):
    env = worker_env(
        f"redis://127.0.0.1:{free_port()}/0",
        DIALOG_REDIS_MODE="cluster",
        DIALOG_SHARDS=SHARDS,
        DIALOG_LOG_LEVEL="info",
    )
    pool = WorkerPool(env, tmp_path)
    try:
        [w] = pool.start(1, metrics=True)
        wait_until(lambda: "redis_unavailable" in w.log_text(), 20, what="an outage log line")
        assert w.alive()
        assert (w._get("/healthz") or (0,))[0] == 200
        assert (w._get("/readyz") or (0,))[0] == 503
        assert w.terminate(20) == 0
    finally:
        pool.stop_all()


async def survivors(c: DialogClient, accepted: list[Sent]) -> tuple[int, int, int, int]:
    by_session: dict[str, list[Sent]] = {}
    for s in accepted:
        by_session.setdefault(s.session_id, []).append(s)
    lost = twice = disorder = pending = 0
    for sid, msgs in by_session.items():
        order = [m.msg_id for m in sorted(msgs, key=lambda m: int(m.msg_id.rsplit("-", 1)[1]))]
        state = await c.state(sid)
        fields = await c.redis.hgetall(c.keys_for(sid).session(sid).state)
        if int(fields.get("a", 0)) < int(fields.get("s", 0)):
            pending += 1
        got = [t["msg_id"] for t in (state or {}).get("history", [])]
        twice += len(got) - len(set(got))
        positions = [order.index(m) for m in got if m in order]
        disorder += sum(1 for a, b in itertools.pairwise(positions) if b <= a)
        lost += len(set(order) - set(got))
    return lost, twice, disorder, pending


async def test_reshard_3_to_2_on_the_cluster_keeps_sessions_going(cluster, cluster_env, tmp_path):
    sessions = [f"c{i}" for i in range(30)] + ["a{b}c"]
    for shards, text in (("3", "nama saya Budi"), ("2", "keluhan")):
        env = {**cluster_env, "DIALOG_SHARDS": shards}
        if shards == "2":
            moved = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "worker", "reshard", "--to", "2"],
                env={**cluster_env, "DIALOG_SHARDS": "3"},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert moved.returncode == 0, moved.stderr
            assert json.loads(moved.stdout)["sessions"] == len(sessions)
        pool = WorkerPool(env, tmp_path)
        try:
            pool.start(1)
            async with DialogClient(settings=load_settings(environ=env)) as c:
                sent = await send_bursts(c, sessions, [text])
                assert await wait_applied(c, sent, timeout_s=60)
                assert await check(c, sent) == []
        finally:
            pool.stop_all()
    async with DialogClient(
        settings=load_settings(environ={**cluster_env, "DIALOG_SHARDS": "2"})
    ) as c:
        state = await c.state("a{b}c")
        assert [t["seq"] for t in state["history"]] == [1, 2]
        assert state["step"] == "COMPLETED"


async def test_ask_and_a_reply_group_work_across_the_cluster_shards(
    cluster, cluster_env, cclient, tmp_path
):
    """One reply reader per shard (each reply stream lives on its own master), and a
    consumer group that reads all of them."""
    pool = WorkerPool(cluster_env, tmp_path)
    try:
        async with cclient.replies(group="outbound", consumer="o1") as outbound:
            pool.start(1)
            replies = await asyncio.gather(
                *(cclient.ask(f"ask{i}", f"nama saya N{i}", timeout=60) for i in range(30))
            )
            assert [r.text for r in replies] == [
                f"Halo N{i}, ada yang bisa dibantu?" for i in range(30)
            ]
            shards = {k.replies for k in cclient.topology.shards}
            assert {r.stream for r in replies} == shards
            seen: set[str] = set()
            async for rep in outbound:
                seen.add(rep.msg_id)
                await cclient.ack(rep)
                if len(seen) == 30:
                    break
            assert seen == {r.msg_id for r in replies}
    finally:
        pool.stop_all()
