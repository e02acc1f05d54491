"""The per-step cap on timers is exact: a step may ask for 2 x MAX_TIMERS timers, not one
more (the session itself keeps at most MAX_TIMERS; the commit decides which stay)."""

from __future__ import annotations

import pytest

import dialog_worker
from dialog_worker.engine.timers import MAX_TIMERS, recording
from dialog_worker.errors import ValidationError


def test_a_step_may_set_exactly_the_cap_and_one_more_is_refused() -> None:
    with recording() as ops:
        for i in range(2 * MAX_TIMERS):
            dialog_worker.schedule(f"t{i}", "nudge", delay_s=60)
        assert len(ops) == 2 * MAX_TIMERS
        with pytest.raises(ValidationError, match=f"at most {2 * MAX_TIMERS} timers"):
            dialog_worker.schedule("one-more", "nudge", delay_s=60)
        # Cancels are not counted against the cap.
        dialog_worker.cancel_timer("t0")
    assert len(ops) == 2 * MAX_TIMERS + 1
