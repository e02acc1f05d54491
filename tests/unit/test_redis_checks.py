"""The pure parts of Redis-as-it-runs: the Sentinel URL form, which errors cannot heal, the
eviction policy rule, the ledger of recent commits."""

from __future__ import annotations

from typing import Any

import pytest
import redis.exceptions

from dialog_worker.config import Settings, load_settings
from dialog_worker.errors import ConfigError
from dialog_worker.store.checks import CommitLedger, ServerConfig, eviction_problem, unhealable
from dialog_worker.store.connection import parse_sentinel_url


def test_sentinel_url_names_sentinels_master_db_and_credentials() -> None:
    url = parse_sentinel_url(
        "redis+sentinel://worker:p%40ss@s1:26379,10.0.0.2:26380/mymaster/3"
        "?sentinel_password=sp&sentinel_username=su"
    )
    assert url.sentinels == [("s1", 26379), ("10.0.0.2", 26380)]
    assert (url.master, url.db, url.username, url.password) == ("mymaster", 3, "worker", "p@ss")
    assert (url.sentinel_username, url.sentinel_password) == ("su", "sp")
    assert parse_sentinel_url("redis+sentinel://h:1/m").db == 0


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h1:26379,h2/mymaster",  # a port missing
        "redis+sentinel://h1:26379",  # no master name
        "redis+sentinel://h1:26379/mymaster/x",  # db not a number
        "redis+sentinel://h1:26379/mymaster/0/extra",
        "redis+sentinel://h1:26379/mymaster?password=x",  # unknown option
    ],
)
def test_malformed_sentinel_url_is_one_config_error_without_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(environ={"REDIS_URL": url.replace("://", "://u:s3cret@")})
    assert refused.value.setting == "REDIS_URL"
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (redis.exceptions.ResponseError("DB index is out of range"), "no database 7"),
        (redis.exceptions.AuthenticationError("invalid username-password pair"), "credentials"),
        (redis.exceptions.NoPermissionError("this user has no permissions"), "NOPERM"),
        (redis.exceptions.ResponseError("ERR unknown command 'evalsha'"), "does not know"),
    ],
)
def test_errors_retrying_cannot_heal_stop_the_worker(exc: Exception, words: str) -> None:
    settings = Settings(redis_url="redis://u:s3cret@h:6379/7")
    refused = unhealable(exc, settings)
    assert refused is not None and words in str(refused) and "s3cret" not in str(refused)


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.ConnectionError("Error 111 connecting"),
        redis.exceptions.TimeoutError("Timeout connecting to server"),
        redis.exceptions.ResponseError("LOADING Redis is loading the dataset in memory"),
        redis.exceptions.OutOfMemoryError("OOM command not allowed"),
    ],
)
def test_errors_that_heal_are_retried(exc: Exception) -> None:
    assert unhealable(exc, Settings()) is None


def test_only_noeviction_or_no_maxmemory_is_safe() -> None:
    assert eviction_problem(ServerConfig(0, "allkeys-lru", True)) is None
    assert eviction_problem(ServerConfig(10**8, "noeviction", True)) is None
    for policy in ("allkeys-lru", "volatile-lru", "volatile-ttl", "allkeys-random"):
        problem = eviction_problem(ServerConfig(10**8, policy, True))
        assert problem is not None and "DIALOG_ALLOW_EVICTION=1" in problem


def test_ledger_keeps_recent_versions_per_session_in_time_order() -> None:
    ledger = CommitLedger()
    ledger.committed("a", 1)
    ledger.committed("b", 1)
    ledger.committed("a", 2)
    assert list(ledger.recent) == ["b", "a"] and ledger.recent["a"][0] == [1, 2]


class InfoOnly:
    """A Redis that answers INFO only: a standalone server's sections, or (``nodes``) a
    Cluster client's {node name: section} for each node, as redis-py's cluster client does."""

    def __init__(self, *memory: dict[str, Any], nodes: bool = False, run_id: str = "a") -> None:
        self.memory = memory
        self.nodes = nodes
        self.run_id = run_id

    async def info(self, section: str) -> dict[str, Any]:
        per = {
            "memory": list(self.memory),
            "persistence": [{"aof_enabled": 1} for _ in self.memory],
            "server": [{"run_id": self.run_id} for _ in self.memory],
        }[section]
        if not self.nodes:
            return per[0]
        return {f"127.0.0.1:{7000 + i}": node for i, node in enumerate(per)}


SAFE = {"maxmemory": 0, "maxmemory_policy": "noeviction"}
EVICTING = {"maxmemory": 10**8, "maxmemory_policy": "allkeys-lru"}


async def test_a_cluster_answers_info_per_node_and_any_evicting_node_counts() -> None:
    """INFO of a Cluster comes per node; a node that can evict is found wherever it is in
    the answer (not only when it is the first), at start and by the periodic re-check."""
    from dialog_worker.metrics import Metrics
    from dialog_worker.store.checks import RedisGuard, check_at_start, per_node, read_config

    assert per_node(SAFE) == [SAFE]
    nodes = {"127.0.0.1:7000": SAFE, "127.0.0.1:7001": {**SAFE, "maxmemory": 9}}
    assert per_node(nodes) == list(nodes.values())
    for evicting_at in range(3):
        memory = [EVICTING if i == evicting_at else SAFE for i in range(3)]
        cluster = InfoOnly(*memory, nodes=True)
        config = await read_config(cluster)  # type: ignore[arg-type]
        assert config is not None and config.policy == "allkeys-lru", evicting_at
        with pytest.raises(ConfigError, match="allkeys-lru"):
            await check_at_start(cluster, Settings(), Metrics())  # type: ignore[arg-type]
        guard = RedisGuard(cluster, Settings(), Metrics())  # type: ignore[arg-type]
        await guard.check_once()
        assert guard.ok is False, evicting_at
    safe = InfoOnly(SAFE, SAFE, SAFE, nodes=True)
    assert await check_at_start(safe, Settings(), Metrics()) == []  # type: ignore[arg-type]


async def test_the_periodic_recheck_honours_allow_eviction_and_still_shows_the_risk() -> None:
    """DIALOG_ALLOW_EVICTION=1 lets a worker run against an evicting Redis: not only at start,
    every re-check too keeps it ready (before, the first re-check made it not ready), while
    the gauge keeps saying the policy is unsafe. Without it, the re-check makes it not ready."""
    import dataclasses

    from dialog_worker.metrics import Metrics
    from dialog_worker.store.checks import RedisGuard

    for allowed in (True, False):
        metrics = Metrics()
        settings = dataclasses.replace(Settings(), allow_eviction=allowed)
        guard = RedisGuard(InfoOnly(EVICTING), settings, metrics)  # type: ignore[arg-type]
        for _ in range(2):
            await guard.check_once()
            assert guard.ok is allowed
            assert metrics.registry.get_sample_value("dialog_redis_eviction_unsafe") == 1.0


async def test_after_a_failover_only_the_commits_redis_no_longer_has_are_reported_lost() -> None:
    """Redis changed (its run_id): a session whose state still has the version this process
    wrote last survived (equal versions: nothing lost); one whose state went back lost the
    commits above it; one whose state is gone lost them all."""
    import fakeredis

    from dialog_worker.metrics import Metrics
    from dialog_worker.store.checks import FailoverWatch

    class FailingOver(InfoOnly):
        def __init__(self) -> None:
            super().__init__(SAFE)
            self.data = fakeredis.FakeAsyncRedis()

        def pipeline(self, transaction: bool) -> Any:
            return self.data.pipeline(transaction=transaction)

    redis_ = FailingOver()
    await redis_.data.hset("kept", "v", 3)
    await redis_.data.hset("went-back", "v", 4)
    ledger = CommitLedger()
    for key, versions in (("kept", [1, 2, 3]), ("went-back", [3, 4, 5, 6]), ("gone", [7])):
        for version in versions:
            ledger.committed(key, version)
    metrics = Metrics()
    watch = FailoverWatch(redis_, metrics, ledger)  # type: ignore[arg-type]
    await watch.check_once()  # the first look: what Redis is now
    assert metrics.registry.get_sample_value("dialog_redis_switches_total") == 0.0
    redis_.run_id = "b"  # a failover, or a restart
    await watch.check_once()
    assert metrics.registry.get_sample_value("dialog_redis_switches_total") == 1.0
    assert metrics.registry.get_sample_value("dialog_redis_commits_lost_total") == 3.0
    assert ledger.recent == {}  # checked once: not reported again at the next change


async def test_a_call_refused_for_memory_waits_longer_each_time_up_to_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of memory is backpressure: the call is tried again, after a pause that doubles
    (with jitter) up to OOM_BACKOFF_MAX_S, and its result is returned once Redis has room."""
    from dialog_worker.store import checks as redis_checks

    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(redis_checks.anyio, "sleep", sleep)
    refusals = 12

    async def call() -> str:
        if len(waits) < refusals:
            raise redis.exceptions.ResponseError("OOM command not allowed when used memory")
        return "done"

    assert await redis_checks.OomBackoff().call("commit", call) == "done"
    assert len(waits) == refusals
    base, cap = redis_checks.OOM_BACKOFF_BASE_S, redis_checks.OOM_BACKOFF_MAX_S
    for failures, wait in enumerate(waits, start=1):
        ceiling = min(cap, base * 2**failures)
        assert ceiling / 2 <= wait <= ceiling
    assert waits[-1] >= cap / 2  # it grew to the cap and stays there
