"""Interrupts, the engine's side: `interrupt(payload, timeout_s=None)` makes a running step
wait for a person ("send this refund?") and go on where it stopped once they answer.

The first time, `interrupt` ends the attempt: it raises `Interrupted`, which the worker turns
into a durable reply event of outcome ``awaiting`` (with the interrupt's id and ``payload``);
the session waits, its later messages behind it (lua/interrupt-3.lua). When the application
resumes it (``DialogClient.resume(session_id, interrupt_id, value)``, applied once), the step
runs again from its start: what it did through ``once`` is answered by the journal, and this
`interrupt` call returns ``value``. Interrupt ids are the same in every attempt: the message's
msg_id, seq and the call's number in the step (1 for its first interrupt, 2 for the second).

One name, two call styles, as `once`: ``await interrupt(...)`` in an ``async def`` step,
``interrupt(...)`` in a plain ``def`` step.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dialog_worker.engine.journal import StepJournal, as_json, current, on_event_loop
from dialog_worker.errors import InterruptTimeout, ValidationError

# Largest payload (its JSON, UTF-8): it travels in a reply event and the session's state.
MAX_PAYLOAD_BYTES = 16_384
# Longest timeout: a year.
MAX_TIMEOUT_S = 366 * 86400


class Interrupted(BaseException):
    """The step asked a person (`interrupt`) and must stop here: the worker parks its
    session. A BaseException, like asyncio's CancelledError, so that an engine's ``except
    Exception`` around its work does not swallow the wait and go on without the answer."""

    def __init__(self, n: int, payload: str, timeout_ms: int) -> None:
        super().__init__(f"interrupt {n} waits for a resume")
        self.n = n
        self.payload = payload  # JSON text
        self.timeout_ms = timeout_ms  # 0: no timeout


def interrupt_id(msg_id: str, seq: int, n: int) -> str:
    """The id of the ``n``-th interrupt of message ``msg_id`` (its ``seq``): the same in
    every attempt, and never that of another message, even one sent later under the same
    msg_id (its seq differs)."""
    return f"{msg_id}:{seq}:{n}"


def awaiting_data(interrupt_id: str, payload: str) -> str:
    """The data (JSON text) of the ``awaiting`` event a parked step's readers get."""
    return f'{{"interrupt_id":{json.dumps(interrupt_id, ensure_ascii=False)},"payload":{payload}}}'


def interrupt(payload: Any, timeout_s: float | None = None) -> Any:
    """Wait for a person: the first run raises `Interrupted` (the worker ends the attempt
    with an ``awaiting`` reply event carrying ``payload`` and the interrupt's id; do not catch
    it), the run after the resume returns the value it was resumed with. ``payload`` is any
    JSON (at most 16 KiB), for the person: what to approve, the choices. With ``timeout_s``,
    a wait that has no resume after that many seconds ends: the run after it raises
    `InterruptTimeout` from this call (a `PermanentError`: catch it to answer otherwise).

    ``await dialog_worker.interrupt(...)`` in an ``async def`` step;
    ``dialog_worker.interrupt(...)`` in a plain ``def`` step. Call it from a running step
    only (RuntimeError otherwise)."""
    text = as_json(payload, "the interrupt's payload")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_PAYLOAD_BYTES:
        raise ValidationError(
            f"an interrupt's payload is at most {MAX_PAYLOAD_BYTES} bytes of JSON"
        )
    timeout_ms = 0
    if timeout_s is not None:
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float)
            or not math.isfinite(timeout_s)
            or not 0 < timeout_s <= MAX_TIMEOUT_S
        ):
            raise ValidationError(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S}]")
        timeout_ms = max(1, round(timeout_s * 1000))
    journal = current()
    if journal is None:
        raise RuntimeError("dialog_worker.interrupt() is called from a running step only")
    n = journal.next_interrupt()
    if on_event_loop():
        return _wait(journal, n, text, timeout_ms)
    return journal.run_sync(_wait(journal, n, text, timeout_ms))


async def _wait(journal: StepJournal, n: int, payload: str, timeout_ms: int) -> Any:
    ended = await journal.interrupt_ended(n)
    if ended is None:
        raise Interrupted(n, payload, timeout_ms)
    journal.interrupt_answered()
    if ended.get("timeout"):
        raise InterruptTimeout(journal.interrupt_id(n))
    return ended.get("value")
