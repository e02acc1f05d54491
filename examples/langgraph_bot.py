"""A LangGraph graph as a dialog engine (docs/engine.md, "Agent frameworks").

    pip install 'dialog-worker[langgraph]'
    python -m dialog_worker.bench.fake_provider --port 8400 &      # or a real provider
    PYTHONPATH=examples DIALOG_ENGINE=langgraph_bot:engine dialog-worker run &
    dialog-worker ask u1 "please lookup_order A-17"
    dialog-worker ask u1 "refund A-17"          # outcome "awaiting": the graph's interrupt()
    dialog-worker resume u1 INTERRUPT_ID true   # Command(resume=True): the refund is made, once

The graph is plain LangGraph code (a model node and a ToolNode in a loop); the last line makes
it an engine. ``LLM_BASE_URL``, ``LLM_API_KEY`` and ``LLM_MODEL`` choose the model (default:
the fake provider).
"""

from __future__ import annotations

from typing import Any

import shop
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import interrupt

from dialog_worker.adapters import from_langgraph


@tool
def refund(order_id: str) -> str:
    """Refund the order, once a person approved it."""
    approved = interrupt({"question": f"Refund order {order_id}?", "choices": [True, False]})
    if approved is not True:
        return "the refund was declined"
    return shop.refund(order_id)


tools = [tool(shop.lookup_order), tool(shop.open_ticket), refund]
base_url, api_key, model_name = shop.settings()
# max_retries=0: a 429 reaches the worker at once, which pauses the limit key for everyone.
model = ChatOpenAI(
    model=model_name, base_url=base_url, api_key=api_key, max_retries=0, stream_usage=True
).bind_tools(tools)


async def assistant(state: MessagesState) -> dict[str, Any]:
    return {"messages": [await model.ainvoke([("system", shop.INSTRUCTIONS), *state["messages"]])]}


builder = StateGraph(MessagesState)
builder.add_node("assistant", assistant)
builder.add_node("tools", ToolNode(tools))
builder.add_edge(START, "assistant")
builder.add_conditional_edges("assistant", tools_condition)
builder.add_edge("tools", "assistant")
graph = builder.compile()

engine = from_langgraph(graph, limit_key=f"llm:{model_name}")
