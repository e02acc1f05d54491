"""Poison messages and the dead-letter stream, with real worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import anyio
import pytest
import redis.asyncio
from queue_checks import assert_drained
from redis_server import wait_until_async as wait_for

from dialog_worker import __version__
from dialog_worker.ops.dead_letters import redrive, resend
from dialog_worker.ops.verify import Sent, check, send_bursts, wait_applied

pytestmark = pytest.mark.fault

FAST = {
    "DIALOG_ENGINE": "fault_engine:make",
    "DIALOG_LOCK_TTL_MS": "1000",
    "DIALOG_VISIBILITY_TIMEOUT_MS": "1500",
    "DIALOG_RECLAIM_INTERVAL_MS": "100",
    "DIALOG_BACKOFF_BASE_MS": "20",
    "DIALOG_BACKOFF_MAX_MS": "100",
    # Explicit: the expected attempt counts below must not follow the default.
    "DIALOG_MAX_ATTEMPTS": "3",
}

# What the worker adds to the original fields of a dead letter (contract, section 3).
LETTER_FIELDS = {
    "error",
    "error_kind",
    "attempts",
    "first_failed_at",
    "last_failed_at",
    "consumer",
    "worker_version",
    "source_stream",
    "source_entry_id",
}


async def dead_letters(client) -> list[dict[str, str]]:
    return [f for _, f in await client.redis.xrange(client.keys.dlq)]


async def reply_events(client, session_id: str) -> list[dict[str, str]]:
    return [
        f
        for _, f in await client.redis.xrange(client.keys.replies)
        if f["session_id"] == session_id
    ]


async def assert_nothing_left(client, dead: int) -> None:
    """Stream, pending list, ready set empty, no lock, nothing outstanding; `dead` letters."""
    await assert_drained(client, timeout_s=20, dlq=dead)


async def test_step_that_always_raises_is_dead_lettered_after_max_attempts(client, workers):
    workers.start(2, **FAST)
    sent = await send_bursts(client, ["p1"], ["nama saya Budi", "boom here", "saya ada kendala"])
    poison = sent[1]
    assert await wait_applied(client, sent, timeout_s=30)
    [letter] = await dead_letters(client)
    # The original fields byte for byte (session_id, text and the msg_id the client
    # generated), plus the worker's, and the message's seq (every dead letter of a sequenced
    # message has it).
    assert set(letter) == {"session_id", "text", "msg_id", "seq"} | LETTER_FIELDS
    assert letter["seq"] == "2"
    assert (letter["session_id"], letter["text"]) == ("p1", "boom here")
    assert letter["msg_id"] == poison.msg_id
    assert (letter["error_kind"], letter["attempts"]) == ("exhausted", "3")
    assert letter["source_stream"] == client.keys.stream
    [event] = [e for e in await reply_events(client, "p1") if e["msg_id"] == poison.msg_id]
    assert letter["source_entry_id"] == event["entry_id"]
    assert "boom on seq 2" in letter["error"]
    assert int(letter["first_failed_at"]) <= int(letter["last_failed_at"])
    state = await client.state("p1")
    assert [t["seq"] for t in state["history"]] == [1, 2, 3]
    assert state["history"][1]["bot"] == client.settings.fallback_reply
    # The complaint that followed the poison message was still applied, in order.
    assert state["step"] == "COMPLETED"
    events = await reply_events(client, "p1")
    assert [(e["seq"], e["outcome"]) for e in events] == [
        ("1", "applied"),
        ("2", "dead_lettered"),
        ("3", "applied"),
    ]
    assert events[1]["entry_id"] == letter["source_entry_id"]
    assert events[1]["reply"] == client.settings.fallback_reply
    assert await check(client, [s for s in sent if s is not poison]) == []
    await assert_nothing_left(client, dead=1)


async def test_a_dead_letter_keeps_the_time_of_the_first_failure_across_attempts(client, workers):
    """Three attempts, each retried after 2 to 4 s: first_failed_at is the first attempt's
    failure (right after the append), last_failed_at the third's (two retry waits later)."""
    [worker] = workers.start(
        1, **{**FAST, "DIALOG_BACKOFF_BASE_MS": "4000", "DIALOG_BACKOFF_MAX_MS": "4000"}
    )
    # Idle (it holds the waiter lease): the append is read at once, not after its start.
    await wait_for(lambda: client.redis.exists(client.keys.waiter), 20, "the worker to be idle")
    sent = await client.send("ff", "boom again and again")
    appended_ms = int(sent.entry_id.split("-")[0])  # Redis' clock, as the scripts' times
    letter = await wait_for(lambda: _first_letter(client), 30, "the dead letter")
    assert (letter["error_kind"], letter["attempts"]) == ("exhausted", "3")
    first, last = int(letter["first_failed_at"]), int(letter["last_failed_at"])
    # Before the first retry wait could have ended (at least 2 s after the first failure).
    assert 0 <= first - appended_ms < 2000, (appended_ms, first)
    assert last - first >= 2 * 2000, (first, last)  # two waits of at least half of 4 s
    # The rest of the worker's bookkeeping, each with its value.
    assert letter["consumer"] == worker.name
    assert letter["worker_version"] == __version__
    assert (letter["source_stream"], letter["source_entry_id"]) == (
        client.keys.stream,
        sent.entry_id,
    )
    assert (letter["seq"], letter["msg_id"], letter["session_id"]) == ("1", sent.msg_id, "ff")
    assert letter["error"].startswith("RuntimeError: boom on seq 1"), letter["error"]


async def test_session_shows_the_message_being_retried_with_its_attempts_and_error(
    client, workers, env
):
    """`dialog-worker session` between two attempts: the message in flight with its attempt
    count and last error, when the session is looked at next, and what waits behind it."""
    workers.start(1, **{**FAST, "DIALOG_BACKOFF_BASE_MS": "8000", "DIALOG_BACKOFF_MAX_MS": "8000"})
    await wait_for(lambda: client.redis.exists(client.keys.waiter), 20, "the worker to be idle")
    first = await client.send("rv", "boom now", msg_id="m1")
    second = await client.send("rv", "nama saya Budi", msg_id="m2")
    sk = client.keys.session("rv")

    async def failed_once() -> bool:
        return await client.redis.hget(sk.state, "e") is not None

    await wait_for(failed_once, 20, "the first failed attempt")
    shown = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "dialog_worker", "session", "rv"],
            env=env, capture_output=True, text=True, timeout=60,
        )
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert 0 < view.pop("next_look_in_s") <= 8
    waiting = view.pop("waiting")
    assert [(w["seq"], w["msg_id"], w["entry_id"], w["present"]) for w in waiting] == [
        (1, "m1", first.entry_id, True),
        (2, "m2", second.entry_id, True),
    ]
    assert all(0 <= w["age_s"] < 60 for w in waiting)
    in_flight = view.pop("in_flight")
    assert in_flight.pop("last_error").startswith("RuntimeError: boom on seq 1")
    assert in_flight == {"seq": 1, "attempts": 1}
    assert view == {
        "session_id": "rv",
        "lock": {"token": None, "ttl_ms": None},
        "applied_seq": 0,
        "last_seq": 2,
        "version": 0,
        "step": None,
        "dead_letters": [],
    }


async def _first_letter(client) -> dict[str, str] | None:
    letters = await dead_letters(client)
    return letters[0] if letters else None


async def test_a_message_of_exactly_max_message_bytes_is_sent_and_applied_one_more_is_refused(
    client, workers, env
):
    """DIALOG_MAX_MESSAGE_BYTES counts every field name and value of the entry: send refuses
    one byte more, the worker accepts exactly the limit (and dead-letters one more, appended
    by a producer that skips the check)."""
    from dialog_worker.client.dialog_client import DialogClient
    from dialog_worker.config import load_settings
    from dialog_worker.errors import ValidationError

    limit = 1000
    workers.start(1, **FAST, DIALOG_MAX_MESSAGE_BYTES=str(limit))
    settings = load_settings(environ={**env, "DIALOG_MAX_MESSAGE_BYTES": str(limit)})
    fixed = len("session_id") + len("mb") + len("msg_id") + len("m1") + len("text")
    text = "nama saya " + "B" * (limit - fixed - len("nama saya "))
    async with DialogClient(settings=settings) as small:
        with pytest.raises(ValidationError, match=f"at most {limit}"):
            await small.send("mb", text + "x", msg_id="m0")
        await small.send("mb", text, msg_id="m1")
    fields = {"session_id": "mb", "msg_id": "m2", "text": text + "x"}
    assert sum(len(k) + len(v) for k, v in fields.items()) == limit + 1
    await client.redis.xadd(client.keys.stream, fields)
    events = await wait_for(lambda: _two_events(client, "mb"), 20, "both messages answered")
    assert sorted((e["msg_id"], e["seq"], e["outcome"]) for e in events) == [
        ("m1", "1", "applied"),
        ("m2", "0", "dead_lettered"),
    ]
    [letter] = await dead_letters(client)
    assert letter["error"] == f"entry is {limit + 1} bytes; at most {limit} are allowed"
    state = await client.state("mb")
    assert [t["user"] for t in state["history"]] == [text]
    await assert_nothing_left(client, dead=1)


async def _two_events(client, session_id: str) -> list[dict[str, str]] | None:
    events = await reply_events(client, session_id)
    return events if len(events) >= 2 else None


async def test_permanent_error_is_dead_lettered_at_once(client, workers):
    workers.start(1, **FAST)
    sent = await send_bursts(client, ["p2"], ["fatal input", "nama saya Ani"])
    assert await wait_applied(client, sent, timeout_s=20)
    [letter] = await dead_letters(client)
    assert (letter["error_kind"], letter["attempts"]) == ("permanent", "1")
    assert (await client.state("p2"))["memory"] == {"userName": "Ani"}
    assert await check(client, sent[1:]) == []
    await assert_nothing_left(client, dead=1)


async def test_step_that_kills_its_worker_is_dead_lettered_without_crash_loop(client, workers):
    procs = workers.start(2, **FAST)
    sent = await send_bursts(client, ["p3"], ["exit now", "nama saya Budi"])
    deaths = 0
    deadline = time.monotonic() + 60
    while not await client.redis.xlen(client.keys.dlq):
        assert time.monotonic() < deadline, "poison message never dead-lettered"
        for w in list(procs):
            if not w.alive():  # a supervisor restarts what died
                deaths += 1
                procs.remove(w)
                procs += workers.start(1, **FAST)
        assert deaths <= 3, f"a crash loop: {deaths} deaths for DIALOG_MAX_ATTEMPTS=3"
        await anyio.sleep(0.05)
    assert await wait_applied(client, sent, timeout_s=30)
    [letter] = await dead_letters(client)
    assert (letter["error_kind"], letter["attempts"]) == ("exhausted", "3")
    assert "delivered 3 times" in letter["error"]
    assert deaths == 3, f"expected one death per delivery, saw {deaths}"
    assert all(w.alive() for w in procs)
    assert await check(client, sent[1:]) == []
    await assert_nothing_left(client, dead=1)
    print(f"\nos._exit poison: {deaths} worker deaths, then dead-lettered")


async def test_entry_without_session_id_is_dead_lettered_with_reason(client, workers):
    k = client.keys
    # A raw XADD (any producer can write one); appended before any worker runs.
    bad_id = await client.redis.xadd(k.stream, {"text": "no session", "seq": "1"})
    workers.start(1, **FAST)
    sent = await send_bursts(client, ["ok"], ["nama saya Budi"])
    assert await wait_applied(client, sent, timeout_s=20)
    await wait_for(lambda: client.redis.xlen(k.dlq), 20, "dead letter")
    [letter] = await dead_letters(client)
    assert letter["error_kind"] == "malformed"
    assert "session_id" in letter["error"]
    assert (letter["source_stream"], letter["source_entry_id"]) == (k.stream, bad_id)
    # Its fields byte for byte, the forged seq included (it was never used).
    assert (letter["text"], letter["seq"]) == ("no session", "1")
    # It names no session: no reply event refers to it.
    assert [f for _, f in await client.redis.xrange(k.replies) if f["entry_id"] == bad_id] == []
    assert await check(client, sent) == []
    await assert_nothing_left(client, dead=1)


async def test_oversized_entry_is_dead_lettered_and_the_next_message_proceeds(client, workers):
    workers.start(1, **FAST, DIALOG_MAX_MESSAGE_BYTES="1000")
    k = client.keys
    # A producer that bypasses send's check: a raw XADD. It is refused at intake and takes no
    # seq, so the next message of the session is seq 1.
    await client.redis.xadd(k.stream, {"session_id": "big", "msg_id": "huge", "text": "x" * 5000})
    await client.send("big", "nama saya Budi")
    state = await wait_for(
        lambda: _state_at(client, "big", 1), 20, "the message after the oversized one"
    )
    assert state["memory"] == {"userName": "Budi"}
    assert [t["user"] for t in state["history"]] == ["nama saya Budi"]
    [letter] = await dead_letters(client)
    assert letter["error_kind"] == "malformed" and "bytes" in letter["error"]
    assert len(letter["text"]) == 5000  # the dead letter keeps the original whole
    events = await reply_events(client, "big")
    assert [(e["msg_id"], e["seq"], e["outcome"]) for e in events] == [
        ("huge", "0", "dead_lettered"),
        (events[1]["msg_id"], "1", "applied"),
    ]
    await assert_nothing_left(client, dead=1)


async def test_malformed_entries_in_one_read_hurt_only_themselves(client, workers):
    """One intake call reads all of these (appended before the worker starts): the refused
    ones are dead-lettered alone, content the engine cannot take (text that is not UTF-8) is
    dead-lettered in its turn, and a producer-written seq is ignored."""
    k = client.keys
    entries = [
        {"session_id": "m", "text": "nama saya Budi", "seq": "99", "attempts": "7"},
        {"text": "no session"},
        {"session_id": "m", "text": "   "},
        {"session_id": "m", "text": b"\xff\xfe not utf-8"},
        {"session_id": "m", "msg_id": "huge", "text": "x" * 5000},
        {"session_id": "m", "msg_id": "bad\x01id", "text": "control character in msg_id"},
        {"session_id": "m", "text": "saya ada kendala"},
    ]
    ids = [await client.redis.xadd(k.stream, e) for e in entries]
    workers.start(1, **FAST, DIALOG_MAX_MESSAGE_BYTES="1000")
    state = await wait_for(lambda: _state_at(client, "m", 3), 20, "session m at seq 3")
    assert [t["seq"] for t in state["history"]] == [1, 2, 3]
    assert [t["bot"] == client.settings.fallback_reply for t in state["history"]] == [
        False,
        True,
        False,
    ]
    assert state["memory"]["userName"] == "Budi" and state["step"] == "COMPLETED"
    # Read as bytes: one dead letter keeps the text that is not UTF-8, byte for byte.
    raw = redis.asyncio.Redis.from_url(client.settings.redis_url)
    try:
        letters = [f for _, f in await raw.xrange(k.dlq)]
    finally:
        await raw.aclose()
    kinds = {f[b"source_entry_id"].decode(): f[b"error_kind"] for f in letters}
    assert kinds == {i: b"malformed" for i in ids[1:6]}
    assert [f[b"text"] for f in letters if f[b"source_entry_id"] == ids[3].encode()] == [
        b"\xff\xfe not utf-8"
    ]
    events = await reply_events(client, "m")
    assert sorted((e["entry_id"], e["seq"], e["outcome"]) for e in events) == sorted(
        [
            (ids[0], "1", "applied"),
            (ids[2], "0", "dead_lettered"),
            (ids[3], "2", "dead_lettered"),
            (ids[4], "0", "dead_lettered"),
            (ids[5], "0", "dead_lettered"),
            (ids[6], "3", "applied"),
        ]
    )
    await assert_nothing_left(client, dead=5)


async def test_a_session_key_of_the_wrong_type_hurts_only_its_own_entries(client, workers):
    """A per-session key of the wrong type (written by hand, or left by a bad restore) makes
    the commands on it fail inside the intake script. Redis keeps what a failed script wrote:
    the batch-mates' dedupe keys were written, their entries left pending, and every reclaim
    answered them 'duplicate' without ever applying them (seen before the fix: the reclaimer
    failed every round and the reply stream filled with duplicate events). The entries that
    meet such a key are refused alone; the others are applied."""
    k = client.keys
    await client.redis.hset(k.session("x").dedupe("bad"), "not", "a string")
    await client.redis.set(k.session("y").state, "not a hash")
    ids = [
        await client.redis.xadd(k.stream, e)
        for e in [
            {"session_id": "a", "msg_id": "m1", "text": "nama saya Budi"},
            {"session_id": "x", "msg_id": "bad", "text": "halo"},
            {"session_id": "y", "text": "halo"},
            {"session_id": "a", "msg_id": "m2", "text": "saya ada kendala"},
        ]
    ]
    workers.start(1, **FAST)
    state = await wait_for(lambda: _state_at(client, "a", 2), 20, "session a at seq 2")
    assert [t["msg_id"] for t in state["history"]] == ["m1", "m2"]
    letters = {f["source_entry_id"]: f for f in await dead_letters(client)}
    assert set(letters) == {ids[1], ids[2]}
    assert all(f["error_kind"] == "malformed" for f in letters.values())
    assert "WRONGTYPE" in letters[ids[1]]["error"] and "WRONGTYPE" in letters[ids[2]]["error"]
    outcomes = [(f["entry_id"], f["outcome"]) for _, f in await client.redis.xrange(k.replies)]
    assert sorted(outcomes) == sorted(
        [
            (ids[0], "applied"),
            (ids[1], "dead_lettered"),
            (ids[2], "dead_lettered"),
            (ids[3], "applied"),
        ]
    )
    # The corrupt keys are left as they were, for a human to look at.
    assert await client.redis.type(k.session("y").state) == "string"
    await assert_nothing_left(client, dead=2)


async def _state_at(client, session_id: str, seq: int):
    state = await client.state(session_id)
    return state if state and state["applied_seq"] >= seq else None


async def test_redrive_resends_and_a_message_that_fails_again_is_dead_lettered_again(
    client, workers, tmp_path, env
):
    flag = tmp_path / "flaky-on"
    flag.write_text("1")
    workers.start(1, **FAST, FAULT_FLAG_FILE=str(flag))
    sent = await send_bursts(client, ["r1"], ["flaky a", "boom b"])
    assert await wait_applied(client, sent, timeout_s=30)
    assert len(await dead_letters(client)) == 2

    flag.unlink()  # the dependency is fixed: "flaky" now succeeds, "boom" still fails
    cli = [sys.executable, "-m", "dialog_worker", "dlq"]
    result = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [*cli, "redrive", "--rate", "50"], env=env, capture_output=True, text=True, check=True
        )
    )
    assert json.loads(result.stdout) == {"redriven": 2, "skipped": 0}

    async def settled():
        state = await client.state("r1")
        return state if state and state["applied_seq"] >= 4 else None

    state = await wait_for(settled, 30, "redriven messages")
    turns = [
        (t["seq"], t["user"], t["bot"] == client.settings.fallback_reply) for t in state["history"]
    ]
    assert turns == [
        (1, "flaky a", True),
        (2, "boom b", True),
        (3, "flaky a", False),
        (4, "boom b", True),
    ]
    [again] = await dead_letters(client)
    assert again["text"] == "boom b" and again["msg_id"].startswith("redrive:")
    await assert_nothing_left(client, dead=1)
    listed = await anyio.to_thread.run_sync(
        lambda: subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, check=True)
    )
    assert [json.loads(line)["msg_id"] for line in listed.stdout.splitlines()] == [again["msg_id"]]


async def test_a_state_larger_than_max_state_bytes_is_dead_lettered_at_once(client, workers):
    workers.start(1, **FAST, DIALOG_MAX_STATE_BYTES="20000")
    sent = await send_bursts(client, ["huge"], ["big 10000", "big 30000", "nama saya Ani"])
    assert await wait_applied(client, sent, timeout_s=20)
    [letter] = await dead_letters(client)
    assert (letter["text"], letter["error_kind"], letter["attempts"]) == (
        "big 30000", "permanent", "1")  # fmt: skip
    assert "DIALOG_MAX_STATE_BYTES" in letter["error"]
    state = await client.state("huge")
    assert len(state["memory"]["blob"]) == 10000  # the refused state was never stored
    assert state["memory"]["userName"] == "Ani"
    events = [(e["seq"], e["outcome"]) for e in await reply_events(client, "huge")]
    assert events == [("1", "applied"), ("2", "dead_lettered"), ("3", "applied")]
    await assert_nothing_left(client, dead=1)


async def test_a_state_of_exactly_max_state_bytes_is_stored_and_one_byte_more_is_refused(
    client, workers
):
    """The limit is the stored document's size: measured once with room to spare, then set
    to exactly that size; the same step in a session of the same id length is applied, one
    byte more is dead-lettered."""
    k = client.keys
    workers.start(1, **FAST)
    await client.send("sz-a", "big 5000", msg_id="m1")
    await wait_for(lambda: _state_at(client, "sz-a", 1), 20, "the measuring step")
    size = len(await client.raw.hget(k.session("sz-a").state, "d"))
    workers.stop_all()
    workers.start(1, **FAST, DIALOG_MAX_STATE_BYTES=str(size))
    await client.send("sz-b", "big 5000", msg_id="m1")
    await client.send("sz-c", "big 5001", msg_id="m1")
    state = await wait_for(lambda: _state_at(client, "sz-b", 1), 20, "the step at the limit")
    assert len(state["memory"]["blob"]) == 5000
    assert len(await client.raw.hget(k.session("sz-b").state, "d")) == size
    letter = await wait_for(lambda: _first_letter(client), 20, "the step one byte over")
    assert (letter["session_id"], letter["error_kind"], letter["attempts"]) == (
        "sz-c", "permanent", "1")  # fmt: skip
    assert letter["error"] == (
        f"engine state is {size + 1} bytes; at most {size} (DIALOG_MAX_STATE_BYTES) are allowed"
    )


async def test_a_step_running_past_the_step_timeout_is_a_failed_attempt(client, workers):
    workers.start(1, **FAST, DIALOG_STEP_TIMEOUT_S="0.3")
    # 8 s: without the timeout the step would finish and be applied, well within the wait.
    sent = await send_bursts(client, ["slowpoke"], ["sleep 8", "nama saya Budi"])
    assert await wait_applied(client, sent, timeout_s=20)
    [letter] = await dead_letters(client)
    assert (letter["error_kind"], letter["attempts"]) == ("exhausted", "3")
    assert "did not finish within 0.3 s" in letter["error"]
    assert (await client.state("slowpoke"))["memory"]["userName"] == "Budi"
    await assert_nothing_left(client, dead=1)


# ---------------------------------------------------------------------------------------------
# dlq redrive: --id, --limit, --rate, and a dead letter re-sent twice


async def _letters_by_hand(client, n: int) -> list[str]:
    """Dead letters as the workers write them (original fields, source stream, error)."""
    ids = []
    for i in range(n):
        ids.append(
            await client.redis.xadd(
                client.keys.dlq,
                {
                    "session_id": f"rd{i}",
                    "text": "nama saya Budi",
                    "error": "boom",
                    "error_kind": "exhausted",
                    "source_stream": client.keys.stream,
                },
            )
        )
    return ids


async def _resent_msg_ids(client) -> list[str]:
    return [f["msg_id"] for _, f in await client.redis.xrange(client.keys.stream)]


async def test_redrive_only_the_named_dead_letter_or_at_most_the_limit(client, env):
    ids = await _letters_by_hand(client, 4)
    only = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "dialog_worker", "dlq", "redrive", "--id", ids[2]],
            env=env, capture_output=True, text=True, check=True,
        )
    )  # fmt: skip
    assert json.loads(only.stdout) == {"redriven": 1, "skipped": 0}
    assert await _resent_msg_ids(client) == [f"redrive:{ids[2]}"]
    limited = await redrive(client.topology.shards, client, limit=2, rate_per_s=None, only_id=None)
    assert limited == {"redriven": 2, "skipped": 0}
    assert await _resent_msg_ids(client) == [f"redrive:{i}" for i in (ids[2], ids[0], ids[1])]
    assert [i for i, _ in await client.redis.xrange(client.keys.dlq)] == [ids[3]]


async def test_redrive_rate_spaces_the_sends(client):
    await _letters_by_hand(client, 4)
    started = time.monotonic()
    result = await redrive(client.topology.shards, client, limit=None, rate_per_s=5, only_id=None)
    took = time.monotonic() - started
    assert result == {"redriven": 4, "skipped": 0}
    assert took >= 0.6  # 4 sends at 5 per second: 0.2 s apart (the last wait included)
    assert await client.redis.xlen(client.keys.dlq) == 0


async def test_a_dead_letter_redriven_twice_is_applied_once(client, workers):
    """A redrive stopped after the send and before the dead letter's deletion, then run
    again: the same dead letter is sent twice, with the same msg_id, and applied once."""
    [entry_id] = await _letters_by_hand(client, 1)
    [letter] = await client.entries.range(client.keys.dlq)
    await resend(client, client.keys, entry_id, letter)  # the first run, stopped here
    again = await redrive(client.topology.shards, client, limit=None, rate_per_s=None, only_id=None)
    assert again == {"redriven": 1, "skipped": 0}
    workers.start(1)
    sent = [Sent("rd0", 1, f"redrive:{entry_id}", "nama saya Budi")]
    assert await wait_applied(client, sent, timeout_s=20)
    await assert_nothing_left(client, dead=0)
    outcomes = [(e["seq"], e["outcome"]) for e in await reply_events(client, "rd0")]
    assert outcomes == [("1", "applied"), ("1", "duplicate")]
    assert [t["msg_id"] for t in (await client.state("rd0"))["history"]] == [f"redrive:{entry_id}"]
