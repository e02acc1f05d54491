"""Usage metering under faults: workers killed (kill -9) and stopped (SIGSTOP) in the middle of
model calls. The tenant's counters must equal the usage of the committed replies exactly: a
killed attempt's usage is never counted, a fenced one only as wasted, none twice."""

from __future__ import annotations

import signal
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


@pytest.fixture
def provider() -> Iterator[Running]:
    # Slow answers: a kill or a stop lands in the middle of a call.
    with Running(output_tokens=6, latency_ms=600, chunks=3) as running:
        yield running


async def test_usage_counters_equal_committed_usage_after_kill_9_and_sigstop(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    llm = {
        **with_examples(env),
        **FAST,
        "DIALOG_ENGINE": "llm_engine:LLMEngine",
        "LLM_BASE_URL": f"{provider.url}/v1",
        "LLM_MODEL": "m",
        "LLM_MAX_TOKENS": "6",
        "DIALOG_MAX_ATTEMPTS": "20",
        "DIALOG_BACKOFF_BASE_MS": "50",
        "DIALOG_BACKOFF_MAX_MS": "200",
        "DIALOG_TENANT_PATTERN": "^(u)[0-9]",  # the sessions under test: tenant "u"
    }
    w1, w2, _w3 = workers.start(3, metrics=True, **llm)
    for i in range(6):  # every worker is up and reading
        await client.ask(f"warm{i}", "halo", timeout=30)
    provider.provider.reset()
    sessions = [f"u{i}" for i in range(24)]
    for text in ("satu", "dua", "tiga"):
        for sid in sessions:
            await client.send(sid, f"{text} {sid}")
    await anyio.sleep(0.9)
    w1.kill()  # mid-call: nothing of its attempts may count
    w2.signal(signal.SIGSTOP)  # its leases run out; its late commits are fenced
    await anyio.sleep(2.5)
    w2.signal(signal.SIGCONT)
    workers.start(1, **llm)

    async def all_answered() -> bool:
        events = await client.redis.xrange(client.keys.replies)
        mine = [f for _, f in events if f["session_id"] in sessions]
        return sum(1 for f in mine if f["outcome"] == "applied") >= 3 * len(sessions)

    await poll(all_answered, 90, what="every message applied")
    replies = [r async for r in client.replies(start="0", follow=False) if r.session_id in sessions]
    assert {r.outcome for r in replies} == {"applied"}
    assert len({(r.session_id, r.seq) for r in replies}) == len(replies) == 3 * len(sessions)
    assert all(r.usage is not None for r in replies)
    committed_in = sum(r.usage["input_tokens"] for r in replies if r.usage)
    committed_out = sum(r.usage["output_tokens"] for r in replies if r.usage)
    counted = await client.tenant_usage("u")
    assert (counted["input_tokens"], counted["output_tokens"], counted["calls"]) == (
        committed_in,
        committed_out,
        len(replies),
    ), "the counters are exactly the committed replies' usage"
    per_session = [await client.usage(sid) for sid in sessions]
    assert sum(u["input_tokens"] for u in per_session) == committed_in
    assert sum(u["calls"] for u in per_session) == len(replies)
    # The provider served what was committed, plus the calls of killed and fenced attempts:
    # some there were (the faults hit calls), and none of them was counted as committed.
    served = provider.provider.stats()["models"]["m"]
    wasted = counted["wasted"]
    assert served["calls"] > len(replies), "a fault landed in the middle of a call"
    assert served["prompt_tokens"] >= committed_in + wasted["input_tokens"]
    print(
        f"\ncommitted {committed_in}+{committed_out} tokens in {len(replies)} calls; wasted "
        f"{wasted['calls']} calls; provider served {served['calls']} calls "
        f"({served['prompt_tokens']} prompt tokens) at {time.time():.0f}"
    )
