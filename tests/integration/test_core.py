"""Core guarantees end to end: real redis-server, real worker processes."""

from __future__ import annotations

import time

import pytest

from worker.client import DialogClient
from worker.verify import Sent, check, send_bursts, wait_applied

pytestmark = pytest.mark.integration


async def assert_drained(client: DialogClient, timeout_s: float = 20) -> None:
    """Nothing pending, nothing delayed, no lock left, inbound stream trimmed to empty."""
    r, k = client.redis, client.keys
    deadline = time.monotonic() + timeout_s
    while True:
        locks = [key async for key in r.scan_iter(match=f"{k.prefix}:s:*:lock", count=1000)]
        pending = (await r.xpending(k.stream, k.group))["pending"]
        state = (await r.xlen(k.stream), pending, await r.zcard(k.delayed), len(locks))
        if state == (0, 0, 0, 0):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not drained: stream, pending, delayed, locks = {state}")
        await __import__("anyio").sleep(0.05)


async def test_seed_verification_two_back_to_back_messages_two_workers(client, workers):
    workers.start(2)
    sent = await send_bursts(
        client, ["session_123"], ["nama saya Budi", "saya ada kendala billing"]
    )
    assert await wait_applied(client, sent, timeout_s=20)
    state = await client.state("session_123")
    assert state["memory"]["userName"] == "Budi"
    assert state["step"] == "COMPLETED"
    assert [t["user"] for t in state["history"]] == ["nama saya Budi", "saya ada kendala billing"]
    assert [t["bot"] for t in state["history"]] == [
        "Halo Budi, ada yang bisa dibantu?",
        'Mencatat keluhan Anda: "saya ada kendala billing". Tim kami akan meninjau.',
    ]
    assert await check(client, sent) == []


async def test_burst_500_sessions_x10_applied_exactly_once_in_order(client, workers):
    workers.start(2)
    texts = ["nama saya Budi"] + [f"pesan {i}" for i in range(2, 11)]
    started = time.monotonic()
    sent = await send_bursts(client, [f"s{i}" for i in range(500)], texts)
    assert len(sent) == 5000
    assert await wait_applied(client, sent, timeout_s=120)
    elapsed = time.monotonic() - started
    print(f"\n5000-message burst drained in {elapsed:.2f}s = {5000 / elapsed:.0f} msg/s")
    assert await check(client, sent) == []
    await assert_drained(client)
    assert await client.redis.xlen(client.keys.dlq) == 0


async def test_one_session_200_messages_three_workers_in_order(client, workers):
    procs = workers.start(3, metrics=True)
    sent = await send_bursts(client, ["hot"], [f"pesan {i}" for i in range(1, 201)])
    assert await wait_applied(client, sent, timeout_s=60)
    assert await check(client, sent) == []
    await assert_drained(client)
    assert await client.redis.xlen(client.keys.dlq) == 0
    requeues = 0.0
    for w in procs:
        for line in w.metrics_text().splitlines():
            if line.startswith("dialog_retries_total{"):
                requeues += float(line.rsplit(" ", 1)[1])
    print(f"\none session x200, 3 workers: {requeues / 200:.2f} re-queues per message")


async def test_messages_sent_before_any_worker_started_are_processed(client, workers):
    sent = await send_bursts(client, ["early-1", "early-2"], ["nama saya Ani", "tolong"])
    assert await client.redis.exists(client.keys.stream)
    workers.start(1)
    assert await wait_applied(client, sent, timeout_s=20)
    assert await check(client, sent) == []


async def test_duplicate_msg_id_enqueues_nothing_and_returns_original_seq(client, workers):
    first = await client.send("dup", "nama saya Budi", msg_id="m-1")
    again = await client.send("dup", "nama saya Budi", msg_id="m-1")
    assert (first.seq, first.duplicate) == (1, False)
    assert (again.seq, again.duplicate) == (1, True)
    assert await client.redis.xlen(client.keys.stream) == 1
    second = await client.send("dup", "keluhan", msg_id="m-2")
    assert second.seq == 2


@pytest.mark.parametrize(
    "ids",
    [
        ["a}b", "a", "b"],
        ["{x}", "x", "{x"],
        ["a:lock", "a"],
        ["sesi-ñ-日本", "sesi"],
        ["é" * 128, "é" * 127],
    ],
)
async def test_tricky_session_ids_stay_separate(client, workers, ids):
    workers.start(1)
    sent = []
    for i, sid in enumerate(ids):
        sent += await send_bursts(client, [sid], [f"nama saya N{i}", f"keluhan {i}"])
    assert await wait_applied(client, sent, timeout_s=20)
    assert await check(client, sent) == []
    for i, sid in enumerate(ids):
        state = await client.state(sid)
        assert state["session_id"] == sid
        assert state["memory"]["userName"] == f"N{i}"
        assert [t["seq"] for t in state["history"]] == [1, 2]


async def test_copies_of_one_message_in_one_read_apply_once_and_leave_nothing_pending(
    client, workers
):
    # Two entries with the same seq (a producer that re-sent past `send`, or a promoted copy)
    # and the next message, all read in one batch by one worker.
    k = client.keys
    first = await client.send("copy", "nama saya Budi", msg_id="m1")
    entry = (await client.redis.xrange(k.stream))[0][1]
    await client.redis.xadd(k.stream, entry)
    second = await client.send("copy", "keluhan", msg_id="m2")
    workers.start(1)
    sent = [Sent("copy", first.seq, "m1", "nama saya Budi"), Sent("copy", second.seq, "m2", "x")]
    assert await wait_applied(client, sent, timeout_s=20)
    assert await check(client, sent) == []
    await assert_drained(client)
