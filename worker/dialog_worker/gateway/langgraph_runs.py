"""What a LangGraph client sees of a session and of one message's answer (gateway/langgraph.py).

A thread is a session and a run is one message (its msg_id is the run id). The session's
state becomes the protocol's *values*: its kept turns (docs/engine.md, ``history``) as human
and AI messages, its ``step``, and the engine's ``memory`` for the server token only (a page
with a session token sees the conversation, not what the engine keeps for itself). One
answer's events (`DialogClient.stream`) become the protocol's stream parts, by stream mode:

    delta            messages-tuple: an AIMessageChunk of the run's AI message
    reset / resync   values: the thread's values without the abandoned text; messages-tuple:
                     the answer starts again under a new AI message id (resync: with the
                     whole text so far)
    event            custom: {"kind", "data"} (dialog_worker.emit_event)
    event awaiting   values with __interrupt__, updates {"__interrupt__": [...]}, then the
                     run ends (the thread is interrupted until a run answers it with
                     command.resume); an interrupt already answered is passed over
    end              values (the state after the commit), updates {"engine": ...}, then
                     ``end`` ({"run_id", "status"}), or ``error`` for an outcome that is one

SSE ids are the answer's cursors (``<msg_id>:<attempt>:<pos>``): a client that reconnects with
``Last-Event-ID`` gets every later part once. Parts made from one event carry the id on their
last part only: a reconnect in the middle repeats values and updates (which replace), never a
text chunk.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.interrupts import PendingInterrupt
from dialog_worker.client.partial_reader import StreamEvent
from dialog_worker.store.codec import unpack_custody

# The one node a session's run goes through: the engine's step.
NODE = "engine"
INITIAL_STEP = "ROOT"

# How each outcome of a message (its reply event) reads as a run's status.
RUN_STATUS = {
    "applied": "success",
    "duplicate": "success",
    "merged": "success",
    "cancelled": "interrupted",
    "superseded": "interrupted",
    "expired": "timeout",
    "rejected": "error",
    "dead_lettered": "error",
    "budget_exceeded": "error",
}
# Outcomes that end a run with the protocol's ``error`` part: (error, message).
RUN_ERRORS = {
    "rejected": (
        "Rejected",
        "the thread was busy and the run's multitask_strategy is reject",
    ),
    "dead_lettered": (
        "DeadLettered",
        "the engine failed on this message; the thread shows its fallback reply",
    ),
    "budget_exceeded": ("BudgetExceeded", "the tenant's daily token budget is spent"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One server-sent event of a run's stream."""

    event: str
    data: Any
    id: str | None = None

    def sse(self) -> str:
        head = f"id: {self.id}\n" if self.id is not None else ""
        return f"{head}event: {self.event}\ndata: {json.dumps(self.data, ensure_ascii=False)}\n\n"


def ai_message_id(msg_id: str, attempt: int = 1, segment: int = 0) -> str:
    """The AI message of a run: ``run-<msg_id>`` for a first attempt streamed at one go (the id
    the committed turn has too, so a client that shows the chunks keeps one message); another
    attempt, or a text sent again whole (resync), starts a message of its own."""
    if attempt <= 1 and segment == 0:
        return f"run-{msg_id}"
    return f"run-{msg_id}-{attempt}-{segment}"


def human_message(msg_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "human",
        "content": text,
        "id": msg_id,
        "additional_kwargs": {},
        "response_metadata": {},
    }


def ai_message(msg_id: str, text: str, **metadata: Any) -> dict[str, Any]:
    return {
        "type": "ai",
        "content": text,
        "id": ai_message_id(msg_id),
        "additional_kwargs": {},
        "response_metadata": metadata,
    }


def turn_messages(turn: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A history turn as messages: the user's (absent for a timer's turn) and the answer's
    (absent when there was none). What is read from Redis is not trusted to be well-formed."""
    msg_id = turn.get("msg_id")
    if not isinstance(msg_id, str):
        return []
    messages = []
    user = turn.get("user")
    if isinstance(user, str):
        messages.append(human_message(msg_id, user))
    bot = turn.get("bot")
    ended = next((k for k in ("cancelled", "superseded", "expired") if turn.get(k)), None)
    metadata: dict[str, Any] = {}
    if ended:
        metadata["outcome"] = ended
    if isinstance(turn.get("bubbles"), list):
        metadata["bubbles"] = turn["bubbles"]
    if isinstance(bot, str) and (bot or metadata) and not turn.get("no_reply"):
        messages.append(ai_message(msg_id, bot, **metadata))
    return messages


def thread_values(state: Mapping[str, Any] | None, memory: bool) -> dict[str, Any]:
    """The session's state as the protocol's values (a session with no state: the initial
    one)."""
    state = state if isinstance(state, Mapping) else {}
    history = state.get("history")
    messages = [
        m
        for turn in (history if isinstance(history, list) else [])
        if isinstance(turn, Mapping)
        for m in turn_messages(turn)
    ]
    step = state.get("step")
    values: dict[str, Any] = {
        "messages": messages,
        "step": step if isinstance(step, str) else INITIAL_STEP,
    }
    if memory:
        values["memory"] = state.get("memory", {})
    return values


def interrupt_part(pending: PendingInterrupt) -> dict[str, Any]:
    return {"value": pending.payload, "id": pending.interrupt_id}


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """What the gateway reads of a session for a thread: its state, how far its messages
    got, and the interrupt it waits on."""

    thread_id: str
    state: dict[str, Any] | None
    last_seq: int
    applied_seq: int
    pending: Sequence[PendingInterrupt]

    @property
    def status(self) -> str:
        if self.pending:
            return "interrupted"
        return "busy" if self.last_seq > self.applied_seq else "idle"

    @property
    def version(self) -> int:
        version = (self.state or {}).get("version")
        return version if isinstance(version, int) else 0

    def interrupts(self) -> list[dict[str, Any]]:
        return [interrupt_part(p) for p in self.pending]

    def thread(self, memory: bool) -> dict[str, Any]:
        return {
            "thread_id": self.thread_id,
            "created_at": None,
            "updated_at": None,
            "metadata": {},
            "status": self.status,
            "values": thread_values(self.state, memory) if self.state is not None else None,
            "interrupts": {p.msg_id: [interrupt_part(p)] for p in self.pending},
        }

    def thread_state(self, memory: bool) -> dict[str, Any]:
        """The protocol's ThreadState: the current state (no other checkpoint is kept); the
        checkpoint id is the state's version."""
        checkpoint = {
            "thread_id": self.thread_id,
            "checkpoint_ns": "",
            "checkpoint_id": str(self.version) if self.state is not None else None,
            "checkpoint_map": None,
        }
        return {
            "values": thread_values(self.state, memory),
            "next": [NODE] if self.pending else [],
            "tasks": [
                {
                    "id": p.msg_id,
                    "name": NODE,
                    "error": None,
                    "interrupts": [interrupt_part(p)],
                    "checkpoint": None,
                    "state": None,
                    "result": None,
                }
                for p in self.pending
            ],
            "interrupts": self.interrupts(),
            "checkpoint": checkpoint,
            "metadata": {},
            "created_at": None,
            "parent_checkpoint": None,
        }


async def snapshot(client: DialogClient, thread_id: str) -> Snapshot:
    state_key = client.keys_for(thread_id).session(thread_id).state
    doc, last_seq, applied_seq = await client.redis.hmget(state_key, "d", "s", "a")
    pending = await client.pending(thread_id)
    try:
        state = json.loads(doc) if doc is not None else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        state = None
    return Snapshot(
        thread_id,
        state if isinstance(state, dict) else None,
        _int(last_seq),
        _int(applied_seq),
        pending,
    )


async def waiting_text(client: DialogClient, thread_id: str, run_id: str) -> str | None:
    """The user's text of a message not committed yet (it waits in its session's keys under
    its seq, which its msg_id's dedupe key names), or None."""
    session = client.keys_for(thread_id).session(thread_id)
    seq = await client.raw.get(session.dedupe(run_id))
    if not (isinstance(seq, bytes) and seq.isdigit() and len(seq) <= 18):
        return None
    held = await client.raw.hget(session.state, b"q" + seq)
    custody = unpack_custody(held) if isinstance(held, bytes) else None
    text = custody[1].get(b"text") if custody is not None else None
    return text.decode("utf-8", "replace") if text is not None else None


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


@dataclasses.dataclass
class RunStream:
    """Turns one message's answer into a run's stream parts (see the module's docstring).

    ``human``: the user's text when this request sent the message (the first values show it,
    as the protocol's show a run's input); ``resumed``: the interrupt this run answered (the
    answer's events up to it belong to the run before). ``memory``: whether values carry the
    engine's memory (the server token)."""

    client: DialogClient
    thread_id: str
    run_id: str
    modes: frozenset[str]
    memory: bool
    human: str | None = None
    resumed: str | None = None
    status: str | None = None  # the run's status once it ended here
    values: dict[str, Any] | None = None  # the last values sent (or that would have been)
    _base: dict[str, Any] = dataclasses.field(default_factory=dict)
    _attempt: int = 1
    _segment: int = 0

    async def frames(
        self, events: AsyncIterator[StreamEvent], opening: bool
    ) -> AsyncIterator[Frame]:
        """The run's parts, from the answer's ``events``; ``opening``: the run's first parts
        (``metadata``, the values it starts from) come first, as on a new stream."""
        start = await snapshot(self.client, self.thread_id)
        self._base = thread_values(start.state, self.memory)
        if not any(m["id"] == self.run_id for m in self._base["messages"]):
            # Not committed yet: its user message is part of the run's values all along.
            human = self.human or await waiting_text(self.client, self.thread_id, self.run_id)
            if human is not None:
                self._base["messages"].append(human_message(self.run_id, human))
        self.values = self._base
        if opening:
            yield Frame("metadata", {"run_id": self.run_id, "attempt": 1})
            if "values" in self.modes:
                yield Frame("values", self._base)
        skipping = self.resumed is not None
        async for event in events:
            if skipping:
                skipping = not (
                    event.kind == "event"
                    and event.event_kind == "awaiting"
                    and isinstance(event.data, dict)
                    and event.data.get("interrupt_id") == self.resumed
                )
                continue
            async for frame in self._parts(event):
                yield frame
            if self.status is not None:
                return

    async def _parts(self, event: StreamEvent) -> AsyncIterator[Frame]:
        if event.kind == "delta":
            if "messages-tuple" in self.modes:
                yield self._chunk(event.text, event.cursor)
        elif event.kind in ("reset", "resync"):
            self._attempt = max(self._attempt, event.attempt)
            self._segment += 1
            if "values" in self.modes:
                yield Frame("values", self._base, event.cursor if event.kind == "reset" else None)
            if event.kind == "resync" and "messages-tuple" in self.modes:
                yield self._chunk(event.text, event.cursor)
        elif event.kind == "event" and event.event_kind == "awaiting":
            async for frame in self._interrupt(event):
                yield frame
        elif event.kind == "end":
            async for frame in self._end(event):
                yield frame
        elif "custom" in self.modes:
            kind = event.event_kind if event.kind == "event" else event.kind
            yield Frame("custom", {"kind": kind, "data": event.data}, event.cursor)

    def _chunk(self, text: str, cursor: str | None) -> Frame:
        chunk = {
            "type": "AIMessageChunk",
            "content": text,
            "id": ai_message_id(self.run_id, self._attempt, self._segment),
            "additional_kwargs": {},
            "response_metadata": {},
            "tool_call_chunks": [],
        }
        metadata = {"run_id": self.run_id, "thread_id": self.thread_id, "langgraph_node": NODE}
        return Frame("messages", [chunk, metadata], cursor)

    async def _interrupt(self, event: StreamEvent) -> AsyncIterator[Frame]:
        data = event.data if isinstance(event.data, dict) else {}
        interrupt_id = data.get("interrupt_id")
        pending = await self.client.pending(self.thread_id)
        waiting = [p for p in pending if p.interrupt_id == interrupt_id]
        if not waiting:
            return  # answered already: the run went on (its reset and text follow)
        parts = [interrupt_part(p) for p in waiting]
        self.values = {**self._base, "__interrupt__": parts}
        self.status = "interrupted"
        frames = []
        if "values" in self.modes:
            frames.append(Frame("values", self.values))
        if "updates" in self.modes:
            frames.append(Frame("updates", {"__interrupt__": parts}))
        frames.append(Frame("end", {"run_id": self.run_id, "status": "interrupted"}))
        for frame in _last_with_id(frames, event.cursor):
            yield frame

    async def _end(self, event: StreamEvent) -> AsyncIterator[Frame]:
        outcome = event.outcome or "applied"
        state = await self.client.state(self.thread_id)
        self.values = thread_values(state, self.memory)
        self.status = RUN_STATUS.get(outcome, "error")
        turn = [m for m in self.values["messages"] if m["id"] == ai_message_id(self.run_id)] or [
            ai_message(self.run_id, event.text, outcome=outcome)
        ]
        frames = []
        if "values" in self.modes:
            frames.append(Frame("values", self.values))
        if "updates" in self.modes:
            frames.append(Frame("updates", {NODE: {"messages": turn, "step": self.values["step"]}}))
        error = run_error(outcome)
        if error is not None:
            self.values = {**self.values, "__error__": error}
            frames.append(Frame("error", error))
        else:
            frames.append(Frame("end", {"run_id": self.run_id, "status": self.status}))
        for frame in _last_with_id(frames, event.cursor):
            yield frame


def run_error(outcome: str) -> dict[str, str] | None:
    if outcome in RUN_STATUS and outcome not in RUN_ERRORS:
        return None
    error, message = RUN_ERRORS.get(outcome, ("Failed", f"the message ended {outcome}"))
    return {"error": error, "message": message}


def _last_with_id(frames: Iterable[Frame], cursor: str | None) -> list[Frame]:
    """Parts made from one event: the cursor goes on the last only (a reconnect in the middle
    repeats the values and updates, which replace what was shown)."""
    listed = list(frames)
    if listed:
        listed[-1] = dataclasses.replace(listed[-1], id=cursor)
    return listed
