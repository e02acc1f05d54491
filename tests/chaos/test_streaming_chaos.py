"""Chaos with streamed answers, bounded (well under 60 s): three real workers (two with an
``async def`` streaming engine, one with a plain ``def`` one in its thread: the same answers,
so a message may move from one kind to the other) answer 16 sessions x 3 messages sent over
about 12 s, while a driver picks the worker holding the most session locks every 1-2.5 s and
either kills it (kill -9; a new one of the same kind starts) or pauses it past its lease
(SIGSTOP for 1-1.6 s against a 600 ms lease, then SIGCONT: it wakes and tries to go on).

Every message has two readers, each over many connections that drop after 1-5 events and
resume from the last cursor handled (sometimes a little later): one from the send on, one that
joins 0-2 s later from the start. Each message's answer is made of pieces tagged with the
message (``<tag>.0 <tag>.1 ...``), so a piece of another answer cannot pass for one of its own.

Checked, for every reader of every message: no piece (attempt, position) arrived twice; the
text shown (appending deltas, clearing on reset, replacing on resync) was always a start of
the committed reply and, when the end came, was exactly the committed reply; the end says
``applied`` with that reply. And for the queue: each message has exactly one reply event
(``applied``, its reply), each session's history holds its messages once, in send order, with
those replies, and nothing is left over. Seeded (printed; CHAOS_SEED replays a run).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
from queue_checks import assert_drained, lock_holders
from worker_procs import WorkerPool, WorkerProc

from dialog_worker import StreamEvent
from dialog_worker.client.dialog_client import DialogClient

pytestmark = pytest.mark.chaos

SESSIONS = 16
PER_SESSION = 3
SEND_SPREAD_S = 4.0  # each session waits up to this long before each of its sends
FAULT_PHASE_S = 14.0
ENV = {
    "DIALOG_LOCK_TTL_MS": "600",
    # A message hit by several faults in a row must still be answered, not dead-lettered.
    "DIALOG_MAX_ATTEMPTS": "50",
    "DIALOG_BACKOFF_BASE_MS": "10",
    "DIALOG_BACKOFF_MAX_MS": "100",
}
KINDS = ("TaggedAsync", "TaggedAsync", "TaggedThread")


@dataclass
class Reader:
    msg_id: str
    events: list[StreamEvent] = field(default_factory=list)
    connections: int = 0


def answer_of(text: str) -> str:
    words, _, tag = text.split()
    return "".join(f"{tag}.{i} " for i in range(int(words)))


async def read(
    client: DialogClient, session: str, msg_id: str, rng: random.Random, join_after_s: float
) -> Reader:
    """One reader of one answer over as many connections as it takes."""
    await asyncio.sleep(join_after_s)
    reader = Reader(msg_id)
    cursor: str | None = None
    while not reader.events or reader.events[-1].kind != "end":
        reader.connections += 1
        keep, got = rng.randint(1, 5), 0
        async for event in client.stream(session, msg_id, after=cursor, timeout=60):
            reader.events.append(event)
            if event.cursor is not None:
                cursor = event.cursor
            got += 1
            if event.kind == "end" or got >= keep:
                break  # the connection drops here (or the answer ended)
        if rng.random() < 0.3:
            await asyncio.sleep(rng.uniform(0, 0.3))  # reconnects a little later
    return reader


def problems_of(reader: Reader, reply: str) -> tuple[list[str], int]:
    """What is wrong with what this reader was shown, and how many resets it honoured."""
    wrong: list[str] = []
    text, seen, resets = "", set(), 0
    for event in reader.events[:-1]:
        if event.kind == "delta":
            piece = (event.attempt, event.pos)
            if piece in seen:
                wrong.append(f"{reader.msg_id}: piece {piece} twice")
            seen.add(piece)
            text += event.text
        elif event.kind == "reset":
            resets += 1
            text = ""
        elif event.kind == "resync":
            text = event.text
        else:
            wrong.append(f"{reader.msg_id}: {event.kind} before the end")
        if not reply.startswith(text):
            wrong.append(f"{reader.msg_id}: showed {text[-40:]!r}, not a start of the reply")
            break
    end = reader.events[-1]
    if (end.kind, end.outcome, end.text) != ("end", "applied", reply):
        wrong.append(f"{reader.msg_id}: ended {end.kind} {end.outcome} {end.text[:40]!r}")
    if text != reply:
        wrong.append(f"{reader.msg_id}: the pieces built {len(text)} of {len(reply)} chars")
    return wrong, resets


async def test_streamed_answers_through_kill9_and_paused_workers_reach_every_reader_once(
    client: DialogClient, workers: WorkerPool
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 30)))
    print(f"CHAOS_SEED={seed}")
    rng = random.Random(seed)
    started = time.monotonic()
    procs: dict[str, WorkerProc] = {}
    kinds: dict[str, str] = {}
    for kind in KINDS:
        [proc] = workers.start(1, DIALOG_ENGINE=f"stream_engines:{kind}", **ENV)
        procs[proc.name], kinds[proc.name] = proc, kind
    sent: dict[str, list[tuple[str, str]]] = defaultdict(list)  # session -> (msg_id, reply)
    readers: list[asyncio.Task[Reader]] = []
    faults: Counter[str] = Counter()

    async def session(i: int) -> None:
        sid = f"sc-{i}"
        for k in range(PER_SESSION):
            await asyncio.sleep(rng.uniform(0, SEND_SPREAD_S))
            msg_id, text = f"{sid}-m{k}", f"{rng.randint(40, 70)} {rng.randint(15, 30)} s{i}m{k}"
            await client.send(sid, text, msg_id=msg_id)
            sent[sid].append((msg_id, answer_of(text)))
            for join in (0.0, rng.uniform(0, 2)):
                readers.append(asyncio.create_task(read(client, sid, msg_id, rng, join)))

    async def busiest() -> WorkerProc:
        held = Counter((await lock_holders(client)).values())
        return max(procs.values(), key=lambda w: held.get(w.name, 0))

    async def inject() -> None:
        kill = rng.random() < 0.5
        ends = time.monotonic() + FAULT_PHASE_S
        while time.monotonic() < ends:
            await asyncio.sleep(rng.uniform(1.0, 2.5))
            victim = await busiest()
            if kill:
                victim.signal(signal.SIGKILL)
                kind = kinds.pop(victim.name)
                del procs[victim.name]
                [new] = workers.start(1, DIALOG_ENGINE=f"stream_engines:{kind}", **ENV)
                procs[new.name], kinds[new.name] = new, kind
                faults["kill -9"] += 1
            else:
                victim.signal(signal.SIGSTOP)
                await asyncio.sleep(rng.uniform(1.0, 1.6))  # past the 600 ms lease
                victim.signal(signal.SIGCONT)
                faults["SIGSTOP past the lease"] += 1
            kill = not kill

    driver = asyncio.create_task(inject())
    await asyncio.gather(*(session(i) for i in range(SESSIONS)))
    done = await asyncio.wait_for(asyncio.gather(*readers), 40)
    await driver
    elapsed = time.monotonic() - started

    replies = dict(msg for msgs in sent.values() for msg in msgs)
    wrong: list[str] = []
    resets = 0
    for reader in done:
        found, honoured = problems_of(reader, replies[reader.msg_id])
        wrong += found
        resets += honoured
    assert wrong == []
    events = [fields for _, fields in await client.redis.xrange(client.keys.replies)]
    finishes = Counter(e["msg_id"] for e in events)
    assert {m for m, n in finishes.items() if n != 1} == set(), "one reply event per message"
    assert {e["msg_id"]: (e["outcome"], e["reply"]) for e in events} == {
        m: ("applied", reply) for m, reply in replies.items()
    }
    for sid, msgs in sent.items():
        state = await client.state(sid)
        assert state is not None
        assert [(t["msg_id"], t["bot"]) for t in state["history"]] == msgs, sid
    await assert_drained(client, timeout_s=15)
    connections = sum(r.connections for r in done)
    print(
        f"{len(replies)} answers, {len(done)} readers over {connections} connections, "
        f"{resets} resets honoured, faults {dict(faults)}, {elapsed:.1f} s"
    )
    assert faults["kill -9"] >= 2 and faults["SIGSTOP past the lease"] >= 2
    assert resets >= 1, "a fault hit an answer mid-way"
    assert connections >= 3 * len(done)
