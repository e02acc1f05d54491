"""`from_langgraph`: a LangGraph graph as a dialog engine (docs/engine.md, "Agent
frameworks"). LangGraph is imported when the function is called, not with this module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dialog_worker.adapters._common import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_MAX_MEMORY_BYTES,
    DEFAULT_MAX_TURNS,
    missing_extra,
    options,
)
from dialog_worker.engine.protocol import Engine


def from_langgraph(
    graph: Any,
    *,
    limit_key: str | None = None,
    input: Callable[[dict[str, Any]], Any] | None = None,
    reply: Callable[[Any], Any] | None = None,
    config: dict[str, Any] | None = None,
    memory_turns: int | None = DEFAULT_MAX_TURNS,
    memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
    interrupt_timeout_s: float | None = None,
) -> Engine:
    """An engine that answers each message with a run of ``graph`` (a compiled LangGraph
    graph, or a ``StateGraph``, compiled here), one thread per session.

    - **Memory**: the thread's latest checkpoint (as LangGraph serializes it) lives in the
      session's state, under ``memory["langgraph"]``, committed with the reply. The thread's
      ``messages`` are trimmed with the graph's own ``RemoveMessage`` to the last
      ``memory_turns`` turns and at most ``memory_bytes`` of JSON (oldest turns dropped first,
      the latest always kept; None: no bound).
    - **Streaming**: the text of the chat models' tokens (stream mode ``messages``) reaches
      ``emit``; what a node writes with ``get_stream_writer()`` becomes a ``custom`` event;
      each tool call of a ``ToolNode`` sends ``tool`` events; a cancelled message stops the run.
    - **Durable**: every checkpoint and task write of the message goes to the step journal, so
      a re-run goes on from the last superstep (finished nodes do not run again), and each
      ``ToolNode`` tool call runs through the journal keyed by its call id (its ToolMessage
      recorded).
    - **Interrupts**: a graph's ``interrupt(value)`` becomes our ``interrupt`` with ``value``
      as payload; the value it is resumed with is the graph's ``Command(resume=...)``. With
      ``interrupt_timeout_s``, a wait with no answer by then raises ``InterruptTimeout`` (the
      message is dead-lettered).
    - **Limits**: every chat model call goes through ``model_call(limit_key)`` (default
      ``llm:<model name>``) by a LangChain callback, with an estimate of the prompt plus
      ``answer_tokens`` (or the call's ``max_tokens``), and reports its usage; a provider's 429
      becomes ``RateLimited`` (give the chat model ``max_retries=0``).

    ``input(message)`` makes the graph's input (default ``{"messages": [HumanMessage(text)]}``),
    ``reply(values)`` the reply from the thread's final values (default the last AI message's
    text); ``config`` is merged into every run's config. Needs
    ``pip install 'dialog-worker[langgraph]'``.
    """
    checked = options(limit_key, memory_turns, memory_bytes, answer_tokens, interrupt_timeout_s)
    try:
        from dialog_worker.adapters._langgraph_impl import GraphEngine
    except ImportError as exc:
        raise missing_extra("langgraph", "langgraph") from exc
    if hasattr(graph, "compile") and not hasattr(graph, "astream"):
        graph = graph.compile()
    return GraphEngine(graph, checked, input, reply, config)
