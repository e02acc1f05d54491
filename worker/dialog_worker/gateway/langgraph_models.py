"""The bodies of the LangGraph Agent Protocol subset (gateway/langgraph.py), as pydantic models:
they validate what a client sends (a refusal is a 400 naming the field, never a 422) and give
the OpenAPI document its schemas (gateway/openapi.py).

Field names and shapes are the protocol's (the LangGraph Platform API, as the ``langgraph-sdk``
and ``@langchain/langgraph-sdk`` clients send and read them). Fields a client may send that
this gateway does not act on are listed as such; those that would change what a run does and
that the gateway cannot honour (checkpoints, node breakpoints, webhooks) are refused by the
route, not silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The stream modes this gateway serves; any other is refused (400).
STREAM_MODES = ("values", "updates", "messages-tuple", "custom")

MultitaskStrategy = Literal["reject", "interrupt", "rollback", "enqueue"]
StreamModeName = Literal["values", "updates", "messages-tuple", "custom"]


class _Body(BaseModel):
    # A client newer than this gateway may send fields it does not know: they are ignored,
    # as the protocol's own servers ignore them.
    model_config = ConfigDict(extra="ignore")


class Command(_Body):
    """``{"resume": value}`` answers the thread's pending interrupt (`DialogClient.resume`);
    ``value`` may also be ``{interrupt_id: value}``. ``goto`` and ``update`` are refused."""

    resume: Any = None
    goto: Any = None
    update: Any = None


class RunCreate(_Body):
    """``POST /threads/{thread_id}/runs[/stream|/wait]``: a message to the thread's session
    (``input.messages``: one user message) or the answer to its interrupt (``command``)."""

    assistant_id: str = Field(description="the assistant's id or its graph_id")
    input: dict[str, Any] | None = Field(
        None,
        description='{"messages": [{"role": "user", "content": "..."}]}: one user message '
        "(its id, if given, becomes the run id: posting it again is not a second message)",
    )
    command: Command | None = None
    stream_mode: StreamModeName | list[StreamModeName] = "values"
    multitask_strategy: MultitaskStrategy | None = Field(
        None,
        description="what the run does if the thread is busy: reject, interrupt or enqueue "
        "(rollback is refused); absent: the deployment's DIALOG_MULTITASK",
    )
    metadata: dict[str, Any] | None = Field(
        None, description="string values only: they reach the engine as message fields (meta)"
    )
    after_seconds: float | None = Field(None, ge=0, description="deliver the message this late")
    on_disconnect: Literal["cancel", "continue"] | None = Field(
        None, description="cancel: a stream closed by the client before the end cancels the run"
    )
    if_not_exists: Literal["create", "reject"] | None = Field(
        None, description="threads always exist here (a thread is a session): accepted, no effect"
    )
    stream_subgraphs: bool | None = Field(None, description="accepted: there are no subgraphs")
    stream_resumable: bool | None = Field(None, description="accepted: every stream resumes")
    durability: str | None = Field(None, description="accepted: every commit is durable")
    config: dict[str, Any] | None = Field(None, description="accepted, not used")
    context: dict[str, Any] | None = Field(None, description="accepted, not used")
    checkpoint: dict[str, Any] | None = Field(None, description="refused when given")
    checkpoint_id: str | None = Field(None, description="refused when given")
    interrupt_before: Any = Field(None, description="refused when given")
    interrupt_after: Any = Field(None, description="refused when given")
    webhook: str | None = Field(None, description="refused when given")


class ThreadCreate(_Body):
    """``POST /threads``. A thread is a session: creating one keeps nothing, it names it."""

    thread_id: str | None = Field(None, description="the session id; a new uuid when absent")
    metadata: dict[str, Any] | None = Field(None, description="accepted, not kept")
    if_exists: Literal["raise", "do_nothing"] | None = None


class HistoryRequest(_Body):
    """``POST /threads/{thread_id}/history``: the session keeps its current state only."""

    limit: int = Field(10, ge=0)
    before: Any = None
    metadata: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None


class AssistantSearch(_Body):
    """``POST /assistants/search``: the one assistant (the deployment's engine) or none."""

    graph_id: str | None = None
    name: str | None = None
    metadata: dict[str, Any] | None = None
    limit: int = Field(10, ge=0)
    offset: int = Field(0, ge=0)


# Answers (for the OpenAPI document; the routes build plain dicts of these shapes).


class Interrupt(BaseModel):
    value: Any
    id: str


class Message(BaseModel):
    type: Literal["human", "ai"]
    content: str
    id: str
    additional_kwargs: dict[str, Any] = {}
    response_metadata: dict[str, Any] = {}


class ThreadValues(BaseModel):
    """A session's state as the protocol's values: its kept turns as messages, its step, and
    (for the server token only) the engine's memory."""

    messages: list[Message]
    step: str
    memory: Any = None


class Thread(BaseModel):
    thread_id: str
    created_at: str | None = None
    updated_at: str | None = None
    metadata: dict[str, Any] = {}
    status: Literal["idle", "busy", "interrupted"]
    values: ThreadValues | None
    interrupts: dict[str, list[Interrupt]]


class Checkpoint(BaseModel):
    thread_id: str
    checkpoint_ns: str = ""
    checkpoint_id: str | None
    checkpoint_map: dict[str, Any] | None = None


class Task(BaseModel):
    id: str
    name: str
    error: str | None = None
    interrupts: list[Interrupt]
    checkpoint: Checkpoint | None = None
    state: Any = None
    result: Any = None


class ThreadState(BaseModel):
    values: ThreadValues
    next: list[str]
    tasks: list[Task]
    interrupts: list[Interrupt]
    checkpoint: Checkpoint
    metadata: dict[str, Any] = {}
    created_at: str | None = None
    parent_checkpoint: Checkpoint | None = None


class Run(BaseModel):
    run_id: str
    thread_id: str
    assistant_id: str
    created_at: str | None = None
    updated_at: str | None = None
    status: Literal["pending", "running", "error", "success", "timeout", "interrupted"]
    metadata: dict[str, Any] = {}
    multitask_strategy: str | None = None


class Assistant(BaseModel):
    assistant_id: str
    graph_id: str
    name: str
    description: str | None = None
    config: dict[str, Any] = {}
    context: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    version: int = 1
    created_at: str | None = None
    updated_at: str | None = None


class Info(BaseModel):
    version: str
    flags: dict[str, bool]
    metadata: dict[str, Any] = {}


class RunValues(BaseModel):
    """What ``/runs/wait`` and ``/join`` answer: the thread's values after the run, with
    ``__interrupt__`` when it waits for a person, ``__error__`` when it failed."""

    model_config = ConfigDict(extra="allow")
    messages: list[Message]
    step: str
