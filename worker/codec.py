"""Validation of ids and texts, and decoding of inbound stream entries.

Validation runs before any key is built: an id that is refused here never reaches Redis.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from worker.errors import ValidationError

MAX_ID_BYTES = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_id(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{kind} must be a string, got {type(value).__name__}")
    if not value:
        raise ValidationError(f"{kind} must not be empty")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:
        raise ValidationError(f"{kind} is {size} bytes; at most {MAX_ID_BYTES} are allowed")
    if _CONTROL.search(value):
        raise ValidationError(f"{kind} must not contain control characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{kind} is not valid unicode text") from None
    return value


def check_text(text: object, max_bytes: int) -> str:
    if not isinstance(text, str):
        raise ValidationError(f"text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValidationError("text must not be empty")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValidationError("text is not valid unicode text") from None
    if size > max_bytes:
        raise ValidationError(f"text is {size} bytes; at most {max_bytes} are allowed")
    return text


class MalformedEntry(Exception):
    """The entry cannot be placed in any session's order: it is dead-lettered on its own."""

    def __init__(self, reason: str, session_id: str | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.session_id = session_id


@dataclasses.dataclass(slots=True)
class Message:
    session_id: str
    msg_id: str
    seq: int
    text: str
    enqueued_at_ms: int
    requeues: int
    fields: dict[str, str]
    # Set when the entry is well placed (session and seq are fine) but its content is refused:
    # it is dead-lettered as permanent in its turn, so the session's later messages proceed.
    problem: str | None = None

    def as_engine_input(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "msg_id": self.msg_id,
            "seq": self.seq,
            "text": self.text,
            "enqueued_at": self.enqueued_at_ms,
        }


def decode_entry(fields: Mapping[str, str], max_message_bytes: int) -> Message:
    fields = dict(fields)
    raw_session = fields.get("session_id")
    try:
        session_id = check_id("session_id", raw_session)
    except ValidationError as exc:
        raise MalformedEntry(str(exc), None) from None
    try:
        seq = int(fields.get("seq", ""))
        if seq < 1:
            raise ValueError
    except ValueError:
        raise MalformedEntry(
            f"seq must be a positive integer, got {fields.get('seq')!r}", session_id
        ) from None

    problem = None
    msg_id = fields.get("msg_id") or ""
    try:
        check_id("msg_id", msg_id)
        check_text(fields.get("text"), max_message_bytes)
    except ValidationError as exc:
        problem = str(exc)
    try:
        enqueued_at_ms = int(fields.get("enqueued_at", "0"))
        requeues = int(fields.get("requeues", "0"))
    except ValueError:
        enqueued_at_ms, requeues = 0, 0
        problem = problem or "enqueued_at and requeues must be integers"
    return Message(
        session_id=session_id,
        msg_id=msg_id,
        seq=seq,
        text=fields.get("text") or "",
        enqueued_at_ms=enqueued_at_ms,
        requeues=requeues,
        fields=fields,
        problem=problem,
    )


def decode_parked(payload: str, max_message_bytes: int) -> Message:
    """A handed-off message: its fields as the JSON array of pairs the scripts store."""
    flat = json.loads(payload)
    return decode_entry(dict(zip(flat[0::2], flat[1::2], strict=True)), max_message_bytes)


def pairs(fields: Mapping[str, object]) -> str:
    """Fields as the JSON array of name/value pairs the scripts unpack into XADD."""
    flat: list[str] = []
    for name, value in fields.items():
        flat += [name, str(value)]
    return json.dumps(flat, ensure_ascii=False)
