"""The fake provider's tool calls (dialog_worker/bench/fake_provider.py): every offered tool the
user's last message names, in the order named, with arguments read from the text; none once the
tools answered, and none when no tools are offered."""

from __future__ import annotations

import json
from typing import Any

from dialog_worker.bench.fake_provider import tool_calls


def tool(name: str, **properties: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {p: {"type": t} for p, t in properties.items()},
        "required": list(properties),
    }
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    tool("lookup_order", order_id="string"),
    tool("refund", order_id="string", amount="integer"),
]


def body(text: str, tools: list[dict[str, Any]] | None = TOOLS) -> dict[str, Any]:
    doc: dict[str, Any] = {"messages": [{"role": "user", "content": text}]}
    if tools is not None:
        doc["tools"] = tools
    return doc


def test_each_tool_the_user_names_is_called_in_order_with_arguments_from_the_text() -> None:
    calls = tool_calls(body("refund B-2 9 and lookup_order A-17 please"))
    assert [c["function"]["name"] for c in calls] == ["refund", "lookup_order"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"order_id": "B-2", "amount": 9}
    assert json.loads(calls[1]["function"]["arguments"]) == {"order_id": "A-17"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != tool_calls(body("refund B-2 9"))[0]["id"]  # fresh ids, as OpenAI's


def test_name_value_pairs_win_over_the_words_that_follow() -> None:
    [call] = tool_calls(body("refund amount=5 order_id=C-3"))
    assert json.loads(call["function"]["arguments"]) == {"order_id": "C-3", "amount": 5}


def test_no_call_without_tools_without_a_name_or_after_the_tools_answered() -> None:
    assert tool_calls(body("lookup_order A-17", tools=None)) == []
    assert tool_calls(body("what about my order?")) == []
    answered = body("lookup_order A-17")
    answered["messages"].append({"role": "tool", "tool_call_id": "x", "content": "80 EUR"})
    assert tool_calls(answered) == []


def test_text_in_content_parts_is_read_too() -> None:
    parts = body("")
    parts["messages"][0]["content"] = [{"type": "text", "text": "lookup_order A-17"}]
    assert [c["function"]["name"] for c in tool_calls(parts)] == ["lookup_order"]
