"""The LangGraph adapter's working parts (imported by `from_langgraph` only, so that importing
dialog_worker.adapters imports no framework).

LangGraph's own durability does the journaling: a graph checkpoints its thread after every
superstep and saves each finished task's writes. `JournalSaver` is an in-memory checkpointer
of one step that also appends everything it stores to the step journal (``lg:<n>``, in
order). A re-run of the message (a crash, a retry, the run after a resume) loads the thread's
committed checkpoint, replays the journal into the saver and goes on from the last
checkpoint, as LangGraph resumes any thread: finished nodes do not run again. At the end the
thread's latest checkpoint (as LangGraph serializes it) is committed with the reply.

Inside a node, `journaled_tool_call` (installed on the graph's ``ToolNode``s) runs each tool
call through ``once`` keyed by its call id, so a node cut off between two tool calls does not
repeat the first; `ModelCalls`, a LangChain callback handler, puts every chat model call under
`model_call` and reports its usage. A graph's ``interrupt()`` becomes our `interrupt`, and its
answer the graph's ``Command(resume=...)``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    ToolMessage,
    message_to_dict,
    messages_from_dict,
)
from langgraph._internal._constants import RESUME
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import ToolNode
from langgraph.types import Command

from dialog_worker.adapters._common import (
    Options,
    call_name,
    estimate_tokens,
    json_size,
    memory_of,
    raise_for_worker,
    rate_limited,
    record,
    replayed,
    stoppable,
    trim_turns,
    with_memory,
)
from dialog_worker.engine.emit import emit, emit_event
from dialog_worker.engine.interrupts import interrupt
from dialog_worker.engine.journal import once
from dialog_worker.engine.model_calls import ModelCall, model_call
from dialog_worker.errors import PermanentError, ValidationError

# Where the thread's checkpoint lives in the state's memory.
MEMORY_KEY = "langgraph"
# Most rounds of (resume or go on) in one step: far more than a graph's interrupts.
MAX_ROUNDS = 1000


def _typed(value: tuple[str, bytes]) -> list[str]:
    return [value[0], base64.b64encode(value[1]).decode("ascii")]


def _untyped(value: list[str]) -> tuple[str, bytes]:
    return value[0], base64.b64decode(value[1])


class JournalSaver(InMemorySaver):
    """The thread of one step: its committed checkpoint, what the journal recorded of this
    message so far, and every new checkpoint and write, recorded in the journal in order."""

    def __init__(self, thread_id: str) -> None:
        super().__init__()
        self.thread_id = thread_id
        self.recorded = 0  # journal records of this message (``lg:1`` .. ``lg:<recorded>``)
        # Resume values the graph was given during this message, per task that got them.
        self._resumed: dict[tuple[str, str, str], int] = {}

    @property
    def resumes(self) -> int:
        """How many of the graph's interrupts were resumed during this message."""
        return sum(self._resumed.values())

    # --- what the session's state keeps ---

    def load(self, kept: Any) -> None:
        """The thread's committed checkpoint (`export`'s value), if any."""
        if not isinstance(kept, dict) or not isinstance(kept.get("id"), str):
            return
        try:
            self.storage[self.thread_id][""][kept["id"]] = (
                _untyped(kept["checkpoint"]),
                _untyped(kept["metadata"]),
                None,
            )
            for channel, version, kind, data in kept["blobs"]:
                self.blobs[(self.thread_id, "", channel, version)] = _untyped([kind, data])
        except (KeyError, TypeError, ValueError) as exc:
            raise PermanentError(
                f"the session's LangGraph checkpoint is unreadable: {exc}"
            ) from exc

    def export(self) -> dict[str, Any] | None:
        """The thread's latest checkpoint with the channel values it holds, as JSON."""
        saved = self.storage[self.thread_id][""]
        if not saved:
            return None
        latest = max(saved)
        checkpoint, metadata, _parent = saved[latest]
        versions = self.serde.loads_typed(checkpoint).get("channel_versions", {})
        blobs = [
            [channel, version, *_typed(self.blobs[(self.thread_id, "", channel, version)])]
            for channel, version in versions.items()
            if (self.thread_id, "", channel, version) in self.blobs
        ]
        return {
            "id": latest,
            "checkpoint": _typed(checkpoint),
            "metadata": _typed(metadata),
            "blobs": blobs,
        }

    # --- the journal ---

    async def replay(self) -> bool:
        """Apply what earlier runs of this message recorded; True if there was anything."""
        while (entry := await replayed(f"lg:{self.recorded + 1}")) is not None:
            self.recorded += 1
            self._apply(entry)
        return self.recorded > 0

    async def _record(self, entry: dict[str, Any]) -> None:
        self.recorded += 1
        await record(f"lg:{self.recorded}", entry)
        self._count_resumes(entry)

    def _apply(self, entry: dict[str, Any]) -> None:
        if "put" in entry:
            ns, cid, checkpoint, metadata, parent, blobs = entry["put"]
            self.storage[self.thread_id][ns][cid] = (
                _untyped(checkpoint),
                _untyped(metadata),
                parent,
            )
            for channel, version, kind, data in blobs:
                self.blobs[(self.thread_id, ns, channel, version)] = _untyped([kind, data])
        else:
            ns, cid, writes = entry["writes"]
            for task_id, idx, channel, kind, data, path in writes:
                self.writes[(self.thread_id, ns, cid)][(task_id, idx)] = (
                    task_id,
                    channel,
                    _untyped([kind, data]),
                    path,
                )
        self._count_resumes(entry)

    def _count_resumes(self, entry: dict[str, Any]) -> None:
        if "writes" not in entry:
            return
        ns, cid, writes = entry["writes"]
        for task_id, _idx, channel, kind, data, _path in writes:
            if channel == RESUME:
                value = self.serde.loads_typed(_untyped([kind, data]))
                self._resumed[(ns, cid, task_id)] = len(value) if isinstance(value, list) else 1

    async def aput(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        saved = self.put(config, checkpoint, metadata, new_versions)
        ns = config["configurable"].get("checkpoint_ns", "")
        cid = checkpoint["id"]
        stored, stored_metadata, parent = self.storage[self.thread_id][ns][cid]
        blobs = [
            [channel, version, *_typed(self.blobs[(self.thread_id, ns, channel, version)])]
            for channel, version in new_versions.items()
        ]
        await self._record(
            {"put": [ns, cid, _typed(stored), _typed(stored_metadata), parent, blobs]}
        )
        return saved

    async def aput_writes(
        self, config: Any, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        self.put_writes(config, writes, task_id, task_path)
        ns = config["configurable"].get("checkpoint_ns", "")
        cid = config["configurable"]["checkpoint_id"]
        entries = [
            [tid, idx, channel, *_typed(value), path]
            for (tid, idx), (_t, channel, value, path) in self.writes[
                (self.thread_id, ns, cid)
            ].items()
            if tid == task_id
        ]
        await self._record({"writes": [ns, cid, entries]})


# --- inside the nodes: model calls and tool calls ---


def _usage_of(response: Any) -> tuple[int, int]:
    """Input and output tokens of a LangChain ``LLMResult``."""
    for generations in getattr(response, "generations", None) or []:
        for generation in generations:
            used = getattr(getattr(generation, "message", None), "usage_metadata", None)
            if used:
                return int(used.get("input_tokens", 0)), int(used.get("output_tokens", 0))
    used = (getattr(response, "llm_output", None) or {}).get("token_usage") or {}
    return int(used.get("prompt_tokens", 0) or 0), int(used.get("completion_tokens", 0) or 0)


class ModelCalls(AsyncCallbackHandler):
    """Every chat model call of the graph under `model_call` (its limit key's turn, its
    usage reported; a 429 pauses the key). Run inline and raising: a wait for the key or a
    budget spent must leave the step."""

    raise_error = True
    run_inline = True

    def __init__(self, options: Options) -> None:
        self.options = options
        self.calls: dict[Any, tuple[ModelCall, str]] = {}
        # The limit key of the latest call: the step makes a 429 that leaves the graph
        # `RateLimited` on it.
        self.key: str | None = None

    async def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: Any, **kwargs: Any
    ) -> None:
        params = kwargs.get("invocation_params") or {}
        metadata = kwargs.get("metadata") or {}
        model_name = str(
            params.get("model")
            or params.get("model_name")
            or metadata.get("ls_model_name")
            or "model"
        )
        answer = params.get("max_tokens") or params.get("max_completion_tokens")
        prompt = [[getattr(m, "content", "") for m in batch] for batch in messages]
        self.key = self.options.key_for(model_name)
        call = model_call(
            self.key,
            tokens=estimate_tokens(prompt, int(answer or self.options.answer_tokens)),
        )
        self.calls[run_id] = (await call.begin(), model_name)

    async def on_llm_end(self, response: Any, *, run_id: Any, **kwargs: Any) -> None:
        call, model_name = self.calls.pop(run_id, (None, ""))
        if call is not None:
            call.usage(*_usage_of(response), model=model_name)
            await call.end()

    async def on_llm_error(self, error: BaseException, *, run_id: Any, **kwargs: Any) -> None:
        call, _model_name = self.calls.pop(run_id, (None, ""))
        if call is not None:
            await call.end(rate_limited(error, call.key) or error)


async def journaled_tool_call(request: Any, execute: Callable[[Any], Any]) -> Any:
    """A ``ToolNode`` tool-call wrapper: the call runs at most once per message, keyed by its
    id (its ``ToolMessage`` recorded), with ``tool`` events around it."""
    call = request.tool_call
    event = {"name": call.get("name"), "call_id": call.get("id")}
    emit_event("tool", {**event, "state": "running"})
    unrecorded: list[Any] = []

    async def run() -> dict[str, Any]:
        result = await execute(request)
        if isinstance(result, ToolMessage):
            return {"message": message_to_dict(result)}
        unrecorded.append(result)  # a Command: not JSON, so it is not journaled
        return {"message": None}

    recorded = await once(call_name(str(call.get("id") or "")), run)
    emit_event("tool", {**event, "state": "done"})
    if recorded["message"] is not None:
        return messages_from_dict([recorded["message"]])[0]
    return unrecorded[0] if unrecorded else await execute(request)


def install_tool_journal(graph: Any) -> None:
    """Wrap the tool calls of every ``ToolNode`` of ``graph`` (and its subgraphs) with
    `journaled_tool_call`, around a wrapper the node already has."""
    for node in getattr(graph, "nodes", {}).values():
        bound = getattr(node, "bound", None)
        if isinstance(bound, ToolNode):
            inner = bound._awrap_tool_call
            if inner is journaled_tool_call or getattr(inner, "journaled", False):
                continue
            if inner is None and bound._wrap_tool_call is None:
                bound._awrap_tool_call = journaled_tool_call
            elif inner is not None:
                bound._awrap_tool_call = _around(inner)
        elif hasattr(bound, "nodes") and bound is not graph:
            install_tool_journal(bound)


def _around(inner: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, execute: Callable[[Any], Any]) -> Any:
        async def call(request: Any) -> Any:
            return await inner(request, execute)

        return await journaled_tool_call(request, call)

    wrapper.journaled = True  # type: ignore[attr-defined]
    return wrapper


# --- the engine ---


def _text(content: Any) -> str:
    """A message's text: a string, or the text blocks of a list of blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            b.get("text", "") if isinstance(b, dict) else b if isinstance(b, str) else ""
            for b in content
        )
    return ""


def default_input(message: dict[str, Any]) -> Any:
    """The graph's input for a message: the user's text as a ``HumanMessage``."""
    return {"messages": [HumanMessage(content=message["text"], id=f"user:{message['msg_id']}")]}


def default_reply(values: Any) -> str:
    """The reply: the text of the last AI message in the thread's ``messages``."""
    messages = values.get("messages") if isinstance(values, dict) else None
    for m in reversed(messages or []):
        if isinstance(m, AIMessage):
            return _text(m.content)
    return ""


def _messages_size(messages: Sequence[Any]) -> int:
    return json_size([message_to_dict(m) for m in messages])


class GraphEngine:
    """A compiled LangGraph graph as a dialog engine (see
    `dialog_worker.adapters.from_langgraph`)."""

    def __init__(
        self,
        graph: Any,
        options: Options,
        make_input: Callable[[dict[str, Any]], Any] | None,
        make_reply: Callable[[Any], Any] | None,
        config: dict[str, Any] | None,
    ) -> None:
        install_tool_journal(graph)
        self.graph = graph
        self.options = options
        self.make_input = make_input or default_input
        self.make_reply = make_reply or default_reply
        self.config = config or {}

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], Any]:
        saver = JournalSaver(state["session_id"])
        saver.load(memory_of(state, MEMORY_KEY))
        graph = self.graph.copy(update={"checkpointer": saver})
        config = {
            **self.config,
            "configurable": {
                **self.config.get("configurable", {}),
                "thread_id": state["session_id"],
            },
            "callbacks": [*self.config.get("callbacks", []), ModelCalls(self.options)],
        }
        calls = config["callbacks"][-1]
        try:
            values = await stoppable(self._run(graph, saver, config, message))
        except BaseException as exc:
            raise_for_worker(exc, calls.key)
            raise
        return with_memory(state, MEMORY_KEY, saver.export()), self.make_reply(values)

    async def _run(
        self, graph: Any, saver: JournalSaver, config: dict[str, Any], message: dict[str, Any]
    ) -> Any:
        if not await saver.replay():
            await self._stream(graph, self.make_input(message), config)
        await self._finish(graph, saver, config)
        values = (await graph.aget_state(config)).values
        await self._trim(graph, values, config)
        return values

    async def _finish(self, graph: Any, saver: JournalSaver, config: dict[str, Any]) -> None:
        """Run the thread to its end: answer its interrupts (ours, in the order the graph
        asked them), go on where a crash left it."""
        asked = 0  # our interrupt() calls in this run of the step
        for _round in range(MAX_ROUNDS):
            snapshot = await graph.aget_state(config)
            if snapshot.interrupts:
                pending = snapshot.interrupts[0]
                # Our interrupts are numbered in the order they are called: the ones resumed
                # earlier in this message are asked again first (they answer at once).
                while asked < saver.resumes:
                    asked += 1
                    await interrupt(None, timeout_s=self.options.interrupt_timeout_s)
                asked += 1
                value = await interrupt(pending.value, timeout_s=self.options.interrupt_timeout_s)
                await self._stream(graph, Command(resume={pending.id: value}), config)
            elif snapshot.next:
                await self._stream(graph, None, config)
            else:
                return
        raise PermanentError(f"the graph did not finish in {MAX_ROUNDS} rounds")

    async def _stream(self, graph: Any, graph_input: Any, config: dict[str, Any]) -> None:
        async for mode, chunk in graph.astream(
            graph_input, config, stream_mode=["messages", "custom"], durability="sync"
        ):
            if mode == "messages":
                piece = chunk[0]
                if isinstance(piece, AIMessageChunk):
                    emit(_text(piece.content))
            else:
                try:
                    emit_event("custom", chunk)
                except ValidationError:
                    pass  # not JSON or too large for an event: the graph's own business

    async def _trim(self, graph: Any, values: Any, config: dict[str, Any]) -> None:
        """Drop the oldest turns of the thread's ``messages`` past the memory's bounds, with
        the graph's own ``RemoveMessage``."""
        messages = values.get("messages") if isinstance(values, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, BaseMessage) for m in messages):
            return
        kept = trim_turns(
            messages,
            lambda m: isinstance(m, HumanMessage),
            self.options.memory_turns,
            self.options.memory_bytes,
            _messages_size,
        )
        if len(kept) == len(messages):
            return
        kept_ids = {m.id for m in kept}
        removed = [RemoveMessage(id=m.id) for m in messages if m.id not in kept_ids]
        await graph.aupdate_state(config, {"messages": removed})
        values["messages"] = kept
