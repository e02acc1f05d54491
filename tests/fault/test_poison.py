"""Poison messages and the dead-letter stream, with real worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import anyio
import pytest
from redis_server import wait_until_async as wait_for

from worker.verify import check, send_bursts, wait_applied

pytestmark = pytest.mark.fault

FAST = {
    "DIALOG_ENGINE": "fault_engine:make",
    "DIALOG_LOCK_TTL_MS": "1000",
    "DIALOG_VISIBILITY_TIMEOUT_MS": "1500",
    "DIALOG_RECLAIM_INTERVAL_MS": "100",
    "DIALOG_BACKOFF_BASE_MS": "20",
    "DIALOG_BACKOFF_MAX_MS": "100",
    "DIALOG_MAX_ATTEMPTS": "3",
}

DLQ_FIELDS = {
    "session_id",
    "msg_id",
    "seq",
    "text",
    "enqueued_at",
    "error",
    "error_kind",
    "attempts",
    "first_failed_at",
    "last_failed_at",
    "consumer",
    "worker_version",
    "source_entry_id",
}


async def dead_letters(client) -> list[dict[str, str]]:
    return [f for _, f in await client.redis.xrange(client.keys.dlq)]


async def assert_nothing_left(client) -> None:
    k = client.keys

    async def empty():
        pending = (await client.redis.xpending(k.stream, k.group))["pending"]
        return (
            await client.redis.xlen(k.stream),
            pending,
            await client.redis.zcard(k.delayed),
        ) == (0, 0, 0)

    await wait_for(empty, 20, "stream, pending and delayed set to be empty")


async def test_step_that_always_raises_is_dead_lettered_after_max_attempts(client, workers):
    workers.start(2, **FAST)
    sent = await send_bursts(client, ["p1"], ["nama saya Budi", "boom here", "saya ada kendala"])
    assert await wait_applied(client, sent, timeout_s=30)
    [letter] = await dead_letters(client)
    assert DLQ_FIELDS <= set(letter)
    assert (letter["error_kind"], letter["attempts"], letter["seq"]) == ("exhausted", "3", "2")
    assert "boom on seq 2" in letter["error"]
    assert int(letter["first_failed_at"]) <= int(letter["last_failed_at"])
    state = await client.state("p1")
    assert [t["seq"] for t in state["history"]] == [1, 2, 3]
    assert state["history"][1]["bot"] == client.settings.fallback_reply
    # The complaint that followed the poison message was still applied, in order.
    assert state["step"] == "COMPLETED"
    assert await check(client, sent) == []
    await assert_nothing_left(client)


async def test_permanent_error_is_dead_lettered_at_once(client, workers):
    workers.start(1, **FAST)
    sent = await send_bursts(client, ["p2"], ["fatal input", "nama saya Ani"])
    assert await wait_applied(client, sent, timeout_s=20)
    [letter] = await dead_letters(client)
    assert (letter["error_kind"], letter["attempts"]) == ("permanent", "1")
    assert (await client.state("p2"))["memory"] == {"userName": "Ani"}
    assert await check(client, sent) == []


async def test_step_that_kills_its_worker_is_dead_lettered_without_crash_loop(client, workers):
    procs = workers.start(2, **FAST)
    sent = await send_bursts(client, ["p3"], ["exit now", "nama saya Budi"])
    deaths = 0
    deadline = time.monotonic() + 60
    while not await client.redis.xlen(client.keys.dlq):
        assert time.monotonic() < deadline, "poison message never dead-lettered"
        for w in list(procs):
            if not w.alive():  # a supervisor restarts what died
                deaths += 1
                procs.remove(w)
                procs += workers.start(1, **FAST)
        await anyio.sleep(0.05)
    assert await wait_applied(client, sent, timeout_s=30)
    [letter] = await dead_letters(client)
    assert (letter["error_kind"], letter["attempts"]) == ("exhausted", "3")
    assert deaths == 3, f"expected one death per delivery, saw {deaths}"
    assert all(w.alive() for w in procs)
    assert await check(client, sent) == []
    print(f"\nos._exit poison: {deaths} worker deaths, then dead-lettered")


async def test_entry_without_session_id_is_dead_lettered_with_reason(client, workers):
    workers.start(1, **FAST)
    k = client.keys
    await client.redis.xgroup_create(k.stream, k.group, id="0", mkstream=True)
    bad_id = await client.redis.xadd(k.stream, {"text": "no session", "seq": "1"})
    sent = await send_bursts(client, ["ok"], ["nama saya Budi"])
    assert await wait_applied(client, sent, timeout_s=20)
    await wait_for(lambda: client.redis.xlen(k.dlq), 20, "dead letter")
    [letter] = await dead_letters(client)
    assert letter["error_kind"] == "permanent"
    assert "session_id" in letter["error"]
    assert letter["source_entry_id"] == bad_id
    assert letter["text"] == "no session"
    await assert_nothing_left(client)


async def test_oversized_entry_is_dead_lettered_and_the_next_message_proceeds(client, workers):
    workers.start(1, **FAST, DIALOG_MAX_MESSAGE_BYTES="1000")
    k = client.keys
    sk = k.session("big")
    await client.redis.xgroup_create(k.stream, k.group, id="0", mkstream=True)
    # A producer that bypasses send's check: the entry takes seq 1 in the session's order.
    seq = await client.redis.hincrby(sk.state, "s", 1)
    await client.redis.xadd(
        k.stream,
        {"session_id": "big", "msg_id": "huge", "seq": seq, "text": "x" * 5000, "enqueued_at": 0},
    )
    after = await client.send("big", "nama saya Budi")
    assert after.seq == 2
    await wait_for(lambda: client.state("big"), 20, "state")
    state = await wait_for(
        lambda: _state_at(client, "big", 2), 20, "the message after the oversized one"
    )
    assert state["memory"] == {"userName": "Budi"}
    [letter] = await dead_letters(client)
    assert letter["error_kind"] == "permanent" and "5000 bytes" in letter["error"]
    assert len(letter["text"]) == 5000  # the dead letter keeps the original whole
    await assert_nothing_left(client)


async def _state_at(client, session_id: str, seq: int):
    state = await client.state(session_id)
    return state if state and state["applied_seq"] >= seq else None


async def test_redrive_resends_and_a_message_that_fails_again_is_dead_lettered_again(
    client, workers, tmp_path, env
):
    flag = tmp_path / "flaky-on"
    flag.write_text("1")
    workers.start(1, **FAST, FAULT_FLAG_FILE=str(flag))
    sent = await send_bursts(client, ["r1"], ["flaky a", "boom b"])
    assert await wait_applied(client, sent, timeout_s=30)
    assert len(await dead_letters(client)) == 2

    flag.unlink()  # the dependency is fixed: "flaky" now succeeds, "boom" still fails
    cli = [sys.executable, "-m", "worker", "dlq"]
    result = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [*cli, "redrive", "--rate", "50"], env=env, capture_output=True, text=True, check=True
        )
    )
    assert json.loads(result.stdout) == {"redriven": 2, "skipped": 0}

    async def settled():
        state = await client.state("r1")
        return state if state and state["applied_seq"] >= 4 else None

    state = await wait_for(settled, 30, "redriven messages")
    turns = [
        (t["seq"], t["user"], t["bot"] == client.settings.fallback_reply) for t in state["history"]
    ]
    assert turns == [
        (1, "flaky a", True),
        (2, "boom b", True),
        (3, "flaky a", False),
        (4, "boom b", True),
    ]
    [again] = await dead_letters(client)
    assert again["text"] == "boom b" and again["msg_id"].startswith("redrive:")
    listed = await anyio.to_thread.run_sync(
        lambda: subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, check=True)
    )
    assert [json.loads(line)["msg_id"] for line in listed.stdout.splitlines()] == [again["msg_id"]]
