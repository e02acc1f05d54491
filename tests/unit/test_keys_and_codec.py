"""Key names (hash tags, escaping, no collisions), entry decoding, and the backoff curve."""

from __future__ import annotations

import itertools
import json
import random
from urllib.parse import unquote

import pytest

from worker.codec import MalformedEntry, Message, decode_entry, decode_parked, pairs
from worker.config import Settings
from worker.keys import Keys, SessionKeys, escape_tag
from worker.pipeline import backoff_ms

# ---------------------------------------------------------------------------------------------
# Redis Cluster key -> slot, as src/cluster.c keyHashSlot does it


def crc16_xmodem(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def hash_tag(key: str) -> bytes | None:
    """The bytes Redis hashes for ``key`` if it has a non-empty tag, else None."""
    raw = key.encode("utf-8")
    start = raw.find(b"{")
    if start == -1:
        return None
    end = raw.find(b"}", start + 1)
    if end == -1 or end == start + 1:
        return None
    return raw[start + 1 : end]


def key_slot(key: str) -> int:
    tag = hash_tag(key)
    return crc16_xmodem(key.encode("utf-8") if tag is None else tag) % 16384


def test_slot_helper_matches_redis() -> None:
    assert crc16_xmodem(b"123456789") == 0x31C3
    assert key_slot("foo") == 12182
    assert key_slot("bar") == 5061
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == crc16_xmodem(b"foo{}{bar}") % 16384
    assert hash_tag("foo{{bar}}zap") == b"{bar"
    assert hash_tag("foo{bar}{zap}") == b"bar"


# ---------------------------------------------------------------------------------------------
# Session keys

KEYS = Keys.from_settings(Settings())

TRICKY_IDS = [
    "a}b",
    "{x}",
    "a:lock",
    "a",
    "%7D",
    "%7B",
    "%25",
    "%",
    "{",
    "}",
    "}{",
    "{}",
    "a%",
    "a%25",
    "a%7D",
    "a}",
    "a{",
    "a}:lock",
    "a}:state",
    "a:s:{b}",
    "sesi-ñ-日本",
    "🙂{🙂}",
    "x" * 256,
    "}" * 256,
    "é" * 128,
]


def all_keys(sk: SessionKeys, msg_ids: list[str]) -> list[str]:
    return [sk.state, sk.lock, sk.parked, *(sk.dedupe(m) for m in msg_ids)]


def test_tricky_ids_are_distinct_and_256_byte_ids_are_at_the_limit() -> None:
    assert len(set(TRICKY_IDS)) == len(TRICKY_IDS)
    assert len("é" * 128) == 128 and len(("é" * 128).encode()) == 256


@pytest.mark.parametrize("session_id", TRICKY_IDS)
def test_all_keys_of_a_session_share_one_hash_tag_and_slot(session_id: str) -> None:
    sk = KEYS.session(session_id)
    keys = all_keys(sk, ["m1", "{evil}", "}", "{", "a}b{c}"])
    tags = {hash_tag(k) for k in keys}
    assert len(tags) == 1
    (tag,) = tags
    assert tag is not None
    assert b"{" not in tag and b"}" not in tag
    assert len({key_slot(k) for k in keys}) == 1


@pytest.mark.parametrize("session_id", TRICKY_IDS)
def test_hash_tag_decodes_back_to_the_session_id(session_id: str) -> None:
    tag = hash_tag(KEYS.session(session_id).state)
    assert tag is not None
    assert tag.decode() == escape_tag(session_id)
    assert unquote(tag.decode()) == session_id


def test_no_two_tricky_ids_share_any_key() -> None:
    msg_ids = ["m1", "lock", "state", ":lock", "{x}"]
    seen: dict[str, str] = {}
    for session_id in TRICKY_IDS:
        for key in all_keys(KEYS.session(session_id), msg_ids):
            assert key not in seen, f"{key!r} built for both {seen[key]!r} and {session_id!r}"
            seen[key] = session_id
    assert len(seen) == len(TRICKY_IDS) * (3 + len(msg_ids))


def test_no_two_tricky_ids_share_a_hash_tag() -> None:
    tags = [hash_tag(KEYS.session(s).state) for s in TRICKY_IDS]
    assert len(set(tags)) == len(TRICKY_IDS)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("%7B", "{"),
        ("%7D", "}"),
        ("%25", "%"),
        ("a%", "a%25"),
        ("a%7B", "a{"),
        ("%257B", "%7B"),
        ("a:lock", "a"),
        ("a}:lock", "a"),
    ],
)
def test_ids_designed_to_collide_under_naive_escaping_get_different_keys(
    one: str, other: str
) -> None:
    a, b = KEYS.session(one), KEYS.session(other)
    assert set(all_keys(a, ["m"])).isdisjoint(all_keys(b, ["m"]))
    assert hash_tag(a.state) != hash_tag(b.state)


def test_every_short_id_over_a_brace_and_percent_alphabet_gets_its_own_state_key() -> None:
    alphabet = "{}%7BDa:"
    ids = ["".join(p) for n in range(1, 5) for p in itertools.product(alphabet, repeat=n)]
    states = {KEYS.session(s).state for s in ids}
    assert len(states) == len(ids)


@pytest.mark.parametrize("msg_id", ["m1", "{x}", "}", "{", "a}b", "%7D", "ñ-日本", "z" * 256])
def test_dedupe_key_stays_in_the_state_keys_slot(msg_id: str) -> None:
    for session_id in ["a", "a}b", "{x}", "sesi-ñ-日本"]:
        sk = KEYS.session(session_id)
        assert hash_tag(sk.dedupe(msg_id)) == hash_tag(sk.state)
        assert key_slot(sk.dedupe(msg_id)) == key_slot(sk.state)


def test_dedupe_keys_differ_per_msg_id() -> None:
    sk = KEYS.session("a")
    ids = ["m1", "m2", "{m1}", "m1:", ":m1"]
    assert len({sk.dedupe(m) for m in ids}) == len(ids)


def test_session_keys_use_the_prefix_and_stream_keys_use_the_settings() -> None:
    keys = Keys.from_settings(
        Settings(stream="in", group="g", reply_stream="out", dlq_stream="dead", key_prefix="kp")
    )
    assert (keys.stream, keys.group, keys.replies, keys.dlq) == ("in", "g", "out", "dead")
    sk = keys.session("a")
    for key in all_keys(sk, ["m"]):
        assert key.startswith("kp:")
    assert Keys.from_settings(Settings(stream="in")).session("a").state.startswith("in:")


def test_two_deployments_with_different_streams_do_not_share_session_keys() -> None:
    one = Keys.from_settings(Settings(stream="one")).session("a")
    two = Keys.from_settings(Settings(stream="two")).session("a")
    assert set(all_keys(one, ["m"])).isdisjoint(all_keys(two, ["m"]))


# ---------------------------------------------------------------------------------------------
# decode_entry

MAX = 64


def entry(**overrides: str | None) -> dict[str, str]:
    fields = {
        "session_id": "s1",
        "msg_id": "m1",
        "seq": "3",
        "text": "nama saya Budi",
        "enqueued_at": "1700000000000",
    }
    for name, value in overrides.items():
        if value is None:
            fields.pop(name, None)
        else:
            fields[name] = value
    return fields


def test_decode_entry_of_a_good_entry() -> None:
    fields = entry(requeues="2", attempts="1")
    msg = decode_entry(fields, MAX)
    assert isinstance(msg, Message)
    assert (msg.session_id, msg.msg_id, msg.seq, msg.text) == ("s1", "m1", 3, "nama saya Budi")
    assert msg.enqueued_at_ms == 1_700_000_000_000
    assert msg.requeues == 2
    assert msg.problem is None
    assert msg.fields == fields
    assert msg.as_engine_input() == {
        "session_id": "s1",
        "msg_id": "m1",
        "seq": 3,
        "text": "nama saya Budi",
        "enqueued_at": 1_700_000_000_000,
    }


def test_decode_entry_copies_the_fields() -> None:
    fields = entry()
    msg = decode_entry(fields, MAX)
    msg.fields["x"] = "y"
    assert "x" not in fields


def test_requeues_defaults_to_zero() -> None:
    assert decode_entry(entry(), MAX).requeues == 0


def test_missing_enqueued_at_defaults_to_zero_without_a_problem() -> None:
    msg = decode_entry(entry(enqueued_at=None), MAX)
    assert msg.enqueued_at_ms == 0
    assert msg.problem is None


@pytest.mark.parametrize("session_id", [None, ""])
def test_missing_or_empty_session_id_is_malformed_without_a_session(
    session_id: str | None,
) -> None:
    with pytest.raises(MalformedEntry) as info:
        decode_entry(entry(session_id=session_id), MAX)
    assert info.value.session_id is None
    assert "session_id" in info.value.reason


@pytest.mark.parametrize("session_id", ["a\nb", "x" * 257])
def test_invalid_session_id_is_malformed_without_a_session(session_id: str) -> None:
    with pytest.raises(MalformedEntry) as info:
        decode_entry(entry(session_id=session_id), MAX)
    assert info.value.session_id is None


@pytest.mark.parametrize("seq", ["0", "-1", "x", "", "1.5", None])
def test_bad_seq_is_malformed_and_carries_the_session_id(seq: str | None) -> None:
    with pytest.raises(MalformedEntry) as info:
        decode_entry(entry(seq=seq), MAX)
    assert info.value.session_id == "s1"
    assert "seq" in info.value.reason


def test_seq_of_one_is_accepted() -> None:
    assert decode_entry(entry(seq="1"), MAX).seq == 1


@pytest.mark.parametrize(
    ("overrides", "word"),
    [
        ({"text": "x" * (MAX + 1)}, "bytes"),
        ({"text": "ñ" * (MAX // 2 + 1)}, "bytes"),
        ({"text": ""}, "empty"),
        ({"text": "   "}, "empty"),
        ({"text": None}, "text"),
        ({"msg_id": None}, "msg_id"),
        ({"msg_id": ""}, "msg_id"),
        ({"msg_id": "m\x00"}, "msg_id"),
        ({"msg_id": "m" * 257}, "msg_id"),
        ({"requeues": "x"}, "requeues"),
        ({"enqueued_at": "soon"}, "enqueued_at"),
    ],
)
def test_refused_content_sets_problem_instead_of_raising(
    overrides: dict[str, str | None], word: str
) -> None:
    msg = decode_entry(entry(**overrides), MAX)
    assert msg.problem is not None
    assert word in msg.problem
    assert (msg.session_id, msg.seq) == ("s1", 3)


def test_text_of_exactly_max_bytes_has_no_problem() -> None:
    assert decode_entry(entry(text="x" * MAX), MAX).problem is None
    assert decode_entry(entry(text="ñ" * (MAX // 2)), MAX).problem is None


def test_missing_msg_id_decodes_as_empty_string() -> None:
    msg = decode_entry(entry(msg_id=None), MAX)
    assert msg.msg_id == ""
    assert msg.problem is not None


def test_pairs_round_trips_through_decode_parked() -> None:
    fields = entry(text='kata "kutip" ñ 日本 🙂\n', requeues="1", source="1-0")
    payload = pairs(fields)
    flat = json.loads(payload)
    assert flat == [x for kv in fields.items() for x in kv]
    msg = decode_parked(payload, MAX)
    assert msg.fields == fields
    assert msg == decode_entry(fields, MAX)


def test_pairs_stringifies_values() -> None:
    msg = decode_parked(pairs({"session_id": "s", "msg_id": "m", "seq": 7, "text": "t"}), MAX)
    assert (msg.seq, msg.fields["seq"]) == (7, "7")


def test_decode_parked_of_a_malformed_entry_raises_malformed() -> None:
    with pytest.raises(MalformedEntry) as info:
        decode_parked(pairs(entry(seq="0")), MAX)
    assert info.value.session_id == "s1"


# ---------------------------------------------------------------------------------------------
# backoff_ms


class Extreme(random.Random):
    """An rng whose uniform() always returns its low (or high) end."""

    def __init__(self, high: bool) -> None:
        super().__init__(0)
        self.high = high

    def uniform(self, a: float, b: float) -> float:
        return b if self.high else a


def ceiling(attempt: int, base: int, top: int) -> int:
    return min(top, base * 2 ** max(0, attempt - 1))


@pytest.mark.parametrize(("base", "top"), [(50, 5000), (1, 1), (100, 150), (7, 1000)])
def test_backoff_is_never_above_max_and_at_least_half_the_ceiling(base: int, top: int) -> None:
    rng = random.Random(1234)
    for attempt in range(0, 40):
        for _ in range(50):
            value = backoff_ms(attempt, base, top, rng)
            assert value <= top
            assert ceiling(attempt, base, top) // 2 <= value <= ceiling(attempt, base, top)


@pytest.mark.parametrize("high", [False, True])
def test_backoff_bounds_hold_at_the_extremes_of_the_jitter(high: bool) -> None:
    for attempt in range(1, 30):
        value = backoff_ms(attempt, 50, 5000, Extreme(high))
        c = ceiling(attempt, 50, 5000)
        assert value == (c if high else c // 2)
        assert value <= 5000


def test_backoff_with_a_huge_attempt_stays_at_max() -> None:
    assert backoff_ms(10_000, 50, 5000, Extreme(True)) == 5000
    assert 2500 <= backoff_ms(10_000, 50, 5000, random.Random(3)) <= 5000


def test_backoff_grows_with_attempt_until_the_cap() -> None:
    # The lowest value at attempt n+1 is the highest at attempt n, so growth holds for any draw.
    rng = random.Random(99)
    # Below the cap (50 * 2**6 = 3200 at attempt 7; attempt 8 is capped at 5000, whose lower
    # half starts at 2500), so the ranges of consecutive attempts only touch.
    for attempt in range(1, 7):
        later = min(backoff_ms(attempt + 1, 50, 5000, rng) for _ in range(30))
        earlier = max(backoff_ms(attempt, 50, 5000, rng) for _ in range(30))
        assert later >= earlier
    lows = [backoff_ms(a, 50, 5000, Extreme(False)) for a in range(1, 9)]
    assert lows == sorted(lows) and len(set(lows)) == len(lows)


def test_backoff_is_deterministic_with_a_seeded_rng() -> None:
    one = [backoff_ms(a, 50, 5000, random.Random(42)) for a in range(1, 12)]
    two = [backoff_ms(a, 50, 5000, random.Random(42)) for a in range(1, 12)]
    assert one == two
    rng_a, rng_b = random.Random(7), random.Random(7)
    assert [backoff_ms(3, 50, 5000, rng_a) for _ in range(20)] == [
        backoff_ms(3, 50, 5000, rng_b) for _ in range(20)
    ]


def test_backoff_jitter_spreads_values() -> None:
    rng = random.Random(5)
    assert len({backoff_ms(6, 50, 5000, rng) for _ in range(50)}) > 10
