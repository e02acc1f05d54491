"""Tenant-fair turns at a limit key under faults: a worker killed (kill -9) while its sessions
hold turns at the key and wait in its tenants' queues. No turn is lost for good (every message
is answered once, at the key's rate), and once the dead worker's leases end the tenants still
share the key's turns equally (lua/acquire-3.lua)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anyio
import pytest
from examples_path import with_examples
from redis_server import wait_until_async as poll

from dialog_worker import DialogClient
from dialog_worker.bench.fake_provider import Running

pytestmark = pytest.mark.fault

FAST = {
    "DIALOG_LOCK_TTL_MS": "1000",
    "DIALOG_VISIBILITY_TIMEOUT_MS": "2000",
    "DIALOG_RECLAIM_INTERVAL_MS": "200",
}
KEY = "llm:m"


@pytest.fixture
def provider() -> Iterator[Running]:
    with Running(output_tokens=6, latency_ms=100) as running:
        yield running


async def test_a_killed_worker_loses_no_turn_and_skews_no_share_at_the_key(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    llm = {
        **with_examples(env),
        **FAST,
        "DIALOG_ENGINE": "llm_engine:LLMEngine",
        "LLM_BASE_URL": f"{provider.url}/v1",
        "LLM_MODEL": "m",
        "LLM_MAX_TOKENS": "6",
        "DIALOG_CONCURRENCY": "8",
        "DIALOG_MAX_ATTEMPTS": "20",
        "DIALOG_MODEL_LIMITS": json.dumps({KEY: {"rpm": 600}}),  # 10 calls a second
    }
    w1, _w2 = workers.start(2, **llm)
    for i in range(4):
        await client.ask(f"warm{i}", "halo", timeout=30)
    n = 80
    async with client.redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            for tenant in ("a", "b"):
                pipe.xadd(
                    client.keys.stream,
                    {"session_id": f"{tenant}-{i}", "text": "halo", "tenant": tenant},
                )
        await pipe.execute()
    await anyio.sleep(1.5)
    w1.kill()  # its sessions held turns and waited in the queues at the key
    killed_at = time.time()
    workers.start(1, **llm)

    async def answered() -> dict[str, float]:
        done: dict[str, float] = {}
        async for r in client.replies(start="0", follow=False):
            if r.outcome == "applied" and r.session_id[:2] in ("a-", "b-"):
                assert r.session_id not in done, f"{r.session_id} answered twice"
                done[r.session_id] = int(r.id.split("-")[0]) / 1000
        return done

    async def all_answered() -> bool:
        return len(await answered()) == 2 * n

    # 160 calls at 10 a second, plus the dead worker's leases: no turn kept for good.
    await poll(all_answered, 90, what="every message answered")
    done = await answered()
    assert await client.redis.xlen(client.keys.dlq) == 0
    # After the leases end (the lock TTL, the reclaim, the queue's grace for a caller that
    # does not come back is far longer), both tenants still have backlogs for a while: their
    # shares of the key's turns in that window are equal (within a loaded machine's noise).
    start = killed_at + 3.0
    end = min(max(t for s, t in done.items() if s.startswith(p)) for p in ("a-", "b-"))
    window = {p: sum(1 for s, t in done.items() if s.startswith(p) and start <= t < end)
              for p in ("a-", "b-")}  # fmt: skip
    assert sum(window.values()) >= 20, window
    # The key's rate is used (no turn kept for a dead caller holds it up): 10 calls a second.
    assert sum(window.values()) / (end - start) >= 8.0, window
    assert 0.6 <= window["a-"] / max(1, window["b-"]) <= 1.67, window
