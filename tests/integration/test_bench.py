"""`dialog-worker bench`: a small real run against the suite's redis-server, and the
percentile function it reports with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.bench import inversions, percentile, summarize

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

RUN_KEYS = {
    "system",
    "phase",
    "mode",
    "sessions",
    "messages",
    "throughput_msg_s",
    "drain_s",
    "latency_ms",
    "latency_redis_ms",
    "requeues",
    "redis",
    "cpu",
    "workers_rss_kb",
    "correctness",
    "violations",
}
CORRECTNESS_KEYS = {
    "lost",
    "duplicated",
    "out_of_order",
    "missing_replies",
    "extra_replies",
    "not_applied",
    "dead_lettered",
    "problems",
}


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([1.0, 2.0, 3.0, 4.0], 25) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    s = summarize([1.0, 2.0, 3.0])
    assert s["p50"] == 2.0 and s["max"] == 3.0 and s["count"] == 3


def test_inversions_count_messages_applied_after_a_later_one() -> None:
    assert inversions([1, 2, 3]) == 0
    assert inversions([2, 1, 3]) == 1
    assert inversions([3, 1, 2]) == 2


def test_bench_small_run_reports_documented_keys_and_no_violation(env: dict[str, str]) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker",
            "bench",
            "--sessions",
            "20",
            "--burst",
            "5",
            "--workers",
            "1",
            "--warmup",
            "20",
            "--timeout",
            "20",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout  # one JSON object on stdout
    report = json.loads(lines[0])
    assert report["ok"] is True
    assert report["violations"] == {"ours": 0}
    assert {"machine", "config", "runs"} <= set(report)
    (run,) = report["runs"]
    assert RUN_KEYS <= set(run), sorted(RUN_KEYS - set(run))
    assert run["system"] == "ours" and run["messages"] == 100
    assert CORRECTNESS_KEYS <= set(run["correctness"])
    assert run["violations"] == 0
    assert run["correctness"]["problems"] == []
    assert run["latency_ms"]["count"] == 100
    assert run["latency_ms"]["p50"] <= run["latency_ms"]["p99"]
    assert run["redis"]["commands_per_msg"] > 0
    assert run["redis"]["worker_round_trips_per_msg"] > 0
    assert run["cpu"]["workers_ms_per_msg"] > 0
    assert "bench:" in proc.stderr  # progress and summary on stderr
