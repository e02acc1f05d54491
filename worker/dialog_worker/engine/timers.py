"""Timers, the engine's side: `schedule` and `cancel_timer` for a running step.

A step asks for a message to its own session later (``dialog_worker.schedule``) or drops one
it asked for before (``dialog_worker.cancel_timer``). Nothing reaches Redis while the step
runs: the requests are gathered for the running step (a context variable, which
``anyio.to_thread.run_sync`` copies into a plain step's thread) and written by the step's
commit, atomically with its state and reply (lua/commit-5.lua). A step that fails, is
fenced or cancelled leaves no timer behind. When due, a worker's fire loop appends the
timer's message to the session's inbound stream (lua/fire-3.lua), where it is sequenced like
any message; its ``meta`` carries ``timer`` (the timer's name).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from dialog_worker.errors import ValidationError
from dialog_worker.store.codec import check_meta

# Mirrors of lua/_common.lua.
MAX_TIMERS = 64  # per session
MAX_TIMER_NAME_BYTES = 128
# Fields a timer's meta may not use: they are the message's own or the worker's.
_RESERVED_META = frozenset(
    {"session_id", "text", "msg_id", "multitask", "timer", "deliver_at", "seq", "entry_id"}
)
MAX_TIMER_META = 30


class TimerOps:
    """What one attempt of one step asked for, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: list[dict[str, Any]] = []

    def add(self, op: dict[str, Any]) -> None:
        with self._lock:
            sets = sum(1 for o in self.ops if o["op"] == "set")
            if op["op"] == "set" and sets >= 2 * MAX_TIMERS:  # a cancel is never refused
                raise ValidationError(f"a step may set at most {2 * MAX_TIMERS} timers")
            self.ops.append(op)

    def encoded(self) -> str:
        """The commit's timer argument ("" for none)."""
        with self._lock:
            return json.dumps(self.ops, ensure_ascii=False) if self.ops else ""


_current: contextvars.ContextVar[TimerOps | None] = contextvars.ContextVar(
    "dialog_worker_timer_ops", default=None
)


def bind(ops: TimerOps) -> contextvars.Token[TimerOps | None]:
    """For the pipeline: the timer requests of the step about to run in this context."""
    return _current.set(ops)


def unbind(token: contextvars.Token[TimerOps | None]) -> None:
    _current.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """For an engine's own tests: what steps run inside the block ask for (``schedule`` /
    ``cancel_timer``), as a list of operations (``{"op": "set", "name", "text", "meta",
    "delay_ms" | "at_ms", "cancel_on_message"}`` / ``{"op": "cancel", "name"}``)."""
    ops = TimerOps()
    token = bind(ops)
    try:
        yield ops.ops
    finally:
        unbind(token)


def check_timer_name(name: object) -> str:
    if (
        not isinstance(name, str)
        or not name
        or len(name.encode("utf-8")) > MAX_TIMER_NAME_BYTES
        or any(ord(ch) < 32 or ord(ch) == 127 for ch in name)
    ):
        raise ValidationError(
            f"a timer name is 1 to {MAX_TIMER_NAME_BYTES} bytes of text without control "
            f"characters, got {name!r}"
        )
    return name


def schedule(
    name: str,
    text: str,
    *,
    delay_s: float | None = None,
    at: float | None = None,
    meta: Mapping[str, str] | None = None,
    cancel_on_message: bool = False,
) -> None:
    """Ask for a message to this step's own session: ``text`` (with ``meta``) is appended to
    the session's stream ``delay_s`` seconds after the step's commit, or at ``at`` (seconds
    since the epoch, like ``time.time()``), and is then processed in its turn like any
    message, with ``meta["timer"] == name``. A timer of the same name replaces the earlier
    one. ``cancel_on_message``: a message of the user sequenced before it is due cancels it
    (an inactivity nudge). Written only if the step's result is committed; at most
    64 timers per session (a commit that would leave more is refused and its message
    dead-lettered). Call it from a step, ``async def`` or plain ``def``; outside a step it
    raises ``RuntimeError`` (in an engine's own tests, wrap the step in ``recording()``)."""
    ops = _current.get()
    if ops is None:
        raise RuntimeError("dialog_worker.schedule() is called from a running step only")
    check_timer_name(name)
    if not isinstance(text, str) or not text.strip():
        raise ValidationError("a timer's text must be non-empty text")
    if (delay_s is None) == (at is None):
        raise ValidationError("give exactly one of delay_s or at")
    op: dict[str, Any] = {"op": "set", "name": name, "text": text}
    when = delay_s if delay_s is not None else at
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        raise ValidationError("delay_s / at must be a finite number of seconds")
    if delay_s is not None:
        if delay_s < 0:
            raise ValidationError("delay_s must not be negative")
        op["delay_ms"] = int(delay_s * 1000)
    else:
        assert at is not None
        if at < 0:
            raise ValidationError("at must not be negative")
        op["at_ms"] = int(at * 1000)
    flat: list[str] = []
    for key, value in (meta or {}).items():
        if key in _RESERVED_META:
            raise ValidationError(f"meta field {key!r} is reserved")
        flat += [key, check_meta(key, value)]
    if len(flat) > 2 * MAX_TIMER_META:
        raise ValidationError(f"a timer carries at most {MAX_TIMER_META} meta fields")
    op["meta"] = flat
    op["cancel_on_message"] = bool(cancel_on_message)
    ops.add(op)


def cancel_timer(name: str) -> None:
    """Drop this session's timer ``name`` (set by an earlier step, or earlier in this one)
    when this step's result is committed. A name with no timer is no error. Call it from a
    running step only."""
    ops = _current.get()
    if ops is None:
        raise RuntimeError("dialog_worker.cancel_timer() is called from a running step only")
    ops.add({"op": "cancel", "name": check_timer_name(name)})


def deliver_at_ms(deliver_at: float) -> int:
    """The `deliver_at` field of a send: seconds since the epoch (``time.time()``) -> ms."""
    if (
        isinstance(deliver_at, bool)
        or not isinstance(deliver_at, (int, float))
        or not math.isfinite(deliver_at)
        or deliver_at < 0
    ):
        raise ValidationError("deliver_at must be seconds since the epoch (time.time())")
    if deliver_at > time.time() + 366 * 86400:
        raise ValidationError("deliver_at is at most 366 days ahead")
    return int(deliver_at * 1000)
