"""How a session's state reads as the LangGraph protocol's values, and which run inputs are
one user message: pure functions, with state that is not well-formed (read from Redis, never
trusted)."""

from __future__ import annotations

from typing import Any

import pytest

from dialog_worker.errors import ValidationError
from dialog_worker.gateway.langgraph_run_routes import user_message
from dialog_worker.gateway.langgraph_runs import ai_message_id, run_error, thread_values


def test_turns_become_human_and_ai_messages_and_memory_is_for_the_server_only():
    state = {
        "step": "AWAITING_QUERY",
        "memory": {"userName": "Budi"},
        "history": [
            {"seq": 1, "msg_id": "m1", "user": "nama saya Budi", "bot": "Halo Budi"},
            {"seq": 2, "msg_id": "t1", "user": None, "bot": "still there?"},  # a timer's
            {"seq": 3, "msg_id": "m3", "user": "stop", "bot": "half", "cancelled": True},
            {"seq": 4, "msg_id": "m4", "user": "ok", "bot": "", "no_reply": True},
            {
                "seq": 5,
                "msg_id": "m5",
                "user": "menu",
                "bot": "Pick",
                "bubbles": [{"text": "Pick"}],
            },
        ],
    }
    values = thread_values(state, memory=True)
    shown = [(m["type"], m["content"], m["id"], m["response_metadata"]) for m in values["messages"]]
    assert shown == [
        ("human", "nama saya Budi", "m1", {}),
        ("ai", "Halo Budi", ai_message_id("m1"), {}),
        ("ai", "still there?", ai_message_id("t1"), {}),
        ("human", "stop", "m3", {}),
        ("ai", "half", ai_message_id("m3"), {"outcome": "cancelled"}),
        ("human", "ok", "m4", {}),
        ("human", "menu", "m5", {}),
        ("ai", "Pick", ai_message_id("m5"), {"bubbles": [{"text": "Pick"}]}),
    ]
    assert values["step"] == "AWAITING_QUERY" and values["memory"] == {"userName": "Budi"}
    assert "memory" not in thread_values(state, memory=False)


@pytest.mark.parametrize(
    "state",
    [None, [], {"history": "x"}, {"history": [1, None, {"msg_id": 5}, {"user": "x"}]}, {"step": 3}],
)
def test_a_state_that_is_not_well_formed_reads_as_what_can_be_read(state: Any):
    values = thread_values(state, memory=False)
    assert values == {"messages": [], "step": "ROOT"}


def test_an_ai_message_keeps_its_id_for_a_first_attempt_only():
    assert ai_message_id("m1") == ai_message_id("m1", 1, 0) == "run-m1"
    assert len({ai_message_id("m1", 2, 0), ai_message_id("m1", 1, 1), "run-m1"}) == 3


def test_outcomes_that_are_errors_say_so():
    assert run_error("applied") is None and run_error("cancelled") is None
    assert run_error("rejected") == {
        "error": "Rejected",
        "message": "the thread was busy and the run's multitask_strategy is reject",
    }
    assert run_error("something new")["error"] == "Failed"  # type: ignore[index]


@pytest.mark.parametrize(
    ("run_input", "expected"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, ("hi", None)),
        ({"messages": [{"type": "human", "content": "hi", "id": "u1"}]}, ("hi", "u1")),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ]
            },
            ("ab", None),
        ),
        ({"messages": ["hi"]}, ("hi", None)),
        ({"messages": [["user", "hi"]]}, ("hi", None)),
        ({"messages": {"role": "human", "content": "hi"}}, ("hi", None)),
    ],
)
def test_one_user_message_in_its_usual_forms(run_input: dict[str, Any], expected: Any):
    assert user_message(run_input) == expected


@pytest.mark.parametrize(
    ("run_input", "reason"),
    [
        ({"text": "hi"}, "messages only"),
        ({"messages": []}, "one user message"),
        ({"messages": ["a", "b"]}, "one user message"),
        ({"messages": [{"role": "ai", "content": "x"}]}, "user message"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text"),
        ({"messages": [{"role": "user", "content": 5}]}, "text"),
        ({"messages": [{"role": "user", "content": "x", "id": "a\nb"}]}, "control"),
        ({"messages": [5]}, "a message"),
    ],
)
def test_anything_else_is_refused_with_its_reason(run_input: dict[str, Any], reason: str):
    with pytest.raises(ValidationError, match=reason):
        user_message(run_input)
