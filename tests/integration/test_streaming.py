"""Streamed replies end to end: real redis-server, real worker processes, DialogClient.stream
and ask_stream (dialog_worker/daemon/partial_writer.py, dialog_worker/client/partial_reader.py,
lua/emit-2.lua)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest
from redis_server import wait_until, wait_until_async
from stream_views import shown, streamed
from worker_procs import WorkerPool

from dialog_worker import StreamEvent
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.errors import ReplyTimeout

pytestmark = pytest.mark.integration


async def collect(client: DialogClient, session: str, text: str, **kw) -> list[StreamEvent]:
    return [e async for e in client.ask_stream(session, text, timeout=30, **kw)]


@pytest.mark.parametrize("engine", ["AsyncWords", "ThreadWords"])
async def test_a_step_streams_batched_deltas_and_ends_with_the_committed_reply(
    client: DialogClient, workers: WorkerPool, engine: str
):
    workers.start(1, DIALOG_ENGINE=f"stream_engines:{engine}")
    events = await collect(client, "st-1", "60 5", msg_id="m1")
    reply = "".join(f"w{i} " for i in range(60))
    assert events[-1].kind == "end"
    assert (events[-1].outcome, events[-1].text) == ("applied", reply)
    assert [e.kind for e in events[:-1]] == ["delta"] * (len(events) - 1)
    assert streamed(events) == reply  # every piece once, in order
    deltas = len(events) - 1
    # 60 tokens over ~300 ms, gathered every 40 ms: a handful of writes, never one per token.
    assert 2 <= deltas <= 20, deltas
    assert [e.pos for e in events[:-1]] == list(range(deltas))
    assert all(e.cursor == f"m1:1:{e.pos}" for e in events[:-1])
    key = client.keys.session("st-1").partial("m1")
    # The deltas and the end entry (appended right after the commit, which readers need not
    # wait for: the reply event ends them too).
    await wait_until_async(
        lambda: _length_is(client, key, deltas + 1), 5, what="the end entry appended"
    )
    ttl = await client.redis.ttl(key)
    assert 0 < ttl <= 600


async def test_a_reader_resuming_from_any_cursor_gets_each_piece_once(
    client: DialogClient, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    reply = "".join(f"w{i} " for i in range(80))
    first: list[StreamEvent] = []
    async for event in client.ask_stream("st-2", "80 5", msg_id="m2", timeout=30):
        first.append(event)
        if len(first) == 3:
            break  # the connection drops mid-answer
    assert all(e.kind == "delta" for e in first)
    rest = [e async for e in client.stream("st-2", "m2", after=first[-1].cursor, timeout=30)]
    assert rest[-1].kind == "end" and rest[-1].text == reply
    assert streamed(first + rest) == reply
    positions = [e.pos for e in first + rest[:-1]]
    assert positions == list(range(len(positions)))  # nothing twice, nothing missing
    # Resumed from every cursor after the end: exactly the remaining pieces.
    everything = [e async for e in client.stream("st-2", "m2", timeout=5)]
    for i, event in enumerate(everything[:-1]):
        tail = [e async for e in client.stream("st-2", "m2", after=event.cursor, timeout=5)]
        assert [e.pos for e in tail[:-1]] == [e.pos for e in everything[i + 1 : -1]]
        assert streamed(everything[: i + 1] + tail) == reply


async def test_a_reader_after_the_end_gets_the_committed_reply_and_nothing_after_its_cursor(
    client: DialogClient, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:EmitsOtherThanReturns")
    events = await collect(client, "st-3", "x", msg_id="m3")
    assert [e.kind for e in events] == ["delta", "end"]
    assert (events[0].text, events[-1].text) == ("draft ", "final answer")
    late = [e async for e in client.stream("st-3", "m3", timeout=5)]
    assert [(e.kind, e.text) for e in late] == [("delta", "draft "), ("end", "final answer")]
    assert late[-1].cursor == events[-1].cursor
    assert [e async for e in client.stream("st-3", "m3", after=events[-1].cursor, timeout=5)] == []


async def test_after_the_partial_stream_expired_a_reader_gets_the_reply_from_the_history(
    client: DialogClient, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords", DIALOG_PARTIAL_TTL_S="1")
    events = await collect(client, "st-4", "5 1", msg_id="m4")
    key = client.keys.session("st-4").partial("m4")
    await wait_until_async(lambda: _gone(client, key), 5, what="partial stream expired")
    late = [e async for e in client.stream("st-4", "m4", after=events[1].cursor, timeout=5)]
    assert [(e.kind, e.outcome, e.text) for e in late] == [("end", "applied", events[-1].text)]


async def _length_is(client: DialogClient, key: str, length: int) -> bool:
    return bool(await client.redis.xlen(key) == length)


async def _gone(client: DialogClient, key: str) -> bool:
    return not await client.redis.exists(key)


async def test_a_retried_attempt_tells_readers_to_replace_what_the_failed_one_streamed(
    client: DialogClient, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:FailsFirstAttempt", DIALOG_BACKOFF_BASE_MS="1")
    reply = "".join(f"w{i} " for i in range(10))
    events = await collect(client, "st-5", "10 5", msg_id="m5")
    kinds = [e.kind for e in events]
    assert "reset" in kinds, kinds
    reset = kinds.index("reset")
    assert streamed(events[:reset]) == "WRONG START "
    assert streamed(events) == reply and shown(events) == reply
    assert events[reset].attempt == 2
    # A reader resuming from the failed attempt's cursor is told to start over.
    again = [e async for e in client.stream("st-5", "m5", after=events[0].cursor, timeout=5)]
    assert again[0].kind == "reset" and shown(events[:1] + again) == reply


async def test_a_429_after_the_step_streamed_resets_its_readers_and_spends_no_attempt(
    client: DialogClient, workers: WorkerPool
):
    """One attempt allowed (DIALOG_MAX_ATTEMPTS=1). The step streams, then its model call is
    refused twice (429): each time its readers are told to start over (reset, a new attempt
    number: the partial stream's cursor rules) and the answer starts again when the key
    reopens. It is applied, not dead-lettered: a 429 never costs an attempt."""
    workers.start(1, DIALOG_ENGINE="stream_engines:LimitedAfterEmit", DIALOG_MAX_ATTEMPTS="1")
    reply = "".join(f"w{i} " for i in range(10))
    events = await collect(client, "st-429", "10 5 2", msg_id="m429")
    kinds = [e.kind for e in events]
    assert kinds[-1] == "end" and events[-1].outcome == "applied", kinds
    assert kinds.count("reset") == 2, kinds
    assert streamed(events) == "THINKING " + reply and shown(events) == reply
    assert [e.attempt for e in events if e.kind == "reset"] == [2, 3]
    assert await client.redis.xlen(client.keys.dlq) == 0


async def test_an_engine_that_never_emits_streams_just_its_end(
    client: DialogClient, workers: WorkerPool
):
    workers.start(1)  # the built-in rules
    events = await collect(client, "st-6", "nama saya Budi", msg_id="m6")
    assert [(e.kind, e.outcome, e.text) for e in events] == [
        ("end", "applied", "Halo Budi, ada yang bisa dibantu?")
    ]
    late = [e async for e in client.stream("st-6", "m6", timeout=5)]
    assert [(e.kind, e.text) for e in late] == [("end", "Halo Budi, ada yang bisa dibantu?")]


async def test_stream_of_a_message_nobody_answers_times_out_naming_it(client: DialogClient):
    started = time.monotonic()
    with pytest.raises(ReplyTimeout, match="m7"):
        async for _ in client.stream("st-7", "m7", timeout=0.5):
            pass
    assert time.monotonic() - started < 3


async def test_a_worker_killed_mid_answer_is_replaced_and_readers_see_one_clean_answer(
    client: DialogClient, workers: WorkerPool, tmp_path: Path
):
    log = tmp_path / "engine"
    env = {
        "DIALOG_ENGINE": "stream_engines:SlowOnFirstWorker",
        "APP_ENGINE_LOG": str(log),
        "DIALOG_LOCK_TTL_MS": "500",
    }
    [first] = workers.start(1, **env)
    reply = "".join(f"w{i} " for i in range(30))
    events: list[StreamEvent] = []

    async def read() -> None:
        async for event in client.ask_stream("st-8", "30 20", msg_id="m8", timeout=30):
            events.append(event)

    reader = asyncio.create_task(read())
    marker = Path(f"{log}.started")
    await asyncio.to_thread(wait_until, marker.exists, 20, what="first attempt half way")
    first.signal(signal.SIGKILL)
    workers.start(1, **env)
    await asyncio.wait_for(reader, 30)
    assert events[-1].kind == "end" and events[-1].text == reply
    assert "reset" in [e.kind for e in events]
    assert shown(events) == reply and streamed(events) == reply
    assert not first.alive()


# ---------------------------------------------------------------------------------------------
# lua/emit-2.lua on its own


async def _emit(
    client: DialogClient, *args: str | int, maxlen: int = 1000, refresh: str = ""
) -> int:
    """One batch (kind, token, attempt, pos, seq, text, snapshot, outcome) of message m9 of
    session st-9, with a ttl of 600 s."""
    from dialog_worker.store.scripts import Script, source

    session = client.keys.session("st-9")
    script = Script(client.redis, source("emit"))
    keys = [session.lock, session.partial("m9")]
    if args[0] == "e":  # the end follows a commit: the session has its state
        await client.redis.hsetnx(session.state, "v", 1)
    [code] = await script(keys=keys, args=[maxlen, 600, 1, *args, refresh])
    return int(code)


async def _entries(client: DialogClient) -> list[tuple[str, str]]:
    """(entry id, text) of every entry of st-9's m9."""
    rows = await client.raw.xrange(client.keys.session("st-9").partial("m9"))
    return [(i.decode(), f[b"t"].decode()) for i, f in rows]


async def test_only_the_lock_holder_appends_and_a_resent_batch_is_written_once(
    client: DialogClient,
):
    session = client.keys.session("st-9")
    await client.redis.set(session.lock, "tok", px=5000)
    assert await _emit(client, "d", "other", 1, 0, 1, "zombie", "", "") == -1
    assert await _emit(client, "d", "tok", 1, 0, 1, "a", "", "") == 1
    assert await _emit(client, "d", "tok", 1, 0, 1, "a", "", "") == 0  # the same call again
    assert await _emit(client, "d", "tok", 1, 1, 1, "b", "", "") == 1
    assert await _emit(client, "d", "tok", 0, 5, 1, "old", "", "") == -3  # an older attempt
    assert await _emit(client, "e", "", 1, 2, 1, "ab", "", "applied") == 1
    assert await _emit(client, "d", "tok", 1, 2, 1, "late", "", "") == 0  # after the end
    assert await _emit(client, "e", "", 1, 2, 1, "ab", "", "applied") == 0
    texts = [f[b"t"] for _, f in await client.raw.xrange(session.partial("m9"))]
    assert texts == [b"a", b"b", b"ab"]


async def test_redis_refuses_a_resent_batch_by_its_explicit_id_and_nothing_is_written(
    client: DialogClient,
):
    session = client.keys.session("st-9")
    await client.redis.set(session.lock, "tok", px=5000)
    for pos in range(3):
        assert await _emit(client, "d", "tok", 1, pos, 1, f"p{pos}", "", "") == 1
    for pos in range(3):  # a lost reply: the same batches again
        assert await _emit(client, "d", "tok", 1, pos, 1, f"p{pos}", "", "") == 0
    assert await _entries(client) == [("2-0", "p0"), ("2-1", "p1"), ("2-2", "p2")]


async def test_an_older_attempt_is_refused_after_a_newer_one_wrote(client: DialogClient):
    session = client.keys.session("st-9")
    await client.redis.set(session.lock, "tok", px=5000)
    assert await _emit(client, "d", "tok", 1, 0, 1, "first ", "", "") == 1
    assert await _emit(client, "d", "tok", 2, 0, 1, "second", "", "") == 1
    # The first attempt's writer, paused, wakes with a later position than the second's.
    assert await _emit(client, "d", "tok", 1, 7, 1, "zombie", "", "") == -3
    assert await _emit(client, "d", "tok", 1, 1, 1, "zombie", "", "") == -3
    assert await _entries(client) == [("2-0", "first "), ("3-0", "second")]


async def test_nothing_is_appended_after_the_end_not_even_a_newer_attempt(client: DialogClient):
    session = client.keys.session("st-9")
    await client.redis.set(session.lock, "tok", px=5000)
    assert await _emit(client, "d", "tok", 1, 0, 1, "a", "", "") == 1
    assert await _emit(client, "e", "", 1, 1, 1, "a", "", "applied") == 1
    assert await _emit(client, "d", "tok", 1, 1, 1, "late", "", "") == 0
    assert await _emit(client, "d", "tok", 9, 0, 1, "newer", "", "") == 0
    assert await _emit(client, "e", "", 9, 0, 1, "other", "", "applied") == 0
    assert await _entries(client) == [("2-0", "a"), ("18446744073709551615-0", "a")]
    events = [e async for e in client.stream("st-9", "m9", timeout=5)]
    assert [(e.kind, e.text) for e in events] == [("delta", "a"), ("end", "a")]


async def test_a_stream_of_time_based_ids_from_the_previous_version_is_still_appended(
    client: DialogClient,
):
    """An answer in flight during a rolling upgrade: the earlier script wrote its first
    entries with ids of the clock, which every explicit id is below."""
    session = client.keys.session("st-9")
    key = session.partial("m9")
    await client.redis.set(session.lock, "tok", px=5000)
    for pos in range(2):
        fields = {"a": 1, "p": pos, "s": 1, "k": "d", "t": f"old{pos} "}
        await client.redis.xadd(key, fields)  # type: ignore[arg-type]
    assert await _emit(client, "d", "tok", 1, 2, 1, "new2 ", "", "") == 1
    assert await _emit(client, "d", "tok", 1, 2, 1, "new2 ", "", "") == 0  # resent
    assert await _emit(client, "d", "tok", 1, 1, 1, "old1 ", "", "") == 0
    assert await _emit(client, "d", "tok", 0, 5, 1, "stale", "", "") == -3
    assert await _emit(client, "d", "tok", 1, 3, 1, "new3 ", "", "") == 1
    assert await _emit(client, "e", "", 1, 4, 1, "final", "", "applied") == 1
    assert await _emit(client, "d", "tok", 1, 4, 1, "late", "", "") == 0
    entries = await _entries(client)
    assert [t for _, t in entries] == ["old0 ", "old1 ", "new2 ", "new3 ", "final"]
    assert int(entries[3][0].split("-")[0]) > 10**12  # still the clock's ids
    assert 0 < await client.redis.ttl(key) <= 600
    events = [e async for e in client.stream("st-9", "m9", timeout=5)]
    assert streamed(events) == "old0 old1 new2 new3 " and events[-1].text == "final"


async def test_the_expiry_is_set_at_a_new_stream_first_every_32nd_asked_and_end_entries(
    client: DialogClient,
):
    """Not at every append: a stream's expiry is set by the entry that creates it, the first
    of each attempt, every 32nd, one the writer asks for, and the end."""
    session = client.keys.session("st-9")
    key = session.partial("m9")
    await client.redis.set(session.lock, "tok", px=60_000)

    async def ttl_after(attempt: int, pos: int, kind: str = "d", refresh: str = "") -> int:
        await client.redis.expire(key, 100)  # stands for what is left of the last one set
        token = "tok" if kind == "d" else ""
        code = await _emit(client, kind, token, attempt, pos, 1, "x", "", "", refresh=refresh)
        assert code == 1
        return int(await client.redis.ttl(key))

    assert await _emit(client, "d", "tok", 1, 0, 1, "x", "", "") == 1
    assert 590 < await client.redis.ttl(key) <= 600
    assert await ttl_after(1, 1) <= 100
    assert await ttl_after(1, 2, refresh="1") > 590
    assert await ttl_after(1, 31) <= 100
    assert await ttl_after(1, 32) > 590
    assert await ttl_after(1, 33) <= 100
    assert await ttl_after(2, 0) > 590
    assert await ttl_after(2, 1) <= 100
    # The stream expired (or was deleted) while its answer went on: the next entry, due or
    # not, makes a new one, never one without an expiry.
    await client.redis.delete(key)
    assert await _emit(client, "d", "tok", 2, 5, 1, "x", "", "") == 1
    assert 590 < await client.redis.ttl(key) <= 600
    assert await ttl_after(2, 6, kind="e") > 590


async def test_a_batch_costs_a_lock_check_and_one_xadd(client: DialogClient):
    """The commands Redis runs for batches that need no expiry: GET of the lock (the fence)
    and XADD, nothing else."""
    from dialog_worker.store.scripts import Script, source

    script = Script(client.redis, source("emit"))
    keys: list[str] = []
    args: list[str | int] = []
    for i in range(10):
        session = client.keys.session(f"st-c{i}")
        await client.redis.set(session.lock, "tok", px=60_000)
        keys += [session.lock, session.partial("c")]
        args += ["d", "tok", 1, 0, 1, "text", "", "", ""]
    await script(keys=keys, args=[1000, 600, 10, *args])  # the first entries: expiry set
    before = await client.redis.info("commandstats")
    args = [a if i % 9 != 3 else 1 for i, a in enumerate(args)]  # the next position
    assert [int(c) for c in await script(keys=keys, args=[1000, 600, 10, *args])] == [1] * 10
    after = await client.redis.info("commandstats")
    ran = {
        name.removeprefix("cmdstat_"): int(v["calls"]) - int(before.get(name, {}).get("calls", 0))
        for name, v in after.items()
    }
    script_may_run = ("get", "xadd", "expire", "xrevrange", "type", "exists")
    assert {name: ran.get(name, 0) for name in script_may_run} == {
        "get": 10,
        "xadd": 10,
        "expire": 0,
        "xrevrange": 0,
        "type": 0,
        "exists": 0,
    }


@pytest.mark.parametrize(
    "args",
    [
        ("x", "tok", 1, 0, 1, "a", "", ""),
        ("d", "tok", "one", 0, 1, "a", "", ""),
        ("d", "tok", 1, -1, 1, "a", "", ""),
        ("d", "tok", 1, 0, 1, "a", ""),
    ],
)
async def test_bad_arguments_write_nothing(client: DialogClient, args):
    import redis.exceptions

    session = client.keys.session("st-9")
    await client.redis.set(session.lock, "tok", px=5000)
    with pytest.raises(redis.exceptions.ResponseError, match="emit"):
        await _emit(client, *args)
    assert not await client.redis.exists(session.partial("m9"))


async def test_a_partial_stream_is_capped_and_a_reader_behind_the_cap_resyncs(
    client: DialogClient,
):
    """MAXLEN ~ 10 (snapshots every 5 entries; Redis trims whole nodes of 100 entries): 250
    entries, a reader that saw only the first."""
    session = client.keys.session("st-9")
    await client.redis.set(session.lock, "tok", px=5000)
    await client.redis.set(session.dedupe("m9"), 1)
    text = ""
    for pos in range(250):
        piece = f"p{pos} "
        full = text + piece if pos and pos % 5 == 0 else ""
        text += piece
        assert await _emit(client, "d", "tok", 1, pos, 1, piece, full, "", maxlen=10) == 1
    length = await client.redis.xlen(session.partial("m9"))
    assert length < 250
    await _emit(client, "e", "", 1, 250, 1, text, "", "applied", maxlen=10)
    events = [e async for e in client.stream("st-9", "m9", after="m9:1:0", timeout=5)]
    assert events[0].kind == "resync"
    assert shown(events[:-1]) == text


async def test_cli_ask_stream_prints_each_event_as_a_json_line(
    env: dict[str, str], workers: WorkerPool
):
    import json
    import subprocess
    import sys

    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "dialog_worker", "ask", "st-10", "30 5", "--stream"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) >= 3
    assert {line["kind"] for line in lines[:-1]} == {"delta"}
    reply = "".join(f"w{i} " for i in range(30))
    assert "".join(line["text"] for line in lines[:-1]) == reply
    assert (lines[-1]["kind"], lines[-1]["outcome"], lines[-1]["text"]) == ("end", "applied", reply)
    assert lines[-1]["session_id"] == "st-10"


async def test_one_script_call_writes_the_batches_of_every_live_answer(
    client: DialogClient, workers: WorkerPool
):
    """20 answers streamed at once by one worker: the writes are grouped across answers, so
    the worker's script calls (intake, commit and emit together) are far fewer than the
    entries written."""
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    before = (await client.redis.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)

    async def one(i: int) -> list[StreamEvent]:
        return await collect(client, f"st-g{i}", "80 5", msg_id=f"g{i}")

    answers = await asyncio.gather(*(one(i) for i in range(20)))
    after = (await client.redis.info("commandstats"))["cmdstat_evalsha"]["calls"]
    reply = "".join(f"w{i} " for i in range(80))
    assert all(shown(events) == reply == streamed(events) for events in answers)
    entries = 0
    for i in range(20):
        entries += await client.redis.xlen(client.keys.session(f"st-g{i}").partial(f"g{i}"))
    assert entries >= 20 * 5
    assert after - before < entries / 2, (after - before, entries)


async def test_a_partial_stream_key_of_another_type_refuses_its_batch_alone(
    client: DialogClient,
):
    from dialog_worker.store.scripts import Script, source

    script = Script(client.redis, source("emit"))
    a, b = client.keys.session("st-11"), client.keys.session("st-12")
    await client.redis.set(a.lock, "tok", px=5000)
    await client.redis.set(b.lock, "tok", px=5000)
    await client.redis.set(a.partial("x"), "not a stream")
    keys = [a.lock, a.partial("x"), b.lock, b.partial("y"), a.lock, a.partial("x")]
    batch = ["d", "tok", 1, 0, 1, "text", "", "", ""]
    later = ["d", "tok", 1, 1, 1, "more", "", "", ""]  # no expiry due: XADD NOMKSTREAM
    codes = await script(keys=keys, args=[1000, 600, 3, *batch, *batch, *later])
    assert [int(c) for c in codes] == [-4, 1, -4]
    assert await client.redis.get(a.partial("x")) == "not a stream"
    assert await client.redis.xlen(b.partial("y")) == 1


async def test_a_reader_that_learns_the_end_from_the_state_still_reads_every_piece_first(
    client: DialogClient, monkeypatch: pytest.MonkeyPatch
):
    """The router has not delivered the last pieces yet (here: it never does) when the
    session's state says the message is applied: the reader reads them before the end."""
    import json

    from dialog_worker.client import partial_reader as partials

    class SilentRouter(partials.PartialRouter):
        def listen(self, watch: partials.Watch, last: tuple[int, int] | None) -> None:
            pass

    monkeypatch.setattr(partials, "IDLE_CHECK_S", 0.1)
    session = client.keys.session("st-13")
    await client.redis.set(session.lock, "tok", px=5000)
    await client.redis.set(session.dedupe("m13"), 1)
    await client.redis.hset(session.state, mapping={"a": 0, "s": 1})
    for pos in range(3):
        await _emit_to(client, session, "m13", pos, f"p{pos} ")
    keys = partials.MessageKeys(session.partial("m13"), session.state, session.dedupe("m13"))
    never: asyncio.Future = asyncio.get_running_loop().create_future()
    events = partials.follow(
        client.raw, SilentRouter(client.raw), keys, "m13", None, never, deadline=None
    )
    got = [await anext(events) for _ in range(3)]
    for pos in range(3, 6):
        await _emit_to(client, session, "m13", pos, f"p{pos} ")
    reply = "".join(f"p{i} " for i in range(6))
    turn = {"seq": 1, "msg_id": "m13", "user": "u", "bot": reply}
    await client.redis.hset(session.state, mapping={"a": 1, "d": json.dumps({"history": [turn]})})
    got += [e async for e in events]
    assert [e.kind for e in got] == ["delta"] * 6 + ["end"]
    assert streamed(got) == reply == got[-1].text


async def _emit_to(client: DialogClient, session, msg_id: str, pos: int, text: str) -> None:
    from dialog_worker.store.scripts import Script, source

    script = Script(client.redis, source("emit"))
    keys = [session.lock, session.partial(msg_id)]
    args = [1000, 600, 1, "d", "tok", 1, pos, 1, text, "", "", ""]
    [code] = await script(keys=keys, args=args)
    assert int(code) == 1


class OwnReads:
    """The follower's own reads of Redis (its catch-up XRANGEs), counted."""

    def __init__(self, redis) -> None:
        self.redis = redis
        self.xranges = 0

    async def xrange(self, *args, **kwargs):
        self.xranges += 1
        return await self.redis.xrange(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.redis, name)


@pytest.mark.parametrize("end_entry", [True, False])
async def test_a_follower_of_a_message_just_sent_takes_every_piece_from_the_router(
    client: DialogClient, end_entry: bool
):
    """A message just sent has (nearly) nothing streamed yet: its follower is not worth an
    XRANGE at start. When the reply says it is finished, the rest of its text comes from the
    router's next read (with the end entry, or without one) instead of an XRANGE each: at a
    thousand answers those were two thousand reads."""
    import json

    from dialog_worker.client import partial_reader as partials
    from dialog_worker.client.replies import Reply

    session = client.keys.session(f"st-14{end_entry}")
    await client.redis.set(session.lock, "tok", px=5000)
    await client.redis.set(session.dedupe("m14"), 1)
    await client.redis.hset(session.state, mapping={"a": 0, "s": 1})
    keys = partials.MessageKeys(session.partial("m14"), session.state, session.dedupe("m14"))
    own = OwnReads(client.raw)
    router = partials.PartialRouter(client.raw)
    reply: asyncio.Future = asyncio.get_running_loop().create_future()
    events = partials.follow(own, router, keys, "m14", None, reply, None, just_sent=True)  # type: ignore[arg-type]
    first = asyncio.ensure_future(anext(events))
    for pos in range(3):
        await _emit_to(client, session, "m14", pos, f"p{pos} ")
    got = [await asyncio.wait_for(first, 5)]
    got += [await asyncio.wait_for(anext(events), 5) for _ in range(2)]
    for pos in range(3, 6):
        await _emit_to(client, session, "m14", pos, f"p{pos} ")
    text = "".join(f"p{i} " for i in range(6))
    turn = {"seq": 1, "msg_id": "m14", "user": "u", "bot": text}
    await client.redis.hset(session.state, mapping={"a": 1, "d": json.dumps({"history": [turn]})})
    reply.set_result(Reply(f"st-14{end_entry}", "m14", 1, "applied", text, "0-1"))
    if end_entry:
        from dialog_worker.store.scripts import Script, source

        script = Script(client.redis, source("emit"))
        end = ["e", "", 1, 6, 1, text, "", "applied", ""]
        await script(keys=[session.lock, session.partial("m14")], args=[1000, 600, 1, *end])
    got += [e async for e in events]
    await router.aclose()
    assert [e.kind for e in got] == ["delta"] * 6 + ["end"]
    assert streamed(got) == text == got[-1].text
    assert own.xranges == 0


async def test_a_plain_xadd_message_whose_turn_left_the_history_ends_expired_at_once(
    client: DialogClient, workers: WorkerPool
):
    """Sent without a msg_id, a message's msg_id is its entry id and no dedupe key records its
    seq: once its turn left the history its stream must still end (as one with a msg_id does),
    while one still unread in the inbound stream is waited for."""
    # The workers' group exists (as once any worker ran) and has delivered nothing past it.
    await client.raw.xgroup_create(client.keys.stream, client.keys.group, id="$", mkstream=True)
    unread = await client.raw.xadd(client.keys.stream, {"session_id": "st-px", "text": "first"})
    with pytest.raises(ReplyTimeout):  # no worker yet: it waits, it does not end
        [e async for e in client.stream("st-px", unread.decode(), timeout=2.5)]
    workers.start(1, DIALOG_HISTORY_LIMIT="2")
    for i in range(4):
        await client.raw.xadd(client.keys.stream, {"session_id": "st-px", "text": f"m{i}"})
    await wait_until_async(lambda: _applied(client, "st-px", 5), 20, what="5 messages applied")
    started = time.monotonic()
    events = [e async for e in client.stream("st-px", unread.decode(), timeout=5)]
    assert [(e.kind, e.outcome, e.text) for e in events] == [("end", "expired", "")]
    assert time.monotonic() - started < 1.5  # the state is looked at once, at start
    # The newest message's turn is still kept: its reply, as before.
    state = await client.state("st-px")
    assert state is not None
    kept = state["history"][-1]
    events = [e async for e in client.stream("st-px", kept["msg_id"], timeout=20)]
    assert [(e.kind, e.outcome, e.text) for e in events] == [("end", "applied", kept["bot"])]


async def _applied(client: DialogClient, session: str, seq: int) -> bool:
    state = await client.state(session)
    return state is not None and state["applied_seq"] >= seq


async def test_a_msg_id_sent_again_starts_its_partial_stream_anew(client: DialogClient):
    """Message seq 1 ended cancelled (its msg_id freed) and left its end; the same msg_id sent
    again is seq 2: its first batch replaces the old stream instead of being answered 'already
    there', and its readers see only its own answer."""
    session = client.keys.session("st-9")
    await client.redis.set(session.lock, "tok", px=5000)
    assert await _emit(client, "d", "tok", 1, 0, 1, "old ", "", "") == 1
    assert await _emit(client, "e", "", 1, 1, 1, "old ", "", "cancelled") == 1
    assert await _emit(client, "d", "tok", 1, 0, 2, "new ", "", "") == 1
    assert await _emit(client, "d", "tok", 1, 1, 2, "text", "", "") == 1
    assert await _entries(client) == [("2-0", "new "), ("2-1", "text")]
    assert await client.redis.ttl(session.partial("m9")) > 0
    assert await _emit(client, "e", "", 1, 2, 2, "new text", "", "applied") == 1
    events = [e async for e in client.stream("st-9", "m9", timeout=5)]
    assert [(e.kind, e.text) for e in events] == [
        ("delta", "new "),
        ("delta", "text"),
        ("end", "new text"),
    ]


@pytest.mark.parametrize("msg_id", ["m2", "1700000000000-0"], ids=["msg-id", "plain-xadd"])
async def test_a_reader_of_a_message_a_redrive_moved_up_waits_for_its_new_seq(
    client: DialogClient, msg_id: str
):
    """A reader follows the message (seq 2) as its first attempt streams. A redrive into its
    held session then puts a dead letter at seq 2 and moves the message up to 3 (its dedupe
    key follows; a message sent without a msg_id has none), and the letter is applied. The
    reader must not take the letter's turn for its message's end (`expired`): it waits, and
    ends with the answer once seq 3 is applied."""
    sk = client.keys.session("st-mv")
    # The workers' group has delivered past the message (it is not unread).
    await client.raw.xgroup_create(
        client.keys.stream, client.keys.group, id="1800000000000-0", mkstream=True
    )
    for pos, text in enumerate(("OLD.0 ", "OLD.1 ")):
        fields = {"a": 1, "p": pos, "s": 2, "k": "d", "t": text}
        await client.redis.xadd(sk.partial(msg_id), fields, id=f"2-{pos}")  # type: ignore[arg-type]
    await client.redis.hset(sk.state, mapping={"a": 1, "s": 2, "d": "{}"})
    if msg_id == "m2":
        await client.redis.set(sk.dedupe(msg_id), 2)
    else:
        await client.redis.zadd(sk.ids, {msg_id: time.time() * 1000 + 60_000})
    got: list[StreamEvent] = []

    async def read() -> None:
        async for event in client.stream("st-mv", msg_id, timeout=20):
            got.append(event)

    reader = asyncio.create_task(read())
    await wait_until_async(lambda: _true(len(got) == 2), 5, what="the first attempt's pieces")
    # The redrive, then the letter applied.
    letter = {"seq": 2, "msg_id": "redrive:1-0", "user": "letter", "bot": "letter ok"}
    state = {"a": 2, "s": 3, "d": json.dumps({"history": [letter]})}
    await client.redis.hset(sk.state, mapping=state)  # type: ignore[arg-type]
    if msg_id == "m2":
        await client.redis.set(sk.dedupe(msg_id), 3)
    await asyncio.sleep(3)  # past the reader's look at the state after a silence (2 s)
    assert not reader.done(), got
    turn = {"seq": 3, "msg_id": msg_id, "user": "12 50", "bot": "the answer"}
    state = {"a": 3, "d": json.dumps({"history": [letter, turn]})}
    await client.redis.hset(sk.state, mapping=state)  # type: ignore[arg-type]
    await asyncio.wait_for(reader, 10)
    assert (got[-1].kind, got[-1].outcome, got[-1].text) == ("end", "applied", "the answer")


async def _true(value: bool) -> bool:
    return value


async def test_a_reader_starting_while_the_stream_holds_an_earlier_message_shows_none_of_it(
    client: DialogClient,
):
    """m9 (seq 1) ended cancelled and left its pieces and its end; sent again it is seq 2 (its
    dedupe key says so) and has streamed nothing yet. A reader starting now shows none of
    the old pieces (no old text, then a reset): it waits for seq 2's, which start the stream
    anew below the ids it read."""
    session = client.keys.session("st-9")
    await client.redis.set(session.lock, "tok", px=5000)
    assert await _emit(client, "d", "tok", 1, 0, 1, "old ", "", "") == 1
    assert await _emit(client, "e", "", 1, 1, 1, "old ", "", "cancelled") == 1
    await client.redis.set(session.dedupe("m9"), 2)
    await client.redis.hset(session.state, mapping={"a": 1, "s": 2})
    got: list[StreamEvent] = []

    async def read() -> None:
        async for event in client.stream("st-9", "m9", timeout=10):
            got.append(event)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.5)
    assert got == []
    assert await _emit(client, "d", "tok", 1, 0, 2, "new ", "", "") == 1
    assert await _emit(client, "d", "tok", 1, 1, 2, "text", "", "") == 1
    assert await _emit(client, "e", "", 1, 2, 2, "new text", "", "applied") == 1
    await asyncio.wait_for(reader, 10)
    assert [(e.kind, e.text) for e in got] == [
        ("delta", "new "),
        ("delta", "text"),
        ("end", "new text"),
    ]
