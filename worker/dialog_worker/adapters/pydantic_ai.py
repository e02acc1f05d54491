"""`from_pydantic_ai`: a Pydantic AI agent as a dialog engine (docs/engine.md, "Agent
frameworks"). Pydantic AI is imported when the function is called, not with this module."""

from __future__ import annotations

from typing import Any

from dialog_worker.adapters._common import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_MAX_MEMORY_BYTES,
    DEFAULT_MAX_TURNS,
    missing_extra,
    options,
)
from dialog_worker.engine.protocol import Engine


def from_pydantic_ai(
    agent: Any,
    *,
    limit_key: str | None = None,
    deps: Any = None,
    memory_turns: int | None = DEFAULT_MAX_TURNS,
    memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
    interrupt_timeout_s: float | None = None,
) -> Engine:
    """An engine that answers each message with a run of ``agent`` (a ``pydantic_ai.Agent``).

    - **Memory**: the run's message history lives in the session's state, under
      ``memory["pydantic_ai"]["messages"]`` (Pydantic AI's own JSON of its messages), committed
      with the reply; a history processor trims it to the last ``memory_turns`` turns and at
      most ``memory_bytes`` of JSON (oldest turns dropped first, the latest always kept;
      None: no bound), before each model request and at the commit.
    - **Streaming**: text parts reach ``emit``; each tool call sends ``tool`` events
      (``{"name", "call_id", "state": "running"|"done"}``); a cancelled message stops the run.
    - **Tools run once**: every tool call goes through the step journal keyed by its call id
      (its result recorded as JSON), and every model answer is journaled, so a re-run gets the
      recorded results instead of calling again.
    - **Approvals**: a tool with ``requires_approval=True`` (a deferred tool) becomes an
      ``interrupt`` whose payload is ``{"kind": "tool_approval", "question", "tool",
      "arguments", "call_id"}``; resuming with ``true`` approves the call, anything else (or
      no answer within ``interrupt_timeout_s``) denies it and the model is told so.
    - **Limits**: each model request goes through ``model_call(limit_key)`` (default
      ``llm:<model name>``) with an estimate of the prompt plus ``answer_tokens`` (or the
      settings' ``max_tokens``), reports its usage, and a provider's 429 becomes
      ``RateLimited`` (give the OpenAI client ``max_retries=0`` so the 429 reaches the worker
      at once).

    ``deps`` is passed to every run. Needs ``pip install 'dialog-worker[pydantic-ai]'``.
    """
    checked = options(limit_key, memory_turns, memory_bytes, answer_tokens, interrupt_timeout_s)
    try:
        from dialog_worker.adapters._pydantic_ai_impl import PydanticAIEngine
    except ImportError as exc:
        raise missing_extra("pydantic-ai", "pydantic-ai-slim") from exc
    return PydanticAIEngine(agent, checked, deps)
