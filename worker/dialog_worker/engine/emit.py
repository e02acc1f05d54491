"""Streaming, the engine's side: `emit(text)` adds to the answer a running step streams,
`emit_event(kind, data)` a typed event beside it.

The worker runs each step with a writer bound in a context variable (`bind`): an ``async def``
step sees it directly, a plain ``def`` step in its worker thread too
(``anyio.to_thread.run_sync`` copies the context). The writer itself, which batches what
steps emit into their messages' partial streams, is the worker's (dialog_worker/daemon/
partial_writer.py); this module only knows that it has an ``add(text)``.
"""

from __future__ import annotations

import contextvars
import json
from typing import Any, Protocol

from dialog_worker.errors import ValidationError


class Writer(Protocol):
    """Where a step's emitted text and events go (the worker's partial writer)."""

    def add(self, text: str) -> None: ...

    def add_event(self, kind: str, data: str, keep: bool) -> None: ...


_current: contextvars.ContextVar[Writer | None] = contextvars.ContextVar(
    "dialog_worker_partial_writer", default=None
)


def emit(text: str) -> None:
    """Add ``text`` to the reply this step is streaming (readers see it within about
    ``DIALOG_PARTIAL_FLUSH_MS``). Call it from a step, ``async def`` or plain ``def``; outside a
    step (a unit test calling ``step`` directly) it does nothing. It never blocks and never
    talks to Redis itself. The committed reply is what the step returns, not what it emitted."""
    if not isinstance(text, str):
        raise TypeError(f"emit() takes text (str), got {type(text).__name__}")
    writer = _current.get()
    if writer is not None and text:
        writer.add(text)


# Limits of a typed event (emit_event): its kind, and its data as JSON in UTF-8.
MAX_EVENT_KIND_CHARS = 64
MAX_EVENT_BYTES = 8192
# Kinds the worker writes itself: a step may not forge them.
RESERVED_EVENT_KINDS = frozenset({"awaiting", "waiting"})


def emit_event(kind: str, data: Any = None, *, keep: bool = False) -> None:
    """Stream a typed event beside the text (tool progress, a status, a card): readers get an
    ``event`` with ``event_kind`` = ``kind`` and ``data`` (any JSON, at most 8 KiB), in order
    with the text, under the same cursor rules (a resumed reader gets it once; a new attempt
    starts over with ``reset``). Not kept once the message is committed, unless ``keep``:
    then the committed attempt's kept events go into the message's history turn
    (``"events": [{"kind", "data"}...]``, at most 32). ``kind`` is 1 to 64 letters, digits,
    ``_ . : -``; ``awaiting`` (`interrupt`) and ``waiting`` (a wait for the model) are the
    worker's. A plain function, like `emit`:
    call it from a step, ``async def`` or plain ``def``; outside a step it does nothing."""
    if (
        not isinstance(kind, str)
        or not 0 < len(kind) <= MAX_EVENT_KIND_CHARS
        or not all(ch.isascii() and (ch.isalnum() or ch in "_.:-") for ch in kind)
    ):
        raise ValidationError(
            f"an event kind is 1 to {MAX_EVENT_KIND_CHARS} letters, digits, '_', '.', ':' "
            f"or '-', got {kind!r}"
        )
    if kind in RESERVED_EVENT_KINDS:
        raise ValidationError(f"the event kind {kind!r} is the worker's own")
    try:
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"an event's data is not JSON: {exc}") from None
    if len(text.encode("utf-8", "surrogatepass")) > MAX_EVENT_BYTES:
        raise ValidationError(f"an event's data is at most {MAX_EVENT_BYTES} bytes of JSON")
    writer = _current.get()
    if writer is not None:
        writer.add_event(kind, text, bool(keep))


def bind(writer: Writer | None) -> contextvars.Token[Writer | None]:
    """For the worker: the writer of the step about to run in this context."""
    return _current.set(writer)


def unbind(token: contextvars.Token[Writer | None]) -> None:
    _current.reset(token)


def current_writer() -> Writer | None:
    """The writer of the step running in this context (None outside a step); for tests."""
    return _current.get()
