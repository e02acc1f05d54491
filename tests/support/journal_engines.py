"""Engines for the step journal and interrupt tests, loaded by worker processes with
DIALOG_ENGINE=journal_engines:<Name>. A message's text says what the step does (words):

- ``tools N [hold]``: N journaled tool calls (``once("tool:<i>")``); each call appends a line
  ``<msg_id> <i>`` to the file named by JOURNAL_CALLS; with ``hold``, after the second call
  the step waits until the file named by JOURNAL_HOLD exists no more (a test kills the worker
  meanwhile). Answers ``done <results>``.
- ``refund AMOUNT [TIMEOUT_S]``: a journaled quote, an interrupt asking to approve it (the
  payload names the amount), then, if approved, a journaled refund; answers ``refunded`` or
  ``declined``; a timed-out wait answers ``timed out``.
- ``big BYTES``: a journaled result of that many bytes.
- ``receipt KIND``: a journaled payment whose result is not plain JSON, as payment SDKs return
  (each call appends ``<msg_id> receipt`` to JOURNAL_CALLS): ``dated`` holds a datetime, a
  Decimal and a UUID; ``opaque`` is an object of a class of its own; ``deep`` nests lists past
  what JSON encoding recurses through; ``cut`` holds text ending in half a UTF-16 pair (a
  lone surrogate, as a text cut at a byte count can). Answers ``paid <the result as the step
  got it>``.
- ``stream``: an emitted text, a typed event (kept in the history), an interrupt, then the
  answer ``after <value>``.
- ``twice``: two interrupts in a row, answers ``<first> <second>``.
- ``unawaited``: calls interrupt() without awaiting it and returns (must fail permanently).
- anything else: answered ``ok <text>``.
``Agent`` is ``async def``; ``SyncAgent`` runs the same in a plain ``def`` step (its thread).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import anyio

import dialog_worker


def tool(msg_id: str, i: int) -> dict[str, int]:
    with open(os.environ["JOURNAL_CALLS"], "a", encoding="utf-8") as calls:
        calls.write(f"{msg_id} {i}\n")
    return {"i": i}


class Receipt:
    """A payment SDK's own result type (not JSON, no conversion the journal knows)."""


def pay(msg_id: str, kind: str) -> Any:
    with open(os.environ["JOURNAL_CALLS"], "a", encoding="utf-8") as calls:
        calls.write(f"{msg_id} receipt\n")
    if kind == "dated":
        return {
            "id": uuid.UUID(int=17),
            "amount": Decimal("12.50"),
            "created": datetime(2025, 3, 1, 9, 30, tzinfo=UTC),
        }
    if kind == "deep":
        nested: list[Any] = []
        for _ in range(100_000):
            nested = [nested]
        return nested
    if kind == "cut":
        return {"text": "ab\ud83d"}
    return Receipt()


def paid(result: Any) -> str:
    return "paid " + json.dumps(result, sort_keys=True)[:200]


class Agent:
    async def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        words = message["text"].split()
        msg_id = message["msg_id"]
        new = {**state, "step": "AGENT", "memory": state["memory"]}
        if words[0] == "tools":
            results = []
            for i in range(1, int(words[1]) + 1):
                results.append(await dialog_worker.once(f"tool:{i}", tool, msg_id, i))
                if i == 2 and "hold" in words:
                    # Held until the test removes the file (it kills this worker meanwhile).
                    while os.path.exists(os.environ["JOURNAL_HOLD"]):  # noqa: ASYNC110, ASYNC240
                        await anyio.sleep(0.05)
            return new, "done " + " ".join(str(r["i"]) for r in results)
        if words[0] == "refund":
            quote = await dialog_worker.once("quote", tool, msg_id, 0)
            timeout = float(words[2]) if len(words) > 2 else None
            try:
                answer = await dialog_worker.interrupt(
                    {"approve": f"refund {words[1]}", "quote": quote}, timeout_s=timeout
                )
            except dialog_worker.InterruptTimeout:
                return new, "timed out"
            if answer is True or (isinstance(answer, dict) and answer.get("approved")):
                await dialog_worker.once("refund", tool, msg_id, 99)
                return new, "refunded"
            return new, "declined"
        if words[0] == "big":
            await dialog_worker.once("big", lambda: "x" * int(words[1]))
            return new, "big"
        if words[0] == "receipt":
            return new, paid(await dialog_worker.once("refund:A-17", pay, msg_id, words[1]))
        if words[0] == "stream":
            dialog_worker.emit("checking ")
            dialog_worker.emit_event("tool", {"name": "lookup", "state": "done"}, keep=True)
            value = await dialog_worker.interrupt({"ask": "go on?"})
            dialog_worker.emit("approved ")
            return new, f"after {value}"
        if words[0] == "twice":
            first = await dialog_worker.interrupt({"n": 1})
            second = await dialog_worker.interrupt({"n": 2})
            return new, f"{first} {second}"
        if words[0] == "unawaited":
            dialog_worker.interrupt({"oops": True})
            return new, "went on"
        return new, "ok " + message["text"]


class SyncAgent:
    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        words = message["text"].split()
        msg_id = message["msg_id"]
        new = {**state, "step": "AGENT", "memory": state["memory"]}
        if words[0] == "tools":
            results = []
            for i in range(1, int(words[1]) + 1):
                results.append(dialog_worker.once(f"tool:{i}", tool, msg_id, i))
                if i == 2 and "hold" in words:
                    while os.path.exists(os.environ["JOURNAL_HOLD"]):
                        time.sleep(0.05)
            return new, "done " + " ".join(str(r["i"]) for r in results)
        if words[0] == "refund":
            quote = dialog_worker.once("quote", tool, msg_id, 0)
            answer = dialog_worker.interrupt({"approve": f"refund {words[1]}", "quote": quote})
            if answer is True:
                dialog_worker.once("refund", tool, msg_id, 99)
                return new, "refunded"
            return new, "declined"
        if words[0] == "receipt":
            return new, paid(dialog_worker.once("refund:A-17", pay, msg_id, words[1]))
        return new, "ok " + message["text"]
