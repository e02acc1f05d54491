"""An engine's own `fallback_reply` answers the messages that cannot be processed, in its
bot's language, on every path that dead-letters: a step that refuses the message, and an entry
malformed before any step (the intake script). Its own `budget_reply` answers a message over
its tenant's budget; without one (and without DIALOG_BUDGET_REPLY) the default is English."""

from __future__ import annotations

import anyio
import pytest
from worker_procs import WorkerPool

from dialog_worker import DialogClient
from dialog_worker.config import DEFAULT_BUDGET_REPLY, DEFAULT_FALLBACK_REPLY
from dialog_worker.store import tenants

pytestmark = pytest.mark.integration

ENGLISH = "Sorry, we could not process your message. Please try again later."


async def test_an_engines_fallback_reply_answers_dead_lettered_messages(
    client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1, DIALOG_ENGINE="app_engines:English")
    ok = await client.ask("en-1", "hello", timeout=20)
    assert (ok.outcome, ok.text) == ("applied", "you said hello")
    refused = await client.ask("en-1", "poison", timeout=20)
    assert (refused.outcome, refused.text) == ("dead_lettered", ENGLISH)

    # Malformed before any step: a session id but no text.
    await client.redis.xadd(client.keys.stream, {"session_id": "en-2", "msg_id": "raw-1"})
    with anyio.fail_after(20):
        async for reply in client.replies(start="0", follow=True):
            if reply.session_id == "en-2":
                assert (reply.outcome, reply.text) == ("dead_lettered", ENGLISH)
                break


async def test_dialog_fallback_reply_when_set_wins_over_the_engines(
    client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1, DIALOG_ENGINE="app_engines:English", DIALOG_FALLBACK_REPLY="Oops.")
    refused = await client.ask("en-3", "poison", timeout=20)
    assert (refused.outcome, refused.text) == ("dead_lettered", "Oops.")
    assert DEFAULT_FALLBACK_REPLY != ENGLISH


@pytest.mark.parametrize(
    ("engine", "setting", "answer"),
    [
        ("PoliteUsageEngine", {}, "You have used today's messages; see you tomorrow."),
        ("UsageEngine", {}, DEFAULT_BUDGET_REPLY),
        ("PoliteUsageEngine", {"DIALOG_BUDGET_REPLY": "Kuota habis."}, "Kuota habis."),
    ],
)
async def test_an_engines_budget_reply_answers_a_message_over_its_tenants_budget(
    client: DialogClient, workers: WorkerPool, engine: str, setting: dict[str, str], answer: str
) -> None:
    workers.start(
        1, DIALOG_ENGINE=f"usage_engines:{engine}", DIALOG_TENANT_DAILY_TOKENS="10", **setting
    )
    await client.redis.hset(client.keys.budget("default", tenants.today()).meter, "spent", 10)
    reply = await client.ask("b-en", "halo", timeout=20)
    assert (reply.outcome, reply.text) == ("budget_exceeded", answer)
    assert DEFAULT_BUDGET_REPLY.startswith("Sorry")
