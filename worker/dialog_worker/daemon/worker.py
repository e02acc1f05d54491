"""The worker process: message tasks plus named side loops.

    intake   reader (intake script: deliver, sequence, lock; only as many entries as there
             are free slots; when idle, one reader per shard, the waiter, blocks on the
             stream from the last delivered id, the others on the wake stream: see
             Worker._idle_wait)
             resumer (sessions of the ready set that are due: a crashed holder's lease ran
             out, a retry's backoff is over)
             reclaimer (entries left pending by anything else; consumer hygiene)
             timers (due timers appended to the inbound stream: lua/fire-3.lua)
             The reclaimer and the timers are shared upkeep: one worker per shard does it
             (see Shard.does_upkeep).
    work     one task per session being worked, at most DIALOG_CONCURRENCY at once
             (pipeline.py), and one committer per shard (group commit)
    side     heartbeat (lease renewal), sampler (gauges, readiness), event-loop lag watch,
             HTTP (/metrics, /healthz, /readyz), signals

Shutdown (SIGTERM/SIGINT): intake stops at once; in-flight work gets DIALOG_SHUTDOWN_GRACE_S;
what is still running then is cancelled and handed back to the queue; locks are released;
exit 0. A second signal exits at once (whatever was in flight stays pending for others).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import secrets
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
import redis.exceptions
import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from dialog_worker.config import Settings
from dialog_worker.daemon.health_server import serve as serve_http
from dialog_worker.daemon.pipeline import Committer, Job, Pipeline
from dialog_worker.engine.protocol import Engine, shutdown_engine, startup_engine
from dialog_worker.errors import ConfigError
from dialog_worker.metrics import Metrics
from dialog_worker.store import checks as redis_checks
from dialog_worker.store.codec import MAX_EXTRA_FIELDS, fields_dict, text
from dialog_worker.store.connection import TOPOLOGY_LISTENERS, check_topology, connect, prepare
from dialog_worker.store.keys import Keys, Topology
from dialog_worker.store.queue_view import queue_stats, reply_group_lags
from dialog_worker.store.scripts import Scripts
from dialog_worker.version import __version__

log = structlog.get_logger("dialog_worker.daemon.worker")


class MalformedNotice:
    """Entries intake refused (malformed: dead-lettered alone, with the reason and their raw
    fields) are logged, not only counted: the first at once, then at most one line every
    INTERVAL_S carrying how many were refused since the previous line, so a producer that
    floods bad entries cannot flood the log."""

    INTERVAL_S = 10.0

    def __init__(self) -> None:
        self.unlogged = 0
        self.logged_at = -self.INTERVAL_S

    def add(self, count: int, keys: Keys) -> None:
        self.unlogged += count
        now = time.monotonic()
        if now - self.logged_at >= self.INTERVAL_S:
            log.warning(
                "malformed_dead_lettered",
                count=self.unlogged,
                stream=keys.stream,
                dlq=keys.dlq,
                see="dialog-worker dlq list",
            )
            self.unlogged, self.logged_at = 0, now


OUTAGE_BACKOFF_MAX_S = 5.0
# Most entries one intake call reads (the script refuses more).
INTAKE_BATCH = 1000
# Entries a reader's intake call reads at least, whatever its free slots: the sessions it
# locks beyond them wait in the process for a slot, their leases renewed (Worker._start).
READ_BATCH_SHORT_OF_SLOTS = 64
# How long the resumer sleeps when no session waits in the ready set: anything added later is
# due a lock lease or a backoff from then, except a hand-back at shutdown.
RESUME_IDLE_S = 1.0
# A session whose message took at least this long gives its slot up between messages when
# others wait for one (Worker._take_turns).
TURN_AFTER_S = 0.02
# How often the worker doing a shard's upkeep (Shard.does_upkeep) looks for due timers (one
# ZRANGE of the first; the fire script only when one is due): the most a timer is appended
# after it is due, while that worker lives.
TIMER_POLL_S = 0.25
# The waiter role of a shard (see Worker._idle_wait): a lease at least this long (and three
# blocking reads), renewed when half of it is left; a worker that waits on the wake stream asks
# whether the role is free this often (a waiter that died leaves it to expire), and blocks
# on the wake stream as long in between (WAKE_BLOCK_MAX_MS at most).
WAITER_LEASE_MS = 3000
# Below the connections' socket timeout (5 s, redis_conn.py): a blocking read that outlasts
# it fails.
WAKE_BLOCK_MAX_MS = 3000
# Shutdown ends a blocked read with an intake call behind it by an entry on the wake stream
# (Worker._end_reads_ahead); one that reached Redis before the read did is sent again after this.
READ_END_WAIT_S = 0.05
# The wake stream's consumer group (one per shard, readers of every worker join it).
WAKE_GROUP = "readers"
# A worker that finished a message this recently is active: it blocks on the inbound stream
# itself, waiter or not, so a pool under steady traffic reads in parallel (each woken reader
# finds work) and no message waits for a hand-over; after this long without work it goes back
# to the wake stream.
ACTIVE_WINDOW_S = 2.0
# An idle waiter runs an intake call this often even when its blocking read saw nothing: the
# group's position can move back (docs/runbook.md: a pushed-ahead stream's recovery resets it),
# and a read from the old position would never return.
IDLE_RECHECK_S = 5.0
# While a worker's last sample saw an empty queue and it has started no message since, it
# samples the queue gauges every this many intervals.
IDLE_SAMPLE_EVERY = 3


class SlotGate:
    """A shard's free message slots, handed out with priority: a freed slot goes to a waiting
    resumer before a waiting reader.

    anyio's Semaphore hands a released slot straight to the task blocked in `acquire()`; with
    the reader always blocked there under a backlog, the resumer (crash recovery, retries,
    hand-backs, gap checks) would never get one until the backlog is gone. Here the resumer
    waits in the first queue, so a due session waits at most for the next slot to free up."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiting: tuple[deque[_SlotWaiter], deque[_SlotWaiter]] = (deque(), deque())

    @property
    def free(self) -> int:
        return self._free

    @property
    def contended(self) -> bool:
        """Every slot is taken and someone waits for one."""
        return self._free <= 0 and any(self._waiting)

    def acquire_nowait(self) -> None:
        if self._free <= 0:
            raise anyio.WouldBlock
        self._free -= 1

    def take(self, most: int) -> int:
        """Up to `most` free slots at once, without waiting: how many were taken."""
        taken = max(0, min(most, self._free))
        self._free -= taken
        return taken

    async def acquire(self, priority: bool = False) -> None:
        await anyio.lowlevel.checkpoint()
        if self._free > 0:
            self._free -= 1
            return
        waiter = _SlotWaiter()
        queue = self._waiting[0 if priority else 1]
        queue.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release()  # handed over just as we were cancelled: pass it on
            else:
                queue.remove(waiter)
            raise

    def release(self, n: int = 1) -> None:
        """Give back `n` slots: to waiters first (priority first), the rest become free. An
        intake call gives back the slots it did not fill at once (up to 63 by default)."""
        for queue in self._waiting:
            while n > 0 and queue:
                waiter = queue.popleft()
                waiter.granted = True
                waiter.event.set()
                n -= 1
        self._free += max(n, 0)


async def take_turns(slots: SlotGate, took_s: float, stopping: bool = False) -> None:
    """Between two messages of a session: if its last one took a while (a model call, not the
    rules) and a reader or resumer waits for a slot, give the slot to it and queue behind.
    Under a backlog of slow steps the sessions then take turns, instead of each holding a slot
    for its whole burst while the others wait; fast steps keep their slot (a turn costs an
    intake call). Not while the worker stops: the session goes on and hands back at once."""
    if took_s >= TURN_AFTER_S and slots.contended and not stopping:
        slots.release()
        await slots.acquire()


@dataclasses.dataclass(eq=False)
class _SlotWaiter:
    event: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    granted: bool = False


@dataclasses.dataclass(eq=False)
class Shard:
    """One inbound stream and what reads it: its own share of the slots, so a reader blocked
    on an idle shard never holds the capacity another shard's messages need."""

    keys: Keys
    slots: SlotGate
    group_ready: bool = False
    # This process is the shard's waiter until then (monotonic s; 0: not the waiter).
    lease_until: float = 0.0
    # When this process last asked whether the waiter role is free (monotonic s).
    lease_checked_at: float = 0.0
    # Another worker held the waiter role when this process last asked: it counts as alive
    # until then (monotonic s; 0: none seen).
    waiter_seen_until: float = 0.0
    # Set when the read with an intake call behind it (Worker._read_ahead) has returned.
    read_ahead_done: anyio.Event | None = None
    # Sessions this process locked beyond its free slots, waiting for one (Worker._start).
    locked_waiting: int = 0

    @property
    def reading_ahead(self) -> bool:
        return self.read_ahead_done is not None and not self.read_ahead_done.is_set()

    def does_upkeep(self) -> bool:
        """Whether this process runs the shard's shared upkeep (due timers, the reclaim
        check), which one worker of the pool suffices for: every worker that has not seen
        another one hold the waiter role lately. That is the waiter; the last holder, busy
        since it handed the role on while nobody took it; everyone once the waiter died (a
        sighting counts for two leases, and the role is free after one). An idle pool of any
        size pays for one worker's upkeep."""
        return time.monotonic() >= self.waiter_seen_until

    @property
    def label(self) -> str:
        return str(self.keys.shard)


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
        self.leases: dict[str, Job] = {}
        # Sessions locked beyond the free slots, waiting for one (_run_when_a_slot_frees).
        self._waiting_for_slots: dict[str, anyio.CancelScope] = {}
        # Their hand-backs at shutdown go one at a time: each needs a connection, and the
        # pool is sized for the slots (there may be up to READ_BATCH_SHORT_OF_SLOTS of them).
        self._hand_backs = anyio.Lock()
        self.committers = {
            s.keys.shard: Committer(self.scripts, s.keys, settings) for s in self.shards
        }
        self.pipeline = Pipeline(
            settings, self.scripts, engine, self.metrics, self.leases, self.committers
        )
        self._token_counter = 0
        self._sessions_started = 0
        self._last_finished = 0.0  # monotonic s: when a session task last ended
        # The sampler's view of idleness: sessions started at the last sample, whether that
        # sample saw an empty queue, and the intervals skipped since.
        self._sampled_at_sessions = -1
        self._sampled_empty = False
        self._samples_skipped = 0
        # A restarted process may reuse its consumer name and pid (pid 1 in a container):
        # the nonce keeps its tokens apart from the locks its previous life still holds.
        self._token_nonce = f"{settings.consumer}:{secrets.token_hex(6)}"
        self.refused: ConfigError | None = None  # set when Redis says this config is wrong
        self.malformed = MalformedNotice()
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
                side.start_soon(self._loop, "heartbeat", self._heartbeat_once)
                side.start_soon(
                    self._loop, "cancel-watch", partial(self.pipeline.watch_cancels, self.raw)
                )
                side.start_soon(self._watch_loop_lag)
                side.start_soon(self._loop, "sampler", self._sample_once)
                side.start_soon(self._loop, "redis-check", self.guard.check_once)
                side.start_soon(self._loop, "failover-watch", self.failover.check_once)
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
                                f"resumer-{shard.label}",
                                partial(self._resume_once, shard, work),
                            )
                            intake.start_soon(
                                self._loop,
                                f"reclaimer-{shard.label}",
                                partial(self._reclaim_once, shard, work),
                            )
                            intake.start_soon(
                                self._loop,
                                f"timers-{shard.label}",
                                partial(self._fire_once, shard),
                            )
                        await self.stopping.wait()
                        await self._end_reads_ahead()
                        intake.cancel_scope.cancel()
                    await self._leave_waiter_roles()
                    for waiting in list(self._waiting_for_slots.values()):
                        waiting.cancel()  # each hands its session back at once
                    # Intake has stopped; in-flight work gets the grace period, then is cancelled
                    # (cancelled steps hand their message back, see Pipeline._process).
                    work.cancel_scope.deadline = (
                        anyio.current_time() + self.settings.shutdown_grace_s
                    )
                    self.pipeline.stopping = True
                with anyio.CancelScope(shield=True):
                    await shutdown_engine(self.pipeline.engine)  # after the last step
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

    async def _leave_waiter_roles(self) -> None:
        """At shutdown: another worker takes over waiting at once, not when the lease ends."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            for shard in self.shards:
                try:
                    await self._hand_over(shard)
                    await self.raw.xgroup_delconsumer(
                        shard.keys.wake, WAKE_GROUP, self.settings.consumer
                    )
                except redis.exceptions.RedisError as exc:
                    log.warning("waiter_hand_over_failed", error=str(exc), shard=shard.label)

    async def _end_reads_ahead(self) -> None:
        """At shutdown: a read that carries an intake call is never cancelled (the call could
        run after the reader gave up on its reply): the read also watches the wake stream, and
        one entry there ends it now, not after DIALOG_READ_BLOCK_MS. Another worker's wake read
        may take the entry as well: it looks for new entries, as at any hand-over. An entry
        that reached Redis before the read did (from "$" on) does not end it: another one goes
        after READ_END_WAIT_S."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            for shard in self.shards:
                while shard.read_ahead_done is not None and not shard.read_ahead_done.is_set():
                    try:
                        await self.raw.xadd(
                            shard.keys.wake,
                            {"from": self.settings.consumer},
                            maxlen=1,
                            approximate=False,
                        )
                    except redis.exceptions.RedisError as exc:
                        log.warning("read_not_ended", error=str(exc), shard=shard.label)
                        break
                    with anyio.move_on_after(READ_END_WAIT_S):
                        await shard.read_ahead_done.wait()

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
        await self._ensure_wake_group(keys)
        shard.group_ready = True
        if all(s.group_ready for s in self.shards):
            self.ready = True

    async def _ensure_wake_group(self, keys: Keys) -> None:
        try:
            await self.raw.xgroup_create(keys.wake, WAKE_GROUP, id="$", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @staticmethod
    def _give_slots(shard: Shard, n: int) -> None:
        shard.slots.release(n)

    def _token_base(self) -> str:
        """Unique per script call: the scripts number the tokens they hand out after it."""
        self._token_counter += 1
        return f"{self._token_nonce}:{self._token_counter}"

    def _take_free_slots(self, shard: Shard) -> int:
        return shard.slots.take(shard.slots.free)

    def _intake_call(
        self, shard: Shard, count: int, claim_idle_ms: int = 0
    ) -> tuple[list[str], list[Any]]:
        """The intake script's keys and arguments (lua/intake-5.lua)."""
        k, s = shard.keys, self.settings
        return [k.stream, k.ready, k.session_prefix, k.dlq, k.replies], [
            k.group,
            s.consumer,
            min(count, INTAKE_BATCH),
            self._token_base(),
            s.lock_ttl_ms,
            s.dedupe_ttl_s,
            s.max_message_bytes,
            MAX_EXTRA_FIELDS,
            s.reply_maxlen,
            __version__,
            claim_idle_ms,
            s.fallback_reply,
            k.shard,
            len(self.shards),
            s.multitask,
            s.echo_fields,
        ]

    async def _intake(self, shard: Shard, count: int, claim_idle_ms: int = 0) -> list[Any]:
        keys, args = self._intake_call(shard, count, claim_idle_ms)
        # Shielded: entries the script delivered are ours (locked or queued), so the reply
        # must be seen and its jobs started, whatever is cancelled meanwhile.
        with anyio.CancelScope(shield=True):
            reply = await self.scripts.intake(keys=keys, args=args)
        return cast(list[Any], reply)

    async def _read_once(self, shard: Shard, work: anyio.abc.TaskGroup) -> float:
        if not shard.group_ready:
            await self._ensure_group(shard)
        if shard.slots.free == 0 and shard.lease_until:
            await self._hand_over(shard)  # busy: another worker waits for new entries
        await shard.slots.acquire()
        slots = 1 + self._take_free_slots(shard)
        # Short of slots under a backlog, a call still reads a batch: later messages of the
        # sessions in flight get their seq (their commits hand them on), and the sessions it
        # locks beyond the slots wait here for one (_start), rather than one entry per call.
        # Not again while any of those still waits: at most one batch is held that way.
        entries = slots if shard.locked_waiting else max(slots, READ_BATCH_SHORT_OF_SLOTS)
        try:
            reply = await self._intake(shard, entries)
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
        last_id, read = reply[0], int(reply[1])
        self._start(shard, work, reply, slots)
        if read < min(entries, INTAKE_BATCH):
            # The stream had no more: wait (a blocking read from the last id returns at once
            # if something came meanwhile) rather than run another intake call to find out.
            await self._commits_first(read)
            await self._idle_wait(shard, last_id, work)
        return 0

    @staticmethod
    async def _commits_first(started: int) -> None:
        """After an intake call that started sessions, before the reader's next call: the
        sessions go first. In one turn of the event loop each runs its step (one that awaits
        nothing, as the built-in engine's) up to its commit, in the next the committer sends
        it. A lone message's commit then leaves before this reader's next call, not behind
        it."""
        if started:
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()

    async def _idle_wait(
        self, shard: Shard, last_id: bytes, work: anyio.abc.TaskGroup | None = None
    ) -> None:
        """Nothing to read: wait until there is. One reader per shard, the waiter (the holder
        of a short lease on the shard's waiter key), blocks on the inbound stream itself, so
        an append wakes one worker, not every replica. The other readers block on the shard's
        wake stream in a consumer group: Redis hands each entry appended there to exactly one
        of them. The waiter keeps its role while it has nothing in flight (a lone message costs
        no hand-over); woken while busy, it hands the role on (deletes the key, appends to the
        wake stream) before it reads, so one more worker joins. A worker that finished a
        message within ACTIVE_WINDOW_S blocks on the stream too, waiter or not: under steady
        traffic the active workers read in parallel, as many as the rate keeps busy, and an
        idle pool is back to one blocked reader within that window. A waiter that dies leaves the
        key to expire (the lease); the others ask for it that often. A wait that times out
        waits again without an intake call (the waiter runs one every IDLE_RECHECK_S). It
        returns once another loop's Redis failure asked for a fresh group check.
        With `work` and two free slots or more, a read on the inbound stream carries its
        intake call behind it (see _read_ahead)."""
        keys = shard.keys
        block = self.settings.read_block_ms
        since = time.monotonic()
        while True:
            if not shard.group_ready:
                # Another loop met a Redis failure: the group check is the reader's to make
                # (_read_once), and the resumer and the timers wait for it.
                return
            waiter = await self._take_waiter_role(shard)
            if waiter or time.monotonic() - self._last_finished < ACTIVE_WINDOW_S:
                if work is not None and self._can_read_ahead(shard):
                    next_id = await self._read_ahead(shard, work, last_id, waiter)
                    if next_id is None:
                        return
                    last_id = next_id
                    continue
                # From the last delivered id, not "$": an entry appended between the empty
                # intake and this call would be missed until the next timeout.
                got = await self.raw.xread({keys.stream: last_id}, count=1, block=block)
                if not got:
                    if time.monotonic() - since >= IDLE_RECHECK_S:
                        return
                    continue
                if waiter and self.leases:
                    await self._hand_over(shard)
                return
            try:
                woken = await self.raw.xreadgroup(
                    WAKE_GROUP,
                    self.settings.consumer,
                    {keys.wake: ">"},
                    count=1,
                    block=self._wake_block_ms(),
                    noack=True,
                )
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self._ensure_wake_group(keys)
                continue
            if woken:
                # The waiter was busy when entries came: read now, then ask for the role.
                shard.lease_checked_at = 0.0
                return

    def _can_read_ahead(self, shard: Shard) -> bool:
        # One slot stays free for the resumer (a due session is not kept waiting by a read
        # that blocks); the Cluster client sends a pipeline its own way: it reads, then calls.
        return (
            shard.slots.free >= 2
            and not isinstance(self.raw, RedisCluster)
            and not self.stopping.is_set()  # a stopping reader's read may be cancelled
        )

    async def _read_ahead(
        self, shard: Shard, work: anyio.abc.TaskGroup, last_id: bytes, waiter: bool
    ) -> bytes | None:
        """A blocking read on the inbound stream with the intake call queued behind it on the
        same connection, in one write: Redis runs the intake the moment the read returns, an
        entry's arrival or the read's timeout, with no round trip back to this process in
        between: a lone message costs the woken worker two round trips, not three, and loses
        the Python between the read and the call. The intake reads as many entries as the
        free slots less the one left for the resumer, which are taken until it answers. Each
        read that times out runs its intake call (an idle pool's price: 15 commands with
        those the script runs, per DIALOG_READ_BLOCK_MS).

        Returns the id to wait from next, or None when the plain intake call should follow:
        the intake filled every slot it had (more may be waiting), or it failed (the plain
        call meets the same error and handles it: NOSCRIPT, NOGROUP, out of memory).
        Shielded, as every intake call: the read also watches the shard's wake stream (from
        its end), where shutdown appends one entry to end it at once (_end_reads_ahead)."""
        count = shard.slots.take(min(shard.slots.free - 1, INTAKE_BATCH))
        k = shard.keys
        keys, args = self._intake_call(shard, count)
        done = shard.read_ahead_done = anyio.Event()
        try:
            with anyio.CancelScope(shield=True):
                async with self.raw.pipeline(transaction=False) as pipe:
                    pipe.xread(
                        {k.stream: last_id, k.wake: "$"}, count=1, block=self.settings.read_block_ms
                    )
                    pipe.evalsha(self.scripts.intake.sha, len(keys), *keys, *args)
                    _, reply = await pipe.execute(raise_on_error=False)
        except BaseException:
            self._give_slots(shard, count)
            raise
        finally:
            done.set()
        if isinstance(reply, Exception):
            self._give_slots(shard, count)
            return None
        busy = bool(self.leases)
        self._start(shard, work, reply, count)
        read = int(reply[1])
        await self._commits_first(read)
        if read and waiter and busy:
            await self._hand_over(shard)  # woken while busy: one more worker joins
        return None if read >= count else cast(bytes, reply[0])

    def _lease_ms(self) -> int:
        # At least three blocking reads long: a lease renewed with half of it left outlasts
        # the read that follows.
        return max(WAITER_LEASE_MS, 3 * self.settings.read_block_ms)

    def _wake_block_ms(self) -> int:
        # A reader on the wake stream asks for the waiter role once a lease: blocking that
        # long in between (not one read_block_ms) costs one read per check, not three.
        return max(self.settings.read_block_ms, min(self._lease_ms(), WAKE_BLOCK_MAX_MS))

    async def _take_waiter_role(self, shard: Shard) -> bool:
        now = time.monotonic()
        lease_s = self._lease_ms() / 1000
        if shard.lease_until - now > lease_s / 2:
            return True
        if not shard.lease_until and now - shard.lease_checked_at < lease_s:
            return False  # another worker waits; it hands over through the wake stream
        shard.lease_checked_at = now
        me = self.settings.consumer.encode()
        holder = await self.raw.set(shard.keys.waiter, me, nx=True, px=self._lease_ms(), get=True)
        if holder == me:
            await self.raw.pexpire(shard.keys.waiter, self._lease_ms())
        elif holder is not None:
            shard.lease_until = 0.0
            # Alive until we ask again (a lease from now) and a wake-stream read after that.
            shard.waiter_seen_until = now + 2 * lease_s
            return False
        shard.lease_until = now + lease_s
        shard.waiter_seen_until = 0.0
        return True

    async def _hand_over(self, shard: Shard) -> None:
        """Give up the waiter role and wake one other reader (it takes the role if free)."""
        if not shard.lease_until:
            return
        shard.lease_until = 0.0
        shard.lease_checked_at = time.monotonic()
        async with self.raw.pipeline(transaction=False) as pipe:
            pipe.delete(shard.keys.waiter)
            pipe.xadd(
                shard.keys.wake, {"from": self.settings.consumer}, maxlen=1, approximate=False
            )
            await pipe.execute()

    def _start(self, shard: Shard, work: anyio.abc.TaskGroup, reply: list[Any], slots: int) -> None:
        """One task per session whose lock the intake took; its held entries go with it.
        Synchronous: nothing may come between a script's reply and the start of its jobs."""
        _, _, rows, held_rows, counts = reply
        dups, refused, contended, trimmed, ahead, rejected = (int(c) for c in counts)
        if rejected:
            self.metrics.messages.labels("rejected").inc(rejected)
        if trimmed:
            self.metrics.inbound_trimmed.inc(trimmed)
            log.error("inbound_trimmed", count=trimmed, stream=shard.keys.stream)
        if ahead:
            self.metrics.inbound_id_ahead.inc()
            log.error("inbound_id_ahead", stream=shard.keys.stream)
        if dups:
            self.metrics.messages.labels("duplicate").inc(dups)
        if refused:
            self.metrics.messages.labels("dead_lettered").inc(refused)
            self.malformed.add(refused, shard.keys)
        if contended:
            self.metrics.lock_contended.inc(contended)
            self.metrics.retries.labels("contended").inc(contended)
        jobs = {}
        for row in rows:
            job = Job.from_script(shard.keys, row)
            jobs[job.session_id] = job
        for sid, _, entry_id, flat in held_rows:
            jobs[sid.decode("utf-8")].held[text(entry_id)] = fields_dict(flat)
        self._give_slots(shard, max(0, slots - len(jobs)))
        for n, job in enumerate(jobs.values()):
            if n < slots:
                work.start_soon(self._run_session, shard, job)
            else:
                shard.locked_waiting += 1
                work.start_soon(self._run_when_a_slot_frees, shard, job)

    async def _run_when_a_slot_frees(self, shard: Shard, job: Job) -> None:
        """A session a reader locked beyond its free slots (see _read_once): it waits for a
        slot in line with the reader, behind the resumer, its lease renewed by the heartbeat
        meanwhile; a worker that stops hands it back at once."""
        self.leases[job.token] = job
        try:
            with anyio.CancelScope() as waiting:
                self._waiting_for_slots[job.token] = waiting
                if self.stopping.is_set():
                    waiting.cancel()
                await shard.slots.acquire()
        finally:
            shard.locked_waiting -= 1
            self._waiting_for_slots.pop(job.token, None)
            if self.leases.get(job.token) is job:
                del self.leases[job.token]
        if waiting.cancel_called:
            with anyio.CancelScope(shield=True):
                async with self._hand_backs:
                    try:
                        await self.pipeline.hand_back(job)
                    except redis.exceptions.RedisError as exc:
                        # Its lease runs out and the session comes back through the ready set.
                        log.warning("hand_back_failed", session_id=job.session_id, error=str(exc))
            return
        if not job.ending:
            # Cancelled while it waited: it ends in its turn without a step, as a message that
            # waited in the stream or behind its session's running one would (the commit
            # script checks the mark as well: a failed look costs a started step, no outcome).
            msg_id = text(job.fields.get(b"msg_id", job.entry_id.encode()))
            mark = job.keys.session(job.session_id).cancel_mark(msg_id)
            try:
                if await self.raw.exists(mark):
                    job.ending = "cancelled"
            except redis.exceptions.RedisError as exc:
                log.warning("cancel_check_failed", session_id=job.session_id, error=str(exc))
        await self._run_session(shard, job)

    async def _run_session(self, shard: Shard, job: Job) -> None:
        self._sessions_started += 1
        self.metrics.in_flight.inc()
        try:
            await self.pipeline.run_session(job, partial(self._take_turns, shard))
        finally:
            self.metrics.in_flight.dec()
            self._give_slots(shard, 1)
            self._last_finished = time.monotonic()

    async def _take_turns(self, shard: Shard, took_s: float) -> None:
        await take_turns(shard.slots, took_s, stopping=self.pipeline.stopping)

    async def _resume_once(self, shard: Shard, work: anyio.abc.TaskGroup) -> float:
        """Take up due sessions of the ready set, as many as there are free slots. Waits for
        one slot first, ahead of the reader (see SlotGate): a due session is taken up within
        one poll interval plus the time until the next slot frees up, whatever the backlog."""
        if not shard.group_ready:
            return self.settings.promote_interval_ms / 1000
        if not await self.raw.zrange(shard.keys.ready, 0, 0):
            return RESUME_IDLE_S  # one cheap look instead of a script call while idle
        await shard.slots.acquire(priority=True)
        slots = 1 + self._take_free_slots(shard)
        k, s = shard.keys, self.settings
        try:
            with anyio.CancelScope(shield=True):
                rows, wait_ms = await self.scripts.resume(
                    keys=[k.stream, k.ready, k.session_prefix],
                    args=[
                        min(slots, INTAKE_BATCH),
                        self._token_base(),
                        s.lock_ttl_ms,
                        int(s.gap_timeout_s * 1000),
                    ],
                )
                jobs = [Job.from_script(k, row[1:], gap=row[0] == b"g") for row in rows]
        except BaseException:
            self._give_slots(shard, slots)
            raise
        self._give_slots(shard, slots - len(jobs))
        for job in jobs:
            # Taken over from a holder whose lease ran out: an earlier delivery was counted
            # (attempts > 1) and neither committed nor released with an error. A hand-back at
            # shutdown gives its attempt back or records why it kept it, and a failed attempt
            # records its error, so none counts; nor does a session resumed only because its
            # next entry was missing at hand-off time.
            if not job.gap and job.attempts > 1 and not job.last_error:
                self.metrics.reclaimed.inc()
            work.start_soon(self._run_session, shard, job)
        if jobs and len(jobs) == slots:
            return 0
        if int(wait_ms) < 0:
            return RESUME_IDLE_S
        return min(s.promote_interval_ms, max(int(wait_ms), 5)) / 1000

    async def _fire_once(self, shard: Shard) -> float:
        """Append the shard's due timers to its inbound stream (lua/fire-3.lua: each timer
        exactly once, whichever workers call it). Upkeep (Shard.does_upkeep): the waiter, or
        every worker that knows of none, looks every `TIMER_POLL_S`; a timer is appended at
        most about that long after it is due (about 2 waiter leases if the waiter dies), then
        sequenced like any message (the reader wakes for it like for any append)."""
        if not shard.group_ready or not shard.does_upkeep():
            return TIMER_POLL_S
        k = shard.keys
        first = await self.raw.zrange(k.timers, 0, 0, withscores=True)
        if not first or float(first[0][1]) > time.time() * 1000 + TIMER_POLL_S * 1000:
            return TIMER_POLL_S  # one cheap look instead of a script call
        with anyio.CancelScope(shield=True):
            fired, wait_ms = await self.scripts.fire(
                keys=[k.stream, k.ready, k.session_prefix], args=[INTAKE_BATCH]
            )
        if int(fired):
            log.info("timers_fired", shard=shard.label, fired=int(fired))
        if int(fired) == INTAKE_BATCH:
            return 0
        if int(wait_ms) < 0:
            return TIMER_POLL_S
        return min(TIMER_POLL_S, max(int(wait_ms), 5) / 1000)

    async def _reclaim_once(self, shard: Shard, work: anyio.abc.TaskGroup) -> float:
        """Entries pending in the group past the visibility timeout. The intake acks what it
        delivers in the same step, so only something else leaves entries pending (another
        reader of the group, an older version): they are sequenced like new ones. Upkeep
        (Shard.does_upkeep): run by the waiter, or by every worker that knows of none."""
        if not shard.group_ready or not shard.does_upkeep():
            return self.settings.reclaim_interval_ms / 1000
        consumers = await self.redis.xinfo_consumers(shard.keys.stream, shard.keys.group)
        slots = self._take_free_slots(shard) if any(int(c["pending"]) for c in consumers) else 0
        if slots:
            try:
                reply = await self._intake(shard, slots, self.settings.visibility_timeout_ms)
            except BaseException:
                self._give_slots(shard, slots)
                raise
            if int(reply[1]):
                self.metrics.reclaimed.inc(int(reply[1]))
                log.info("reclaimed", count=int(reply[1]), shard=shard.keys.shard)
            self._start(shard, work, reply, slots)
        await self._delete_idle_consumers(shard.keys, consumers)
        return self.settings.reclaim_interval_ms / 1000

    async def _delete_idle_consumers(self, keys: Keys, consumers: list[Any]) -> None:
        idle_ms = self.settings.consumer_idle_delete_s * 1000
        for consumer in consumers:
            name = consumer["name"]
            if (
                name != self.settings.consumer
                and int(consumer["pending"]) == 0
                and int(consumer["idle"]) >= idle_ms
            ):
                deleted = await self.housekeeping.delconsumer(
                    keys=[keys.stream], args=[keys.group, name, idle_ms]
                )
                if int(deleted):
                    log.info("consumer_deleted", deleted_consumer=name, shard=keys.shard)

    # ------------------------------------------------------------------------------------
    # side loops

    async def _heartbeat_once(self) -> float:
        """Renew the leases of steps still running, one call per shard."""
        ttl = self.settings.lock_ttl_ms
        due = time.monotonic() - ttl / 3000
        by_shard: dict[int, list[Job]] = {}
        for job in self.leases.values():
            if job.renewed_at < due and not job.lost:
                by_shard.setdefault(job.keys.shard, []).append(job)
        for jobs in by_shard.values():
            keys = jobs[0].keys
            args: list[Any] = [ttl]
            for job in jobs:
                args += [job.token, job.session_id]
            results = await self.scripts.renew(keys=[keys.ready, keys.session_prefix], args=args)
            now = time.monotonic()
            for job, ok in zip(jobs, results, strict=True):
                if int(ok):
                    job.renewed_at = now
                    self.metrics.lease_renewals.inc()
                else:
                    job.lost = True
                    if job.scope is not None:
                        job.scope.cancel()
                    log.warning("lease_lost", session_id=job.session_id, seq=job.seq)
        return ttl / 4000

    async def _watch_loop_lag(self) -> None:
        """The event loop must never be blocked for long (plain engine steps run in threads):
        measure how late a short timer fires."""
        interval = 0.1
        while True:
            started = time.perf_counter()
            await anyio.sleep(interval)
            self.metrics.loop_lag.observe(max(0.0, time.perf_counter() - started - interval))

    async def _sample_once(self) -> float:
        """The queue gauges. An idle worker (its last sample saw nothing unread, waiting,
        delayed or pending, and it has started no message since) samples every
        IDLE_SAMPLE_EVERY intervals: an idle pool costs Redis little."""
        interval = self.settings.metrics_sample_interval_s
        if (
            self._sampled_empty
            and self._sessions_started == self._sampled_at_sessions
            and self._samples_skipped < IDLE_SAMPLE_EVERY - 1
        ):
            self._samples_skipped += 1
            return interval
        self._samples_skipped = 0
        self._sampled_at_sessions = self._sessions_started
        empty = True
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
            empty = empty and not (
                stats["stream_length"] or stats["pending"] or stats["delayed"] or stats["waiting"]
            )
            if self.settings.reply_maxlen:
                for group, lag in (await reply_group_lags(self.redis, shard.keys)).items():
                    m.reply_group_lag.labels(label, group).set(lag / self.settings.reply_maxlen)
        self._sampled_empty = empty
        return interval


def run_worker(settings: Settings, engine: Engine, **kwargs: Any) -> None:
    """Run a worker until it is told to stop, on uvloop where available."""
    backend_options: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401

        backend_options["use_uvloop"] = True
    except ImportError:
        pass
    worker = Worker(settings, engine, freeze_startup=True, **kwargs)
    anyio.run(worker.run, backend_options=backend_options)
