"""Retry delays and the failure text kept in dead letters (dialog_worker.daemon.failures)."""

from __future__ import annotations

import random

import pytest

from dialog_worker.daemon.failures import (
    FAILURE_MAX_CHARS,
    RETRY_AFTER_CEILING_MS,
    describe_failure,
    retry_after_of,
    retry_delay_ms,
)
from dialog_worker.errors import PermanentError, RateLimited, TransientError


@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 6, 7, 10, 100, 10_000])
def test_delay_is_capped_exponential_with_equal_jitter(attempt: int) -> None:
    rng = random.Random(attempt)
    ceiling = min(30_000, 500 * 2 ** min(attempt - 1, 62))
    for _ in range(200):
        delay = retry_delay_ms(attempt, 500, 30_000, rng=rng)
        assert ceiling // 2 <= delay <= ceiling


def test_defaults_give_a_remote_api_about_a_minute_before_giving_up() -> None:
    """Five attempts with 500 ms / 30 s bounds: four waits of at least 0.25+0.5+1+2 s, and at
    most 0.5+1+2+4 s; what a flaky upstream gets before the message is dead-lettered."""
    low = sum(retry_delay_ms(n, 500, 30_000, rng=_Fixed(0.0)) for n in range(1, 5))
    high = sum(retry_delay_ms(n, 500, 30_000, rng=_Fixed(1.0)) for n in range(1, 5))
    assert (low, high) == (3750, 7500)


def test_retry_after_is_waited_at_least_with_a_little_jitter() -> None:
    rng = random.Random(7)
    delays = [retry_delay_ms(1, 500, 30_000, retry_after_s=2, rng=rng) for _ in range(500)]
    assert min(delays) >= 2000
    assert max(delays) <= 2200
    assert len(set(delays)) > 50, "messages told the same time must not all come back at once"


def test_retry_after_shorter_than_the_backoff_changes_nothing() -> None:
    assert retry_delay_ms(5, 500, 30_000, retry_after_s=0.1, rng=_Fixed(0.0)) == 4000


def test_retry_after_is_capped() -> None:
    assert retry_delay_ms(1, 500, 30_000, retry_after_s=86_400) == RETRY_AFTER_CEILING_MS
    # A max above the ceiling is the operator's choice and wins.
    assert retry_delay_ms(1, 500, 3_600_000, retry_after_s=86_400) == 3_600_000


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (2, 2.0),
        (0.5, 0.5),
        ("3", 3.0),
        (None, None),
        (-1, None),
        (float("nan"), None),
        (float("inf"), None),
        ("soon", None),
        (True, None),
    ],
)
def test_transient_error_keeps_only_a_sane_retry_after(given: object, kept: float | None) -> None:
    exc = TransientError("LLM API returned 429", retry_after=given)  # type: ignore[arg-type]
    assert exc.retry_after == kept
    assert retry_after_of(exc) == kept
    assert str(exc) == "LLM API returned 429"


def test_only_transient_errors_carry_a_retry_after() -> None:
    assert retry_after_of(PermanentError("no")) is None
    assert retry_after_of(ValueError("x")) is None
    assert TransientError().retry_after is None


def _engine_bug(depth: int) -> None:
    """Seven nested calls, each its own line in a traceback."""
    calls = [_layer_a, _layer_b, _layer_c, _layer_d, _layer_e, _layer_f]
    calls[depth % len(calls)](depth)


def _layer_a(depth: int) -> None:
    _engine_bug(depth - 1) if depth else _lookup()


_layer_b = _layer_c = _layer_d = _layer_e = _layer_f = _layer_a


def _lookup() -> None:
    {"a": 1}["user"]


def _raised(fn: object, *args: object) -> BaseException:
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as exc:
        return exc
    raise AssertionError("did not raise")


def test_failure_text_has_type_message_and_the_innermost_frames() -> None:
    text = describe_failure(_raised(_engine_bug, 12))
    first, *rest = text.splitlines()
    assert first == "KeyError: 'user'"
    assert rest[0] == "Traceback (innermost 5 frames):"
    assert len(rest) == 1 + 2 * 5
    assert rest[-2].endswith("in _lookup")
    assert rest[-1].strip() == '{"a": 1}["user"]', "the frame that raised comes last"


def test_failure_text_names_the_cause() -> None:
    def wraps() -> None:
        try:
            _engine_bug(0)
        except KeyError as exc:
            raise ValueError("memory is missing the user") from exc

    text = describe_failure(_raised(wraps))
    assert text.splitlines()[:2] == [
        "ValueError: memory is missing the user",
        "caused by KeyError: 'user'",
    ]


def test_failure_text_is_bounded_and_keeps_frames_when_the_message_is_huge() -> None:
    def huge() -> None:
        raise RuntimeError("x" * 100_000)

    text = describe_failure(_raised(huge))
    assert len(text) <= FAILURE_MAX_CHARS
    assert text.startswith("RuntimeError: xxx")
    assert "in huge" in text


def test_failure_without_traceback_is_just_type_and_message() -> None:
    assert describe_failure(TransientError("LLM API returned 503")) == (
        "TransientError: LLM API returned 503"
    )
    assert describe_failure(TimeoutError()) == "TimeoutError"


class _Fixed(random.Random):
    """uniform(a, b) always at the given fraction of the way from a to b."""

    def __init__(self, fraction: float) -> None:
        super().__init__(0)
        self.fraction = fraction

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.fraction


def test_failure_text_shows_the_engines_frames_before_a_librarys() -> None:
    """An engine whose JSON parse fails deep in the standard library: its own frame (where it
    called the library) comes first, then the library's innermost frames."""
    import json

    def parse_reply() -> None:
        json.loads('{"broken": ')

    text = describe_failure(_raised(parse_reply))
    lines = text.splitlines()
    assert lines[0].startswith("JSONDecodeError: ")
    assert lines[1].endswith("frames, the engine's first):"), lines[1]
    mine = next(i for i, line in enumerate(lines) if line.endswith("in parse_reply"))
    library = next(i for i, line in enumerate(lines) if "json" in line and "decoder.py" in line)
    assert mine < library


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("2", 2.0),
        ("0", 0.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date in the past: no wait
        ("-3", None),
        ("soon", None),
        ("", None),
        (None, None),
    ],
)
def test_a_retry_after_header_is_taken_as_it_came(header: str | None, seconds: float | None):
    """RateLimited(key, response.headers.get("retry-after")) works as is: seconds or an HTTP
    date; what names no wait is None (the worker then pauses the key for its floor)."""
    assert RateLimited("k", header).retry_after_s == seconds
    assert TransientError("x", retry_after=header).retry_after == seconds


def test_a_retry_after_date_in_the_future_is_the_seconds_until_it() -> None:
    import email.utils
    import time

    header = email.utils.formatdate(time.time() + 30, usegmt=True)
    got = RateLimited("k", header).retry_after_s
    assert got is not None and 28 <= got <= 30
