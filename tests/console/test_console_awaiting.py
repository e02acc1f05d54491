"""The console's session page shows what a session waits on: a step that asked a person
(dialog_worker.interrupt), its message and its payload (redacted like any field)."""

from __future__ import annotations

import json

import httpx
import pytest
from console_support import OPERATOR, basic

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.integration


async def test_the_session_page_shows_the_interrupt_a_session_waits_on(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    sk = Keys.from_settings(Settings()).session("w1")
    await client.redis.hset(sk.state, mapping={"a": "0", "s": "1", "v": "1", "d": "{}", "w": "m1"})
    payload = json.dumps({"approve": "refund 40"})
    record = {"id": "m1:1:1", "n": 1, "msg_id": "m1", "seq": 1, "entry_id": "1-1",
              "payload": payload, "at": 1, "timeout_at": 0}  # fmt: skip
    await client.redis.set(sk.awaiting, json.dumps(record))
    page = (await http.get("/session?id=w1", headers=basic(OPERATOR))).text
    assert 'id="awaiting"' in page and "m1:1:1" in page and "refund 40" in page
    other = (await http.get("/session?id=w2", headers=basic(OPERATOR))).text
    assert 'id="awaiting"' not in other
