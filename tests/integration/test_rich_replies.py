"""Rich replies, echoed fields and expiry against real workers and a real Redis: what a step
returns (a string, one bubble, a list of bubbles, None) reaches the reply event, `Reply` and
the history; the limits hold at the limit and fail one past it; DIALOG_ECHO_FIELDS copies
producer fields onto every event of a message; a message whose turn comes after its expiry
ends `expired` in order, without a step."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from redis_server import wait_for
from reply_engines import BUTTONS
from worker_procs import run_cli

from dialog_worker import SyncDialogClient
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.replies import reply_from_entry
from dialog_worker.config import load_settings
from dialog_worker.engine.protocol import MAX_BUBBLES, MAX_BUBBLES_BYTES

pytestmark = pytest.mark.integration

CORE = {"session_id", "msg_id", "seq", "outcome", "reply", "produced_at", "entry_id"}


def events(url: str, stream: str = "dialog-replies") -> list[dict[str, str]]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [fields for _, fields in r.xrange(stream)]


def dead_letters(url: str) -> list[dict[str, str]]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [fields for _, fields in r.xrange("dialog-dlq")]


def start(workers: Any, tmp_path: Path, **env: str) -> Path:
    log = tmp_path / "steps.log"
    workers.start(1, DIALOG_ENGINE="reply_engines:Replies", REPLY_ENGINE_LOG=str(log), **env)
    return log


def stepped(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


async def test_a_step_answers_with_a_string_a_bubble_bubbles_or_nothing(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    plain = await client.ask("s1", "hello", msg_id="m1", timeout=15)
    one = await client.ask("s1", "buttons", msg_id="m2", timeout=15)
    two = await client.ask("s1", "two", msg_id="m3", timeout=15)
    none = await client.ask("s1", "silent", msg_id="m4", timeout=15)
    # A plain string is exactly the event of old: no new field.
    got = {e["msg_id"]: e for e in events(env["REDIS_URL"])}
    assert set(got["m1"]) == CORE and got["m1"]["reply"] == "ok hello"
    assert (plain.text, plain.bubbles, plain.no_reply, plain.echo) == ("ok hello", None, False, {})
    assert one.outcome == "applied" and one.text == "Lanjut?"
    assert one.bubbles == [{"text": "Lanjut?", "data": BUTTONS}]
    assert json.loads(got["m2"]["bubbles"]) == one.bubbles  # passed through untouched
    assert two.text == "Halo\n\nPilih:"
    assert two.bubbles == [{"text": "Halo"}, {"text": "Pilih:", "data": BUTTONS}]
    assert (none.outcome, none.text, none.no_reply, none.bubbles) == ("applied", "", True, None)
    assert got["m4"]["no_reply"] == "1" and "bubbles" not in got["m4"]
    state = await client.state("s1")
    assert state is not None
    turns = {t["msg_id"]: t for t in state["history"]}
    assert turns["m1"] == {"seq": 1, "msg_id": "m1", "user": "hello", "bot": "ok hello"}
    assert turns["m2"]["bubbles"] == one.bubbles and turns["m2"]["bot"] == "Lanjut?"
    assert turns["m3"]["bubbles"] == two.bubbles
    assert turns["m4"]["no_reply"] is True and turns["m4"]["bot"] == ""
    # A copy of a rich reply's message is answered with its text (its msg_id was seen).
    again = await client.ask("s1", "buttons", msg_id="m2", timeout=15)
    assert (again.outcome, again.seq, again.text) == ("duplicate", 2, "Lanjut?")


async def test_reply_limits_hold_at_the_limit_and_fail_one_past_it(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path, DIALOG_MAX_ATTEMPTS="1")
    at_count = await client.ask("s2", f"bubbles {MAX_BUBBLES}", timeout=15)
    past_count = await client.ask("s2", f"bubbles {MAX_BUBBLES + 1}", timeout=15)
    at_size = await client.ask("s2", f"size {MAX_BUBBLES_BYTES}", timeout=15)
    past_size = await client.ask("s2", f"size {MAX_BUBBLES_BYTES + 1}", timeout=15)
    after = await client.ask("s2", "hello", timeout=15)
    assert at_count.outcome == "applied" and len(at_count.bubbles or []) == MAX_BUBBLES
    assert at_size.outcome == "applied"
    got = {e["msg_id"]: e for e in events(env["REDIS_URL"])}
    assert len(got[at_size.msg_id]["bubbles"].encode()) == MAX_BUBBLES_BYTES
    assert [past_count.outcome, past_size.outcome] == ["dead_lettered", "dead_lettered"]
    letters = {d["msg_id"]: d for d in dead_letters(env["REDIS_URL"])}
    assert letters[past_count.msg_id]["error_kind"] == "permanent"
    assert f"at most {MAX_BUBBLES} are allowed" in letters[past_count.msg_id]["error"]
    assert f"at most {MAX_BUBBLES_BYTES} are allowed" in letters[past_size.msg_id]["error"]
    assert (after.outcome, after.seq) == ("applied", 5)  # the session goes on


async def test_a_streaming_step_may_answer_with_a_bubble(
    workers: Any, client: DialogClient, tmp_path: Path
) -> None:
    start(workers, tmp_path)
    events_seen = [e async for e in client.ask_stream("s3", "stream", timeout=15)]
    end = events_seen[-1]
    assert (end.kind, end.outcome, end.text) == ("end", "applied", "partial")
    state = await client.state("s3")
    assert state is not None
    assert state["history"][0]["bubbles"] == [{"text": "partial", "data": {"done": True}}]


async def test_echoed_fields_reach_every_event_of_their_message(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path, DIALOG_ECHO_FIELDS="channel,chat_id")
    url = env["REDIS_URL"]
    r = redis.Redis.from_url(url)
    route = {"channel": "wa", "chat_id": "62811"}
    applied = await client.ask("e1", "buttons", msg_id="a", timeout=15)
    # The same msg_id again, answered at intake from the history.
    await client.send("e1", "buttons", msg_id="a", meta=route)
    # Refused at intake (no text), but it names its session.
    r.xadd("dialog", {"session_id": "e1", "msg_id": "bad", "channel": "wa", "chat_id": "62811"})
    # While a slow one runs: a rejected one, a cancelled one, a copy of the slow one.
    await client.send("e2", "sleep 1", msg_id="slow", meta=route)
    await client.send("e2", "x", msg_id="rej", meta=route, multitask="reject")
    await client.send("e2", "sleep 0", msg_id="cxl", meta=route)
    await client.cancel("e2", "cxl")
    await client.send("e2", "sleep 1", msg_id="slow", meta={"channel": "other"})
    await client.send("e2", "late", msg_id="exp", meta=route, expires_at=time.time())
    await client.send("e2", "plain", msg_id="none")  # carries neither field
    got = await wait_for(lambda: len(events(url)) >= 9 and events(url))
    assert applied.echo == {}  # ask sends no meta: nothing to echo
    ends = [(e["msg_id"], e["outcome"], e.get("channel"), e.get("chat_id")) for e in got[1:]]
    assert sorted(ends) == sorted(
        [
            ("a", "duplicate", "wa", "62811"),
            ("bad", "dead_lettered", "wa", "62811"),
            ("rej", "rejected", "wa", "62811"),
            ("slow", "applied", "wa", "62811"),
            # A copy answered by its original's commit carries the original's fields.
            ("slow", "duplicate", "wa", "62811"),
            ("cxl", "cancelled", "wa", "62811"),
            ("exp", "expired", "wa", "62811"),
            ("none", "applied", None, None),
        ]
    )
    raw = redis.Redis.from_url(url).xrange("dialog-replies")
    replies = [reply_from_entry(i, f, "dialog-replies") for i, f in raw]
    assert {(p.msg_id, p.outcome): p.echo for p in replies}[("exp", "expired")] == route
    assert [p.echo for p in replies if p.msg_id == "none"] == [{}]
    dup = next(e for e in got if e["msg_id"] == "a" and e["outcome"] == "duplicate")
    assert "bubbles" not in dup  # answered at intake: its text only


async def test_a_message_past_its_expiry_ends_expired_in_order_without_a_step(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    log = start(workers, tmp_path)
    url = env["REDIS_URL"]
    await client.send("x1", "sleep 1", msg_id="first")
    await client.send("x1", "soon", msg_id="gone", expires_at=time.time() + 0.3)
    await client.send("x1", "later", msg_id="kept", expires_at=time.time() + 60)
    got = await wait_for(lambda: len(events(url)) >= 3 and events(url))
    assert [(e["msg_id"], e["seq"], e["outcome"], e["reply"]) for e in got] == [
        ("first", "1", "applied", "ok sleep 1"),
        ("gone", "2", "expired", ""),
        ("kept", "3", "applied", "ok later"),
    ]
    assert stepped(log) == ["first", "kept"]
    state = await client.state("x1")
    assert state is not None
    assert state["history"][1] == {
        "seq": 2, "msg_id": "gone", "user": "soon", "bot": "", "expired": True
    }  # fmt: skip
    finished = await client.cancel("x1", "gone")
    assert (finished.status, finished.seq, finished.outcome) == ("finished", 2, "expired")
    # ask returns it; an expired message frees its msg_id (a re-send is applied).
    expired = await client.ask("x1", "soon", msg_id="gone2", expires_at=1.5, timeout=15)
    assert (expired.outcome, expired.seq) == ("expired", 4)
    again = await client.ask("x1", "soon", msg_id="gone", timeout=15)
    assert (again.outcome, again.seq) == ("applied", 5)


async def test_the_deployment_ttl_expires_a_message_that_waited_too_long(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    log = start(workers, tmp_path, DIALOG_MESSAGE_TTL_S="0.5")
    url = env["REDIS_URL"]
    r = redis.asyncio.Redis.from_url(url)
    for i in range(50):  # until the worker is up: until then, each one expires
        if (await client.ask("t0", "warm", msg_id=f"warm{i}", timeout=15)).outcome == "applied":
            break
    await r.delete("dialog-replies")
    log.unlink(missing_ok=True)
    await client.send("t1", "sleep 1.2", msg_id="first")
    await client.send("t1", "waited", msg_id="waited")
    got = await wait_for(lambda: len(events(url)) >= 2 and events(url))
    assert [(e["msg_id"], e["outcome"]) for e in got] == [
        ("first", "applied"),
        ("waited", "expired"),
    ]
    # A message's own expires_at replaces the deployment's TTL.
    await client.send("t1", "sleep 1.2", msg_id="second")
    await client.send("t1", "mine", msg_id="own", expires_at=time.time() + 60)
    await client.send("t1", "theirs", msg_id="theirs")
    fresh = await client.ask("t2", "fresh", msg_id="fresh", timeout=15)  # no wait: in time
    assert fresh.outcome == "applied"
    got = await wait_for(lambda: len(events(url)) >= 6 and events(url))
    outcomes = {e["msg_id"]: e["outcome"] for e in got}
    assert (outcomes["own"], outcomes["theirs"]) == ("applied", "expired")
    assert sorted(stepped(log)) == sorted(["first", "second", "own", "fresh"])


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("soon", "is not unix seconds"),
        ("-5", "is not unix seconds"),
        ("1767225600000", "not milliseconds"),
    ],
)
async def test_a_malformed_expires_at_is_dead_lettered_alone(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path, value: str, why: str
) -> None:
    start(workers, tmp_path)
    url = env["REDIS_URL"]
    r = redis.Redis.from_url(url)
    r.xadd("dialog", {"session_id": "y1", "text": "hi", "msg_id": "bad", "expires_at": value})
    ok = await client.ask("y1", "next", msg_id="next", timeout=15)
    assert (ok.outcome, ok.seq) == ("applied", 2)
    outcomes = [(e["msg_id"], e["outcome"]) for e in events(url)]
    assert outcomes == [("bad", "dead_lettered"), ("next", "applied")]
    [letter] = dead_letters(url)
    assert letter["error_kind"] == "malformed" and why in letter["error"]
    assert letter["expires_at"] == value  # the original fields, byte for byte


def save_menu_bot(path: Path) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text("utf-8")
    [block] = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if b.startswith("# menu")]
    path.write_text(block, encoding="utf-8")


async def test_the_guides_menu_bot_answers_with_buttons_bubbles_and_nothing(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    """docs/engine.md's menu_bot.py, saved as the guide says, in a real worker."""
    save_menu_bot(tmp_path / "menu_bot.py")
    path = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    workers.start(1, DIALOG_ENGINE="menu_bot:MenuBot", PYTHONPATH=path)
    menu = await client.ask("u1", "menu", timeout=15)
    assert menu.text == "What would you like?"
    [bubble] = menu.bubbles or []
    assert [b["payload"] for b in bubble["data"]["buttons"]] == ["hours", "human"]
    hours = await client.ask("u1", bubble["data"]["buttons"][0]["payload"], timeout=15)
    assert len(hours.bubbles or []) == 2 and hours.text.startswith("We are open")
    assert hours.bubbles and hours.bubbles[1]["data"]["quick_replies"][0]["payload"] == "menu"
    quiet = await client.ask("u1", "ok", timeout=15)
    assert (quiet.outcome, quiet.text, quiet.no_reply) == ("applied", "", True)


def test_the_sync_client_sends_expires_at_and_reads_rich_replies(
    env: dict[str, str], workers: Any, tmp_path: Path
) -> None:
    start(workers, tmp_path)
    with SyncDialogClient(settings=load_settings(environ=env)) as sync:
        late = sync.ask("z1", "hello", timeout=15, expires_at=1.0)
        rich = sync.ask("z1", "buttons", timeout=15, expires_at=time.time() + 60)
    assert (late.outcome, late.seq, late.text) == ("expired", 1, "")
    assert (rich.outcome, rich.bubbles) == ("applied", [{"text": "Lanjut?", "data": BUTTONS}])


def test_cli_send_and_ask_take_expires_at(
    workers: Any, env: dict[str, str], tmp_path: Path
) -> None:
    start(workers, tmp_path)
    late = run_cli(env, "ask", "c1", "hello", "--expires-at", "1", "--timeout", "15")
    assert late.returncode == 0, late.stderr
    assert json.loads(late.stdout)["outcome"] == "expired"
    sent = run_cli(env, "send", "c1", "later", "--expires-at", f"{time.time() + 60:.3f}")
    assert sent.returncode == 0, sent.stderr
    rich = run_cli(env, "ask", "c1", "buttons", "--timeout", "15")
    printed = json.loads(rich.stdout)
    assert (printed["outcome"], printed["bubbles"][0]["data"]) == ("applied", BUTTONS)
    outcomes = [(e["msg_id"], e["outcome"]) for e in events(env["REDIS_URL"])]
    assert outcomes[1] == (json.loads(sent.stdout)["msg_id"], "applied")
    bad = run_cli(env, "send", "c1", "x", "--expires-at", "1767225600000")
    assert bad.returncode != 0 and "milliseconds" in bad.stderr
