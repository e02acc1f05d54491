"""Redis as production runs it, with real processes: a wrong REDIS_URL stops `run` with one
line (exit 2) before anything is written, an outage is said once and its end too; an eviction
policy that can take the worker's keys is refused at start and noticed while running; Redis out
of memory is backpressure; a forward jump of Redis' clock; an AOF replay; a Sentinel failover."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from conftest import worker_env
from redis_server import RedisServer, free_port, wait_until
from worker_procs import REPO_DIR, WorkerPool

pytestmark = pytest.mark.fault


def run_worker(env: dict[str, str], timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """`dialog-worker run` to its end: (exit code, stdout, stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", "run"],
        env=env,
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:] + done.stdout[-3000:]
    assert lines[0].startswith("dialog-worker: "), lines
    return lines[0]


def dbsize_all(url: str, password: str | None = None) -> int:
    r = redis.Redis.from_url(url, password=password)
    try:
        info = r.info("keyspace")
        return sum(int(v["keys"]) for v in info.values())
    finally:
        r.close()


# ---------------------------------------------------------------------------------------------
# Errors that cannot heal: one line, exit 2, nothing written


def test_database_index_out_of_range_exits_2_before_writing(redis_server: RedisServer) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    done = run_worker(worker_env(f"redis://127.0.0.1:{redis_server.port}/99"))
    assert done.returncode == 2, done.stderr
    line = one_line(done)
    assert "REDIS_URL" in line and "database 99" in line, line
    assert dbsize_all(redis_server.url) == 0


@pytest.mark.parametrize("credentials", ["", ":wrong-pass@", "ghost:s3cret@"])
def test_refused_credentials_exit_2_before_writing(tmp_path: Path, credentials: str) -> None:
    server = RedisServer(tmp_path / "redis", extra=("--requirepass", "s3cret")).start()
    try:
        done = run_worker(worker_env(f"redis://{credentials}127.0.0.1:{server.port}/0"))
        assert done.returncode == 2, done.stderr
        line = one_line(done)
        assert "refused the credentials" in line, line
        assert "wrong-pass" not in line and "s3cret" not in line, line
        assert dbsize_all(server.url, password="s3cret") == 0
    finally:
        server.stop()


def test_tls_url_to_a_plain_server_exits_2(redis_server: RedisServer) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    done = run_worker(worker_env(f"rediss://127.0.0.1:{redis_server.port}/0"))
    assert done.returncode == 2, done.stderr
    line = one_line(done)
    assert "speaks plain Redis without TLS" in line and "redis://" in line, line
    assert dbsize_all(redis_server.url) == 0


def test_acl_without_script_rights_exits_2_before_writing(redis_server: RedisServer) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    admin.flushall()
    admin.acl_setuser(
        "noscripts", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-evalsha"]
    )
    try:
        done = run_worker(worker_env(f"redis://noscripts:pw@127.0.0.1:{redis_server.port}/0"))
        assert done.returncode == 2, done.stderr
        line = one_line(done)
        assert "NOPERM" in line and "evalsha" in line and "redis-acl.conf" in line, line
        assert admin.dbsize() == 0
    finally:
        admin.acl_deluser("noscripts")
        admin.close()


def test_command_the_server_does_not_know_exits_2(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", extra=("--rename-command", "EVALSHA", "")).start()
    try:
        done = run_worker(worker_env(server.url))
        assert done.returncode == 2, done.stderr
        line = one_line(done)
        assert "does not know a command" in line and "evalsha" in line.lower(), line
        assert dbsize_all(server.url) == 0
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# Errors that heal: said once, and once more when over


def test_connection_refused_is_retried_and_said_once_then_recovery(tmp_path: Path) -> None:
    port = free_port()
    pool = WorkerPool(worker_env(f"redis://127.0.0.1:{port}/0"), tmp_path)
    [w] = pool.start(1, metrics=True)
    server = RedisServer(tmp_path / "redis", port=port, appendonly=True)
    try:
        wait_until(lambda: "retrying" in w.log_text(), 20, what="the retry line")
        time.sleep(1.5)  # several retries go by: still one line
        server.start()
        wait_until(lambda: w._get("/readyz") == (200, "ready\n"), 30, what="ready after Redis")
        wait_until(lambda: "answers again" in w.log_text(), 5, what="the recovery line")
        told = [line for line in w.log_text().splitlines() if line.startswith("dialog-worker:")]
        assert len(told) == 2, told
        assert f"127.0.0.1:{port}" in told[0] and "at least every 5 s" in told[0], told[0]
        assert "answers again after" in told[1], told[1]
        assert w.terminate() == 0
    finally:
        pool.stop_all()
        server.stop()


# ---------------------------------------------------------------------------------------------
# Eviction and persistence


def test_eviction_policy_refused_at_start_with_what_to_set(tmp_path: Path) -> None:
    extra = ("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
    server = RedisServer(tmp_path / "redis", extra=extra).start()
    try:
        done = run_worker(worker_env(server.url))
        assert done.returncode == 2, done.stderr
        line = one_line(done)
        assert "maxmemory-policy allkeys-lru" in line, line
        assert "noeviction" in line and "DIALOG_ALLOW_EVICTION=1" in line, line
        assert dbsize_all(server.url) == 0
    finally:
        server.stop()


async def test_eviction_override_runs_and_says_so(tmp_path: Path) -> None:
    from dialog_worker.client import DialogClient
    from dialog_worker.config import load_settings

    extra = ("--maxmemory", "100mb", "--maxmemory-policy", "volatile-lru", "--appendonly", "yes")
    server = RedisServer(tmp_path / "redis", extra=extra).start()
    env = worker_env(server.url, DIALOG_ALLOW_EVICTION="1")
    pool = WorkerPool(env, tmp_path)
    try:
        [w] = pool.start(1, metrics=True)
        async with DialogClient(settings=load_settings(environ=env)) as c:
            reply = await c.ask("ev1", "nama saya Budi", timeout=20)
        assert reply.outcome == "applied"
        told = [line for line in w.log_text().splitlines() if line.startswith("dialog-worker:")]
        assert len(told) == 1 and "DIALOG_ALLOW_EVICTION=1" in told[0], told
        assert "dialog_redis_eviction_unsafe 1.0" in w.metrics_text()
    finally:
        pool.stop_all()
        server.stop()


def test_policy_changed_under_a_running_worker_makes_it_not_ready(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    pool = WorkerPool(worker_env(server.url, DIALOG_REDIS_CHECK_INTERVAL_S="1"), tmp_path)
    admin = redis.Redis.from_url(server.url)
    try:
        [w] = pool.start(1, metrics=True)
        wait_until(lambda: w._get("/readyz") == (200, "ready\n"), 20, what="ready")
        assert "dialog_redis_eviction_unsafe 0.0" in w.metrics_text()
        admin.config_set("maxmemory", "100mb")
        admin.config_set("maxmemory-policy", "allkeys-lru")
        wait_until(lambda: w._get("/readyz") == (503, "not ready\n"), 5, what="not ready")
        assert "dialog_redis_eviction_unsafe 1.0" in w.metrics_text()
        assert "redis_eviction_policy_unsafe" in w.log_text()
        admin.config_set("maxmemory-policy", "noeviction")
        wait_until(lambda: w._get("/readyz") == (200, "ready\n"), 5, what="ready again")
        assert "dialog_redis_eviction_unsafe 0.0" in w.metrics_text()
        assert w.alive()
    finally:
        admin.close()
        pool.stop_all()
        server.stop()


async def test_info_refused_is_one_line_and_the_worker_goes_on(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    from dialog_worker.client import DialogClient
    from dialog_worker.config import load_settings

    admin = redis.Redis.from_url(redis_server.url)
    admin.flushall()
    admin.acl_setuser(
        "noinfo",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        commands=["+@all", "-info", "-config"],
    )
    env = worker_env(f"redis://noinfo:pw@127.0.0.1:{redis_server.port}/0")
    pool = WorkerPool(env, tmp_path)
    try:
        [w] = pool.start(1, metrics=True)
        async with DialogClient(settings=load_settings(environ=env)) as c:
            reply = await c.ask("nc1", "nama saya Budi", timeout=20)
        assert reply.outcome == "applied"
        told = [line for line in w.log_text().splitlines() if line.startswith("dialog-worker:")]
        assert len(told) == 1 and "cannot read the Redis configuration" in told[0], told
    finally:
        pool.stop_all()
        admin.acl_deluser("noinfo")
        admin.close()


def test_no_aof_is_one_warning_line(redis_server: RedisServer, tmp_path: Path) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    pool = WorkerPool(worker_env(redis_server.url), tmp_path)
    try:
        [w] = pool.start(1, metrics=True)
        wait_until(lambda: w._get("/readyz") == (200, "ready\n"), 20, what="ready")
        told = [line for line in w.log_text().splitlines() if line.startswith("dialog-worker:")]
        assert len(told) == 1 and "without AOF" in told[0], told
        assert w.terminate() == 0
    finally:
        pool.stop_all()
