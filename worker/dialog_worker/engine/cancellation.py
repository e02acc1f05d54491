"""Cancellation, the engine's side: `cancelled()` tells a running step that its message was
cancelled (``DialogClient.cancel``, or an interrupting message).

An ``async def`` step needs nothing: it is cancelled where it awaits (within about
`WATCH_INTERVAL_S` of the cancel) and its result, if any, is discarded. A plain ``def`` step runs
in a thread, which cannot be interrupted: the worker moves on at once (the message ends
``cancelled``, whatever the thread returns later is discarded), and the thread can stop early
by checking ``dialog_worker.cancelled()`` between pieces of work. The flag travels in a
context variable, which ``anyio.to_thread.run_sync`` copies into the step's thread.
"""

from __future__ import annotations

import contextvars
import threading

# How often the worker looks for cancel marks of the steps it runs (one MGET per shard while
# any step runs): the bound on how late a running step learns of its cancel, plus one round
# trip.
WATCH_INTERVAL_S = 0.05
# Quiet (every step it runs looked at once, no cancel for QUIET_S), the watch blocks on the
# shard's cancel notes for at most WATCH_BLOCK_MS instead, and looks as soon as one comes.
QUIET_S = 1.0
WATCH_BLOCK_MS = 1000

_flag: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "dialog_worker_cancel_flag", default=None
)


def cancelled() -> bool:
    """True once the message of the running step has been cancelled. Call it from a step
    (``async def`` or plain ``def``); outside a step it is False."""
    flag = _flag.get()
    return flag is not None and flag.is_set()


def bind(flag: threading.Event) -> contextvars.Token[threading.Event | None]:
    """For the pipeline: the flag of the step about to run in this context."""
    return _flag.set(flag)


def unbind(token: contextvars.Token[threading.Event | None]) -> None:
    _flag.reset(token)
