"""Engines for the cancellation tests, loaded by worker processes with
DIALOG_ENGINE=cancel_engines:<Name>. A message's text says what the step does: ``sleep S``
sleeps S seconds before answering, ``flaky`` fails its first attempt (retried after 1 s),
anything else answers at once. Each step appends JSON lines
(started / cancelled / finished, with time.time()) to the file named by CANCEL_ENGINE_LOG."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import anyio

import dialog_worker


def record(event: str, **fields: Any) -> None:
    path = os.environ.get("CANCEL_ENGINE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


def _delay(text: str) -> float:
    parts = text.split()
    return float(parts[1]) if len(parts) == 2 and parts[0] == "sleep" else 0.0


def _answer(state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
    seen = [*(state["memory"] or {}).get("seen", []), message["msg_id"]]
    return {**state, "step": "ANSWERED", "memory": {"seen": seen}}, "ok " + message["text"]


class SlowAsync:
    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        record("started", msg_id=message["msg_id"])
        if message["text"] == "flaky" and message["attempt"] == 1:
            raise dialog_worker.TransientError("try again", retry_after=1)
        try:
            await anyio.sleep(_delay(message["text"]))
        except anyio.get_cancelled_exc_class():
            record("cancelled", msg_id=message["msg_id"])
            raise
        record("finished", msg_id=message["msg_id"])
        return _answer(state, message)


class SlowThread:
    """A plain def step that checks dialog_worker.cancelled() while it works."""

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        record("started", msg_id=message["msg_id"])
        deadline = time.monotonic() + _delay(message["text"])
        while time.monotonic() < deadline:
            if dialog_worker.cancelled():
                record("cancelled", msg_id=message["msg_id"])
                return _answer(state, message)  # discarded by the worker
            time.sleep(0.005)
        record("finished", msg_id=message["msg_id"])
        return _answer(state, message)
