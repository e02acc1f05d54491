"""The Redis Cluster harness itself: it comes up, its slot helper matches the server, and a
killed master is replaced by its replica and comes back as a replica."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient
from redis_cluster import RedisCluster, slot

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    c = RedisCluster(Path(tmp_path_factory.mktemp("cluster")), node_timeout_ms=1000)
    c.start()
    print(f"\ncluster started in {c.start_seconds:.2f}s on ports {[n.port for n in c.nodes]}")
    yield c
    c.stop()


def test_cluster_comes_up_and_keys_spread_over_all_masters(cluster: RedisCluster) -> None:
    masters, replicas = cluster.masters(), cluster.replicas()
    assert len(masters) == 3 and len(replicas) == 3
    assert {n.role for n in masters} == {"master"} and {n.role for n in replicas} == {"slave"}
    for node in cluster.nodes:
        assert node.running and node.pid is not None
        info = node.cluster_info()
        assert info["cluster_state"] == "ok" and info["cluster_slots_assigned"] == "16384"
    for replica in replicas:
        assert replica.replication_info()["master_link_status"] == "up"
    assert cluster.url.startswith("redis://127.0.0.1:")

    client = ClusterClient.from_url(cluster.url, decode_responses=True)
    try:
        for i in range(300):
            client.set(f"spread:{i}", i)
        assert client.get("spread:299") == "299"
    finally:
        client.close()
    counts = cluster.keys_per_master()
    assert set(counts) == {m.port for m in masters}
    assert all(n > 0 for n in counts.values()), counts
    assert sum(counts.values()) >= 300

    for key in ("spread:0", "spread:1", "spread:2"):
        owner = cluster.node_for_slot(slot(key))
        assert owner in masters
        assert owner.client().get(key) is not None


KEYS = [
    "a",
    "{a}b",
    "a{b}c",
    "a{}b",
    "{}{x}",
    "a}{b}",
    "{a}",
    "{",
    "}",
    "{}",
    "a{b",
    "{{a}}",
    "foo{bar}{zap}",
    "",
    "session:{42}:state",
    "ключ{сессия}",
    "日本語",
    "emoji🙂{🙂}",
    "{user1000}.following",
    "123456789",
]


def test_slot_helper_agrees_with_cluster_keyslot(cluster: RedisCluster) -> None:
    node = cluster.nodes[0].client()
    assert slot("123456789") == 0x31C3 % 16384  # CRC16-XMODEM check value
    for key in KEYS:
        expected = node.execute_command("CLUSTER", "KEYSLOT", key)
        assert slot(key) == expected, key
        assert slot(key.encode()) == expected, key
        assert cluster.slot(key) == expected, key


def test_kill_master_fails_over_and_old_master_rejoins_as_replica(cluster: RedisCluster) -> None:
    client = ClusterClient.from_url(cluster.url, decode_responses=True)
    try:
        victim = next(m for m in cluster.masters() if m.url != cluster.url)
        replicas = cluster.replicas_of(victim)
        assert len(replicas) == 1
        lo, hi = cluster.slots_of(victim)[0]
        key = next(f"fo:{i}" for i in range(100_000) if lo <= slot(f"fo:{i}") <= hi)
        client.set(key, "before")
        # make sure the replica has it, so the failover cannot lose it
        assert victim.client().execute_command("WAIT", 1, 2000) >= 1

        killed_at = time.monotonic()
        cluster.kill(victim)
        new_master = cluster.wait_for_failover(victim.port, timeout=15)
        failover_s = time.monotonic() - killed_at
        print(f"\nfailover of port {victim.port} -> {new_master.port} in {failover_s:.2f}s")
        assert failover_s < 10
        assert new_master in replicas
        assert cluster.node_for_slot(slot(key)) is new_master
        assert victim not in cluster.masters()

        # the client made before the kill follows the new topology (MOVED / refresh)
        value = _retry(lambda: client.get(key))
        assert value == "before"
        _retry(lambda: client.set(key, "after"))
        assert client.get(key) == "after"
        assert new_master.client().get(key) == "after"

        restarted_at = time.monotonic()
        cluster.restart(victim)
        master = cluster.wait_rejoined_as_replica(victim, timeout=20)
        rejoin_s = time.monotonic() - restarted_at
        print(f"old master rejoined as replica of {master.port} in {rejoin_s:.2f}s")
        assert master is new_master
        assert victim.role == "slave"
        assert victim in cluster.replicas()
        assert len(cluster.masters()) == 3 and len(cluster.replicas()) == 3
    finally:
        client.close()


def _retry(fn, attempts: int = 20, delay_s: float = 0.1):
    """redis-py retries a few times by itself; give it some more room right after failover."""
    for attempt in range(attempts):
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError):
            if attempt == attempts - 1:
                raise
            time.sleep(delay_s)
    return None


def test_kill_once_replicated_waits_for_a_lagging_replica_so_the_failover_keeps_every_write(
    cluster: RedisCluster,
) -> None:
    """The replica is cut off and paused while the master acknowledges 200 writes (what
    asynchronous replication loses to a plain kill -9); kill_once_replicated lets it resync
    first, so the replica that takes over has all 200."""
    client = ClusterClient.from_url(cluster.url, decode_responses=True)
    try:
        victim = next(m for m in cluster.masters() if m.url != cluster.url)
        [replica] = cluster.replicas_of(victim)
        lo, hi = cluster.slots_of(victim)[0]
        keys = [f"lag:{i}" for i in range(100_000) if lo <= slot(f"lag:{i}") <= hi][:200]
        assert replica.proc is not None
        cluster.pause(replica)
        try:
            victim.client().client_kill_filter(_type="replica")
            for key in keys:
                assert client.set(key, "acknowledged")
        finally:
            cluster.resume(replica)
        offset = cluster.kill_once_replicated(victim)
        assert int(replica.replication_info()["slave_repl_offset"]) >= offset
        new_master = cluster.wait_for_failover(victim.port, timeout=15)
        assert new_master is replica
        assert [_retry(lambda k=k: client.get(k)) for k in keys] == ["acknowledged"] * len(keys)
        cluster.restart(victim)
        cluster.wait_rejoined_as_replica(victim, timeout=20)
    finally:
        client.close()
