"""The console's reader of a timer as the scripts store it (cmsgpack of due ms, the
cancel-on-message flag and the flat field list): every format cmsgpack writes for them, and
anything else read as unreadable, never an exception."""

from __future__ import annotations

import random
import struct

from dialog_worker.store.codec import unpack_timer


def fixstr(value: bytes) -> bytes:
    return bytes([0xA0 | len(value)]) + value


def test_a_timer_payload_is_read_in_every_integer_width() -> None:
    fields = [b"text", b"wake up", b"timer", b"nudge"]
    body = bytes([0x90 | len(fields)]) + b"".join(fixstr(f) for f in fields)
    due = 1_796_127_009_961
    for head in (
        b"\xcf" + struct.pack(">Q", due),
        b"\xd3" + struct.pack(">q", due),
        b"\xcb" + struct.pack(">d", float(due)),
    ):
        assert unpack_timer(head + b"\x01" + body) == (
            due,
            True,
            {b"text": b"wake up", b"timer": b"nudge"},
        )
    assert unpack_timer(b"\x7f\x00" + body) == (
        127,
        False,
        {b"text": b"wake up", b"timer": b"nudge"},
    )
    assert unpack_timer(b"\xce" + struct.pack(">I", 70000) + b"\x00\x90") == (70000, False, {})


def test_anything_else_is_unreadable() -> None:
    good = b"\x05\x00\x92" + fixstr(b"text") + fixstr(b"hi")
    for bad in (
        b"",
        b"not msgpack",
        good[:-1],  # truncated
        good + b"\x00",  # trailing bytes
        b"\x05\x00\x91" + fixstr(b"text"),  # an odd field list
        b"\xcb" + struct.pack(">d", 1.5) + good[1:],  # not a whole number
        b"\xcb" + struct.pack(">d", float("nan")) + good[1:],
    ):
        assert unpack_timer(bad) is None, bad
    rng = random.Random(7)
    for _ in range(2000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(24)))
        unpack_timer(raw)  # never raises
