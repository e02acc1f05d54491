"""The worker process: message tasks plus named side loops, each in a module of its own.

    intake   reader.py: the reader of each shard (intake script: deliver, sequence, lock;
             only as many entries as there are free slots; when idle, one reader per shard,
             the waiter, blocks on the stream from the last delivered id, the others on the
             wake stream: see Reader.idle_wait)
             upkeep.py: the resumer (sessions of the ready set that are due: a crashed
             holder's lease ran out, a retry's backoff is over), the reclaimer (entries left
             pending by anything else; consumer hygiene) and the timers (due timers appended
             to the inbound stream: lua/fire-3.lua). The reclaimer and the timers are shared
             upkeep: one worker per shard does it (see Shard.does_upkeep).
    work     sessions.py: one task per session being worked, at most DIALOG_CONCURRENCY at
             once (slots.py), each through the pipeline (pipeline.py), and one committer per
             shard (group commit); the heartbeat that renews their leases
    side     sampler.py (gauges, event-loop lag), health_server.py (/metrics, /healthz,
             /readyz), signals, the Redis checks (dialog_worker/store/checks.py)

Shutdown (SIGTERM/SIGINT): intake stops at once; in-flight work gets DIALOG_SHUTDOWN_GRACE_S;
what is still running then is cancelled and handed back to the queue; locks are released;
exit 0. A second signal exits at once (whatever was in flight stays pending for others).
"""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import redis.exceptions
import structlog
from redis.asyncio import Redis

from dialog_worker import tracing
from dialog_worker.config import Settings
from dialog_worker.daemon.health_server import serve as serve_http
from dialog_worker.daemon.pipeline import Committer, Pipeline
from dialog_worker.daemon.presence import Presence
from dialog_worker.daemon.reader import Reader
from dialog_worker.daemon.sampler import Sampler
from dialog_worker.daemon.sessions import Sessions
from dialog_worker.daemon.shard import Shard
from dialog_worker.daemon.slots import SlotGate
from dialog_worker.daemon.upkeep import Upkeep
from dialog_worker.engine.protocol import Engine, shutdown_engine, startup_engine
from dialog_worker.errors import ConfigError
from dialog_worker.metrics import Metrics
from dialog_worker.store import checks as redis_checks
from dialog_worker.store import tenants
from dialog_worker.store.connection import TOPOLOGY_LISTENERS, check_topology, connect, prepare
from dialog_worker.store.keys import Keys, Topology
from dialog_worker.store.scripts import Scripts

log = structlog.get_logger("dialog_worker.daemon.worker")

OUTAGE_BACKOFF_MAX_S = 5.0


class Worker:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        metrics: Metrics | None = None,
        freeze_startup: bool = False,
    ) -> None:
        self.settings = settings
        self.freeze_startup = freeze_startup  # the process is the worker's (run_worker)
        self.topology = Topology.from_settings(settings)
        per_shard = max(1, -(-settings.concurrency // len(self.topology.shards)))
        self.shards = [Shard(k, SlotGate(per_shard)) for k in self.topology.shards]
        self.metrics = metrics or Metrics()
        if settings.redis_mode == "cluster":
            TOPOLOGY_LISTENERS.append(self._topology_refreshed)
        for shard in self.shards:  # so every gauge is exported from the start
            for gauge in self.metrics.queue_gauges():
                gauge.labels(shard.label)
        # The callers are bounded: a message task holds one connection at a time (at most
        # `concurrency` of them), each shard's reader, reclaimer and promoter one each, the
        # heartbeat and the sampler one each; the margin is for safety, not for need.
        # Two clients: one reads replies as bytes (scripts and streams: nothing read from Redis
        # is trusted to be UTF-8, and one bad entry must not fail its batch), one decodes (the
        # sampler and housekeeping). Callers are bounded: a session task holds at most one
        # connection at a time, each shard's reader, resumer, reclaimer and committer one each.
        self.raw: Redis = connect(
            settings,
            max_connections=settings.concurrency + 8 + 4 * len(self.shards),
            bounded_callers=True,
            decode_responses=False,
        )
        self.redis: Redis = connect(settings, max_connections=4, bounded_callers=False)
        self.scripts = Scripts.register(self.raw)
        self.housekeeping = Scripts.register(self.redis)
        self.guard = redis_checks.RedisGuard(self.redis, settings, self.metrics)
        self.failover = redis_checks.FailoverWatch(self.redis, self.metrics)
        redis_checks.oom.metrics = self.metrics
        self.stopping = anyio.Event()
        self.committers = {
            s.keys.shard: Committer(
                self.scripts,
                s.keys,
                settings,
                token_base=partial(self._token_base, s.keys.shard),
                slots=s.slots,
                lock_ttl_ms=partial(self._lock_ttl_ms, s.keys.shard),
            )
            for s in self.shards
        }
        self.pipeline = Pipeline(settings, self.scripts, engine, self.metrics, {}, self.committers)
        self.sessions = Sessions(
            settings, self.raw, self.scripts, self.metrics, self.pipeline, self.stopping
        )
        self.reader = Reader(
            settings,
            self.raw,
            self.redis,
            self.scripts,
            self.shards,
            self.sessions,
            self.stopping,
            on_ready=self._groups_ready,
        )
        self.upkeep = Upkeep(
            settings,
            self.raw,
            self.redis,
            self.scripts,
            self.housekeeping,
            self.metrics,
            self.sessions,
            self.reader,
        )
        self.sampler = Sampler(settings, self.redis, self.metrics, self.shards, self.sessions)
        self.presence = Presence(self.redis, self.shards, settings.consumer)
        self.refused: ConfigError | None = None  # set when Redis says this config is wrong
        self._ready = False
        self._last_error_log = 0.0

    def _token_base(self, shard: int) -> str:
        return self.sessions.token_base(shard)

    def _lock_ttl_ms(self, shard: int) -> int:
        return self.sessions.lock_ttl_ms(shard)

    @property
    def ready(self) -> bool:
        return self._ready

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value
        self.metrics.ready.set(1 if value else 0)
        if not value:
            for shard in self.shards:
                shard.group_ready = False

    def _groups_ready(self) -> None:
        self.ready = True

    def _topology_refreshed(self, masters: int, nodes: int) -> None:
        self.metrics.topology_refreshes.inc()
        log.info("redis_topology_refreshed", masters=masters, nodes=nodes)

    async def run(self) -> None:
        log.info(
            "worker_starting",
            redis=self.settings.redacted_url(),
            mode=self.settings.redis_mode,
            streams=[s.keys.stream for s in self.shards],
            group=self.settings.group,
            concurrency=self.settings.concurrency,
        )
        http = None
        if self.settings.metrics_port:
            # Up before Redis is: /healthz answers and /readyz says 503 meanwhile.
            http = serve_http(
                self.settings.metrics_host,
                self.settings.metrics_port,
                self.metrics.registry,
                ready=lambda: self.ready and self.guard.ok and not self.stopping.is_set(),
            )
            log.info("http_listening", host=self.settings.metrics_host, port=http.port)
        try:
            async with anyio.create_task_group() as side:
                side.start_soon(self._signals, side.cancel_scope)
                await self._prepare()
                if self.stopping.is_set():  # told to stop before Redis was ever reachable
                    side.cancel_scope.cancel()
                    return
                # The engine's clients and pools, before the first message it must serve; a
                # failure stops the worker (EngineHookError) rather than dead-letter traffic.
                await startup_engine(self.pipeline.engine)
                # What startup made (modules, settings, the engine and its clients) lives as
                # long as the process: frozen, a full collection no longer walks it. At a
                # steady 1,500 msg/s per worker that collection ran about once a second and
                # stopped the loop for 20-25 ms, the p99 of the latency (docs/benchmarks.md).
                # Only where the process is the worker's: frozen objects are never collected
                # as cycles, which a process embedding a worker would not expect.
                if self.freeze_startup:
                    gc.collect()  # startup's garbage is freed, not kept frozen
                    gc.freeze()
                for committer in self.committers.values():
                    side.start_soon(committer.run)
                side.start_soon(self._loop, "heartbeat", self.sessions.renew_leases_once)
                side.start_soon(
                    self._loop, "cancel-watch", partial(self.pipeline.watch_cancels, self.raw)
                )
                side.start_soon(self._loop, "pause-watch", self.pipeline.gate.wake_resumed)
                side.start_soon(self.sampler.watch_loop_lag)
                side.start_soon(self._loop, "sampler", self.sampler.sample_once)
                side.start_soon(self._loop, "presence", self.presence.announce_once)
                side.start_soon(self._loop, "redis-check", self.guard.check_once)
                side.start_soon(self._loop, "failover-watch", self.failover.check_once)
                async with anyio.create_task_group() as work:
                    async with anyio.create_task_group() as intake:
                        for shard in self.shards:
                            intake.start_soon(
                                self._loop,
                                f"reader-{shard.label}",
                                partial(self.reader.read_once, shard, work),
                            )
                            intake.start_soon(
                                self._loop,
                                f"resumer-{shard.label}",
                                partial(self.upkeep.resume_once, shard, work),
                            )
                            intake.start_soon(
                                self._loop,
                                f"reclaimer-{shard.label}",
                                partial(self.upkeep.reclaim_once, shard, work),
                            )
                            intake.start_soon(
                                self._loop,
                                f"timers-{shard.label}",
                                partial(self.upkeep.fire_once, shard),
                            )
                        await self.stopping.wait()
                        for committer in self.committers.values():
                            committer.dispatching = False  # no new session after intake stops
                        await self.reader.end_reads_ahead()
                        intake.cancel_scope.cancel()
                    await self.reader.leave_waiter_roles()
                    # Intake has stopped; in-flight work gets the grace period, then is cancelled
                    # (cancelled steps hand their message back, see Pipeline._process).
                    work.cancel_scope.deadline = (
                        anyio.current_time() + self.settings.shutdown_grace_s
                    )
                    self.pipeline.stopping = True
                with anyio.CancelScope(shield=True):
                    await shutdown_engine(self.pipeline.engine)  # after the last step
                    await self.presence.leave()  # nothing in hand: shown as gone at once
                    await self.sessions.leave()  # its leases are forgotten at once too
                side.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.raw.aclose()
                await self.redis.aclose()
            if http is not None:
                http.close()
            if self._topology_refreshed in TOPOLOGY_LISTENERS:
                TOPOLOGY_LISTENERS.remove(self._topology_refreshed)
            log.info("worker_stopped")
            if self.refused is not None:
                raise self.refused

    def stop(self) -> None:
        self.stopping.set()
        self.metrics.ready.set(0)  # as /readyz: a stopping worker takes no new work

    async def _prepare(self) -> None:
        """Cluster mode: learn the slot map before the loops start (see redis_conn.prepare).
        Retried with backoff, so a worker can start before Redis does."""
        failures = 0
        outage = redis_checks.OutageNotice(self.settings, OUTAGE_BACKOFF_MAX_S)
        while not self.stopping.is_set():
            try:
                await prepare(self.redis)
                await prepare(self.raw)
                warnings = await redis_checks.check_at_start(
                    self.redis, self.settings, self.metrics, self.scripts
                )
                await check_topology(self.redis, self.settings, record=True)
                await self._copy_tenant_shares()
                for warning in warnings:  # only once nothing refused the start
                    redis_checks.say(warning)
                outage.recovered()
                return
            except ConfigError as exc:
                self.refused = exc
                self.stop()
                return
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
                # RedisClusterException ("cannot be connected") is not a RedisError: a worker
                # started while its startup node is down must wait, not exit. What waiting
                # cannot heal (credentials, database index, ACL, TLS on one side) stops it.
                fatal = redis_checks.unhealable(exc, self.settings) or (
                    await redis_checks.tls_mismatch(exc, self.settings)
                )
                if fatal is not None:
                    self.refused = fatal
                    self.stop()
                    return
                outage.failed(exc)
                failures += 1
                self._log_outage("prepare", exc, failures)
                await anyio.sleep(min(OUTAGE_BACKOFF_MAX_S, 0.05 * 2**failures))

    async def _copy_tenant_shares(self) -> None:
        """Each shard's copy of the tenants' weights, minima and maxima (what its scripts
        read) made to match the deployment's settings: after a reshard, or a copy lost.
        A worker whose Redis user may not write them goes on with the copies as they are."""
        try:
            count = await tenants.sync_shards(
                self.redis, self.topology, Keys.from_settings(self.settings)
            )
        except redis.exceptions.NoPermissionError as exc:
            log.warning("tenant_settings_not_copied", error=str(exc))
            return
        if count:
            log.info("tenant_settings_copied", tenants=count, shards=len(self.shards))

    async def _signals(self, side_scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self.stopping.is_set():
                    log.warning("second_signal_exit_now", signal=signum)
                    os._exit(1)
                log.info(
                    "shutdown_requested",
                    signal=signum,
                    grace_s=self.settings.shutdown_grace_s,
                    in_flight=len(self.sessions.leases),
                )
                self.stop()

    async def _loop(self, name: str, once: Callable[[], Awaitable[float]]) -> None:
        """Run one side loop: each round returns how long to wait before the next. A Redis
        failure marks the worker not ready and backs off; the loop itself never dies."""
        failures = 0
        while True:
            try:
                wait_s = await once()
                if failures:
                    redis_checks.oom.answered()
                failures = 0
            except (
                redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError,
                redis.exceptions.RedisClusterException,
            ) as exc:
                failures += 1
                self.ready = False
                wait_s = min(OUTAGE_BACKOFF_MAX_S, 0.05 * 2**failures)
                self._log_outage(name, exc, failures)
            except redis.exceptions.RedisError as exc:
                failures += 1
                wait_s = min(OUTAGE_BACKOFF_MAX_S, 0.05 * 2**failures)
                if redis_checks.is_oom(exc):  # backpressure: intake and resumes wait for room
                    redis_checks.oom.refused(name)
                elif (fatal := redis_checks.unhealable(exc, self.settings)) is not None:
                    self.refused = fatal  # an ACL changed under us: stop, exit 2
                    self.stop()
                else:
                    log.warning(
                        "loop_error",
                        loop=name,
                        error=str(exc),  # redis-py's repr() hides Redis' message
                        error_type=type(exc).__name__,
                        failures=failures,
                    )
            except Exception:
                failures += 1
                wait_s = min(OUTAGE_BACKOFF_MAX_S, 0.05 * 2**failures)
                log.exception("loop_error", loop=name, failures=failures)
            if wait_s > 0:
                await anyio.sleep(wait_s)

    def _log_outage(self, loop: str, exc: BaseException, failures: int) -> None:
        now = time.monotonic()
        if failures == 1 or now - self._last_error_log > 5:
            self._last_error_log = now
            log.warning("redis_unavailable", loop=loop, error=type(exc).__name__, failures=failures)


def run_worker(settings: Settings, engine: Engine, **kwargs: Any) -> None:
    """Run a worker until it is told to stop, on uvloop where available."""
    backend_options: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401

        backend_options["use_uvloop"] = True
    except ImportError:
        pass
    worker = Worker(settings, engine, freeze_startup=True, **kwargs)
    # Traces when the OTEL_* variables ask for them (the process is the worker's, so the
    # tracer provider is ours to install); what is still buffered is exported at exit.
    tracing.setup("dialog-worker")
    try:
        anyio.run(worker.run, backend_options=backend_options)
    finally:
        tracing.shutdown()
