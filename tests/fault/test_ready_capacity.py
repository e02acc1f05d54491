"""The ready set gets capacity under any backlog: a session whose holder was killed is taken
up within its lease plus one second, even while hundreds of new sessions keep every slot
busy (the reader must not take every freed slot before the resumer)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from redis_server import wait_until_async as poll

from dialog_worker.client.dialog_client import DialogClient

pytestmark = pytest.mark.fault

LEASE_MS = 2000


async def test_a_killed_workers_session_is_taken_up_within_lease_plus_one_second_behind_a_backlog(
    client: DialogClient, workers, tmp_path: Path
):
    flag = tmp_path / "hold"
    flag.touch()
    common = {
        "DIALOG_ENGINE": "fault_engine:make",
        "FAULT_FLAG_FILE": str(flag),
        "DIALOG_LOCK_TTL_MS": str(LEASE_MS),
        "DIALOG_VISIBILITY_TIMEOUT_MS": "60000",
    }
    (victim,) = workers.start(1, DIALOG_CONCURRENCY="1", **common)
    sk = client.keys.session("victim")
    await client.send("victim", "hold until the flag is gone")

    async def held_by_victim() -> bool:
        return str(await client.redis.get(sk.lock) or "").startswith("w1:")

    await poll(held_by_victim, 20, "the first worker to hold the session")
    # The backlog, appended after the held session: 300 sessions of slow steps, more than the
    # second worker can finish in many leases (300 x 0.3 s / 8 slots = 11 s).
    for i in range(300):
        await client.send(f"b{i}", "sleep 0.3 backlog")
    (survivor,) = workers.start(1, DIALOG_CONCURRENCY="8", **common)

    async def survivor_busy() -> bool:
        applied = 0
        for i in range(0, 300, 10):
            applied += int(await client.redis.hget(client.keys.session(f"b{i}").state, "a") or 0)
        return bool(await client.redis.exists(client.keys.session("b0").lock)) or applied > 0

    await poll(survivor_busy, 20, "the second worker to work the backlog")
    await asyncio.to_thread(victim.kill)
    killed_at = time.monotonic()
    flag.unlink()

    async def taken_up() -> bool:
        return str(await client.redis.get(sk.lock) or "").startswith("w2:") or (
            await client.redis.hget(sk.state, "a") == "1"
        )

    await poll(taken_up, 30, "the killed worker's session to be taken up", interval_s=0.02)
    waited_s = time.monotonic() - killed_at
    async with client.redis.pipeline(transaction=False) as pipe:
        for i in range(300):
            pipe.hget(client.keys.session(f"b{i}").state, "a")
        unfinished = sum(1 for a in await pipe.execute() if a != "1")
    print(
        f"\n[ready] taken up {waited_s:.2f}s after kill -9 (lease {LEASE_MS} ms); "
        f"{unfinished} backlog sessions still unfinished"
    )
    assert waited_s <= LEASE_MS / 1000 + 1, f"taken up only after {waited_s:.2f}s"
    assert unfinished > 100, "the backlog was gone before the session came back: no test"
    survivor.kill()
