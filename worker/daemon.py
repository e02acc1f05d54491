"""The worker process: message tasks plus named side loops.

    intake   reader (XREADGROUP, only as many entries as there are free slots)
             reclaimer (XAUTOCLAIM of entries idle past the visibility timeout; consumer hygiene)
    work     one task per message, at most DIALOG_CONCURRENCY at once (pipeline.py)
    side     promoter (delayed set -> stream), heartbeat (lease renewal), sampler (gauges,
             readiness), HTTP (/metrics, /healthz, /readyz), signals

Shutdown (SIGTERM/SIGINT): intake stops at once; in-flight work gets DIALOG_SHUTDOWN_GRACE_S;
what is still running then is cancelled and handed back to the queue; locks are released;
exit 0. A second signal exits at once (whatever was in flight stays pending for others).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import anyio
import anyio.abc
import redis.exceptions
import structlog
from redis.asyncio import Redis

from worker.config import Settings
from worker.engine import Engine
from worker.http import serve as serve_http
from worker.keys import Keys, Topology
from worker.metrics import Metrics
from worker.pipeline import Lease, Pipeline
from worker.redis_conn import connect, prepare
from worker.scripts import Scripts
from worker.views import queue_stats

log = structlog.get_logger("dialog_worker.daemon")

# XREADGROUP / XAUTOCLAIM replies with decode_responses=True (redis-py cannot type these).
ReadReply = list[tuple[str, list[tuple[str, dict[str, str] | None]]]]
ClaimReply = tuple[str, list[tuple[str, dict[str, str] | None]], list[str]]

PROMOTE_BATCH = 500
OUTAGE_BACKOFF_MAX_S = 5.0


@dataclasses.dataclass(eq=False)
class Shard:
    """One inbound stream and what reads it: its own share of the slots, so a reader blocked
    on an idle shard never holds the capacity another shard's messages need."""

    keys: Keys
    slots: anyio.Semaphore
    group_ready: bool = False

    @property
    def label(self) -> str:
        return str(self.keys.shard)


class Worker:
    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.topology = Topology.from_settings(settings)
        per_shard = max(1, -(-settings.concurrency // len(self.topology.shards)))
        self.shards = [Shard(k, anyio.Semaphore(per_shard)) for k in self.topology.shards]
        self.metrics = metrics or Metrics()
        for shard in self.shards:  # so every gauge is exported from the start
            for gauge in self.metrics.queue_gauges():
                gauge.labels(shard.label)
        # The callers are bounded: a message task holds one connection at a time (at most
        # `concurrency` of them), each shard's reader, reclaimer and promoter one each, the
        # heartbeat and the sampler one each; the margin is for safety, not for need.
        self.redis: Redis = connect(
            settings,
            max_connections=settings.concurrency + 8 + 3 * len(self.shards),
            bounded_callers=True,
        )
        self.scripts = Scripts.register(self.redis)
        self.leases: dict[str, Lease] = {}
        self.pipeline = Pipeline(settings, self.scripts, engine, self.metrics, self.leases)
        self.stopping = anyio.Event()
        self._ready = False
        self._last_error_log = 0.0

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

    # ------------------------------------------------------------------------------------

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
                ready=lambda: self.ready and not self.stopping.is_set(),
            )
            log.info("http_listening", host=self.settings.metrics_host, port=http.port)
        try:
            async with anyio.create_task_group() as side:
                side.start_soon(self._signals, side.cancel_scope)
                await self._prepare()
                if self.stopping.is_set():  # told to stop before Redis was ever reachable
                    side.cancel_scope.cancel()
                    return
                for shard in self.shards:
                    side.start_soon(
                        self._loop, f"promoter-{shard.label}", partial(self._promote_once, shard)
                    )
                side.start_soon(self._loop, "heartbeat", self._heartbeat_once)
                side.start_soon(self._loop, "sampler", self._sample_once)
                async with anyio.create_task_group() as work:
                    async with anyio.create_task_group() as intake:
                        for shard in self.shards:
                            intake.start_soon(
                                self._loop,
                                f"reader-{shard.label}",
                                partial(self._read_once, shard, work),
                            )
                            intake.start_soon(
                                self._loop,
                                f"reclaimer-{shard.label}",
                                partial(self._reclaim_once, shard, work),
                            )
                        await self.stopping.wait()
                        intake.cancel_scope.cancel()
                    # Intake has stopped; in-flight work gets the grace period, then is cancelled
                    # (cancelled steps hand their message back, see Pipeline._process).
                    work.cancel_scope.deadline = (
                        anyio.current_time() + self.settings.shutdown_grace_s
                    )
                    self.pipeline.stopping = True
                side.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.redis.aclose()
            if http is not None:
                http.close()
            log.info("worker_stopped")

    def stop(self) -> None:
        self.stopping.set()
        self.metrics.ready.set(0)  # as /readyz: a stopping worker takes no new work

    async def _prepare(self) -> None:
        """Cluster mode: learn the slot map before the loops start (see redis_conn.prepare).
        Retried with backoff, so a worker can start before Redis does."""
        failures = 0
        while not self.stopping.is_set():
            try:
                await prepare(self.redis)
                return
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
                # RedisClusterException ("cannot be connected") is not a RedisError: a worker
                # started while its startup node is down must wait, not exit.
                failures += 1
                self._log_outage("prepare", exc, failures)
                await anyio.sleep(min(OUTAGE_BACKOFF_MAX_S, 0.05 * 2**failures))

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
                    in_flight=len(self.leases),
                )
                self.stop()

    async def _loop(self, name: str, once: Callable[[], Awaitable[float]]) -> None:
        """Run one side loop: each round returns how long to wait before the next. A Redis
        failure marks the worker not ready and backs off; the loop itself never dies."""
        failures = 0
        while True:
            try:
                wait_s = await once()
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
                log.warning("loop_error", loop=name, error=repr(exc), failures=failures)
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

    # ------------------------------------------------------------------------------------
    # intake (one reader and one reclaimer per shard)

    async def _ensure_group(self, shard: Shard) -> None:
        keys = shard.keys
        try:
            await self.redis.xgroup_create(keys.stream, keys.group, id="0", mkstream=True)
            log.info("group_created", stream=keys.stream, group=keys.group)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        shard.group_ready = True
        if all(s.group_ready for s in self.shards):
            self.ready = True

    @staticmethod
    async def _take_slots(shard: Shard) -> int:
        """Wait for one free slot, then take every other free one: we read only what we can
        start now, so nothing sits unstarted in the pending list looking stuck."""
        await shard.slots.acquire()
        taken = 1
        while True:
            try:
                shard.slots.acquire_nowait()
            except anyio.WouldBlock:
                return taken
            taken += 1

    @staticmethod
    def _give_slots(shard: Shard, n: int) -> None:
        for _ in range(n):
            shard.slots.release()

    async def _read_once(self, shard: Shard, work: anyio.abc.TaskGroup) -> float:
        if not shard.group_ready:
            await self._ensure_group(shard)
        slots = await self._take_slots(shard)
        keys = shard.keys
        try:
            # Shielded: a read Redis has served assigns its entries to us, so cancelling it
            # at shutdown would strand them unstarted in our pending list until another
            # worker's visibility timeout. The read ends within read_block_ms, and the entries
            # are started below with no await in between, so they are finished or handed back.
            with anyio.CancelScope(shield=True):
                reply = await self.redis.xreadgroup(
                    keys.group,
                    self.settings.consumer,
                    {keys.stream: ">"},
                    count=slots,
                    block=self.settings.read_block_ms,
                )
        except redis.exceptions.ResponseError as exc:
            self._give_slots(shard, slots)
            if "NOGROUP" in str(exc):
                # The stream or group vanished (a Redis restart without persistence, a
                # deleted key): create them again rather than spin.
                shard.group_ready = False
                return 0
            raise
        except BaseException:
            self._give_slots(shard, slots)
            raise
        entries = [e for _, batch in cast(ReadReply, reply or []) for e in batch]
        self._give_slots(shard, slots - len(entries))
        self._start(shard, work, entries)
        return 0

    def _start(
        self,
        shard: Shard,
        work: anyio.abc.TaskGroup,
        entries: list[tuple[str, dict[str, str] | None]],
    ) -> None:
        """One task per session in the batch (a user's burst usually arrives together): its
        entries run one after another, each commit carrying the lock to the next, instead of
        racing each other for the lock. Synchronous: nothing may come between a read and
        the start of what it delivered (see _read_once)."""
        by_session: dict[str, list[tuple[str, dict[str, str]]]] = {}
        for entry_id, fields in entries:
            if fields is None:
                work.start_soon(self._ack_deleted, shard, entry_id)
            else:
                by_session.setdefault(fields.get("session_id", ""), []).append((entry_id, fields))
        for group in by_session.values():
            work.start_soon(self._run_group, shard, group)

    async def _ack_deleted(self, shard: Shard, entry_id: str) -> None:
        """Deleted after it was delivered: nothing left to process."""
        try:
            with anyio.CancelScope(shield=True):
                await self.redis.xack(shard.keys.stream, shard.keys.group, entry_id)
        finally:
            shard.slots.release()

    async def _run_group(self, shard: Shard, group: list[tuple[str, dict[str, str]]]) -> None:
        self.metrics.in_flight.inc(len(group))
        try:
            await self.pipeline.handle_entries(shard.keys, group)
        finally:
            self.metrics.in_flight.dec(len(group))
            self._give_slots(shard, len(group))

    async def _reclaim_once(self, shard: Shard, work: anyio.abc.TaskGroup) -> float:
        """XAUTOCLAIM entries idle past the visibility timeout (their consumer died or hangs:
        live work is kept fresh by the heartbeat). Follows the cursor to 0-0; a page may be
        empty with a non-zero cursor, and IDs of entries deleted meanwhile come back apart."""
        if not shard.group_ready:
            return self.settings.reclaim_interval_ms / 1000
        keys = shard.keys
        cursor = "0-0"
        while True:
            slots = await self._take_slots(shard)
            try:
                # Shielded for the same reason as the read: claimed entries become ours.
                with anyio.CancelScope(shield=True):
                    cursor, claimed, deleted = cast(
                        ClaimReply,
                        await self.redis.xautoclaim(
                            keys.stream,
                            keys.group,
                            self.settings.consumer,
                            min_idle_time=self.settings.visibility_timeout_ms,
                            start_id=cursor,
                            count=slots,
                        ),
                    )
            except BaseException:
                self._give_slots(shard, slots)
                raise
            self._give_slots(shard, slots - len(claimed))
            if deleted:
                log.info("reclaim_deleted_entries", count=len(deleted), shard=keys.shard)
            if claimed:
                self.metrics.reclaimed.inc(len(claimed))
                log.info("reclaimed", count=len(claimed), shard=keys.shard)
            self._start(shard, work, claimed)
            if cursor == "0-0":
                break
        await self._delete_idle_consumers(keys)
        return self.settings.reclaim_interval_ms / 1000

    async def _delete_idle_consumers(self, keys: Keys) -> None:
        idle_ms = self.settings.consumer_idle_delete_s * 1000
        for consumer in await self.redis.xinfo_consumers(keys.stream, keys.group):
            name = consumer["name"]
            if (
                name != self.settings.consumer
                and int(consumer["pending"]) == 0
                and int(consumer["idle"]) >= idle_ms
            ):
                deleted = await self.scripts.delconsumer(
                    keys=[keys.stream], args=[keys.group, name, idle_ms]
                )
                if int(deleted):
                    log.info("consumer_deleted", deleted_consumer=name, shard=keys.shard)

    # ------------------------------------------------------------------------------------
    # side loops

    async def _promote_once(self, shard: Shard) -> float:
        keys = shard.keys
        moved, wait_ms = await self.scripts.promote(
            keys=[keys.delayed, keys.delayed_data, keys.stream],
            args=[PROMOTE_BATCH],
        )
        if int(moved) >= PROMOTE_BATCH:
            return 0
        interval = self.settings.promote_interval_ms
        wait = interval if int(wait_ms) < 0 else min(interval, max(int(wait_ms), 5))
        return wait / 1000

    async def _heartbeat_once(self) -> float:
        ttl = self.settings.lock_ttl_ms
        due = time.monotonic() - ttl / 3000
        for lease in [lease for lease in self.leases.values() if lease.renewed_at < due]:
            if lease.lost:
                continue
            ok = await self.scripts.renew(
                keys=[lease.keys.lock, lease.shard.stream, lease.shard.delayed],
                args=[
                    lease.token,
                    ttl,
                    lease.shard.group,
                    self.settings.consumer,
                    lease.source,
                    lease.source_id,
                ],
            )
            if int(ok):
                lease.renewed_at = time.monotonic()
                self.metrics.lease_renewals.inc()
                waiting: list[Any] = [entry_id for entry_id, _ in lease.waiting.values()]
                if waiting:  # reset their idle time; JUSTID does not count a delivery
                    await self.redis.xclaim(
                        lease.shard.stream,
                        lease.shard.group,
                        self.settings.consumer,
                        0,
                        waiting,
                        justid=True,
                    )
            else:
                lease.lost = True
                if lease.scope is not None:
                    lease.scope.cancel()
                log.warning("lease_lost", entry_id=lease.source_id)
        return ttl / 4000

    async def _sample_once(self) -> float:
        m = self.metrics
        for shard in self.shards:
            stats = await queue_stats(self.redis, shard.keys)
            label = shard.label
            m.stream_length.labels(label).set(stats["stream_length"])
            m.group_lag.labels(label).set(stats["lag"] or 0)
            m.pending.labels(label).set(stats["pending"])
            m.oldest_pending_age.labels(label).set(stats["oldest_pending_age_s"])
            m.delayed.labels(label).set(stats["delayed"])
            m.dlq_length.labels(label).set(stats["dlq_length"])
        return self.settings.metrics_sample_interval_s


def run_worker(settings: Settings, engine: Engine, **kwargs: Any) -> None:
    """Run a worker until it is told to stop, on uvloop where available."""
    backend_options: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401

        backend_options["use_uvloop"] = True
    except ImportError:
        pass
    anyio.run(Worker(settings, engine, **kwargs).run, backend_options=backend_options)
