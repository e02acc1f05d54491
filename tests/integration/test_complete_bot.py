"""docs/engine.md's complete bot (cafe_bot.py), saved from the guide as it is written and run
by a real worker: its buttons arrive in the reply events' bubbles, a silence brings one nudge,
a user who writes first cancels the nudge waiting, and "start over" brings the step back."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis_server import wait_for

from dialog_worker.client.dialog_client import DialogClient

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"
NUDGE_S = 0.5  # the guide's NUDGE_AFTER_S, short for the test
BUTTONS = ["hours", "order", "start over"]


def start_cafe_bot(workers: Any, env: dict[str, str], tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text("utf-8"), flags=re.S)
    [code] = [b for b in blocks if b.startswith("# cafe_bot.py")]
    (tmp_path / "cafe_bot.py").write_text(code, encoding="utf-8")
    path = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    workers.start(1, DIALOG_ENGINE="cafe_bot:CafeBot", NUDGE_AFTER_S=str(NUDGE_S), PYTHONPATH=path)


def session_events(url: str, sid: str) -> list[tuple[str, dict[str, str]]]:
    """(entry id, fields) of the session's reply events, oldest first."""
    r = redis.Redis.from_url(url, decode_responses=True)
    return [(eid, f) for eid, f in r.xrange("dialog-replies") if f["session_id"] == sid]


def payloads(bubbles: list[dict[str, Any]] | None) -> list[str]:
    [bubble] = bubbles or []
    return [b["payload"] for b in bubble["data"]["buttons"]]


def user_turns(state: dict[str, Any] | None) -> list[str]:
    history = (state or {}).get("history", [])
    return [t["user"] for t in history if not t["msg_id"].startswith("timer:")]


async def test_the_guides_complete_bot_answers_with_buttons_and_nudges_once_after_a_silence(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start_cafe_bot(workers, env, tmp_path)
    url = env["REDIS_URL"]
    # Three messages in quick succession: each one cancels the nudge the one before set.
    for i, text in enumerate(["hello", "order", "pizza"], 1):
        await client.send("c1", text, msg_id=f"m{i}")
    await wait_for(lambda: len(session_events(url, "c1")) >= 4)
    await anyio.sleep(NUDGE_S * 3)  # and nothing more comes: one nudge, not one per message
    got = session_events(url, "c1")
    assert [(f["msg_id"].split(":")[0], f["outcome"], f["reply"]) for _, f in got] == [
        ("m1", "applied", "Hello! What can I do for you?"),
        ("m2", "applied", "What would you like to order?"),
        ("m3", "applied", "Noted: pizza."),
        ("timer", "applied", "Are you still there?"),
    ]
    hello, order, pizza, nudge = (fields for _, fields in got)
    # The buttons ride in the reply event's bubbles, as JSON text.
    assert json.loads(hello["bubbles"]) == [
        {
            "text": "Hello! What can I do for you?",
            "data": {
                "buttons": [
                    {"title": "Opening hours", "payload": "hours"},
                    {"title": "Order", "payload": "order"},
                    {"title": "Start over", "payload": "start over"},
                ]
            },
        }
    ]
    assert "bubbles" not in order  # a plain string stays a plain reply
    assert payloads(json.loads(pizza["bubbles"])) == BUTTONS
    assert payloads(json.loads(nudge["bubbles"])) == BUTTONS
    # The nudge that fired is the one "pizza" set: due NUDGE_S after pizza's commit (the
    # reply event's id is the commit's Redis time, in ms).
    assert nudge["msg_id"].startswith("timer:nudge:")
    due_ms = int(nudge["msg_id"].rsplit(":", 1)[1])
    pizza_ms = int(got[2][0].split("-")[0])
    assert abs(due_ms - pizza_ms - NUDGE_S * 1000) <= 50, (due_ms, pizza_ms)
    state = await client.state("c1")
    assert state is not None
    assert (state["step"], state["memory"]) == ("ROOT", {"order": "pizza"})


async def test_the_guides_complete_bot_starts_over_and_an_admin_reset_clears_the_history(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path
) -> None:
    start_cafe_bot(workers, env, tmp_path)
    asked = await client.ask("c2", "order", timeout=15)
    assert asked.text == "What would you like to order?"
    state = await client.state("c2")
    assert state is not None and state["step"] == "ORDER"
    over = await client.ask("c2", "start over", timeout=15)  # the button's payload
    assert over.text == "Let's start over." and payloads(over.bubbles) == BUTTONS
    state = await client.state("c2")
    assert state is not None and (state["step"], state["memory"]) == ("ROOT", {})
    assert user_turns(state) == ["order", "start over"]  # the history stays
    # Back at the start: "tea" is no longer taken as an order.
    tea = await client.ask("c2", "tea", timeout=15)
    assert tea.text == "Hello! What can I do for you?"
    # The admin reset the guide points to clears the history as well.
    await client.reset("c2", reason="test")
    state = await client.state("c2")
    assert user_turns(state) == []
    assert state is None or (state["step"], state["memory"]) == ("ROOT", {})
