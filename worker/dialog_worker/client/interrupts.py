"""Interrupts, the application's side (`DialogClient.pending`, `DialogClient.resume`, CLI
``resume``, the gateway's ``/pending`` and ``/interrupts/{id}/resume``): what a session waits
for, and the answer of a person to it, applied once (lua/resolve-2.lua).

A step that called ``dialog_worker.interrupt(payload)`` parked its session: the message's
reply event has outcome ``awaiting`` with the interrupt's id and payload, and the session's
await key holds the interrupt until it is resumed, times out or its message is cancelled.
It lives in Redis, so it survives a page reload and a worker restart.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from redis.asyncio import Redis

from dialog_worker.errors import ValidationError
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Script

# Most bytes of a resume's value (its JSON): it is written into the message's journal.
MAX_VALUE_BYTES = 65_536
MAX_INTERRUPT_ID_BYTES = 1024

# resolve-2.lua's answers, as `ResumeResult.status` says them.
RESUMED = "resumed"
ALREADY_RESUMED = "already_resumed"
UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True, slots=True)
class PendingInterrupt:
    """One interrupt a session waits on: its id (give it to `DialogClient.resume`), the
    message that asked (``msg_id``, ``seq``), the step's ``payload`` (any JSON), when it was
    asked (``created_at``, ms) and when it times out (``timeout_at``, ms; None: never)."""

    session_id: str
    interrupt_id: str
    msg_id: str
    seq: int
    payload: Any
    created_at: int
    timeout_at: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class ResumeResult:
    """What `DialogClient.resume` did. ``status``:

    - ``resumed``: applied now; the message runs again and its ``interrupt()`` returns the
      value.
    - ``already_resumed``: this interrupt was resumed before (a second resume is never
      applied twice); ``timed_out`` / ``cancelled`` / ``superseded``: it ended so before.
      Ended interrupts are remembered a day.
    - ``unknown``: the session waits on no such interrupt (a wrong id, or the session was
      reset or deleted).
    """

    session_id: str
    interrupt_id: str
    status: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pending_from_record(session_id: str, raw: bytes | str | None) -> list[PendingInterrupt]:
    """The parked interrupt of a session's await key ([] when there is none or it cannot be
    read: nothing read from Redis is trusted to be well-formed)."""
    if not raw:
        return []
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []
    if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
        return []
    try:
        payload = json.loads(rec.get("payload") or "null")
    except (ValueError, TypeError, RecursionError):
        payload = None
    timeout_at = _whole(rec.get("timeout_at"))
    return [
        PendingInterrupt(
            session_id=session_id,
            interrupt_id=rec["id"],
            msg_id=str(rec.get("msg_id", "")),
            seq=_whole(rec.get("seq")),
            payload=payload,
            created_at=_whole(rec.get("at")),
            timeout_at=timeout_at or None,
        )
    ]


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return 0
    return int(value)


async def pending(redis: Redis, keys: Keys, session_id: str) -> list[PendingInterrupt]:
    raw = await redis.get(keys.session(session_id).awaiting)
    return pending_from_record(session_id, raw)


def check_interrupt_id(interrupt_id: object) -> str:
    if (
        not isinstance(interrupt_id, str)
        or not interrupt_id
        or len(interrupt_id.encode("utf-8", "surrogatepass")) > MAX_INTERRUPT_ID_BYTES
    ):
        raise ValidationError(
            f"interrupt_id must be 1 to {MAX_INTERRUPT_ID_BYTES} bytes of text, got "
            f"{interrupt_id!r}"
        )
    return interrupt_id


def value_json(value: object) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"a resume's value must be JSON: {exc}") from None
    if len(text.encode("utf-8", "surrogatepass")) > MAX_VALUE_BYTES:
        raise ValidationError(f"a resume's value is at most {MAX_VALUE_BYTES} bytes of JSON")
    return text


async def resume(
    script: Script, keys: Keys, session_id: str, interrupt_id: str, value: object
) -> ResumeResult:
    answer = await script(
        keys=[keys.ready, keys.session_prefix],
        args=["resume", session_id, interrupt_id, value_json(value)],
    )
    kind = _text(answer[0])
    if kind == "resumed":
        status = RESUMED
    elif kind == "ended":
        status = ended_status(answer[1])
    else:
        status = UNKNOWN
    return ResumeResult(session_id, interrupt_id, status)


def ended_status(raw: object) -> str:
    """How an interrupt ended (its JSON in the session's interrupts hash), as a status."""
    try:
        how = json.loads(raw if isinstance(raw, bytes | str) else "")
    except (ValueError, RecursionError):
        return UNKNOWN
    if not isinstance(how, dict):
        return UNKNOWN
    if "value" in how:
        return ALREADY_RESUMED
    if how.get("timeout") is True:
        return "timed_out"
    ended = how.get("ended")
    return ended if ended in ("cancelled", "superseded") else UNKNOWN


async def wake_if_parked(script: Script, keys: Keys, session_id: str, msg_id: str) -> bool:
    """After a cancel of ``msg_id``: a session parked on it is looked at now (and its message
    ends cancelled) instead of waiting for its interrupt."""
    answer = await script(keys=[keys.ready, keys.session_prefix], args=["wake", session_id, msg_id])
    return _text(answer[0]) == "woken"


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
