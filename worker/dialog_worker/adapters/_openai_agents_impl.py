"""The OpenAI Agents SDK adapter's working parts (imported by `from_openai_agent` only, so
that importing dialog_worker.adapters imports no framework).

- `JournaledModel` wraps each agent's model: every call waits for the limit key's turn
  (`model_call`), reports its usage, turns a 429 into `RateLimited`, streams its text to
  `emit`, and records its answer in the journal before the run sees it (``model:<n>``), so a
  re-run gets the same answer and the same tool-call ids.
- `journaled_tool` wraps each function tool: ``once`` keyed by the call's id, with ``tool``
  events around it.
- `StateSession` is the Agents SDK ``Session`` over the session's state: the run reads its
  items and adds the turn's; the engine commits them with the reply, whole turns only.
- `AgentEngine.step` runs the agent streamed; a tool that needs approval becomes our
  `interrupt`, and the run goes on from its ``RunState`` once a person answered.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from agents import Agent, FunctionTool, RunConfig, Runner
from agents.items import ModelResponse, TResponseOutputItem
from agents.models.interface import Model, ModelProvider
from agents.models.multi_provider import MultiProvider
from agents.usage import Usage
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseTextDeltaEvent,
)
from pydantic import TypeAdapter

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
MEMORY_KEY = "openai_agents"

_OUTPUT_ITEM: TypeAdapter[Any] = TypeAdapter(TResponseOutputItem)

# The model calls of the running step, numbered in the order the run makes them (the same
# order on every run of the message, since every earlier answer is replayed).
_calls: contextvars.ContextVar[itertools.count[int] | None] = contextvars.ContextVar(
    "dialog_worker_agents_calls", default=None
)


def _next_call() -> int:
    counter = _calls.get()
    return next(counter) if counter is not None else 0


def _texts(output: list[Any]) -> str:
    """The text of an answer's output messages."""
    parts: list[str] = []
    for item in output:
        if isinstance(item, ResponseOutputMessage):
            parts.extend(getattr(c, "text", "") or "" for c in item.content)
    return "".join(parts)


class JournaledModel(Model):
    """An agent's model, with its calls under our limits and its answers journaled."""

    def __init__(self, inner: Model, options: Options) -> None:
        self.inner = inner
        self.options = options
        self.model_name = str(getattr(inner, "model", None) or type(inner).__name__)
        self.key = options.key_for(self.model_name)

    def get_retry_advice(self, request: Any) -> Any:
        return self.inner.get_retry_advice(request)

    async def close(self) -> None:
        await self.inner.close()

    def _estimate(self, system_instructions: str | None, input: Any, settings: Any) -> int:
        answer = getattr(settings, "max_tokens", None) or self.options.answer_tokens
        return estimate_tokens([system_instructions, input], int(answer))

    async def get_response(
        self,
        system_instructions: str | None,
        input: Any,
        model_settings: Any,
        *args: Any,
        **kwargs: Any,
    ) -> ModelResponse:
        name = f"model:{_next_call()}"
        recorded = await replayed(name)
        if recorded is None:
            estimate = self._estimate(system_instructions, input, model_settings)
            async with model_call(self.key, tokens=estimate) as call:
                try:
                    response = await self.inner.get_response(
                        system_instructions, input, model_settings, *args, **kwargs
                    )
                except Exception as exc:
                    raise_for_worker(exc, self.key)
                    raise
                call.usage(
                    response.usage.input_tokens, response.usage.output_tokens, model=self.model_name
                )
            recorded = await record(
                name,
                {
                    "output": [item.model_dump(mode="json") for item in response.output],
                    "usage": [response.usage.input_tokens, response.usage.output_tokens],
                    "response_id": response.response_id,
                },
            )
        output = [_OUTPUT_ITEM.validate_python(item) for item in recorded["output"]]
        emit(_texts(output))
        return ModelResponse(
            output=output,
            usage=Usage(
                requests=1,
                input_tokens=recorded["usage"][0],
                output_tokens=recorded["usage"][1],
                total_tokens=sum(recorded["usage"]),
            ),
            response_id=recorded["response_id"],
        )

    async def stream_response(
        self,
        system_instructions: str | None,
        input: Any,
        model_settings: Any,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        name = f"model:{_next_call()}"
        recorded = await replayed(name)
        if recorded is not None:
            response = Response.model_validate(recorded)
            emit(_texts(response.output))  # a replayed answer: its text at once
        else:
            completed = None
            async for event in self._live(system_instructions, input, model_settings, args, kwargs):
                if isinstance(event, ResponseCompletedEvent):
                    completed = event.response
                else:
                    yield event
            if completed is None:
                return  # the runner reports an answer without an end
            # Recorded before the run sees the answer: its tool calls run only once their ids
            # are in the journal, so a re-run calls them by the same ids.
            dump = completed.model_dump(mode="json")
            dump["tools"], dump["instructions"] = [], None  # the request's, not the answer's
            response = Response.model_validate(await record(name, dump))
        yield ResponseCompletedEvent(
            type="response.completed", response=response, sequence_number=0
        )

    async def _live(
        self,
        system_instructions: str | None,
        input: Any,
        model_settings: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AsyncIterator[Any]:
        """The inner model's stream, its text emitted; the completed answer (with the output
        items some streams leave out of it) comes last."""
        estimate = self._estimate(system_instructions, input, model_settings)
        done_items: list[Any] = []
        async with model_call(self.key, tokens=estimate) as call:
            try:
                async for event in self.inner.stream_response(
                    system_instructions, input, model_settings, *args, **kwargs
                ):
                    if isinstance(event, ResponseTextDeltaEvent):
                        emit(event.delta)
                    elif isinstance(event, ResponseOutputItemDoneEvent):
                        done_items.append(event.item)
                    elif isinstance(event, ResponseCompletedEvent):
                        if not event.response.output:
                            event.response.output = done_items
                        used = event.response.usage
                        call.usage(
                            used.input_tokens if used else 0,
                            used.output_tokens if used else 0,
                            model=self.model_name,
                        )
                    yield event
            except Exception as exc:
                raise_for_worker(exc, self.key)
                raise


def _tool_output(value: Any) -> Any:
    """A tool's output as JSON for the journal (the SDK shows the model its text anyway)."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def journaled_tool(tool: FunctionTool) -> FunctionTool:
    """``tool`` with each call run at most once per message (keyed by the call's id), and
    ``tool`` events (running, done) to the answer's readers."""
    invoke = tool.on_invoke_tool

    async def run(ctx: Any, arguments: str) -> Any:
        return _tool_output(await invoke(ctx, arguments))

    async def invoke_once(ctx: Any, arguments: str) -> Any:
        call_id = str(getattr(ctx, "tool_call_id", "") or "")
        event = {"name": tool.name, "call_id": call_id}
        emit_event("tool", {**event, "state": "running"})
        result = await once(call_name(call_id), run, ctx, arguments)
        emit_event("tool", {**event, "state": "done"})
        return result

    return dataclasses.replace(tool, on_invoke_tool=invoke_once)


def journaled_agents(agent: Agent[Any], provider: ModelProvider, options: Options) -> Agent[Any]:
    """A copy of ``agent`` and of every agent it hands off to (cycles kept), each with its
    model journaled and its function tools run once."""
    copies: dict[int, Agent[Any]] = {}
    todo = [agent]
    while todo:
        original = todo.pop()
        if id(original) in copies:
            continue
        model = original.model
        if not isinstance(model, Model):
            model = provider.get_model(model)
        tools = [journaled_tool(t) if isinstance(t, FunctionTool) else t for t in original.tools]
        copies[id(original)] = original.clone(model=JournaledModel(model, options), tools=tools)
        todo.extend(h for h in original.handoffs if isinstance(h, Agent))
    for copy in copies.values():
        copy.handoffs = [copies[id(h)] if isinstance(h, Agent) else h for h in copy.handoffs]
    return copies[id(agent)]


def _starts_turn(item: Any) -> bool:
    return isinstance(item, dict) and item.get("role") == "user"


class StateSession:
    """The Agents SDK ``Session`` of one step: the conversation read from the session's
    state; what the run adds is committed with the reply, trimmed to whole turns."""

    session_settings = None

    def __init__(self, session_id: str, items: list[Any], options: Options) -> None:
        self.session_id = session_id
        self.items = list(items)
        self.options = options

    async def get_items(self, limit: int | None = None) -> list[Any]:
        return list(self.items[-limit:] if limit else self.items)

    async def add_items(self, items: list[Any]) -> None:
        self.items.extend(items)

    async def pop_item(self) -> Any:
        return self.items.pop() if self.items else None

    async def clear_session(self) -> None:
        self.items = []

    def kept(self) -> list[Any]:
        """The items to commit: the last turns within the memory's bounds."""
        return trim_turns(
            self.items,
            _starts_turn,
            self.options.memory_turns,
            self.options.memory_bytes,
            json_size,
        )


class AgentEngine:
    """An Agents SDK agent as a dialog engine (see `dialog_worker.adapters.from_openai_agent`)."""

    def __init__(
        self,
        agent: Agent[Any],
        options: Options,
        model_provider: ModelProvider | None,
        run_config: RunConfig | None,
        context: Any,
        max_agent_turns: int,
    ) -> None:
        self.options = options
        self.run_config = run_config or RunConfig()
        if self.run_config.model_settings is None:
            from agents import ModelSettings

            # Usage of chat-completions streams comes only when asked for.
            self.run_config = dataclasses.replace(
                self.run_config, model_settings=ModelSettings(include_usage=True)
            )
        self.agent = journaled_agents(agent, model_provider or MultiProvider(), options)
        self.context = context
        self.max_agent_turns = max_agent_turns

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        kept = memory_of(state, MEMORY_KEY)
        items = kept.get("items") if isinstance(kept, dict) else None
        session = StateSession(
            state["session_id"], items if isinstance(items, list) else [], self.options
        )
        token = _calls.set(itertools.count(1))
        try:
            output = await stoppable(self._run(message["text"], session))
        except BaseException as exc:
            raise_for_worker(exc, None)
            raise
        finally:
            _calls.reset(token)
        return with_memory(state, MEMORY_KEY, {"items": session.kept()}), reply_text(output)

    async def _run(self, text: str, session: StateSession) -> Any:
        run_input: Any = text
        while True:
            result = Runner.run_streamed(
                self.agent,
                run_input,
                context=self.context,
                max_turns=self.max_agent_turns,
                run_config=self.run_config,
                session=session,
            )
            try:
                async for _event in result.stream_events():
                    pass  # the model and the tools emit what readers see
            finally:
                if not result.is_complete:
                    result.cancel()  # a cancelled step stops the agent's run
            if not result.interruptions:
                return result.final_output
            run_input = result.to_state()
            for item in result.interruptions:
                if await self._approved(item):
                    run_input.approve(item)
                else:
                    run_input.reject(item)

    async def _approved(self, item: Any) -> bool:
        """Ask a person (our `interrupt`): True approves the tool call; anything else, or no
        answer within ``interrupt_timeout_s``, rejects it."""
        raw = item.raw_item
        arguments: Any = getattr(raw, "arguments", None)
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        payload = {
            "kind": "tool_approval",
            "question": approval_question(item.tool_name or getattr(raw, "name", None), arguments),
            "tool": item.tool_name or getattr(raw, "name", None),
            "arguments": arguments,
            "call_id": getattr(raw, "call_id", None),
        }
        try:
            value = await interrupt(payload, timeout_s=self.options.interrupt_timeout_s)
        except InterruptTimeout:
            return False
        return value is True
