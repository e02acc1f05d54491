"""The limits bench's incident figures (dialog_worker/bench/limits.py), from a provider log
as the fake provider keeps it: with an honest Retry-After no call may come during it; with one
that names no wait (0), at most twice the key's rate."""

from __future__ import annotations

from typing import Any

from dialog_worker.bench.limits import MODEL, _incident_ok, _provider_figures

STARTED, INCIDENT_AT, INCIDENT_S = 1000.0, 1100.0, 10.0


def figures(times: list[float]) -> dict[str, Any]:
    log = [{"t": t, "model": MODEL, "tokens": 10, "status": 429} for t in times]
    found = _provider_figures(
        {"log": log}, STARTED, INCIDENT_AT, INCIDENT_AT + 30, INCIDENT_S, 100_000
    )
    return {**found, "key_rate_per_s": 1.0}


def test_a_hot_loop_during_the_incident_fails_the_figure() -> None:
    hot = figures([INCIDENT_AT + i / 50 for i in range(500)])  # 50 calls/s for 10 s
    assert hot["incident_calls_per_s"] == 50.0
    assert not _incident_ok(hot, "0")


def test_a_floor_that_grows_passes_the_figure() -> None:
    paced = figures([INCIDENT_AT + t for t in (0.0, 1.0, 3.0, 7.0)])
    assert paced["incident_calls_per_s"] == 0.4
    assert _incident_ok(paced, "0")


def test_an_honest_retry_after_allows_no_call_during_it() -> None:
    assert _incident_ok(figures([INCIDENT_AT]), None)
    assert not _incident_ok(figures([INCIDENT_AT, INCIDENT_AT + 2.0]), None)
