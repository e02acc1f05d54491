"""Engines for the timer and erasure tests, loaded by worker processes with
DIALOG_ENGINE=timer_engines:<Name>. A user message's text says what the step does:

- ``remind S NAME [TEXT]``: a timer NAME in S seconds (its text TEXT, default "reminder");
- ``nudge S``: an inactivity nudge in S seconds, cancelled by the user's next message;
- ``cancel NAME``: drop timer NAME;
- ``remind-then-fail S NAME``: set a timer, then fail for good (the timer must not exist);
- ``sleep S``: take S seconds;
- anything else: answered at once.
A timer's message (meta ``timer``) is answered ``fired <name>: <text>``. Each step appends a
JSON line (time, msg_id, text, meta) to the file named by TIMER_ENGINE_LOG."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import anyio

import dialog_worker


def record(message: dict[str, Any]) -> None:
    path = os.environ.get("TIMER_ENGINE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            line = {"t": time.time(), "msg_id": message["msg_id"], "seq": message["seq"]}
            log.write(json.dumps({**line, "text": message["text"], "meta": message["meta"]}))
            log.write("\n")


class Timers:
    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        record(message)
        memory = dict(state["memory"] or {})
        memory["turns"] = memory.get("turns", 0) + 1
        new = {**state, "step": "TALKING", "memory": memory}
        timer = message["meta"].get("timer")
        if timer is not None:
            return new, f"fired {timer}: {message['text']}"
        words = message["text"].split()
        if words[:1] == ["remind"] and len(words) >= 3:
            text = " ".join(words[3:]) or "reminder"
            dialog_worker.schedule(words[2], text, delay_s=float(words[1]), meta={"kind": "r"})
        elif words[:1] == ["nudge"] and len(words) == 2:
            dialog_worker.schedule(
                "nudge", "are you still there?", delay_s=float(words[1]), cancel_on_message=True
            )
        elif words[:1] == ["cancel"] and len(words) == 2:
            dialog_worker.cancel_timer(words[1])
        elif words[:1] == ["remind-then-fail"]:
            dialog_worker.schedule(words[2], "never", delay_s=float(words[1]))
            raise dialog_worker.PermanentError("failed after scheduling")
        elif words[:1] == ["sleep"] and len(words) == 2:
            await anyio.sleep(float(words[1]))
        return new, "ok " + message["text"]
