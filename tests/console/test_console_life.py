"""The console answers "why did this message take so long?": the message page shows its life
(each attempt with its start, end and error, each wait with its duration, each model call and
each journaled call), and the session page says what the session waits for now (a paused
model key with the pause's reason and end). Real workers, the console in-process."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from console_support import OPERATOR, basic
from redis_server import wait_until_async as poll
from worker_procs import run_cli

from dialog_worker.client.dialog_client import DialogClient

pytestmark = pytest.mark.integration

OP = basic(OPERATOR)


async def _life(http: httpx.AsyncClient, session_id: str, msg_id: str) -> dict[str, Any]:
    got = await http.get(
        "/api/message/life", params={"session": session_id, "msg_id": msg_id}, headers=OP
    )
    return dict(got.json())


async def test_the_message_page_shows_each_attempt_wait_model_call_and_journaled_call(
    http: httpx.AsyncClient, client: DialogClient, workers, env: dict[str, str]
) -> None:
    """rpm 20 (a call every 3 s): the message's first attempt journals a call, calls the model
    and fails; its retry gets the journaled result back and waits about 3 s for its turn
    inside the step, then is applied. Its page lists both attempts, the failure, the wait
    for the rate with its duration, both model calls and both journaled calls."""
    workers.start(
        1,
        DIALOG_ENGINE="usage_engines:UsageEngine",
        DIALOG_MODEL_LIMITS=json.dumps({"k": {"rpm": 20}}),
        DIALOG_MODEL_CALL_MAX_WAIT_MS="5000",
        DIALOG_BACKOFF_BASE_MS="100",
        DIALOG_BACKOFF_MAX_MS="200",
    )
    sent = await client.send("life1", "fail-once once")
    msg_id = sent.msg_id

    async def recorded() -> bool:
        return len((await _life(http, "life1", msg_id))["attempts"]) == 2

    await poll(recorded, 30, what="both attempts recorded")
    life = await _life(http, "life1", msg_id)
    first, second = life["attempts"]
    assert (first["attempt"], first["outcome"], second["outcome"]) == (1, "retry", "applied")
    assert "after the call" in first["error"]
    assert [c["key"] for c in first["calls"] + second["calls"]] == ["k", "k"]
    assert {c["tokens"] for c in first["calls"] + second["calls"]} == {15}
    assert [(w["reason"], w["key"]) for w in second["waits"]] == [("rate", "k")]
    assert 1_000 <= second["waits"][0]["ms"] <= 3_500
    assert first["once"] == [{"name": "lookup", "replayed": False}]
    assert second["once"] == [{"name": "lookup", "replayed": True}]
    assert second["between_s"] is not None and life["waited_s"] >= 1.0
    assert life["turn"]["bot"] == "ok fail-once once"
    page = await http.get(
        "/message/life", params={"session": "life1", "msg_id": msg_id}, headers=OP
    )
    assert page.status_code == 200
    assert 'data-reason="rate"' in page.text and "after the call" in page.text
    assert "from the journal" in page.text
    session = (await http.get("/session", params={"id": "life1"}, headers=OP)).text
    assert f"msg_id={msg_id}" in session  # its turn links to its life
    missing = await http.get(
        "/api/message/life", params={"session": "life1", "msg_id": "nope"}, headers=OP
    )
    assert missing.status_code == 404
    life_key = client.keys_for("life1").session("life1").life(msg_id)
    assert await client.redis.exists(life_key)
    await client.delete("life1", reason="test")
    assert not await client.redis.exists(life_key), "its life goes with the session"


async def test_the_session_page_says_it_waits_for_a_paused_key_with_its_reason_and_end(
    http: httpx.AsyncClient, client: DialogClient, workers, env: dict[str, str]
) -> None:
    workers.start(
        1,
        DIALOG_ENGINE="usage_engines:UsageEngine",
        DIALOG_MODEL_LIMITS=json.dumps({"k": {"rpm": 6000}}),
    )
    paused = run_cli(env, "limits", "pause", "k", "--for", "600", "--reason", "bill check")
    assert paused.returncode == 0, paused.stderr
    await anyio.sleep(0.3)  # past the 100 ms in which workers see the pause
    sent = await client.send("life2", "hello")

    async def says_so() -> bool:
        page = (await http.get("/session", params={"id": "life2"}, headers=OP)).text
        return 'id="waits-for" data-reason="paused"' in page

    await poll(says_so, 20, what="the session page says it waits for the paused key")
    page = (await http.get("/session", params={"id": "life2"}, headers=OP)).text
    line = page.split('id="waits-for"', 1)[1].split("</p>", 1)[0]
    assert "the model key k is paused" in line and "bill check" in line and "UTC" in line
    assert sent.msg_id in line
    resumed = run_cli(env, "limits", "resume", "k", "--reason", "bill is fine")
    assert resumed.returncode == 0, resumed.stderr

    async def answered() -> bool:
        return len((await _life(http, "life2", sent.msg_id))["attempts"]) == 2

    await poll(answered, 20, what="the message answered after the resume")
    first, second = (await _life(http, "life2", sent.msg_id))["attempts"]
    assert first["outcome"] == "waiting" and second["outcome"] == "applied"
    assert [(w["reason"], w["key"]) for w in first["waits"]] == [("paused", "k")]
    assert first["waits"][0]["until"] is not None and first["calls"] == []
    assert [c["key"] for c in second["calls"]] == ["k"]
    after = (await http.get("/session", params={"id": "life2"}, headers=OP)).text
    assert 'id="waits-for"' not in after
