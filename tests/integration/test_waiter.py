"""One waiter per shard: an append to an idle pool wakes one worker, not every replica, and a
waiter that dies is replaced within its lease. Real worker processes, real Redis."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import anyio
import pytest
import redis
from redis_server import wait_until, wait_until_async
from tenant_engines import share

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.store.scripts import source

pytestmark = pytest.mark.integration

WAITER = "dialog:{dialog}:ready:waiter"
WAKE = "dialog:{dialog}:ready:wake"


def _calls(r: redis.Redis, command: str) -> int:
    stats = r.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def _arg(command: bytes | str, i: int) -> str:
    """The i-th word of a slow log entry's command, lower case ('' when it has fewer)."""
    text = command.decode(errors="replace") if isinstance(command, bytes) else command
    words = text.split()
    return words[i].lower() if len(words) > i else ""


def _idle(r: redis.Redis, others: int, timeout_s: float = 30) -> str:
    """One worker holds the waiter role (its name is returned) and `others` are blocked on
    the wake stream (Redis 7.0 lists no consumer for a read that is still blocked)."""
    name = str(wait_until(lambda: r.get(WAITER), timeout_s, what="a waiter").decode())

    def readers() -> bool:
        blocked = [c for c in r.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"]]
        return len(blocked) >= others

    wait_until(readers, timeout_s, what=f"{others} readers on the wake stream")
    return name


async def test_an_append_to_an_idle_pool_wakes_one_worker(client: DialogClient, workers, env):
    r = redis.Redis.from_url(env["REDIS_URL"])
    workers.start(4)
    wait_until(lambda: all(w.alive() for w in workers.procs), 10)
    await client.ask("warm", "halo", timeout=20)  # every worker up, scripts loaded
    _idle(r, others=3, timeout_s=10)  # within a second of the warm-up
    # Every command goes to the slow log, so the scripts can be told apart: each worker's lease
    # (lua/lease-2.lua) is renewed on a clock, whatever the messages, and is not counted.
    r.config_set("slowlog-max-len", 100_000)
    r.config_set("slowlog-log-slower-than", 0)
    r.slowlog_reset()
    n = 10
    for i in range(n):
        reply = await client.ask(f"lone{i}", "nama saya Budi", timeout=20)
        assert reply.outcome == "applied"
    r.config_set("slowlog-log-slower-than", 10_000)
    lease = hashlib.sha1(source("lease").encode("utf-8")).hexdigest()
    shas = [
        _arg(e["command"], 1) for e in r.slowlog_get(100_000) if _arg(e["command"], 0) == "evalsha"
    ]
    per_message = sum(1 for sha in shas if sha != lease) / n
    # One intake call and one commit per message (plus a rare idle re-check); with every
    # blocked replica woken it was 4 intake calls + 1 commit.
    assert per_message < 3, (per_message, len(shas))


async def test_an_idle_pool_looks_for_due_timers_from_one_worker(
    client: DialogClient, workers, env
):
    """The shard's upkeep (due timers, the reclaim check) is the waiter's: an idle pool of 4
    pays one worker's look at the timers every 0.25 s, not four; the others block on the wake
    stream a lease (3 s) at a time."""
    r = redis.Redis.from_url(env["REDIS_URL"])
    workers.start(4)
    await client.ask("warm", "halo", timeout=20)
    _idle(r, others=3)
    commands = ("zrange", "xreadgroup")
    before, started = {c: _calls(r, c) for c in commands}, time.monotonic()
    await anyio.sleep(6)
    elapsed = time.monotonic() - started
    per_s = {c: (_calls(r, c) - before[c]) / elapsed for c in commands}
    # One ZRANGE of the timers every 0.25 s (4/s) and each resumer's look at the ready set
    # (4 x 1/s); with every worker polling the timers it was 16/s + 4/s.
    assert per_s["zrange"] < 12, per_s
    # Three readers on the wake stream, one read each per 3 s (it was one per second).
    assert per_s["xreadgroup"] < 2, per_s


async def test_a_killed_waiter_is_replaced_within_its_lease(client: DialogClient, workers, env):
    r = redis.Redis.from_url(env["REDIS_URL"])
    procs = workers.start(2)
    await client.ask("warm", "halo", timeout=20)
    name = _idle(r, others=1)
    [waiter] = [w for w in procs if w.name == name]
    waiter.kill()
    started = time.monotonic()
    # A reply later than 10 s fails below anyway: wait no longer than that.
    reply = await client.ask("after-kill", "nama saya Budi", timeout=10)
    assert reply.outcome == "applied"
    # The lease (3 s) runs out, the other worker asks for the role (at most 3 s later).
    assert time.monotonic() - started < 10
    assert r.get(WAITER).decode() != name


async def test_an_idle_reader_waits_from_the_last_id_its_intake_read(env):
    """The race of an idle wait: an entry appended after the intake call that found nothing
    and before the blocking read. The waiter blocks from the last id the intake read, so
    that entry ends the wait at once; a read from "$" (only what comes later) would sit out
    the whole blocking read."""
    from dialog_worker.config import load_settings
    from dialog_worker.daemon.worker import Worker
    from dialog_worker.engine.loading import load_engine

    r = redis.Redis.from_url(env["REDIS_URL"])
    seen = r.xadd("dialog", {"session_id": "w0", "text": "read by the last intake"})
    r.xadd("dialog", {"session_id": "w1", "text": "appended in between"})
    worker = Worker(
        load_settings(environ={**env, "DIALOG_READ_BLOCK_MS": "3000"}), load_engine(None)
    )
    try:
        r.xgroup_create("dialog", "dialog-workers", id=seen)  # what that intake left
        worker.shards[0].group_ready = True  # as after the reader's first call
        started = time.monotonic()
        with anyio.fail_after(2):
            await worker.reader.idle_wait(worker.shards[0], seen)
        assert time.monotonic() - started < 1
    finally:
        await worker.raw.aclose()
        await worker.redis.aclose()


def _command_names(packed: bytes, scripts: dict[bytes, str]) -> tuple[str, ...]:
    """The commands of one write to Redis (RESP arrays of bulk strings), named by their first
    argument; a script call by the script's name."""
    names, pos = [], 0
    while pos < len(packed):
        end = packed.index(b"\r\n", pos)
        count, pos, args = int(packed[pos + 1 : end]), end + 2, []
        for _ in range(count):
            end = packed.index(b"\r\n", pos)
            size = int(packed[pos + 1 : end])
            args.append(packed[end + 2 : end + 2 + size])
            pos = end + 2 + size + 2
        name = args[0].decode().lower()
        names.append(scripts.get(args[1], "script") if name == "evalsha" else name)
    return tuple(names)


async def _writes_for_a_lone_message(env: dict[str, str]) -> list[tuple[str, ...]]:
    """Every write an idle worker sends to Redis from a lone message's append until its reply
    event, and the next one after it: the commands each write carries."""
    from dialog_worker.config import load_settings
    from dialog_worker.daemon.worker import Worker
    from dialog_worker.engine.loading import load_engine

    r = redis.Redis.from_url(env["REDIS_URL"])
    worker = Worker(load_settings(environ=env), load_engine(None))
    scripts = {
        worker.scripts.intake.sha.encode(): "intake",
        worker.scripts.commit.sha.encode(): "commit",
    }
    writes: list[tuple[str, ...]] = []
    pool = worker.raw.connection_pool
    base = pool.connection_class

    class Recording(base):  # type: ignore[misc,valid-type]  # the pool's own class
        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            chunks = [command] if isinstance(command, bytes | str) else command
            packed = b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)
            writes.append(_command_names(packed, scripts))
            await super().send_packed_command(command, check_health)

    pool.connection_class = Recording
    blocked = ("xread", "intake") if worker.settings.concurrency > 1 else ("xread",)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        # At once (a tenth of a second) once the worker is up.
        await anyio.to_thread.run_sync(lambda: wait_until(lambda: blocked in writes, 10))
        del writes[:]
        r.xadd("dialog", {"session_id": "lone", "text": "halo"})
        await anyio.to_thread.run_sync(lambda: wait_until(lambda: r.xlen("dialog-replies"), 20))
        await anyio.to_thread.run_sync(lambda: wait_until(lambda: len(writes) >= 2, 20))
        worker.stop()
    return [w for w in writes if w[0] in ("xread", "intake", "commit")]


async def test_a_lone_message_costs_the_worker_two_round_trips_its_read_and_its_commit(env):
    """An idle worker blocks on the inbound stream with its intake call queued behind the read
    in the same write: Redis runs the intake as the message arrives, with no round trip back
    to the worker in between. The commit then goes out before the next read (the sessions the
    intake started run first), so it is not queued behind a blocking read on its way."""
    writes = await _writes_for_a_lone_message(env)
    assert writes[:2] == [("commit",), ("xread", "intake")], writes


async def test_with_one_slot_the_reader_blocks_without_an_intake_call_behind_its_read(env):
    """With one message slot the reader holds none while it blocks (the resumer must be able
    to take it): it reads, then calls intake, then the session commits, before the reader's
    next call."""
    writes = await _writes_for_a_lone_message({**env, "DIALOG_CONCURRENCY": "1"})
    assert ("xread", "intake") not in writes, writes
    assert writes[:2] == [("intake",), ("commit",)], writes
    assert ("xread",) in writes, writes


def _read_ahead_worker(env: dict[str, str], concurrency: int) -> Any:
    from dialog_worker.config import load_settings
    from dialog_worker.daemon.worker import Worker
    from dialog_worker.engine.loading import load_engine

    settings = load_settings(
        environ={**env, "DIALOG_CONCURRENCY": str(concurrency), "DIALOG_READ_BLOCK_MS": "3000"}
    )
    return Worker(settings, load_engine(None))


async def _until(check: Any, timeout_s: float = 20) -> None:
    await anyio.to_thread.run_sync(lambda: wait_until(check, timeout_s))


async def test_a_blocked_read_leaves_a_message_slot_free_for_the_resumer(env):
    """The read that carries an intake call holds the slots that call may fill while it
    blocks, all but one: a session that falls due meanwhile (a crashed holder's lease ran out,
    a retry's backoff is over) is taken up without waiting for the read to time out."""
    worker = _read_ahead_worker(env, 4)
    shard = worker.shards[0]
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        await _until(lambda: shard.slots.free == 1, 10)  # at once (a tenth of a second)
        # The read blocks (3 s) with three slots taken; the fourth is there for the taking.
        shard.slots.acquire_nowait()
        shard.slots.release()
        worker.stop()


async def test_a_read_whose_intake_call_fails_gives_its_slots_back(env):
    """Redis lost the scripts (a restart, a failover) while the worker's read blocked: the
    intake call behind it fails with NOSCRIPT, the plain intake call loads the script and takes
    the message, and no slot is lost, then or when the worker stops in the middle of a read."""
    r = redis.Redis.from_url(env["REDIS_URL"])
    worker = _read_ahead_worker(env, 4)
    shard = worker.shards[0]
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        await _until(lambda: shard.slots.free == 1)
        r.script_flush()
        r.xadd("dialog", {"session_id": "noscript", "text": "halo"})
        await _until(lambda: r.xlen("dialog-replies") == 1)
        await _until(lambda: shard.slots.free == 1)
        # The blocked read's connection breaks (Redis restarted, a proxy dropped it).
        [blocked] = [c for c in r.client_list() if c["cmd"] == "xread" and "b" in c["flags"]]
        r.client_kill_filter(_id=blocked["id"])
        await _until(lambda: shard.slots.free == 1 and r.client_list()[-1]["id"] != blocked["id"])
        r.xadd("dialog", {"session_id": "reconnected", "text": "halo"})
        await _until(lambda: r.xlen("dialog-replies") == 2)
        await _until(lambda: shard.slots.free == 1)
        worker.stop()
    assert shard.slots.free == 4


async def test_a_read_whose_intake_stays_unanswered_gives_its_slots_back(env):
    """The blocked read's connection breaks and the intake call behind it, sent again, gets no
    answer either (Redis out of reach past the time a lost reply is asked for again): the
    read gives back the slots it held, and the next read takes them again."""
    r = redis.Redis.from_url(env["REDIS_URL"])
    worker = _read_ahead_worker(env, 4)
    shard = worker.shards[0]

    async def unanswered(shard_number: int, call: Any) -> Any:
        worker.sessions.in_doubt = sent_again  # once: Redis answers the next read
        raise redis.exceptions.ConnectionError("test: Redis stayed out of reach")

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        await _until(lambda: shard.slots.free == 1)
        sent_again = worker.sessions.in_doubt
        worker.sessions.in_doubt = unanswered  # type: ignore[method-assign]
        [blocked] = [c for c in r.client_list() if c["cmd"] == "xread" and "b" in c["flags"]]
        r.client_kill_filter(_id=blocked["id"])
        await _until(lambda: r.client_list()[-1]["id"] != blocked["id"])
        await _until(lambda: shard.slots.free == 1)  # read again, with the same slots
        worker.stop()
    assert shard.slots.free == 4


async def test_a_worker_stops_at_once_while_its_read_blocks(env):
    """A read with an intake call behind it is never cancelled (the call could run after the
    worker gave up on its reply); shutdown ends it through the wake stream instead of waiting
    for it to time out."""
    worker = _read_ahead_worker(env, 4)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        await _until(lambda: worker.shards[0].reading_ahead)
        await anyio.sleep(0.2)  # well inside the read's 3 s
        stopped = time.monotonic()
        worker.stop()
    assert time.monotonic() - stopped < 1.5


def test_a_worker_short_of_slots_reads_the_backlog_into_the_queue_and_its_commits_take_it_up(
    workers, env, tmp_path
):
    """All slots busy and a backlog arriving: the reader still reads it (each message into its
    session, each session into its tenant's queue, no lock taken), so the scheduler sees every
    tenant's messages, not only the backlog ahead of them; each freed slot goes to the queue's
    next session in the commit that freed it: in stream order, one slot at a time, each step
    once. (Tenants in use: some tenant has settings; without, the backlog waits in the stream
    for a slot, test_a_worker_without_tenants_leaves_the_backlog_in_the_stream.)"""
    r = redis.Redis.from_url(env["REDIS_URL"])
    share(r, "default")  # tenants in use: the worker reads ahead
    steps = tmp_path / "steps.jsonl"
    workers.start(
        1,
        DIALOG_CONCURRENCY="1",
        DIALOG_ENGINE="timer_engines:Timers",
        DIALOG_LOCK_TTL_MS="1000",
        TIMER_ENGINE_LOG=str(steps),
    )
    r.xadd("dialog", {"session_id": "first", "text": "sleep 1", "msg_id": "first"})
    wait_until(lambda: r.exists("dialog:{dialog}:s:{first}:lock"), 20, what="the first step")
    for i in range(30):
        r.xadd("dialog", {"session_id": f"s{i}", "text": "sleep 0.1", "msg_id": f"m{i}"})
    # Read while the one slot is busy: queued, not locked.
    wait_until(lambda: r.zcard("dialog:{dialog}:ready:runq:default") == 30, 5, what="queued")
    assert r.xlen("dialog") == 0 and r.exists("dialog:{dialog}:s:{first}:lock")
    locks = [f"dialog:{{dialog}}:s:{{s{i}}}:lock" for i in range(30)]
    assert r.exists(*locks) == 0
    assert r.zrange("dialog:{dialog}:ready:active", 0, -1) == [b"default"]
    wait_until(lambda: all(int(r.hget(f"dialog:{{dialog}}:s:{{s{i}}}:state", "a") or 0) == 1
                           for i in range(30)), 20, what="every session applied")  # fmt: skip
    applied = [e for _, e in r.xrange("dialog-replies") if e[b"session_id"] != b"first"]
    assert [e[b"session_id"].decode() for e in applied] == [f"s{i}" for i in range(30)]
    log = workers.procs[0].log_text()
    assert "lease_lost" not in log and "commit_fenced" not in log
    ran = [json.loads(line)["msg_id"] for line in steps.read_text().splitlines()]
    assert sorted(ran) == sorted(["first", *(f"m{i}" for i in range(30))])
    # Nothing left queued or counted in flight once every session is done.
    assert r.exists("dialog:{dialog}:ready:active", "dialog:{dialog}:ready:runq:default") == 0
    assert r.zcard("dialog:{dialog}:ready:busy:default") == 0


def test_a_worker_without_tenants_leaves_the_backlog_in_the_stream(workers, env, tmp_path):
    """No tenants configured: a worker whose slots are all busy reads nothing more, so the
    unread backlog stays in the stream, where an autoscaler sees it (XLEN); the next slot that
    frees reads it."""
    r = redis.Redis.from_url(env["REDIS_URL"])
    workers.start(1, DIALOG_CONCURRENCY="1", DIALOG_ENGINE="timer_engines:Timers")
    r.xadd("dialog", {"session_id": "first", "text": "sleep 1", "msg_id": "first"})
    wait_until(lambda: r.exists("dialog:{dialog}:s:{first}:lock"), 20, what="the first step")
    for i in range(10):
        r.xadd("dialog", {"session_id": f"s{i}", "text": "hi", "msg_id": f"m{i}"})
    time.sleep(0.3)  # several of the reader's 20 ms turns, had it been reading ahead
    assert r.xlen("dialog") == 10 and r.exists("dialog:{dialog}:s:{first}:lock")
    wait_until(lambda: r.xlen("dialog-replies") == 11, 20, what="all answered")


async def test_a_queued_session_whose_message_is_cancelled_ends_without_a_step(
    client: DialogClient, workers, env, tmp_path
):
    """A session read while every slot is busy waits in its tenant's queue: a queued message
    to its user. Cancelled meanwhile, it ends cancelled in its turn and its step never runs."""
    r = redis.Redis.from_url(env["REDIS_URL"])
    share(r, "default")  # tenants in use: the worker reads ahead
    steps = tmp_path / "steps.jsonl"
    workers.start(
        1, DIALOG_CONCURRENCY="1", DIALOG_ENGINE="timer_engines:Timers", TIMER_ENGINE_LOG=str(steps)
    )
    r.xadd("dialog", {"session_id": "first", "text": "sleep 1", "msg_id": "first"})
    wait_until(lambda: r.exists("dialog:{dialog}:s:{first}:lock"), 20, what="the first step")
    for i in range(5):
        r.xadd("dialog", {"session_id": f"s{i}", "text": "sleep 0.3", "msg_id": f"m{i}"})
    wait_until(
        lambda: r.zcard("dialog:{dialog}:ready:runq:default") == 5, 10, what="the five queued"
    )
    assert (await client.cancel("s4", "m4")).status == "cancelled"

    def ended() -> list[bytes]:
        return [e[b"outcome"] for _, e in r.xrange("dialog-replies") if e[b"msg_id"] == b"m4"]

    assert wait_until(ended, 20, what="m4's reply event") == [b"cancelled"]
    ran = [json.loads(line)["msg_id"] for line in steps.read_text().splitlines()]
    assert "m4" not in ran


async def test_an_idle_reader_makes_the_group_check_another_loop_asked_for(env):
    """A side loop that meets a Redis failure marks the worker not ready and every shard for a
    fresh group check, which only the reader makes. An idle reader waiting on the stream must
    come back out of its wait to make it at its next blocking read's end, not at the end of its
    idle period (IDLE_RECHECK_S): until then the worker answers 503 on /readyz and the resumer
    and the timers wait. (With redis-py 8.2 a connection Redis closed while it sat idle in the
    pool is replaced when next taken, so cutting every connection no longer makes such a
    failure come late: here a loop fails by itself, just after the reader's wait began.)"""
    from dialog_worker.config import load_settings
    from dialog_worker.daemon.reader import IDLE_RECHECK_S
    from dialog_worker.daemon.worker import Worker
    from dialog_worker.engine.loading import load_engine

    settings = load_settings(
        environ={**env, "DIALOG_METRICS_PORT": "0", "DIALOG_READ_BLOCK_MS": "200"}
    )
    worker = Worker(settings, load_engine(None))
    fail_next = anyio.Event()
    failed_at: list[float] = []
    sample_once, idle_wait = worker.sampler.sample_once, worker.reader.idle_wait

    async def sampler() -> float:
        if fail_next.is_set() and not failed_at:
            failed_at.append(time.monotonic())
            raise redis.exceptions.ConnectionError("cut (injected)")
        await sample_once()
        return 0.05

    async def waiting(*args: Any, **kwargs: Any) -> None:
        if worker.ready and not fail_next.is_set():
            fail_next.set()  # this wait has just begun: the failure comes 0.05 s into it
        await idle_wait(*args, **kwargs)

    worker.sampler.sample_once = sampler  # type: ignore[method-assign]
    worker.reader.idle_wait = waiting  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)

        async def has_failed() -> bool:
            return bool(failed_at)

        async def ready() -> bool:
            return bool(worker.ready)

        await wait_until_async(has_failed, 10, what="the injected failure", interval_s=0.01)
        await wait_until_async(ready, 10, what="ready again", interval_s=0.01)
        again = time.monotonic() - failed_at[0]
        worker.stop()
    assert again < IDLE_RECHECK_S / 2, f"ready again {again:.2f} s after the failure"
