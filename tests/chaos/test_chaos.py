"""Chaos: three real workers and a real redis-server (AOF, `appendfsync always`) under bursts
of plain XADDs over 300 sessions, while a driver injects a random fault every 0.5-2 s:

    kill -9 of a worker (a new one starts), SIGSTOP of a worker past its lease then SIGCONT,
    SIGTERM of a worker (it must exit 0; a new one starts), kill -9 of redis-server (restarted
    on the same port from its AOF).

Senders append with explicit msg_ids and retry a failed XADD with the same msg_id until it is
acknowledged, so a retry whose first try did land leaves two entries for one message (the
workers answer the second one `duplicate`); one message in a hundred is also sent twice on
purpose, as by a producer that missed the reply. A few messages are poison (the fault engine raises
on "boom ..." every time): they must be dead-lettered after DIALOG_MAX_ATTEMPTS, and their
sessions go on.

Hostile producers too: one more sender appends to its own 30 sessions with `XADD MAXLEN ~ 8`
(the server keeps 8 entries per stream node, so `~` does trim whenever the unread backlog
grows), which removes unread entries of everyone, and once during the run someone XDELs an
acknowledged entry of the main workload (by then sequenced: nothing happens) and appends and
deletes one entry in the same transaction (an unread deletion for certain). Custody means a
sequenced message is never touched by either; the unread entries they remove are lost, and
each one must be counted by the workers (the inbound hash's `trimmed`).

Half-way through the fault phase Redis runs out of memory for 4 s (longer than a lease):
maxmemory is set 1 MB below what it uses, so it refuses every write that needs memory while
the load goes on (senders retry a refused XADD with the same msg_id, as after an outage), then
the limit is lifted. The workers must count the refusals (dialog_redis_oom_total) and back off:
nothing of it may be dead-lettered, lost, applied twice or out of order.

After a bounded fault phase the faults stop, the queue drains (deadline poll), and a checker in
the style of Jepsen's total-queue checker reads every session's state history, the whole reply
stream and the DLQ:
- lost: an acknowledged send that was neither applied nor dead-lettered, beyond the entries
  the workers counted as trimmed (each entry either has exactly one reply event or was
  trimmed unread, and the trimmed ones are exactly the count);
- applied twice: a msg_id finished (applied or dead-lettered) more than once, or twice in a
  history;
- out of order: a session's history not in send order, or its seqs not 1, 2, 3...;
- every acknowledged entry has exactly one reply event; every duplicate event answers a
  msg_id that was finished, with that finish's seq; only poison messages are dead-lettered.
With `appendfsync always` Redis acknowledges a write only once it is on disk, so a kill -9
should lose nothing acknowledged. The check still compares Redis' own count of appends
(`entries-added`) with the acknowledged XADDs and reports a shortfall as `lost_by_redis`,
apart from what the workers lost: "lost" must be 0 without any allowance. (One 120 s run in
four saw Redis 7.0 count 973 fewer appends than it had acknowledged, and exactly those entries
were gone: no worker can see, count or restore what Redis itself forgets.)

A second test, where redis-sentinel is installed, does the same on a Sentinel deployment (one
master, one replica, three Sentinels) with worker faults and a kill -9 of the master mid-burst,
the replica lagging behind: there Redis does lose acknowledged writes, and the check counts
them apart from what the workers lost (which must be 0).

The workload and the fault schedule come from one seed (printed; set CHAOS_SEED to replay a
run); CHAOS_FAULT_PHASE_S sets the fault phase (default 90 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions
from redis_server import RedisServer
from redis_server import wait_until_async as poll
from worker_procs import WorkerPool, WorkerProc

from dialog_worker.config import load_settings
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.chaos

SEED = int(os.environ.get("CHAOS_SEED", "20240917"))
FAULT_PHASE_S = float(os.environ.get("CHAOS_FAULT_PHASE_S", "90"))
SESSIONS = 300
WORKERS = 3
LOCK_TTL_MS = 1000
MAX_ATTEMPTS = 6  # a kill or a lost lease counts as a delivery: room for a few per message
POISON_MESSAGES = 8
RESEND_RATE = 0.01  # messages sent twice on purpose (besides the retries of failed XADDs)
DRAIN_TIMEOUT_S = 120
OOM_HOLD_S = 4.0  # out of memory for longer than a lease (LOCK_TTL_MS)
OOM_MARGIN = 1024 * 1024  # maxmemory this far below used_memory: freeing a little is not room

WORKER_ENV = {
    "DIALOG_ENGINE": "fault_engine:make",
    "DIALOG_LOCK_TTL_MS": str(LOCK_TTL_MS),
    "DIALOG_VISIBILITY_TIMEOUT_MS": "2000",
    "DIALOG_RECLAIM_INTERVAL_MS": "200",
    "DIALOG_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    "DIALOG_BACKOFF_BASE_MS": "20",
    "DIALOG_BACKOFF_MAX_MS": "200",
    "DIALOG_GAP_TIMEOUT_S": "5",  # a lost entry would show up as a gap within the drain
    "DIALOG_HISTORY_LIMIT": "100000",  # the checker reads the whole history
    "DIALOG_REPLY_MAXLEN": "0",  # and every reply event
    "DIALOG_SHUTDOWN_GRACE_S": "3",
}
FAULTS = ("kill9_worker", "sigstop_worker", "sigterm_worker", "kill9_redis")


@dataclass
class Message:
    session_id: str
    index: int  # its place in the session's send order (1, 2, 3...)
    msg_id: str
    poison: bool
    entry_ids: list[str] = field(default_factory=list)  # every acknowledged XADD
    failed_xadds: int = 0  # tries that raised (the entry may or may not exist)
    refused_xadds: int = 0  # tries Redis refused whole (out of memory, read-only replica)


@dataclass
class Workload:
    """The senders: bursts to random sessions; a session's messages go out one by one. With
    `maxlen`, every XADD trims the stream (MAXLEN ~), as a producer copying a common idiom."""

    r: redis.asyncio.Redis
    stream: str
    rng: random.Random
    prefix: str = "c"
    sessions: int = SESSIONS
    maxlen: int | None = None
    messages: dict[str, Message] = field(default_factory=dict)
    sent_per_session: Counter[str] = field(default_factory=Counter)
    poison_left: int = POISON_MESSAGES
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    busy: set[str] = field(default_factory=set)

    async def run(self) -> None:
        sessions = [f"{self.prefix}{i}" for i in range(self.sessions)]
        async with asyncio.TaskGroup() as tg:
            while not self.stop.is_set():
                burst = min(len(sessions), self.rng.randint(30, 120))
                for sid in self.rng.sample(sessions, burst):
                    if sid not in self.busy:
                        self.busy.add(sid)
                        tg.create_task(self._burst(sid, self.rng.randint(1, 3)))
                # Pacing of the load, not a wait for an event: bursts every 0.3-1.2 s.
                await asyncio.sleep(self.rng.uniform(0.3, 1.2))

    async def _burst(self, sid: str, n: int) -> None:
        try:
            for _ in range(n):
                self.sent_per_session[sid] += 1
                index = self.sent_per_session[sid]
                poison = self.maxlen is None and self.poison_left > 0 and self.rng.random() < 0.002
                self.poison_left -= poison
                m = Message(sid, index, f"{sid}-m{index}", poison)
                self.messages[m.msg_id] = m
                await self._send(m)
                if self.rng.random() < RESEND_RATE:
                    await self._send(m)  # a producer that missed the reply sends it again
        finally:
            self.busy.discard(sid)

    async def _send(self, m: Message) -> None:
        text = f"boom {m.msg_id}" if m.poison else f"pesan {m.index}"
        fields = {"session_id": m.session_id, "text": text, "msg_id": m.msg_id}
        while True:
            try:
                entry_id = await self.r.xadd(
                    self.stream,
                    fields,  # type: ignore[arg-type]
                    maxlen=self.maxlen,
                    approximate=True,
                )
                m.entry_ids.append(entry_id.decode())
                return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                m.failed_xadds += 1
                await asyncio.sleep(0.05)  # retry pacing while Redis is down; same msg_id
            except (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError):
                # Refused whole, nothing appended: a producer retries it like an outage.
                m.refused_xadds += 1
                await asyncio.sleep(0.05)


@dataclass
class Chaos:
    """The fault driver."""

    server: RedisServer | None  # None: Redis is not this driver's to kill
    pool: WorkerPool
    rng: random.Random
    live: list[WorkerProc]
    faults: tuple[str, ...] = FAULTS
    injected: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    xdel_results: list[int] = field(default_factory=list)

    async def run(self, until: float) -> None:
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))  # pacing of the faults
            kind = self.rng.choice(self.faults)
            await getattr(self, kind)()
            self.injected[kind] += 1

    async def kill9_worker(self) -> None:
        victim = self.rng.choice(self.live)
        await asyncio.to_thread(victim.kill)
        await self._replace(victim)

    async def sigstop_worker(self) -> None:
        victim = self.rng.choice(self.live)
        victim.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(LOCK_TTL_MS * 1.5 / 1000)  # the fault: paused past its lease
        finally:
            victim.signal(signal.SIGCONT)

    async def sigterm_worker(self) -> None:
        victim = self.rng.choice(self.live)
        code = await asyncio.to_thread(victim.terminate, 30)
        if code != 0:
            self.problems.append(f"{victim.name} exited {code} on SIGTERM")
        await self._replace(victim)

    async def hostile_xdel(self, load: Workload, trimmer: Workload) -> None:
        """Once: XDEL of an acknowledged entry of the main workload (read by now: custody makes
        it a no-op), then an append and its deletion in one transaction (unread for certain)."""
        sent = [e for m in load.messages.values() for e in m.entry_ids]
        if sent:
            self.xdel_results.append(int(await load.r.xdel(load.stream, self.rng.choice(sent))))
        m = Message("t-hostile", 1, "t-hostile-m1", False)
        trimmer.messages[m.msg_id] = m
        fields = ["session_id", m.session_id, "text", "pesan 1", "msg_id", m.msg_id]
        # One atomic step, so no worker reads it in between.
        append_and_delete = (
            "local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV)) "
            "redis.call('XDEL', KEYS[1], id) return id"
        )
        while True:
            try:
                entry_id = await load.r.eval(append_and_delete, 1, load.stream, *fields)
            except (
                redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError,
                redis.exceptions.OutOfMemoryError,
            ):
                await asyncio.sleep(0.05)  # Redis is down or full (a fault): try again
                continue
            m.entry_ids.append(entry_id.decode())
            return

    async def kill9_redis(self) -> None:
        server = self.server
        assert server is not None
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(self.rng.uniform(0.1, 1.0))  # the fault: Redis stays down a while
        await asyncio.to_thread(server.start)

    async def out_of_memory(self, replies: str, hold_s: float) -> dict[str, int]:
        """Redis out of memory for `hold_s` (longer than a lease): maxmemory set below what it
        uses, so every write that needs memory is refused (noeviction) while the load goes on;
        then no limit again. No other fault meanwhile (a restart would lift the limit).
        Returns the refusals the workers counted (dialog_redis_oom_total) and how much was
        applied while Redis refused."""
        assert self.server is not None
        # Its own connection: one opened before a kill -9 of Redis would be found closed.
        r = redis.asyncio.Redis.from_url(self.server.url, decode_responses=True)
        before = await asyncio.to_thread(scrape_sum, self.live, "dialog_redis_oom_total")
        replies_before = await r.xlen(replies)
        used = int((await r.info("memory"))["used_memory"])
        limit = max(1, used - OOM_MARGIN)
        await r.config_set("maxmemory", limit)
        try:
            # The probe: a write needing memory is refused (else the phase proves nothing).
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                await r.set("chaos:oom-probe", "x")
            await asyncio.sleep(hold_s)  # the fault's length; the load keeps sending
            applied_meanwhile = await r.xlen(replies) - replies_before
            oom_active = await asyncio.to_thread(scrape_sum, self.live, "dialog_redis_oom_backoff")
        finally:
            await r.config_set("maxmemory", 0)
            await r.aclose()
        after = await asyncio.to_thread(scrape_sum, self.live, "dialog_redis_oom_total")
        self.injected["out_of_memory"] += 1
        return {
            "maxmemory": limit,
            "used_memory": used,
            "refused_by_workers": int(after - before),
            "workers_backing_off": int(oom_active),
            "reply_events_meanwhile": applied_meanwhile,
        }

    async def _replace(self, victim: WorkerProc) -> None:
        self.live.remove(victim)
        # Started means serving /healthz: a SIGTERM that lands while the interpreter is still
        # importing (before any handler exists) kills it by signal, holding nothing.
        self.live += await asyncio.to_thread(lambda: self.pool.start(1, metrics=True))


def scrape_sum(procs: list[WorkerProc], name: str) -> float:
    """The sum of a metric's samples over the running workers' /metrics."""
    total = 0.0
    for w in procs:
        if not w.alive():
            continue
        for line in w.metrics_text().splitlines():
            head, _, value = line.rpartition(" ")
            if not line.startswith("#") and head.split("{", 1)[0] == name:
                total += float(value)
    return total


# ---------------------------------------------------------------------------------------------
# the checker


async def read_all(r: redis.asyncio.Redis, stream: str) -> list[dict[str, str]]:
    entries: list[dict[str, str]] = []
    start = "-"
    while True:
        page = await r.xrange(stream, min=start, count=5000)
        entries += [f for _, f in page]
        if len(page) < 5000:
            return entries
        start = f"({page[-1][0]}"


async def leftovers(r: redis.asyncio.Redis, keys: Keys) -> dict[str, int]:
    """What is not finished. Not the group's lag: an empty stream has nothing undelivered, and
    after kill -9 restarts Redis 7.0 can report a lag of thousands for it (printed below)."""
    groups = await r.xinfo_groups(keys.stream)
    locks = [k async for k in r.scan_iter(match=f"{keys.prefix}:*:lock", count=1000)]
    return {
        "stream": await r.xlen(keys.stream),
        "pending": sum(int(g["pending"]) for g in groups),
        "ready": await r.zcard(keys.ready),
        "locks": len(locks),
    }


def sent_entries(m: Message) -> set[tuple[str, str]]:
    """(entry id, msg_id): after a failover the new master can give a new entry the id of one
    the old master had and lost."""
    return {(e, m.msg_id) for e in m.entry_ids}


async def check(
    r: redis.asyncio.Redis, keys: Keys, messages: dict[str, Message]
) -> tuple[dict[str, int], list[str]]:
    """Jepsen-style total-queue check: returns counts and the problems found. An entry with no
    reply event was trimmed unread (custody: nothing else can make one vanish) or lost by Redis
    itself (its own count of appends falls short by as many); the workers' count of trimmed
    entries must match the trimmed ones (plus, at most, the entries of XADDs that raised but
    landed, whose ids nobody knows)."""
    problems: list[str] = []
    events = await read_all(r, keys.replies)
    letters = await read_all(r, keys.dlq)
    finished: dict[str, list[dict[str, str]]] = defaultdict(list)  # applied or dead-lettered
    duplicates: dict[str, list[dict[str, str]]] = defaultdict(list)
    per_entry = Counter((e["entry_id"], e["msg_id"]) for e in events)
    for e in events:
        if e["msg_id"] not in messages:
            problems.append(f"an event for a msg_id nobody sent: {e}")
        elif e["outcome"] == "duplicate":
            duplicates[e["msg_id"]].append(e)
        else:
            finished[e["msg_id"]].append(e)
    lettered = Counter(f.get("msg_id", "") for f in letters)

    vanished = {e for m in messages.values() for e in sent_entries(m) if per_entry[e] == 0}
    trimmed = int(await r.hget(keys.inbound, "trimmed") or 0)
    failed = sum(m.failed_xadds for m in messages.values())
    # Redis' own count of appends against the XADDs it acknowledged: fewer means Redis itself
    # lost acknowledged entries (its counter went back with them, so no worker can see them
    # as trimmed). That is Redis' loss, counted apart from the workers' (which must be 0).
    acked = sum(len(m.entry_ids) for m in messages.values())
    added = int((await r.xinfo_stream(keys.stream))["entries-added"])
    redis_lost = max(0, acked - added)
    if not len(vanished) - redis_lost <= trimmed <= len(vanished) + failed:
        problems.append(
            f"{trimmed} entries counted as trimmed, {len(vanished)} vanished (and {failed} "
            f"XADDs raised); Redis counts {added} appends for {acked} acknowledged XADDs"
        )
    lost = [
        m
        for m in messages.values()
        if m.entry_ids and not finished[m.msg_id] and not sent_entries(m) <= vanished
    ]
    twice = [k for k, v in finished.items() if len(v) > 1]
    dead = [k for k, v in finished.items() if v and v[0]["outcome"] == "dead_lettered"]
    problems += [f"lost: {m.msg_id} (entries {m.entry_ids})" for m in lost[:10]]
    problems += [f"finished twice: {k}: {finished[k]}" for k in twice[:10]]
    for k in dead:
        if not messages[k].poison:
            problems.append(f"dead-lettered though not poison: {k}: {finished[k]}")
        if lettered[k] != 1:
            problems.append(f"{k}: {lettered[k]} dead letters")
    for m in messages.values():
        if (
            m.poison
            and m.entry_ids
            and not sent_entries(m) <= vanished
            and [e["outcome"] for e in finished[m.msg_id]] != ["dead_lettered"]
        ):
            problems.append(f"poison {m.msg_id} ended {finished[m.msg_id]}")
        for entry in sent_entries(m):
            if per_entry[entry] != 1 and entry not in vanished:
                problems.append(f"{m.msg_id}: entry {entry[0]} has {per_entry[entry]} events")
        for d in duplicates[m.msg_id]:
            if not finished[m.msg_id] or d["seq"] != finished[m.msg_id][0]["seq"]:
                problems.append(f"duplicate {d} of {m.msg_id} finished as {finished[m.msg_id]}")
    if sum(lettered.values()) != len(dead):
        problems.append(f"{len(letters)} dead letters for {len(dead)} dead-lettered messages")

    # Every session's history: send order, seqs 1, 2, 3..., each finished message once.
    out_of_order = 0
    by_session: dict[str, list[Message]] = defaultdict(list)
    for m in messages.values():
        by_session[m.session_id].append(m)
    for sid, sent in sorted(by_session.items()):
        raw = await r.hget(keys.session(sid).state, "d")
        history = json.loads(raw)["history"] if raw else []
        got = [t["msg_id"] for t in history]
        want = [m.msg_id for m in sorted(sent, key=lambda m: m.index) if finished[m.msg_id]]
        if got != want or [t["seq"] for t in history] != list(range(1, len(history) + 1)):
            out_of_order += 1
            problems.append(f"{sid}: history {got[:8]}... seqs {[t['seq'] for t in history][:8]}")
    counts = {
        "messages": len(messages),
        "entries": sum(len(m.entry_ids) for m in messages.values()),
        "failed_xadds": sum(m.failed_xadds for m in messages.values()),
        "refused_xadds": sum(m.refused_xadds for m in messages.values()),
        "applied": sum(1 for v in finished.values() if v and v[0]["outcome"] == "applied"),
        "dead_lettered": len(dead),
        "duplicate_events": sum(len(v) for v in duplicates.values()),
        # Poison that reached the workers: some known entry was not trimmed, or an XADD that
        # raised but landed (an entry id nobody knows) brought it in after its known ones were.
        "poison": sum(
            1
            for m in messages.values()
            if m.poison and (not sent_entries(m) <= vanished or finished[m.msg_id])
        ),
        "trimmed_entries_counted": trimmed,
        "lost_by_redis": redis_lost,
        "trimmed_messages": sum(
            1 for m in messages.values() if m.entry_ids and sent_entries(m) <= vanished
        ),
        "lost": len(lost),
        "applied_twice": len(twice),
        "out_of_order_sessions": out_of_order,
    }
    return counts, problems


# ---------------------------------------------------------------------------------------------


async def test_chaos_total_queue(tmp_path: Path) -> None:
    from conftest import worker_env  # a plain function of tests/conftest.py

    print(f"\n[chaos] seed {SEED} (CHAOS_SEED={SEED} replays this workload and fault schedule)")
    # 8 entries per stream node: the trimming producer's MAXLEN ~ 8 trims a backlog of ~16.
    server = RedisServer(
        tmp_path / "redis",
        appendonly=True,
        fsync="always",
        extra=("--stream-node-max-entries", "8"),
    ).start()
    env = worker_env(server.url, **WORKER_ENV)
    keys = Keys.from_settings(load_settings(environ=env))
    pool = WorkerPool(env, tmp_path)
    pool_args: dict[str, Any] = {"max_connections": 64, "timeout": 10}
    common: dict[str, Any] = {"socket_timeout": 5, "socket_connect_timeout": 1}
    sender_redis = redis.asyncio.Redis(
        connection_pool=redis.asyncio.BlockingConnectionPool.from_url(
            server.url, **pool_args, **common
        )
    )
    reader = redis.asyncio.Redis.from_url(server.url, decode_responses=True, **common)
    try:
        live = await asyncio.to_thread(lambda: pool.start(WORKERS, metrics=True))
        chaos = Chaos(server, pool, random.Random(SEED), live)
        load = Workload(sender_redis, keys.stream, random.Random(SEED + 1))
        trimmer = Workload(
            sender_redis, keys.stream, random.Random(SEED + 2), prefix="t", sessions=30, maxlen=8
        )
        started = time.monotonic()
        sender = asyncio.create_task(load.run())
        trimming = asyncio.create_task(trimmer.run())
        await chaos.run(until=started + FAULT_PHASE_S / 3)
        await chaos.hostile_xdel(load, trimmer)
        await chaos.run(until=started + FAULT_PHASE_S / 2)
        # Within the fault phase, not added to it: Redis out of memory, nothing else meanwhile.
        refused_before = sum(m.refused_xadds for m in load.messages.values())
        oom = await chaos.out_of_memory(keys.replies, OOM_HOLD_S)
        oom["refused_sends"] = sum(m.refused_xadds for m in load.messages.values())
        oom["refused_sends"] -= refused_before
        await chaos.run(until=started + FAULT_PHASE_S)
        load.stop.set()
        trimmer.stop.set()
        await sender
        await trimming
        faults_s = time.monotonic() - started

        last: dict[str, int] = {}

        async def drained() -> bool:
            nonlocal last
            last = await leftovers(reader, keys)
            return not any(last.values())

        problems: list[str] = []
        try:
            await poll(drained, DRAIN_TIMEOUT_S, "the queue to drain", interval_s=0.2)
        except AssertionError as exc:
            problems.append(f"{exc}: {last}")  # check what there is all the same
        drain_s = time.monotonic() - started - faults_s
        counts, found = await check(reader, keys, {**load.messages, **trimmer.messages})
        problems += found + chaos.problems
        problems += [f"{w.name} is not running" for w in chaos.live if not w.alive()]
        print(
            f"[chaos] {faults_s:.0f} s of faults: {dict(chaos.injected)}; drained "
            f"{drain_s:.1f} s later; AOF cut inside a command and repaired "
            f"{server.aof_fixes} time(s)"
        )
        print(f"[chaos] {counts}")
        print(f"[chaos] out of memory for {OOM_HOLD_S:.0f} s: {oom}")
        group = (await reader.xinfo_groups(keys.stream))[0]
        print(f"[chaos] consumer group as Redis reports it: lag {group['lag']}, entries-read "
              f"{group['entries-read']}; stream entries-added "
              f"{(await reader.xinfo_stream(keys.stream))['entries-added']}")  # fmt: skip
        assert not problems, f"{len(problems)} problems, e.g.: " + "\n".join(problems[:20])
        assert counts["lost"] == counts["applied_twice"] == counts["out_of_order_sessions"] == 0
        assert counts["dead_lettered"] == counts["poison"]
        assert chaos.xdel_results in ([0], [1])  # 0 unless that entry was still unread
        assert counts["trimmed_entries_counted"] >= 1  # the hostile append-and-delete at least
        assert set(chaos.injected) == {*FAULTS, "out_of_memory"}, chaos.injected
        # Out of memory was backpressure: the workers were refused and backed off, the senders
        # were refused and retried, and nothing came of it but delay (the checks above: nothing
        # lost, twice or out of order; only poison dead-lettered).
        assert oom["refused_by_workers"] > 0 and oom["refused_sends"] > 0, oom
    finally:
        await sender_redis.aclose()
        await reader.aclose()
        await asyncio.to_thread(pool.stop_all)
        server.stop()


# ---------------------------------------------------------------------------------------------
# Sentinel failover

WORKER_FAULTS = ("kill9_worker", "sigstop_worker", "sigterm_worker")
FAILOVER_SESSIONS = 100
FAILOVER_FAULTS_S = 10.0  # worker faults before the master's kill, and again after it
FAILOVER_DRAIN_S = 40
REPLICA_BEHIND_S = 1.3


async def tail_finishes(port: int, replies: str, stop: asyncio.Event) -> set[tuple[str, str]]:
    """The finish events (applied, dead-lettered) the master on `port` acknowledged, read as
    they come until `stop` or the master's death: (reply stream id, msg_id)."""
    r = redis.asyncio.Redis(port=port, decode_responses=True, socket_timeout=2)
    seen: set[tuple[str, str]] = set()
    last = "0-0"
    try:
        while not stop.is_set():
            for _, entries in await r.xread({replies: last}, count=500, block=50):
                for event_id, f in entries:
                    last = event_id
                    if f.get("outcome") in ("applied", "dead_lettered"):
                        seen.add((event_id, f.get("msg_id", "")))
    except (redis.exceptions.RedisError, OSError):
        pass  # the master was killed
    finally:
        await r.aclose(close_connection_pool=True)
    return seen


async def test_chaos_sentinel_failover_total_queue(tmp_path: Path) -> None:
    """1 master, 1 replica, 3 Sentinels; three workers and the senders on the redis+sentinel://
    URL. A burst with worker faults (kill -9, SIGSTOP past the lease, SIGTERM); mid-burst the
    replica falls behind (paused 1.3 s, its link cut) and the master is killed (-9), so the
    promoted replica lacks the master's last writes; more worker faults on the new master; then
    the drain and the total-queue check on the new master.

    What Redis lost is counted apart: the acknowledged sends the replica never had (no event
    ever answers them; the new master's count of appends falls short of the acknowledged XADDs
    by as many entries, and nobody trims here) and the acknowledged commits it never had
    (finish events read on the old master, missing on the new; the workers report them as
    dialog_redis_commits_lost_total, and apply those messages again). What the workers lost
    must be 0: nothing applied twice or out of order on the surviving master, nothing
    unanswered beyond what Redis lost, only poison dead-lettered."""
    if shutil.which("redis-sentinel") is None:
        pytest.skip("redis-sentinel is not installed (apt-get install redis-sentinel)")
    from conftest import worker_env  # a plain function of tests/conftest.py
    from redis_sentinel import SentinelSet

    from dialog_worker.store.connection import connect

    print(f"\n[failover] seed {SEED} (CHAOS_SEED={SEED} replays this workload and fault schedule)")
    started = time.monotonic()
    cluster = SentinelSet(tmp_path / "sentinel").start()
    env = worker_env(cluster.url, **WORKER_ENV)
    settings = load_settings(environ=env)
    keys = Keys.from_settings(settings)
    pool = WorkerPool(env, tmp_path)
    sender_redis = connect(settings, 100, decode_responses=False)
    reader = connect(settings, 4)
    try:
        live = await asyncio.to_thread(lambda: pool.start(WORKERS, metrics=True))
        chaos = Chaos(None, pool, random.Random(SEED + 3), live, faults=WORKER_FAULTS)
        load = Workload(
            sender_redis, keys.stream, random.Random(SEED + 4), sessions=FAILOVER_SESSIONS
        )
        old_port = cluster.master.port
        killed = asyncio.Event()
        tail = asyncio.create_task(tail_finishes(old_port, keys.replies, killed))
        sender = asyncio.create_task(load.run())
        await chaos.run(until=time.monotonic() + FAILOVER_FAULTS_S)

        # The replica falls behind: paused, its link cut (what it received it keeps), so the
        # master's next 0.5 s of writes never reach it; then the master is killed.
        replica = cluster.replica
        assert replica is not None and replica.proc is not None
        os.kill(replica.proc.pid, signal.SIGSTOP)
        master = redis.asyncio.Redis(port=old_port)
        await master.client_kill_filter(_type="replica")
        await master.aclose()
        # The fault: writes the replica never gets, for longer than the senders' pause between
        # bursts (at most 1.2 s), so some acknowledged sends are among them.
        await asyncio.sleep(REPLICA_BEHIND_S)
        await asyncio.to_thread(cluster.master.kill)
        killed_at = time.monotonic()
        killed.set()
        os.kill(replica.proc.pid, signal.SIGCONT)
        seen_on_old = await tail
        await poll(
            lambda: asyncio.to_thread(lambda: cluster.master_port() != old_port),
            20,
            "the Sentinels promote the replica",
        )
        promoted_s = time.monotonic() - killed_at
        # Each worker notices the new master and checks its recent commits against it.
        await poll(
            lambda: asyncio.to_thread(
                lambda: all(scrape_sum([w], "dialog_redis_switches_total") for w in chaos.live)
            ),
            20,
            "every worker notices the new master",
        )
        reported = await asyncio.to_thread(
            scrape_sum, chaos.live, "dialog_redis_commits_lost_total"
        )
        followed_s = time.monotonic() - killed_at
        await chaos.run(until=time.monotonic() + FAILOVER_FAULTS_S)
        load.stop.set()
        await sender

        last: dict[str, int] = {}

        async def drained() -> bool:
            nonlocal last
            last = await leftovers(reader, keys)
            return not any(last.values())

        problems: list[str] = []
        try:
            await poll(drained, FAILOVER_DRAIN_S, "the new master drained", interval_s=0.2)
        except AssertionError as exc:
            problems.append(f"{exc}: {last}")  # check what there is all the same
        counts, found = await check(reader, keys, load.messages)
        problems += found + chaos.problems
        problems += [f"{w.name} is not running" for w in chaos.live if not w.alive()]
        on_new = {(i, f.get("msg_id", "")) for i, f in await reader.xrange(keys.replies)}
        lost_commits = len(seen_on_old - on_new)
        redis_side = {
            # Nobody trims here: an acknowledged send with no event is Redis' loss (the check
            # holds the vanished entries to Redis' own shortfall of appends).
            "sends_lost_by_redis": counts["trimmed_messages"],
            "entries_lost_by_redis": counts["lost_by_redis"],
            # Finish events a reader saw on the old master and misses on the new: fewer than
            # were lost when the reader lagged behind at the kill.
            "commits_seen_lost": lost_commits,
            "commits_lost_reported_by_workers": int(reported),
        }
        workers_side = {k: counts[k] for k in ("lost", "applied_twice", "out_of_order_sessions")}
        print(
            f"[failover] master kill -9 after {len(seen_on_old)} finishes read on it; promoted "
            f"after {promoted_s:.1f} s, every worker on the new master after {followed_s:.1f} s; "
            f"faults {dict(chaos.injected)}; whole test {time.monotonic() - started:.0f} s"
        )
        print(f"[failover] {counts}")
        print(f"[failover] lost by Redis: {redis_side}")
        print(f"[failover] lost by the workers (must be 0): {workers_side}")
        assert not problems, f"{len(problems)} problems, e.g.: " + "\n".join(problems[:20])
        assert workers_side == {"lost": 0, "applied_twice": 0, "out_of_order_sessions": 0}
        assert counts["dead_lettered"] == counts["poison"]
        assert counts["trimmed_entries_counted"] == 0  # nobody trims here
        # The replica lagged: Redis lost acknowledged writes, and the workers reported every
        # commit of theirs it lost.
        assert redis_side["sends_lost_by_redis"] + lost_commits > 0, redis_side
        assert reported >= lost_commits, redis_side
    finally:
        await sender_redis.aclose()
        await reader.aclose()
        await asyncio.to_thread(pool.stop_all)
        cluster.stop()
