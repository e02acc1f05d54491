"""Streaming, the engine's side: `emit(text)` adds to the answer a running step streams.

The worker runs each step with a writer bound in a context variable (`bind`): an ``async def``
step sees it directly, a plain ``def`` step in its worker thread too
(``anyio.to_thread.run_sync`` copies the context). The writer itself, which batches what
steps emit into their messages' partial streams, is the worker's (dialog_worker/daemon/
partial_writer.py); this module only knows that it has an ``add(text)``.
"""

from __future__ import annotations

import contextvars
from typing import Protocol


class Writer(Protocol):
    """Where a step's emitted text goes (the worker's partial writer)."""

    def add(self, text: str) -> None: ...


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


def bind(writer: Writer | None) -> contextvars.Token[Writer | None]:
    """For the worker: the writer of the step about to run in this context."""
    return _current.set(writer)


def unbind(token: contextvars.Token[Writer | None]) -> None:
    _current.reset(token)


def current_writer() -> Writer | None:
    """The writer of the step running in this context (None outside a step); for tests."""
    return _current.get()
