"""examples/reply_dispatcher.py as a real process: every reply reaches a local webhook that
fails its first call, and is acknowledged only once delivered."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from examples_path import EXAMPLES, with_examples
from http_stub import Answer, HttpStub
from redis_server import wait_until_async

from dialog_worker import DialogClient
from dialog_worker.ops.verify import send_bursts, wait_applied

pytestmark = pytest.mark.integration


class FlakyWebhook:
    """500 for the very first POST, 200 after that."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, method: str, path: str, body: Any) -> Answer:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        return (500, {}, {"error": "try again"}) if first else (200, {}, {"ok": True})


@pytest.fixture
def webhook() -> Iterator[HttpStub]:
    with HttpStub(FlakyWebhook()) as stub:
        yield stub


def start_dispatcher(env: dict[str, str], url: str, consumer: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / "reply_dispatcher.py"), url, "--consumer", consumer],
        env=with_examples(env),
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    return err


async def group_exists(client: DialogClient) -> bool:
    try:
        groups = await client.redis.xinfo_groups(client.keys.replies)
    except Exception:
        return False
    return any(g["name"] == "outbound" for g in groups)


async def test_dispatcher_delivers_every_reply_and_retries_a_failed_post(
    client: DialogClient, workers, env: dict[str, str], webhook: HttpStub
):
    workers.start(1)
    proc = start_dispatcher(env, f"{webhook.url}/hooks/replies", "d1")
    try:
        await wait_until_async(lambda: group_exists(client), 20, "the outbound group")
        sent = await send_bursts(
            client, [f"wh{i}" for i in range(10)], ["nama saya Budi", "saya ada kendala billing"]
        )

        async def all_delivered() -> bool:
            return len({b["id"] for b in webhook.bodies()}) == len(sent)

        await wait_until_async(all_delivered, 30, "every reply posted to the webhook")

        async def all_acked() -> bool:
            pending = await client.redis.xpending(client.keys.replies, "outbound")
            return int(pending["pending"]) == 0

        await wait_until_async(all_acked, 10, "every delivered reply acknowledged")
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    bodies = webhook.bodies("/hooks/replies")
    assert len(bodies) == len(sent) + 1, "the first POST failed and was made again"
    assert "retrying" in err
    by_msg = {b["msg_id"]: b for b in bodies}
    for s in sent:
        got = by_msg[s.msg_id]
        assert got["session_id"] == s.session_id
        expected = (
            "Halo Budi, ada yang bisa dibantu?"
            if s.text.startswith("nama")
            else f'Mencatat keluhan Anda: "{s.text}". Tim kami akan meninjau.'
        )
        assert got["text"] == expected
    keys = [r["headers"]["Idempotency-Key"] for r in webhook.requests]
    assert keys[0] == keys[1], "the retry carried the same idempotency key"


@pytest.fixture
def accepting_webhook() -> Iterator[HttpStub]:
    with HttpStub(lambda method, path, body: (200, {}, {"ok": True})) as stub:
        yield stub


async def wait_acked(client: DialogClient) -> None:
    async def all_acked() -> bool:
        groups = await client.redis.xinfo_groups(client.keys.replies)
        (group,) = [g for g in groups if g["name"] == "outbound"]
        pending = await client.redis.xpending(client.keys.replies, "outbound")
        return (
            int(pending["pending"]) == 0
            and group["last-delivered-id"]
            == ((await client.redis.xrevrange(client.keys.replies, count=1))[0][0])
        )

    await wait_until_async(all_acked, 20, "every reply read and acknowledged")


async def test_replies_written_before_the_dispatchers_first_start_are_delivered(
    client: DialogClient, workers, env: dict[str, str], accepting_webhook: HttpStub
):
    workers.start(1)
    sent = await send_bursts(client, [f"early{i}" for i in range(4)], ["nama saya Budi"])
    assert await wait_applied(client, sent, timeout_s=20)
    proc = start_dispatcher(env, f"{accepting_webhook.url}/hooks/replies", "d1")
    try:

        async def all_delivered() -> bool:
            return len(accepting_webhook.bodies()) >= len(sent)

        await wait_until_async(all_delivered, 20, "the 4 earlier replies posted")
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    assert sorted(b["msg_id"] for b in accepting_webhook.bodies()) == sorted(s.msg_id for s in sent)


async def test_a_message_sent_twice_is_answered_once(
    client: DialogClient, workers, env: dict[str, str], accepting_webhook: HttpStub
):
    workers.start(1)
    proc = start_dispatcher(env, f"{accepting_webhook.url}/hooks/replies", "d1")
    try:
        await wait_until_async(lambda: group_exists(client), 20, "the outbound group")
        for _ in range(2):  # a producer's retry: the same msg_id again
            await client.send("twice", "nama saya Budi", msg_id="web-1")
        await client.send("twice", "saya ada kendala billing", msg_id="web-2")

        async def outcomes() -> list[str]:
            events = await client.redis.xrange(client.keys.replies)
            return [f["outcome"] for _, f in events]

        await wait_until_async(
            lambda: _equals(outcomes(), ["applied", "duplicate", "applied"]), 20, "3 events"
        )
        await wait_acked(client)
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    posted = [(r["body"]["msg_id"], r["body"]["outcome"]) for r in accepting_webhook.requests]
    assert posted == [("web-1", "applied"), ("web-2", "applied")]
    keys = [r["headers"]["Idempotency-Key"] for r in accepting_webhook.requests]
    assert len(set(keys)) == 2


async def _equals(got: Any, expected: Any) -> bool:
    return bool(await got == expected)
