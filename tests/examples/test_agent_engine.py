"""examples/agent_engine.py in real workers: an approval that survives a worker's restart,
each tool called once per message, a decline, and the answer without a person below the
approval threshold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from examples_path import with_examples
from redis_server import wait_for

from dialog_worker import DialogClient

pytestmark = pytest.mark.integration


def applied(url: str, sid: str) -> list[str]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [f["reply"] for _, f in r.xrange("dialog-replies") if f["session_id"] == sid
            and f["outcome"] == "applied"]  # fmt: skip


def start(workers: Any, env: dict[str, str]) -> None:
    workers.env = with_examples(env)
    workers.start(1, DIALOG_ENGINE="agent_engine:RefundAgent")


async def test_a_refund_waits_for_approval_across_a_restart_and_is_made_once(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, env)
    asked = await client.ask("a1", "refund A-17", timeout=20)
    assert asked.outcome == "awaiting"
    assert asked.payload == {"question": "Refund 80 EUR for the headphones?",
                             "choices": [True, False]}  # fmt: skip
    for w in workers.procs:
        w.kill()  # the prompt is in Redis, not in a worker
    start(workers, env)
    [waiting] = await client.pending("a1")
    assert (await client.resume("a1", waiting.interrupt_id, True)).status == "resumed"
    assert (await client.resume("a1", waiting.interrupt_id, True)).status == "already_resumed"
    url = env["REDIS_URL"]
    assert await wait_for(lambda: applied(url, "a1")) == ["Refunded 80 EUR (R-A-17)."]
    # The lookup ran in the first worker, before the restart; the second one got it from the
    # journal. Its history turn keeps the event the step asked to keep.
    state = await client.state("a1")
    assert state is not None
    assert state["history"][-1]["events"] == [
        {"kind": "tool", "data": {"name": "lookup_order", "state": "done"}}
    ]


async def test_a_declined_refund_is_not_made_and_a_small_one_needs_nobody(
    workers: Any, client: DialogClient, env: dict[str, str]
) -> None:
    start(workers, env)
    asked = await client.ask("a2", "refund A-17", timeout=20)
    assert asked.interrupt_id is not None
    await client.resume("a2", asked.interrupt_id, False)
    url = env["REDIS_URL"]
    assert await wait_for(lambda: applied(url, "a2")) == ["The refund was declined."]
    small = await client.ask("a3", "refund B-2", timeout=20)
    assert (small.outcome, small.text) == ("applied", "Refunded 9 EUR (R-B-2).")
