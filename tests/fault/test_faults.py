"""Fault injection with real processes: kill -9 of workers, a paused lock holder, kill -9 of
Redis itself, SIGTERM in the middle of a burst. Every test asserts the outcome from Redis:
exactly once, in order, one reply each (dialog_worker.ops.verify.check), and a drained deployment
(tests/support/queue_checks.py: inbound stream, pending list and ready set empty, no lock, no
sequenced message left unapplied). Measured numbers are printed (run with -s to see them)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import pytest
import redis.exceptions
from queue_checks import assert_drained, leftovers, lock_holders
from redis_server import RedisServer
from redis_server import wait_until_async as poll
from worker_procs import WorkerPool, WorkerProc

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.ops.verify import Sent, check, send_bursts, wait_applied

pytestmark = pytest.mark.fault

# Short leases so that a dead or paused worker's work is taken over within seconds.
FAST = {
    "DIALOG_LOCK_TTL_MS": "1000",
    "DIALOG_VISIBILITY_TIMEOUT_MS": "2000",
    "DIALOG_RECLAIM_INTERVAL_MS": "200",
}


# ---------------------------------------------------------------------------------------------
# helpers


def metric(text: str, name: str, label: str = "") -> float:
    """Sum of the samples of `name` (optionally only those whose labels contain `label`)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] == name and label in head:
            total += float(value)
    return total


COUNTERS = {
    "applied": ("dialog_messages_total", 'outcome="applied"'),
    "duplicate": ("dialog_messages_total", 'outcome="duplicate"'),
    "dead_lettered": ("dialog_messages_total", 'outcome="dead_lettered"'),
    "reclaimed": ("dialog_reclaimed_total", ""),
    "fencing_rejections": ("dialog_fencing_rejections_total", ""),
    "handoffs": ("dialog_handoffs_total", ""),
    "retries": ("dialog_retries_total", ""),
    "in_flight": ("dialog_in_flight", ""),
}


def scrape(w: WorkerProc) -> dict[str, float]:
    """The worker's counters, or zeros if it does not answer (it may just have died)."""
    try:
        text = w.metrics_text()
    except AssertionError:
        return dict.fromkeys(COUNTERS, 0.0)
    return {k: metric(text, name, label) for k, (name, label) in COUNTERS.items()}


def add(total: dict[str, float], more: dict[str, float]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0.0) + v


async def stepping_first(client: DialogClient, session_id: str) -> str | None:
    """The consumer stepping the session's first message (nothing applied yet, its attempt
    counted, the lock held), or None."""
    sk = client.keys.session(session_id)
    applied, attempts = await client.redis.hmget(sk.state, "a", "n")
    if applied not in (None, "0") or attempts != "1":
        return None
    return (await lock_holders(client)).get(sk.lock)


async def duplicate_events(client: DialogClient) -> int:
    replies = await client.redis.xrange(client.keys.replies)
    return sum(1 for _, f in replies if f["outcome"] == "duplicate")


# ---------------------------------------------------------------------------------------------
# 1. kill -9 of a random worker every second


async def test_kill9_random_worker_every_second_loses_nothing(client, workers):
    extra = {
        **FAST,
        "DIALOG_MAX_ATTEMPTS": "20",
        "DIALOG_ENGINE": "fault_engine:make",
        # Few slots, so the burst's work outlasts most of the killing (see below).
        "DIALOG_CONCURRENCY": "16",
    }
    live: list[WorkerProc] = workers.start(3, metrics=True, **extra)
    totals: dict[str, float] = {}
    rng = random.Random(20240601)
    sessions = [f"k{i}" for i in range(200)]
    # Every fourth step takes 0.3 s: about 300 slot-seconds of work for 3 x 16 slots, so the
    # work is spread over the killing and most kills -9 catch steps in flight (counted below).
    texts = ["nama saya Budi"] + [
        f"sleep 0.3 pesan {i}" if i % 4 == 0 else f"pesan {i}" for i in range(2, 21)
    ]

    started = time.monotonic()
    sender = asyncio.create_task(send_bursts(client, sessions, texts))
    sent_done_at = 0.0

    def sending_done(_: asyncio.Task[list[Sent]]) -> None:
        nonlocal sent_done_at
        sent_done_at = time.monotonic() - started

    sender.add_done_callback(sending_done)
    kills = 0
    in_flight_at_kill: list[int] = []
    next_kill = time.monotonic() + 1.0
    while not (sender.done() and kills >= 8):
        await asyncio.sleep(max(0.0, next_kill - time.monotonic()))  # pacing of the fault
        next_kill += 1.0
        victim = rng.choice(live)
        counters = await asyncio.to_thread(scrape, victim)
        await asyncio.to_thread(victim.kill)
        in_flight_at_kill.append(int(counters.pop("in_flight")))
        add(totals, counters)
        live.remove(victim)
        kills += 1
        live += await asyncio.to_thread(workers.start, 1, True, **extra)
        assert kills < 40, "the burst never finished sending"
    sent = sender.result()
    killing_stopped = time.monotonic()
    assert len(sent) == 4000

    applied = await wait_applied(client, sent, timeout_s=120)
    drain_s = time.monotonic() - killing_stopped
    for w in live:
        counters = await asyncio.to_thread(scrape, w)
        counters.pop("in_flight")
        add(totals, counters)
    print(
        f"\n[kill9] {kills} kill -9 over {killing_stopped - started:.1f}s "
        f"(burst of 4000 sent after {sent_done_at:.1f}s); "
        f"all applied {drain_s:.1f}s after the last kill, total {time.monotonic() - started:.1f}s"
    )
    print(
        f"[kill9] counters (victims scraped just before their kill + survivors): "
        f"{ {k: int(v) for k, v in totals.items()} }; "
        f"messages in flight in each victim when killed: {in_flight_at_kill}"
    )
    assert applied, f"not all applied within 120s: {await leftovers(client)}"
    assert sum(1 for n in in_flight_at_kill if n) >= kills // 2, "kills missed the work"
    # The victims' sessions were taken over once their leases ran out.
    assert totals["reclaimed"] >= 1
    assert await check(client, sent) == []
    left = await assert_drained(client, timeout_s=30)
    assert left["dlq"] == 0
    assert all(w.alive() for w in live)


# ---------------------------------------------------------------------------------------------
# 2. a paused lock holder comes back after its lease was taken over


def stopped(proc: WorkerProc) -> bool:
    """The process is stopped (SIGSTOP): state T in /proc."""
    assert proc.proc is not None
    try:
        stat = Path(f"/proc/{proc.proc.pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


async def test_paused_lock_holder_cannot_overwrite_newer_state(client, workers):
    """The holder of seq 1 stops (SIGSTOP, a long pause) the moment its step returns, before
    its commit is sent; its worker lease lapses, the other worker's lease call brings the
    session back, and the other worker applies seq 1..3; woken, it
    sends that commit at once (before its heartbeat can learn the lease is gone), and the
    commit script must refuse it. The engine stops its own process at that point, so the
    commit reaches the fence in every run, not only when it beats the heartbeat."""
    procs = workers.start(
        2,
        metrics=True,
        DIALOG_ENGINE="fault_engine:make",
        DIALOG_LOCK_TTL_MS="1000",
        DIALOG_VISIBILITY_TIMEOUT_MS="1500",
        DIALOG_RECLAIM_INTERVAL_MS="100",
    )
    r, k = client.redis, client.keys
    sk = k.session("p")
    sent = await send_bursts(client, ["p"], ["pause nama saya Budi", "saya ada kendala", "ketiga"])
    assert [s.seq for s in sent] == [1, 2, 3]

    async def holder() -> WorkerProc | None:
        # seq 1's step has returned in a worker that stopped itself, nothing applied yet.
        if await stepping_first(client, "p") is None:
            return None
        return next((w for w in procs if stopped(w)), None)

    paused = await poll(holder, 10, "the holder of seq 1 to stop itself")
    other = next(w for w in procs if w is not paused)
    paused_at = time.monotonic()
    try:

        async def all_applied() -> bool:
            return await r.hget(sk.state, "a") == "3"

        await poll(all_applied, 20, "the other worker to apply seq 1..3")
        taken_over_s = time.monotonic() - paused_at
    finally:
        paused.signal(signal.SIGCONT)
    resumed_at = time.monotonic()

    async def fenced() -> float:
        text = await asyncio.to_thread(paused.metrics_text)
        return metric(text, "dialog_fencing_rejections_total")

    rejections = await poll(fenced, 10, "the resumed worker's fencing rejection")
    fenced_s = time.monotonic() - resumed_at
    theirs = await asyncio.to_thread(scrape, other)
    mine = await asyncio.to_thread(scrape, paused)
    print(
        f"\n[pause] {paused.name} paused holding seq 1; {other.name} applied seq 1..3 "
        f"{taken_over_s:.2f}s after the pause (reclaimed={int(theirs['reclaimed'])}, "
        f"applied={int(theirs['applied'])}); after SIGCONT {paused.name} had "
        f"{int(rejections)} fencing rejection(s) within {fenced_s:.2f}s, "
        f"applied={int(mine['applied'])}; its log: "
        f"{[ln for ln in paused.log_text().splitlines() if 'fenced' in ln or 'lease_lost' in ln]}"
    )

    assert await check(client, sent) == []
    state = await client.state("p")
    assert state is not None
    assert [t["seq"] for t in state["history"]] == [1, 2, 3]
    assert [t["msg_id"] for t in state["history"]] == [s.msg_id for s in sent]
    assert state["applied_seq"] == 3
    assert state["memory"]["userName"] == "Budi"
    replies = [f for _, f in await r.xrange(k.replies) if f["session_id"] == "p"]
    assert sorted(int(f["seq"]) for f in replies) == [1, 2, 3]
    # The paused worker wrote nothing: the version counts exactly three commits.
    assert int(await r.hget(sk.state, "v")) == 3
    assert mine["applied"] == 0
    # It was the commit script that refused it (not the heartbeat, before any commit).
    assert "commit_fenced" in paused.log_text()
    # The other worker took the session over through the ready set once the paused worker's
    # lease lapsed: its own lease call brought the session back (lua/lease-2.lua).
    assert theirs["reclaimed"] >= 1
    assert "lapsed_leases_swept" in other.log_text()
    await assert_drained(client, timeout_s=20)
    assert paused.alive() and other.alive()


# ---------------------------------------------------------------------------------------------
# 3. kill -9 of Redis (AOF, fsync always) in the middle of a burst


def test_a_script_cut_off_mid_write_in_the_aof_is_repaired_not_half_replayed(tmp_path: Path):
    """What a kill -9 can leave: the AOF ends inside a command of a script's effects (MULTI,
    some of its writes, part of one more). Redis 7.0 with the default `aof-load-truncated yes`
    cuts the file after the last whole command, inside the MULTI: on the next start every
    write made after it is queued into that MULTI and lost (or, once another script's
    MULTI/EXEC follows, replayed with the half script: the chaos test once saw the reply
    event of a commit whose state write was gone, so the message was applied again). The
    test servers refuse such a file and repair it with redis-check-aof (docs/deploy.md): the
    half script is gone for good, later writes stay."""
    import redis as sync_redis

    server = RedisServer(tmp_path / "aof", appendonly=True, fsync="always").start()
    try:
        r = sync_redis.Redis.from_url(server.url)
        r.set("before", "1")
        r.eval("redis.call('SET', 'half', '1'); redis.call('SET', 'other', '1')", 0)
        server.kill()
        [incr] = (tmp_path / "aof" / "appendonlydir").glob("*.incr.aof")
        data = incr.read_bytes()
        cut = data.rindex(b"other")  # inside the script's second write
        incr.write_bytes(data[:cut])
        server.start()
        r = sync_redis.Redis.from_url(server.url)
        assert r.mget("before", "half", "other") == [b"1", None, None]
        r.set("after", "1")
        server.kill()
        server.start()
        r = sync_redis.Redis.from_url(server.url)
        assert r.mget("before", "half", "other", "after") == [b"1", None, None, b"1"]
        assert server.aof_fixes == 1
    finally:
        server.stop()


async def test_redis_kill9_mid_burst_and_restart_loses_no_accepted_message(tmp_path: Path):
    # A plain function of tests/conftest.py (the fixtures there all use the shared server).
    from conftest import worker_env

    server = RedisServer(tmp_path / "redis-aof", appendonly=True, fsync="always").start()
    env = worker_env(server.url, **FAST, DIALOG_MAX_ATTEMPTS="10")
    pool = WorkerPool(env, tmp_path)
    client = DialogClient(settings=load_settings(environ=env), max_connections=120)
    try:
        procs = pool.start(2, metrics=True)
        sessions = [f"r{i}" for i in range(100)]
        per_session = 20
        sent: list[Sent] = []
        errors = 0
        half_way = asyncio.Event()
        give_up_at = time.monotonic() + 90

        async def sender(sid: str) -> None:
            nonlocal errors
            for i in range(1, per_session + 1):
                text = "nama saya Budi" if i == 1 else f"pesan {i}"
                msg_id = f"{sid}-m{i}"
                while True:
                    try:
                        res = await client.send(sid, text, msg_id=msg_id)
                        break
                    except (redis.exceptions.RedisError, OSError):
                        # The XADD may have been done before the connection broke: the retry
                        # (same msg_id) is then answered with a duplicate event, no seq.
                        errors += 1
                        assert time.monotonic() < give_up_at, "Redis never came back"
                        await asyncio.sleep(0.05)  # retry pacing, same msg_id
                sent.append(Sent(sid, i, res.msg_id, text))
                if len(sent) >= 500:
                    half_way.set()

        started = time.monotonic()
        senders = asyncio.gather(*(sender(sid) for sid in sessions))
        await asyncio.wait_for(half_way.wait(), 60)
        accepted_at_kill = len(sent)
        await asyncio.to_thread(server.kill)
        killed_at = time.monotonic()
        await asyncio.sleep(1.0)  # fault pacing: Redis stays down for a second
        await asyncio.to_thread(server.start)
        down_s = time.monotonic() - killed_at
        await senders
        send_s = time.monotonic() - started
        assert len(sent) == len(sessions) * per_session
        assert accepted_at_kill < len(sent), "Redis was killed after the burst, not in it"

        applied = await wait_applied(client, sent, timeout_s=120)
        applied_s = time.monotonic() - started
        totals: dict[str, float] = {}
        for w in procs:
            add(totals, await asyncio.to_thread(scrape, w))
        duplicates = await duplicate_events(client)
        print(
            f"\n[redis-kill] Redis kill -9 after {accepted_at_kill} accepted, down {down_s:.2f}s; "
            f"{errors} send errors retried, {duplicates} retries answered duplicate; "
            f"burst of {len(sent)} accepted in {send_s:.1f}s, all applied after "
            f"{applied_s:.1f}s; worker counters { {k: int(v) for k, v in totals.items()} }"
        )
        assert applied, f"not all applied within 120s: {await leftovers(client)}"
        assert await check(client, sent) == []
        # seq is assigned without gaps, whatever was lost with the kill: a retried send that
        # Redis had already taken took no second seq.
        for sid in sessions:
            assert await client.redis.hget(client.keys.session(sid).state, "s") == str(
                per_session
            ), sid
        assert duplicates <= errors
        await assert_drained(client, timeout_s=30)
        assert all(w.alive() for w in procs), "a worker died with Redis"
        # Ready again. Polled: a loop that meets a connection the kill broke (the sampler's,
        # every 5 s) marks its worker not ready until the reader has checked the group again.
        for w in procs:

            async def ready(w: WorkerProc = w) -> bool:
                got = await asyncio.to_thread(w._get, "/readyz")
                return got is not None and got[0] == 200

            await poll(ready, 10, f"{w.name} /readyz 200 after the restart")
    finally:
        await client.aclose()
        pool.stop_all()
        server.stop()


# ---------------------------------------------------------------------------------------------
# 4. SIGTERM in the middle of a burst


async def test_sigterm_mid_burst_exits_zero_within_grace_and_others_finish(client, workers):
    grace = 2.0
    # Lock TTL 5 s (the default): far longer than the check right after the exit, so a session
    # the stopped worker did not hand back would still show its lock then.
    procs = workers.start(
        2,
        metrics=True,
        DIALOG_ENGINE="fault_engine:make",
        DIALOG_SHUTDOWN_GRACE_S=str(grace),
        DIALOG_LOCK_TTL_MS="5000",
        DIALOG_VISIBILITY_TIMEOUT_MS="10000",
        DIALOG_RECLAIM_INTERVAL_MS="500",
    )
    r, k = client.redis, client.keys

    # A step longer than the grace period: it must be cancelled and handed back.
    sent = await send_bursts(client, ["slow"], ["sleep 6 nama saya Budi", "pesan 2", "pesan 3"])
    slow_lock = k.session("slow").lock

    # SIGTERM goes to whichever worker is running the 6 s step.
    name = await poll(lambda: stepping_first(client, "slow"), 10, "the 6 s step to start")
    victim = next(w for w in procs if w.name == name)
    survivor = next(w for w in procs if w is not victim)

    sessions = [f"t{i}" for i in range(50)]
    texts = ["nama saya Budi"] + [
        f"sleep 0.2 pesan {i}" if i % 5 == 0 else f"pesan {i}" for i in range(2, 21)
    ]
    accepted = 0
    mid = asyncio.Event()

    async def burst(sid: str) -> None:
        nonlocal accepted
        for position, text in enumerate(texts, start=1):
            res = await client.send(sid, text)
            sent.append(Sent(sid, position, res.msg_id, text))
            accepted += 1
            if accepted >= 300:
                mid.set()

    started = time.monotonic()
    senders = asyncio.gather(*(burst(sid) for sid in sessions))
    await asyncio.wait_for(mid.wait(), 30)
    before = await asyncio.to_thread(scrape, victim)
    victim.signal(signal.SIGTERM)
    term_at = time.monotonic()
    accepted_at_term = accepted
    assert victim.proc is not None
    code = await asyncio.to_thread(victim.proc.wait, grace + 5)
    exit_s = time.monotonic() - term_at
    # What the stopped worker left behind: locks still carrying its token (sessions neither
    # finished nor handed back) and entries in its pending list (v2: never any).
    victim_locks = [key for key, who in (await lock_holders(client)).items() if who == victim.name]
    victim_pending = await r.xpending_range(
        k.stream, k.group, min="-", max="+", count=100, consumername=name
    )
    await senders
    assert len(sent) == 3 + 50 * 20

    applied = await wait_applied(client, sent, timeout_s=60)
    applied_s = time.monotonic() - term_at
    after = await asyncio.to_thread(scrape, survivor)
    print(
        f"\n[sigterm] SIGTERM to {victim.name} after {accepted_at_term} of {len(sent)} accepted "
        f"({term_at - started:.2f}s into the burst), holding the 6 s step; exit code {code} "
        f"after {exit_s:.2f}s (grace {grace}s); {victim.name} had applied "
        f"{int(before['applied'])} before the signal and had {int(before['in_flight'])} in "
        f"flight; it exited holding {len(victim_locks)} locks and {len(victim_pending)} pending "
        f"entries; {survivor.name} applied {int(after['applied'])} (resumed "
        f"{int(after['reclaimed'])} sessions after a lease ran out); everything applied "
        f"{applied_s:.1f}s after SIGTERM"
    )
    assert code == 0
    assert exit_s <= grace + 5
    # The 6 s step was cancelled at the end of the grace period and handed back (its lock
    # released for the others at once, not left to run out), like everything else it held.
    assert slow_lock not in victim_locks
    assert victim_locks == [] and victim_pending == []
    # Handed back, not abandoned: the survivor took those sessions up without waiting for a
    # lease to run out, and counted none as taken over from a dead holder.
    assert after["reclaimed"] == 0
    assert exit_s >= grace - 0.5, "exited before the grace period although a step was running"
    assert applied, f"not all applied within 60s: {await leftovers(client)}"
    assert await check(client, sent) == []
    state = await client.state("slow")
    assert state is not None and [t["seq"] for t in state["history"]] == [1, 2, 3]
    assert state["memory"]["userName"] == "Budi"
    await assert_drained(client, timeout_s=20)
    assert survivor.alive()
    log = victim.log_text()
    assert "Traceback" not in log, log[-3000:]


# ---------------------------------------------------------------------------------------------
# 5. SIGTERM while the reader's intake is in flight


async def test_sigterm_under_load_leaves_nothing_pending_and_no_lock_behind(client, workers):
    """v1 lost entries here: XREADGROUP delivered them to a reader that was stopping, and they
    sat in its pending list until a reclaim. v2 delivers, sequences and acks in one script,
    and hands back at shutdown whatever it took: after each clean exit nothing is pending for
    the stopped consumer and no lock carries its token."""
    r, k = client.redis, client.keys
    sent: list[Sent] = []
    rounds = []
    for attempt in range(4):
        [w] = workers.start(1, metrics=True, DIALOG_SHUTDOWN_GRACE_S="2")
        stop = asyncio.Event()

        async def produce(sid: str, stop: asyncio.Event = stop) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                res = await client.send(sid, f"pesan {n}")
                sent.append(Sent(sid, n, res.msg_id, f"pesan {n}"))
                await asyncio.sleep(0.002)  # producer pacing

        producers = asyncio.gather(*(produce(f"g{attempt}-{i}") for i in range(20)))
        await asyncio.sleep(0.7)  # fault pacing: let the worker get busy reading
        in_flight = int((await asyncio.to_thread(scrape, w))["in_flight"])
        w.signal(signal.SIGTERM)
        assert w.proc is not None
        code = await asyncio.to_thread(w.proc.wait, 10)
        stop.set()
        await producers
        assert code == 0
        pending = await r.xpending_range(
            k.stream, k.group, min="-", max="+", count=100, consumername=w.name
        )
        locks = [key for key, who in (await lock_holders(client)).items() if who == w.name]
        rounds.append((w.name, in_flight, len(pending), len(locks)))
        log = w.log_text()
        assert "redis_error" not in log and "unexpected_error" not in log, log[-3000:]
        assert pending == [] and locks == [], (w.name, pending[:5], locks[:5])

    # Nothing is lost in the end: one more worker applies everything once.
    drain_started = time.monotonic()
    workers.start(1, **FAST)
    assert await wait_applied(client, sent, timeout_s=60)
    assert await check(client, sent) == []
    await assert_drained(client, timeout_s=20)
    print(
        f"\n[sigterm-race] (worker, in flight at SIGTERM, left pending, left locked): {rounds}; "
        f"{len(sent)} messages all applied once after the last worker drained for "
        f"{time.monotonic() - drain_started:.1f}s"
    )
