"""The figures of `bench --mode limits --tenants` (dialog_worker/bench/fair_turns.py), from the
times the replies were written: b's lone messages each within half a second plus the step,
weights 3 : 1 within 10 %, a tenant alone at 0.95 of the key's rate or more."""

from __future__ import annotations

from dialog_worker.bench.fair_turns import alone_figures, flood_figures, weights_figures


def test_a_lone_message_past_half_a_second_plus_the_step_fails_the_flood_figure() -> None:
    sent = {"b-0": 10.0, "b-1": 10.5}
    assert flood_figures(sent, {"b-0": 10.4, "b-1": 11.1}, 100)["met"]
    late = flood_figures(sent, {"b-0": 10.4, "b-1": 11.2}, 100)
    assert not late["met"] and late["b_reply_s"] == [0.4, 0.7]
    assert not flood_figures(sent, {"b-0": 10.4}, 100)["met"], "one never answered"


def test_the_weights_figure_counts_calls_from_when_both_wait_and_holds_3_to_1() -> None:
    done = {f"a-{i}": 100.0 + i for i in range(30)} | {f"b-{i}": 100.0 + i for i in range(10)}
    done |= {f"b-early{i}": 1.0 for i in range(50)}  # before the window: not counted
    assert weights_figures(done, 50.0) == {"calls": {"a": 30, "b": 10}, "ratio": 3.0, "met": True}
    done |= {f"b-{i}": 200.0 for i in range(10, 14)}
    assert not weights_figures(done, 50.0)["met"], "30 : 14 is not 3 : 1"


def test_a_tenant_alone_below_095_of_the_rate_fails_the_figure() -> None:
    full = [i / 10 for i in range(200)]  # 10 calls a second, the key's rate at 600 rpm
    assert alone_figures(full, 600)["share_of_rate"] == 1.0
    slow = [i / 9 for i in range(200)]
    assert not alone_figures(slow, 600)["met"]
