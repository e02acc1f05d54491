"""The reader's state machine of streamed replies (dialog_worker/client/partial_reader.py) and
`emit` outside a step: every resume case without Redis."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import redis.exceptions

from dialog_worker import StreamEvent, emit
from dialog_worker.client import partial_reader as partials
from dialog_worker.client.dialog_client import DialogClient, SendResult
from dialog_worker.client.partial_reader import (
    Cursor,
    MessageKeys,
    Tracker,
    Watch,
    follow,
    parse_cursor,
    reply_from_history,
)
from dialog_worker.client.replies import Reply
from dialog_worker.config import load_settings
from dialog_worker.daemon.partial_writer import BATCH_WIDTH, PartialReplies
from dialog_worker.errors import ValidationError


def entry(a: int, p: int, t: str, k: str = "d", f: str | None = None, s: int = 3):
    fields = {b"a": str(a).encode(), b"p": str(p).encode(), b"k": k.encode(), b"t": t.encode()}
    fields[b"s"] = str(s).encode()
    if f is not None:
        fields[b"f"] = f.encode()
    return fields


def run(tracker: Tracker, entries) -> list[tuple[str, str, str | None]]:
    return [(e.kind, e.text, e.cursor) for x in entries for e in tracker.feed(x)]


def test_deltas_in_order_carry_their_cursor_and_the_seq_is_learned():
    t = Tracker("m")
    assert run(t, [entry(1, 0, "a"), entry(1, 1, "b")]) == [
        ("delta", "a", "m:1:0"),
        ("delta", "b", "m:1:1"),
    ]
    assert t.seq == 3


def test_a_resumed_reader_skips_what_it_has():
    t = Tracker("m", Cursor("m", 1, 1))
    assert run(t, [entry(1, 0, "a"), entry(1, 1, "b"), entry(1, 2, "c")]) == [
        ("delta", "c", "m:1:2")
    ]


def test_a_newer_attempt_resets_a_reader_that_saw_the_older_one():
    t = Tracker("m", Cursor("m", 1, 0))
    got = run(t, [entry(1, 0, "x"), entry(1, 1, "y"), entry(2, 0, "a")])
    assert got == [("delta", "y", "m:1:1"), ("reset", "", None), ("delta", "a", "m:2:0")]


def test_a_fresh_reader_gets_old_attempts_then_a_reset():
    t = Tracker("m")
    got = run(t, [entry(1, 0, "x"), entry(2, 0, "a")])
    assert [k for k, _, _ in got] == ["delta", "reset", "delta"]


def test_a_piece_of_a_later_seq_makes_the_reader_start_over_with_a_reset():
    """The same message under a later seq (a redrive into its held session moved it up) with
    no end between: its stream was started anew below the ids read, so the piece is not shown
    after the old ones; once told to forget them, the new answer comes after a reset."""
    t = Tracker("m")
    assert run(t, [entry(1, 0, "OLD ", s=2), entry(1, 1, "new ", s=3)]) == [
        ("delta", "OLD ", "m:1:0")
    ]
    assert t.renumbered == 3
    t.forget_older(t.renumbered - 1)
    got = run(t, [entry(1, 0, "OLD ", s=2), entry(1, 0, "a ", s=3), entry(1, 1, "b ", s=3)])
    assert got == [("reset", "", None), ("delta", "a ", "m:1:0"), ("delta", "b ", "m:1:1")]


def test_a_reader_behind_a_trimmed_start_waits_for_a_snapshot_and_resyncs():
    t = Tracker("m", Cursor("m", 1, 0))
    got = run(t, [entry(1, 5, "f"), entry(1, 6, "g", f="abcdefg"), entry(1, 7, "h")])
    assert got == [("resync", "abcdefg", "m:1:6"), ("delta", "h", "m:1:7")]


def test_entries_of_an_older_attempt_after_a_newer_one_are_ignored():
    t = Tracker("m")
    got = run(t, [entry(2, 0, "a"), entry(1, 1, "zombie"), entry(2, 1, "b")])
    assert [x[1] for x in got] == ["a", "b"]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {b"a": b"x", b"p": b"0", b"k": b"d", b"t": b"a"},
        {b"a": b"1", b"p": b"-1", b"k": b"d", b"t": b"a"},
        {b"a": b"1", b"p": b"9" * 40, b"k": b"d", b"t": b"a"},
        {b"a": b"1", b"p": b"0", b"k": b"zz", b"t": b"a"},
    ],
)
def test_forged_or_malformed_entries_are_skipped(fields):
    t = Tracker("m")
    assert run(t, [fields, entry(1, 0, "ok")]) == [("delta", "ok", "m:1:0")]


def test_the_end_cursor_is_one_past_the_newest_piece_for_every_reader():
    a, b = Tracker("m"), Tracker("m", Cursor("m", 1, 1))
    entries = [entry(1, 0, "a"), entry(1, 1, "b"), entry(1, 2, "ok", k="e")]
    ends = [run(a, entries)[-1], run(b, entries)[-1]]
    assert ends == [("end", "ok", "m:1:2"), ("end", "ok", "m:1:2")]
    resumed = Tracker("m", Cursor("m", 1, 2))
    run(resumed, entries)
    assert resumed.resumed_at_end()


def test_invalid_utf8_in_an_entry_does_not_fail_the_reader():
    t = Tracker("m")
    fields = entry(1, 0, "")
    fields[b"t"] = b"\xff\xfeok"
    assert run(t, [fields])[0][1].endswith("ok")


@pytest.mark.parametrize(
    "raw", ["m:1", "x:1:2", "m:a:1", "m:1:-1", "m:1:" + "9" * 40, "m" * 2000 + ":1:1"]
)
def test_bad_cursors_are_refused_with_one_clear_error(raw):
    with pytest.raises(ValidationError):
        parse_cursor(raw, "m")


def test_a_msg_id_with_colons_has_a_cursor_too():
    assert parse_cursor("a:b:c:2:7", "a:b:c") == Cursor("a:b:c", 2, 7)


def test_the_reply_comes_from_the_history_only_when_the_turn_matches():
    doc = b'{"history": [{"seq": 2, "msg_id": "m", "user": "u", "bot": "hi"}, "junk"]}'
    assert reply_from_history(doc, "m", 2) == ("applied", "hi")
    assert reply_from_history(doc, "m", 3) is None
    assert reply_from_history(doc, "other", None) is None
    assert reply_from_history(b"not json", "m", 2) is None
    assert reply_from_history(b'{"history": 5}', "m", 2) is None


def test_a_turn_marked_cancelled_or_superseded_ended_so():
    doc = (
        b'{"history": [{"seq": 1, "msg_id": "a", "bot": "", "cancelled": true},'
        b' {"seq": 2, "msg_id": "b", "bot": "", "superseded": true},'
        b' {"seq": 3, "msg_id": "c", "bot": "ok", "cancelled": "yes"},'
        b' {"seq": 4, "msg_id": "d", "bot": "", "expired": true}]}'
    )
    assert reply_from_history(doc, "d", 4) == ("expired", "")
    assert reply_from_history(doc, "a", 1) == ("cancelled", "")
    assert reply_from_history(doc, "b", None) == ("superseded", "")
    assert reply_from_history(doc, "c", 3) == ("applied", "ok")  # only a true flag counts


def test_emit_outside_a_step_does_nothing_and_refuses_non_text():
    emit("ignored")
    with pytest.raises(TypeError):
        emit(b"bytes")  # type: ignore[arg-type]


class GatedReplies(PartialReplies):
    """The worker's partial writer with Redis replaced by a call that waits for a gate (a
    batch on its way when the step stops) and answers "appended" for every piece."""

    def __init__(self) -> None:
        super().__init__(None, load_settings(environ={"DIALOG_PARTIAL_FLUSH_MS": "1"}))  # type: ignore[arg-type]
        self.gate = asyncio.Event()
        self.sent: list[str] = []
        self.calling = asyncio.Event()

    async def call(self, keys: list[str], args: list[str | int]) -> list[int]:
        self.calling.set()
        await self.gate.wait()
        texts = [str(args[i + 5]) for i in range(0, len(args), BATCH_WIDTH)]
        self.sent += texts
        return [1] * len(texts)


async def test_a_stopped_step_keeps_the_text_of_a_batch_still_on_its_way() -> None:
    """What a cancelled answer keeps is what readers get: a batch sent before the stop and
    answered after it counts; text gathered but not sent does not."""
    replies = GatedReplies()
    keys = SimpleNamespace(
        shard=0, session=lambda sid: SimpleNamespace(lock="L", partial=lambda m: f"P:{m}")
    )
    job = SimpleNamespace(keys=keys, token="t", seq=1, session_id="s", attempts=1, partial=None)

    async def step() -> None:
        emit("shown ")
        await replies.calling.wait()  # the batch is on its way
        emit("never sent")
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError):
        await replies.run(job, SimpleNamespace(msg_id="m"), step())  # type: ignore[arg-type]
    kept = asyncio.create_task(job.partial.shown())
    await asyncio.sleep(0.05)
    assert not kept.done(), "it waits for the batch on its way"
    replies.gate.set()
    assert await asyncio.wait_for(kept, 2) == "shown "
    await asyncio.sleep(0.05)
    assert replies.sent == ["shown "]  # the text gathered after it was dropped, not written


def test_every_half_maxlen_entry_carries_the_whole_text_so_far() -> None:
    """A reader behind a trimmed start resyncs from a snapshot: with DIALOG_PARTIAL_MAXLEN=10,
    every 5th entry carries all the text written before it plus its own piece, and a huge
    emit is split into entries of at most MAX_ENTRY_CHARS."""
    from dialog_worker.daemon.partial_writer import MAX_ENTRY_CHARS, PartialWriter

    replies = SimpleNamespace(settings=SimpleNamespace(partial_maxlen=10))
    job = SimpleNamespace(keys=SimpleNamespace(shard=0), token="t", seq=1, session_id="s")
    writer = PartialWriter(replies, job, "m", 1)  # type: ignore[arg-type]
    fulls = []
    for word in ("a ", "b ", "c ", "d ", "e ", "f "):
        [(pos, piece, full)] = writer.batches(word)
        assert (pos, piece) == (writer.pos, word)
        writer.written([piece], [1])
        fulls.append(full)
    assert fulls == ["", "", "", "", "", "a b c d e f "]
    huge = "x" * (2 * MAX_ENTRY_CHARS) + "y"
    entries = writer.batches(huge)
    assert [(pos, len(piece)) for pos, piece, _ in entries] == [
        (6, MAX_ENTRY_CHARS),
        (7, MAX_ENTRY_CHARS),
        (8, 1),
    ]
    assert "".join(piece for _, piece, _ in entries) == huge


class RecordingReplies(PartialReplies):
    """The worker's partial writer with Redis replaced by a call that records each batch's
    refresh argument and answers "appended"."""

    def __init__(self, ttl_s: int) -> None:
        settings = load_settings(
            environ={"DIALOG_PARTIAL_FLUSH_MS": "1", "DIALOG_PARTIAL_TTL_S": str(ttl_s)}
        )
        super().__init__(None, settings)  # type: ignore[arg-type]
        self.refresh: list[str] = []
        self.called = asyncio.Event()

    async def call(self, keys: list[str], args: list[str | int]) -> list[int]:
        batches = [args[i : i + BATCH_WIDTH] for i in range(0, len(args), BATCH_WIDTH)]
        self.refresh += [str(b[-1]) for b in batches]
        self.called.set()
        return [1] * len(batches)


async def test_a_writer_asks_for_the_expiry_again_once_an_eighth_of_the_ttl_passed() -> None:
    """The script sets a stream's expiry at some entries only: a slow answer's writer asks for
    it once DIALOG_PARTIAL_TTL_S / 8 (here 1 s) passed since its last ask, never more often."""
    replies = RecordingReplies(ttl_s=8)
    keys = SimpleNamespace(
        shard=0, session=lambda sid: SimpleNamespace(lock="L", partial=lambda m: f"P:{m}")
    )
    job = SimpleNamespace(keys=keys, token="t", seq=1, session_id="s", attempts=1, partial=None)

    async def written(text: str) -> None:
        replies.called.clear()
        emit(text)
        await asyncio.wait_for(replies.called.wait(), 5)

    async def step() -> None:
        await written("a ")
        await written("b ")  # well within 1 s of the first
        await asyncio.sleep(1.1)
        await written("c ")
        await written("d ")

    await replies.run(job, SimpleNamespace(msg_id="m"), step())  # type: ignore[arg-type]
    assert replies.refresh == ["1", "", "1", ""]


class StateCountingRedis:
    """A partial stream that stays empty (its entries come through the watch) and a session
    state that counts how often it is read and says "outstanding"."""

    def __init__(self) -> None:
        self.state_reads = 0

    async def xrange(self, key: str, min: str, max: str, count: int) -> list:
        return []

    async def get(self, key: str) -> bytes:
        self.state_reads += 1
        return b"1"  # the message's seq

    async def hmget(self, key: str, fields: list[str]) -> list[bytes | None]:
        self.state_reads += 1
        return [b"0", b"1", None]  # seq 1 not applied yet


class QuietRouter:
    """A router that reads nothing: the test hands entries to the watch itself."""

    def __init__(self) -> None:
        self.watches: list[Watch] = []

    def watch(self, key: str) -> Watch:
        self.watches.append(Watch(self, key))  # type: ignore[arg-type]
        return self.watches[-1]

    def listen(self, watch: Watch, last: object) -> None:
        pass

    def unlisten(self, watch: Watch) -> None:
        pass

    done = 0

    def sync(self, watch: Watch) -> int:
        return 1

    def synced(self, watch: Watch, read: int) -> bool:
        return False


@pytest.mark.parametrize("just_sent", [False, True])
async def test_the_state_is_read_at_start_and_after_a_silence_not_while_entries_come(
    monkeypatch: pytest.MonkeyPatch, just_sent: bool
) -> None:
    """A long answer whose pieces keep coming costs no state reads (before: one every
    IDLE_CHECK_S per answer); a message sent just now under a new msg_id is not read at
    start either; after IDLE_CHECK_S without entries the state is read again."""
    monkeypatch.setattr(partials, "IDLE_CHECK_S", 0.15)
    redis, router = StateCountingRedis(), QuietRouter()
    keys = MessageKeys("P", "S", "D")
    reply: asyncio.Future = asyncio.get_running_loop().create_future()
    events = follow(redis, router, keys, "m", None, reply, None, just_sent)  # type: ignore[arg-type]
    got: list[str] = []

    async def read() -> None:
        async for event in events:
            got.append(event.text)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.02)
    assert redis.state_reads == (0 if just_sent else 2)  # the seq, then the state
    for pos in range(12):  # 0.48 s of pieces, 40 ms apart: three IDLE_CHECK_S
        router.watches[0].push([(f"2-{pos}".encode(), entry(1, pos, f"t{pos} "))])
        await asyncio.sleep(0.04)
    assert len(got) == 12
    assert redis.state_reads == (0 if just_sent else 2)
    await asyncio.sleep(0.3)  # silence: the state is read (seq known by now: one read)
    assert redis.state_reads >= (1 if just_sent else 3)
    reply.set_result(Reply("s", "m", 1, "applied", "done", "0-1"))
    await asyncio.wait_for(reader, 2)


async def test_a_watch_wait_ends_by_its_timeout_every_time_and_at_once_on_news() -> None:
    watch = QuietRouter().watch("P")
    loop = asyncio.get_running_loop()
    for timeout_s in (0.05, 0.05, 0.02, 0.1):  # a timer that fired is not relied on again
        started = loop.time()
        await asyncio.wait_for(watch.wait(timeout_s), 1)
        assert loop.time() - started < timeout_s + 0.05
        watch.take()
    waiting = asyncio.create_task(watch.wait(30))
    await asyncio.sleep(0.01)
    watch.push([(b"2-0", entry(1, 0, "x"))])
    await asyncio.wait_for(waiting, 1)
    assert watch.take() == ([(b"2-0", entry(1, 0, "x"))], False)
    watch.close()


class StubReplyRouter:
    def expect(self, session_id: str, msg_id: str, sending: bool = False) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def sent_as(self, future: asyncio.Future, entry_id: str) -> None:
        pass

    async def start(self) -> None:
        pass

    def forget(self, *args: object) -> None:
        pass

    def problem(self) -> str:
        return ""


async def test_ask_stream_skips_the_state_read_at_start_only_for_a_msg_id_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A msg_id the client made was never sent before; a given one may be a resend of a
    finished message, whose state must be read at once."""
    client = DialogClient("redis://127.0.0.1:1/0")  # never connects here
    followed: list[tuple[str, bool]] = []

    async def send(session_id: str, text: str, msg_id: str, **kw: object) -> SendResult:
        return SendResult(session_id, msg_id, "1-1")

    async def fake_follow(
        session_id: str,
        msg_id: str,
        after: object,
        waiter: object,
        deadline: object,
        just_sent: bool = False,
        sent: bool = False,
        sent_entry: str | None = None,
    ):
        assert sent  # ask_stream sent it: an end already in its stream may be an earlier one's
        assert sent_entry == "1-1"  # and as what entry: its own end comes after it was read
        followed.append((msg_id, just_sent))
        yield StreamEvent("end", msg_id, 0, "", f"{msg_id}:0:0", 0, "applied")

    monkeypatch.setattr(client, "_router", lambda stream: StubReplyRouter())
    monkeypatch.setattr(client, "send", send)
    monkeypatch.setattr(client, "_follow", fake_follow)
    try:
        assert [e.kind async for e in client.ask_stream("s1", "hi")] == ["end"]
        assert [e.kind async for e in client.ask_stream("s1", "hi", msg_id="given")] == ["end"]
    finally:
        await client.aclose()
    assert followed[0][1] is True and followed[1] == ("given", False)


class GatedStream:
    """One partial stream held in memory, read by the router through XREAD calls the test
    lets through one at a time, and by followers' XRANGE (which sees ``visible`` entries)."""

    def __init__(self, key: str) -> None:
        self.key = key.encode()
        self.entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        self.visible = 0
        self.reads: list[bytes] = []  # the id each XREAD read after
        self.gate: asyncio.Queue[None] = asyncio.Queue()

    def add(self, pos: int) -> None:
        self.entries.append((f"2-{pos}".encode(), entry(1, pos, f"t{pos} ")))

    def _after(self, raw: bytes | str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        after = partials._entry_id(raw.encode() if isinstance(raw, str) else raw)
        return [e for e in self.entries if partials._entry_id(e[0]) > after]

    async def xread(self, streams: dict, count: int, block: int) -> list:
        after = streams.get(self.key, streams.get(self.key.decode()))
        self.reads.append(after)
        await self.gate.get()
        got = self._after(after)[:count]
        return [[self.key, got]] if got else []

    async def xrange(self, key: str, min: str, max: str, count: int) -> list:
        start = b"0-0" if min == "-" else min.lstrip("(").encode()
        return [e for e in self.entries[: self.visible] if e in self._after(start)][:count]

    async def get(self, key: str) -> None:
        return None  # no seq known: the state (none) is read

    async def hget(self, key: str, field: str) -> None:
        return None

    async def hmget(self, key: str, fields: list[str]) -> list[bytes | None]:
        return [b"0", b"3", None]  # seq 3 outstanding


async def test_a_follower_joining_behind_a_read_under_way_still_gets_every_piece_once() -> None:
    """A second follower of the same answer catches up (XRANGE) to a place older than the
    router's, while the router's next read is on its way: that read's pieces would leave it
    a gap (before: it waited for a snapshot that never came); the router reads again from
    the older place, and each follower gets every piece once."""
    stream = GatedStream("P")
    router = partials.PartialRouter(stream)  # type: ignore[arg-type]
    keys = MessageKeys("P", "S", "D")
    loop = asyncio.get_running_loop()
    reply_a: asyncio.Future = loop.create_future()
    reply_b: asyncio.Future = loop.create_future()
    a = follow(stream, router, keys, "m", None, reply_a, None, True)  # type: ignore[arg-type]
    first = asyncio.ensure_future(anext(a))
    for pos in range(3):
        stream.add(pos)
    stream.gate.put_nowait(None)  # read 1: p0-p2 for A
    got_a = [await first, await anext(a), await anext(a)]
    await asyncio.sleep(0.02)  # the router's read 2 (after p2) is under way
    stream.visible = 3  # B's XRANGE sees p0-p2 ...
    stream.add(3)
    stream.gate.put_nowait(None)  # ... while read 2 hands p3 to A
    got_a.append(await anext(a))
    await asyncio.sleep(0.02)  # read 3 (after p3) under way
    b = follow(stream, router, keys, "m", Cursor("m", 1, 0), reply_b, None)  # type: ignore[arg-type]
    got_b = [await anext(b), await anext(b)]  # p1, p2 by its XRANGE; it listens after p2
    stream.add(4)
    for _ in range(3):
        stream.gate.put_nowait(None)
    got_a.append(await asyncio.wait_for(anext(a), 2))
    got_b += [await asyncio.wait_for(anext(b), 2), await asyncio.wait_for(anext(b), 2)]
    assert [e.text for e in got_a] == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]
    assert [e.text for e in got_b] == ["t1 ", "t2 ", "t3 ", "t4 "]
    assert [e.kind for e in got_a + got_b] == ["delta"] * 9
    await a.aclose()
    await b.aclose()
    await router.aclose()


async def test_a_finished_answer_waits_for_a_read_that_left_nothing_of_its_stream_unread() -> None:
    """The reply says the message is finished while more than two reads' worth of its pieces
    are still unread: the read after the reply brings a full page, so the follower waits for
    the next one before its end (its text complete), instead of ending after the first."""
    stream = GatedStream("P")
    router = partials.PartialRouter(stream)  # type: ignore[arg-type]
    keys = MessageKeys("P", "S", "D")
    reply: asyncio.Future = asyncio.get_running_loop().create_future()
    pieces = 2 * partials.PAGE + 2
    for pos in range(pieces):
        stream.add(pos)
    events = follow(stream, router, keys, "m", None, reply, None, True)  # type: ignore[arg-type]
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.02)  # read 1 under way
    text = "".join(f"t{pos} " for pos in range(pieces))
    reply.set_result(Reply("s", "m", 3, "applied", text, "0-1"))
    for _ in range(4):
        stream.gate.put_nowait(None)
    got = [await asyncio.wait_for(first, 2)]
    got += [e async for e in events]
    assert [e.kind for e in got] == ["delta"] * pieces + ["end"]
    assert "".join(e.text for e in got[:-1]) == text == got[-1].text
    await router.aclose()


def flat(fields: dict[bytes, bytes], order: list[bytes] | None = None) -> list[bytes]:
    return [x for name in (order or list(fields)) for x in (name, fields[name])]


@pytest.mark.parametrize(
    "raw",
    [
        flat(entry(1, 0, "hi"), [b"a", b"p", b"s", b"k", b"t"]),  # as emit-2.lua writes it
        flat(entry(1, 0, "hi")),  # another order
        [*flat(entry(1, 0, "hi"), [b"a", b"p", b"s", b"k", b"t"]), b"t", b"forged"],
        [b"a", b"1", b"p", b"0", b"s", b"3", b"k", b"d", b"x", b"hi"],  # no text field
        [b"a", b"1", b"p", b"0", b"s", b"3", b"k", b"e", b"t", b"bye"],  # an end
        flat(entry(1, 4, "x", f="whole text"), [b"a", b"p", b"s", b"k", b"t", b"f"]),
        [],
    ],
)
def test_an_entry_as_redis_sent_it_reads_as_its_mapping(raw: list[bytes]) -> None:
    """The router hands entries on as Redis sent them (a flat list): read by position when
    laid out as the emit script writes them, else through a mapping; the same events either
    way, repeated names included (the last wins)."""
    it = iter(raw)
    mapping = dict(zip(it, it, strict=False))
    assert run(Tracker("m"), [raw]) == run(Tracker("m"), [mapping])


class CountingReplies(PartialReplies):
    """The worker's partial writer with Redis replaced by a call that counts its calls."""

    def __init__(self) -> None:
        super().__init__(None, load_settings(environ={"DIALOG_PARTIAL_FLUSH_MS": "40"}))  # type: ignore[arg-type]
        self.calls: list[list[str | int]] = []

    async def call(self, keys: list[str], args: list[str | int]) -> list[int]:
        self.calls.append(args)
        await asyncio.sleep(0)
        return [1] * (len(args) // BATCH_WIDTH)


async def test_the_ends_of_messages_committed_together_go_in_one_call() -> None:
    """A thousand answers finishing together were a thousand concurrent script calls for
    their end entries, each taking a connection of its own (the worker's pool grew by
    hundreds, each connection a handshake): now one call carries them all, at once, not
    after a flush interval."""
    replies = CountingReplies()
    keys = SimpleNamespace(
        shard=0, session=lambda sid: SimpleNamespace(lock=f"L{sid}", partial=lambda m: f"P{m}")
    )
    jobs = [
        SimpleNamespace(keys=keys, token=f"t{i}", seq=i + 1, session_id=f"s{i}", attempts=1)
        for i in range(50)
    ]
    started = asyncio.get_running_loop().time()
    await asyncio.gather(
        *(
            replies.committed(job, f"m{i}", "dead_lettered", "sorry")  # type: ignore[arg-type]
            for i, job in enumerate(jobs)
        )
    )
    for _ in range(100):
        if replies.calls:
            break
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    assert asyncio.get_running_loop().time() - started < 0.04  # not a flush interval later
    assert len(replies.calls) == 1
    ends = [replies.calls[0][i : i + BATCH_WIDTH] for i in range(0, 50 * BATCH_WIDTH, BATCH_WIDTH)]
    assert [(e[0], e[4], e[7]) for e in ends] == [("e", i + 1, "dead_lettered") for i in range(50)]


def test_a_rejection_read_with_nobody_waiting_is_kept_until_the_msg_id_is_sent_again() -> None:
    """The reply reader keeps a `rejected` event it read with nobody waiting, for a stream of
    it that starts a moment later on the same client: what ends such a stream when the worker
    that rejected it wrote no end into its partial stream (a worker of the previous version,
    during an upgrade). Sent again, the msg_id's old rejection answers it no more."""
    from dialog_worker.client.replies import ReplyRouter

    router = ReplyRouter(None, "dialog-replies", block_ms=100)  # type: ignore[arg-type]
    fields = {b"session_id": b"s", b"msg_id": b"m", b"seq": b"0", b"outcome": b"rejected"}
    router._route(b"1-1", fields)
    kept = router.rejected("s", "m")
    assert kept is not None and (kept.outcome, kept.seq, kept.id) == ("rejected", 0, "1-1")
    assert router.rejected("s", "other") is None
    router.sent("s", "m")
    assert router.rejected("s", "m") is None


async def test_a_waiter_of_a_msg_id_sent_again_takes_only_the_event_of_its_own_entry() -> None:
    """The reply reader, behind, reads a msg_id's earlier event (its message ended cancelled,
    which frees the msg_id) after the re-send's waiter registered: before the send is known
    (held), and after it (an earlier entry's). Neither answers it; its own entry's event does,
    read during the send or after it; a waiter that sends nothing takes the first event."""
    from dialog_worker.client.replies import ReplyRouter

    router = ReplyRouter(None, "dialog-replies", block_ms=100)  # type: ignore[arg-type]

    def event(seq: int, outcome: str, entry: str) -> dict[bytes, bytes]:
        return {
            b"session_id": b"s",
            b"msg_id": b"m",
            b"seq": str(seq).encode(),
            b"outcome": outcome.encode(),
            b"entry_id": entry.encode(),
        }

    early, late = router.expect("s", "m", sending=True), router.expect("s", "m", sending=True)
    plain = router.expect("s", "m")
    router._route(b"9-1", event(1, "cancelled", "5-0"))  # while both sends are under way
    assert plain.done() and plain.result().outcome == "cancelled"  # not sending: as before
    router._route(b"9-2", event(2, "applied", "7-0"))  # `early`'s own, read before it knew
    router.sent_as(early, "7-0")
    assert early.done() and (early.result().seq, early.result().outcome) == (2, "applied")
    router.sent_as(late, "8-0")
    assert not late.done()  # what it held was older than its entry
    router._route(b"9-3", event(1, "cancelled", "5-0"))  # read late again
    assert not late.done()
    router._route(b"9-4", event(3, "duplicate", "8-0"))
    assert late.done() and (late.result().seq, late.result().outcome) == (3, "duplicate")
    for waiter in (early, late, plain):
        router.forget("s", "m", waiter)
    assert (router._waiters, router._sent_as, router._held) == ({}, {}, {})


class FlakyReplies(PartialReplies):
    """The worker's partial writer whose first script call fails on a lost connection after
    the step emitted more meanwhile; the calls after it are written (the texts recorded)."""

    def __init__(self) -> None:
        super().__init__(None, load_settings(environ={"DIALOG_PARTIAL_FLUSH_MS": "1"}))  # type: ignore[arg-type]
        self.sent: list[str] = []
        self.calling = asyncio.Event()
        self.fail = asyncio.Event()
        self.failed = False

    async def call(self, keys: list[str], args: list[str | int]) -> list[int]:
        texts = [str(args[i + 5]) for i in range(0, len(args), BATCH_WIDTH)]
        if not self.failed:
            self.failed = True
            self.calling.set()
            await self.fail.wait()
            raise redis.exceptions.ConnectionError("Connection reset by peer")
        self.sent += texts
        return [1] * len(texts)


async def test_text_of_a_write_lost_on_a_connection_error_goes_before_what_came_after_it() -> None:
    """A batch whose call failed on a connection error is given back to its writer: it is
    written again at the next flush, ahead of what the step emitted while the call was on
    its way (after it, readers would see the answer's pieces out of order)."""
    replies = FlakyReplies()
    keys = SimpleNamespace(
        shard=0, session=lambda sid: SimpleNamespace(lock="L", partial=lambda m: f"P:{m}")
    )
    job = SimpleNamespace(keys=keys, token="t", seq=1, session_id="s", attempts=1, partial=None)

    async def step() -> str:
        emit("one ")
        await replies.calling.wait()  # "one " is on its way
        emit("two ")
        replies.fail.set()  # ... and its call fails
        await asyncio.sleep(0.05)
        emit("three ")
        return "one two three "

    await replies.run(job, SimpleNamespace(msg_id="m"), step())  # type: ignore[arg-type]
    assert "".join(replies.sent) == "one two three "
    assert job.partial.pos == len(replies.sent)  # each written piece counted once


async def test_a_follower_more_than_its_backlog_behind_the_router_reads_the_rest_itself() -> None:
    """A follower that takes nothing while the router reads on (a slow consumer of the
    answer) holds at most WATCH_BACKLOG entries; past that it drops them and, when it takes
    again, reads from its own place by itself (XRANGE), so it still gets every piece once,
    in order: never a silent gap."""
    stream = GatedStream("P")
    stream.visible = 10**6  # every entry added is there for the follower's own reads too
    router = partials.PartialRouter(stream)  # type: ignore[arg-type]
    keys = MessageKeys("P", "S", "D")
    reply: asyncio.Future = asyncio.get_running_loop().create_future()
    stream.add(0)
    events = follow(stream, router, keys, "m", None, reply, None)  # type: ignore[arg-type]
    got = [await asyncio.wait_for(anext(events), 2)]  # p0 by its own read; it listens after
    pieces = partials.WATCH_BACKLOG + 2 * partials.PAGE
    for pos in range(1, pieces + 1):
        stream.add(pos)
    reads = -(-pieces // partials.PAGE)  # the router's reads that bring them all
    for _ in range(reads):
        stream.gate.put_nowait(None)
    for _ in range(200):  # the router has handed out all it read (the follower took none)
        if len(stream.reads) > reads:
            break
        await asyncio.sleep(0.01)
    assert len(stream.reads) > reads
    while len(got) < pieces + 1:
        stream.gate.put_nowait(None)  # the router may read on meanwhile
        got.append(await asyncio.wait_for(anext(events), 2))
    assert [e.text for e in got] == [f"t{pos} " for pos in range(pieces + 1)]
    await events.aclose()
    await router.aclose()


def test_a_waiting_entry_reads_as_a_waiting_event_with_a_reason_and_a_time() -> None:
    """The worker's `waiting` entry (kind "v", event kind "waiting") is its own event kind,
    with ``data`` {reason, until_ms} and a cursor like any piece; forged data reads as reason
    `rate` with no time, never as something else."""
    t = Tracker("m")
    waiting = entry(1, 0, '{"reason":"paused","until_ms":1700000000000}', k="v")
    waiting[b"n"] = b"waiting"
    forged = entry(1, 1, '{"reason":"<b>","until_ms":"soon"}', k="v")
    forged[b"n"] = b"waiting"
    transient = entry(1, 0, '{"reason":"rate","until_ms":5}', k="w")
    transient[b"n"] = b"waiting"
    older = entry(0, 0, '{"reason":"rate","until_ms":5}', k="w")
    older[b"n"] = b"waiting"
    got = [e for x in (transient, waiting, forged, older, entry(1, 2, "hi")) for e in t.feed(x)]
    assert [(e.kind, e.data, e.cursor) for e in got] == [
        ("waiting", {"reason": "rate", "until_ms": 5}, None),  # at no position: no cursor
        ("waiting", {"reason": "paused", "until_ms": 1700000000000}, "m:1:0"),
        ("waiting", {"reason": "rate", "until_ms": None}, "m:1:1"),
        ("delta", None, "m:1:2"),
    ]
    shown = got[1].as_dict()
    assert shown["data"] == {"reason": "paused", "until_ms": 1700000000000}
    assert "event_kind" not in shown


async def test_a_hand_back_tells_readers_at_no_position_unless_the_answer_had_text() -> None:
    """After a step went back to wait (its writer closed), `PartialReplies.waiting` writes one
    `waiting` event, fenced by the lock. An answer that wrote nothing gets a transient entry
    (kind "w", no position): the next attempt keeps its number, so its model calls find
    their kept turns. One that wrote gets it at its next position (its next attempt takes a
    new number anyway)."""
    replies = RecordingReplies(ttl_s=8)
    sent: list[list[str | int]] = []

    async def call(keys: list[str], args: list[str | int]) -> list[int]:
        sent.append(args)
        return [1]

    replies.call = call  # type: ignore[method-assign]
    keys = SimpleNamespace(
        shard=0, session=lambda sid: SimpleNamespace(lock="L", partial=lambda m: f"P:{m}")
    )
    job = SimpleNamespace(keys=keys, token="t", seq=4, session_id="s", attempts=2, partial=None)

    async def step() -> None:
        raise RuntimeError("went back")

    with pytest.raises(RuntimeError):
        await replies.run(job, SimpleNamespace(msg_id="m"), step())  # type: ignore[arg-type]
    await replies.waiting(job, "paused", 5000)  # type: ignore[arg-type]
    [args] = sent
    assert args[:5] == ["w", "t", 2, 0, 4] and args[7] == "waiting"
    data = json.loads(str(args[5]))
    assert data["reason"] == "paused" and data["until_ms"] > time.time() * 1000 + 4000
    assert not job.partial.used and job.partial.pos == 0, "the attempt keeps its number"
    job.partial.used, job.partial.pos = True, 3  # it had streamed three pieces
    await replies.waiting(job, "rpm", 5000)  # type: ignore[arg-type]
    assert sent[1][:5] == ["v", "t", 2, 3, 4] and json.loads(str(sent[1][5]))["reason"] == "rate"
    assert job.partial.pos == 4


def test_the_gateway_sends_waiting_as_an_sse_event_of_its_own() -> None:
    from dialog_worker.gateway.native import format_event

    data = {"reason": "rate", "until_ms": 5}
    text = format_event(StreamEvent("waiting", "m", 1, "", "m:1:0", 0, data=data))
    assert text.startswith("id: m:1:0\nevent: waiting\ndata: ")
    assert json.loads(text.split("data: ", 1)[1])["data"] == data


async def test_a_call_waiting_inside_its_step_tells_readers_when_the_wait_is_worth_a_line() -> None:
    """A turn 200 ms or more away (reason from the key: a pause is `paused`), or the key's
    calls in flight full (first poll only, no time known), is a `waiting` event in order with
    the text; a shorter wait, a turn at once, a later poll are not."""
    from dialog_worker.daemon.model_gate import Attempt
    from dialog_worker.daemon.partial_writer import waiting_data
    from dialog_worker.engine import emit as emit_context
    from dialog_worker.store.limits import Answer
    from dialog_worker.store.scripts import Turn

    got: list[tuple[str, dict[str, object]]] = []

    async def waiting(why: str, wait_ms: float | None) -> None:
        got.append(("waiting", json.loads(waiting_data(why, wait_ms))))

    writer = SimpleNamespace(waiting=waiting)
    attempt = Attempt(None, None, "s", 1, 1, "t", "d", 0)  # type: ignore[arg-type]
    token = emit_context.bind(writer)  # type: ignore[arg-type]
    try:
        now_ms = time.time() * 1000
        await attempt._announce_wait(Answer(Turn.GRANTED, 0, "", 10), first=True)
        await attempt._announce_wait(Answer(Turn.GRANTED, 199, "rpm", 10), first=True)
        await attempt._announce_wait(Answer(Turn.GRANTED, 1500, "rpm", 10), first=True)
        await attempt._announce_wait(Answer(Turn.GRANTED, 900, "paused", 10), first=True)
        await attempt._announce_wait(Answer(Turn.BUSY, 50, "in_flight", 0), first=True)
        await attempt._announce_wait(Answer(Turn.BUSY, 50, "in_flight", 0), first=False)
    finally:
        emit_context.unbind(token)
    assert [(k, d["reason"]) for k, d in got] == [
        ("waiting", "rate"),
        ("waiting", "paused"),
        ("waiting", "rate"),
    ]
    assert now_ms + 1400 < got[0][1]["until_ms"] < now_ms + 3000  # type: ignore[operator]
    assert got[2][1]["until_ms"] is None
