"""The step journal and interrupts against real worker processes and a real Redis: once per
message across re-runs, a step that waits for a person and goes on where it stopped, a resume
applied once, timeouts, restarts, cancel, reset and delete (tests/support/journal_engines.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis_server import wait_for, wait_until_async

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.integration

KEYS = Keys.from_settings(Settings())


def calls(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def start(workers: Any, tmp_path: Path, engine: str = "Agent", n: int = 1, **env: str) -> Path:
    log = tmp_path / "calls.txt"
    workers.start(
        n,
        DIALOG_ENGINE=f"journal_engines:{engine}",
        JOURNAL_CALLS=str(log),
        JOURNAL_HOLD=str(tmp_path / "hold"),
        **env,
    )
    return log


def events(url: str, sid: str) -> list[dict[str, str]]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [f for _, f in r.xrange("dialog-replies") if f["session_id"] == sid]


async def pending_one(client: DialogClient, sid: str) -> Any:
    async def found() -> Any:
        got = await client.pending(sid)
        return got[0] if got else None

    return await wait_until_async(found, 15, what=f"a pending interrupt of {sid}")


@pytest.mark.parametrize("engine", ["Agent", "SyncAgent"])
async def test_a_step_waits_for_a_person_and_goes_on_where_it_stopped(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path, engine: str
) -> None:
    log = start(workers, tmp_path, engine)
    reply = await client.ask("r1", "refund 40", msg_id="m1", timeout=20)
    assert reply.outcome == "awaiting" and reply.seq == 1
    assert reply.interrupt_id == "m1:1:1"
    assert reply.payload == {"approve": "refund 40", "quote": {"i": 0}}
    waiting = await client.pending("r1")
    assert [(p.interrupt_id, p.msg_id, p.seq, p.payload) for p in waiting] == [
        ("m1:1:1", "m1", 1, {"approve": "refund 40", "quote": {"i": 0}})
    ]
    assert calls(log) == ["m1 0"]  # the quote, once
    result = await client.resume("r1", "m1:1:1", True)
    assert result.status == "resumed"
    url = env["REDIS_URL"]
    done = await wait_for(lambda: [e for e in events(url, "r1") if e["outcome"] == "applied"])
    assert [(e["seq"], e["reply"]) for e in done] == [("1", "refunded")]
    # The quote was answered by the journal in the run after the resume; the refund ran once.
    assert calls(log) == ["m1 0", "m1 99"]
    assert await client.pending("r1") == []
    r = redis.Redis.from_url(url)
    assert r.exists(KEYS.session("r1").journal("m1")) == 0  # deleted with the commit
    state = await client.state("r1")
    assert state is not None and state["applied_seq"] == 1


async def test_a_resume_sent_twice_is_applied_once_and_a_wrong_id_is_unknown(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    log = start(workers, tmp_path)
    reply = await client.ask("r2", "refund 5", msg_id="m1", timeout=20)
    iid = reply.interrupt_id
    assert iid is not None
    assert (await client.resume("r2", "m1:1:9", True)).status == "unknown"
    assert (await client.resume("r2", iid, False)).status == "resumed"
    # Sent again at once and after the answer: nothing more is applied.
    assert (await client.resume("r2", iid, True)).status == "already_resumed"
    url = env["REDIS_URL"]
    done = await wait_for(lambda: [e for e in events(url, "r2") if e["outcome"] == "applied"])
    assert [e["reply"] for e in done] == ["declined"]  # the first answer, not the second
    assert (await client.resume("r2", iid, True)).status == "already_resumed"
    await anyio.sleep(0.5)
    assert [e["outcome"] for e in events(url, "r2")] == ["awaiting", "applied"]
    assert calls(log) == ["m1 0"]  # declined: no refund


async def test_the_sessions_later_messages_wait_behind_a_pending_interrupt_in_order(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path, DIALOG_LOCK_TTL_MS="500")
    reply = await client.ask("r3", "refund 7", msg_id="m1", timeout=20)
    await client.send("r3", "hello", msg_id="m2")
    await client.send("r3", "again", msg_id="m3")
    await anyio.sleep(1.5)  # intake put it in the ready set; resume looked and left it parked
    url = env["REDIS_URL"]
    assert [e["outcome"] for e in events(url, "r3")] == ["awaiting"]  # nothing overtook it
    r = redis.Redis.from_url(url)
    assert r.zscore(KEYS.ready, "r3") is None  # parked: no worker looks at it meanwhile
    assert reply.interrupt_id is not None
    await client.resume("r3", reply.interrupt_id, True)
    done = await wait_for(lambda: len(events(url, "r3")) >= 4 and events(url, "r3"))
    assert [(e["seq"], e["outcome"], e["reply"]) for e in done] == [
        ("1", "awaiting", ""),
        ("1", "applied", "refunded"),
        ("2", "applied", "ok hello"),
        ("3", "applied", "ok again"),
    ]


async def test_an_interrupt_without_a_resume_times_out_and_the_step_is_told(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    log = start(workers, tmp_path)
    reply = await client.ask("r4", "refund 9 0.5", msg_id="m1", timeout=20)
    assert reply.outcome == "awaiting"
    url = env["REDIS_URL"]
    done = await wait_for(
        lambda: [e for e in events(url, "r4") if e["outcome"] == "applied"], timeout_s=10
    )
    assert [e["reply"] for e in done] == ["timed out"]
    assert calls(log) == ["m1 0"]
    assert reply.interrupt_id is not None
    assert (await client.resume("r4", reply.interrupt_id, True)).status == "timed_out"


async def test_a_steps_journal_is_kept_a_state_ttl_after_its_last_result(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    """A step held after two journaled calls: its journal expires DIALOG_STATE_TTL_S (a day)
    after the last result, so an attempt retried that late still finds the results and does
    not call again; the commit then deletes it."""
    log = start(workers, tmp_path)
    hold = tmp_path / "hold"
    hold.touch()
    await client.send("r16", "tools 2 hold", msg_id="m1")
    try:
        await wait_for(lambda: len(calls(log)) == 2, timeout_s=15)
        ttl = redis.Redis.from_url(env["REDIS_URL"]).ttl(KEYS.session("r16").journal("m1"))
    finally:
        hold.unlink()  # the step goes on (a failed check does not wait for a held worker)
    day = Settings().state_ttl_s
    assert day - 60 <= ttl <= day
    done = await wait_for(lambda: [e for e in events(env["REDIS_URL"], "r16")])
    assert [(e["outcome"], e["reply"]) for e in done] == [("applied", "done 1 2")]


async def test_a_wait_keeps_its_journal_as_long_and_pending_says_when_it_times_out(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    """Two steps journal a quote and wait: one without a timeout (pending's timeout_at is
    None, the journal has no expiry), one with timeout_s of two days (timeout_at is two days
    after created_at, and the journal outlives the timeout by DIALOG_STATE_TTL_S), so a late
    answer finds the quote and does not ask for it again."""
    start(workers, tmp_path)
    two_days_s = 2 * 86_400
    await client.ask("r14", "refund 1", msg_id="m1", timeout=20)
    await client.ask("r15", f"refund 1 {two_days_s}", msg_id="m1", timeout=20)
    [forever] = await client.pending("r14")
    [timed] = await client.pending("r15")
    assert forever.timeout_at is None and forever.as_dict()["timeout_at"] is None
    assert timed.timeout_at is not None
    assert timed.timeout_at - timed.created_at == two_days_s * 1000
    r = redis.Redis.from_url(env["REDIS_URL"])
    assert r.ttl(KEYS.session("r14").journal("m1")) == -1
    kept_s = Settings().state_ttl_s + two_days_s
    assert kept_s - 60 <= r.ttl(KEYS.session("r15").journal("m1")) <= kept_s


async def test_a_pending_interrupt_survives_a_worker_restart_and_is_resumed_by_another(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    log = start(workers, tmp_path)
    reply = await client.ask("r5", "refund 3", msg_id="m1", timeout=20)
    for w in workers.procs:
        w.kill()
    start(workers, tmp_path)
    waiting = await client.pending("r5")
    assert [p.interrupt_id for p in waiting] == [reply.interrupt_id]
    assert reply.interrupt_id is not None
    assert (await client.resume("r5", reply.interrupt_id, True)).status == "resumed"
    url = env["REDIS_URL"]
    done = await wait_for(lambda: [e for e in events(url, "r5") if e["outcome"] == "applied"])
    assert [e["reply"] for e in done] == ["refunded"]
    assert calls(log) == ["m1 0", "m1 99"]


async def test_a_cancel_of_a_message_waiting_for_a_person_ends_it_cancelled_at_once(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    reply = await client.ask("r6", "refund 1", msg_id="m1", timeout=20)
    await client.send("r6", "next", msg_id="m2")
    assert (await client.cancel("r6", "m1")).status == "cancelled"
    url = env["REDIS_URL"]
    done = await wait_for(lambda: len(events(url, "r6")) >= 3 and events(url, "r6"), timeout_s=5)
    assert [(e["seq"], e["outcome"]) for e in done] == [
        ("1", "awaiting"),
        ("1", "cancelled"),
        ("2", "applied"),
    ]
    assert await client.pending("r6") == []
    assert reply.interrupt_id is not None
    assert (await client.resume("r6", reply.interrupt_id, True)).status == "cancelled"
    r = redis.Redis.from_url(url)
    assert r.exists(KEYS.session("r6").journal("m1")) == 0


async def test_a_new_message_sent_with_multitask_interrupt_cancels_the_pending_interrupt(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    await client.ask("r7", "refund 1", msg_id="m1", timeout=20)
    reply = await client.ask("r7", "never mind", msg_id="m2", multitask="interrupt", timeout=20)
    assert (reply.outcome, reply.text) == ("applied", "ok never mind")
    url = env["REDIS_URL"]
    assert [(e["seq"], e["outcome"]) for e in events(url, "r7")] == [
        ("1", "awaiting"),
        ("1", "cancelled"),
        ("2", "applied"),
    ]
    assert await client.pending("r7") == []


@pytest.mark.parametrize("action", ["reset", "delete"])
async def test_reset_and_delete_remove_the_journal_and_the_pending_interrupt(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path, action: str
) -> None:
    log = start(workers, tmp_path)
    reply = await client.ask("r8", "refund 2", msg_id="m1", timeout=20)
    url = env["REDIS_URL"]
    r = redis.Redis.from_url(url)
    journal = KEYS.session("r8").journal("m1")
    assert r.exists(journal) == 1
    if action == "delete":
        await client.delete("r8")
        assert r.exists(journal) == 0
        assert await client.pending("r8") == []
        assert r.zscore(KEYS.timers, "r8\n\x01await") is None
        assert sorted(k for k in r.scan_iter(match="*r8*")) == []
        return
    await client.reset("r8")
    # The message runs again from scratch on the new state: nothing journaled, a new wait.
    again = await wait_for(lambda: len(events(url, "r8")) >= 2 and events(url, "r8"))
    assert [e["outcome"] for e in again] == ["awaiting", "awaiting"]
    assert calls(log) == ["m1 0", "m1 0"]
    assert reply.interrupt_id is not None
    waiting = await client.pending("r8")
    assert [p.interrupt_id for p in waiting] == [reply.interrupt_id]


async def test_a_step_may_wait_twice_and_each_answer_reaches_its_own_call(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    # One attempt allowed: the runs that ended waiting for a person are not attempts.
    start(workers, tmp_path, DIALOG_MAX_ATTEMPTS="1")
    first = await client.ask("r9", "twice", msg_id="m1", timeout=20)
    assert first.interrupt_id == "m1:1:1" and first.payload == {"n": 1}
    await client.resume("r9", "m1:1:1", "a")
    second = await pending_one(client, "r9")
    assert (second.interrupt_id, second.payload) == ("m1:1:2", {"n": 2})
    await client.resume("r9", "m1:1:2", "b")
    url = env["REDIS_URL"]
    done = await wait_for(lambda: [e for e in events(url, "r9") if e["outcome"] == "applied"])
    assert [e["reply"] for e in done] == ["a b"]


async def test_an_interrupt_that_is_not_awaited_fails_the_message_instead_of_going_on(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    reply = await client.ask("r10", "unawaited", msg_id="m1", timeout=20)
    assert reply.outcome == "dead_lettered"
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    [(_, letter)] = r.xrange("dialog-dlq")
    assert letter["error_kind"] == "permanent" and "without awaiting" in letter["error"]


async def test_a_result_past_the_journal_limit_dead_letters_the_message_with_a_clear_error(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path, DIALOG_JOURNAL_MAX_BYTES="2048")
    assert (await client.ask("r11", "big 1000", timeout=20)).outcome == "applied"
    reply = await client.ask("r11", "big 3000", timeout=20)
    assert reply.outcome == "dead_lettered"
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    [(_, letter)] = r.xrange("dialog-dlq")
    assert letter["error_kind"] == "permanent"
    assert "DIALOG_JOURNAL_MAX_BYTES" in letter["error"] and "JournalFull" in letter["error"]


@pytest.mark.parametrize("engine", ["Agent", "SyncAgent"])
@pytest.mark.parametrize(
    ("kind", "shown"),
    [
        (
            "dated",
            '{"amount": "12.50", "created": "2025-03-01T09:30:00+00:00", '
            '"id": "00000000-0000-0000-0000-000000000011"}',
        ),
        ("cut", '{"text": "ab\\ud83d"}'),  # the same lone surrogate, read back
    ],
)
async def test_a_result_with_dates_decimals_and_uuids_is_recorded_and_the_call_runs_once(
    workers: Any,
    client: DialogClient,
    env: dict[str, str],
    tmp_path: Path,
    engine: str,
    kind: str,
    shown: str,
) -> None:
    # Short backoff: without the fix each retry would call the payment again at once.
    log = start(workers, tmp_path, engine, DIALOG_BACKOFF_BASE_MS="10", DIALOG_BACKOFF_MAX_MS="50")
    reply = await client.ask("p1", f"receipt {kind}", msg_id="m1", timeout=20)
    assert (reply.outcome, reply.text) == ("applied", f"paid {shown}")
    assert calls(log) == ["m1 receipt"]


@pytest.mark.parametrize("engine", ["Agent", "SyncAgent"])
@pytest.mark.parametrize(("kind", "named"), [("opaque", "Receipt"), ("deep", "nested too deeply")])
async def test_a_result_that_cannot_be_recorded_fails_the_message_after_one_call(
    workers: Any,
    client: DialogClient,
    env: dict[str, str],
    tmp_path: Path,
    engine: str,
    kind: str,
    named: str,
) -> None:
    log = start(workers, tmp_path, engine, DIALOG_BACKOFF_BASE_MS="10", DIALOG_BACKOFF_MAX_MS="50")
    reply = await client.ask("p2", f"receipt {kind}", msg_id="m1", timeout=20)
    assert reply.outcome == "dead_lettered"
    assert calls(log) == ["m1 receipt"]  # the payment was not made again
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    [(_, letter)] = r.xrange("dialog-dlq")
    assert (letter["error_kind"], letter["attempts"]) == ("permanent", "1")
    assert "refund:A-17" in letter["error"] and named in letter["error"]


async def test_typed_events_and_the_prompt_stream_with_the_text_and_the_answer_follows_a_resume(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    seen: list[Any] = []
    async for event in client.ask_stream("r12", "stream", msg_id="m1", timeout=20):
        seen.append(event)
        if event.kind == "event" and event.event_kind == "awaiting":
            assert event.data == {"interrupt_id": "m1:1:1", "payload": {"ask": "go on?"}}
            assert (await client.resume("r12", event.data["interrupt_id"], "yes")).status == (
                "resumed"
            )
    shown = [(e.kind, e.attempt, e.text, e.event_kind, e.data) for e in seen]
    tool = {"name": "lookup", "state": "done"}
    assert shown == [
        ("delta", 1, "checking ", None, None),
        ("event", 1, "", "tool", tool),
        ("event", 1, "", "awaiting", {"interrupt_id": "m1:1:1", "payload": {"ask": "go on?"}}),
        ("reset", 2, "", None, None),  # the run after the resume starts the answer over
        ("delta", 2, "checking ", None, None),
        ("event", 2, "", "tool", tool),
        ("delta", 2, "approved ", None, None),
        ("end", 2, "after yes", None, None),
    ]
    assert [e.cursor for e in seen[:3]] == ["m1:1:0", "m1:1:1", "m1:1:2"]
    # A reader resuming from the first event's cursor gets every later one once.
    again = [e async for e in client.stream("r12", "m1", after="m1:1:1", timeout=10)]
    assert [(e.kind, e.event_kind) for e in again] == [
        ("event", "awaiting"),
        ("reset", None),
        ("delta", None),
        ("event", "tool"),
        ("delta", None),
        ("end", None),
    ]
    # Kept in the history turn (keep=True): the committed attempt's, not the first one's too.
    state = await client.state("r12")
    assert state is not None
    assert state["history"][-1]["events"] == [{"kind": "tool", "data": tool}]


async def test_the_sessions_feed_shows_the_prompt_as_awaiting_and_the_turn_after_the_resume(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    reply = await client.ask("r13", "refund 4", msg_id="m1", timeout=20)
    assert reply.interrupt_id is not None
    await client.resume("r13", reply.interrupt_id, True)
    feed = client.events("r13", "0-0:0")  # from the reply stream's start
    kinds = []
    async for event in feed:
        if event.kind == "idle":
            continue
        kinds.append((event.kind, event.data.get("seq"), event.data.get("interrupt_id")))
        if event.kind == "turn":
            break
    assert kinds == [("awaiting", 1, "m1:1:1"), ("turn", 1, None)]


async def test_the_cli_asks_lists_and_resumes_an_interrupt(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    from worker_procs import run_cli

    start(workers, tmp_path)
    asked = run_cli(env, "ask", "c1", "refund 8", "--msg-id", "m1")
    assert asked.returncode == 0, asked.stderr
    event = json.loads(asked.stdout)
    assert (event["outcome"], event["interrupt_id"]) == ("awaiting", "m1:1:1")
    listed = run_cli(env, "pending", "c1")
    assert [json.loads(line)["interrupt_id"] for line in listed.stdout.splitlines()] == ["m1:1:1"]
    bad = run_cli(env, "resume", "c1", "m1:1:1", "yes")  # not JSON: "yes" needs its quotes
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    done = run_cli(env, "resume", "c1", "m1:1:1", "true")
    again = run_cli(env, "resume", "c1", "m1:1:1", "false")
    unknown = run_cli(env, "resume", "c1", "m1:1:5", "true")
    assert (done.returncode, json.loads(done.stdout)["status"]) == (0, "resumed")
    assert (again.returncode, json.loads(again.stdout)["status"]) == (0, "already_resumed")
    assert (unknown.returncode, json.loads(unknown.stdout)["status"]) == (1, "unknown")
    url = env["REDIS_URL"]
    done_events = await wait_for(
        lambda: [e for e in events(url, "c1") if e["outcome"] == "applied"]
    )
    assert [e["reply"] for e in done_events] == ["refunded"]


def test_the_sync_client_lists_and_resumes_an_interrupt(
    workers: Any, env: dict[str, str], tmp_path: Path
) -> None:
    from dialog_worker.client.sync import SyncDialogClient
    from dialog_worker.config import load_settings

    start(workers, tmp_path)
    with SyncDialogClient(settings=load_settings(environ=env)) as c:
        reply = c.ask("y1", "refund 2", msg_id="m1", timeout=20)
        assert reply.outcome == "awaiting"
        assert [p.interrupt_id for p in c.pending("y1")] == ["m1:1:1"]
        assert c.resume("y1", "m1:1:1", True).status == "resumed"
        assert c.resume("y1", "m1:1:1", True).status == "already_resumed"
