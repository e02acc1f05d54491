"""The pure parts of Redis-as-it-runs: the Sentinel URL form, which errors cannot heal, the
eviction policy rule, the ledger of recent commits."""

from __future__ import annotations

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


def test_a_cluster_answers_info_per_node_and_any_evicting_node_counts() -> None:
    from dialog_worker.store.checks import per_node

    one = {"maxmemory": 0, "maxmemory_policy": "noeviction"}
    assert per_node(one) == [one]
    nodes = {"127.0.0.1:7000": one, "127.0.0.1:7001": {**one, "maxmemory": 9}}
    assert per_node(nodes) == list(nodes.values())


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
