"""The UI message stream writer (dialog_worker/gateway/ui_stream.py): an answer's events in,
the AI SDK's chunks out, with what the client shows kept so that nothing is shown twice and
what cannot be taken back is marked as replaced."""

from __future__ import annotations

from typing import Any

from dialog_worker.client.partial_reader import StreamEvent
from dialog_worker.gateway.ui_stream import UIMessageWriter, answered_msg_id, message_id


def delta(text: str, attempt: int = 1) -> StreamEvent:
    return StreamEvent("delta", "m1", attempt, text, "m1:1:0")


def reset(attempt: int) -> StreamEvent:
    return StreamEvent("reset", "m1", attempt, "", None)


def end(text: str, outcome: str = "applied", attempt: int = 1) -> StreamEvent:
    return StreamEvent("end", "m1", attempt, text, "m1:1:9", outcome=outcome)


def typed(kind: str, data: Any, attempt: int = 1) -> StreamEvent:
    return StreamEvent("event", "m1", attempt, "", "m1:1:3", event_kind=kind, data=data)


def run(writer: UIMessageWriter, *events: StreamEvent) -> list[dict[str, Any]]:
    out = []
    for event in events:
        chunks, last = writer.feed(event)
        out += chunks
        if last:
            break
    return out


def shown(chunks: list[dict[str, Any]]) -> str:
    """The text a client shows after the last reset part."""
    text = ""
    for c in chunks:
        if c["type"] == "data-reset":
            text = ""
        elif c["type"] == "text-delta":
            text += c["delta"]
    return text


def test_an_answer_is_start_text_parts_and_finish_with_its_outcome():
    w = UIMessageWriter("s1", "m1")
    assert w.begin()[0] == {
        "type": "start",
        "messageId": "reply-m1",
        "messageMetadata": {"session_id": "s1", "msg_id": "m1"},
    }
    out = run(w, delta("Halo "), delta("Budi"), end("Halo Budi"))
    assert [c["type"] for c in out] == [
        "text-start",
        "text-delta",
        "text-delta",
        "text-end",
        "finish-step",
        "finish",
    ]
    assert out[-1] == {
        "type": "finish",
        "finishReason": "stop",
        "messageMetadata": {"outcome": "applied"},
    }


def test_a_new_attempt_repeating_the_shown_text_adds_only_what_is_new():
    out = run(
        UIMessageWriter("s1", "m1"),
        delta("one two "),
        reset(2),
        delta("one ", 2),
        delta("two ", 2),
        delta("three", 2),
        end("one two three", attempt=2),
    )
    assert [c["delta"] for c in out if c["type"] == "text-delta"] == ["one two ", "three"]
    assert not any(c["type"] == "data-reset" for c in out)


def test_a_new_attempt_writing_otherwise_replaces_what_is_shown_after_a_reset_part():
    out = run(
        UIMessageWriter("s1", "m1"),
        delta("WRONG START "),
        reset(2),
        delta("right ", 2),
        delta("answer", 2),
        end("right answer", attempt=2),
    )
    kinds = [c["type"] for c in out]
    assert kinds.count("data-reset") == 1
    assert kinds.index("text-end") < kinds.index("data-reset") < kinds.index("text-start", 2)
    assert shown(out) == "right answer"


def test_a_committed_reply_other_than_the_streamed_text_replaces_it():
    out = run(UIMessageWriter("s1", "m1"), delta("draft "), end("final answer"))
    assert shown(out) == "final answer"
    shorter = run(UIMessageWriter("s1", "m1"), delta("one two"), end("one"))
    assert shown(shorter) == "one" and any(c["type"] == "data-reset" for c in shorter)


def test_typed_events_are_data_parts_and_a_new_attempt_repeating_them_adds_none():
    out = run(
        UIMessageWriter("s1", "m1"),
        typed("tool", {"status": "running"}),
        reset(2),
        typed("tool", {"status": "running"}, 2),
        typed("tool", {"status": "done"}, 2),
        typed("bad kind!", {"x": 1}, 2),
    )
    assert out == [
        {"type": "data-tool", "data": {"status": "running"}},
        {"type": "data-tool", "data": {"status": "done"}},
    ]


def test_waiting_is_a_transient_data_part():
    out = run(UIMessageWriter("s1", "m1"), StreamEvent("waiting", "m1", 1, "", None, data=None))
    waiting = {"reason": "rate", "until_ms": 5}
    out += run(UIMessageWriter("s1", "m1"), typed("waiting", waiting))
    assert out == [
        {"type": "data-waiting", "data": {}, "transient": True},
        {"type": "data-waiting", "data": waiting, "transient": True},
    ]


def test_a_question_is_a_tool_call_waiting_for_approval_and_ends_the_stream():
    w = UIMessageWriter("s1", "m1")
    asked = typed("awaiting", {"interrupt_id": "m1:1:1", "payload": {"approve": "refund"}})
    chunks, last = w.feed(asked)
    assert last
    assert chunks[:2] == [
        {
            "type": "tool-input-available",
            "toolCallId": "m1:1:1",
            "toolName": "interrupt",
            "input": {"approve": "refund"},
            "dynamic": True,
        },
        {"type": "tool-approval-request", "toolCallId": "m1:1:1", "approvalId": "m1:1:1"},
    ]
    assert chunks[-1]["finishReason"] == "tool-calls"


def test_the_answer_after_a_question_goes_on_from_what_the_client_shows():
    """The client shows the first run up to its question and answered it: the run after the
    answer repeats the same text and events, which are not sent again."""
    w = UIMessageWriter("s1", "m1", silent_until="m1:1:1", answer=True)
    asked = typed("awaiting", {"interrupt_id": "m1:1:1", "payload": {}})
    out = run(
        w,
        delta("Let me check. "),
        typed("tool", {"status": "asking"}),
        asked,
        reset(2),
        delta("Let me check. ", 2),
        typed("tool", {"status": "asking"}, 2),
        typed("tool", {"status": "done"}, 2),
        delta("Refunded.", 2),
        end("Let me check. Refunded.", attempt=2),
    )
    assert out[0] == {"type": "tool-output-available", "toolCallId": "m1:1:1", "output": True}
    assert {"type": "data-tool", "data": {"status": "asking"}} not in out
    assert [c["delta"] for c in out if c["type"] == "text-delta"] == ["Refunded."]
    # The earlier text part ended with the earlier stream: the rest is in a new one.
    assert next(c for c in out if c["type"] == "text-start") == {
        "type": "text-start",
        "id": "text-2",
    }


def test_a_cancelled_answer_aborts_and_an_unanswered_question_errors():
    out = run(UIMessageWriter("s1", "m1"), delta("half"), end("half", "cancelled"))
    assert [c["type"] for c in out][-3:] == ["finish-step", "abort", "finish"]
    assert out[-1]["messageMetadata"] == {"outcome": "cancelled"}
    w = UIMessageWriter("s1", "m1", silent_until="q")
    run(w, typed("awaiting", {"interrupt_id": "q", "payload": {}}))
    ended = run(w, end("", "cancelled"))
    assert {"type": "tool-output-error", "toolCallId": "q", "errorText": "cancelled"} in ended


def test_assistant_ids_map_back_to_the_msg_id():
    assert message_id("a:b") == "reply-a:b"
    assert answered_msg_id("reply-a:b") == "a:b"
    assert answered_msg_id("m1") is None
