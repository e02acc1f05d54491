"""Two deployments on one Redis, told apart only by DIALOG_STREAM (contract v2 section 2): the
default one and `DIALOG_STREAM=echo`, side by side. Neither sees the other's replies, dead
letters or stats, and redrive sends a dead letter back only to the stream it came from."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest
from worker_procs import WorkerPool

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.ops.verify import send_bursts, wait_applied
from dialog_worker.store.stream_entries import xrange

pytestmark = pytest.mark.integration

ENGINE = {"DIALOG_ENGINE": "fault_engine:make"}  # "fatal ..." is dead-lettered at once


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def acli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: cli(env, *args))


async def test_echo_and_default_deployments_share_no_replies_dead_letters_or_stats(
    env: dict[str, str], client: DialogClient, workers: WorkerPool
) -> None:
    echo_env = {**env, "DIALOG_STREAM": "echo"}
    workers.start(1, **ENGINE)
    workers.start(1, **ENGINE, DIALOG_STREAM="echo")
    async with DialogClient(settings=load_settings(environ=echo_env)) as echo:
        assert (echo.keys.group, echo.keys.replies, echo.keys.dlq) == (
            "echo-workers",
            "echo-replies",
            "echo-dlq",
        )
        mine = await send_bursts(client, ["d1"], ["nama saya Budi", "fatal default"])
        theirs = await send_bursts(echo, ["e1"], ["nama saya Echo", "fatal echo"])
        assert await wait_applied(client, mine, timeout_s=30)
        assert await wait_applied(echo, theirs, timeout_s=30)

        replies = {
            name: {f["session_id"] for _, f in await xrange(client.redis, name)}
            for name in ("dialog-replies", "echo-replies")
        }
        assert replies == {"dialog-replies": {"d1"}, "echo-replies": {"e1"}}
        dead = {
            name: [f["text"] for _, f in await xrange(client.redis, name)]
            for name in ("dialog-dlq", "echo-dlq")
        }
        assert dead == {"dialog-dlq": ["fatal default"], "echo-dlq": ["fatal echo"]}

        stats = json.loads((await acli(env, "stats")).stdout)
        echo_stats = json.loads((await acli(echo_env, "stats")).stdout)
        assert (stats["dlq_length"], echo_stats["dlq_length"]) == (1, 1)

        # The default deployment's redrive touches only its own dead letter, and sends it
        # back into its own stream: echo's engine never sees it, and echo's DLQ keeps its own.
        redriven = await acli(env, "dlq", "redrive")
        assert redriven.returncode == 0, redriven.stderr
        assert json.loads(redriven.stdout) == {"redriven": 1, "skipped": 0}
        assert [f["text"] for _, f in await xrange(client.redis, "echo-dlq")] == ["fatal echo"]
        state = await echo.state("e1")
        assert state is not None and [t["user"] for t in state["history"]] == [
            "nama saya Echo",
            "fatal echo",
        ]


async def test_redrive_skips_a_dead_letter_from_another_stream_and_keeps_it(
    env: dict[str, str], client: DialogClient
) -> None:
    """A DLQ shared on purpose (DIALOG_DLQ_STREAM set alike in two deployments): a dead letter
    whose source_stream is the other deployment's stays for that deployment's redrive."""
    foreign = await client.redis.xadd(
        client.keys.dlq,
        {"session_id": "e2", "msg_id": "m", "text": "halo", "source_stream": "echo"},
    )
    own = await client.redis.xadd(
        client.keys.dlq,
        {"session_id": "d2", "msg_id": "m", "text": "halo", "source_stream": client.keys.stream},
    )
    result = await acli(env, "dlq", "redrive")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"redriven": 1, "skipped": 1}
    assert "echo" in result.stderr
    assert [i for i, _ in await xrange(client.redis, client.keys.dlq)] == [foreign]
    inbound = [f["session_id"] for _, f in await xrange(client.redis, client.keys.stream)]
    assert inbound == ["d2"], own
    assert not await client.redis.exists("echo")
