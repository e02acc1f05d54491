"""Changing the shard count offline: sessions continue where they were."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest

from worker.client import DialogClient
from worker.config import load_settings
from worker.verify import Sent, check, send_bursts, wait_applied

pytestmark = pytest.mark.integration


def run(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_reshard_1_to_3_and_back_keeps_every_session_going(env, workers):
    texts = ["nama saya Budi", "keluhan satu"]
    sessions = [f"r{i}" for i in range(40)] + ["a{b}c", "x:lock"]
    sent: list[Sent] = []

    async def phase(extra: dict[str, str], text: str) -> None:
        settings = load_settings(environ={**env, **extra})
        async with DialogClient(settings=settings, max_connections=100) as c:
            new = await send_bursts(c, sessions, [text])
            sent.extend(new)
            procs = workers.start(1, **extra)
            assert await wait_applied(c, sent, timeout_s=30)
            # Replies of earlier phases stay in the old layout's reply streams (not moved).
            assert await check(c, new) == []
            for w in procs:
                assert await anyio.to_thread.run_sync(w.terminate) == 0

    await phase({}, texts[0])
    # A dead letter, which must follow its session to the new shard.
    async with DialogClient(settings=load_settings(environ=env)) as c:
        await c.redis.xadd(c.keys.dlq, {"session_id": "a{b}c", "text": "old", "error": "x"})

    moved = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "3"))
    assert moved.returncode == 0, moved.stderr
    report = json.loads(moved.stdout)
    assert report["sessions"] == len(sessions) and report["dead_letters"] == 1

    three = {"DIALOG_SHARDS": "3"}
    await phase(three, texts[1])  # seq 2 of every session, applied after seq 1: state moved
    listed = await anyio.to_thread.run_sync(lambda: run(env, "dlq", "list", **three))
    assert [json.loads(line)["session_id"] for line in listed.stdout.splitlines()] == ["a{b}c"]

    back = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "1", **three))
    assert back.returncode == 0, back.stderr
    await phase({}, "keluhan dua")
    async with DialogClient(settings=load_settings(environ=env)) as c:
        state = await c.state("a{b}c")
        assert [t["seq"] for t in state["history"]] == [1, 2, 3]
        assert state["memory"]["userName"] == "Budi"


async def test_reshard_refuses_a_queue_that_is_not_drained(env, client):
    await client.send("busy", "nama saya Budi")
    result = await anyio.to_thread.run_sync(lambda: run(env, "reshard", "--to", "2"))
    assert result.returncode == 1
    assert "not drained" in result.stderr
    assert await client.state("busy") is None
    assert await client.redis.xlen(client.keys.stream) == 1
