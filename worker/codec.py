"""Validation of ids and texts, and decoding of inbound stream entries.

Entries are read as bytes and decoded one by one: one entry that is not UTF-8 is that entry's
problem, never its batch-mates'. The intake script has already refused what it can check
cheaply (see lua/intake-5.lua); what is left here is the content: text and extra fields must
be UTF-8.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from dialog_worker.errors import ValidationError

MAX_ID_BYTES = 256
# Fields a producer may add besides session_id, text and msg_id (they reach the engine as
# message["meta"]).
MAX_EXTRA_FIELDS = 32
# Names the worker gives meaning to: a producer-written value is ignored (not passed on).
RESERVED_FIELDS = frozenset(
    {"session_id", "text", "msg_id", "seq", "requeues", "attempts", "enqueued_at", "entry_id"}
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_id(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{kind} must be a string, got {type(value).__name__}")
    if not value:
        raise ValidationError(f"{kind} must not be empty")
    if not value.strip():
        raise ValidationError(f"{kind} must not be blank")
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


def check_meta(name: str, value: object) -> str:
    """An extra field of a message (reaches the engine as message["meta"][name])."""
    check_id("meta field name", name)
    if not isinstance(value, str):
        raise ValidationError(f"meta field {name!r} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"meta field {name!r} is not valid unicode text") from None
    return value


class MalformedEntry(Exception):
    """The entry's content cannot be given to the engine: it is dead-lettered in its turn."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(slots=True)
class Message:
    session_id: str
    msg_id: str
    seq: int
    text: str
    entry_id: str
    enqueued_at_ms: int
    attempt: int
    meta: dict[str, str]

    def as_engine_input(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "msg_id": self.msg_id,
            "seq": self.seq,
            "text": self.text,
            "entry_id": self.entry_id,
            "enqueued_at": self.enqueued_at_ms,
            "attempt": self.attempt,
            "meta": dict(self.meta),
        }


def entry_time_ms(entry_id: str) -> int:
    """The time part of a stream entry id (when it was appended, Redis clock)."""
    head = entry_id.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def fields_dict(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def decode_message(
    session_id: str, seq: int, entry_id: str, attempt: int, fields: dict[bytes, bytes]
) -> Message:
    """The engine's view of a sequenced entry, or MalformedEntry naming what is wrong."""
    try:
        text = fields.get(b"text", b"").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedEntry(
            f"text is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    raw_msg_id = fields.get(b"msg_id")
    msg_id = raw_msg_id.decode("utf-8") if raw_msg_id is not None else entry_id
    meta: dict[str, str] = {}
    for raw_name, raw_value in fields.items():
        try:
            name = raw_name.decode("utf-8")
            if name in RESERVED_FIELDS:
                continue
            meta[name] = raw_value.decode("utf-8")
        except UnicodeDecodeError:
            shown = raw_name.decode("utf-8", "replace")
            raise MalformedEntry(f"field {shown!r} is not valid UTF-8") from None
    return Message(
        session_id=session_id,
        msg_id=msg_id,
        seq=seq,
        text=text,
        entry_id=entry_id,
        enqueued_at_ms=entry_time_ms(entry_id),
        attempt=attempt,
        meta=meta,
    )


def text(value: bytes | str) -> str:
    """A value from Redis as text (ids and numbers the scripts wrote or validated)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
