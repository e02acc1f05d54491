"""One waiter per shard: an append to an idle pool wakes one worker, not every replica, and a
waiter that dies is replaced within its lease. Real worker processes, real Redis."""

from __future__ import annotations

import time

import anyio
import pytest
import redis
from redis_server import wait_until

from dialog_worker.client import DialogClient

pytestmark = pytest.mark.integration

WAITER = "dialog:{dialog}:ready:waiter"
WAKE = "dialog:{dialog}:ready:wake"


def _calls(r: redis.Redis, command: str) -> int:
    stats = r.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def _idle(r: redis.Redis, others: int) -> str:
    """One worker holds the waiter role (its name is returned) and `others` are blocked on
    the wake stream (Redis 7.0 lists no consumer for a read that is still blocked)."""
    name = str(wait_until(lambda: r.get(WAITER), 30, what="a waiter").decode())

    def readers() -> bool:
        blocked = [c for c in r.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"]]
        return len(blocked) >= others

    wait_until(readers, 30, what=f"{others} readers on the wake stream")
    return name


async def test_an_append_to_an_idle_pool_wakes_one_worker(client: DialogClient, workers, env):
    r = redis.Redis.from_url(env["REDIS_URL"])
    workers.start(4)
    wait_until(lambda: all(w.alive() for w in workers.procs), 10)
    await client.ask("warm", "halo", timeout=20)  # every worker up, scripts loaded
    _idle(r, others=3)
    scripts_before = _calls(r, "evalsha")
    n = 10
    for i in range(n):
        reply = await client.ask(f"lone{i}", "nama saya Budi", timeout=20)
        assert reply.outcome == "applied"
    per_message = (_calls(r, "evalsha") - scripts_before) / n
    # One intake call and one commit per message (plus a rare idle re-check or renewal); with
    # every blocked replica woken it was 4 intake calls + 1 commit.
    assert per_message < 3, per_message


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
    reply = await client.ask("after-kill", "nama saya Budi", timeout=20)
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
    from dialog_worker.daemon import Worker
    from dialog_worker.engine import load_engine

    r = redis.Redis.from_url(env["REDIS_URL"])
    seen = r.xadd("dialog", {"session_id": "w0", "text": "read by the last intake"})
    r.xadd("dialog", {"session_id": "w1", "text": "appended in between"})
    worker = Worker(
        load_settings(environ={**env, "DIALOG_READ_BLOCK_MS": "3000"}), load_engine(None)
    )
    try:
        started = time.monotonic()
        with anyio.fail_after(2):
            await worker._idle_wait(worker.shards[0], seen)
        assert time.monotonic() - started < 1
    finally:
        await worker.raw.aclose()
        await worker.redis.aclose()


async def test_a_lone_messages_commit_is_sent_before_the_readers_next_blocking_read(env):
    """A lone message on an idle worker: intake, then the commit. The reader's next blocking
    read waits until the session it started has sent its commit (two turns of the event
    loop), so the commit is not queued behind that read on the way to Redis."""
    from dialog_worker.config import load_settings
    from dialog_worker.daemon import Worker
    from dialog_worker.engine import load_engine

    r = redis.Redis.from_url(env["REDIS_URL"])
    worker = Worker(load_settings(environ=env), load_engine(None))
    calls: list[str] = []
    names = {worker.scripts.intake.sha: "intake", worker.scripts.commit.sha: "commit"}
    evalsha, xread = worker.raw.evalsha, worker.raw.xread

    async def recorded_evalsha(sha: str, *args: object) -> object:
        calls.append(names.get(sha, "script"))
        return await evalsha(sha, *args)

    async def recorded_xread(*args: object, **kwargs: object) -> object:
        calls.append("xread")
        return await xread(*args, **kwargs)

    worker.raw.evalsha = recorded_evalsha  # type: ignore[method-assign]
    worker.raw.xread = recorded_xread  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        await anyio.to_thread.run_sync(lambda: wait_until(lambda: "xread" in calls, 20))
        del calls[:]
        r.xadd("dialog", {"session_id": "lone", "text": "halo"})
        await anyio.to_thread.run_sync(lambda: wait_until(lambda: r.xlen("dialog-replies"), 20))
        worker.stop()
    assert calls[:3] == ["intake", "commit", "xread"], calls
