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

A second phase (about 15 s, the same faults) re-sends msg_ids and deletes sessions mid
conversation. In each of 8 sessions a long answer is cancelled once its reader saw it start,
and its msg_id is sent again (a new answer under the same msg_id); then two more messages,
and in half the sessions a delete while the first of them streams, then two more messages,
which start the session over. Checked by the same accounting: the cancelled message's reader
ends `cancelled` with a start of its answer; every reader of the re-sent msg_id ends with the
new answer (a start of the old answer may show first, cleared by a reset), no piece twice
between two resets; a message running when its session was deleted ends its readers
`expired` (or `applied`, when its commit came first), as do the readers of its earlier
messages still reading then (nothing is left of their answers); every other message is
answered once, `applied`; each session's history holds, in send order and once, what was
sent since its last delete.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    client: DialogClient,
    session: str,
    msg_id: str,
    rng: random.Random,
    join_after_s: float,
    reader: Reader | None = None,
) -> Reader:
    """One reader of one answer over as many connections as it takes (into ``reader``, if
    given, so the caller can watch it as it goes)."""
    await asyncio.sleep(join_after_s)
    reader = reader or Reader(msg_id)
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


def problems_of(
    reader: Reader, reply: str, earlier: str | None = None, ends: tuple[str, ...] = ("applied",)
) -> tuple[list[str], int]:
    """What is wrong with what this reader was shown, and how many resets it honoured.
    ``earlier``: the answer of an earlier message under the same msg_id, which may show
    before a reset (each reset starts the count of pieces seen anew). ``ends``: the outcomes
    it may end with: ``applied`` with the reply; ``cancelled`` or ``expired`` with a start of
    it (what was shown when it stopped; nothing, for a deleted session's). Where ``expired``
    may end it (its session was deleted), the pieces can be erased under a reader that has
    not read them all: its ``applied`` end still carries the whole reply, which replaces what
    it showed (a start of it), as for a stream that expired (test_streaming.py)."""
    wrong: list[str] = []
    text, seen, resets = "", set(), 0
    starts = [reply] if earlier is None else [reply, earlier]
    for event in reader.events[:-1]:
        if event.kind == "delta":
            piece = (event.attempt, event.pos)
            if piece in seen:
                wrong.append(f"{reader.msg_id}: piece {piece} twice")
            seen.add(piece)
            text += event.text
        elif event.kind == "reset":
            resets += 1
            text, seen = "", set()
        elif event.kind == "resync":
            text = event.text
        else:
            wrong.append(f"{reader.msg_id}: {event.kind} before the end")
        if not any(start.startswith(text) for start in starts):
            wrong.append(f"{reader.msg_id}: showed {text[-40:]!r}, not a start of the reply")
            break
    end = reader.events[-1] if reader.events else None
    if end is None or end.kind != "end" or end.outcome not in ends:
        wrong.append(f"{reader.msg_id}: ended {end}")
    elif end.outcome == "applied" and end.text != reply:
        wrong.append(f"{reader.msg_id}: applied with {len(end.text)} chars, not its reply")
    elif (
        end.outcome == "applied"
        and text != reply
        and not ("expired" in ends and reply.startswith(text))
    ):
        wrong.append(f"{reader.msg_id}: applied with {len(end.text)} / shown {len(text)} chars")
    elif end.outcome != "applied" and not reply.startswith(end.text):
        wrong.append(f"{reader.msg_id}: ended {end.outcome} with {end.text[-40:]!r}")
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

    driver = asyncio.create_task(inject(client, workers, procs, kinds, rng, faults, FAULT_PHASE_S))
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
    await resend_and_delete_phase(client, workers, procs, kinds, rng)


async def inject(
    client: DialogClient,
    workers: WorkerPool,
    procs: dict[str, WorkerProc],
    kinds: dict[str, str],
    rng: random.Random,
    faults: Counter[str],
    phase_s: float,
) -> None:
    """Every 1-2.5 s, the worker holding the most session locks is killed (kill -9; a new one
    of its kind starts) or paused past its lease, in turns."""

    async def busiest() -> WorkerProc:
        held = Counter((await lock_holders(client)).values())
        return max(procs.values(), key=lambda w: held.get(w.name, 0))

    kill = rng.random() < 0.5
    ends = time.monotonic() + phase_s
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


RESEND_SESSIONS = 8
RESEND_FAULT_PHASE_S = 10.0


async def until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


def deltas(reader: Reader) -> int:
    return sum(e.kind == "delta" for e in reader.events)


@dataclass
class Sent:
    """One message of the second phase and what its readers must see."""

    msg_id: str
    reply: str
    readers: list[asyncio.Task[Reader]]
    earlier: str | None = None  # the answer of the message first sent under its msg_id
    ends: tuple[str, ...] = ("applied",)
    events: tuple[str, ...] = ("applied",)  # its reply events, in order, or a choice of
    # ("applied",) and () for a message a delete may erase


async def resend_and_delete_phase(
    client: DialogClient,
    workers: WorkerPool,
    procs: dict[str, WorkerProc],
    kinds: dict[str, str],
    rng: random.Random,
) -> None:
    started = time.monotonic()
    faults: Counter[str] = Counter()
    sent: dict[str, list[Sent]] = defaultdict(list)  # in send order
    kept: dict[str, list[Sent]] = defaultdict(list)  # what each session's history must hold
    cancelled: dict[str, tuple[str, Reader]] = {}  # session -> (answer, its one reader)
    deleted: set[str] = set()

    def readers(sid: str, msg_id: str) -> list[asyncio.Task[Reader]]:
        return [
            asyncio.create_task(read(client, sid, msg_id, rng, join))
            for join in (0.0, rng.uniform(0, 1))
        ]

    async def send(sid: str, msg_id: str, text: str, **expect: Any) -> Sent:
        await client.send(sid, text, msg_id=msg_id)
        item = Sent(msg_id, answer_of(text), readers(sid, msg_id), **expect)
        sent[sid].append(item)
        kept[sid].append(item)
        return item

    async def session(i: int) -> None:
        sid = f"sr-{i}"
        await asyncio.sleep(rng.uniform(0, 2))
        # A long answer, cancelled once its reader saw it start; its msg_id sent again.
        again = f"{sid}-a"
        long_text = f"300 20 r{i}x"
        await client.send(sid, long_text, msg_id=again)
        first = Reader(again)
        whole = asyncio.create_task(read(client, sid, again, rng, 0.0, first))
        await until(lambda: deltas(first) >= 2, 30, f"{again} started")
        assert (await client.cancel(sid, again)).status == "cancelled"
        await asyncio.wait_for(whole, 30)
        cancelled[sid] = (answer_of(long_text), first)
        kept[sid].append(Sent(again, "", [], events=("cancelled",)))
        short = f"{rng.randint(20, 40)} {rng.randint(10, 20)} r{i}a"
        await send(sid, again, short, earlier=answer_of(long_text))
        b = await send(sid, f"{sid}-b", f"{rng.randint(40, 60)} 20 r{i}b")
        if i % 2 == 0:
            # Deleted while b streams: b ends without a reply event (or, its commit first,
            # applied), and the next messages start the session over.
            watch = Reader(b.msg_id)
            b.readers.append(asyncio.create_task(read(client, sid, b.msg_id, rng, 0.0, watch)))
            await until(lambda: deltas(watch) >= 1, 30, f"{b.msg_id} started")
            await client.delete(sid)
            deleted.add(sid)
            b.events = ()
            for item in sent[sid]:  # a reader still reading finds nothing left of its answer
                item.ends = ("applied", "expired")
            kept[sid] = []
        for k in ("c", "d"):
            await asyncio.sleep(rng.uniform(0, 0.5))
            await send(sid, f"{sid}-{k}", f"{rng.randint(20, 40)} {rng.randint(10, 20)} r{i}{k}")

    driver = asyncio.create_task(
        inject(client, workers, procs, kinds, rng, faults, RESEND_FAULT_PHASE_S)
    )
    await asyncio.gather(*(session(i) for i in range(RESEND_SESSIONS)))
    items = [item for msgs in sent.values() for item in msgs]
    done = await asyncio.wait_for(asyncio.gather(*(t for it in items for t in it.readers)), 60)
    await driver

    wrong: list[str] = []
    resets = 0
    by_task = dict(zip([t for it in items for t in it.readers], done, strict=True))
    for item in items:
        for task in item.readers:
            found, honoured = problems_of(by_task[task], item.reply, item.earlier, item.ends)
            wrong += found
            resets += honoured
    for answer, reader in cancelled.values():
        wrong += problems_of(reader, answer, ends=("cancelled",))[0]
    assert wrong == []
    # Each message's reply events, in order: one each (a message a delete erased: none, or
    # its applied one when its commit came first), the re-sent msg_id's cancelled then applied.
    events: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for _, e in await client.redis.xrange(client.keys.replies):
        if e["session_id"].startswith("sr-"):
            events[e["msg_id"]].append((e["outcome"], e["reply"]))
    for msgs in sent.values():
        for item in msgs:
            got = [outcome for outcome, _ in events[item.msg_id]]
            if item.earlier is not None:
                got = got[1:] if got[:1] == ["cancelled"] else ["no cancelled event first"]
            if item.events == ():
                assert got in ([], ["applied"]), (item.msg_id, got)
            else:
                assert got == list(item.events), (item.msg_id, got)
            if got == ["applied"]:
                assert events[item.msg_id][-1][1] == item.reply, item.msg_id
    # Each session's history: what was sent since its last delete, once, in order.
    for sid in sent:
        state = await client.state(sid)
        assert state is not None
        turns = [(t["seq"], t["msg_id"], bool(t.get("cancelled"))) for t in state["history"]]
        want = [m.msg_id for m in kept[sid]]
        assert [m for _, m, _ in turns] == want, sid
        assert [seq for seq, _, _ in turns] == list(range(1, len(want) + 1)), sid
        assert [c for _, _, c in turns] == [m.events == ("cancelled",) for m in kept[sid]], sid
        applied = [t["bot"] for t in state["history"] if not t.get("cancelled")]
        assert applied == [m.reply for m in kept[sid] if m.events != ("cancelled",)], sid
    await assert_drained(client, timeout_s=15)
    print(
        f"phase 2: {len(items)} messages ({len(cancelled)} re-sent after a cancel, "
        f"{len(deleted)} sessions deleted mid-answer), {len(done)} readers, {resets} resets, "
        f"faults {dict(faults)}, {time.monotonic() - started:.1f} s"
    )
