"""Key names (hash tags, escaping, no collisions), entry decoding, and the backoff curve."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable
from urllib.parse import unquote

import hypothesis
import hypothesis.strategies as st
import pytest

from dialog_worker.config import Settings
from dialog_worker.daemon.failures import retry_delay_ms
from dialog_worker.store.codec import (
    MalformedEntry,
    decode_message,
    entry_time_ms,
    json_bytes,
    json_loads,
    redis_text,
)
from dialog_worker.store.keys import Keys, SessionKeys, escape_tag, stream_tag

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
    return [sk.state, sk.lock, *(sk.dedupe(m) for m in msg_ids)]


def test_tricky_ids_are_distinct_and_256_byte_ids_are_at_the_limit() -> None:
    assert len(set(TRICKY_IDS)) == len(TRICKY_IDS)
    assert len("é" * 128) == 128 and len(("é" * 128).encode()) == 256


@pytest.mark.parametrize("session_id", TRICKY_IDS)
def test_all_keys_of_a_session_share_the_streams_slot(session_id: str) -> None:
    """The intake and commit scripts touch the stream, the ready set and many sessions' keys
    in one call: on Redis Cluster they must all live in the stream's slot."""
    sk = KEYS.session(session_id)
    keys = [*all_keys(sk, ["m1", "{evil}", "}", "{", "a}b{c}"]), KEYS.ready]
    assert {hash_tag(k) for k in keys} == {b"dialog"}
    assert {key_slot(k) for k in keys} == {key_slot(KEYS.stream)}


def escaped_id(key: str) -> str:
    """The id segment of a session key: between the brace after the ``:s:`` prefix and the
    next closing brace."""
    rest = key[len(KEYS.session_prefix) :]
    assert rest.startswith("{")
    return rest[1 : rest.index("}")]


@pytest.mark.parametrize("session_id", TRICKY_IDS)
def test_the_id_segment_decodes_back_to_the_session_id(session_id: str) -> None:
    segment = escaped_id(KEYS.session(session_id).state)
    assert segment == escape_tag(session_id)
    assert "{" not in segment and "}" not in segment
    assert unquote(segment) == session_id


def test_a_stream_name_with_its_own_hash_tag_keeps_its_slot() -> None:
    keys = Keys.from_settings(Settings(stream="chat{eu}in", key_prefix="kp"))
    assert stream_tag("chat{eu}in") == "eu"
    assert key_slot(keys.ready) == key_slot(keys.stream)
    assert key_slot(keys.session("a}b").state) == key_slot(keys.stream)


def test_no_two_tricky_ids_share_any_key() -> None:
    msg_ids = ["m1", "lock", "state", ":lock", "{x}"]
    seen: dict[str, str] = {}
    for session_id in TRICKY_IDS:
        for key in all_keys(KEYS.session(session_id), msg_ids):
            assert key not in seen, f"{key!r} built for both {seen[key]!r} and {session_id!r}"
            seen[key] = session_id
    assert len(seen) == len(TRICKY_IDS) * (2 + len(msg_ids))


def test_no_two_tricky_ids_share_an_id_segment() -> None:
    segments = [escaped_id(KEYS.session(s).state) for s in TRICKY_IDS]
    assert len(set(segments)) == len(TRICKY_IDS)


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
    assert escaped_id(a.state) != escaped_id(b.state)


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
# decode_message: what the intake script left to Python (UTF-8 of the content)


def fields(**overrides: bytes | None) -> dict[bytes, bytes]:
    found = {b"session_id": b"s1", b"text": "nama saya Budi ñ".encode(), b"msg_id": b"m1"}
    for name, value in overrides.items():
        if value is None:
            found.pop(name.encode(), None)
        else:
            found[name.encode()] = value
    return found


def test_decode_message_gives_the_engine_every_documented_key() -> None:
    msg = decode_message("s1", 3, "1700000000000-5", 2, fields(channel=b"web", lang=b"id"))
    assert msg.as_engine_input() == {
        "session_id": "s1",
        "msg_id": "m1",
        "seq": 3,
        "text": "nama saya Budi ñ",
        "entry_id": "1700000000000-5",
        "enqueued_at": 1_700_000_000_000,
        "attempt": 2,
        "meta": {"channel": "web", "lang": "id"},
    }


def test_msg_id_defaults_to_the_entry_id() -> None:
    assert decode_message("s1", 1, "5-0", 1, fields(msg_id=None)).msg_id == "5-0"


@pytest.mark.parametrize("name", ["seq", "requeues", "attempts", "enqueued_at", "entry_id"])
def test_producer_written_internal_fields_are_ignored(name: str) -> None:
    msg = decode_message("s1", 4, "9-0", 1, fields(**{name: b"10000000000000000000000"}))
    assert (msg.seq, msg.enqueued_at_ms, msg.attempt, msg.entry_id) == (4, 9, 1, "9-0")
    assert name not in msg.meta


@pytest.mark.parametrize(
    "bad",
    [{"text": b"\xff\xfe"}, {"text": b"ok \xc3"}, {"note": b"\xed\xa0\x80"}, {"n\xffame": b"x"}],
)
def test_content_that_is_not_utf8_is_malformed(bad: dict[str, bytes]) -> None:
    raw = fields()
    raw.update({k.encode("latin-1"): v for k, v in bad.items()})
    with pytest.raises(MalformedEntry) as info:
        decode_message("s1", 1, "1-0", 1, raw)
    assert "UTF-8" in info.value.reason


def test_the_engine_gets_a_copy_of_meta() -> None:
    msg = decode_message("s1", 1, "1-0", 1, fields(channel=b"web"))
    msg.as_engine_input()["meta"]["channel"] = "changed"
    assert msg.meta == {"channel": "web"}


@pytest.mark.parametrize(("entry_id", "ms"), [("1700000000000-0", 1_700_000_000_000), ("x-1", 0)])
def test_entry_time_is_the_ms_part_of_the_id(entry_id: str, ms: int) -> None:
    assert entry_time_ms(entry_id) == ms


# ---------------------------------------------------------------------------------------------
# retry_delay_ms (backoff)


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
            value = retry_delay_ms(attempt, base, top, rng=rng)
            assert value <= top
            assert ceiling(attempt, base, top) // 2 <= value <= ceiling(attempt, base, top)


@pytest.mark.parametrize("high", [False, True])
def test_backoff_bounds_hold_at_the_extremes_of_the_jitter(high: bool) -> None:
    for attempt in range(1, 30):
        value = retry_delay_ms(attempt, 50, 5000, rng=Extreme(high))
        c = ceiling(attempt, 50, 5000)
        assert value == (c if high else c // 2)
        assert value <= 5000


def test_backoff_with_a_huge_attempt_stays_at_max() -> None:
    assert retry_delay_ms(10_000, 50, 5000, rng=Extreme(True)) == 5000
    assert 2500 <= retry_delay_ms(10_000, 50, 5000, rng=random.Random(3)) <= 5000


def test_backoff_grows_with_attempt_until_the_cap() -> None:
    # The lowest value at attempt n+1 is the highest at attempt n, so growth holds for any draw.
    rng = random.Random(99)
    # Below the cap (50 * 2**6 = 3200 at attempt 7; attempt 8 is capped at 5000, whose lower
    # half starts at 2500), so the ranges of consecutive attempts only touch.
    for attempt in range(1, 7):
        later = min(retry_delay_ms(attempt + 1, 50, 5000, rng=rng) for _ in range(30))
        earlier = max(retry_delay_ms(attempt, 50, 5000, rng=rng) for _ in range(30))
        assert later >= earlier
    lows = [retry_delay_ms(a, 50, 5000, rng=Extreme(False)) for a in range(1, 9)]
    assert lows == sorted(lows) and len(set(lows)) == len(lows)


def test_backoff_is_deterministic_with_a_seeded_rng() -> None:
    one = [retry_delay_ms(a, 50, 5000, rng=random.Random(42)) for a in range(1, 12)]
    two = [retry_delay_ms(a, 50, 5000, rng=random.Random(42)) for a in range(1, 12)]
    assert one == two
    rng_a, rng_b = random.Random(7), random.Random(7)
    assert [retry_delay_ms(3, 50, 5000, rng=rng_a) for _ in range(20)] == [
        retry_delay_ms(3, 50, 5000, rng=rng_b) for _ in range(20)
    ]


def test_backoff_jitter_spreads_values() -> None:
    rng = random.Random(5)
    assert len({retry_delay_ms(6, 50, 5000, rng=rng) for _ in range(50)}) > 10


def test_state_json_is_utf8_and_writes_a_lone_surrogate_as_visible_text() -> None:
    # Non-ASCII stays as UTF-8 (not \u escapes); a lone surrogate, which is not UTF-8 and
    # which Redis' cjson refuses as an escape, becomes the six characters \udXXX.
    assert json_bytes({"t": "héllo ☕"}) == '{"t":"héllo ☕"}'.encode()
    out = json_bytes({"t": "cut \ud83d here", "k": ["\udfff"]})
    assert out == b'{"t": "cut \\\\ud83d here", "k": ["\\\\udfff"]}'
    assert json.loads(out) == {"t": "cut \\ud83d here", "k": ["\\udfff"]}


def _same(a: object, b: object) -> bool:
    """Equal, and of the same types all the way down (2**70 == float(2**70) in Python)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


# What a state holds: JSON-safe values, with the integers and texts that a fast JSON library
# treats differently from the standard library (past 64 bits, lone surrogates).
_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
_KEYS = _TEXT | st.integers() | st.booleans() | st.none()
_JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(_JSON_VALUES)
def test_a_state_reads_back_as_the_standard_library_writes_and_reads_it(value: object) -> None:
    # A lone surrogate is stored as visible text (above); everything else reads back as the
    # standard library would write and read it (integers as integers, keys as strings),
    # whichever library reads it.
    expected = json.loads(json.dumps(_visible(value), ensure_ascii=False))
    assert _same(json_loads(json_bytes(value)), expected)
    assert _same(json.loads(json_bytes(value)), expected)


def _visible(value: object) -> object:
    """value as json_bytes stores it: lone surrogates as the text \\udXXX."""
    if isinstance(value, str):
        return redis_text(value)
    if isinstance(value, list):
        return [_visible(v) for v in value]
    if isinstance(value, dict):
        return {redis_text(k) if isinstance(k, str) else k: _visible(v) for k, v in value.items()}
    return value


# Documents as anyone may have written them: the standard library's output with NaN,
# infinities, ASCII escapes of lone surrogates, long numbers; and bytes that are not JSON.
_DOCS = (
    st.builds(
        lambda v, ascii_: json.dumps(v, ensure_ascii=ascii_).encode("utf-8", "surrogatepass"),
        st.recursive(
            _SCALARS | st.floats(),
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
            max_leaves=12,
        ),
        st.booleans(),
    )
    | st.binary(max_size=40)
    | st.sampled_from(
        [
            b"NaN",
            b"[1e400]",
            b"[-1e400]",
            b"[12345678901234567890123]",
            b'"\\ud800"',
            b'\xef\xbb\xbf{"a": 1}',
            b'{"a": 1, "a": 2}',
            b"[" * 2000 + b"]" * 2000,
            b'"\xff"',
            b"[-0]",
            b"[1.00000000000000000001]",
            b'"a\x01b"',
        ]
    )
)


def _outcome(read: Callable[[bytes], object], doc: bytes) -> tuple[str, object]:
    try:
        return "value", read(doc)
    except (ValueError, RecursionError) as exc:
        return "error", type(exc)


@hypothesis.settings(max_examples=500, deadline=None)
@hypothesis.given(_DOCS)
def test_a_document_is_read_exactly_as_the_standard_library_reads_it(doc: bytes) -> None:
    kind, got = _outcome(json_loads, doc)
    want_kind, want = _outcome(json.loads, doc)
    assert kind == want_kind
    if kind == "value":
        assert _same(got, want)
    else:
        assert got is want


@pytest.mark.parametrize("session_id", TRICKY_IDS)
def test_a_jobs_cancel_mark_is_the_sessions_mark_of_its_message(session_id: str) -> None:
    """The cancel watch asks each running job for its mark's key every interval; the job
    builds it once, and it is the key `cancel` writes."""
    from dialog_worker.daemon.pipeline import Job

    job = Job(KEYS, session_id, "t", 1, "1-0", {}, b"", 0, 1, "", "")
    assert job.cancel_mark() == KEYS.session(session_id).cancel_mark("")  # not kept
    job.msg_id = "m{1}%"
    assert job.cancel_mark() == KEYS.session(session_id).cancel_mark("m{1}%")
    assert job.cancel_mark() is job.cancel_mark()  # built once


def test_a_message_belongs_to_its_tenant_field_else_the_pattern_else_the_default() -> None:
    from dialog_worker.store.codec import DEFAULT_TENANT, tenant_of

    assert tenant_of({b"tenant": b"acme"}, "globex:7", r"^([^:]+):") == "acme"
    assert tenant_of({}, "globex:7", r"^([^:]+):") == "globex"
    assert tenant_of({}, "globex:7") == DEFAULT_TENANT
    assert tenant_of({}, "no-colon", r"^([^:]+):") == DEFAULT_TENANT
    # An unusable tenant field (too long, a space, a control character, not UTF-8) is ignored.
    for bad in (b"x" * 65, b"a b", b"a\nb", b"\xff", b""):
        assert tenant_of({b"tenant": bad}, "globex:7", r"^([^:]+):") == "globex"
    assert tenant_of({b"tenant": b"x" * 64}, "s") == "x" * 64
    msg = decode_message("globex:7", 1, "1-0", 1, {b"text": b"hi"}, r"^([^:]+):")
    assert msg.tenant == "globex"


def test_a_tenant_pattern_needs_a_group_and_must_compile() -> None:
    from dialog_worker.config import load_settings
    from dialog_worker.errors import ConfigError

    assert load_settings(environ={"DIALOG_TENANT_PATTERN": "^(a)"}).tenant_pattern == "^(a)"
    # What the scripts cannot match alike is refused, saying what: alternation, counted
    # repeats, nested or repeated groups, non-ASCII, escapes other than \d \w \s.
    for bad in (
        "^a",
        "(",
        "[z-a]",
        "(a|b)",
        "(a{2})",
        "((a))",
        "(a)+",
        "(é)",
        r"(\bx)",
        "(?:a)(b)",
    ):
        with pytest.raises(ConfigError, match="DIALOG_TENANT_PATTERN"):
            load_settings(environ={"DIALOG_TENANT_PATTERN": bad})
