"""DialogClient.ask / replies / ack and the `ask` and `replies` commands, on a real redis-server.

The worker's side is played by tests/support/fake_replier.py (one reply event per message, with
every field a worker writes), or by events the tests add themselves, so these tests pin the
client's behaviour on its own: routing by (session_id, msg_id), one reader per reply stream,
timeouts, failures, consumer groups and their redelivery. The same paths with real workers are
in test_application_side.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import pytest_asyncio
from fake_replier import FALLBACK, fake_replier
from redis.asyncio import Redis
from redis_server import wait_until_async

from dialog_worker import DialogClient, Reply, ReplyStreamError, ReplyTimeout
from dialog_worker.config import load_settings
from dialog_worker.errors import ValidationError
from dialog_worker.store.keys import Topology

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture
async def replier(env: dict[str, str]) -> AsyncIterator[None]:
    """The fake worker, on its own connection, for the plain and any sharded layout (it reads
    every shard's inbound stream of the settings it is given)."""
    async with _replier(env):
        yield


@contextlib.asynccontextmanager
async def _replier(env: dict[str, str], **settings: Any) -> AsyncIterator[None]:
    s = load_settings(environ=env).replace(**settings)
    redis = Redis.from_url(s.redis_url, decode_responses=True)
    task = asyncio.create_task(fake_replier(redis, s))
    try:
        yield
    finally:
        await stop(task)
        await redis.aclose()


async def stop(task: asyncio.Task[Any]) -> None:
    """Cancel until done: redis-py may turn a cancellation in mid-read into a connection
    error, which the fake worker's redis-py retry then rides out."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.2)


def router_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("dialog-reply-router")]


def event(session_id: str = "s", msg_id: str = "m", **extra: str) -> dict[str, str]:
    return {
        "session_id": session_id,
        "msg_id": msg_id,
        "seq": "1",
        "outcome": "applied",
        "reply": f"reply to {msg_id}",
        "produced_at": "1700000000000",
        "entry_id": "1700000000000-0",
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# ask


async def test_ask_returns_the_reply_event_of_its_own_message(client: DialogClient, replier):
    rep = await client.ask("a1", "halo", timeout=10)
    assert isinstance(rep, Reply)
    assert (rep.session_id, rep.seq, rep.outcome, rep.text) == ("a1", 1, "applied", "echo: halo")
    assert len(rep.msg_id) == 32, "ask sends with a generated msg_id"
    assert rep.stream == client.keys.replies and rep.group is None
    assert rep.id and rep.entry_id and rep.produced_at
    again = await client.ask("a1", "lagi", msg_id="my-id", timeout=10)
    assert (again.msg_id, again.seq, again.text) == ("my-id", 2, "echo: lagi")


async def test_300_concurrent_asks_over_100_sessions_each_get_their_own_reply(
    client: DialogClient, replier
):
    results: dict[int, Reply] = {}

    async def one(i: int) -> None:
        results[i] = await client.ask(f"c{i % 100}", f"pesan {i}", timeout=30)

    async with anyio.create_task_group() as tg:
        for i in range(300):
            tg.start_soon(one, i)
    assert len(results) == 300
    for i, rep in results.items():
        assert (rep.session_id, rep.text) == (f"c{i % 100}", f"echo: pesan {i}")
    assert len(router_tasks()) == 1, "one read loop per reply stream, not one per ask"
    assert client.waiting_replies == 0


async def test_asks_across_reply_shards_use_one_reader_per_shard(env: dict[str, str]):
    settings = load_settings(environ=env).replace(shards=3)
    async with _replier(env, shards=3), DialogClient(settings=settings) as c:
        replies = await asyncio.gather(*(c.ask(f"sh{i}", f"x{i}", timeout=20) for i in range(30)))
        assert [r.text for r in replies] == [f"echo: x{i}" for i in range(30)]
        streams = {r.stream for r in replies}
        assert streams == {k.replies for k in Topology.from_settings(settings).shards}
        assert len(router_tasks()) == 3


@pytest.mark.parametrize(
    ("text", "outcome", "reply"),
    [("fatal: refused", "dead_lettered", FALLBACK), ("dup again", "duplicate", "echo: dup again")],
)
async def test_ask_ends_on_every_outcome(
    client: DialogClient, replier, text: str, outcome: str, reply: str
):
    rep = await client.ask("o1", text, timeout=10)
    assert (rep.outcome, rep.text) == (outcome, reply)


async def test_ask_timeout_raises_a_clear_error_and_leaves_nothing_behind(
    client: DialogClient, replier
):
    started = time.monotonic()
    with pytest.raises(ReplyTimeout) as caught:
        await client.ask("t1", "silent please", msg_id="quiet-1", timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2
    assert isinstance(caught.value, TimeoutError)
    assert "quiet-1" in str(caught.value) and "0.3 s" in str(caught.value)
    assert client.waiting_replies == 0
    # The client is still fine afterwards.
    assert (await client.ask("t1", "halo", timeout=10)).text == "echo: halo"


async def test_ask_again_with_the_same_msg_id_gets_the_late_reply(client: DialogClient):
    """A reply that arrives after a timeout is waited for by asking again with the msg_id."""
    with pytest.raises(ReplyTimeout):
        await client.ask("late", "silent", msg_id="late-1", timeout=0.2)
    second = asyncio.create_task(client.ask("late", "silent", msg_id="late-1", timeout=10))
    await wait_until_async(_waiting(client, 1), 5, "the second ask to wait")
    await wait_until_async(_sent(client, 2), 5, "the second send")
    # A worker answers the second entry as a duplicate (an event naming that entry).
    [(resent, _)] = await client.redis.xrevrange(client.keys.stream, count=1)
    await client.redis.xadd(
        client.keys.replies, event("late", "late-1", outcome="duplicate", entry_id=resent)
    )
    assert (await second).outcome == "duplicate"


def _sent(client: DialogClient, n: int):
    async def check() -> bool:
        return await client.redis.xlen(client.keys.stream) >= n

    return check


def _waiting(client: DialogClient, n: int):
    async def check() -> bool:
        return client.waiting_replies == n

    return check


async def test_a_reply_already_in_the_stream_before_the_ask_is_not_taken_for_its_answer(
    client: DialogClient,
):
    """The reader starts at the newest event that existed before the send: an old event with
    the same session and msg_id is not this message's reply."""
    await client.redis.xadd(client.keys.replies, event("old", "reused"))
    with pytest.raises(ReplyTimeout):
        await client.ask("old", "silent", msg_id="reused", timeout=0.5)


async def test_invalid_bytes_in_reply_events_do_not_stop_the_reader(client: DialogClient):
    waiting = asyncio.create_task(client.ask("b1", "silent", msg_id="b-1", timeout=10))
    await wait_until_async(_waiting(client, 1), 5, "the ask to wait")
    raw = Redis.from_url(client.settings.redis_url)  # bytes, as a foreign producer would write
    try:
        await raw.xadd(client.keys.replies, {b"\xff\xfe": b"\xc3\x28", b"session_id": b"\xff"})
        await raw.xadd(
            client.keys.replies,
            {
                b"session_id": b"b1",
                b"msg_id": b"b-1",
                b"seq": b"99999999999999999999999",
                b"outcome": b"applied",
                b"reply": b"ok \xff\xfe",
            },
        )
    finally:
        await raw.aclose()
    rep = await waiting
    assert rep.text == "ok \ufffd\ufffd"
    assert rep.seq is None, "a number too long to be a seq is not trusted"
    assert rep.produced_at is None and rep.entry_id == ""


async def test_a_failing_reader_fails_the_waiting_asks_instead_of_hanging(client: DialogClient):
    waiting = asyncio.create_task(client.ask("f1", "silent", msg_id="f-1", timeout=30))
    await wait_until_async(_waiting(client, 1), 5, "the ask to wait")
    # The reply stream turns into a string: every XREAD now fails with WRONGTYPE.
    await client.redis.delete(client.keys.replies)
    await client.redis.set(client.keys.replies, "not a stream")
    started = time.monotonic()
    with pytest.raises(ReplyStreamError, match="WRONGTYPE"):
        await waiting
    assert time.monotonic() - started < 5
    assert client.waiting_replies == 0
    # Once the stream is fixed, the next ask starts a new reader and works.
    await client.redis.delete(client.keys.replies)
    async with _replier(_env_of(client)):
        assert (await client.ask("f1", "halo", timeout=10)).text == "echo: halo"


def _env_of(client: DialogClient) -> dict[str, str]:
    return {"REDIS_URL": client.settings.redis_url}


async def test_closing_the_client_fails_waiting_asks(env: dict[str, str]):
    c = DialogClient(settings=load_settings(environ=env))
    waiting = asyncio.create_task(c.ask("z1", "silent", timeout=30))
    await wait_until_async(_waiting(c, 1), 5, "the ask to wait")
    await c.aclose()
    with pytest.raises(ReplyStreamError, match="closed"):
        await waiting
    assert router_tasks() == []


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True])
async def test_ask_refuses_a_bad_timeout_before_sending(client: DialogClient, bad: Any):
    with pytest.raises(ValidationError, match="timeout"):
        await client.ask("v1", "halo", timeout=bad)
    assert await client.redis.xlen(client.keys.stream) == 0


# ---------------------------------------------------------------------------------------------
# replies(): consumer groups


async def add_events(client: DialogClient, n: int, prefix: str = "e") -> list[str]:
    return [
        await client.redis.xadd(client.keys.replies, event(f"s{i % 7}", f"{prefix}{i}"))
        for i in range(n)
    ]


async def consume(
    client: DialogClient, group: str, consumer: str, into: list[Reply], ack: bool = True, **kw: Any
) -> None:
    async for rep in client.replies(group=group, consumer=consumer, **kw):
        into.append(rep)
        if ack:
            assert await client.ack(rep) == 1


async def pending(client: DialogClient, group: str) -> int:
    return int((await client.redis.xpending(client.keys.replies, group))["pending"])


async def test_two_consumers_of_a_group_see_each_event_once_after_acks(client: DialogClient):
    first: list[Reply] = []
    second: list[Reply] = []
    # Created before any event: the group starts at "$", the events after it all count.
    async with client.replies(group="out", consumer="c1"):
        pass
    ids = await add_events(client, 200)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: consume(client, "out", "c1", first, count=5))
        tg.start_soon(lambda: consume(client, "out", "c2", second, count=5))

        async def all_seen() -> bool:
            return len(first) + len(second) >= 200

        await wait_until_async(all_seen, 20, "every event read")
        tg.cancel_scope.cancel()
    got = [r.id for r in first + second]
    assert sorted(got) == sorted(ids), "each event exactly once across the group"
    assert first and second, "both consumers took a share"
    assert {r.group for r in first + second} == {"out"}
    assert await pending(client, "out") == 0


async def test_events_a_killed_consumer_read_but_never_acked_go_to_another(
    client: DialogClient, env: dict[str, str]
):
    await client.redis.xgroup_create(client.keys.replies, "out", id="$", mkstream=True)
    script = (
        "import asyncio\n"
        "from dialog_worker import DialogClient\n"
        "async def main():\n"
        "    async with DialogClient() as c:\n"
        "        async for rep in c.replies(group='out', consumer='doomed', count=10):\n"
        "            print(rep.id, flush=True)\n"
        "asyncio.run(main())\n"
    )
    doomed = spawn(env, "-c", script)
    try:
        ids = await add_events(client, 150)
        assert doomed.stdout is not None
        read = await anyio.to_thread.run_sync(
            lambda: [doomed.stdout.readline().strip() for _ in ids]
        )
        assert sorted(read) == sorted(ids)
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
    assert await pending(client, "out") == 150, "read, never acknowledged"

    heir: list[Reply] = []
    async with anyio.create_task_group() as tg:
        # count=10: XAUTOCLAIM scans at most 100 pending entries per call, so taking all 150
        # needs the cursor loop.
        tg.start_soon(lambda: consume(client, "out", "heir", heir, claim_idle_ms=300, count=10))

        async def all_taken() -> bool:
            return len(heir) >= 150

        await wait_until_async(all_taken, 20, "the dead consumer's events redelivered")
        tg.cancel_scope.cancel()
    assert sorted(r.id for r in heir) == sorted(ids)
    assert await pending(client, "out") == 0


async def test_a_restarted_consumer_gets_its_own_unacked_events_back_first(client: DialogClient):
    async with client.replies(group="out", consumer="pod-1"):
        pass
    ids = await add_events(client, 5)
    first: list[Reply] = []
    await consume(client, "out", "pod-1", first, ack=False, follow=False)
    assert [r.id for r in first] == ids
    again: list[Reply] = []
    await consume(client, "out", "pod-1", again, follow=False)
    assert [r.id for r in again] == ids
    assert await pending(client, "out") == 0


async def test_pending_events_trimmed_from_the_stream_are_dropped_not_stuck(client: DialogClient):
    async with client.replies(group="out", consumer="pod-1"):
        pass
    ids = await add_events(client, 4)
    read: list[Reply] = []
    await consume(client, "out", "pod-1", read, ack=False, follow=False)
    await client.redis.xdel(client.keys.replies, ids[0], ids[2])
    again: list[Reply] = []
    await consume(client, "out", "pod-1", again, follow=False)
    assert [r.id for r in again] == [ids[1], ids[3]]
    assert await pending(client, "out") == 0


async def test_group_created_at_zero_takes_the_events_already_kept(client: DialogClient):
    ids = await add_events(client, 3)
    got: list[Reply] = []
    await consume(client, "archive", "a", got, start="0", follow=False)
    assert [r.id for r in got] == ids
    assert got[0].text == "reply to e0" and got[0].seq == 1


# ---------------------------------------------------------------------------------------------
# replies(): plain tail


async def test_tail_reads_from_a_given_point_and_needs_no_ack(client: DialogClient):
    ids = await add_events(client, 3)
    everything = [r async for r in client.replies(start="0", follow=False)]
    assert [r.id for r in everything] == ids
    assert [r async for r in client.replies(start=ids[1], follow=False)] == everything[2:]
    with pytest.raises(ValidationError, match="without a consumer group"):
        await client.ack(everything[0])


async def test_tail_from_now_sees_only_new_events(client: DialogClient):
    await add_events(client, 3, prefix="old")
    got: list[Reply] = []
    async with client.replies() as live:
        new = await add_events(client, 2, prefix="new")
        async for rep in live:
            got.append(rep)
            if len(got) == 2:
                break
    assert [r.id for r in got] == new


async def test_closing_a_subscription_ends_an_iteration_waiting_in_another_task(
    client: DialogClient,
):
    subscription = client.replies(group="out", consumer="c1")
    got: list[Reply] = []

    async def iterate() -> None:
        async for rep in subscription:
            got.append(rep)

    task = asyncio.create_task(iterate())
    await wait_until_async(lambda: _group_exists(client, "out"), 5, "the group")
    await subscription.aclose()
    await asyncio.wait_for(task, 5)
    assert got == []


async def _group_exists(client: DialogClient, group: str) -> bool:
    if not await client.redis.exists(client.keys.replies):
        return False
    groups = await client.redis.xinfo_groups(client.keys.replies)
    return any(g["name"] == group for g in groups)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": "latest"}, "start"),
        ({"count": 0}, "count"),
        ({"claim_idle_ms": 0}, "claim_idle_ms"),
        ({"group": ""}, "group"),
        ({"group": "g", "consumer": "a\nb"}, "consumer"),
    ],
)
def test_replies_refuses_bad_arguments(client: DialogClient, kwargs: dict[str, Any], match: str):
    with pytest.raises(ValidationError, match=match):
        client.replies(**kwargs)


# ---------------------------------------------------------------------------------------------
# the command line


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def spawn(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def acli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: cli(env, *args))


async def test_cli_ask_prints_the_reply_event(env: dict[str, str], replier):
    done = await acli(env, "ask", "cli-1", "halo", "--msg-id", "cli-m1", "--timeout", "10")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    printed = json.loads(line)
    assert {k: printed[k] for k in ("session_id", "msg_id", "seq", "outcome", "text")} == {
        "session_id": "cli-1",
        "msg_id": "cli-m1",
        "seq": 1,
        "outcome": "applied",
        "text": "echo: halo",
    }
    assert set(printed) == {
        "session_id",
        "msg_id",
        "seq",
        "outcome",
        "text",
        "id",
        "produced_at",
        "entry_id",
        "stream",
        "group",
    }


async def test_cli_ask_exits_1_for_a_dead_lettered_message_and_prints_it(env, replier):
    done = await acli(env, "ask", "cli-2", "fatal: no")
    assert done.returncode == 1
    assert json.loads(done.stdout)["outcome"] == "dead_lettered"


async def test_cli_ask_timeout_is_one_line_on_stderr_and_exit_1(env: dict[str, str]):
    # A worker's group reads the stream (none would add a warning line, see
    # test_uncertain_send.py), but nothing answers.
    r = Redis.from_url(env["REDIS_URL"])
    await r.xgroup_create("dialog", "dialog-workers", id="0", mkstream=True)
    await r.aclose()
    done = await acli(env, "ask", "cli-3", "silent", "--msg-id", "q", "--timeout", "0.3")
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert "no reply" in line and "'q'" in line


@pytest.mark.parametrize(
    "args",
    [("ask", "s", "x", "--timeout", "0"), ("ask", "s", "  "), ("replies", "--limit", "0")],
)
async def test_cli_usage_errors_exit_2(env: dict[str, str], args: tuple[str, ...]):
    done = await acli(env, *args)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


async def test_cli_replies_prints_events_and_a_group_acknowledges_them(
    client: DialogClient, env: dict[str, str]
):
    ids = await add_events(client, 3)
    plain = await acli(env, "replies")
    assert plain.returncode == 0, plain.stderr
    assert [json.loads(line)["id"] for line in plain.stdout.splitlines()] == ids
    limited = await acli(env, "replies", "--limit", "2")
    assert len(limited.stdout.splitlines()) == 2

    grouped = await acli(env, "replies", "--group", "ops", "--consumer", "me")
    assert [json.loads(line)["id"] for line in grouped.stdout.splitlines()] == ids
    assert await pending(client, "ops") == 0
    again = await acli(env, "replies", "--group", "ops", "--consumer", "me")
    assert again.returncode == 0 and again.stdout == ""


async def test_cli_replies_follow_prints_new_events_until_sigterm(
    client: DialogClient, env: dict[str, str]
):
    await client.redis.xgroup_create(client.keys.replies, "live", id="$", mkstream=True)
    proc = spawn(env, "-m", "dialog_worker", "replies", "--group", "live", "--follow")
    try:
        [new] = await add_events(client, 1)
        assert proc.stdout is not None
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert json.loads(line)["id"] == new
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(20)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.stderr is not None and proc.stderr.read() == ""
