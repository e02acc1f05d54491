"""Engines for the adapter tests (tests/examples/test_agent_adapters.py), loaded by worker
processes with DIALOG_ENGINE=adapter_engines:<name>.

``two_tools``: a LangGraph graph whose ToolNode runs two tools of one model answer (the user
names both: "first A second B"). Each appends ``<tool> <arg>`` to the file ``SHOP_LEDGER``
names; ``second`` then waits while the file ``HOLD`` names exists, so a test can kill the
worker after ``first`` was recorded and before the node (and so its checkpoint) finished.
"""

from __future__ import annotations

import os
import time
from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from dialog_worker.adapters import from_langgraph


def _ledger(line: str) -> None:
    with open(os.environ["SHOP_LEDGER"], "a", encoding="utf-8") as f:
        f.write(line + "\n")


@tool
def first(x: str) -> str:
    """The first tool."""
    _ledger(f"first {x}")
    return f"first {x} done"


@tool
def second(x: str) -> str:
    """The second tool: held while the HOLD file exists."""
    _ledger(f"second {x}")
    while os.path.exists(os.environ["HOLD"]):
        time.sleep(0.05)
    return f"second {x} done"


_tools = [first, second]
_model = ChatOpenAI(
    model=os.environ.get("LLM_MODEL", "fake-1"),
    base_url=os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8400/v1"),
    api_key="fake",
    max_retries=0,
).bind_tools(_tools)


async def _assistant(state: MessagesState) -> dict[str, Any]:
    return {"messages": [await _model.ainvoke(state["messages"])]}


_builder = StateGraph(MessagesState)
_builder.add_node("assistant", _assistant)
_builder.add_node("tools", ToolNode(_tools))
_builder.add_edge(START, "assistant")
_builder.add_conditional_edges("assistant", tools_condition)
_builder.add_edge("tools", "assistant")

two_tools = from_langgraph(_builder.compile())
