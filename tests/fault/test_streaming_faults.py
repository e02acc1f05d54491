"""Streamed answers under faults: readers that drop and resume at random while a worker is
killed (kill -9) and another paused past its lease (SIGSTOP) mid-answer. For every message,
the text all of its reader's connections showed, in order and honouring reset, resync and
end, is the committed reply, and no piece of an attempt arrived twice."""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from types import SimpleNamespace

import pytest
import redis.exceptions
from redis_server import wait_until_async
from stream_views import streamed
from worker_procs import WorkerPool, WorkerProc

from dialog_worker import StreamEvent, emit
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.partial_reader import Tracker
from dialog_worker.daemon.partial_writer import PartialReplies

pytestmark = pytest.mark.fault

FAST = {"DIALOG_LOCK_TTL_MS": "600", "DIALOG_ENGINE": "stream_engines:AsyncWords"}


async def read_with_drops(
    client: DialogClient, session: str, msg_id: str, rng: random.Random
) -> tuple[list[StreamEvent], int]:
    """Send, then read the answer over many connections, each dropped after a few events
    and resumed from the last cursor handled."""
    events: list[StreamEvent] = []
    await client.send(session, "100 30", msg_id=msg_id)
    cursor: str | None = None
    connections = 0
    while not events or events[-1].kind != "end":
        connections += 1
        keep = rng.randint(1, 4)
        got = 0
        async for event in client.stream(session, msg_id, after=cursor, timeout=60):
            events.append(event)
            if event.cursor is not None:
                cursor = event.cursor
            got += 1
            if event.kind == "end" or got >= keep:
                break  # the connection drops here (or the answer ended)
        if rng.random() < 0.3:
            await asyncio.sleep(rng.uniform(0, 0.3))  # reconnects a little later
    return events, connections


async def test_readers_dropping_at_random_through_kill9_and_a_paused_worker_see_each_answer_once(
    client: DialogClient, workers: WorkerPool
):
    rng = random.Random(22)
    procs = workers.start(3, **FAST)
    reply = "".join(f"w{i} " for i in range(100))

    async def busiest(candidates: list[WorkerProc]) -> WorkerProc:
        """The candidate holding the most answers that have streamed a few pieces, once one
        holds any: on a loaded host the answers may start later than planned (CI once saw no
        reset: the fault hit workers whose answers had not streamed yet), and a fault that
        hits no answer mid-way tests nothing."""
        names = {w.name for w in candidates}
        for _ in range(400):
            held: Counter[str] = Counter()
            for i in range(12):
                sk = client.keys.session(f"sf-{i}")
                token = await client.redis.get(sk.lock)
                holder = token.split(":", 1)[0] if token else ""
                if holder in names and await client.redis.xlen(sk.partial(f"sf{i}")) >= 3:
                    held[holder] += 1
            if held:
                return max(candidates, key=lambda w: held.get(w.name, 0))
            await asyncio.sleep(0.05)
        raise AssertionError("no answer mid-way within 20 s")

    async def faults() -> None:
        await asyncio.sleep(0.6)  # answers are under way
        killed = await busiest(procs)
        killed.signal(signal.SIGKILL)
        await asyncio.sleep(1.2)  # its lease ends, the others take its answers over
        paused = await busiest([w for w in procs if w is not killed])
        paused.signal(signal.SIGSTOP)
        await asyncio.sleep(1.5)  # well past the 600 ms lease: its answers move on
        paused.signal(signal.SIGCONT)  # it wakes and tries to go on writing: fenced

    fault = asyncio.create_task(faults())
    results = await asyncio.wait_for(
        asyncio.gather(*(read_with_drops(client, f"sf-{i}", f"sf{i}", rng) for i in range(12))),
        90,
    )
    await fault
    total_connections = 0
    resets = 0
    for i, (events, connections) in enumerate(results):
        total_connections += connections
        text = ""
        seen: set[tuple[int, int]] = set()
        for event in events:
            if event.kind == "delta":
                assert event.pos is not None
                assert (event.attempt, event.pos) not in seen, (i, event)
                seen.add((event.attempt, event.pos))
                text += event.text
                assert reply.startswith(text), (i, text)  # never a piece twice or out of order
            elif event.kind == "reset":
                resets += 1
                text = ""
            elif event.kind == "resync":
                text = event.text
        assert text == reply, i  # the pieces alone build the whole answer
        assert (events[-1].kind, events[-1].outcome, events[-1].text) == ("end", "applied", reply)
        state = await client.state(f"sf-{i}")
        assert state is not None and state["history"][-1]["bot"] == reply
    assert total_connections > 12 * 5
    assert resets >= 1, "a fault hit an answer mid-way"
    print(f"connections {total_connections}, resets {resets}")


async def stop_mid_answer(client: DialogClient, worker: WorkerProc, partial: str) -> None:
    """SIGTERM the worker once its step has streamed 3 entries, and see it exit 0 (a grace
    shorter than the step: the step is handed back)."""

    async def three_entries() -> bool:
        return await client.redis.xlen(partial) >= 3

    await wait_until_async(three_entries, 20, "the first attempt to stream 3 entries")
    worker.signal(signal.SIGTERM)
    assert worker.proc is not None
    assert await asyncio.to_thread(worker.proc.wait, 15) == 0, worker.log_text()[-3000:]


async def test_an_answer_handed_back_mid_stream_past_the_attempt_limit_says_so_in_its_dead_letter(
    client: DialogClient, workers: WorkerPool
):
    """A streamed hand-back keeps its attempt counted (the next attempt needs a new number),
    so shutdowns alone can use up DIALOG_MAX_ATTEMPTS. The dead letter names the hand-back,
    not a kill or a lost lease that never happened."""
    settings = {"DIALOG_ENGINE": "stream_engines:PerProcessWords", "DIALOG_MAX_ATTEMPTS": "1"}
    [first] = workers.start(1, DIALOG_SHUTDOWN_GRACE_S="0.3", **settings)
    await client.send("handed-out", "60 50", msg_id="hx1")
    partial = client.keys.session("handed-out").partial("hx1")
    await stop_mid_answer(client, first, partial)
    workers.start(1, **settings)

    async def letters() -> list[dict[str, str]]:
        return [f for _, f in await client.redis.xrange(client.keys.dlq)]

    [letter] = await wait_until_async(letters, 20, "the dead letter")
    assert (letter["error_kind"], letter["attempts"]) == ("exhausted", "1"), letter
    assert "handed back at shutdown" in letter["error"], letter["error"]


async def test_an_answer_handed_back_at_shutdown_mid_stream_starts_over_for_its_readers(
    client: DialogClient, workers: WorkerPool
):
    """A step past the shutdown grace is handed back after it streamed part of its answer.
    The next worker's answer differs (its words name its process): a reader that watched the
    first attempt, and one that reads the whole stream after the end, are each told to start
    over and shown the new answer alone, never the first pieces of the old one followed by
    the rest of the new one."""
    engine = {"DIALOG_ENGINE": "stream_engines:PerProcessWords"}
    [first] = workers.start(1, DIALOG_SHUTDOWN_GRACE_S="0.3", **engine)
    await client.send("handed", "60 50", msg_id="hb1")
    partial = client.keys.session("handed").partial("hb1")
    live: list[StreamEvent] = []

    async def watch() -> None:
        async for event in client.stream("handed", "hb1", timeout=60):
            live.append(event)

    watcher = asyncio.create_task(watch())
    try:
        await stop_mid_answer(client, first, partial)
        # Handed back with its attempt kept: the next one writes under a new attempt number.
        assert await client.redis.hget(client.keys.session("handed").state, "n") == "1"
        assert await client.redis.exists(client.keys.session("handed").lock) == 0
        shown_before = "".join(e.text for e in live if e.kind == "delta")
        assert shown_before.startswith(f"p{first.pid}.")  # the reader saw the first attempt
        [heir] = workers.start(1, **engine)
        await asyncio.wait_for(watcher, 60)
    finally:
        watcher.cancel()  # a failed assertion does not leave it waiting a minute
    after = [e async for e in client.stream("handed", "hb1", timeout=60)]
    state = await client.state("handed")
    assert state is not None
    reply = state["history"][-1]["bot"]
    assert reply.startswith(f"p{heir.pid}.")
    for events in (live, after):
        text = streamed(events)
        assert text == reply, [(e.kind, e.attempt, e.pos, e.text[:20]) for e in events]
        assert (events[-1].kind, events[-1].text) == ("end", reply)


class LostReplyOnce(PartialReplies):
    """The worker's partial writer on the real Redis, whose first script call fails with a
    broken connection: after it ran on the server (its reply lost) or before it reached it."""

    def __init__(self, client: DialogClient, ran: bool) -> None:
        super().__init__(client.redis, client.settings)
        self.ran = ran
        self.first_failed = asyncio.Event()

    async def call(self, keys: list[str], args: list[str | int]) -> list[int]:
        if self.first_failed.is_set():
            return await super().call(keys, args)
        if self.ran:
            await super().call(keys, args)
        self.first_failed.set()
        raise redis.exceptions.ConnectionError("Connection reset by peer")


@pytest.mark.parametrize("ran", [True, False], ids=["reply-lost", "never-arrived"])
async def test_a_batch_whose_call_broke_is_sent_again_as_it_was_and_nothing_emitted_since_is_lost(
    client: DialogClient, ran: bool
) -> None:
    """The first batch's call broke (whether it ran on the server is unknown to the worker);
    the step emitted more before the writer tried again. The retry sends the first batch again
    as it was (answered "already there" when it had run) and the new text as the next pieces:
    a reader gets every piece once, in order."""
    replies = LostReplyOnce(client, ran)
    session = client.keys.session("s-lost")
    await client.redis.set(session.lock, "tok", px=10_000)
    job = SimpleNamespace(
        keys=client.keys, session_id="s-lost", token="tok", seq=1, attempts=1, partial=None
    )

    async def step() -> str:
        emit("one ")
        await asyncio.wait_for(replies.first_failed.wait(), 5)
        emit("two ")  # emitted between the lost reply and the retry
        await asyncio.sleep(0.1)
        emit("three ")
        return "one two three "

    assert await replies.run(job, SimpleNamespace(msg_id="m-lost"), step()) == "one two three "
    rows = await client.raw.xrange(session.partial("m-lost"))
    tracker = Tracker("m-lost")
    events = [event for _, fields in rows for event in tracker.feed(fields)]
    assert [e.kind for e in events] == ["delta"] * len(events)
    assert [e.pos for e in events] == list(range(len(events)))
    assert streamed(events) == "one two three "
    assert job.partial.pos == len(events)  # the end entry will name the right place
