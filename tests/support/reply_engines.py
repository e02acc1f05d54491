"""An engine for the reply tests (tests/integration/test_rich_replies.py), loaded by worker
processes with DIALOG_ENGINE=reply_engines:Replies. The message's text says what it answers:

    buttons         one bubble with text and buttons in its data
    two             a list of two bubbles
    silent          None: no answer
    bubbles N       N bubbles ("b0", "b1", ...)
    size N          one bubble whose reply JSON is exactly N bytes
    stream          emits "par" and "tial", then answers with one bubble
    sleep S         sleeps S seconds, then answers as below
    anything else   the plain string "ok <text>"

Each step appends its msg_id to the file named by REPLY_ENGINE_LOG (to tell which ran)."""

from __future__ import annotations

import os
from typing import Any

import anyio

import dialog_worker
from dialog_worker.engine.protocol import bubbles_json

BUTTONS = {"buttons": [{"title": "Ya", "payload": "yes"}, {"title": "Tidak", "payload": "no"}]}


def sized_bubble(size: int) -> dict[str, Any]:
    """One bubble whose reply event's bubbles field is exactly `size` bytes."""
    overhead = len(bubbles_json([{"text": "", "data": ""}]).encode())
    return {"text": "", "data": "x" * (size - overhead)}


def answer(text: str) -> Any:
    word, _, arg = text.partition(" ")
    if word == "buttons":
        return {"text": "Lanjut?", "data": BUTTONS}
    if word == "two":
        return [{"text": "Halo"}, {"text": "Pilih:", "data": BUTTONS}]
    if word == "silent":
        return None
    if word == "bubbles":
        return [{"text": f"b{i}"} for i in range(int(arg))]
    if word == "size":
        return sized_bubble(int(arg))
    return "ok " + text


def record(msg_id: str) -> None:
    path = os.environ.get("REPLY_ENGINE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(msg_id + "\n")


class Replies:
    async def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, Any]:
        record(message["msg_id"])
        text = message["text"]
        if text.startswith("sleep "):
            await anyio.sleep(float(text.split()[1]))
        if text == "stream":
            dialog_worker.emit("par")
            dialog_worker.emit("tial")
            return {**state, "step": "ANSWERED"}, {"text": "partial", "data": {"done": True}}
        return {**state, "step": "ANSWERED"}, answer(text)
