"""What a worker checks about the Redis it is given: at start, while it runs, and when Redis
refuses a call for lack of memory.

- Errors retrying cannot heal (a database index the server does not have, refused
  credentials, TLS on one side only, a command the user may not run or the server does not
  know) stop the worker with one line, exit 2 (`unhealable`). Errors that heal (connection
  refused, a restart) are retried; `OutageNotice` says so once on stderr, and again when Redis
  answers.
- Eviction: Redis evicts whole keys (a stream with its groups, a lock, a state), so a worker
  refuses to start against `maxmemory` with any policy but `noeviction`, unless
  DIALOG_ALLOW_EVICTION=1; `RedisGuard` re-checks every DIALOG_REDIS_CHECK_INTERVAL_S and marks
  the worker not ready if the policy changes under it. No persistence is one warning line.
- Out of memory: every script declares its flags (scripts.py), so Redis refuses it before it
  runs; `OomBackoff` retries such calls with a capped backoff, counted apart from failures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import ssl
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import redis.exceptions
import structlog
from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.errors import ConfigError
from dialog_worker.metrics import Metrics
from dialog_worker.store.scripts import Scripts

log = structlog.get_logger("dialog_worker.store.checks")

T = TypeVar("T")

SAFE_POLICY = "noeviction"
PROBE_SCRIPT = "#!lua flags=no-writes\nreturn 1"
# Longest wait between two tries of a call Redis refused for lack of memory.
OOM_BACKOFF_MAX_S = 2.0
OOM_BACKOFF_BASE_S = 0.05


def say(line: str) -> None:
    """One line for the person who started the worker (stderr; the log goes to stdout)."""
    print(f"dialog-worker: {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Errors that cannot heal


def unhealable(exc: BaseException, settings: Settings) -> ConfigError | None:
    """The ConfigError to stop with when retrying `exc` cannot help, else None."""
    message = str(exc)
    lowered = message.lower()
    if isinstance(exc, redis.exceptions.AuthenticationError) or lowered.startswith(
        ("wrongpass", "noauth", "invalid username-password")
    ):
        return ConfigError(
            "REDIS_URL",
            f"Redis at {settings.redacted_url()} refused the credentials ({message}); "
            "set the user and password in the URL (redis://USER:PASSWORD@host:port/db)",
        )
    if "db index is out of range" in lowered:
        db = urllib.parse.urlsplit(settings.redis_url).path.strip("/") or "0"
        return ConfigError(
            "REDIS_URL",
            f"Redis at {settings.redacted_url()} has no database {db} (its `databases` "
            "setting is lower); name an existing one, e.g. /0",
        )
    if isinstance(exc, redis.exceptions.NoPermissionError) or "noperm" in lowered:
        if not message.startswith("NOPERM"):  # redis-py drops the error code
            message = f"NOPERM {message}"
        return ConfigError(
            "REDIS_URL",
            f"the Redis user may not run a command the worker needs ({message}); give it "
            "the worker's rights (config/redis-acl.conf)",
        )
    if "unknown command" in lowered or "unknown redis command" in lowered:
        return ConfigError(
            "REDIS_URL",
            f"Redis does not know a command the worker needs ({message}): it is renamed or "
            "disabled on the server, or the server is older than 7.0",
        )
    return None


async def tls_mismatch(exc: BaseException, settings: Settings) -> ConfigError | None:
    """A connection that failed because one side speaks TLS and the other does not looks like a
    timeout or a closed connection; ask the server once, the other way, to tell them apart."""
    if not isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return None
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return None
    parts = urllib.parse.urlsplit(settings.redis_url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        return None
    host, port = parts.hostname, parts.port or 6379
    if parts.scheme == "rediss" and await _speaks_plain_resp(host, port, None):
        return ConfigError(
            "REDIS_URL",
            f"rediss:// (TLS) but the server at {host}:{port} speaks plain Redis without TLS: "
            "use redis://, or enable TLS on the server",
        )
    if parts.scheme == "redis" and await _speaks_plain_resp(host, port, _any_cert()):
        return ConfigError(
            "REDIS_URL",
            f"redis:// (no TLS) but the server at {host}:{port} speaks TLS: use rediss://",
        )
    return None


def _any_cert() -> ssl.SSLContext:
    # Only to learn whether the server speaks TLS at all; nothing is sent but PING.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


async def _speaks_plain_resp(host: str, port: int, tls: ssl.SSLContext | None) -> bool:
    try:
        async with asyncio.timeout(2):
            reader, writer = await asyncio.open_connection(host, port, ssl=tls)
            try:
                writer.write(b"PING\r\n")
                await writer.drain()
                first = await reader.read(1)
            finally:
                writer.close()
    except (OSError, TimeoutError, ssl.SSLError):
        return False
    return first in (b"+", b"-")


class OutageNotice:
    """One stderr line when Redis cannot be reached (what is retried, how often), one when it
    answers again. The structured log keeps its own, rate-limited lines."""

    def __init__(self, settings: Settings, retry_max_s: float) -> None:
        self.settings = settings
        self.retry_max_s = retry_max_s
        self.since: float | None = None

    def failed(self, exc: BaseException) -> None:
        if self.since is not None:
            return
        self.since = time.monotonic()
        say(
            f"cannot reach Redis at {self.settings.redacted_url()} ({type(exc).__name__}: "
            f"{_one_line(exc)}); retrying with backoff, at least every "
            f"{self.retry_max_s:g} s, until it answers"
        )

    def recovered(self) -> None:
        if self.since is None:
            return
        say(
            f"Redis at {self.settings.redacted_url()} answers again after "
            f"{time.monotonic() - self.since:.1f} s"
        )
        self.since = None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


# ---------------------------------------------------------------------------------------------
# Eviction and persistence


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    maxmemory: int
    policy: str
    appendonly: bool


async def read_config(client: Redis) -> ServerConfig | None:
    """The settings that matter here, from INFO (which managed services and the worker's ACL
    user allow where CONFIG GET is refused), or None where INFO is not allowed either."""
    try:
        memory = per_node(await client.info("memory"))
        persistence = per_node(await client.info("persistence"))
    except redis.exceptions.ResponseError as exc:  # NOPERM and unknown command included
        if unhealable(exc, _NO_SETTINGS) is None:
            raise
        return None
    configs = [
        ServerConfig(
            maxmemory=int(m.get("maxmemory", 0) or 0),
            policy=_text(m.get("maxmemory_policy", SAFE_POLICY)),
            appendonly=all(str(p.get("aof_enabled", "0")) == "1" for p in persistence),
        )
        for m in memory
    ]
    # In a cluster, the first node that can evict speaks for all.
    return next((c for c in configs if eviction_problem(c)), configs[0] if configs else None)


def per_node(info: dict[str, Any]) -> list[dict[str, Any]]:
    """INFO of a standalone server, or of every node of a Cluster (redis-py's cluster client
    answers {node name: INFO})."""
    if info and all(isinstance(v, dict) for v in info.values()):
        return list(info.values())
    return [info]


_NO_SETTINGS = Settings()


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def eviction_problem(config: ServerConfig) -> str | None:
    if config.maxmemory and config.policy != SAFE_POLICY:
        return (
            f"Redis has maxmemory {config.maxmemory} with maxmemory-policy {config.policy}, "
            "which evicts whole keys (streams with their groups, locks, session states) "
            f"when memory runs out; set maxmemory-policy {SAFE_POLICY} (redis.conf, or "
            f"CONFIG SET maxmemory-policy {SAFE_POLICY}), or DIALOG_ALLOW_EVICTION=1 to "
            "accept that risk"
        )
    return None


async def check_at_start(
    client: Redis, settings: Settings, metrics: Metrics, scripts: Scripts | None = None
) -> list[str]:
    """Raise ConfigError (exit 2, nothing written) for an eviction policy that can take the
    worker's keys; return one warning line for each thing that is only a risk, for the caller
    to `say` once every other start check passed (a worker that refuses to start says only
    why). With `scripts`, load them and run a script that writes nothing first, so a user
    without the rights to (NOPERM) is refused before the worker writes anything (a command
    refused inside a script is found at its first call, and stops the worker then)."""
    if scripts is not None:
        for field in dataclasses.fields(scripts):
            await client.script_load(getattr(scripts, field.name).source)
        await client.evalsha(await client.script_load(PROBE_SCRIPT), 0)
    config = await read_config(client)
    if config is None:
        log.warning("redis_config_unreadable")
        return [
            "cannot read the Redis configuration (INFO is not allowed here); not checking "
            f"maxmemory-policy and persistence: make sure they are {SAFE_POLICY} and AOF"
        ]
    warnings = []
    problem = eviction_problem(config)
    if problem is not None:
        if not settings.allow_eviction:
            raise ConfigError("maxmemory-policy", problem)
        warnings.append(f"DIALOG_ALLOW_EVICTION=1: running although {problem.split(';')[0]}")
        log.warning("redis_eviction_allowed", policy=config.policy, maxmemory=config.maxmemory)
    metrics.redis_eviction_unsafe.set(1 if problem else 0)
    if not config.appendonly:
        warnings.append(
            "Redis runs without AOF (appendonly no): a restart of Redis loses every queued "
            "message and session state written since its last RDB snapshot, if it takes any "
            "(save ''), all of them; set appendonly yes"
        )
        log.warning("redis_not_persistent")
    return warnings


class RedisGuard:
    """The periodic re-check (a side loop of the worker): a policy that turns unsafe while the
    worker runs makes it not ready (/readyz 503), with a log line and a metric, until fixed."""

    def __init__(self, redis: Redis, settings: Settings, metrics: Metrics) -> None:
        self.redis = redis
        self.settings = settings
        self.metrics = metrics
        self.ok = True

    async def check_once(self) -> float:
        interval = self.settings.redis_check_interval_s
        config = await read_config(self.redis)
        if config is None:
            return interval
        problem = eviction_problem(config)
        self.metrics.redis_eviction_unsafe.set(1 if problem else 0)
        ok = problem is None or self.settings.allow_eviction
        if ok != self.ok:
            if ok:
                log.info("redis_eviction_policy_safe", policy=config.policy)
            else:
                log.error("redis_eviction_policy_unsafe", problem=problem, ready=False)
        self.ok = ok
        return interval


# ---------------------------------------------------------------------------------------------
# Out of memory


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or str(exc).startswith("OOM ")


class OomBackoff:
    """Calls Redis refused for lack of memory wait and try again: backpressure, not failure.
    A refused script wrote nothing (its flags make Redis refuse it before it runs), so trying
    again is always safe; the message's attempt is not counted and nothing is dead-lettered."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self.waiting = 0
        self._since: float | None = None

    def refused(self, op: str) -> None:
        """Count one refusal (for callers with their own backoff, like the side loops)."""
        if self.metrics is not None:
            self.metrics.redis_oom.labels(op).inc()
        if self._since is None:
            self._since = time.monotonic()
            if self.metrics is not None:
                self.metrics.redis_oom_active.set(1)
            log.warning("redis_out_of_memory", op=op, note="backing off until Redis has room")

    def answered(self) -> None:
        if self._since is not None and not self.waiting:
            log.info("redis_memory_available", after_s=round(time.monotonic() - self._since, 3))
            self._since = None
            if self.metrics is not None:
                self.metrics.redis_oom_active.set(0)

    async def call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        failures = 0
        while True:
            try:
                result = await call()
            except redis.exceptions.ResponseError as exc:
                if not is_oom(exc):
                    raise
                failures += 1
                self.refused(op)
                self.waiting += 1
                try:
                    await anyio.sleep(_backoff_s(failures))
                finally:
                    self.waiting -= 1
                continue
            if failures:
                self.answered()
            return result


def _backoff_s(failures: int) -> float:
    ceiling = min(OOM_BACKOFF_MAX_S, OOM_BACKOFF_BASE_S * 2 ** min(failures, 16))
    return random.uniform(ceiling / 2, ceiling)


# One per process: the worker binds its metrics at start (daemon); the pipeline's commits and
# releases go through it.
oom = OomBackoff()


# ---------------------------------------------------------------------------------------------
# Failover: what Redis acknowledged and then lost


class CommitLedger:
    """This process's recent commits (state key -> the versions it wrote), kept
    `RECENT_COMMITS_S` and for at most `RECENT_COMMITS_MAX` sessions: what a failover (or a
    restart that lost the last second of its AOF) may have taken back."""

    RECENT_COMMITS_S = 120.0
    RECENT_COMMITS_MAX = 100_000

    def __init__(self) -> None:
        self.recent: dict[str, tuple[list[int], float]] = {}

    def committed(self, state_key: str, version: int) -> None:
        versions, _ = self.recent.pop(state_key, ([], 0.0))  # re-inserted last: time order
        versions.append(version)
        self.recent[state_key] = (versions[-1000:], time.monotonic())
        if len(self.recent) > self.RECENT_COMMITS_MAX:
            del self.recent[next(iter(self.recent))]

    def prune(self) -> None:
        horizon = time.monotonic() - self.RECENT_COMMITS_S
        while self.recent:
            key = next(iter(self.recent))
            if self.recent[key][1] >= horizon:
                return
            del self.recent[key]


# One per process, fed by the pipeline's commits.
ledger = CommitLedger()


class FailoverWatch:
    """Notices that the Redis behind the URL is another server than a moment ago (its run_id
    changed: a Sentinel or Cluster failover, or a restart) and checks this process's recent
    commits against it. A commit Redis acknowledged and no longer has (the state's version
    went back) is reported: a log line `commits_lost` with the count and some session keys,
    and `dialog_redis_commits_lost_total`. Such a message is applied again from the surviving
    state, so a consumer of the reply stream may see its reply twice; nothing else can tell it
    (Redis replication is asynchronous; WAIT narrows the window, does not close it)."""

    INTERVAL_S = 1.0
    RETRY_S = 0.1

    def __init__(self, redis: Redis, metrics: Metrics, commits: CommitLedger = ledger) -> None:
        self.redis = redis
        self.metrics = metrics
        self.commits = commits
        self.run_id: str | None = None

    async def check_once(self) -> float:
        try:
            info: dict[str, Any] = await self.redis.info("server")
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            # Try again soon, not with the loops' backoff: the check must run before the
            # lost commits' messages are applied again (after a lease), which would hide them.
            return self.RETRY_S
        except redis.exceptions.ResponseError as exc:
            if unhealable(exc, _NO_SETTINGS) is None:
                raise
            log.warning("failover_watch_off", reason=str(exc))  # INFO refused: watch nothing
            return 3600.0
        # A cluster's: every node's, so a failover of any shard shows.
        run_id = ",".join(sorted(_text(i.get("run_id", "")) for i in per_node(info)))
        if self.run_id is None or run_id == self.run_id:
            self.run_id = run_id
            self.commits.prune()
            return self.INTERVAL_S
        before = list(self.commits.recent.items())
        self.commits.recent.clear()
        self.run_id = run_id
        lost, count = await self._missing(before)
        self.metrics.redis_switches.inc()
        self.metrics.commits_lost.inc(count)
        if lost:
            log.error(
                "commits_lost",
                lost=count,
                sessions=len(lost),
                checked=len(before),
                state_keys=lost[:20],
                note="Redis changed (failover or restart) and no longer has these commits; "
                "their messages are applied again, their replies may be seen twice",
            )
        else:
            log.warning("redis_changed", checked=len(before), lost=0)
        return self.INTERVAL_S

    async def _missing(
        self, commits: list[tuple[str, tuple[list[int], float]]]
    ) -> tuple[list[str], int]:
        """The sessions whose state went back, and how many of our commits that undid."""
        lost: list[str] = []
        count = 0
        for start in range(0, len(commits), 500):
            chunk = commits[start : start + 500]
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, _ in chunk:
                    pipe.hget(key, "v")
                stored = await pipe.execute()
            for (key, (versions, _)), got in zip(chunk, stored, strict=True):
                now = int(got) if got is not None else 0
                undone = sum(1 for v in versions if v > now)
                if undone:
                    lost.append(key)
                    count += undone
        return lost, count
