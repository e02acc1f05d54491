"""The Vercel AI SDK's UI message stream (protocol ``v1``), written from the events of one
answer (`StreamEvent`s of `DialogClient.stream`): what `useChat` and `readUIMessageStream`
read. Pure: events in, chunks (JSON objects) out; dialog_worker/gateway/ai_sdk.py serves them.

One answer is one assistant message, id ``reply-<msg_id>``:

    start {messageId, messageMetadata: {session_id, msg_id}}, start-step,
    text-start / text-delta ... / text-end,  data-<kind> (a typed event, emit_event),
    data-waiting (transient: the message waits for a model's limit), ...
    finish-step, [abort], finish {finishReason, messageMetadata: {outcome}}

A step that asks a person (``dialog_worker.interrupt``) ends the stream with a tool call
waiting for approval: ``tool-input-available`` (dynamic tool ``interrupt``, input: the
payload) and ``tool-approval-request`` (approval id = the interrupt id); the client answers it
(`addToolApprovalResponse`, or `addToolOutput` for any JSON) and sends the message back, and
the answer goes on in that same assistant message.

The protocol has no chunk that takes text back, and an answer may start over (a new attempt
after a failure, the run after an interrupt's answer) or end with a committed reply that
differs from what was streamed. What the client shows is kept here, so a new attempt that
writes the same text again adds nothing, and one that goes further adds only the rest; only
when the new text differs from what is shown does the client get a ``data-reset`` part (what
came before it is replaced) and the new text in a text part of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dialog_worker.client.partial_reader import StreamEvent

# How an answer's outcome finishes the message (the protocol's finish reasons).
FINISH_REASONS = {
    "applied": "stop",
    "duplicate": "stop",
    "dead_lettered": "error",
}
INTERRUPT_TOOL = "interrupt"
_NOT_GIVEN = object()


def message_id(msg_id: str) -> str:
    """The assistant message's id for the answer to ``msg_id`` (the user message's id)."""
    return f"reply-{msg_id}"


def answered_msg_id(assistant_id: str) -> str | None:
    """The msg_id an assistant message answers, or None when its id is not one of ours."""
    return assistant_id.removeprefix("reply-") if assistant_id.startswith("reply-") else None


def _valid_kind(kind: object) -> bool:
    return (
        isinstance(kind, str)
        and 0 < len(kind) <= 64
        and all(ch.isascii() and (ch.isalnum() or ch in "_.:-") for ch in kind)
    )


@dataclasses.dataclass
class UIMessageWriter:
    """Turns one answer's events into chunks. ``silent_until``: an interrupt id whose question
    the client already shows (it answers it now): everything up to and including that question
    only updates what the client is known to show. ``answer``: the value it was answered with
    (shown as the tool call's output once the run goes on)."""

    session_id: str
    msg_id: str
    silent_until: str | None = None
    answer: Any = _NOT_GIVEN
    # The current attempt's text, and what the client shows of the answer's text.
    _text: str = ""
    _shown: str = ""
    _text_part: str | None = None
    _parts: int = 0
    _attempt: int | None = None
    # The typed events the client shows, and how many of them a new attempt has repeated.
    _events: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    _repeated: int = 0
    _asked: str | None = None

    def begin(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "start",
                "messageId": message_id(self.msg_id),
                "messageMetadata": {"session_id": self.session_id, "msg_id": self.msg_id},
            },
            {"type": "start-step"},
        ]

    def feed(self, event: StreamEvent) -> tuple[list[dict[str, Any]], bool]:
        """The chunks for one event, and whether the message is finished (no more chunks)."""
        if self.silent_until is not None and event.kind in ("reset", "end"):
            self.silent_until = None  # the question was never seen: show from here
        silent = self.silent_until is not None
        if self._attempt is None:
            self._attempt = event.attempt
        out: list[dict[str, Any]] = []
        if event.kind == "delta":
            self._text += event.text
            out = self._sync(final=False)
        elif event.kind == "resync":
            self._text = event.text
            out = self._sync(final=False)
        elif event.kind == "reset":
            out = self._new_attempt(event.attempt)
        elif event.kind == "end":
            return self._end(event), True
        elif event.kind == "event" and event.event_kind == "awaiting":
            return self._ask(event)
        elif event.kind == "waiting" or (event.kind == "event" and event.event_kind == "waiting"):
            data = event.data if isinstance(event.data, dict) else {}
            out = [{"type": "data-waiting", "data": data, "transient": True}]
        elif event.kind == "event" and _valid_kind(event.event_kind):
            out = self._typed(str(event.event_kind), event.data)
        return ([] if silent else out), False

    def cut(self, error: BaseException | None) -> list[dict[str, Any]]:
        """The reader stopped before the end: an error chunk when it failed (the client shows
        it), nothing when this connection's time was up (the text so far stays; reconnecting
        resumes it)."""
        if error is None:
            return []
        return [{"type": "error", "errorText": "the chat service is unavailable; reload to resume"}]

    # -- text -----------------------------------------------------------------------------

    def _sync(self, final: bool) -> list[dict[str, Any]]:
        """Bring what the client shows to the current attempt's text: append what is new; wait
        while a new attempt is still writing what is shown; replace when it wrote otherwise
        (or, at the end, less)."""
        text, shown = self._text, self._shown
        if text.startswith(shown):
            extra = text[len(shown) :]
            self._shown = text
            return self._append(extra) if extra else []
        if shown.startswith(text) and not final:
            return []  # a new attempt, still writing what is shown
        out = self._close_text()
        out.append({"type": "data-reset", "data": {"attempt": self._attempt}})
        self._shown = text
        return out + (self._append(text) if text else [])

    def _append(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._text_part is None:
            self._parts += 1
            self._text_part = f"text-{self._parts}"
            out.append({"type": "text-start", "id": self._text_part})
        out.append({"type": "text-delta", "id": self._text_part, "delta": text})
        return out

    def _close_text(self) -> list[dict[str, Any]]:
        if self._text_part is None:
            return []
        closed, self._text_part = self._text_part, None
        return [{"type": "text-end", "id": closed}]

    # -- attempts, events, questions --------------------------------------------------------

    def _new_attempt(self, attempt: int) -> list[dict[str, Any]]:
        """A new attempt writes the answer again from its start: what it writes is compared
        with what is shown. A question of the previous attempt was answered (the run goes on)."""
        self._attempt = attempt
        self._text = ""
        self._repeated = 0
        out: list[dict[str, Any]] = []
        if self._asked is not None:
            output = None if self.answer is _NOT_GIVEN else self.answer
            out.append(
                {"type": "tool-output-available", "toolCallId": self._asked, "output": output}
            )
            self._asked = None
        return out

    def _typed(self, kind: str, data: Any) -> list[dict[str, Any]]:
        """A typed event as a ``data-<kind>`` part, unless a new attempt repeats one shown."""
        if self._repeated < len(self._events) and self._events[self._repeated] == (kind, data):
            self._repeated += 1
            return []
        self._events.append((kind, data))
        self._repeated = len(self._events)
        return [{"type": f"data-{kind}", "data": data}]

    def _ask(self, event: StreamEvent) -> tuple[list[dict[str, Any]], bool]:
        """A question for a person: a tool call waiting for approval, and the end of this
        stream (the client sends the answer back in a new request)."""
        data = event.data if isinstance(event.data, dict) else {}
        interrupt_id = data.get("interrupt_id")
        if not isinstance(interrupt_id, str) or not interrupt_id:
            return [], False
        self._asked = interrupt_id
        if self.silent_until is not None:
            if interrupt_id == self.silent_until:
                # The client shows everything up to here; its text part ended with the stream
                # that asked.
                self.silent_until = None
                self._text_part = None
            return [], False
        out = self._close_text()
        out += [
            {
                "type": "tool-input-available",
                "toolCallId": interrupt_id,
                "toolName": INTERRUPT_TOOL,
                "input": data.get("payload"),
                "dynamic": True,
            },
            {
                "type": "tool-approval-request",
                "toolCallId": interrupt_id,
                "approvalId": interrupt_id,
            },
            {"type": "finish-step"},
            {
                "type": "finish",
                "finishReason": "tool-calls",
                "messageMetadata": {"outcome": "awaiting", "interrupt_id": interrupt_id},
            },
        ]
        return out, True

    def _end(self, event: StreamEvent) -> list[dict[str, Any]]:
        self._text = event.text
        out = self._sync(final=True) + self._close_text()
        outcome = event.outcome or "applied"
        if self._asked is not None:  # ended without the answer (cancelled, timed out)
            out.append(
                {"type": "tool-output-error", "toolCallId": self._asked, "errorText": outcome}
            )
            self._asked = None
        out.append({"type": "finish-step"})
        if outcome == "cancelled":
            out.append({"type": "abort", "reason": "cancelled"})
        out.append(
            {
                "type": "finish",
                "finishReason": FINISH_REASONS.get(outcome, "other"),
                "messageMetadata": {"outcome": outcome},
            }
        )
        return out
