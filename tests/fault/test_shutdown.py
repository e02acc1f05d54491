"""Shutdown paths not covered by the burst tests."""

from __future__ import annotations

import signal
import time

import anyio
import pytest
from queue_checks import assert_drained, lock_holders
from redis_server import wait_until_async as wait_for

from dialog_worker.ops.verify import Sent, check, send_bursts, wait_applied

pytestmark = pytest.mark.fault


async def test_second_signal_exits_at_once_and_the_message_is_finished_elsewhere(client, workers):
    fast = {
        "DIALOG_ENGINE": "fault_engine:make",
        "DIALOG_LOCK_TTL_MS": "1000",
        "DIALOG_VISIBILITY_TIMEOUT_MS": "1500",
        "DIALOG_RECLAIM_INTERVAL_MS": "100",
    }
    [first] = workers.start(1, DIALOG_SHUTDOWN_GRACE_S="60", **fast)
    sent = await send_bursts(client, ["slow"], ["sleep 5 nama saya Budi", "keluhan"])
    sk = client.keys.session("slow")

    async def started() -> bool:
        # The 5 s step runs: its attempt is counted and the first worker holds the lock.
        return (
            await client.redis.hget(sk.state, "n") == "1"
            and first.name in (await lock_holders(client)).values()
        )

    await wait_for(started, 20, "the 5 s step to start")
    first.signal(signal.SIGTERM)
    # The first signal waits for the step (grace 60 s): a second later the worker still runs
    # it, holding the lock, its attempt counted (nothing handed back).
    await anyio.sleep(1.0)  # fault pacing: time for a wrong exit or hand-back to show
    assert first.alive(), "the first signal must wait for the grace period"
    assert await client.redis.hget(sk.state, "n") == "1"
    assert first.name in (await lock_holders(client)).values()
    t0 = time.monotonic()
    first.signal(signal.SIGTERM)
    code = await anyio.to_thread.run_sync(lambda: first.proc.wait(10))
    assert code != 0 and time.monotonic() - t0 < 5
    # It left at once: nothing was handed back (a hand-back gives the attempt back, n = 0).
    assert await client.redis.hget(sk.state, "n") == "1"
    # The session comes back through the ready set when the lease ends: a new worker
    # finishes it, once, in order.
    workers.start(1, **fast)
    assert await wait_applied(client, sent, timeout_s=60)
    assert await check(client, sent) == []
    await assert_drained(client, timeout_s=20)


async def test_session_behind_a_long_step_is_not_taken_over_meanwhile(client, workers, tmp_path):
    """One read holds a session's burst; the first step outlasts the lock TTL several times.
    The heartbeat renews the lease and pushes the session's place in the ready set back, so
    the other worker never resumes the session meanwhile: every lock token seen belongs to
    one worker, and nobody counts a session resumed after a lease ran out. The other worker
    starts two lock TTLs into the step, and the step lasts until that worker's lease call has
    run (it would bring back the sessions of a lease that was not renewed) and a few renewal
    intervals more, however slowly the second process starts."""
    flag = tmp_path / "hold"
    flag.touch()
    fast = {
        "DIALOG_ENGINE": "fault_engine:make",
        "FAULT_FLAG_FILE": str(flag),
        "DIALOG_LOCK_TTL_MS": "600",
        "DIALOG_VISIBILITY_TIMEOUT_MS": "800",
        "DIALOG_RECLAIM_INTERVAL_MS": "100",
        "DIALOG_METRICS_SAMPLE_INTERVAL_S": "0.1",
    }
    sent = await send_bursts(client, ["long"], ["hold nama saya Budi", "dua", "tiga"])
    procs = workers.start(1, metrics=True, **fast)
    sk = client.keys.session("long")
    tokens: set[str] = set()

    async def applied_watching_the_lock() -> bool:
        token = await client.redis.get(sk.lock)
        if token is not None:
            tokens.add(token)
        return await client.redis.hget(sk.state, "a") == "3"

    async def second_lease_taken() -> bool:
        return await client.redis.get(f"{client.keys.workers}:n") == "2"

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for, applied_watching_the_lock, 60, "all three applied", 0.02)
        await wait_for(lambda: _holding(client, procs[0], "long"), 20, "the long step running")
        await anyio.sleep(1.2)  # two lock TTLs: a lease that was not renewed has lapsed
        procs += workers.start(1, metrics=True, **fast)
        await wait_for(second_lease_taken, 30, "the second worker's first lease call")
        # Five renewal intervals more of the step, then it ends.
        await anyio.sleep(1.0)  # fault pacing: time for a wrong take-over to show
        assert await client.redis.hget(sk.state, "a") is None, "the step ended too early"
        flag.unlink()
    assert await check(client, sent) == []
    assert len({t.split(":", 1)[0] for t in tokens}) == 1, tokens
    reclaimed = sum(
        float(line.rsplit(" ", 1)[1])
        for w in procs
        for line in w.metrics_text().splitlines()
        if line.startswith("dialog_reclaimed_total ")
    )
    assert reclaimed == 0
    await assert_drained(client, timeout_s=20)


async def _holding(client, worker, session_id: str) -> bool:
    """The worker holds the session's lock and runs its step (attempt counted)."""
    sk = client.keys.session(session_id)
    holders = await lock_holders(client)
    return holders.get(sk.lock) == worker.name and await client.redis.hget(sk.state, "n") == "1"


async def _due_now(client, session_id: str) -> bool:
    score = await client.redis.zscore(client.keys.ready, session_id)
    sec, usec = await client.redis.time()
    return score is not None and score <= sec * 1000 + usec // 1000


async def test_sigint_finishes_the_step_in_hand_within_the_grace_and_exits_zero(client, workers):
    """Ctrl-C is a graceful stop like SIGTERM: the running step (1.5 s, inside the 10 s
    grace) is finished and committed by this worker; the session's next message, handed on
    by that commit after the signal, is handed back unstarted, its attempt not counted."""
    [w] = workers.start(1, DIALOG_ENGINE="fault_engine:make", DIALOG_SHUTDOWN_GRACE_S="10")
    sent = await send_bursts(client, ["ctrl-c"], ["sleep 1.5 nama saya Budi", "keluhan"])
    sk = client.keys.session("ctrl-c")
    await wait_for(lambda: _holding(client, w, "ctrl-c"), 20, "the 1.5 s step to start")
    w.signal(signal.SIGINT)
    t0 = time.monotonic()
    code = await anyio.to_thread.run_sync(lambda: w.proc.wait(15))
    took = time.monotonic() - t0
    assert code == 0, w.log_text()[-3000:]
    assert took < 5
    state = await client.state("ctrl-c")
    assert state is not None and state["applied_seq"] == 1
    assert state["memory"]["userName"] == "Budi"
    assert await client.redis.hget(sk.state, "n") == "0"  # seq 2: attempt given back
    assert await client.redis.hget(sk.state, "e") is None  # not a failure
    assert await client.redis.exists(sk.lock) == 0
    assert await _due_now(client, "ctrl-c")  # picked up at once by whoever looks
    assert "Traceback" not in w.log_text()
    workers.start(1)
    assert await wait_applied(client, sent, timeout_s=20)
    assert await check(client, sent) == []
    await assert_drained(client, timeout_s=20)


async def test_a_step_running_past_the_grace_is_handed_back_with_its_attempt_given_back(
    client, workers, tmp_path
):
    flag = tmp_path / "hold"
    flag.touch()
    fault = {"DIALOG_ENGINE": "fault_engine:make", "FAULT_FLAG_FILE": str(flag)}
    [w] = workers.start(1, DIALOG_SHUTDOWN_GRACE_S="0.5", **fault)
    sent = await send_bursts(client, ["past"], ["hold nama saya Budi", "keluhan"])
    sk = client.keys.session("past")
    await wait_for(lambda: _holding(client, w, "past"), 20, "the held step to start")
    w.signal(signal.SIGTERM)
    t0 = time.monotonic()
    code = await anyio.to_thread.run_sync(lambda: w.proc.wait(15))
    took = time.monotonic() - t0
    assert code == 0, w.log_text()[-3000:]
    assert 0.4 <= took < 5  # waited for the grace, then cancelled the step
    # Handed back: nothing applied, the lock released, the attempt given back, no error
    # recorded, the session due at once.
    assert await client.redis.hmget(sk.state, ["a", "n", "e", "f"]) == [None, "0", None, None]
    assert await client.redis.exists(sk.lock) == 0
    assert await _due_now(client, "past")
    flag.unlink()
    [heir] = workers.start(1, metrics=True, **fault)
    assert await wait_applied(client, sent, timeout_s=20)
    assert await check(client, sent) == []
    # Taken up as a first attempt, not as a take-over from a holder that died.
    reclaimed = [
        line for line in heir.metrics_text().splitlines()
        if line.startswith("dialog_reclaimed_total ")
    ]  # fmt: skip
    assert reclaimed == ["dialog_reclaimed_total 0.0"]
    await assert_drained(client, timeout_s=20)


@pytest.mark.parametrize("slots", ["64", "1"])
async def test_sigterm_while_an_intake_call_is_in_flight_loses_nothing(client, workers, slots):
    """The race the burst tests can only hope to hit, driven: the idle reader is woken by a
    burst, and its intake call (a write script) is held in the server by CLIENT PAUSE WRITE,
    issued in the same transaction as the burst. SIGTERM arrives while that call is in
    flight; the call delivers and locks after the worker began to stop. Whatever it took is
    finished or handed back: nothing pending, no lock left, every message applied once. With
    64 slots the call was sent behind the blocking read; with one, after it."""
    r, k = client.redis, client.keys
    [w] = workers.start(1, metrics=True, DIALOG_SHUTDOWN_GRACE_S="2", DIALOG_CONCURRENCY=slots)

    async def ready() -> bool:
        got = await anyio.to_thread.run_sync(w._get, "/readyz")
        return got is not None and got[0] == 200

    await wait_for(ready, 20, "the worker to be ready (idle, its reader blocked in XREAD)")
    sessions = [f"race{i}" for i in range(20)]
    try:
        async with r.pipeline(transaction=True) as pipe:
            for sid in sessions:
                pipe.xadd(k.stream, {"session_id": sid, "text": "nama saya Budi"})
            pipe.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
            ids = (await pipe.execute())[:-1]

        async def intake_in_flight() -> bool:
            clients = await r.client_list()
            scripts = [c for c in clients if c["cmd"] == "evalsha" and "b" in c["flags"]]
            readers = [c for c in clients if c["cmd"] == "xread" and "b" in c["flags"]]
            return bool(scripts) and not readers

        await wait_for(intake_in_flight, 10, "the reader's intake call to wait in the server")
        assert (await r.xinfo_groups(k.stream))[0]["lag"] == len(sessions)  # not yet delivered
        w.signal(signal.SIGTERM)
        # Fault pacing: the worker is stopping while the call waits, longer than a stopping
        # worker tries to end a blocked read (1 s) before it cancels its intake loops.
        await anyio.sleep(1.5)
        assert w.alive(), "the worker must wait for the call it sent"
    finally:
        await r.execute_command("CLIENT", "UNPAUSE")
    code = await anyio.to_thread.run_sync(lambda: w.proc.wait(15))
    assert code == 0, w.log_text()[-3000:]
    # The call went through after the signal: all it read was delivered to the stopping
    # worker (with one slot too: a reader short of slots reads a batch, and the sessions
    # beyond its slot were handed back at once); the next worker finishes them.
    assert (await r.xinfo_groups(k.stream))[0]["lag"] == 0
    pending = await r.xpending_range(k.stream, k.group, "-", "+", 100, consumername=w.name)
    assert pending == []
    assert w.name not in (await lock_holders(client)).values()
    log = w.log_text()
    assert "redis_error" not in log and "unexpected_error" not in log, log[-3000:]
    workers.start(1)
    sent = [
        Sent(sid, 1, entry_id, "nama saya Budi")
        for sid, entry_id in zip(sessions, ids, strict=True)
    ]
    assert await wait_applied(client, sent, timeout_s=20)
    assert await check(client, sent) == []
    await assert_drained(client, timeout_s=20)


async def test_sigterm_leaves_the_queued_sessions_to_another_worker_untouched(client, workers):
    """A worker short of slots reads a batch into its tenant's queue, no lock taken. At SIGTERM
    its step in hand finishes within the grace period, but the slot that step frees is not
    filled from the queue: the queued sessions stay for another worker, untouched (no lock,
    no attempt counted), neither taken up and handed back nor held through the grace period."""
    await client.redis.hset(client.keys.tenants, "default", '{"max": 0, "min": 0, "weight": 1.0}')
    [w] = workers.start(
        1, DIALOG_CONCURRENCY="1", DIALOG_ENGINE="fault_engine:make", DIALOG_SHUTDOWN_GRACE_S="30"
    )
    await client.send("first", "sleep 1 first")
    first = client.keys.session("first")

    async def first_running() -> bool:
        return bool(await client.redis.exists(first.lock))

    await wait_for(first_running, 20, "the first step")
    sk = [client.keys.session(f"s{i}") for i in range(10)]
    for i in range(10):
        await client.send(f"s{i}", "sleep 5 long")
    queue = client.keys.tenant_queue("default")

    async def batch_queued() -> bool:
        return await client.redis.zcard(queue) == 10

    await wait_for(batch_queued, 20, "the batch read into the queue while the slot is busy")
    w.signal(signal.SIGTERM)
    assert await anyio.to_thread.run_sync(lambda: w.proc.wait(20)) == 0
    assert await client.redis.hget(first.state, "a") == "1"  # the step in hand finished
    assert await client.redis.exists(*[k.lock for k in sk]) == 0
    for k in sk:
        assert int(await client.redis.hget(k.state, "n") or 0) == 0  # no attempt counted
    assert await client.redis.zcard(queue) == 10
    workers.start(1, DIALOG_CONCURRENCY="10", DIALOG_ENGINE="fault_engine:make")

    async def taken_up() -> bool:
        return await client.redis.exists(*[k.lock for k in sk]) == 10

    await wait_for(taken_up, 20, "another worker takes the ten up")
