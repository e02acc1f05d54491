"""Shutdown paths not covered by the burst tests."""

from __future__ import annotations

import signal
import time

import anyio
import pytest
import redis.exceptions

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
    k = client.keys

    async def started():
        try:
            return (await client.redis.xpending(k.stream, k.group))["pending"] > 0
        except redis.exceptions.ResponseError:  # the worker has not created the group yet
            return False

    deadline = time.monotonic() + 20
    while not await started():
        assert time.monotonic() < deadline
        await anyio.sleep(0.05)
    first.signal(signal.SIGTERM)
    await anyio.sleep(0.3)  # pacing: the second signal must come after the first one
    assert first.alive(), "the first signal must wait for the grace period"
    t0 = time.monotonic()
    first.signal(signal.SIGTERM)
    code = await anyio.to_thread.run_sync(lambda: first.proc.wait(10))
    assert code != 0 and time.monotonic() - t0 < 5
    # What it held is still pending (or parked): a new worker finishes it, once, in order.
    workers.start(1, **fast)
    assert await wait_applied(client, sent, timeout_s=60)
    assert await check(client, sent) == []


async def test_messages_waiting_behind_a_long_step_are_not_reclaimed_meanwhile(client, workers):
    """One read holds a session's burst; the first step outlasts the visibility timeout. The
    heartbeat keeps the waiting entries fresh, so no other worker reclaims them meanwhile."""
    fast = {
        "DIALOG_ENGINE": "fault_engine:make",
        "DIALOG_LOCK_TTL_MS": "600",
        "DIALOG_VISIBILITY_TIMEOUT_MS": "800",
        "DIALOG_RECLAIM_INTERVAL_MS": "100",
        "DIALOG_METRICS_SAMPLE_INTERVAL_S": "0.1",
    }
    sent = await send_bursts(client, ["long"], ["sleep 2.5 nama saya Budi", "dua", "tiga"])
    procs = workers.start(2, metrics=True, **fast)
    assert await wait_applied(client, sent, timeout_s=30)
    assert await check(client, sent) == []
    reclaimed = sum(
        float(line.rsplit(" ", 1)[1])
        for w in procs
        for line in w.metrics_text().splitlines()
        if line.startswith("dialog_reclaimed_total ")
    )
    assert reclaimed == 0
