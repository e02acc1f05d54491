"""What the reply side parses from untrusted bytes: a message's expires_at (unix seconds,
never milliseconds), and a reply event's bubbles, no_reply and echoed fields (anyone with XADD
can write the reply stream: odd values never raise, large ones are not parsed)."""

from __future__ import annotations

import json

import pytest

from dialog_worker.client.replies import MAX_BUBBLES_FIELD_BYTES, reply_from_entry
from dialog_worker.errors import ValidationError
from dialog_worker.store.codec import MalformedEntry, check_expires_at, decode_message

CORE = {
    b"session_id": b"s1",
    b"msg_id": b"m1",
    b"seq": b"3",
    b"outcome": b"applied",
    b"reply": b"Pick",
    b"produced_at": b"1",
    b"entry_id": b"1-0",
}


def expires(raw: bytes) -> int | None:
    fields = {b"session_id": b"s", b"text": b"hi", b"expires_at": raw}
    return decode_message("s", 1, "1-0", 1, fields).expires_at_ms


def test_expires_at_is_unix_seconds_and_anything_else_is_malformed() -> None:
    assert expires(b"1767225600") == 1_767_225_600_000
    assert expires(b"1767225600.25") == 1_767_225_600_250
    assert expires(b"99999999999") == 99_999_999_999_000  # the largest accepted second
    assert decode_message("s", 1, "1-0", 1, {b"text": b"hi"}).expires_at_ms is None
    for raw, why in [
        (b"100000000000", "not milliseconds"),  # one past: as large as milliseconds
        (b"1767225600000", "not milliseconds"),
        (b"soon", "is not unix seconds"),
        (b"-1", "is not unix seconds"),
        (b"1e9", "is not unix seconds"),
        (b"", "is not unix seconds"),
        (b"\xff", "is not unix seconds"),
    ]:
        with pytest.raises(MalformedEntry, match=why):
            expires(raw)
    # Not in meta: the worker reads it itself.
    msg = decode_message("s", 1, "1-0", 1, {b"text": b"hi", b"expires_at": b"5", b"k": b"v"})
    assert msg.meta == {"k": "v"}


def test_the_client_sends_expires_at_as_seconds_text() -> None:
    assert check_expires_at(1767225600) == "1767225600"
    assert check_expires_at(1767225600.5) == "1767225600.5"
    for bad in (True, "1", float("nan"), -1, 1e11):
        with pytest.raises(ValidationError):
            check_expires_at(bad)


def test_a_reply_event_gives_its_bubbles_no_reply_and_echoed_fields() -> None:
    bubbles = [{"text": "Pick", "data": {"buttons": [{"title": "Ya"}]}}]
    rich = {**CORE, b"bubbles": json.dumps(bubbles).encode(), b"channel": b"wa"}
    reply = reply_from_entry(b"9-0", rich, "dialog-replies")
    assert (reply.bubbles, reply.no_reply, reply.echo) == (bubbles, False, {"channel": "wa"})
    assert reply.as_dict()["bubbles"] == bubbles
    silent = reply_from_entry(b"9-0", {**CORE, b"no_reply": b"1"}, "dialog-replies")
    assert silent.no_reply and silent.as_dict()["no_reply"] is True
    plain = reply_from_entry(b"9-0", CORE, "dialog-replies")
    assert not {"bubbles", "no_reply", "echo"} & set(plain.as_dict())  # printed as always


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b'{"text": "a dict, not a list"}',
        b'["not a dict"]',
        b"[" * 100_000,
        json.dumps([{"text": "x" * MAX_BUBBLES_FIELD_BYTES}]).encode(),
        b"\xff\xfe",
    ],
)
def test_a_forged_bubbles_field_is_ignored_not_raised(raw: bytes) -> None:
    reply = reply_from_entry(b"9-0", {**CORE, b"bubbles": raw}, "dialog-replies")
    assert reply.bubbles is None and reply.text == "Pick"
