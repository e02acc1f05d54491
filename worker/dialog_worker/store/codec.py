"""Validation of ids and texts, and decoding of inbound stream entries.

Entries are read as bytes and decoded one by one: one entry that is not UTF-8 is that entry's
problem, never its batch-mates'. The intake script has already refused what it can check
cheaply (see lua/intake-5.lua); what is left here is the content: text and extra fields must
be UTF-8.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import struct
from collections.abc import Sequence
from typing import Any

import orjson

from dialog_worker.config import tenant_pattern_forms
from dialog_worker.errors import ValidationError
from dialog_worker.tracing import TRACE_FIELD_BYTES

MAX_ID_BYTES = 256
# Fields a producer may add besides session_id, text and msg_id (they reach the engine as
# message["meta"]).
MAX_EXTRA_FIELDS = 32
# Names the worker gives meaning to: a producer-written value is ignored (not passed on).
# The tenant of a message that names none (no tenant field, no DIALOG_TENANT_PATTERN match).
DEFAULT_TENANT = "default"
# Longest tenant name: tenants name keys and metrics' rows, never unbounded text.
MAX_TENANT_BYTES = 64


RESERVED_FIELDS = frozenset(
    {
        "session_id",
        "text",
        "msg_id",
        "multitask",
        "seq",
        "requeues",
        "attempts",
        "enqueued_at",
        "entry_id",
        "expires_at",
    }
)
# expires_at is unix seconds (a fraction allowed); a value this large is milliseconds by
# mistake (the year 5138), refused rather than read as "never".
EXPIRES_AT_MAX_S = 10**11
_EXPIRES_AT = re.compile(r"[0-9]{1,15}(\.[0-9]{1,6})?")


def check_expires_at(value: object) -> str:
    """``expires_at`` for `DialogClient.send`: unix seconds as the field's text."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValidationError(f"expires_at must be unix seconds (a number), got {value!r}")
    if not 0 <= value < EXPIRES_AT_MAX_S:
        raise ValidationError(
            f"expires_at {value!r} is out of range: it is unix seconds, not milliseconds"
        )
    return f"{value:.3f}".rstrip("0").rstrip(".")


def parse_expires_at(raw: bytes | str) -> int:
    """A message's ``expires_at`` field (unix seconds) as unix milliseconds, or
    MalformedEntry saying why it is not one."""
    value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if not _EXPIRES_AT.fullmatch(value):
        raise MalformedEntry(
            f"expires_at {value[:40]!r} is not unix seconds (digits, optionally a fraction)"
        )
    seconds = float(value)
    if seconds >= EXPIRES_AT_MAX_S:
        raise MalformedEntry(
            f"expires_at {value!r} is too large: it is unix seconds, not milliseconds"
        )
    return round(seconds * 1000)


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


# A message's priority inside its tenant (the scripts read one digit; anything else is 5).
PRIORITIES = range(10)


def check_tenant(value: object) -> str:
    """A ``tenant`` field a client sends: what intake takes as a tenant name (`tenant_of`),
    refused here rather than counted as the default tenant there."""
    if not isinstance(value, str) or _tenant_name(value.encode("utf-8", "surrogatepass")) is None:
        raise ValidationError(
            f"tenant must be 1 to {MAX_TENANT_BYTES} bytes of UTF-8 text without spaces or "
            f"control characters, got {str(value)[:80]!r}"
        )
    return value


def check_priority(value: object) -> str:
    """A ``priority`` field a client sends: an integer 0-9 (higher first), as intake reads it
    (one digit), refused here rather than counted as 5 there."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in PRIORITIES:
        raise ValidationError(f"priority must be an integer from 0 to 9, got {value!r}")
    return str(value)


def priority_of(value: object) -> int:
    """A message's priority as the scripts read its ``priority`` field: one ASCII digit, anything
    else (or none) is 5."""
    if isinstance(value, str) and len(value) == 1 and value in "0123456789":
        return int(value)
    return 5


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
    expires_at_ms: int | None = None  # from the message's expires_at field
    tenant: str = DEFAULT_TENANT  # tenant_of: its tenant field, or DIALOG_TENANT_PATTERN
    # A merged burst (multitask=merge): every part, the last one this message's own
    # (merged_message); empty for a message alone.
    parts: list[Message] = dataclasses.field(default_factory=list)

    def as_engine_input(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "session_id": self.session_id,
            "msg_id": self.msg_id,
            "seq": self.seq,
            "text": self.text,
            "entry_id": self.entry_id,
            "enqueued_at": self.enqueued_at_ms,
            "attempt": self.attempt,
            "meta": dict(self.meta),
        }
        if self.parts:
            shown["parts"] = [
                {
                    "msg_id": p.msg_id,
                    "seq": p.seq,
                    "text": p.text,
                    "entry_id": p.entry_id,
                    "enqueued_at": p.enqueued_at_ms,
                    "meta": dict(p.meta),
                }
                for p in self.parts
            ]
        return shown


def merged_message(parts: list[Message]) -> Message:
    """One step's message for a merged burst: the last part's identity (its msg_id, seq,
    entry id, meta and expiry: it answers), the parts' texts one per line, the first part's
    arrival, and every part in `parts`."""
    last = parts[-1]
    return dataclasses.replace(
        last,
        text="\n".join(p.text for p in parts),
        enqueued_at_ms=parts[0].enqueued_at_ms,
        parts=list(parts),
    )


@functools.lru_cache(maxsize=8)
def _tenant_regex(pattern: str) -> re.Pattern[bytes]:
    # The same matching as the scripts' (config.tenant_pattern_forms): over the id's bytes.
    return re.compile(tenant_pattern_forms(pattern)[1])


def tenant_of(fields: dict[bytes, bytes], session_id: str, pattern: str = "") -> str:
    """The tenant a message belongs to: its ``tenant`` field when that is a usable name (UTF-8,
    1 to MAX_TENANT_BYTES bytes, no control characters or spaces), else the group of
    ``pattern`` (DIALOG_TENANT_PATTERN) matched against the session id's UTF-8 bytes, else
    `DEFAULT_TENANT`. The scripts compute the same (tenant_of in lua/_common.lua). Never
    raises: a message with an unusable tenant field belongs to the default tenant, it is not
    refused for it."""
    raw = fields.get(b"tenant")
    if raw is not None:
        name = _tenant_name(raw)
        if name is not None:
            return name
    if pattern:
        match = _tenant_regex(pattern).search(session_id.encode("utf-8", "surrogatepass"))
        if match is not None and match.group(1):
            name = _tenant_name(match.group(1))
            if name is not None:
                return name
    return DEFAULT_TENANT


def _tenant_name(raw: bytes) -> str | None:
    if not 0 < len(raw) <= MAX_TENANT_BYTES or any(b <= 32 or b == 127 for b in raw):
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def entry_time_ms(entry_id: str) -> int:
    """The time part of a stream entry id (when it was appended, Redis clock)."""
    head = entry_id.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def fields_dict(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def decode_message(
    session_id: str,
    seq: int,
    entry_id: str,
    attempt: int,
    fields: dict[bytes, bytes],
    tenant_pattern: str = "",
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
    raw_expires = fields.get(b"expires_at")
    expires_at_ms = None if raw_expires is None else parse_expires_at(raw_expires)
    meta: dict[str, str] = {}
    for raw_name, raw_value in fields.items():
        try:
            name = raw_name.decode("utf-8")
            if name in RESERVED_FIELDS:
                continue
            meta[name] = raw_value.decode("utf-8")
        except UnicodeDecodeError:
            if raw_name in TRACE_FIELD_BYTES:
                continue  # bad trace context is ignored (and counted by tracing), never fatal
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
        expires_at_ms=expires_at_ms,
        tenant=tenant_of(fields, session_id, tenant_pattern),
    )


def text(value: bytes | str) -> str:
    """A value from Redis as text (ids and numbers the scripts wrote or validated)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# Python text may hold lone surrogates (a UTF-16 pair cut in two, e.g. an API message
# truncated mid-emoji). They are not UTF-8: redis-py refuses to encode them, and Redis' cjson
# refuses their JSON escape (\ud83d). Everything the worker sends to Redis goes through the two
# helpers below, which write each one as the visible text \udXXX instead.
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON = json.JSONEncoder(ensure_ascii=False)


def redis_text(value: str) -> str:
    """`value` as valid UTF-8 text, lone surrogates written as the text ``\\udXXX``."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", value)


def json_bytes(value: Any) -> bytes:
    """JSON for Redis: UTF-8 (not ASCII escapes), lone surrogates as the text ``\\udXXX``.

    orjson writes the common case (the standard library's encoding of a session's state was a
    large share of a step's CPU); what it refuses (a lone surrogate, an integer past 64 bits, a key
    that is not a string) the standard library writes as before. Values are JSON-safe here
    (engine states are checked): orjson would write NaN as null."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError
        pass
    dumped = _JSON.encode(value)
    try:
        return dumped.encode("utf-8")  # the common case: no lone surrogate, no second pass
    except UnicodeEncodeError:
        pass
    # A surrogate can only stand inside a JSON string, where "\\\\" is one backslash.
    return _SURROGATE.sub(lambda m: f"\\\\u{ord(m.group()):04x}", dumped).encode("utf-8")


# orjson reads an integer past 64 bits as a float; any run of 19 digits might be one. Found
# with two passes in C (every digit made "0", then a substring search): a regular expression
# scanning for it took twice as long as the standard library's whole decode.
_DIGITS_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS = b"0" * 19


def json_loads(doc: bytes) -> Any:
    """A JSON document from Redis, read as the standard library reads it: by orjson when that
    gives the same result, else by the standard library (NaN, a lone surrogate escape, an
    integer past 64 bits, text that is not UTF-8)."""
    if _LONG_DIGITS not in doc.translate(_DIGITS_AS_ZEROS):
        try:
            return orjson.loads(doc)
        except orjson.JSONDecodeError:
            pass
    return json.loads(doc)


def unpack_custody(raw: bytes) -> tuple[str, dict[bytes, bytes]] | None:
    """The entry id and fields of a sequenced message as intake stored them (the q<seq> field
    of its session's state: cmsgpack of the id and the flat field list, see lua/_common.lua),
    or None when the value is not in that format (e.g. a plain entry id written before
    custody)."""
    try:
        entry_id, pos = _unpack_str(raw, 0)
        flat, pos = _unpack_flat(raw, pos)
    except (IndexError, ValueError, struct.error):
        return None
    if pos != len(raw) or len(flat) % 2:
        return None
    return entry_id.decode("utf-8", "replace"), fields_dict(flat)


def unpack_timer(raw: bytes) -> tuple[int, bool, dict[bytes, bytes]] | None:
    """A timer as the scripts store it (a t:<name> field of its session's timers hash:
    cmsgpack of the due time in ms, 1 when a user's message cancels it, and the flat field
    list of the message it appends, see lua/_common.lua set_timer), or None when the value
    is not in that format."""
    try:
        due, pos = _unpack_int(raw, 0)
        on_message, pos = _unpack_int(raw, pos)
        flat, pos = _unpack_flat(raw, pos)
    except (IndexError, ValueError, struct.error):
        return None
    if pos != len(raw) or len(flat) % 2:
        return None
    return due, on_message == 1, fields_dict(flat)


def _unpack_flat(raw: bytes, pos: int) -> tuple[list[bytes], int]:
    """A msgpack array of strings (a flat name/value list) at `pos`, and the position after."""
    count, pos = _unpack_array_header(raw, pos)
    flat = []
    for _ in range(count):
        value, pos = _unpack_str(raw, pos)
        flat.append(value)
    return flat, pos


def _unpack_int(raw: bytes, pos: int) -> tuple[int, int]:
    tag = raw[pos]
    if tag <= 0x7F:
        return tag, pos + 1
    if tag >= 0xE0:
        return tag - 0x100, pos + 1
    formats = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h"}
    formats |= {0xD2: ">i", 0xD3: ">q", 0xCB: ">d"}
    if tag not in formats:
        raise ValueError(f"not a number: 0x{tag:02x}")
    value = struct.unpack_from(formats[tag], raw, pos + 1)[0]
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("not a whole number")
    return int(value), pos + 1 + struct.calcsize(formats[tag])


def _unpack_str(raw: bytes, pos: int) -> tuple[bytes, int]:
    tag = raw[pos]
    if 0xA0 <= tag <= 0xBF:
        size, pos = tag & 0x1F, pos + 1
    elif tag in (0xD9, 0xC4):
        size, pos = raw[pos + 1], pos + 2
    elif tag in (0xDA, 0xC5):
        size, pos = struct.unpack_from(">H", raw, pos + 1)[0], pos + 3
    elif tag in (0xDB, 0xC6):
        size, pos = struct.unpack_from(">I", raw, pos + 1)[0], pos + 5
    else:
        raise ValueError(f"not a string: 0x{tag:02x}")
    if pos + size > len(raw):
        raise ValueError("truncated")
    return raw[pos : pos + size], pos + size


def _unpack_array_header(raw: bytes, pos: int) -> tuple[int, int]:
    tag = raw[pos]
    if 0x90 <= tag <= 0x9F:
        return tag & 0x0F, pos + 1
    if tag == 0xDC:
        return struct.unpack_from(">H", raw, pos + 1)[0], pos + 3
    if tag == 0xDD:
        return struct.unpack_from(">I", raw, pos + 1)[0], pos + 5
    raise ValueError(f"not an array: 0x{tag:02x}")
