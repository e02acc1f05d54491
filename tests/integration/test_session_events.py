"""A session's feed (`DialogClient.events`, the gateway's ``/events``) against a real worker:
when a reader is told to start over (``resync``) and when it must not be."""

from __future__ import annotations

import contextlib

import anyio
import pytest
import redis

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.session_events import SessionEvent

pytestmark = pytest.mark.integration


async def test_a_duplicate_send_is_a_turn_of_its_own_and_no_open_feed_starts_over(
    workers, client: DialogClient
) -> None:
    """A message sent again with its msg_id is answered ``duplicate`` with the original seq:
    a seq the feed has shown, but not a restart of the session, so the page keeps what it
    shows (no ``resync``) and the next message follows."""
    workers.start(1)
    await client.ask("ev-dup", "nama saya Budi", msg_id="m1", timeout=20)
    got: list[SessionEvent] = []
    with anyio.fail_after(20):
        async with contextlib.aclosing(client.events("ev-dup")) as feed:
            async for event in feed:
                if event.kind == "idle":
                    continue
                got.append(event)
                if len(got) == 1:
                    await client.send("ev-dup", "nama saya Budi", msg_id="m1")  # sent again
                elif len(got) == 2:
                    await client.send("ev-dup", "internet mati", msg_id="m2")
                elif event.data.get("seq") == 2:
                    break
    assert [(e.kind, e.data.get("seq"), e.data.get("outcome")) for e in got] == [
        ("turn", 1, "applied"),
        ("turn", 1, "duplicate"),
        ("turn", 2, "applied"),
    ]


async def test_a_reader_back_after_the_reply_stream_was_emptied_is_resynced(
    workers, client: DialogClient, env: dict[str, str]
) -> None:
    """A reader took the first turn's cursor and went away; the second turn landed, then the
    reply stream was trimmed to nothing (MAXLEN, an operator's XTRIM). Coming back from its
    cursor it cannot read what it missed from the stream: it is told to start over with the
    turns the session keeps, never left with a silent hole."""
    workers.start(1)
    await client.ask("ev-empty", "nama saya Budi", timeout=20)
    with anyio.fail_after(20):
        async with contextlib.aclosing(client.events("ev-empty")) as feed:
            first = await anext(feed)
    assert first.kind == "turn" and first.cursor is not None
    await client.ask("ev-empty", "internet mati", timeout=20)
    redis.Redis.from_url(env["REDIS_URL"]).xtrim("dialog-replies", maxlen=0, approximate=False)
    with anyio.fail_after(20):
        async with contextlib.aclosing(client.events("ev-empty", first.cursor)) as feed:
            back = await anext(feed)  # without the resync: "idle" after 5 s, turn 2 missed
    assert (back.kind, back.data.get("reason")) == ("resync", "gap")
    assert [t["seq"] for t in back.data["turns"]] == [1, 2]
