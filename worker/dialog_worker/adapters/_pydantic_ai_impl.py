"""The Pydantic AI adapter's working parts (imported by `from_pydantic_ai` only, so that
importing dialog_worker.adapters imports no framework).

Everything goes through one capability, Pydantic AI's own extension point, added to each run:

- ``wrap_model_request``: each model request waits for the limit key's turn (`model_call`),
  reports its usage, turns a 429 into `RateLimited`, and its answer is journaled
  (``model:<n>``) before the run sees it; a re-run gets the recorded answer without calling
  (Pydantic AI then replays its events, so the text still reaches the readers);
- ``wrap_tool_execute``: each tool call through ``once``, keyed by its call id;
- ``handle_deferred_tool_calls``: a tool that requires approval becomes our `interrupt`;
- ``on_event``: text parts and deltas reach ``emit``.

The conversation is the run's message history, kept in the session's state; a history
processor (`ProcessHistory`) trims it to whole turns before each model request, and the same
trim bounds what is committed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai import messages as ai_messages
from pydantic_ai.capabilities import AbstractCapability, ProcessHistory
from pydantic_ai.tools import DeferredToolResults, ToolDenied

from dialog_worker.adapters._common import (
    Options,
    approval_question,
    call_name,
    estimate_tokens,
    json_size,
    memory_of,
    raise_for_worker,
    record,
    replayed,
    reply_text,
    stoppable,
    trim_turns,
    with_memory,
)
from dialog_worker.engine.emit import emit, emit_event
from dialog_worker.engine.interrupts import interrupt
from dialog_worker.engine.journal import once
from dialog_worker.engine.model_calls import model_call
from dialog_worker.errors import InterruptTimeout

# Where the conversation lives in the state's memory.
MEMORY_KEY = "pydantic_ai"

_HISTORY = ai_messages.ModelMessagesTypeAdapter
_ANY: TypeAdapter[Any] = TypeAdapter(Any)


def _starts_turn(message: Any) -> bool:
    """A request that carries the user's prompt starts a turn (tool returns do not)."""
    return isinstance(message, ai_messages.ModelRequest) and any(
        isinstance(part, ai_messages.UserPromptPart) for part in message.parts
    )


def _history_size(messages: Sequence[Any]) -> int:
    return json_size(_HISTORY.dump_python(list(messages), mode="json"))


def trimmed(messages: Sequence[Any], options: Options) -> list[Any]:
    return trim_turns(
        messages, _starts_turn, options.memory_turns, options.memory_bytes, _history_size
    )


class DialogCapability(AbstractCapability[Any]):
    """One step's capability: journal, limits, approvals and streaming (see the module)."""

    def __init__(self, options: Options) -> None:
        super().__init__()
        self.options = options
        self._calls = itertools.count(1)
        # The limit key of the latest model request: a streamed request's 429 is raised in the
        # run (not in wrap_model_request), and the step makes it `RateLimited` on this key.
        self.key: str | None = None

    async def wrap_model_request(self, ctx: Any, *, request_context: Any, handler: Any) -> Any:
        name = f"model:{next(self._calls)}"
        recorded = await replayed(name)
        if recorded is None:
            response = await self._call(request_context, handler)
            recorded = await record(name, _HISTORY.dump_python([response], mode="json"))
        return _HISTORY.validate_python(recorded)[0]

    async def _call(self, request_context: Any, handler: Any) -> Any:
        model = request_context.model
        model_name = str(getattr(model, "model_name", None) or type(model).__name__)
        key = self.key = self.options.key_for(model_name)
        settings = request_context.model_settings or {}
        answer = settings.get("max_tokens") or self.options.answer_tokens
        prompt = _HISTORY.dump_python(list(request_context.messages), mode="json")
        async with model_call(key, tokens=estimate_tokens(prompt, int(answer))) as call:
            try:
                response = await handler(request_context)
            except Exception as exc:
                raise_for_worker(exc, key)
                raise
            call.usage(response.usage.input_tokens, response.usage.output_tokens, model=model_name)
        return response

    async def wrap_tool_execute(
        self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any
    ) -> Any:
        event = {"name": call.tool_name, "call_id": call.tool_call_id}
        emit_event("tool", {**event, "state": "running"})

        async def run() -> Any:
            return _ANY.dump_python(await handler(args), mode="json")

        result = await once(call_name(call.tool_call_id), run)
        emit_event("tool", {**event, "state": "done"})
        return result

    async def handle_deferred_tool_calls(self, ctx: Any, *, requests: Any) -> Any:
        if not requests.approvals:
            return None
        approvals: dict[str, Any] = {}
        for call in requests.approvals:
            payload = {
                "kind": "tool_approval",
                "question": approval_question(call.tool_name, call.args_as_dict()),
                "tool": call.tool_name,
                "arguments": call.args_as_dict(),
                "call_id": call.tool_call_id,
            }
            try:
                value = await interrupt(payload, timeout_s=self.options.interrupt_timeout_s)
            except InterruptTimeout:
                value = None
            approvals[call.tool_call_id] = (
                True if value is True else ToolDenied("The person did not approve this call.")
            )
        return DeferredToolResults(approvals=approvals)

    async def on_event(self, ctx: Any, *, event: Any) -> None:
        if isinstance(event, ai_messages.PartStartEvent):
            if isinstance(event.part, ai_messages.TextPart):
                emit(event.part.content)
        elif isinstance(event, ai_messages.PartDeltaEvent):
            if isinstance(event.delta, ai_messages.TextPartDelta):
                emit(event.delta.content_delta)


class PydanticAIEngine:
    """A Pydantic AI agent as a dialog engine (see `dialog_worker.adapters.from_pydantic_ai`)."""

    def __init__(self, agent: Any, options: Options, deps: Any) -> None:
        self.agent = agent
        self.options = options
        self.deps = deps

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        kept = memory_of(state, MEMORY_KEY)
        raw = kept.get("messages") if isinstance(kept, dict) else None
        history = _HISTORY.validate_python(raw) if isinstance(raw, list) else []
        options = self.options
        capability = DialogCapability(options)
        try:
            result = await stoppable(
                self.agent.run(
                    message["text"],
                    message_history=history,
                    deps=self.deps,
                    # The same ids in every run of the message: the journaled answers carry them.
                    run_id=f"{message['msg_id']}:{message['seq']}",
                    conversation_id=state["session_id"],
                    capabilities=[
                        capability,
                        ProcessHistory(lambda messages: trimmed(messages, options)),
                    ],
                )
            )
        except BaseException as exc:
            raise_for_worker(exc, capability.key)
            raise
        messages = trimmed(result.all_messages(), options)
        stored = {"messages": _HISTORY.dump_python(messages, mode="json")}
        return with_memory(state, MEMORY_KEY, stored), reply_text(result.output)
