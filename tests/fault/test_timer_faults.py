"""Timers through a worker kill -9 and a Redis restart (AOF): every timer set by a committed
step fires exactly once, and each session's timers are applied in the order they were due."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from redis_server import RedisServer, wait_until
from worker_procs import WorkerPool

from dialog_worker.config import load_settings
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.fault

SESSIONS = 20
TIMERS = ("a", "b", "c")  # due 3.0, 3.5, 4.0 s after their steps


def events(r: redis.Redis) -> list[dict[str, str]]:
    rows = r.xrange("dialog-replies")
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in rows]


def test_timers_fire_once_in_order_through_worker_kill_and_redis_restart(tmp_path: Path) -> None:
    from conftest import worker_env

    server = RedisServer(tmp_path / "redis-aof", appendonly=True, fsync="always").start()
    env = worker_env(
        server.url,
        DIALOG_ENGINE="timer_engines:Timers",
        DIALOG_LOCK_TTL_MS="1000",
        DIALOG_VISIBILITY_TIMEOUT_MS="2000",
    )
    pool = WorkerPool(env, tmp_path)
    r = redis.Redis.from_url(server.url)
    try:
        procs = pool.start(2)
        for i in range(SESSIONS):
            for k, name in enumerate(TIMERS):
                r.xadd(
                    "dialog",
                    {"session_id": f"s{i}", "text": f"remind {3.0 + k / 2} {name}",
                     "msg_id": f"s{i}-{name}"},
                )  # fmt: skip
        set_all = SESSIONS * len(TIMERS)
        wait_until(lambda: len(events(r)) >= set_all, 30, what="every timer set")
        procs[0].kill()  # kill -9, with every timer waiting
        server.kill()  # and Redis: only the AOF is left
        server.start()
        pool.start(1)
        wait_until(lambda: len(events(r)) >= 2 * set_all, 60, what="every timer fired")
        time.sleep(1.5)  # nothing more comes
        got = events(r)
        fired = [e for e in got if e["msg_id"].startswith("timer:")]
        assert len(got) == 2 * set_all and len(fired) == set_all
        assert {e["outcome"] for e in got} == {"applied"}
        for i in range(SESSIONS):
            mine = [e for e in fired if e["session_id"] == f"s{i}"]
            names = [e["msg_id"].split(":")[1] for e in sorted(mine, key=lambda e: int(e["seq"]))]
            assert names == list(TIMERS), f"s{i}: {names}"
            assert [int(e["seq"]) for e in mine] == [4, 5, 6]
        keys = Keys.from_settings(load_settings(environ=env))
        assert r.zcard(keys.timers) == 0
    finally:
        pool.stop_all()
        server.stop()


def test_a_timer_fires_when_the_worker_polling_for_it_is_killed(tmp_path: Path) -> None:
    """Only the shard's waiter looks for due timers while the pool is idle: killed -9, it is
    replaced (its lease runs out, or the others stop counting on it) and the timer fires
    within about two leases (3 s each) of its due time."""
    from conftest import worker_env

    server = RedisServer(tmp_path / "redis").start()
    env = worker_env(server.url, DIALOG_ENGINE="timer_engines:Timers")
    pool = WorkerPool(env, tmp_path)
    r = redis.Redis.from_url(server.url)
    keys = Keys.from_settings(load_settings(environ=env))
    try:
        procs = pool.start(3)
        r.xadd("dialog", {"session_id": "k", "text": "warm", "msg_id": "k-warm"})
        wait_until(lambda: len(events(r)) >= 1, 30, what="the workers up")
        # Idle: one waiter, the other two blocked on the wake stream.
        name = wait_until(lambda: r.get(keys.waiter), 30, what="a waiter").decode()
        wait_until(
            lambda: sum(c["cmd"] == "xreadgroup" for c in r.client_list()) >= 2,
            30,
            what="two readers on the wake stream",
        )
        r.xadd("dialog", {"session_id": "k", "text": "remind 1.0 r", "msg_id": "k-r"})
        wait_until(lambda: len(events(r)) >= 2, 30, what="the timer set")
        due = time.time() + 1.0
        [waiter] = [p for p in procs if p.name == name]
        waiter.kill()
        # Fired later than 8 s past its time fails below anyway: wait no longer than that.
        wait_until(
            lambda: any(e["msg_id"].startswith("timer:r:") for e in events(r)),
            due + 8 - time.time(),
            what="the timer fired within 8 s of its time",
        )
        late_s = time.time() - due
        assert late_s < 8, late_s
    finally:
        pool.stop_all()
        server.stop()


def test_an_idle_worker_is_ready_again_and_fires_timers_after_its_connections_are_cut(
    tmp_path: Path,
) -> None:
    """Every connection cut while the pool is idle (a proxy or a Redis restart does this): the
    waiting reader reconnects at once, the other loops (resumer, timers) meet the cut later,
    one by one. The worker must be ready again and fire a timer that was waiting, not only
    once a new message comes: a failure of any loop marks every shard for a fresh group
    check, which only the reader makes, and an idle reader that stayed inside its wait never
    came back to make it (a timer waited forever, /readyz stayed 503)."""
    from conftest import worker_env

    server = RedisServer(tmp_path / "redis").start()
    env = worker_env(server.url, DIALOG_ENGINE="timer_engines:Timers")
    pool = WorkerPool(env, tmp_path)
    r = redis.Redis.from_url(server.url)
    try:
        [proc] = pool.start(1, metrics=True)
        r.xadd("dialog", {"session_id": "k", "text": "remind 2.0 r", "msg_id": "k-r"})
        wait_until(lambda: len(events(r)) >= 1, 30, what="the timer set")
        wait_until(lambda: r.get("dialog:{dialog}:ready:waiter"), 30, what="the waiter")
        wait_until(lambda: proc._get("/readyz") == (200, "ready\n"), 10, what="ready")
        due = time.time() + 2.0
        r.client_kill_filter(_type="normal", skipme=True)
        wait_until(
            lambda: any(e["msg_id"].startswith("timer:r:") for e in events(r)),
            20,
            what="the timer fired",
        )
        assert time.time() - due < 10
        wait_until(lambda: (proc._get("/readyz") or (0,))[0] == 200, 10, what="ready again")
    finally:
        pool.stop_all()
        server.stop()
