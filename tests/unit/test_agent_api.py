"""The engine's side of the step journal, interrupts and typed events without Redis: what
`once`, `interrupt` and `emit_event` accept and refuse, and how a reader turns event entries
and ``awaiting`` reply events into what applications see."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest

import dialog_worker
from dialog_worker.client.partial_reader import Tracker
from dialog_worker.client.replies import reply_from_entry
from dialog_worker.engine import emit as emit_context
from dialog_worker.engine import journal as journal_context
from dialog_worker.engine.emit import MAX_EVENT_BYTES
from dialog_worker.engine.interrupts import MAX_PAYLOAD_BYTES, Interrupted
from dialog_worker.errors import ValidationError


class Recorder:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, text: str) -> None:
        self.items.append(text)

    def add_event(self, kind: str, data: str, keep: bool) -> None:
        self.items.append((kind, json.loads(data), keep))


def test_once_outside_a_step_calls_the_function_and_returns_its_json_in_both_styles() -> None:
    calls: list[int] = []

    def tool(x: int) -> tuple[int, str]:
        calls.append(x)
        return (x, "done")

    async def in_an_async_step() -> Any:
        return await dialog_worker.once("t", tool, 1)

    assert asyncio.run(in_an_async_step()) == [1, "done"]  # read back as JSON: a list
    assert dialog_worker.once("t", tool, 2) == [2, "done"]  # a plain step's thread: a value
    assert calls == [1, 2]
    with pytest.raises(dialog_worker.UnrecordableResult, match="type set"):
        dialog_worker.once("t", lambda: {1, 2})
    for bad in ("", "x" * 129, "a\nb", "cut\ud83d"):
        with pytest.raises(ValidationError, match="once"):
            dialog_worker.once(bad, tool, 1)
    assert dialog_worker.once("x" * 128, lambda: 1) == 1


class MemoryJournal:
    """A step journal in memory, as lua/journal-1.lua keeps it: the first result of a name
    stays; no interrupt has been answered."""

    def __init__(self) -> None:
        self.results: dict[str, str] = {}
        self.asked = 0

    async def result(self, name: str) -> str | None:
        return self.results.get(name)

    async def record(self, name: str, value: str) -> str:
        return self.results.setdefault(name, value)

    async def interrupt_ended(self, n: int) -> dict[str, Any] | None:
        return None

    def interrupt_id(self, n: int) -> str:
        return f"m:1:{n}"

    def next_interrupt(self) -> int:
        self.asked += 1
        return self.asked

    def interrupt_answered(self) -> None:
        pass

    def run_sync(self, call: Any) -> Any:
        return asyncio.run(call)  # a plain step's thread has no event loop of its own


def in_step(journal: MemoryJournal, call: Any) -> Any:
    token = journal_context.bind(journal)
    try:
        return call()
    finally:
        journal_context.unbind(token)


def test_once_returns_in_the_first_attempt_what_every_later_attempt_reads_back() -> None:
    """A tuple, or a dict with a number as a key, comes back as its JSON reads: a list, a
    string key. The first attempt must see that too, or its step and a later run of it
    (which reads the journal) take different paths."""

    def tool() -> Any:
        return ((1, "a"), {2: "b"})

    async def async_step() -> Any:
        return await dialog_worker.once("t", tool)

    for run in (lambda: asyncio.run(async_step()), lambda: dialog_worker.once("t", tool)):
        journal = MemoryJournal()
        first = in_step(journal, run)
        later = in_step(journal, run)  # the next attempt: from the journal
        assert first == later == [[1, "a"], {"2": "b"}]
        assert type(first[0]) is list


def test_interrupt_timeout_s_is_seconds() -> None:
    async def async_step() -> Any:
        return await dialog_worker.interrupt({"q": 1}, timeout_s=2.5)

    runs = [
        (lambda: asyncio.run(async_step()), 2_500),
        (lambda: dialog_worker.interrupt({}, 90), 90_000),  # a plain step's thread
        (lambda: dialog_worker.interrupt({}), 0),  # no timeout
    ]
    for run, timeout_ms in runs:
        with pytest.raises(Interrupted) as asked:
            in_step(MemoryJournal(), run)
        assert asked.value.timeout_ms == timeout_ms


def test_once_records_the_types_sdk_results_hold_as_json_and_refuses_the_rest() -> None:
    class Status(enum.Enum):
        PAID = "paid"

    @dataclasses.dataclass
    class Line:
        sku: str
        status: Status

    class Model:  # a pydantic model's method, as the OpenAI and Anthropic SDKs' results have
        def model_dump(self, mode: str) -> dict[str, Any]:
            return {"mode": mode}

    result = {
        "at": datetime(2025, 3, 1, 9, 30, tzinfo=UTC),
        "day": date(2025, 3, 1),
        "amount": Decimal("12.50"),
        "id": uuid.UUID(int=1),
        "lines": [Line("A-17", Status.PAID)],
        "usage": Model(),
        "cut": "ab\ud83d",
    }
    assert dialog_worker.once("sdk", lambda: result) == {
        "at": "2025-03-01T09:30:00+00:00",
        "day": "2025-03-01",
        "amount": "12.50",
        "id": "00000000-0000-0000-0000-000000000001",
        "lines": [{"sku": "A-17", "status": "paid"}],
        "usage": {"mode": "json"},
        "cut": "ab\ud83d",
    }
    nested: list[Any] = []
    for _ in range(100_000):
        nested = [nested]
    for bad, why in ((object(), "type object"), (float("nan"), "Out of range"), (nested, "deep")):
        with pytest.raises(dialog_worker.UnrecordableResult, match=why) as refused:
            dialog_worker.once("refund:A-17", lambda bad=bad: bad)
        assert isinstance(refused.value, dialog_worker.PermanentError)  # dead-lettered at once
        assert "refund:A-17" in str(refused.value)


def test_interrupt_outside_a_step_is_refused_and_its_payload_is_bounded() -> None:
    with pytest.raises(RuntimeError, match="running step"):
        dialog_worker.interrupt({"q": "ok?"})
    with pytest.raises(ValidationError, match="payload"):
        dialog_worker.interrupt("x" * MAX_PAYLOAD_BYTES)
    for bad in (0, -1, float("inf"), True):
        with pytest.raises(ValidationError, match="timeout_s"):
            dialog_worker.interrupt({}, timeout_s=bad)


def test_emit_event_checks_its_kind_and_size_and_passes_the_rest_in_order() -> None:
    recorder = Recorder()
    token = emit_context.bind(recorder)
    try:
        dialog_worker.emit("a")
        dialog_worker.emit_event("tool.call:1-x_y", {"n": 1}, keep=True)
        dialog_worker.emit_event("status")
        dialog_worker.emit_event("big", "x" * (MAX_EVENT_BYTES - 2))  # 8 KiB with its quotes
        for kind in ("", "x" * 65, "a b", "é", "awaiting", "waiting"):
            with pytest.raises(ValidationError):
                dialog_worker.emit_event(kind, 1)
        with pytest.raises(ValidationError, match="8192"):
            dialog_worker.emit_event("big", "x" * (MAX_EVENT_BYTES - 1))
        with pytest.raises(ValidationError, match="not JSON"):
            dialog_worker.emit_event("bad", float("nan"))
    finally:
        emit_context.unbind(token)
    assert recorder.items == [
        "a",
        ("tool.call:1-x_y", {"n": 1}, True),
        ("status", None, False),
        ("big", "x" * (MAX_EVENT_BYTES - 2), False),
    ]
    dialog_worker.emit_event("ignored", 1)  # outside a step: nothing, no error


def entry(attempt: int, pos: int, kind: bytes, text: str, **more: bytes) -> dict[bytes, bytes]:
    fields = {b"a": b"%d" % attempt, b"p": b"%d" % pos, b"s": b"1", b"k": kind}
    fields[b"t"] = text.encode()
    fields.update({k.encode(): v for k, v in more.items()})
    return fields


def test_a_reader_gets_events_in_order_with_the_text_and_resumes_after_them_once() -> None:
    stream = [
        entry(1, 0, b"d", "checking "),
        entry(1, 1, b"v", '{"name":"lookup"}', n=b"tool"),
        entry(1, 2, b"v", '{"interrupt_id":"m:1:1","payload":{"q":1}}', n=b"awaiting"),
        entry(2, 0, b"d", "approved"),
    ]
    tracker = Tracker("m")
    got = [e for fields in stream for e in tracker.feed(fields)]
    assert [(e.kind, e.text, e.event_kind, e.data, e.cursor) for e in got] == [
        ("delta", "checking ", None, None, "m:1:0"),
        ("event", "", "tool", {"name": "lookup"}, "m:1:1"),
        ("event", "", "awaiting", {"interrupt_id": "m:1:1", "payload": {"q": 1}}, "m:1:2"),
        ("reset", "", None, None, None),
        ("delta", "approved", None, None, "m:2:0"),
    ]
    assert got[1].as_dict()["event_kind"] == "tool"
    assert "event_kind" not in got[0].as_dict() and "data" not in got[0].as_dict()
    from dialog_worker.client.partial_reader import parse_cursor

    again = Tracker("m", parse_cursor("m:1:1", "m"))
    later = [e for fields in stream for e in again.feed(fields)]
    assert [(e.kind, e.event_kind) for e in later] == [
        ("event", "awaiting"),
        ("reset", None),
        ("delta", None),
    ]
    # Data that is not JSON (forged) reads as None; the event is still in its place.
    [odd] = Tracker("m").feed(entry(1, 0, b"v", "{oops", n=b"x"))
    assert (odd.kind, odd.event_kind, odd.data) == ("event", "x", None)


def test_an_awaiting_reply_event_carries_its_interrupt_and_payload_not_as_echoed_fields() -> None:
    fields = {
        b"session_id": b"s",
        b"msg_id": b"m",
        b"seq": b"3",
        b"outcome": b"awaiting",
        b"reply": b"",
        b"produced_at": b"1",
        b"entry_id": b"1-1",
        b"interrupt_id": b"m:3:1",
        b"payload": b'{"approve":"refund 40"}',
        b"channel": b"web",
    }
    reply = reply_from_entry(b"2-0", fields, "dialog-replies")
    assert (reply.outcome, reply.interrupt_id, reply.payload) == (
        "awaiting",
        "m:3:1",
        {"approve": "refund 40"},
    )
    assert reply.echo == {"channel": "web"}
    shown = reply.as_dict()
    assert (shown["interrupt_id"], shown["payload"]) == ("m:3:1", {"approve": "refund 40"})
    plain = reply_from_entry(b"3-0", {**fields, b"outcome": b"applied"}, "x")
    del fields[b"interrupt_id"], fields[b"payload"]
    plain = reply_from_entry(b"3-0", {**fields, b"outcome": b"applied"}, "x")
    assert "interrupt_id" not in plain.as_dict() and "payload" not in plain.as_dict()
