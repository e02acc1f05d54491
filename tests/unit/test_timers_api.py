"""dialog_worker.schedule / cancel_timer as an engine calls them: checked before anything is
recorded, recorded for the running step only, and refused outside one."""

from __future__ import annotations

import json
import time

import pytest

import dialog_worker
from dialog_worker.engine.timers import (
    MAX_TIMER_META,
    MAX_TIMER_NAME_BYTES,
    TimerOps,
    deliver_at_ms,
    recording,
)
from dialog_worker.errors import ValidationError


def test_schedule_outside_a_step_raises_instead_of_dropping_the_timer() -> None:
    with pytest.raises(RuntimeError):
        dialog_worker.schedule("n", "t", delay_s=1)
    with pytest.raises(RuntimeError):
        dialog_worker.cancel_timer("n")


def test_a_step_records_sets_and_cancels_in_order() -> None:
    with recording() as ops:
        dialog_worker.schedule("a", "hi", delay_s=1.5, meta={"k": "v"}, cancel_on_message=True)
        dialog_worker.schedule("b", "at", at=1_700_000_000.25)
        dialog_worker.cancel_timer("a")
    assert ops == [
        {"op": "set", "name": "a", "text": "hi", "delay_ms": 1500, "meta": ["k", "v"],
         "cancel_on_message": True},
        {"op": "set", "name": "b", "text": "at", "at_ms": 1_700_000_000_250, "meta": [],
         "cancel_on_message": False},
        {"op": "cancel", "name": "a"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("", "t"), {"delay_s": 1}),
        (("x" * (MAX_TIMER_NAME_BYTES + 1), "t"), {"delay_s": 1}),
        (("a\nb", "t"), {"delay_s": 1}),
        (("n", " "), {"delay_s": 1}),
        (("n", "t"), {}),
        (("n", "t"), {"delay_s": 1, "at": 2}),
        (("n", "t"), {"delay_s": -1}),
        (("n", "t"), {"delay_s": float("nan")}),
        (("n", "t"), {"delay_s": True}),
        (("n", "t"), {"delay_s": 1, "meta": {"timer": "x"}}),
        (("n", "t"), {"delay_s": 1, "meta": {"k": 1}}),
    ],
)
def test_a_bad_timer_is_refused_before_it_is_recorded(
    args: tuple[str, str], kwargs: dict[str, object]
) -> None:
    with recording() as ops:
        with pytest.raises(ValidationError):
            dialog_worker.schedule(*args, **kwargs)  # type: ignore[arg-type]
    assert ops == []


def test_the_commit_argument_is_empty_without_timers_and_json_with_them() -> None:
    ops = TimerOps()
    assert ops.encoded() == ""
    ops.add({"op": "cancel", "name": "é"})
    assert json.loads(ops.encoded()) == [{"op": "cancel", "name": "é"}]


def test_deliver_at_is_seconds_since_the_epoch_within_a_year() -> None:
    assert deliver_at_ms(1.5) == 1500
    for bad in (-1, float("inf"), 10**12, True):
        with pytest.raises(ValidationError):
            deliver_at_ms(bad)  # type: ignore[arg-type]


def test_deliver_at_is_refused_one_day_past_its_limit() -> None:
    """The limit is 366 days ahead, in seconds: a day inside it is taken, a day past refused."""
    day = 86400
    assert deliver_at_ms(time.time() + 365 * day) > 0
    with pytest.raises(ValidationError):
        deliver_at_ms(time.time() + 367 * day)


def test_a_timer_carries_30_meta_fields_and_not_31() -> None:
    at_limit = {f"k{i}": "v" for i in range(MAX_TIMER_META)}
    with recording() as ops:
        dialog_worker.schedule("n", "t", delay_s=1, meta=at_limit)
        with pytest.raises(ValidationError):
            dialog_worker.schedule("n", "t", delay_s=1, meta=at_limit | {"one_more": "v"})
    assert [len(op["meta"]) for op in ops] == [2 * MAX_TIMER_META]
