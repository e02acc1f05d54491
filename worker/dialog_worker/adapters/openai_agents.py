"""`from_openai_agent`: an OpenAI Agents SDK agent as a dialog engine (docs/engine.md,
"Agent frameworks"). The SDK is imported when the function is called, not with this module."""

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

# The Agents SDK's own default for the model/tool loop of one run.
DEFAULT_AGENT_TURNS = 10


def from_openai_agent(
    agent: Any,
    *,
    limit_key: str | None = None,
    model_provider: Any = None,
    run_config: Any = None,
    context: Any = None,
    max_agent_turns: int = DEFAULT_AGENT_TURNS,
    memory_turns: int | None = DEFAULT_MAX_TURNS,
    memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
    interrupt_timeout_s: float | None = None,
) -> Engine:
    """An engine that answers each message with a run of ``agent`` (an ``agents.Agent``).

    - **Memory**: the conversation (the SDK's session items) lives in the session's state,
      under ``memory["openai_agents"]["items"]``, committed with the reply: the last
      ``memory_turns`` turns, at most ``memory_bytes`` of JSON (oldest turns dropped first,
      the latest always kept; None: no bound).
    - **Streaming**: the answer's text reaches ``emit``; each tool call sends ``tool``
      events (``{"name", "call_id", "state": "running"|"done"}``); a cancelled message
      stops the run.
    - **Tools run once**: every function tool call goes through the step journal keyed by
      its call id, and every model answer is journaled, so a re-run (a crash, a retry, the
      run after an approval) gets the recorded results instead of calling again.
    - **Approvals**: a tool with ``needs_approval`` becomes an ``interrupt`` whose payload is
      ``{"kind": "tool_approval", "question", "tool", "arguments", "call_id"}``; resuming
      with ``true`` approves the call, anything else (or no answer within
      ``interrupt_timeout_s``) rejects it.
    - **Limits**: each model call goes through ``model_call(limit_key)`` (default
      ``llm:<model name>``) with an estimate of the prompt plus ``answer_tokens``, reports
      its usage, and a provider's 429 becomes ``RateLimited`` (give the OpenAI client
      ``max_retries=0`` so the 429 reaches the worker at once).

    Agents it hands off to (listed as agents in ``handoffs``) are adapted the same way; a
    model given by name is resolved with ``model_provider`` (default the SDK's). Needs
    ``pip install 'dialog-worker[openai-agents]'``.
    """
    checked = options(limit_key, memory_turns, memory_bytes, answer_tokens, interrupt_timeout_s)
    try:
        from dialog_worker.adapters._openai_agents_impl import AgentEngine
    except ImportError as exc:
        raise missing_extra("openai-agents", "openai-agents") from exc
    return AgentEngine(agent, checked, model_provider, run_config, context, max_agent_turns)
