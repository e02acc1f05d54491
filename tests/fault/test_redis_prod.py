"""Redis as production runs it, with real processes: a wrong REDIS_URL stops `run` with one
line (exit 2) before anything is written, an outage is said once and its end too; an eviction
policy that can take the worker's keys is refused at start and noticed while running; Redis out
of memory is backpressure; a forward jump of Redis' clock; an AOF replay; a Sentinel failover."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio
import redis.exceptions
from conftest import worker_env
from redis_server import RedisServer, free_port, wait_until
from redis_server import wait_until_async as poll
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


async def test_eviction_override_runs_stays_ready_through_rechecks_and_says_so(
    tmp_path: Path,
) -> None:
    """DIALOG_ALLOW_EVICTION=1 holds for the periodic re-check too, not only at start: the
    policy moves to noeviction and back to an evicting one under the running worker (each
    seen by a re-check: the gauge follows it), and the worker stays ready and applies."""
    from dialog_worker.client.dialog_client import DialogClient
    from dialog_worker.config import load_settings

    extra = ("--maxmemory", "100mb", "--maxmemory-policy", "volatile-lru", "--appendonly", "yes")
    server = RedisServer(tmp_path / "redis", extra=extra).start()
    env = worker_env(server.url, DIALOG_ALLOW_EVICTION="1", DIALOG_REDIS_CHECK_INTERVAL_S="1")
    pool = WorkerPool(env, tmp_path)
    admin = redis.Redis.from_url(server.url)
    try:
        [w] = pool.start(1, metrics=True)
        async with DialogClient(settings=load_settings(environ=env)) as c:
            reply = await c.ask("ev1", "nama saya Budi", timeout=20)
            assert reply.outcome == "applied"
            told = [ln for ln in w.log_text().splitlines() if ln.startswith("dialog-worker:")]
            assert len(told) == 1 and "DIALOG_ALLOW_EVICTION=1" in told[0], told
            assert "dialog_redis_eviction_unsafe 1.0" in w.metrics_text()
            admin.config_set("maxmemory-policy", "noeviction")
            wait_until(lambda: "dialog_redis_eviction_unsafe 0.0" in w.metrics_text(), 10)
            admin.config_set("maxmemory-policy", "allkeys-lru")
            wait_until(lambda: "dialog_redis_eviction_unsafe 1.0" in w.metrics_text(), 10)
            assert w._get("/readyz") == (200, "ready\n")  # the re-check kept it ready
            assert (await c.ask("ev1", "lagi", timeout=20)).outcome == "applied"
        assert w.alive()
    finally:
        admin.close()
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
    from dialog_worker.client.dialog_client import DialogClient
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


# ---------------------------------------------------------------------------------------------
# Out of memory is backpressure


async def test_every_script_is_refused_before_it_runs_when_redis_is_out_of_memory(
    tmp_path: Path,
) -> None:
    """Each script declares its flags, so over maxmemory Redis refuses it whole (OOM) before
    its first command; renew alone may run (allow-oom: it only extends leases)."""
    from redis.asyncio import Redis as AsyncRedis

    from dialog_worker.store.scripts import Scripts

    server = RedisServer(tmp_path / "redis", extra=("--maxmemory", "8mb")).start()
    r = AsyncRedis.from_url(server.url)
    try:
        scripts = Scripts.register(r)
        await r.xadd("dialog", {"session_id": "s1", "text": "hi"})
        await r.setrange("filler", 9 * 1024 * 1024, "x")  # allowed: memory was below the limit
        before = {k: await r.dump(k) for k in await r.keys("*") if k != b"filler"}
        for field in ("intake", "resume", "commit", "release", "delconsumer"):
            script = getattr(scripts, field)
            assert script.source.startswith("#!lua flags=\n"), field
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                # Keys and arguments that would make every one of them write something.
                await script(
                    keys=["dialog", "dialog:{dialog}:ready", "dialog:{dialog}:s:", "d", "r"],
                    args=["dialog-workers", "c", 10, "t", 1000, 60, 65536, 32, 100, "v", 0, "f"],
                )
        assert scripts.renew.source.startswith("#!lua flags=allow-oom\n")
        assert (
            await scripts.renew(keys=["dialog:{dialog}:ready", "dialog:{dialog}:s:"], args=[1000])
            == []
        )
        after = {k: await r.dump(k) for k in await r.keys("*") if k != b"filler"}
        assert after == before, "a refused script wrote something"
    finally:
        await r.aclose()
        server.stop()


def scrape_sum(procs: list, name: str, label: str = "") -> float:
    from test_faults import metric

    return sum(metric(w.metrics_text(), name, label) for w in procs if w.alive())


async def test_out_of_memory_mid_burst_holds_the_pool_and_loses_nothing(tmp_path: Path) -> None:
    """Redis reaches maxmemory in the middle of a burst (a big key fills it): producers are
    refused (they retry with the same msg_id), intake and commits back off, leases hold, nothing
    is dead-lettered and no attempt is counted; once the key is deleted everything is applied
    exactly once, in order, at its first attempt."""
    import asyncio

    from dialog_worker.client.dialog_client import DialogClient
    from dialog_worker.config import load_settings
    from dialog_worker.ops.verify import Sent, check, wait_applied

    server = RedisServer(tmp_path / "redis", extra=("--maxmemory", "64mb")).start()
    env = worker_env(
        server.url,
        DIALOG_ENGINE="attempt_engine:make",
        # Eight 0.3 s steps a session: sessions are held when the memory runs out, however
        # slowly the producers send.
        ATTEMPT_ENGINE_STEP_S="0.3",
        DIALOG_LOCK_TTL_MS="1000",
        DIALOG_VISIBILITY_TIMEOUT_MS="2000",
    )
    pool = WorkerPool(env, tmp_path)
    admin = redis.asyncio.Redis.from_url(server.url)
    client = DialogClient(settings=load_settings(environ=env), max_connections=100)
    try:
        procs = pool.start(2, metrics=True)
        # Both workers have taken their leases (they read) before the burst begins.
        deadline = time.monotonic() + 30
        while await admin.get(f"{client.keys.workers}:n") != b"2":
            assert time.monotonic() < deadline, "the workers did not start"
            await asyncio.sleep(0.05)  # start-up poll
        sessions = [f"oom{i}" for i in range(60)]
        per_session = 8
        sent: list[Sent] = []
        refused_sends = 0
        filled = asyncio.Event()

        async def sender(sid: str) -> None:
            nonlocal refused_sends
            for i in range(1, per_session + 1):
                msg_id = f"{sid}-m{i}"
                while True:
                    try:
                        res = await client.send(sid, f"pesan {i}", msg_id=msg_id)
                        break
                    except redis.exceptions.OutOfMemoryError:
                        refused_sends += 1  # refused whole: nothing was appended
                        await asyncio.sleep(0.05)  # producer retry pacing
                sent.append(Sent(sid, i, res.msg_id, f"pesan {i}"))
                if len(sent) == len(sessions) * per_session // 3:
                    # A third of the burst is in: fill Redis past maxmemory.
                    info = await admin.info("memory")
                    room = int(info["maxmemory"]) - int(info["used_memory"])
                    await admin.setrange("filler", room + 2 * 1024 * 1024, "x")
                    filled.set()

        senders = asyncio.gather(*(sender(sid) for sid in sessions))
        await asyncio.wait_for(filled.wait(), 30)
        sent_at_fill = len(sent)
        await asyncio.sleep(1.0)  # let in-flight steps reach their commits
        applied_then = await applied_total(admin, sessions)
        # Sessions are held through the refusals (their leases are what must hold).
        held = [sid for sid in sessions if await admin.exists(client.keys.session(sid).lock)]
        assert held, "no session held when the memory ran out"
        oom_backing_off = await asyncio.to_thread(scrape_sum, procs, "dialog_redis_oom_backoff")
        await asyncio.sleep(2.0)  # held longer than a lease (1 s): leases must be renewed
        held_s = 3.0
        assert await applied_total(admin, sessions) == applied_then, "a commit went through"
        still = [sid for sid in held if await admin.exists(client.keys.session(sid).lock)]
        assert still == held, "a held session's lock ran out"
        assert await admin.xlen("dialog-dlq") == 0
        refusals = await asyncio.to_thread(scrape_sum, procs, "dialog_redis_oom_total")
        assert refusals > 0 and oom_backing_off >= 1
        assert all(w.alive() for w in procs)
        await admin.delete("filler")
        freed = time.monotonic()
        await senders
        assert await wait_applied(client, sent, timeout_s=60)
        drained_s = time.monotonic() - freed
        assert await check(client, sent) == []
        replies = await admin.xrange("dialog-replies")
        assert {f[b"reply"] for _, f in replies} == {b"attempt=1"}, "an attempt was counted"
        assert await admin.xlen("dialog-dlq") == 0
        totals = {
            name: await asyncio.to_thread(scrape_sum, procs, metric_name, label)
            for name, (metric_name, label) in {
                "reclaimed": ("dialog_reclaimed_total", ""),
                "fencing": ("dialog_fencing_rejections_total", ""),
                "retried": ("dialog_retries_total", 'reason="error"'),
                "dead_lettered": ("dialog_messages_total", 'outcome="dead_lettered"'),
            }.items()
        }
        assert totals == {"reclaimed": 0, "fencing": 0, "retried": 0, "dead_lettered": 0}
        print(
            f"\n[oom] filled after {sent_at_fill} sends; held {held_s:.0f}s with "
            f"{applied_then} applied; {int(refusals)} script calls refused for memory, "
            f"{refused_sends} sends refused and retried; all {len(sent)} applied once, "
            f"attempt 1, {drained_s:.1f}s after the memory was freed"
        )
    finally:
        await client.aclose()
        await admin.aclose()
        pool.stop_all()
        server.stop()


async def applied_total(r, sessions: list[str]) -> int:
    total = 0
    for sid in sessions:
        got = await r.hget(f"dialog:{{dialog}}:s:{{{sid}}}:state", "a")
        total += int(got or 0)
    return total


# ---------------------------------------------------------------------------------------------
# AOF replay: no phantom lag in stats, the lag gauge or the KEDA trigger


def keda_trigger_value(r: redis.Redis) -> int:
    """What deploy/kubernetes/keda-scaledobject.yaml's trigger reads, as KEDA's redis-streams
    scaler reads it: with a consumerGroup the lag (nil read as 0) or the pending count, without
    one the stream length."""
    import yaml

    docs = yaml.safe_load_all((REPO_DIR / "deploy/kubernetes/keda-scaledobject.yaml").read_text())
    [scaled] = [d for d in docs if d and d["kind"] == "ScaledObject"]
    [trigger] = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    if "consumerGroup" not in meta:
        return int(r.xlen(meta["stream"]))
    [group] = [g for g in r.xinfo_groups(meta["stream"]) if g["name"] == meta["consumerGroup"]]
    if "lagCount" in meta or "lag" in meta:
        return int(group["lag"] or 0)
    return int(group["pending"])


def unfinished(r: redis.Redis) -> tuple[int, int]:
    """(unread, in the stream) counted from the entries themselves: entries after the group's
    last delivered id, and every entry. A worker moves an entry out of the stream when it
    reads it, so the two are equal unless something left a read entry behind."""
    [group] = r.xinfo_groups("dialog")
    unread = len(r.xrange("dialog", min=b"(" + group["last-delivered-id"]))
    return unread, int(r.xlen("dialog"))


async def test_aof_restart_reports_no_phantom_lag(tmp_path: Path) -> None:
    """Redis killed mid-burst with AOF, then replayed: `stats`, the dialog_group_lag gauge
    and the KEDA trigger's value equal what the stream holds (Redis' own XINFO lag is nil
    here, which KEDA's lag mode would read as 0 with a backlog waiting)."""
    import asyncio
    import json

    from test_faults import metric

    from dialog_worker.client.dialog_client import DialogClient
    from dialog_worker.config import load_settings
    from dialog_worker.ops.verify import send_bursts

    server = RedisServer(tmp_path / "redis", appendonly=True, fsync="always").start()
    env = worker_env(
        server.url,
        DIALOG_ENGINE="attempt_engine:make",
        ATTEMPT_ENGINE_STEP_S="0.02",
        DIALOG_CONCURRENCY="8",
    )
    pool = WorkerPool(env, tmp_path)
    r = redis.Redis.from_url(server.url)
    try:
        first = pool.start(2)
        async with DialogClient(settings=load_settings(environ=env), max_connections=50) as c:
            # More sessions than the two workers lock at once (8 slots each, and up to 64
            # read ahead while every slot is busy), so the burst cannot be read out at once.
            await send_bursts(c, [f"aof{i}" for i in range(200)], [f"hold {j}" for j in range(10)])
            # Part of the burst is done: commits, hand-offs and deletions are in the AOF.
            for _ in range(200):
                if r.xlen("dialog") < 1800:
                    break
                await asyncio.sleep(0.05)
        for w in first:
            w.kill()
        await asyncio.to_thread(server.kill)
        await asyncio.to_thread(server.start)
        r = redis.Redis.from_url(server.url)
        [group] = r.xinfo_groups("dialog")
        unread, outstanding = unfinished(r)
        # Only unread entries are in the stream (read ones moved into their sessions' keys),
        # and some work was left for the replay: part read, part not.
        assert 0 < unread == outstanding < 2000
        stats = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "dialog_worker", "stats"],
            env=env,
            cwd=REPO_DIR,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert stats.returncode == 0, stats.stderr
        reported = json.loads(stats.stdout)
        assert (reported["lag"], reported["stream_length"]) == (unread, outstanding)
        assert keda_trigger_value(r) == outstanding
        # The gauge, from a worker that takes two sessions and holds them: the stream then
        # stays as it is while the gauge is read.
        flag = tmp_path / "hold"
        flag.touch()
        [w] = pool.start(
            1,
            metrics=True,
            DIALOG_ENGINE="fault_engine:make",
            FAULT_FLAG_FILE=str(flag),
            DIALOG_CONCURRENCY="2",
            DIALOG_METRICS_SAMPLE_INTERVAL_S="0.1",
        )

        def gauge_matches() -> tuple[float, int] | None:
            # Both slots taken first: until then an intake call may still take entries.
            text = w.metrics_text()
            if metric(text, "dialog_in_flight") < 2:
                return None
            now_unread, _ = unfinished(r)
            gauge = metric(text, "dialog_group_lag")
            return (gauge, now_unread) if gauge == now_unread else None

        gauge, now_unread = wait_until(gauge_matches, 20, what="dialog_group_lag = unread")
        assert now_unread > 0 and gauge <= r.xlen("dialog")
        print(
            f"\n[aof] after the replay: {unread} unread ({outstanding} in the stream); XINFO "
            f"lag {group['lag']!r} entries-read {group['entries-read']!r}; stats lag "
            f"{reported['lag']}, KEDA trigger {keda_trigger_value(r)} (XLEN), gauge {gauge:g}"
        )
        flag.unlink()
    finally:
        r.close()
        pool.stop_all()
        server.stop()


# ---------------------------------------------------------------------------------------------
# A forward step of Redis' clock


async def test_redis_clock_jumps_an_hour_mid_burst(tmp_path: Path) -> None:
    """Redis' wall clock steps +1 h while a burst is worked on: every lock lease and every
    timer in Redis runs out at once. Fencing holds: 0 messages applied twice, 0 out of order,
    nothing dead-lettered (no false gap). Idle states whose TTL the step ran out are gone, as
    an expired state is: the session's next message starts a new conversation at seq 1."""
    import asyncio
    from collections import defaultdict

    import clock_shift
    from test_faults import metric

    from dialog_worker.client.dialog_client import DialogClient
    from dialog_worker.config import load_settings
    from dialog_worker.ops.verify import send_bursts, wait_applied

    library = clock_shift.build(tmp_path)
    if library is None:
        pytest.skip("no C compiler (cc) to build tests/support/clockshift.c")
    clock = clock_shift.ClockShift(tmp_path, library)
    server = RedisServer(tmp_path / "redis", appendonly=True, env=clock.env).start()
    env = worker_env(
        server.url,
        DIALOG_ENGINE="attempt_engine:make",
        ATTEMPT_ENGINE_STEP_S="0.05",
        DIALOG_STATE_TTL_S="1800",
    )
    pool = WorkerPool(env, tmp_path)
    r = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    client = DialogClient(settings=load_settings(environ=env), max_connections=100)
    try:
        procs = pool.start(2, metrics=True)
        idle = await send_bursts(client, [f"idle{i}" for i in range(20)], ["a", "b", "c"])
        assert await wait_applied(client, idle, timeout_s=30)
        busy_sessions = [f"busy{i}" for i in range(60)]
        texts = [f"pesan {j}" for j in range(1, 11)]
        sending = asyncio.create_task(send_bursts(client, busy_sessions, texts))

        async def a_third_applied() -> bool:
            got = await asyncio.gather(*(r.hget(state_key(s), "a") for s in busy_sessions))
            return sum(int(a or 0) for a in got) >= len(busy_sessions) * len(texts) // 3

        await poll(a_third_applied, 30, "a third of the burst applied")
        before = int((await r.time())[0])
        clock.step(3600)
        await poll(lambda: redis_time_after(r, before + 3000), 5, "Redis' clock stepped")
        jumped_ms = int((await r.time())[0]) * 1000
        busy = await sending

        async def replies() -> dict[tuple[str, str], list[tuple[str, dict[str, str]]]]:
            events: dict[tuple[str, str], list[tuple[str, dict[str, str]]]] = defaultdict(list)
            for entry_id, f in await r.xrange("dialog-replies"):
                events[(f["session_id"], f["msg_id"])].append((entry_id, f))
            return events

        async def all_answered() -> bool:
            events = await replies()
            return all((s.session_id, s.msg_id) in events for s in busy)

        await poll(all_answered, 60, "a reply event for every message of the burst")
        events = await replies()
        applied_twice = [k for k, evs in events.items() if len(evs) > 1]
        not_applied = [
            k for k, evs in events.items() if any(f["outcome"] != "applied" for _, f in evs)
        ]
        out_of_order = []
        by_session: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for s in busy:
            [(entry_id, f)] = events[(s.session_id, s.msg_id)][:1]
            by_session[s.session_id].append((entry_id, int(f["seq"])))
            if int(f["seq"]) != s.seq:
                out_of_order.append((s.session_id, s.msg_id, f["seq"], s.seq))
        for sid, seqs in by_session.items():
            in_stream_order = [seq for _, seq in sorted(seqs, key=lambda e: stream_id(e[0]))]
            if in_stream_order != sorted(in_stream_order):
                out_of_order.append((sid, in_stream_order))
        assert applied_twice == [] and not_applied == [] and out_of_order == []
        assert await r.xlen("dialog-dlq") == 0, "a false gap or an exhausted message"
        # Busy sessions: the whole conversation in the state, or (finished before the step,
        # then idle past DIALOG_STATE_TTL_S) no state at all, never a partial one.
        kept = expired = 0
        for sid in busy_sessions:
            state = await client.state(sid)
            last_event = max(stream_id(e) for e, _ in (events[k][0] for k in events if k[0] == sid))
            if state is None:
                assert last_event < (jumped_ms, 0), f"{sid}: state gone while it was worked on"
                expired += 1
            else:
                assert state["applied_seq"] == len(texts), state
                assert [t["seq"] for t in state["history"]] == list(range(1, len(texts) + 1))
                kept += 1
        # Idle sessions: their states expired with the step; a new message starts over.
        assert all([await client.state(s) is None for s in {s.session_id for s in idle}])
        again = await client.ask("idle0", "nama saya Budi", timeout=20)
        assert (again.outcome, again.seq) == ("applied", 1)
        fenced = sum(metric(w.metrics_text(), "dialog_fencing_rejections_total") for w in procs)
        taken = sum(metric(w.metrics_text(), "dialog_reclaimed_total") for w in procs)
        print(
            f"\n[clock] +3600 s after {len(busy) // 3}+ of {len(busy)} applied: 0 applied "
            f"twice, 0 out of order, 0 dead letters; {int(taken)} sessions taken over, "
            f"{int(fenced)} results fenced; {kept} busy states kept, {expired} expired idle; "
            f"20 idle states expired"
        )
    finally:
        await client.aclose()
        await r.aclose()
        pool.stop_all()
        server.stop()


def state_key(session_id: str) -> str:
    return f"dialog:{{dialog}}:s:{{{session_id}}}:state"


def stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, n = entry_id.partition("-")
    return int(ms), int(n or 0)


async def redis_time_after(r, seconds: int) -> bool:
    return int((await r.time())[0]) >= seconds


# ---------------------------------------------------------------------------------------------
# Sentinel failover


def sentinel_or_skip(tmp_path: Path):
    if shutil.which("redis-sentinel") is None:
        pytest.skip("redis-sentinel is not installed (apt-get install redis-sentinel)")
    from redis_sentinel import SentinelSet

    return SentinelSet(tmp_path / "sentinel").start()


async def test_sentinel_failover_mid_burst_workers_follow_and_report_lost_commits(
    tmp_path: Path,
) -> None:
    """1 master, 1 replica, 3 Sentinels; workers and the client use a redis+sentinel:// URL.
    Mid-burst the replica falls behind (paused 0.5 s) and the master is killed (-9): the
    Sentinels promote the replica, which lacks the master's last writes. The workers follow the
    new master; what Redis lost (acknowledged sends, acknowledged commits) is counted apart
    from what the workers lost, which must be nothing; every commit the workers saw Redis
    lose is reported by them (dialog_redis_commits_lost_total, log `commits_lost`)."""
    import asyncio
    import os
    from collections import defaultdict

    from test_faults import metric

    from dialog_worker.client.dialog_client import DialogClient
    from dialog_worker.config import load_settings

    started = time.monotonic()
    cluster = sentinel_or_skip(tmp_path)
    env = worker_env(
        cluster.url,
        DIALOG_LOCK_TTL_MS="1000",
        DIALOG_VISIBILITY_TIMEOUT_MS="2000",
        DIALOG_ENGINE="attempt_engine:make",
        ATTEMPT_ENGINE_STEP_S="0.01",
    )
    pool = WorkerPool(env, tmp_path)
    client = DialogClient(settings=load_settings(environ=env), max_connections=100)
    seen_on_old: dict[tuple[str, str], str] = {}  # applied events read before the kill
    try:
        procs = pool.start(2, metrics=True)
        sessions = [f"sn{i}" for i in range(80)]
        per_session = 20
        sent: list[tuple[str, int, str]] = []
        half_way = asyncio.Event()
        killed = asyncio.Event()

        async def sender(sid: str) -> None:
            for i in range(1, per_session + 1):
                msg_id = f"{sid}-m{i}"
                deadline = time.monotonic() + 40
                while True:
                    try:
                        await client.send(sid, f"pesan {i}", msg_id=msg_id)
                        break
                    except (redis.exceptions.RedisError, OSError):
                        assert time.monotonic() < deadline, "no master for 40 s"
                        await asyncio.sleep(0.05)  # retry pacing, same msg_id
                sent.append((sid, i, msg_id))
                if len(sent) >= len(sessions) * per_session // 2:
                    half_way.set()
                await asyncio.sleep(0.1)  # a producer's pace: the burst spans the failover

        async def tail_old_master() -> None:
            old = redis.asyncio.Redis(port=cluster.master.port, decode_responses=True)
            last = "0-0"
            try:
                while not killed.is_set():
                    got = await old.xread({"dialog-replies": last}, count=500, block=50)
                    for _, entries in got:
                        for entry_id, f in entries:
                            last = entry_id
                            if f.get("outcome") == "applied":
                                seen_on_old[(f["session_id"], f["msg_id"])] = entry_id
            except (redis.exceptions.RedisError, OSError):
                pass  # the master was killed
            finally:
                await old.aclose(close_connection_pool=True)

        tail = asyncio.create_task(tail_old_master())
        senders = asyncio.gather(*(sender(sid) for sid in sessions))
        await asyncio.wait_for(half_way.wait(), 30)
        assert cluster.replica is not None and cluster.replica.proc is not None
        old_master_port = cluster.master.port
        # The replica falls behind: paused, its link cut (what it had received is kept), so
        # the master's next 0.5 s of writes never reach it.
        os.kill(cluster.replica.proc.pid, signal.SIGSTOP)
        master = redis.asyncio.Redis(port=old_master_port)
        await master.client_kill_filter(_type="replica")
        await master.aclose()
        await asyncio.sleep(0.5)
        await asyncio.sleep(0.1)  # let the tail reader see the last events
        await asyncio.to_thread(cluster.master.kill)
        killed_at = time.monotonic()
        killed_wall_ms = int(time.time() * 1000)
        killed.set()
        os.kill(cluster.replica.proc.pid, signal.SIGCONT)
        await tail
        await poll(
            lambda: asyncio.to_thread(lambda: cluster.master_port() != old_master_port),
            20,
            "the Sentinels promote the replica",
        )
        promoted_s = time.monotonic() - killed_at
        new = redis.asyncio.Redis(port=cluster.replica.port, decode_responses=True)

        async def applied_on_new() -> dict[tuple[str, str], list[str]]:
            events: dict[tuple[str, str], list[str]] = defaultdict(list)
            for entry_id, f in await new.xrange("dialog-replies"):
                if f.get("outcome") == "applied":
                    events[(f["session_id"], f["msg_id"])].append(entry_id)
            return events

        async def first_commit_on_new() -> int | None:
            """When (ms) the workers' first commit on the new master happened: the reply
            stream's ids carry the server's clock, and nothing before the kill is later."""
            after = await new.xrange("dialog-replies", min=f"{killed_wall_ms + 1}-0", count=1)
            return stream_id(after[0][0])[0] if after else None

        followed_s = (await poll(first_commit_on_new, 30, "a commit on the new master")) / 1000
        followed_s -= killed_wall_ms / 1000
        await senders

        async def drained() -> bool:
            return await new.xlen("dialog") == 0 and await new.zcard("dialog:{dialog}:ready") == 0

        await poll(drained, 40, "the new master drained")
        events = await applied_on_new()
        in_new_master = set(events)
        lost_sends = [m for m in sent if (m[0], m[2]) not in in_new_master]
        twice = [k for k, ids in events.items() if len(ids) > 1]
        out_of_order = []
        per_session_order: dict[str, list[tuple[tuple[int, int], int]]] = defaultdict(list)
        for sid, i, msg_id in sent:
            for entry_id in events.get((sid, msg_id), []):
                per_session_order[sid].append((stream_id(entry_id), i))
        for sid, pairs in per_session_order.items():
            order = [i for _, i in sorted(pairs)]
            if order != sorted(order):
                out_of_order.append((sid, order))
        lost_commits = [k for k, eid in seen_on_old.items() if eid not in events.get(k, [])]
        # Each worker noticed the new master (its watch backs off while Redis is down).
        await asyncio.to_thread(
            wait_until,
            lambda: all(metric(w.metrics_text(), "dialog_redis_switches_total") for w in procs),
            10,
            what="both workers notice the new master",
        )
        reported = sum(metric(w.metrics_text(), "dialog_redis_commits_lost_total") for w in procs)
        # What the workers lost: nothing. Every message whose send survived was applied exactly
        # once, in its session's order, and nothing was dead-lettered.
        assert twice == [] and out_of_order == [], (twice[:5], out_of_order[:5])
        assert await new.xlen("dialog-dlq") == 0
        # What Redis lost, counted and reported.
        assert lost_commits, "the replica lagged 0.5 s: some commits must have been lost"
        assert reported >= len(lost_commits), "Redis lost commits the workers did not report"
        assert any("commits_lost" in w.log_text() for w in procs)
        assert followed_s < 15
        elapsed = time.monotonic() - started
        print(
            f"\n[sentinel] master kill -9 after {len(seen_on_old)} applied events seen; "
            f"promoted after {promoted_s:.1f}s, workers committing on the new master after "
            f"{followed_s:.1f}s; Redis lost {len(lost_sends)} acknowledged sends and "
            f"{len(lost_commits)} acknowledged commits (applied again where the send survived); "
            f"workers reported {int(reported)} lost commits; workers lost 0; whole test "
            f"{elapsed:.0f}s"
        )
        await new.aclose()
    finally:
        await client.aclose()
        pool.stop_all()
        cluster.stop()
