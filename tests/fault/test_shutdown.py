"""Shutdown paths not covered by the burst tests."""

from __future__ import annotations

import signal
import time

import anyio
import pytest
from queue_checks import assert_drained, lock_holders
from redis_server import wait_until_async as wait_for

from worker.verify import check, send_bursts, wait_applied

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
    await anyio.sleep(0.3)  # pacing: the second signal must come after the first one
    assert first.alive(), "the first signal must wait for the grace period"
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


async def test_session_behind_a_long_step_is_not_taken_over_meanwhile(client, workers):
    """One read holds a session's burst; the first step outlasts the lock TTL several times.
    The heartbeat renews the lease and pushes the session's place in the ready set back, so
    the other worker never resumes the session meanwhile: every lock token seen belongs to
    one worker, and nobody counts a session resumed after a lease ran out."""
    fast = {
        "DIALOG_ENGINE": "fault_engine:make",
        "DIALOG_LOCK_TTL_MS": "600",
        "DIALOG_VISIBILITY_TIMEOUT_MS": "800",
        "DIALOG_RECLAIM_INTERVAL_MS": "100",
        "DIALOG_METRICS_SAMPLE_INTERVAL_S": "0.1",
    }
    sent = await send_bursts(client, ["long"], ["sleep 2.5 nama saya Budi", "dua", "tiga"])
    procs = workers.start(2, metrics=True, **fast)
    lock = client.keys.session("long").lock
    tokens: set[str] = set()

    async def applied_watching_the_lock() -> bool:
        token = await client.redis.get(lock)
        if token is not None:
            tokens.add(token)
        return await client.redis.hget(client.keys.session("long").state, "a") == "3"

    await wait_for(applied_watching_the_lock, 30, "all three applied", interval_s=0.02)
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
