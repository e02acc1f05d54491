"""Reset and delete of a session against real workers and a real Redis: fenced against a
running step (its commit is refused and brings nothing back), delete leaves no key of the
session (checked with SCAN, here only), reset keeps the waiting messages, both audited."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis_server import wait_for
from worker_procs import run_cli

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.store.keys import Keys, audit_key

pytestmark = pytest.mark.integration


def session_events(url: str, sid: str, stream: str = "dialog-replies") -> list[dict[str, str]]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [f for _, f in r.xrange(stream) if f.get("session_id") == sid]


def engine_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def keys_of(url: str, sid: str) -> list[str]:
    """Every key naming the session, every timer of it in the shard's timer set, its place
    in the ready set and the ages, and the console's indexes that still point at it."""
    r = redis.Redis.from_url(url, decode_responses=True)
    found = sorted(r.scan_iter(match=f"*{{{sid}}}*"))
    for key in r.scan_iter(match="*:timers"):
        if r.type(key) == "zset":
            found += [f"{key} {m!r}" for m in r.zrange(key, 0, -1) if m.startswith(sid + "\n")]
    # The console's indexes name the session in a value or a member, not in the key.
    for key in r.scan_iter(match="*:ready:msgs:*"):
        found += [f"{key} {m!r}" for m, v in r.hgetall(key).items() if v == sid]
    for key in r.scan_iter(match="*:ready:sessions:*"):
        if r.zscore(key, sid) is not None:
            found.append(f"{key} {sid!r}")
    # The shard-wide sets of sessions with work outstanding: the ready set and the ages.
    for key in [*r.scan_iter(match="*:ready"), *r.scan_iter(match="*:ready:ages")]:
        if r.type(key) == "zset" and r.zscore(key, sid) is not None:
            found.append(f"{key} {sid!r}")
    return found


def audit_events(env: dict[str, str]) -> list[dict[str, str]]:
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    return [f for _, f in r.xrange(audit_key(load_settings(environ=env)))]


async def test_delete_of_a_session_with_a_running_step_waiting_messages_and_a_timer_leaves_no_key(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "engine.jsonl"
    workers.start(
        1,
        DIALOG_ENGINE="timer_engines:Timers",
        TIMER_ENGINE_LOG=str(log),
        DIALOG_LOCK_TTL_MS="1000",
    )
    url = env["REDIS_URL"]
    await client.send("e1", "remind 3600 r1", msg_id="m1")  # a timer
    await client.send("e1", "remind-then-fail 1 r2", msg_id="m2")  # a dead letter
    await client.send("e1", "sleep 2", msg_id="m3")  # running when deleted
    await client.send("e1", "w1", msg_id="m4")  # waiting
    await client.send("e1", "w2", msg_id="m5")  # waiting
    await client.cancel("e1", "not-sent-yet")  # a cancel mark of a message to come
    await client.send("other", "hello")
    await wait_for(lambda: any(e["msg_id"] == "m3" for e in engine_log(log)))
    assert keys_of(url, "e1")  # it has keys now
    result = await client.delete("e1", who="test", reason="user asked")
    assert (result.found, result.running, result.waiting, result.timers) == (True, True, 3, 1)
    assert result.dead_letters == 1
    assert keys_of(url, "e1") == []
    await anyio.sleep(3.0)  # the step ends, its commit is refused; leases run out
    assert keys_of(url, "e1") == [], "a fenced step brought keys of the session back"
    assert [e["msg_id"] for e in session_events(url, "e1")] == ["m1", "m2"]
    assert session_events(url, "e1", "dialog-dlq") == []
    # A later message starts a new session; its msg_id was freed with the dedupe keys.
    await client.send("e1", "again", msg_id="m1")
    got = await wait_for(lambda: len(session_events(url, "e1")) >= 3 and session_events(url, "e1"))
    assert (got[2]["msg_id"], got[2]["seq"], got[2]["outcome"]) == ("m1", "1", "applied")
    state = await client.state("e1")
    assert state is not None and state["memory"] == {"turns": 1}
    assert [e["msg_id"] for e in session_events(url, "other")]  # others untouched
    [event] = audit_events(env)
    assert (event["action"], event["target"], event["who"], event["reason"]) == (
        "session_delete",
        "e1",
        "test",
        "user asked",
    )


async def test_reset_keeps_waiting_messages_and_fences_the_running_step(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "engine.jsonl"
    # A lease far longer than the test waits: the waiting ones go on at once after the
    # reset, not when the fenced step's lease would have run out.
    workers.start(
        1,
        DIALOG_ENGINE="timer_engines:Timers",
        TIMER_ENGINE_LOG=str(log),
        DIALOG_LOCK_TTL_MS="30000",
        DIALOG_VISIBILITY_TIMEOUT_MS="60000",
    )
    url = env["REDIS_URL"]
    await client.send("e2", "remind 3600 r1", msg_id="m1")
    await client.send("e2", "sleep 1", msg_id="m2")
    await client.send("e2", "w1", msg_id="m3")
    await wait_for(lambda: any(e["msg_id"] == "m2" for e in engine_log(log)))
    result = await client.reset("e2", reason="start over")
    assert (result.found, result.running, result.waiting) == (True, True, 2)
    state = await client.state("e2")
    assert state is not None
    assert (state["step"], state["memory"], state["history"]) == ("ROOT", {}, [])
    got = await wait_for(lambda: len(session_events(url, "e2")) >= 3 and session_events(url, "e2"))
    await anyio.sleep(1.5)  # the fenced first run of m2 must not add an event
    got = session_events(url, "e2")
    assert [(e["msg_id"], e["seq"], e["outcome"]) for e in got] == [
        ("m1", "1", "applied"),
        ("m2", "2", "applied"),
        ("m3", "3", "applied"),
    ]
    state = await client.state("e2")
    assert state is not None
    assert state["memory"] == {"turns": 2}  # m2 (run again on the new state) and m3
    assert [t["seq"] for t in state["history"]] == [2, 3]
    r = redis.Redis.from_url(url)
    assert r.zcard(Keys.from_settings(load_settings(environ=env)).timers) == 1  # kept
    assert [e["action"] for e in audit_events(env)] == ["session_reset"]


def test_cli_session_delete_and_reset_need_yes_and_are_audited(
    env: dict[str, str], tmp_path: Path
) -> None:
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    settings = load_settings(environ=env)
    state = Keys.from_settings(settings).session("c1").state
    r.hset(state, mapping={"d": '{"step": "X"}', "v": 3, "a": 1, "s": 1})
    refused = run_cli(env, "session", "delete", "c1")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert r.exists(state)
    wrong = run_cli(env, "session", "purge", "c1", "--yes")
    assert wrong.returncode == 2
    reset = run_cli(env, "session", "reset", "c1", "--yes", "--reason", "asked")
    assert reset.returncode == 0, reset.stderr
    assert json.loads(reset.stdout)["action"] == "reset"
    assert json.loads(r.hget(state, "d"))["step"] == "ROOT"
    done = run_cli(env, "session", "delete", "c1", "--yes")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) | {"keys_deleted": 1} == json.loads(done.stdout)
    assert not r.exists(state)
    events = audit_events(env)
    assert [(e["action"], e["target"], e["reason"]) for e in events] == [
        ("session_reset", "c1", "asked"),
        ("session_delete", "c1", ""),
    ]
    assert all(e["who"].startswith("cli:") for e in events)


def test_the_end_of_a_streamed_reply_does_not_bring_a_deleted_session_back(
    env: dict[str, str],
) -> None:
    """The worker appends a partial stream's end after its commit; a delete that ran in
    between must not be undone by it (lua/emit-2.lua refuses an end without a state)."""
    from dialog_worker.store.scripts import source

    r = redis.Redis.from_url(env["REDIS_URL"])
    session = Keys.from_settings(load_settings(environ=env)).session("p1")
    emit = r.register_script(source("emit"))
    args = [100, 600, 1, "e", "", 1, 0, 1, "the reply", "", "applied", ""]
    assert emit(keys=[session.lock, session.partial("m1")], args=args) == [-1]
    assert not r.exists(session.partial("m1"))
    r.hset(session.state, "v", 1)  # committed, not deleted: the end is appended
    assert emit(keys=[session.lock, session.partial("m1")], args=args) == [1]


async def test_delete_removes_the_sessions_entries_past_the_first_chunk_and_no_other(
    client: DialogClient, env: dict[str, str]
) -> None:
    """The dead-letter and reply streams are read in chunks: a session's entries anywhere in
    them go (here the last ones come after more than a chunk of others'), nobody else's."""
    from dialog_worker.client.erasure import CHUNK

    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    keys = Keys.from_settings(load_settings(environ=env))
    for stream in (keys.dlq, keys.replies):
        r.xadd(stream, {"session_id": "gone", "n": "first"})
        for i in range(CHUNK + 20):
            r.xadd(stream, {"session_id": f"other{i % 3}", "n": str(i)})
        r.xadd(stream, {"session_id": "gone", "n": "middle"})
        for i in range(CHUNK):
            r.xadd(stream, {"session_id": "other0", "n": str(i)})
        r.xadd(stream, {"session_id": "gone", "n": "last"})
    result = await client.delete("gone", who="test", reason="asked", replies=True)
    assert (result.dead_letters, result.reply_events) == (3, 3)
    for stream in (keys.dlq, keys.replies):
        left = [f["session_id"] for _, f in r.xrange(stream)]
        assert "gone" not in left
        assert len(left) == 2 * CHUNK + 20


async def test_delete_removes_the_end_a_rejected_message_left_in_its_partial_stream(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    """A message rejected at intake (multitask=reject) leaves its end in its partial stream,
    for readers on other clients: found through the session's msg_id index like every key
    named by a msg_id, so a delete leaves nothing of the session."""
    log = tmp_path / "engine.jsonl"
    workers.start(1, DIALOG_ENGINE="timer_engines:Timers", TIMER_ENGINE_LOG=str(log))
    url = env["REDIS_URL"]
    await client.send("e-rj", "sleep 1", msg_id="m1")
    await wait_for(lambda: any(e["msg_id"] == "m1" for e in engine_log(log)))
    await client.send("e-rj", "too soon", msg_id="m2", multitask="reject")
    await wait_for(lambda: any(e["outcome"] == "rejected" for e in session_events(url, "e-rj")))
    partial = client.keys.session("e-rj").partial("m2")
    assert await client.redis.exists(partial)
    await client.delete("e-rj")
    assert keys_of(url, "e-rj") == []


async def test_the_sender_streaming_a_message_of_a_deleted_session_gets_its_end_not_a_timeout(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    """A message running and one waiting when their session is deleted end without a reply
    event, and nothing of them is left. The client that sent them knows their entries: read by
    the workers and gone, they are finished, so its stream of either ends (`expired`, no
    text) instead of waiting for its timeout."""
    log = tmp_path / "engine.jsonl"
    workers.start(1, DIALOG_ENGINE="timer_engines:Timers", TIMER_ENGINE_LOG=str(log))
    await client.send("e-gone", "sleep 2", msg_id="m1")
    await client.send("e-gone", "w1", msg_id="m2")
    await wait_for(lambda: any(e["msg_id"] == "m1" for e in engine_log(log)))
    await client.delete("e-gone")
    for msg_id in ("m1", "m2"):
        got = [e async for e in client.stream("e-gone", msg_id, timeout=5)]
        assert [(e.kind, e.outcome, e.text) for e in got] == [("end", "expired", "")]


async def test_a_reader_of_an_answer_cut_by_a_delete_ends_when_the_session_starts_over(
    workers: Any, client: DialogClient, env: dict[str, str]
) -> None:
    """A reader on another client follows m2 (seq 2) as it streams; the session is deleted
    and written to again (m3 is seq 1 of the new one). m2 will never be applied: the reader
    ends (`expired`, no text) instead of taking the new state for one that still has seq 2
    to apply."""
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    await client.ask("e-cut", "3 5", msg_id="m1", timeout=20)
    await client.send("e-cut", "300 20", msg_id="m2")
    async with DialogClient(settings=load_settings(environ=env)) as other:
        got: list[Any] = []

        async def follow() -> None:
            async for event in other.stream("e-cut", "m2", timeout=15):
                got.append(event)

        reader = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                await follow()
                reader.set()

            tg.start_soon(run)
            await wait_for(lambda: len(got) >= 2)
            await client.delete("e-cut")
            reply = await client.ask("e-cut", "2 5", msg_id="m3", timeout=20)
            assert (reply.outcome, reply.seq) == ("applied", 1)
            with anyio.fail_after(10):
                await reader.wait()
    assert (got[-1].kind, got[-1].outcome, got[-1].text) == ("end", "expired", "")
    assert all(e.kind == "delta" for e in got[:-1])
