"""An engine's own `fallback_reply` answers the messages that cannot be processed, in its
bot's language, on every path that dead-letters: a step that refuses the message, and an entry
malformed before any step (the intake script)."""

from __future__ import annotations

import anyio
import pytest
from worker_procs import WorkerPool

from dialog_worker import DialogClient
from dialog_worker.config import DEFAULT_FALLBACK_REPLY

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
