"""Worker leases on a real redis-server, scripts called directly (lua/lease-2.lua and the worker
leases in lua/_common.lua): one lease per worker and shard covers every session the worker
holds; while it lives nobody looks at those sessions, and once it lapses they come back
through the ready set and the holder's late writes are fenced."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import pytest_asyncio
import redis.exceptions
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from test_scripts import Harness, commit_args, server_ms, xadd
from trace_engines import TraceEngine
from worker_procs import run_cli

from dialog_worker.config import Settings, load_settings
from dialog_worker.daemon.pipeline import HELD_LOCK_TTL_FACTOR, Pipeline
from dialog_worker.daemon.sessions import holder_of
from dialog_worker.daemon.worker import Worker as Daemon
from dialog_worker.engine.loading import load_engine
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, Script, source

pytestmark = pytest.mark.integration

HELD_BASE_MS = 10**13  # lua/_common.lua


class Worker:
    """One worker's side of the scripts: its lease number and the tokens it hands out."""

    def __init__(self, h: Harness, name: str, lease_ms: int) -> None:
        self.h, self.name, self.lease_ms = h, name, lease_ms
        self.number = 0
        self.calls = 0

    async def lease(self) -> tuple[int, int, int]:
        k = self.h.k
        reply = await self.h.s.lease(
            keys=[k.ready, k.session_prefix], args=[self.number, self.lease_ms, 1000]
        )
        number, lapsed, swept = (int(x) for x in reply)
        self.number = number
        return number, lapsed, swept

    def base(self) -> str:
        self.calls += 1
        return f"{self.name}:L{self.number}.ab12:{self.calls}"

    async def intake(self) -> list[Any]:
        k = self.h.k
        return await self.h.s.intake(
            keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
            args=[
                k.group, self.name, 100, self.base(), self.lease_ms * HELD_LOCK_TTL_FACTOR,
                3600, 65536, 32, 0, "test", 0, "maaf",
            ],
        )  # fmt: skip

    async def resume(self) -> list[Any]:
        k = self.h.k
        rows, _ = await self.h.s.resume(
            keys=[k.stream, k.ready, k.session_prefix],
            args=[100, self.base(), self.lease_ms * HELD_LOCK_TTL_FACTOR, 60_000],
        )
        return rows


@pytest_asyncio.fixture
async def h(redis_server) -> AsyncIterator[Harness]:
    r = Redis.from_url(redis_server.url)
    await r.flushall()
    harness = Harness(r, Keys.from_settings(Settings()))
    await harness.group()
    yield harness
    await r.aclose()


async def lapse(h: Harness, w: Worker) -> None:
    """Until the server's clock is past w's lease (no renewal meanwhile)."""
    until = await h.r.zscore(h.k.workers, w.number)
    assert until is not None
    left_ms = until - await server_ms(h)
    await anyio.sleep(max(left_ms, 0) / 1000 + 0.02)  # a deadline: the lease's end
    assert await server_ms(h) > until


async def test_sessions_under_a_live_worker_lease_are_out_of_the_resumers_sight(h):
    w = Worker(h, "w1", 5000)
    number, lapsed, swept = await w.lease()
    assert (number, lapsed, swept) == (1, 0, 0)
    for sid in ["a", "b"]:
        await xadd(h, sid)
    _, _, jobs, _, _ = await w.intake()
    assert [holder_of(j[1].decode()) for j in jobs] == [number, number]
    # Each held session's place is its holder's, far past any clock; its lock lives long.
    assert await h.r.zscore(h.k.ready, "a") == HELD_BASE_MS + number
    assert await h.r.pttl(h.k.session("a").lock) > 5000 * HELD_LOCK_TTL_FACTOR - 2000
    assert await Worker(h, "w2", 5000).resume() == []
    # Renewing the lease renews them all: one call, whatever the number of sessions.
    assert await w.lease() == (number, 0, 0)
    # A session a resume meets due while its holder's lease lives goes back to its place.
    await h.r.zadd(h.k.ready, {"a": 0})
    assert await Worker(h, "w2", 5000).resume() == []
    assert await h.r.zscore(h.k.ready, "a") == HELD_BASE_MS + number
    # A commit that hands the session on keeps it at its holder's place.
    await xadd(h, "a", "second")
    await w.intake()
    [result] = await h.commit(commit_args(jobs[0]))
    assert int(result[0]) == Code.HANDOFF
    assert await h.r.zscore(h.k.ready, "a") == HELD_BASE_MS + number


async def test_a_lapsed_worker_lease_brings_its_sessions_back_and_fences_its_late_commit(h):
    paused = Worker(h, "w1", 300)
    other = Worker(h, "w2", 5000)
    await paused.lease()
    await xadd(h, "p")
    _, _, [job], _, _ = await paused.intake()
    busy = h.k.tenant_busy("default")
    assert await h.r.zscore(busy, "p") is not None  # in flight for its tenant
    await other.lease()
    await lapse(h, paused)
    # The next lease call of any worker brings the lapsed lease's sessions back.
    _, lapsed, swept = await other.lease()
    assert (lapsed, swept) == (0, 1)
    assert await h.r.exists(h.k.session("p").lock) == 0
    assert await h.r.zscore(busy, "p") is None  # no longer counted in flight
    assert await h.r.zscore(h.k.ready, "p") <= await server_ms(h)
    [row] = await other.resume()
    assert (row[1], int(row[3]), int(row[8])) == (b"p", 1, 2)  # the attempt is counted
    assert holder_of(row[2].decode()) == other.number
    # The paused worker wakes: its commit is refused, and its lease call tells it its
    # number lapsed (it gives up what it held) and gives it a new one.
    [result] = await h.commit(commit_args(job))
    assert int(result[0]) == Code.FENCED_TOKEN
    old = paused.number
    number, lapsed, _ = await paused.lease()
    assert lapsed == 1 and number not in (old, other.number)


async def test_resume_breaks_a_lock_whose_worker_lease_lapsed(h):
    w = Worker(h, "w1", 300)
    await w.lease()
    await xadd(h, "x")
    _, _, [job], _, _ = await w.intake()
    await lapse(h, w)
    await h.r.zadd(h.k.ready, {"x": 0})  # due (an operator's touch, a stale place)
    [row] = await Worker(h, "w2", 5000).resume()
    assert row[1] == b"x" and await h.r.get(h.k.session("x").lock) == row[2] != job[1]


async def test_a_lapsed_lease_renewed_late_is_a_new_number_and_its_own_sessions_come_back(h):
    w = Worker(h, "w1", 300)
    await w.lease()
    await xadd(h, "s")
    await w.intake()
    await lapse(h, w)
    old = w.number
    number, lapsed, swept = await w.lease()
    assert (lapsed, swept) == (1, 1) and number != old
    assert await h.r.exists(h.k.session("s").lock) == 0
    # The lapsed number stays listed (lapsed) so a lock taken under it later is found too.
    assert await h.r.zscore(h.k.workers, old) < await server_ms(h)


async def test_a_lease_call_refuses_bad_arguments_and_writes_nothing(h):
    k = h.k
    for args in ([-1, 1000, 10], [0, 0, 10], [0, 1000, 0], [0, 1000, 10001], ["x", 1, 1], [0]):
        with pytest.raises(ResponseError, match="lease: bad arguments"):
            await h.s.lease(keys=[k.ready, k.session_prefix], args=args)
    assert await h.r.exists(k.workers) == 0
    await h.r.set(k.workers, "by hand")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await h.s.lease(keys=[k.ready, k.session_prefix], args=[0, 1000, 10])


async def test_a_token_without_a_worker_lease_keeps_the_per_session_lease(h):
    await xadd(h, "old")
    await h.intake()  # token base "t1": no worker number
    place = await h.r.zscore(h.k.ready, "old")
    assert place < HELD_BASE_MS and place <= await server_ms(h) + 5000


async def test_a_lock_released_by_hand_makes_its_session_due_at_once(h, redis_server):
    """`dialog-worker session S --release-lock --yes` on a session held under a live worker
    lease: it is due now (a resume takes it up), not when that lease lapses."""
    w = Worker(h, "w1", 5000)
    await w.lease()
    await xadd(h, "hand")
    _, _, [job], _, _ = await w.intake()
    env = {**os.environ, "REDIS_URL": redis_server.url}
    done = run_cli(env, "session", "hand", "--release-lock", "--yes")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lock_released"] is True
    assert await h.r.zscore(h.k.ready, "hand") <= await server_ms(h)
    [row] = await Worker(h, "w2", 5000).resume()
    assert row[1] == b"hand" and row[2] != job[1]


async def test_a_lease_left_by_a_stopped_worker_is_forgotten_at_the_next_call(h):
    """A worker that stops marks its lease lapsed long ago (Sessions.leave): with nothing left
    under it, the next lease call of another worker forgets it rather than keep it a minute."""
    gone, other = Worker(h, "w1", 5000), Worker(h, "w2", 5000)
    await gone.lease()
    await other.lease()
    await h.r.zadd(h.k.workers, {str(gone.number): 0}, xx=True)
    assert await other.lease() == (other.number, 0, 0)
    assert await h.r.zscore(h.k.workers, gone.number) is None
    assert await h.r.zscore(h.k.workers, other.number) is not None


async def ask_while_running(daemon: Daemon, client: Any, session_id: str, text: str) -> Any:
    """Ask one message (10 s at most) of a worker run in this process, then stop it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon.run)
        try:
            return await client.ask(session_id, text, timeout=10)
        finally:
            daemon.stop()


async def test_a_step_that_redis_failed_under_a_live_lease_comes_back_at_once(
    client, env, monkeypatch
):
    """A Redis error ends a session's work mid-way (here its commit's connection drops) while
    its worker lives on: the session is given back as a lapse of the lease would give it
    (due now, the attempt counted), not left at the worker's place for as long as it lives.
    The Sentinel failover chaos run found 63 sessions held that way by live workers."""
    commit, failed = Pipeline._commit, []

    async def commit_fails_once(self, job, *args):
        if not failed:
            failed.append(job.session_id)
            raise redis.exceptions.ConnectionError("test: the connection dropped mid-commit")
        return await commit(self, job, *args)

    monkeypatch.setattr(Pipeline, "_commit", commit_fails_once)
    # A lease long enough that its lapse cannot be what brings the session back in time.
    settings = load_settings(environ={**env, "DIALOG_LOCK_TTL_MS": "30000"})
    daemon = Daemon(settings, load_engine(None))
    reply = await ask_while_running(daemon, client, "failed-commit", "nama saya Budi")
    assert failed == ["failed-commit"]
    assert reply.outcome == "applied"
    state = await client.state("failed-commit")
    assert state is not None and "Budi" in json.dumps(state["memory"]), state


@pytest.mark.parametrize("script", ["intake", "resume"])
async def test_a_lock_handing_call_whose_reply_was_lost_is_sent_again(
    client, env, monkeypatch, script
):
    """An intake or resume call runs (it locks a session under the worker's lease) and its
    reply is lost on the way back: the worker sends the same call again and its receipt
    gives the job back, instead of the session waiting at the worker's place for as long as
    the worker lives."""
    sha = hashlib.sha1(source(script).encode("utf-8")).hexdigest()
    call, lost = Script.__call__, []

    async def reply_lost_once(self, keys, args):
        reply = await call(self, keys, args)
        if self.sha != sha or lost:
            return reply
        if reply[0] if script == "resume" else reply[2:]:  # it handed out a job
            lost.append(args[1] if script == "resume" else args[3])  # the token base
            raise redis.exceptions.ConnectionError("test: the reply was lost")
        return reply

    monkeypatch.setattr(Script, "__call__", reply_lost_once)
    # The first attempt fails: the session goes back to the ready set, where a resume takes
    # it up for the second.
    settings = load_settings(
        environ={**env, "DIALOG_LOCK_TTL_MS": "30000", "DIALOG_BACKOFF_BASE_MS": "10",
                 "DIALOG_BACKOFF_MAX_MS": "20"}
    )  # fmt: skip
    daemon = Daemon(settings, TraceEngine())
    reply = await ask_while_running(daemon, client, "lost-reply", "fail-once, then answer")
    assert len(lost) == 1, lost
    assert reply.outcome == "applied"
