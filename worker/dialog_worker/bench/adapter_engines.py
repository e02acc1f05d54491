"""The engines of `dialog-worker bench --mode adapters`: one support agent with one tool
(``lookup_order``), written by hand against the engine API and with each framework, all making
the same calls to the fake provider (fake_provider.py) for a message that names the tool: a
model call that asks for the tool, the tool, a model call that answers; each model answer and
the tool's result through the journal, each model call through ``model_call``, the text
streamed. DIALOG_ENGINE=dialog_worker.bench.adapter_engines:<name>, configured by the
environment the bench gives its workers: BENCH_PROVIDER_URL, BENCH_MODEL, and BENCH_TRIM
(``0``: the adapters keep the whole conversation; default: their default bounds).

The frameworks are imported by each factory, so this module loads without them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dialog_worker.adapters._common import DEFAULT_MAX_MEMORY_BYTES, DEFAULT_MAX_TURNS
from dialog_worker.engine.emit import emit, emit_event
from dialog_worker.engine.journal import once
from dialog_worker.engine.model_calls import model_call
from dialog_worker.engine.protocol import Engine

INSTRUCTIONS = "You are a shop's support assistant. Use the tools to look orders up."
ORDERS = {"A-17": "headphones, 80 EUR"}
# A prompt of the bench: the fake provider calls the tool it names, then answers.
PROMPT = "please lookup_order A-17"


def lookup_order(order_id: str) -> str:
    """What the order holds and what was paid."""
    return f"order {order_id}: {ORDERS.get(order_id, 'unknown')}"


def _settings() -> tuple[str, str]:
    return (
        os.environ.get("BENCH_PROVIDER_URL", "http://127.0.0.1:8400") + "/v1",
        os.environ.get("BENCH_MODEL", "fake-1"),
    )


def _bounds() -> dict[str, Any]:
    if os.environ.get("BENCH_TRIM", "1") == "0":
        return {"memory_turns": None, "memory_bytes": None}
    return {"memory_turns": DEFAULT_MAX_TURNS, "memory_bytes": DEFAULT_MAX_MEMORY_BYTES}


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "What the order holds and what was paid.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
    },
}


class HandWritten:
    """The same agent against the engine API alone: the OpenAI client, a loop of model calls
    and tool calls, the last DEFAULT_MAX_TURNS turns kept in the memory."""

    def __init__(self) -> None:
        from openai import AsyncOpenAI

        base_url, self.model = _settings()
        self.client = AsyncOpenAI(base_url=base_url, api_key="fake", max_retries=0)

    async def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        memory = state["memory"] if isinstance(state["memory"], dict) else {}
        turns: list[list[dict[str, Any]]] = list(memory.get("turns", []))
        turn: list[dict[str, Any]] = [{"role": "user", "content": message["text"]}]
        for n in range(1, 6):
            history = [m for t in turns for m in t]
            answer = await once(f"model:{n}", self._call, history + turn)
            turn.append(answer)
            if not answer.get("tool_calls"):
                break
            for call in answer["tool_calls"]:
                emit_event("tool", {"name": "lookup_order", "call_id": call["id"]})
                arguments = json.loads(call["function"]["arguments"])
                result = await once(f"tool:{call['id']}", lookup_order, arguments["order_id"])
                turn.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        turns = [*turns, turn][-DEFAULT_MAX_TURNS:]
        return {**state, "step": "AGENT", "memory": {"turns": turns}}, turn[-1]["content"] or ""

    async def _call(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        conversation = [{"role": "system", "content": INSTRUCTIONS}, *messages]
        estimate = len(json.dumps(conversation)) // 4 + 1024
        async with model_call(f"llm:{self.model}", tokens=estimate) as call:
            stream = await self.client.chat.completions.create(
                model=self.model,
                messages=conversation,
                tools=[TOOL_SCHEMA],
                stream=True,
                stream_options={"include_usage": True},
            )
            text = ""
            calls: dict[int, dict[str, Any]] = {}  # the answer's tool calls, by index
            async for chunk in stream:
                if chunk.usage is not None:
                    call.usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                for choice in chunk.choices:
                    if choice.delta.content:
                        emit(choice.delta.content)
                        text += choice.delta.content
                    for part in choice.delta.tool_calls or []:
                        _add_piece(calls, part)
        answer: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            answer["tool_calls"] = [calls[i] for i in sorted(calls)]
        return answer


def _add_piece(calls: dict[int, dict[str, Any]], part: Any) -> None:
    """A streamed piece of a tool call (its id and name come first, its arguments in pieces)."""
    entry = calls.setdefault(
        part.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
    )
    entry["id"] = part.id or entry["id"]
    if part.function is not None:
        entry["function"]["name"] += part.function.name or ""
        entry["function"]["arguments"] += part.function.arguments or ""


def hand_written() -> Engine:
    return HandWritten()


def openai_agents() -> Engine:
    from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    from dialog_worker.adapters import from_openai_agent

    set_tracing_disabled(True)
    base_url, model = _settings()
    client = AsyncOpenAI(base_url=base_url, api_key="fake", max_retries=0)
    agent = Agent(
        name="support",
        instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        tools=[function_tool(lookup_order)],
    )
    return from_openai_agent(agent, **_bounds())


def pydantic_ai() -> Engine:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from dialog_worker.adapters import from_pydantic_ai

    base_url, model = _settings()
    client = AsyncOpenAI(base_url=base_url, api_key="fake", max_retries=0)
    agent = Agent(
        OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client)),
        instructions=INSTRUCTIONS,
        tools=[Tool(lookup_order)],
    )
    return from_pydantic_ai(agent, **_bounds())


def langgraph() -> Engine:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from dialog_worker.adapters import from_langgraph

    base_url, model_name = _settings()
    tools = [tool(lookup_order)]
    model = ChatOpenAI(
        model=model_name, base_url=base_url, api_key="fake", max_retries=0, stream_usage=True
    ).bind_tools(tools)

    async def assistant(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke([("system", INSTRUCTIONS), *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("assistant", assistant)
    builder.add_node("tools", ToolNode(tools))
    builder.add_edge(START, "assistant")
    builder.add_conditional_edges("assistant", tools_condition)
    builder.add_edge("tools", "assistant")
    return from_langgraph(builder.compile(), **_bounds())


# engine name -> (the package it needs, its factory's name)
ENGINES = {
    "hand-written": ("openai", "hand_written"),
    "openai-agents": ("agents", "openai_agents"),
    "pydantic-ai": ("pydantic_ai", "pydantic_ai"),
    "langgraph": ("langgraph", "langgraph"),
}
