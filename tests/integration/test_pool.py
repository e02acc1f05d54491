"""`dialog-worker run --processes N`: one supervisor and its worker processes on one host, with
one /metrics for all of them, restarts, and one clean stop. Real processes, real Redis."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from redis_server import wait_until
from worker_procs import Supervisor, WorkerPool

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.ops.verify import check, send_bursts, wait_applied

pytestmark = pytest.mark.integration

GRACE_S = 5.0
FAST = {
    "DIALOG_METRICS_SAMPLE_INTERVAL_S": "0.1",
    "DIALOG_LOG_LEVEL": "info",
    "DIALOG_SHUTDOWN_GRACE_S": str(GRACE_S),
    # A killed child's entries come back quickly.
    "DIALOG_LOCK_TTL_MS": "1000",
    "DIALOG_VISIBILITY_TIMEOUT_MS": "2000",
    "DIALOG_RECLAIM_INTERVAL_MS": "200",
    "DIALOG_ENGINE": "fault_engine:make",  # "sleep S ..." keeps a message in flight
    "DIALOG_CONCURRENCY": "8",  # so that one child cannot take a whole burst alone
}

# The lock of the session the test sends to: it exists while a worker holds the session.
HELD_LOCK = "dialog:{dialog}:s:{held}:lock"


def supervisor(env: dict[str, str], tmp_path: Path, processes: int = 2) -> Supervisor:
    """Its temporary files (the metrics directory) go under `tmp_path/tmp`."""
    (tmp_path / "tmp").mkdir()
    env = {**env, **FAST, "TMPDIR": str(tmp_path / "tmp")}
    return Supervisor("pool", env, tmp_path, processes).start()


def metric(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def events(sup: Supervisor) -> list[dict[str, Any]]:
    lines = (line for line in sup.log_text().splitlines() if line.startswith("{"))
    return [json.loads(line) for line in lines]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_two_processes_share_one_scrape_survive_kill_9_and_stop_within_the_grace(
    env: dict[str, str], client: DialogClient, tmp_path: Path
) -> None:
    sup = supervisor(env, tmp_path)
    try:
        first = sup.wait_ready()
        # Every message takes 50 ms: 240 of them are 1.5 s of work for one child's 8 slots,
        # more than a child holds at once (its slots and one batch read ahead), so both take
        # part. (With one slow message of three, one child could keep up with the sends alone,
        # and once did.)
        sessions = [f"pool-{i}" for i in range(80)]
        texts = ["sleep 0.05 nama", "sleep 0.05 pesan 2", "sleep 0.05 pesan 3"]
        sent = await send_bursts(client, sessions, texts)
        assert await wait_applied(client, sent, timeout_s=30)
        assert await check(client, sent) == []

        # One scrape holds the counters of both children, and both did part of the work.
        def counted() -> str | None:
            text = sup.metrics_text()
            return text if metric(text, "dialog_messages_total", outcome="applied") == 240 else None

        text = await anyio.to_thread.run_sync(lambda: wait_until(counted, 10, what="240"))
        assert metric(text, "dialog_processing_seconds_count") == 240
        assert {int(s) for s in _ready_pids(text)} == first
        committed = [e for e in events(sup) if e["event"] == "committed"]
        assert len({e["consumer"] for e in committed}) == 2, "both children applied messages"

        # kill -9 one child while it holds work: it is restarted and nothing is lost.
        slow = await send_bursts(client, [f"slow-{i}" for i in range(20)], ["sleep 0.3 a", "b"])
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        assert await wait_applied(client, slow, timeout_s=60)
        assert await check(client, slow) == []
        after = await anyio.to_thread.run_sync(sup.wait_ready)
        assert victim not in after and len(after) == 2 and after & first
        text = sup.metrics_text()
        assert metric(text, "dialog_worker_restarts_total") == 1
        assert metric(text, "dialog_messages_total", outcome="applied") >= 240 + 40 - 1
        died = [e for e in events(sup) if e["event"] == "worker_process_died"]
        assert [(e["pid"], e["returncode"]) for e in died] == [(victim, -9)]
        # The dead child's live gauges were collected (mark_process_dead): only its counters
        # and histograms stay, so totals never go back.
        (metrics_dir,) = (tmp_path / "tmp").iterdir()
        assert list(metrics_dir.glob(f"gauge_live*_{victim}.db")) == []
        assert (metrics_dir / f"counter_{victim}.db").exists()
        assert list(metrics_dir.glob(f"gauge_liveall_{min(after)}.db"))

        # SIGTERM: every child finishes, the supervisor exits 0 within the grace period.
        started = time.monotonic()
        assert sup.terminate(timeout_s=GRACE_S + 10) == 0
        took = time.monotonic() - started
        assert took < GRACE_S, took
        assert not any(alive(pid) for pid in after)
        assert list((tmp_path / "tmp").iterdir()) == []  # metrics directory removed
        print(f"\npool of 2: stopped in {took:.2f}s")
    finally:
        if sup.alive():
            sup.kill()


def test_readyz_needs_every_child_and_ctrl_c_reaches_each_child_once(
    env: dict[str, str], tmp_path: Path
) -> None:
    sup = supervisor(env, tmp_path)
    try:
        pids = sup.wait_ready()
        os.kill(min(pids), signal.SIGKILL)
        # One child down is enough to be not ready, until its replacement is.
        wait_until(lambda: sup.readyz() == 503, 5, what="/readyz 503 with one child dead")
        assert sup._get("/healthz") == (200, "ok\n")
        sup.wait_ready()
        sup.interrupt()  # Ctrl-C: the terminal signals the supervisor's process group
        assert sup.proc is not None and sup.proc.wait(GRACE_S + 10) == 0
    finally:
        if sup.alive():
            sup.kill()
    names = [(e["event"], e["consumer"]) for e in events(sup)]
    assert not [n for n in names if n[0] == "second_signal_exit_now"], names
    # Each child (named after the supervisor's consumer and its slot) got one signal.
    requested = [c for event, c in names if event == "shutdown_requested"]
    assert sorted(requested) == ["pool", "pool-1", "pool-2"], names
    assert {c for event, c in names if event == "worker_stopped"} == {"pool-1", "pool-2"}


def test_children_stop_themselves_when_the_supervisor_is_killed(
    env: dict[str, str], tmp_path: Path
) -> None:
    sup = supervisor(env, tmp_path)
    pids: set[int] = set()
    try:
        pids = sup.wait_ready()
        sup.kill()
        wait_until(lambda: not any(map(alive, pids)), 15, what="orphaned children to stop")
    finally:
        sup.kill()
        for pid in filter(alive, pids):  # never leave orphans behind a failed test
            os.kill(pid, signal.SIGKILL)
    assert [e["event"] for e in events(sup)].count("supervisor_gone") == 2


def _ready_pids(text: str) -> list[str]:
    return [
        s.labels["pid"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "dialog_ready"
    ]


async def test_a_second_signal_stops_every_child_at_once_and_loses_nothing(
    env: dict[str, str], client: DialogClient, workers: WorkerPool, tmp_path: Path
) -> None:
    sup = supervisor(env, tmp_path)
    try:
        pids = sup.wait_ready()
        sent = await send_bursts(client, ["held"], ["sleep 4 nama saya Budi", "pesan 2"])
        r = redis.Redis.from_url(env["REDIS_URL"])
        wait_until(lambda: r.exists(HELD_LOCK), 10, what="pickup")  # a worker holds it
        sup.signal(signal.SIGTERM)

        def asked() -> bool:
            return [e["event"] for e in events(sup)].count("shutdown_requested") == 3

        wait_until(asked, 10, what="the stop forwarded to both children")
        started = time.monotonic()
        sup.signal(signal.SIGTERM)
        assert sup.proc is not None and sup.proc.wait(10) == 1
        assert time.monotonic() - started < 3  # neither the 4 s step nor the 5 s grace
        assert not any(map(alive, pids))
    finally:
        if sup.alive():
            sup.kill()
    # What the children held is taken over once its lease ends: nothing is lost.
    workers.start(1, **FAST)
    assert await wait_applied(client, sent, timeout_s=60)
