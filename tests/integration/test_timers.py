"""Timers against real workers and a real Redis: a timer a step sets is written with its
commit and fires once, in its session's order; cancel by name, cancel by the user's next
message, none from a failed step; ``send(deliver_at=...)``."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis_server import wait_for

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.integration


def events(url: str) -> list[dict[str, str]]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [fields for _, fields in r.xrange("dialog-replies")]


def session_events(url: str, sid: str) -> list[tuple[str, str, str, str]]:
    return [
        (e["msg_id"], e["seq"], e["outcome"], e["reply"])
        for e in events(url)
        if e["session_id"] == sid
    ]


def start(workers: Any, tmp_path: Path, n: int = 1) -> Path:
    log = tmp_path / "engine.jsonl"
    workers.start(n, DIALOG_ENGINE="timer_engines:Timers", TIMER_ENGINE_LOG=str(log))
    return log


def guide() -> str:
    return (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()


def timer_keys(url: str) -> list[str]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return sorted(k for k in r.scan_iter(match="*timers*"))


async def test_a_timer_set_by_a_step_fires_once_in_its_sessions_order(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path, n=2)  # two workers race to fire it: it still fires once
    url = env["REDIS_URL"]
    await client.send("t1", "remind 0.6 r1 call the bank", msg_id="m1")
    got = await wait_for(lambda: len(session_events(url, "t1")) >= 2 and session_events(url, "t1"))
    await client.send("t1", "after", msg_id="m2")
    got = await wait_for(lambda: len(session_events(url, "t1")) >= 3 and session_events(url, "t1"))
    await anyio.sleep(1.0)  # nothing more comes
    got = session_events(url, "t1")
    assert [(m.split(":")[0:2], s, o, r) for m, s, o, r in got] == [
        (["m1"], "1", "applied", "ok remind 0.6 r1 call the bank"),
        (["timer", "r1"], "2", "applied", "fired r1: call the bank"),
        (["m2"], "3", "applied", "ok after"),
    ]
    state = await client.state("t1")
    assert state is not None and state["memory"]["turns"] == 3
    assert timer_keys(url) == []  # fired: nothing of it is left


async def test_a_timer_is_cancelled_by_name_from_a_later_step(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    url = env["REDIS_URL"]
    await client.send("t2", "remind 1.0 r1")
    await client.send("t2", "cancel r1")
    await wait_for(lambda: len(session_events(url, "t2")) >= 2)
    await anyio.sleep(1.5)
    assert [o for _, _, o, _ in session_events(url, "t2")] == ["applied", "applied"]
    assert timer_keys(url) == []


async def test_a_nudge_is_cancelled_when_the_user_writes_first_and_fires_when_silent(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    url = env["REDIS_URL"]
    await client.send("t3", "nudge 1.0")
    await wait_for(lambda: session_events(url, "t3"))
    await client.send("t3", "still here")  # within the second: the nudge goes
    await anyio.sleep(1.6)
    assert [r for *_, r in session_events(url, "t3")] == ["ok nudge 1.0", "ok still here"]
    await client.send("t3", "nudge 0.3")
    got = await wait_for(lambda: len(session_events(url, "t3")) >= 4 and session_events(url, "t3"))
    assert got[-1][3] == "fired nudge: are you still there?"
    assert got[-1][0].startswith("timer:nudge:")


async def test_a_step_that_fails_after_scheduling_leaves_no_timer(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    url = env["REDIS_URL"]
    await client.send("t4", "remind-then-fail 0.2 r1")
    await wait_for(lambda: session_events(url, "t4"))
    await anyio.sleep(0.8)
    assert [o for _, _, o, _ in session_events(url, "t4")] == ["dead_lettered"]
    assert timer_keys(url) == []


async def test_a_message_sent_with_deliver_at_joins_the_order_when_due(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    log = start(workers, tmp_path)
    url = env["REDIS_URL"]
    await client.send("warm", "up")  # the worker is reading
    await wait_for(lambda: session_events(url, "warm"))
    later = await client.send("t5", "later", msg_id="late", deliver_at=time.time() + 0.8)
    await client.send("t5", "now", msg_id="now")
    got = await wait_for(lambda: len(session_events(url, "t5")) >= 2 and session_events(url, "t5"))
    assert [(m, s, r) for m, s, _, r in got] == [
        ("now", "1", "ok now"),
        ("late", "2", "fired msg:late: later"),
    ]
    assert later.msg_id == "late"
    meta = [json.loads(line)["meta"] for line in log.read_text().splitlines()]
    assert meta[2] == {"timer": "msg:late"}


async def test_too_many_timers_dead_letter_the_step_that_asks_for_them(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    """At most 64 timers per session: the 65th is refused with its commit (one dead letter,
    the 64 others stay); replacing one of them is no 65th."""
    start(workers, tmp_path)
    url = env["REDIS_URL"]
    for i in range(65):
        await client.send("t6", f"remind 3600 r{i}")
    await wait_for(lambda: len(session_events(url, "t6")) >= 65)
    outcomes = [o for _, _, o, _ in session_events(url, "t6")]
    assert outcomes == ["applied"] * 64 + ["dead_lettered"]
    settings = load_settings(environ=env)
    r = redis.Redis.from_url(url)
    assert r.zcard(Keys.from_settings(settings).timers) == 64
    # At the limit, a timer of a name the session has replaces it: still 64, not refused.
    await client.send("t6", "remind 7200 r0")
    await wait_for(lambda: len(session_events(url, "t6")) >= 66)
    assert session_events(url, "t6")[-1][2] == "applied"
    assert r.zcard(Keys.from_settings(settings).timers) == 64


async def test_the_guides_nudger_asks_once_after_a_silence_and_not_while_the_user_writes(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    """docs/engine.md's inactivity nudge, run by a real worker as the guide shows it."""
    doc = guide()
    [code] = [
        b
        for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S)
        if b.startswith("# nudger.py")
    ]
    (tmp_path / "nudger.py").write_text(code)
    path = os.pathsep.join([env["PYTHONPATH"], str(tmp_path)])
    workers.start(1, DIALOG_ENGINE="nudger:Nudger", NUDGE_AFTER_S="0.8", PYTHONPATH=path)
    url = env["REDIS_URL"]
    await client.send("n1", "hello")
    await anyio.sleep(0.4)
    await client.send("n1", "are you there?")  # before the nudge: it goes, a new one is set
    got = await wait_for(lambda: len(session_events(url, "n1")) >= 3 and session_events(url, "n1"))
    await anyio.sleep(1.5)  # one nudge only
    assert [r for *_, r in session_events(url, "n1")] == [
        "You said: hello",
        "You said: are you there?",
        "Are you still there?",
    ]
    assert got[2][0].startswith("timer:nudge:")


async def test_a_session_key_of_timers_or_msg_ids_written_by_hand_hurts_no_message(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    """A string where a session's msg_id index or timers hash belongs: its messages are still
    applied (the index is skipped; a timer there is refused with its commit alone)."""
    start(workers, tmp_path)
    url = env["REDIS_URL"]
    session = Keys.from_settings(load_settings(environ=env)).session("h1")
    r = redis.Redis.from_url(url)
    r.set(session.ids, "x")
    r.set(session.timers, "x")
    await client.send("h1", "hello")
    await client.send("h1", "remind 60 r1")
    await client.send("h1", "after")
    got = await wait_for(lambda: len(session_events(url, "h1")) >= 3 and session_events(url, "h1"))
    assert [o for _, _, o, _ in got] == ["applied", "dead_lettered", "applied"]


async def test_a_due_timer_fires_alone_and_a_later_one_waits_for_its_time(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    url = env["REDIS_URL"]
    await client.send("t9", "remind 3600 later", msg_id="m1")
    await client.send("t9", "remind 0.3 soon", msg_id="m2")
    got = await wait_for(lambda: len(session_events(url, "t9")) >= 3 and session_events(url, "t9"))
    await anyio.sleep(0.8)  # a few more looks for due timers
    got = session_events(url, "t9")
    assert [r for *_, r in got] == [
        "ok remind 3600 later",
        "ok remind 0.3 soon",
        "fired soon: reminder",
    ]
    r = redis.Redis.from_url(url, decode_responses=True)
    [later] = r.zrange(Keys.from_settings(load_settings(environ=env)).timers, 0, -1)
    assert later.startswith("t9\n")
