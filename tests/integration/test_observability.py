"""Operations surface (issue 4, contract section 7): /metrics scraped over real HTTP and parsed
with prometheus-client's parser, /healthz and /readyz across a Redis outage, structured log
fields (in-process with structlog.testing and in a worker's JSON log file), and the Redis
password never showing up in logs or metrics. Real redis-server, real worker processes."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from redis_server import RedisServer, free_port
from worker_procs import WorkerPool, WorkerProc

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.daemon.worker import Worker
from dialog_worker.engine.loading import load_engine
from dialog_worker.ops.verify import check, send_bursts, wait_applied

pytestmark = pytest.mark.integration

# Contract section 7, by kind. Counters are exposed with the `_total` suffix, histograms as
# `_bucket`/`_count`/`_sum` series.
CONTRACT_COUNTERS = (
    "dialog_messages_total",
    "dialog_retries_total",
    "dialog_lock_contended_total",
    "dialog_reclaimed_total",
    "dialog_fencing_rejections_total",
    "dialog_lease_renewals_total",
)
CONTRACT_HISTOGRAMS = ("dialog_processing_seconds", "dialog_end_to_end_seconds")
CONTRACT_GAUGES = (
    "dialog_stream_length",
    "dialog_group_lag",
    "dialog_pending",
    "dialog_oldest_pending_age_seconds",
    "dialog_delayed",
    "dialog_dlq_length",
    "dialog_in_flight",
)

FAST_SAMPLER = {"DIALOG_METRICS_SAMPLE_INTERVAL_S": "0.1"}

# The per-message fields every line about one message carries (dialog_worker/log.py).
MESSAGE_FIELDS = {"session_id", "msg_id", "seq", "entry_id", "attempt", "outcome", "duration_ms"}


# ---------------------------------------------------------------------------------------------
# helpers


def samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        s.value
        for s in samples(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def total(procs: Iterable[WorkerProc], name: str, **labels: str) -> float:
    return sum(value(w.metrics_text(), name, **labels) for w in procs)


async def poll(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Call `predicate` (sync) until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await anyio.sleep(0.05)


def wait_sync(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            lines.append(obj)
    return lines


# ---------------------------------------------------------------------------------------------
# 1. a burst


async def test_burst_counters_histograms_and_settled_gauges_with_no_session_labels(
    client: DialogClient, workers: WorkerPool
):
    [w] = workers.start(1, metrics=True, **FAST_SAMPLER)
    run = uuid.uuid4().hex[:8]
    sessions = [f"obs-{run}-{i}" for i in range(6)]
    sent = await send_bursts(
        client, sessions, ["nama saya Budi"] + [f"pesan {i}" for i in range(4)]
    )
    n = len(sent)
    assert n == 30
    assert await wait_applied(client, sent, timeout_s=30)
    assert await check(client, sent) == []

    def settled() -> str | None:
        text = w.metrics_text()
        counted = (
            value(text, "dialog_messages_total", outcome="applied"),
            value(text, "dialog_processing_seconds_count"),
            value(text, "dialog_end_to_end_seconds_count"),
        )
        gauges = [
            value(text, g)
            for g in (
                "dialog_stream_length",
                "dialog_pending",
                "dialog_delayed",
                "dialog_in_flight",
            )
        ]
        ok = counted == (n, n, n) and gauges == [0, 0, 0, 0]
        return text if ok and value(text, "dialog_ready") == 1 else None

    text = await poll(settled, 20, "counters at N and queue gauges at 0")
    assert value(text, "dialog_messages_total", outcome="applied") == n
    assert value(text, "dialog_messages_total", outcome="duplicate") == 0
    assert value(text, "dialog_messages_total", outcome="dead_lettered") == 0
    assert value(text, "dialog_processing_seconds_count") == n
    assert value(text, "dialog_end_to_end_seconds_count") == n
    # The +Inf bucket of a histogram holds every observation.
    assert value(text, "dialog_end_to_end_seconds_bucket", le="+Inf") == n
    assert value(text, "dialog_dlq_length") == 0
    assert value(text, "dialog_ready") == 1

    names = {s.name for s in samples(text)}
    wanted = {
        *CONTRACT_COUNTERS,
        *CONTRACT_GAUGES,
        *(f"{h}_{suffix}" for h in CONTRACT_HISTOGRAMS for suffix in ("bucket", "count", "sum")),
    }
    assert wanted <= names, f"missing: {sorted(wanted - names)}"
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {kinds[c.removesuffix("_total")] for c in CONTRACT_COUNTERS} == {"counter"}
    assert {kinds[h] for h in CONTRACT_HISTOGRAMS} == {"histogram"}
    assert {kinds[g] for g in CONTRACT_GAUGES} == {"gauge"}

    # No per-session labels: no label is about sessions, and no label value is a session id.
    for s in samples(text):
        assert not any("session" in k for k in s.labels), s
        for v in s.labels.values():
            assert not any(sid in v for sid in sessions), s
    assert not any(sid in text for sid in sessions)


# ---------------------------------------------------------------------------------------------
# 2. a contended burst


async def test_contended_burst_counts_contention_and_applies_each_message_once(
    client: DialogClient, workers: WorkerPool
):
    procs = workers.start(2, metrics=True, **FAST_SAMPLER)
    sent = await send_bursts(client, ["hot-obs"], [f"pesan {i}" for i in range(1, 101)])
    assert await wait_applied(client, sent, timeout_s=45)
    assert await check(client, sent) == []

    await poll(
        lambda: total(procs, "dialog_messages_total", outcome="applied") == 100,
        20,
        "applied counters summed over both workers to reach 100",
    )
    contended = total(procs, "dialog_lock_contended_total")
    retried_contended = total(procs, "dialog_retries_total", reason="contended")
    out_of_order = total(procs, "dialog_retries_total", reason="out_of_order")
    print(
        f"\none session x100, 2 workers: lock_contended={contended:.0f} "
        f"out_of_order={out_of_order:.0f}"
    )
    assert contended + out_of_order > 0
    assert retried_contended == contended
    assert total(procs, "dialog_messages_total", outcome="applied") == 100
    assert total(procs, "dialog_messages_total", outcome="dead_lettered") == 0
    assert total(procs, "dialog_retries_total", reason="error") == 0


# ---------------------------------------------------------------------------------------------
# 3. a poison message


async def test_poison_message_counts_error_retries_dead_letter_and_dlq_gauge(
    client: DialogClient, workers: WorkerPool
):
    [w] = workers.start(
        1,
        metrics=True,
        **FAST_SAMPLER,
        DIALOG_ENGINE="fault_engine:make",
        DIALOG_BACKOFF_BASE_MS="20",
        DIALOG_BACKOFF_MAX_MS="100",
        DIALOG_MAX_ATTEMPTS="3",
    )
    max_attempts = 3
    sent = await send_bursts(client, ["poison-obs"], ["nama saya Budi", "boom here", "keluhan"])
    assert await wait_applied(client, sent, timeout_s=30)
    assert await client.redis.xlen(client.keys.dlq) == 1

    def settled() -> str | None:
        text = w.metrics_text()
        done = (
            value(text, "dialog_messages_total", outcome="dead_lettered") == 1
            and value(text, "dialog_messages_total", outcome="applied") == 2
            and value(text, "dialog_dlq_length") == 1
        )
        return text if done else None

    text = await poll(settled, 20, "dead-letter counter and dlq gauge")
    assert value(text, "dialog_retries_total", reason="error") == max_attempts - 1
    assert value(text, "dialog_messages_total", outcome="dead_lettered") == 1
    assert value(text, "dialog_messages_total", outcome="applied") == 2
    assert value(text, "dialog_dlq_length") == 1
    # The dead-lettered message is committed too: both histograms count all three.
    assert value(text, "dialog_processing_seconds_count") == 3


# ---------------------------------------------------------------------------------------------
# 4. readiness across a Redis outage


def test_readyz_follows_redis_outage_while_healthz_stays_200(tmp_path: Path):
    from conftest import worker_env

    server = RedisServer(tmp_path / "r").start()
    pool = WorkerPool(worker_env(server.url, **FAST_SAMPLER), tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    try:
        [w] = pool.start(1, metrics=True)

        def probe(path: str) -> int | None:
            got = w._get(path)
            return None if got is None else got[0]

        def ready_gauge() -> float:
            return value(w.metrics_text(), "dialog_ready")

        def phase(want_ready: int, want_status: int) -> bool:
            assert w.alive(), w.log_text()[-2000:]
            assert probe("/healthz") == 200
            return probe("/readyz") == want_status and ready_gauge() == want_ready

        wait_sync(lambda: phase(1, 200), 20, "/readyz 200 with Redis up")
        started = time.monotonic()
        server.kill()
        wait_sync(lambda: phase(0, 503), 10, "/readyz 503 with Redis down")  # at once
        noticed = time.monotonic() - started
        # Stays not ready (and alive, and healthy) while Redis is down: probed over 2 s,
        # through the loops' reconnect attempts.
        for _ in range(5):
            time.sleep(0.4)  # probe pacing: time must pass between the probes
            assert phase(0, 503)
        server.start()  # same port
        started = time.monotonic()
        wait_sync(lambda: phase(1, 200), 30, "/readyz 200 after Redis restarted")
        recovered = time.monotonic() - started
        print(f"\nreadiness: down noticed in {noticed:.2f}s, back in {recovered:.2f}s")
        assert w.alive()
        assert probe("/healthz") == 200
    finally:
        pool.stop_all()
        server.stop()


# ---------------------------------------------------------------------------------------------
# 5. log fields


async def test_committed_log_carries_per_message_fields_in_process(
    client: DialogClient, env: dict[str, str]
):
    settings = load_settings(
        environ={**env, "DIALOG_METRICS_PORT": "0", "DIALOG_READ_BLOCK_MS": "100"}
    )
    assert settings.metrics_port == 0
    worker = Worker(settings, load_engine(None))
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            sent = await send_bursts(client, ["log-obs"], ["nama saya Budi", "keluhan"])
            applied = await wait_applied(client, sent, timeout_s=20)
            worker.stop()
    assert applied
    committed = [e for e in logs if e["event"] == "committed"]
    assert len(committed) == 2, logs
    for entry, s in zip(sorted(committed, key=lambda e: e["seq"]), sent, strict=True):
        assert MESSAGE_FIELDS <= set(entry), entry
        assert entry["session_id"] == "log-obs"
        assert (entry["msg_id"], entry["seq"]) == (s.msg_id, s.seq)
        assert entry["outcome"] == "applied"
        assert entry["attempt"] >= 1
        assert isinstance(entry["duration_ms"], float) and entry["duration_ms"] >= 0
        assert "-" in entry["entry_id"]
        assert entry["log_level"] == "info"
    # Context is per message: nothing leaks into lines that are not about one.
    stopped = [e for e in logs if e["event"] == "worker_stopped"]
    assert stopped and "session_id" not in stopped[0]


async def test_worker_json_log_file_has_committed_line_with_consumer(
    client: DialogClient, workers: WorkerPool
):
    [w] = workers.start(1, DIALOG_LOG_LEVEL="info")
    sent = await send_bursts(client, ["logfile-obs"], ["nama saya Budi"])
    assert await wait_applied(client, sent, timeout_s=20)

    def committed() -> list[dict[str, Any]]:
        return [e for e in json_lines(w.log_text()) if e.get("event") == "committed"]

    [entry] = await poll(committed, 10, "a committed line in the worker's log file")
    assert MESSAGE_FIELDS | {"consumer", "level", "timestamp"} <= set(entry), entry
    assert entry["consumer"] == w.name
    assert (entry["session_id"], entry["msg_id"], entry["seq"]) == (
        "logfile-obs",
        sent[0].msg_id,
        sent[0].seq,
    )
    assert entry["outcome"] == "applied"
    # Every JSON line carries the consumer, not just the per-message ones.
    assert all(e.get("consumer") == w.name for e in json_lines(w.log_text()))


# ---------------------------------------------------------------------------------------------
# 6. the password


def test_redis_password_never_appears_in_logs_or_metrics(tmp_path: Path):
    from conftest import worker_env

    url = f"redis://user:s3cretpw@127.0.0.1:{free_port()}/0"  # nothing listens there
    pool = WorkerPool(worker_env(url, DIALOG_LOG_LEVEL="debug"), tmp_path)
    try:
        [w] = pool.start(1, metrics=True)
        wait_sync(lambda: "redis_unavailable" in w.log_text(), 20, "a redis_unavailable line")
        got = w._get("/metrics")
        assert got is not None and got[0] == 200
        metrics_body = got[1]
        readyz = w._get("/readyz")
        assert readyz is not None and readyz[0] == 503
        assert w.terminate() == 0
    finally:
        pool.stop_all()
    log = w.log_text()
    assert "s3cretpw" not in log
    assert "s3cretpw" not in metrics_body
    # The URL is logged, redacted (so the check above is not vacuous).
    assert "redis://user:***@127.0.0.1" in log
    assert any(e.get("event") == "redis_unavailable" for e in json_lines(log))
