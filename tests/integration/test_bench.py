"""`dialog-worker bench`: a small real run against the suite's redis-server, and the
percentile function it reports with."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis_server import wait_until
from worker_procs import WorkerPool

from dialog_worker.bench import inversions, percentile, summarize
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.ops.verify import send_bursts, wait_applied

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
            "dialog_worker",
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
    # Counted by name through the worker's own packer (dialog_worker.store.connection) too.
    assert run["redis"]["worker_top_level_by_command_per_msg"].get("evalsha", 0) > 0
    assert run["cpu"]["workers_ms_per_msg"] > 0
    assert "bench:" in proc.stderr  # progress and summary on stderr


# ---------------------------------------------------------------------------------------------
def test_hold_mode_counts_the_commands_of_steps_held_in_flight() -> None:
    """--mode hold: every step is in flight before the count starts and still at its end, and
    the figure per step is the commands counted over the seconds and the steps; under worker
    leases no step is renewed on its own (no PEXPIRE of a lock, no HGET of a tenant)."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "dialog_worker", "bench", "--mode", "hold"),
            *("--sessions", "20", "--duration", "3", "--workers", "1", "--redis", "embedded"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [run] = json.loads(done.stdout)["runs"]
    assert run["mode"] == "hold" and run["steps_in_flight"] == run["steps_in_flight_at_end"] == 20
    per_step = run["commands"] / run["seconds"] / 20
    assert abs(run["commands_per_s_per_step"] - per_step) < 0.01 * per_step + 0.0001
    # A renewal per step (GET, PEXPIRE, HGET, two ZADDs every 2.5 s at most) would be 20 each
    # at least in 3 s.
    assert all(run["by_command"].get(c, 0) < 20 for c in ("pexpire", "hget", "zadd"))
    # Nor does the resumer look at the ready set every 100 ms while it holds only held
    # sessions (a ZRANGE and an EXISTS each time: 30 of each in 3 s).
    assert run["by_command"].get("exists", 0) < 15
    assert run["redis_memory_per_step_bytes"] > 0


# Namespaces: the bench never touches a deployment it was not pointed at, and cleans up after
# itself where it was.


def bench(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    small = ["--sessions", "5", "--burst", "3", "--warmup", "5", "--timeout", "30"]
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", "bench", *small, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def contents(r: redis.Redis) -> dict[str, Any]:
    """Every key with what it holds (stream entries, hash fields, string values...)."""
    read = {
        "stream": lambda k: r.xrange(k),
        "hash": lambda k: r.hgetall(k),
        "string": lambda k: r.get(k),
        "zset": lambda k: r.zrange(k, 0, -1, withscores=True),
        "set": lambda k: sorted(r.smembers(k)),
        "list": lambda k: r.lrange(k, 0, -1),
    }
    # Receipts of the workers' own calls live one lock lease (they answer a re-sent call), the
    # waiter key and the wake stream change hands as the workers wait, the worker leases move
    # on as the workers renew them, and the inbound hash's
    # added/length are intake's count of every append (the bench's included): they come and
    # go with the deployment, not with the bench.
    keys = [
        key
        for key in sorted(r.scan_iter(count=1000))
        if ":receipt:" not in key
        and not key.endswith((":ready:waiter", ":ready:wake", ":ready:workers", ":workers:n"))
    ]
    found = {key: read[r.type(key)](key) for key in keys}
    for key, value in list(found.items()):
        if key.endswith(":ready:inbound"):
            kept = {k: v for k, v in value.items() if k not in ("added", "length")}
            if kept:
                found[key] = kept
            else:  # only the baseline, written by whichever intake call came first
                del found[key]
    return found


async def test_bench_against_a_live_deployment_leaves_its_streams_and_keys_untouched(
    env: dict[str, str], client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1, DIALOG_ENGINE="fault_engine:make")
    sent = await send_bursts(client, ["app-1", "app-2"], ["nama saya Budi", "keluhan", "fatal x"])
    assert await wait_applied(client, sent, timeout_s=30)
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    r.xgroup_create("dialog-replies", "app", id="0")  # the application's reply consumer
    before = contents(r)
    assert before["dialog-replies"] and before["dialog-dlq"]

    # By default the bench runs in a namespace of its own and removes it.
    own = await anyio.to_thread.run_sync(lambda: bench(env, "--workers", "1"))
    assert own.returncode == 0, own.stderr[-3000:]
    report = json.loads(own.stdout)
    assert report["ok"] and report["runs"][0]["messages"] == 15
    assert report["namespaces"]["ours"]["stream"] == "bench"
    assert report["namespaces"]["ours"]["own"] is True
    assert contents(r) == before

    # Pointed at the running workers, it writes there and removes exactly what it wrote.
    live = await anyio.to_thread.run_sync(
        lambda: bench(env, "--workers", "0", "--namespace", "dialog")
    )
    assert live.returncode == 0, live.stderr[-3000:]
    report = json.loads(live.stdout)
    assert report["ok"] and report["runs"][0]["messages"] == 15
    where = report["namespaces"]["ours"]
    assert (where["stream"], where["own"]) == ("dialog", False)
    assert where["removed"]["entries"] >= 15 + 5  # its replies (warm-up included)
    assert where["removed"]["keys"] >= 5
    assert contents(r) == before
    assert r.xinfo_groups("dialog-replies")[0]["entries-read"] in (None, 0)


def test_bench_refuses_a_namespace_that_a_group_reads_unless_named(
    env: dict[str, str], workers: WorkerPool
) -> None:
    workers.start(1, DIALOG_STREAM="bench")  # something live in the default namespace
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    wait_until(lambda: r.exists("bench"), 20, what="the group on stream bench")
    before = contents(r)
    for args in (["--workers", "1"], ["--workers", "0"]):
        refused = bench(env, *args)
        assert refused.returncode == 2, refused.stderr[-3000:]
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "--namespace" in lines[0], refused.stderr
        assert refused.stdout == ""
    assert contents(r) == before


def test_streaming_bench_measures_plain_messages_alone_and_alongside_the_answers() -> None:
    """`python -m dialog_worker.bench.streaming --plain M` (docs/benchmarks.md, "Streamed
    answers"): a small run answers every streamed answer correctly and reports the plain
    messages' two throughputs, each over bursts of M repeated until they took --plain-min-s, the one
    alongside taken while the answers were still being written, and the CPU each process
    used."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dialog_worker.bench.streaming",
            *("--answers", "4", "--tokens", "60", "--rate", "20"),
            *("--plain", "100", "--plain-sessions", "20", "--plain-after-s", "0.5"),
            *("--plain-min-s", "0.4"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["correct_answers"] == 4 and result["tokens_received"] == 240
    plain = result["plain"]
    for burst in (plain["alone"], plain["alongside"]):
        assert burst["messages"] == 100 * burst["bursts"] and burst["seconds"] >= 0.4
        assert burst["per_s"] == pytest.approx(burst["messages"] / burst["seconds"], rel=0.01)
    assert plain["streaming_still_running"] is True  # 3 s answers; the burst is at 0.5 s
    assert plain["ratio"] == round(plain["alongside"]["per_s"] / plain["alone"]["per_s"], 3)
    assert result["latency_ms_p99"] > 0
    assert result["redis_commands_per_token"] is None  # the plain messages' commands are in it
    cpu = result["cpu_s"]
    assert cpu["reader"] > 0 and cpu["redis"] > 0 and len(cpu["workers"]) == 2
    assert all(s is not None and s > 0 for s in cpu["workers"])


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids |= {int(p) for p in (task / "children").read_text().split()}
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _sigterm_stops_its_children(
    args: list[str], started_s: float, running: str = "", tmp: Path | None = None
) -> None:
    """Start a bench (`python -m` args), wait until it has started redis-server and two
    workers (and, with `running`, until its progress on stderr says that: the run itself,
    not the workers' first milliseconds, is what a CI runner or `timeout` stops), SIGTERM it:
    it exits non-zero and every one of them stops with it."""
    err = (tmp / "bench.err") if tmp is not None else None
    bench = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=err.open("wb") if err is not None else subprocess.DEVNULL,
    )

    def started() -> set[int] | None:
        kids = _children(bench.pid)
        if len(kids) < 3 or (err is not None and running not in err.read_text(errors="replace")):
            return None
        return kids

    children: set[int] = set()
    try:
        children = wait_until(started, timeout_s=started_s)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) != 0
        # Gone with it (within a second or two of the SIGTERM).
        wait_until(lambda: not any(_alive(pid) for pid in children), timeout_s=10)
    finally:
        children |= _children(bench.pid)
        bench.kill()
        bench.wait(10)
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_a_streaming_bench_stopped_with_sigterm_leaves_no_process_behind() -> None:
    """`timeout`, a CI runner or `kill` stop a bench with SIGTERM: its workers and its
    redis-server stop with it instead of running on."""
    _sigterm_stops_its_children(
        ["dialog_worker.bench.streaming", "--answers", "2", "--tokens", "200", "--rate", "10"],
        started_s=30,
    )


def test_the_bench_command_stopped_with_sigterm_leaves_no_process_behind(tmp_path: Path) -> None:
    """The same for `dialog-worker bench`: its embedded redis-server and its workers stop
    with it."""
    _sigterm_stops_its_children(
        [
            "dialog_worker",
            "bench",
            *("--redis", "embedded", "--workers", "2", "--step-ms", "200"),
            *("--sessions", "20", "--burst", "200", "--timeout", "300"),
        ],
        started_s=60,
        running="warm-up",
        tmp=tmp_path,
    )


def test_gateway_bench_times_both_doors_and_streams_whole_answers_at_once() -> None:
    """`python -m dialog_worker.bench.gateway` (docs/benchmarks.md, "The gateway's front
    doors"): a small run times the first token through each door and streams every answer of
    the concurrent useChat streams whole, with the gateway's memory before, at its peak, after."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dialog_worker.bench.gateway",
            *("--pairs", "3", "--streams", "6", "--tokens", "5", "--rate", "20", "--rounds", "2"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    first = result["first_token"]
    assert first["pairs"] == 3
    for door in (first["native"], first["ai_sdk"]):
        assert 0 < door["emit_to_client_ms_p50"] <= door["request_to_token_ms_p99"] + 1000
    assert first["overhead_ms_p50"] == round(
        first["ai_sdk"]["emit_to_client_ms_p50"] - first["native"]["emit_to_client_ms_p50"], 2
    )
    assert len(result["streams"]) == 2
    for streams in result["streams"]:
        assert (streams["streams"], streams["whole_answers"], streams["all_open"]) == (6, 6, True)
        assert 0 < streams["gateway_rss_mib_before"] <= streams["gateway_rss_mib_peak"]
