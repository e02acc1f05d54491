"""Sends whose outcome is unknown name their msg_id, and sends nobody will read are noticed.

- Redis paused longer than the client's socket timeout: `send` and `ask` raise
  UncertainSendError carrying the msg_id generated before the append; sending or asking again
  with it applies the message exactly once, whether the first append landed or not.
- A stream no consumer group reads: the first send of a client logs one warning, and an ask
  that times out says so."""

from __future__ import annotations

import logging
import time

import pytest
from redis.asyncio import Redis

from dialog_worker import DialogClient, ReplyTimeout, UncertainSendError
from dialog_worker.config import load_settings

pytestmark = pytest.mark.integration

PAUSE_MS = 6500  # the client's socket timeout is 5 s


async def _pause_writes(env: dict[str, str], ms: int) -> None:
    admin = Redis.from_url(env["REDIS_URL"])
    try:
        await admin.execute_command("CLIENT", "PAUSE", ms, "WRITE")
    finally:
        await admin.aclose()


async def test_an_ask_whose_append_timed_out_names_its_msg_id_and_asking_again_applies_once(
    client: DialogClient, workers, env: dict[str, str]
):
    workers.start(1)
    first = await client.ask("u1", "nama saya Budi", timeout=30)
    assert first.outcome == "applied"
    await _pause_writes(env, PAUSE_MS)
    started = time.monotonic()
    with pytest.raises(UncertainSendError) as caught:
        await client.ask("u1", "saya ada kendala billing", timeout=30)
    assert time.monotonic() - started < PAUSE_MS / 1000, "it waited out the pause"
    msg_id = caught.value.msg_id
    assert msg_id and caught.value.session_id == "u1"
    assert msg_id in str(caught.value) and "again" in str(caught.value)
    # The pause ends; the app asks again with the msg_id it was given.
    again = await client.ask("u1", "saya ada kendala billing", msg_id=msg_id, timeout=30)
    assert again.msg_id == msg_id and again.outcome in ("applied", "duplicate")
    state = await client.state("u1")
    assert state is not None
    assert [t["msg_id"] for t in state["history"]].count(msg_id) == 1
    applied = [
        f
        for _, f in await client.redis.xrange(client.keys.replies)
        if f["msg_id"] == msg_id and f["outcome"] == "applied"
    ]
    assert len(applied) == 1


async def test_a_send_whose_append_timed_out_raises_with_the_generated_msg_id(
    client: DialogClient, env: dict[str, str]
):
    await client.send("u2", "warm up: topology checked, connection open")
    await _pause_writes(env, PAUSE_MS)
    with pytest.raises(UncertainSendError) as caught:
        await client.send("u2", "halo")
    msg_id = caught.value.msg_id
    # After the pause the retry with that msg_id carries it: the workers see one msg_id.
    sent = await client.send("u2", "halo", msg_id=msg_id)
    assert sent.msg_id == msg_id
    entries = [f for _, f in await client.redis.xrange(client.keys.stream) if f["text"] == "halo"]
    assert entries and {f["msg_id"] for f in entries} == {msg_id}


async def test_send_generates_the_msg_id_it_returns(client: DialogClient):
    sent = await client.send("u3", "halo")
    ((_, fields),) = await client.redis.xrange(client.keys.stream)
    assert fields["msg_id"] == sent.msg_id != sent.entry_id


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dialog_worker.client.dialog_client" and r.levelno == logging.WARNING
    ]


async def test_a_stream_no_group_reads_is_warned_once_and_named_by_an_ask_timeout(
    env: dict[str, str], caplog: pytest.LogCaptureFixture
):
    settings = load_settings(environ=env).replace(stream="nobody-reads-this")
    async with DialogClient(settings=settings) as c:
        await c.send("s", "one")
        await c.send("s", "two")
        warned = _warnings(caplog)
        assert len(warned) == 1 and "'nobody-reads-this'" in warned[0]
        with pytest.raises(ReplyTimeout, match="no consumer group 'nobody-reads-this-workers'"):
            await c.ask("s", "three", timeout=0.5)
        assert await c.redis.xlen("nobody-reads-this") == 3  # sent all the same


async def test_a_stream_a_group_reads_is_not_warned(
    client: DialogClient, workers, caplog: pytest.LogCaptureFixture
):
    workers.start(1)
    await client.ask("s", "halo", timeout=30)  # the worker's group exists from here on
    caplog.clear()  # the fixture's client may have sent before the worker made its group
    async with DialogClient(settings=client.settings) as c:
        await c.send("s", "again")
    assert _warnings(caplog) == []


def test_an_uncertain_send_is_still_caught_as_a_redis_error():
    """Applications that retried on redis-py's errors before keep working (and can now read
    the msg_id from the error)."""
    import redis.exceptions

    exc = UncertainSendError("s", "m", redis.exceptions.TimeoutError("Timeout reading"))
    assert isinstance(exc, redis.exceptions.RedisError)
    assert isinstance(exc, redis.exceptions.ConnectionError)
