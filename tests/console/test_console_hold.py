"""Holding a session from the console, against real workers: a held session's messages wait,
sequenced; a release lets them go on in order; under DIALOG_ON_DEAD_LETTER=hold a dead
letter holds its session, and redriving it puts the letter back before the waiting ones.
Cancelling a waiting message from the console. Every action is audited; a viewer cannot act."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_support import OPERATOR, VIEWER, basic, form_token
from redis_server import wait_until_async
from stream_views import shown, streamed
from worker_procs import WorkerPool

from dialog_worker import StreamEvent
from dialog_worker.client.dialog_client import DialogClient

pytestmark = pytest.mark.integration

OP = basic(OPERATOR)
VIEW = basic(VIEWER)


async def session_page(http: httpx.AsyncClient, sid: str) -> str:
    r = await http.get(f"/session?id={sid}", headers=OP)
    return r.text


async def hold_action(http: httpx.AsyncClient, sid: str, action: str, reason: str) -> str:
    page = await session_page(http, sid)
    r = await http.post(
        "/session/hold",
        headers=OP,
        data={
            "session_id": sid,
            "action": action,
            "reason": reason,
            "form_token": form_token(page),
        },
    )
    assert r.status_code == 200, r.text
    return r.text


async def turns(client: DialogClient, sid: str) -> list[dict[str, Any]]:
    state = await client.state(sid)
    return list((state or {}).get("history", []))


async def test_a_held_session_waits_until_released_then_goes_on_in_order(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1)
    await client.ask("alice", "halo", timeout=20)
    done = await hold_action(http, "alice", "hold", "checking a complaint")
    assert "Done" in done
    for text in ("satu", "dua", "tiga"):
        await client.send("alice", text)

    async def three_waiting() -> bool:
        page = await session_page(http, "alice")
        return page.count('class="cancel-go"') == 3

    await wait_until_async(three_waiting, 10, what="three waiting messages")
    await asyncio.sleep(1.0)  # a worker that ignored the hold would have applied them by now
    assert [t["user"] for t in await turns(client, "alice")] == ["halo"]
    page = await session_page(http, "alice")
    assert 'id="held"' in page and "held by olga" in page and "Release this session" in page

    await hold_action(http, "alice", "release", "complaint checked")

    async def applied() -> list[str] | None:
        users = [t["user"] for t in await turns(client, "alice")]
        return users if len(users) == 4 else None

    assert await wait_until_async(applied, 10, what="the waiting messages applied") == [
        "halo",
        "satu",
        "dua",
        "tiga",
    ]
    audit = (await http.get("/audit", headers=VIEW)).text
    assert "hold_session" in audit and "release_session" in audit
    assert "checking a complaint" in audit and "complaint checked" in audit


async def test_under_on_dead_letter_hold_a_redrive_puts_the_letter_back_before_the_waiting_ones(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool, tmp_path: Path
) -> None:
    flag = tmp_path / "flag"
    flag.write_text("on")
    workers.start(
        1,
        DIALOG_ENGINE="fault_engine:make",
        DIALOG_MAX_ATTEMPTS="1",
        DIALOG_ON_DEAD_LETTER="hold",
        FAULT_FLAG_FILE=str(flag),
    )
    # All three waiting before the first fails: its commit must hand nothing on.
    for text in ("flaky one", "two", "three"):
        await client.send("bob", text)

    async def held_with_two_waiting() -> str | None:
        page = await session_page(http, "bob")
        ok = 'id="held"' in page and page.count('class="cancel-go"') == 2
        return page if ok else None

    page = await wait_until_async(held_with_two_waiting, 10, what="bob held, two waiting")
    await asyncio.sleep(1.0)
    assert [t["user"] for t in await turns(client, "bob")] == ["flaky one"]  # the fallback turn
    handles = [h for h in page.split('data-handle="')[1:]]
    assert len(handles) == 1
    handle = handles[0].split('"')[0]
    flag.unlink()
    r = await http.post(
        "/session/redrive",
        headers=OP,
        data={
            "session_id": "bob",
            "handle": [handle],
            "count": "1",
            "reason": "engine fixed",
            "form_token": form_token(page),
        },
    )
    assert r.status_code == 200, r.text
    assert "1 of 1 listed letters done" in r.text

    async def applied() -> list[tuple[int, str]] | None:
        rows = [(t["seq"], t["user"]) for t in await turns(client, "bob")]
        return rows if len(rows) == 4 else None

    rows = await wait_until_async(applied, 10, what="the redriven and waiting messages applied")
    assert rows == [(1, "flaky one"), (2, "flaky one"), (3, "two"), (4, "three")]
    assert await client.redis.xlen(client.keys.dlq) == 0
    page = await session_page(http, "bob")
    assert 'id="held"' not in page


async def test_holding_a_session_stops_the_retries_of_its_failing_message(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool, tmp_path: Path
) -> None:
    flag = tmp_path / "flag"
    flag.write_text("on")
    workers.start(
        1,
        DIALOG_ENGINE="fault_engine:make",
        DIALOG_MAX_ATTEMPTS="50",
        DIALOG_BACKOFF_BASE_MS="100",
        DIALOG_BACKOFF_MAX_MS="200",
        FAULT_FLAG_FILE=str(flag),
    )
    await client.send("erin", "flaky please")
    state_key = client.keys_for("erin").session("erin").state

    async def attempts() -> int:
        return int(await client.redis.hget(state_key, "n") or 0)

    async def retried() -> bool:
        return await attempts() >= 2

    await wait_until_async(retried, 10, what="a retry")
    await hold_action(http, "erin", "hold", "stop the retries")
    await asyncio.sleep(1.0)  # an attempt running at the hold ends and goes back
    before = await attempts()
    await asyncio.sleep(1.5)  # ~10 retries would run if the hold were ignored
    assert await attempts() == before
    assert await turns(client, "erin") == []
    flag.unlink()
    await hold_action(http, "erin", "release", "upstream fixed")

    async def applied() -> bool:
        return [t["user"] for t in await turns(client, "erin")] == ["flaky please"]

    await wait_until_async(applied, 10, what="the message applied after the release")


async def test_a_waiting_message_is_cancelled_from_the_console(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1)
    await hold_action(http, "carol", "hold", "look first")
    await client.send("carol", "keep me", msg_id="k1")
    await client.send("carol", "drop me", msg_id="d1")

    async def two_waiting() -> str | None:
        page = await session_page(http, "carol")
        return page if page.count('class="cancel-go"') == 2 else None

    page = await wait_until_async(two_waiting, 10, what="two waiting")
    r = await http.post(
        "/session/cancel",
        headers=OP,
        data={
            "session_id": "carol",
            "msg_id": "d1",
            "reason": "sent by mistake",
            "form_token": form_token(page),
        },
    )
    assert r.status_code == 200, r.text
    assert "Done" in r.text
    await hold_action(http, "carol", "release", "go on")

    async def ended() -> list[dict[str, Any]] | None:
        rows = await turns(client, "carol")
        return rows if len(rows) == 2 else None

    rows = await wait_until_async(ended, 20, what="both ended")
    assert rows[0]["msg_id"] == "k1" and not rows[0].get("cancelled")
    assert rows[1]["msg_id"] == "d1" and rows[1].get("cancelled") is True
    audit = (await http.get("/audit", headers=VIEW)).text
    assert "cancel_message" in audit and "sent by mistake" in audit


async def test_a_viewer_cannot_hold_release_or_cancel(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    await client.send("dave", "halo")
    page = (await http.get("/session?id=dave", headers=VIEW)).text
    assert 'id="hold-go"' not in page and "cancel-go" not in page
    for path, data in (
        ("/session/hold", {"session_id": "dave", "action": "hold", "reason": "x"}),
        ("/session/cancel", {"session_id": "dave", "msg_id": "m", "reason": "x"}),
    ):
        r = await http.post(path, headers=VIEW, data=data)
        assert r.status_code == 403
    assert await client.redis.hget(client.keys_for("dave").session("dave").state, "h") is None


async def test_releasing_a_session_that_is_not_held_says_so(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    page = await hold_action(http, "carol", "release", "just in case")
    assert 'id="outcome">Nothing changed: the session was not held' in page
    assert 'id="outcome">Done' in await hold_action(http, "carol", "hold", "checking")
    assert 'id="outcome">Done' in await hold_action(http, "carol", "release", "checked")
    page = await hold_action(http, "carol", "release", "again")
    assert "the session was not held" in page
    audit = (await http.get("/audit", headers=VIEW)).text
    assert audit.count("release_session") >= 3


async def test_a_redrive_while_a_step_of_the_session_runs_is_refused_and_changes_nothing(
    client: DialogClient,
) -> None:
    """A running step would commit at the seq the redrive gives the letter: the script
    refuses ("busy") while the session's lock is held, and writes nothing; once the lock is
    gone the same redrive goes through."""
    from dialog_worker.console import actions

    sk = client.keys.session("dave")
    r = client.redis
    await r.hset(sk.state, mapping={"a": "1", "s": "1", "h": "held by a test"})
    letter = await r.xadd(client.keys.dlq, {"session_id": "dave", "msg_id": "m1", "text": "hi"})
    fields = json.dumps(["session_id", "dave", "text", "hi", "msg_id", "m1"])
    redrive = ["redrive", client.settings.dedupe_ttl_s, 1, letter, "m1", fields]
    await r.set(sk.lock, "a-running-step", px=60_000)
    before = await r.hgetall(sk.state)

    assert await actions._hold_call(client, "dave", redrive) == ["busy"]
    assert await r.hgetall(sk.state) == before  # still held, nothing queued
    assert [e[0] for e in await r.xrange(client.keys.dlq)] == [letter]
    assert await r.get(sk.lock) == "a-running-step"
    assert await r.zscore(client.keys.ready, "dave") is None

    await r.delete(sk.lock)  # the step committed and let go
    result = await actions._hold_call(client, "dave", redrive)
    assert result[0] == "redriven" and result[1] == "1", result
    assert await r.xlen(client.keys.dlq) == 0
    assert await r.hget(sk.state, "h") is None
    assert await r.zscore(client.keys.ready, "dave") is not None


async def letter_handle(http: httpx.AsyncClient, sid: str) -> tuple[str, str]:
    """The session page and the handle of its one dead letter."""

    async def listed() -> str | None:
        page = await session_page(http, sid)
        return page if page.count('data-handle="') == 1 else None

    page = await wait_until_async(listed, 10, what=f"{sid}'s dead letter listed")
    return page, page.split('data-handle="')[1].split('"')[0]


async def redrive_letter(http: httpx.AsyncClient, sid: str, reason: str) -> None:
    page, handle = await letter_handle(http, sid)
    r = await http.post(
        "/session/redrive",
        headers=OP,
        data={
            "session_id": sid,
            "handle": [handle],
            "count": "1",
            "reason": reason,
            "form_token": form_token(page),
        },
    )
    assert r.status_code == 200, r.text
    assert "1 of 1 listed letters done" in r.text


async def test_a_redrive_renumbering_a_message_that_streamed_part_of_an_answer_resets_its_readers(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool, tmp_path: Path
) -> None:
    """m2 streamed two pieces, failed and waits for its retry; the session is held and an
    earlier dead letter redriven in front of it, so m2 runs again under the next seq and its
    partial stream starts anew. Its reader, following since the first attempt, gets a reset
    and the new answer whole (never the old pieces as the new answer's start, never an end
    before it is applied); a reader after the end gets the new answer alone."""
    flag = tmp_path / "flag"
    flag.write_text("on")
    workers.start(1, DIALOG_ENGINE="stream_engines:FailsWhileFlagged", FAULT_FLAG_FILE=str(flag))
    await client.send("fay", "letter one", msg_id="l1")
    await wait_until_async(
        lambda: _xlen_is(client, client.keys.dlq, 1), 10, what="l1 dead-lettered"
    )
    events: list[StreamEvent] = []

    async def read() -> None:
        async for event in client.stream("fay", "m2", timeout=60):
            events.append(event)

    reader = asyncio.create_task(read())
    await client.send("fay", "12 50", msg_id="m2")
    sk = client.keys.session("fay")

    async def failed_once() -> bool:
        return len(events) == 2 and not await client.redis.exists(sk.lock)

    await wait_until_async(failed_once, 10, what="m2's first attempt streamed and failed")
    assert shown(events) == "OLD.0 OLD.1 "
    await hold_action(http, "fay", "hold", "look at the letter")
    flag.unlink()
    await redrive_letter(http, "fay", "engine fixed")
    await asyncio.wait_for(reader, 30)
    answer = "".join(f"w{i} " for i in range(12))
    assert (events[-1].kind, events[-1].outcome, events[-1].text) == ("end", "applied", answer)
    assert [e.kind for e in events[:3]] == ["delta", "delta", "reset"]
    assert streamed(events) == answer  # after the reset: the new answer, each piece once
    rows = [(t["seq"], t["user"], t["bot"]) for t in await turns(client, "fay")]
    assert rows[1:] == [(2, "letter one", "letter ok"), (3, "12 50", answer)]
    late = [e async for e in client.stream("fay", "m2", timeout=10)]
    assert (late[-1].outcome, late[-1].text) == ("applied", answer)
    assert streamed(late) == answer and "reset" not in [e.kind for e in late]


async def _xlen_is(client: DialogClient, key: str, n: int) -> bool:
    return int(await client.redis.xlen(key)) == n


@pytest.mark.parametrize(
    ("policy", "ended"), [("interrupt", "cancelled"), ("coalesce", "superseded")]
)
async def test_a_redrive_while_an_interrupt_or_coalesce_waits_ends_only_the_messages_it_covers(
    http: httpx.AsyncClient,
    client: DialogClient,
    workers: WorkerPool,
    tmp_path: Path,
    policy: str,
    ended: str,
) -> None:
    """Held by its dead letter (a1), the session gets b2, then c3 sent with multitask
    interrupt (or coalesce), which ends every message outstanding before it (b2) in its turn.
    Redriving a1 puts it in front of them: it was not outstanding when c3 came, so it is
    applied; b2 still ends cancelled (superseded), c3 is applied."""
    flag = tmp_path / "flag"
    flag.write_text("on")
    workers.start(
        1,
        DIALOG_ENGINE="fault_engine:make",
        DIALOG_MAX_ATTEMPTS="1",
        DIALOG_ON_DEAD_LETTER="hold",
        FAULT_FLAG_FILE=str(flag),
    )
    await client.send("gus", "flaky one", msg_id="a1")
    await letter_handle(http, "gus")  # dead-lettered, and so held
    await client.send("gus", "two", msg_id="b2")
    await client.send("gus", "three", msg_id="c3", multitask=policy)

    async def two_waiting() -> bool:
        return (await session_page(http, "gus")).count('class="cancel-go"') == 2

    await wait_until_async(two_waiting, 10, what="b2 and c3 waiting")
    flag.unlink()
    await redrive_letter(http, "gus", "engine fixed")

    async def all_ended() -> list[tuple[int, str, str]] | None:
        rows = [
            (
                t["seq"],
                t["user"],
                "cancelled"
                if t.get("cancelled")
                else "superseded"
                if t.get("superseded")
                else "applied",
            )
            for t in await turns(client, "gus")
        ]
        return rows if len(rows) == 4 else None

    rows = await wait_until_async(all_ended, 20, what="the letter and both waiting ended")
    assert rows[1:] == [(2, "flaky one", "applied"), (3, "two", ended), (4, "three", "applied")]
    outcomes = {
        (f[b"msg_id"], f[b"outcome"])
        for _, f in await client.raw.xrange(client.keys.replies)
        if f[b"session_id"] == b"gus"
    }
    assert (b"b2", ended.encode()) in outcomes and (b"c3", b"applied") in outcomes


async def _held_idle_session_with_a_letter(client: DialogClient, sid: str) -> list[Any]:
    """A session that went idle (its state has the idle expiry), then held, with one dead
    letter: the redrive arguments for that letter."""
    sk = client.keys.session(sid)
    r = client.redis
    await r.hset(sk.state, mapping={"a": "1", "s": "1", "h": "held by a test"})
    await r.expire(sk.state, client.settings.state_ttl_s)
    letter = await r.xadd(client.keys.dlq, {"session_id": sid, "msg_id": "m2", "text": "hi"})
    fields = json.dumps(["session_id", sid, "text", "hi", "msg_id", "m2"])
    return ["redrive", client.settings.dedupe_ttl_s, 1, letter, "m2", fields]


async def test_a_redrive_into_a_held_idle_session_removes_its_idle_expiry_while_the_letter_waits(
    client: DialogClient,
) -> None:
    """The letter goes back as the session's next message: a state that keeps its idle
    expiry could expire with the message in it (G5: no state expires while it has work
    outstanding)."""
    from dialog_worker.console import actions

    redrive = await _held_idle_session_with_a_letter(client, "erin")
    sk = client.keys.session("erin")
    assert await client.redis.ttl(sk.state) > 0
    result = await actions._hold_call(client, "erin", redrive)
    assert result[:2] == ["redriven", "1"], result
    assert await client.redis.hget(sk.state, "s") == "2"  # the letter waits as seq 2
    assert await client.redis.ttl(sk.state) == -1  # no expiry while it waits
    assert await client.redis.hget(sk.state, "h") is None  # released with the redrive
    assert await client.redis.zscore(client.keys.ready, "erin") is not None


async def test_a_redriven_letters_msg_id_claim_expires_like_any_other(client: DialogClient) -> None:
    """The redriven letter's msg_id is claimed for its new seq (a copy sent meanwhile is a
    duplicate) for the dedupe window, not for ever: after it a re-send is a new message."""
    from dialog_worker.console import actions

    redrive = await _held_idle_session_with_a_letter(client, "fay")
    claim = client.keys.session("fay").dedupe("m2")
    await actions._hold_call(client, "fay", redrive)
    assert await client.redis.get(claim) == "2"
    ttl = await client.redis.ttl(claim)
    assert client.settings.dedupe_ttl_s - 5 <= ttl <= client.settings.dedupe_ttl_s
