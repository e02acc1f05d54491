"""Merged bursts (multitask=merge, lua/_common.lua merge_parts): a session's fragments within
the window reach one step; every part gets its own reply event. The scripts on a real
redis-server, then real worker processes (a kill -9 inside the window loses and doubles
nothing)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import pytest_asyncio
import redis as sync_redis
from redis.asyncio import Redis
from redis_server import wait_until

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, Scripts

pytestmark = pytest.mark.integration

TTL_MS = 5000
WINDOW_MS, LONGEST_MS = 1000, 3000
MERGE = f"enqueue,{WINDOW_MS},{LONGEST_MS}"


class Harness:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.r, self.k, self.s = redis, keys, Scripts.register(redis)
        self.calls = 0

    async def intake(self, free: int = 8, merge: str = MERGE) -> list[Any]:
        self.calls += 1
        k = self.k
        return await self.s.intake(
            keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
            args=[
                k.group, "c1", 1000, f"t{self.calls}", TTL_MS, 3600, 65536, 32, 0, "test", 0,
                "maaf", 0, 1, "enqueue", "", free, "", 600, merge,
            ],
        )  # fmt: skip

    async def resume(self, count: int = 8, merge: str = MERGE) -> list[Any]:
        self.calls += 1
        k = self.k
        rows, _ = await self.s.resume(
            keys=[k.stream, k.ready, k.session_prefix],
            args=[count, f"r{self.calls}", TTL_MS, 60_000, "", merge],
        )
        return list(rows)

    async def commit(
        self, row: list[Any], first: int, last: int, msg_id: bytes, outcome: str = "applied"
    ) -> list[Any]:
        """Commit a resumed job (its row without the kind) as a merged step of seqs
        first..last."""
        self.calls += 1
        k = self.k
        sid, token, version = row[0], row[1], int(row[6])
        entry = row[11][-1][1] if row[11] else row[3]
        args: list[Any] = [TTL_MS, 3600, 0, 1, token, sid, last, version, json.dumps({})]
        args += [msg_id, b"the answer", outcome, entry, "", "", "", "", "", str(first)]
        args += ["continue", "1", f"c{self.calls}", "", "0", MERGE]
        (result,) = await self.s.commit(
            keys=[k.stream, k.ready, k.session_prefix, k.replies, k.dlq], args=args
        )
        return list(result)

    async def events(self) -> list[dict[bytes, bytes]]:
        return [f for _, f in await self.r.xrange(self.k.replies)]


@pytest_asyncio.fixture
async def h(redis_server) -> AsyncIterator[Harness]:
    r = Redis.from_url(redis_server.url)
    await r.flushall()
    harness = Harness(r, Keys.from_settings(Settings()))
    await r.xgroup_create(harness.k.stream, harness.k.group, id="0", mkstream=True)
    yield harness
    await r.aclose()


async def now_ms(h: Harness) -> int:
    sec, usec = await h.r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def send_at(h: Harness, ms: int, mid: str, sid: str = "s", **extra: Any) -> bytes:
    """A merge message appended with its entry id's time `ms` (its arrival)."""
    fields = {"session_id": sid, "text": f"text {mid}", "msg_id": mid, "multitask": "merge"}
    return await h.r.xadd(h.k.stream, {**fields, **extra}, id=f"{ms}-0")


async def test_a_burst_waits_in_the_ready_set_until_its_window_closes(h):
    t = await now_ms(h)
    await send_at(h, t, "m1")
    _, _, jobs, _, _ = await h.intake()
    assert jobs == []  # not handed out: its window is open
    score = await h.r.zscore(h.k.ready, "s")
    assert score == t + WINDOW_MS
    await send_at(h, t + 200, "m2")
    await h.intake()
    assert await h.r.zscore(h.k.ready, "s") == t + 200 + WINDOW_MS  # a later part moves it on
    assert await h.resume() == []  # not due yet


async def test_a_burst_due_before_its_window_closes_still_waits_for_it(h):
    """A session can come due while its burst is still arriving (the lease of a killed
    worker that held it ran out): resume hands nothing out and puts it back at the close."""
    t = await now_ms(h)
    await send_at(h, t, "m1")
    await h.intake()
    await h.r.zadd(h.k.ready, {"s": 0})  # due now, as a crashed holder's lease leaves it
    assert await h.resume() == []
    assert await h.r.zscore(h.k.ready, "s") == t + WINDOW_MS
    assert not await h.r.exists(h.k.session("s").lock)


async def test_a_closed_window_gives_one_job_with_every_part_and_one_commit_answers_all(h):
    t = await now_ms(h) - 10_000  # a burst that arrived ten seconds ago: its window is over
    for i, mid in enumerate(("m1", "m2", "m3")):
        await send_at(h, t + 100 * i, mid)
    await h.intake()
    await h.r.zadd(h.k.ready, {"s": 0})  # due
    [row] = await h.resume()
    assert row[0] == b"m" and int(row[3]) == 1
    parts = row[12]
    assert [int(p[0]) for p in parts] == [2, 3]
    result = await h.commit(row[1:], first=1, last=3, msg_id=b"m3")
    assert int(result[0]) == Code.COMMITTED
    events = await h.events()
    got = [(e[b"msg_id"], e[b"seq"], e[b"outcome"], e.get(b"answered_by")) for e in events]
    assert got == [
        (b"m1", b"1", b"merged", b"m3"),
        (b"m2", b"2", b"merged", b"m3"),
        (b"m3", b"3", b"applied", None),
    ]
    assert all(e[b"reply"] == b"the answer" for e in events)
    state = await h.r.hgetall(h.k.session("s").state)
    assert state[b"a"] == b"3" and not [n for n in state if n[:1] in (b"q", b"u")]


async def test_parts_past_the_longest_wait_go_to_the_next_step(h):
    t = await now_ms(h) - 20_000
    await send_at(h, t, "m1")
    await send_at(h, t + 900, "m2")
    await send_at(h, t + 1800, "m3")
    await send_at(h, t + LONGEST_MS + 100, "m4")  # past the first's arrival + the longest wait
    await h.intake()
    await h.r.zadd(h.k.ready, {"s": 0})
    [row] = await h.resume()
    assert [int(p[0]) for p in row[12]] == [2, 3]


async def test_a_burst_whose_parts_keep_coming_is_handed_out_at_its_longest_wait(h):
    """Parts 1.4 s apart with a 2.5 s window: each keeps the window open, but the burst closes
    3 s (the longest wait) after its first part, not a window after the last part that came
    within it (5.3 s). Just past 3 s after the first, it is due and handed out with its
    parts."""
    window_ms, longest_ms = 2500, 3000
    merge = f"enqueue,{window_ms},{longest_ms}"
    t = await now_ms(h) - longest_ms - 1
    for i, mid in enumerate(("m1", "m2", "m3")):
        await send_at(h, t + 1400 * i, mid)
    await h.intake(merge=merge)
    assert await h.r.zscore(h.k.ready, "s") == t + longest_ms
    [row] = await h.resume(merge=merge)
    assert [int(p[0]) for p in row[12]] == [2, 3]


async def test_a_burst_holds_at_most_32_parts_and_the_rest_go_to_the_next_step(h):
    t = await now_ms(h) - 60_000
    for i in range(1, 41):
        await send_at(h, t + 10 * i, f"m{i}")
    await h.intake()
    await h.r.zadd(h.k.ready, {"s": 0})
    [row] = await h.resume()
    assert [int(p[0]) for p in row[12]] == list(range(2, 33))  # with the first: 32
    result = await h.commit(row[1:], first=1, last=32, msg_id=b"m32")
    assert int(result[0]) == Code.HANDOFF, result
    assert [int(p[0]) for p in result[6]] == list(range(34, 41))  # the next step: 33..40
    events = await h.events()
    assert [(e[b"seq"], e[b"outcome"]) for e in events] == [
        *((b"%d" % i, b"merged") for i in range(1, 32)),
        (b"32", b"applied"),
    ]


async def test_a_cancelled_part_ends_alone_and_the_burst_stops_before_it(h):
    t = await now_ms(h) - 10_000
    await send_at(h, t, "m1")
    await send_at(h, t + 100, "m2")
    await send_at(h, t + 200, "m3")
    await h.intake()
    await h.s.cancel(keys=[h.k.session_prefix], args=["s", "m2", 3600])
    await h.r.zadd(h.k.ready, {"s": 0})
    [row] = await h.resume()
    assert row[12] == []  # m1 alone: m2 ends cancelled in its own turn, m3 after it


async def test_a_merged_commit_is_fenced_by_its_first_part(h):
    t = await now_ms(h) - 10_000
    await send_at(h, t, "m1")
    await send_at(h, t + 100, "m2")
    await h.intake()
    await h.r.zadd(h.k.ready, {"s": 0})
    [row] = await h.resume()
    # Claiming seqs 2..2 (skipping the first part) is refused: the state is at 0, not 1.
    result = await h.commit(row[1:], first=1, last=2, msg_id=b"m2")
    assert int(result[0]) == Code.COMMITTED
    again = await h.commit(row[1:], first=1, last=2, msg_id=b"m2")
    assert int(again[0]) == Code.COMMITTED  # the same commit sent twice: answered as it was
    assert len(await h.events()) == 2


async def test_a_hand_off_to_a_burst_whose_window_is_open_waits_for_it(h):
    """The session's running message ends while the burst after it is still arriving: no
    hand-off; the session is taken up when the burst's window closes."""
    await h.r.xadd(h.k.stream, {"session_id": "s", "text": "first", "msg_id": "m0"})
    _, _, [job], _, _ = await h.intake()
    t = await now_ms(h) + 10  # after m0's entry id
    await send_at(h, t, "m1")
    await h.intake()
    k = h.k
    args: list[Any] = [TTL_MS, 3600, 0, 1, job[1], job[0], 1, int(job[6]), "{}", b"m0", b"r"]
    args += ["applied", job[3], "", "", "", "", "", ""]
    args += ["continue", "1", "cz", "", "0", MERGE]
    (result,) = await h.s.commit(
        keys=[k.stream, k.ready, k.session_prefix, k.replies, k.dlq], args=args
    )
    assert int(result[0]) == Code.COMMITTED  # not HANDOFF: m1's window is open
    assert not await h.r.exists(h.k.session("s").lock)
    assert await h.r.zscore(h.k.ready, "s") == t + WINDOW_MS


async def test_a_burst_waiting_in_a_queue_goes_with_its_parts_whoever_hands_it_out(h):
    """Sessions wait in the queue (x, read with no free slot); two bursts whose windows closed
    join it behind x; resume hands out two (x and s1's burst), the next intake call with a
    free slot hands out s2's burst: each burst with its parts."""
    t = await now_ms(h) - 20_000
    await h.r.xadd(h.k.stream, {"session_id": "x", "text": "t", "msg_id": "x1"}, id=f"{t}-0")
    t += 10_000
    for sid in ("s1", "s2"):
        await send_at(h, t, f"{sid}-a", sid=sid)
        await send_at(h, t + 50, f"{sid}-b", sid=sid)
        t += 100
    await h.intake(free=0)
    assert await h.r.zrange(h.k.tenant_queue("default"), 0, -1) == [b"x"]
    await h.r.zadd(h.k.ready, {"s1": 0, "s2": 0})
    rows = await h.resume(count=2)
    got = {bytes(r[1]).decode(): [int(p[0]) for p in r[12]] for r in rows}
    assert got == {"x": [], "s1": [2]}
    _, _, [row], _, _ = await h.intake(free=1)
    assert row[0] == b"s2" and [int(p[0]) for p in row[11]] == [2]


# --- real workers ---------------------------------------------------------------------------


def steps(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def test_a_burst_sent_apart_reaches_one_step_and_every_part_is_answered(
    workers, env, tmp_path, client: DialogClient
):
    log = tmp_path / "steps.jsonl"
    workers.start(
        1,
        DIALOG_ENGINE="merge_engines:Parts",
        MERGE_ENGINE_LOG=str(log),
        DIALOG_MULTITASK="merge",
        DIALOG_MERGE_WINDOW_MS="700",
    )
    replies: dict[int, Any] = {}

    async def ask(i: int) -> None:
        replies[i] = await client.ask("burst", f"part {i}", msg_id=f"p{i}", timeout=15)

    async with anyio.create_task_group() as tg:  # a user typing three fragments
        for i in range(3):
            tg.start_soon(ask, i)
            await anyio.sleep(0.2)
    # ask returns for every part: the earlier ones merged into the last one's step.
    assert [(replies[i].outcome, replies[i].answered_by) for i in range(3)] == [
        ("merged", "p2"),
        ("merged", "p2"),
        ("applied", ""),
    ]
    r = sync_redis.Redis.from_url(env["REDIS_URL"])
    events = [f for _, f in r.xrange("dialog-replies")]
    got = [(e[b"msg_id"], e[b"outcome"], e.get(b"answered_by")) for e in events]
    assert got == [(b"p0", b"merged", b"p2"), (b"p1", b"merged", b"p2"), (b"p2", b"applied", None)]
    assert {e[b"reply"] for e in events} == {b"got: part 0 | part 1 | part 2"}
    assert [(s["msg_id"], s["parts"]) for s in steps(log)] == [("p2", ["p0", "p1", "p2"])]


async def test_a_worker_killed_inside_the_window_loses_and_doubles_nothing(
    workers, env, tmp_path, client: DialogClient
):
    log = tmp_path / "steps.jsonl"
    common = {
        "DIALOG_ENGINE": "merge_engines:Parts",
        "MERGE_ENGINE_LOG": str(log),
        "DIALOG_MULTITASK": "merge",
        "DIALOG_MERGE_WINDOW_MS": "1500",
        "DIALOG_LOCK_TTL_MS": "1000",
    }
    [first] = workers.start(1, **common)
    r = sync_redis.Redis.from_url(env["REDIS_URL"])
    await client.send("k", "one", msg_id="k1")
    await client.send("k", "two", msg_id="k2")
    wait_until(lambda: r.xlen("dialog") == 0, 10, what="both read into the session")
    first.kill()
    workers.start(1, **common)
    await client.send("k", "three", msg_id="k3")
    wait_until(lambda: r.xlen("dialog-replies") >= 3, 20, what="the burst answered")
    events = [f for _, f in r.xrange("dialog-replies")]
    assert [(e[b"msg_id"], e[b"outcome"]) for e in events] == [
        (b"k1", b"merged"),
        (b"k2", b"merged"),
        (b"k3", b"applied"),
    ]
    assert [s["parts"] for s in steps(log)] == [["k1", "k2", "k3"]]


async def test_a_cancel_of_any_part_stops_the_merged_step_and_every_part_ends_cancelled(
    workers, env, tmp_path, client: DialogClient
):
    log = tmp_path / "steps.jsonl"
    workers.start(
        1,
        DIALOG_ENGINE="merge_engines:Parts",
        MERGE_ENGINE_LOG=str(log),
        DIALOG_MULTITASK="merge",
        DIALOG_MERGE_WINDOW_MS="300",
        DIALOG_SHUTDOWN_GRACE_S="1",  # a step that is not stopped does not hold the teardown
    )
    await client.send("c", "first part", msg_id="c1")
    await client.send("c", "then sleep", msg_id="c2")
    wait_until(lambda: any(s.get("started") for s in steps(log)), 20, what="the merged step")
    assert (await client.cancel("c", "c1")).status == "cancelled"  # the first part, not the last
    r = sync_redis.Redis.from_url(env["REDIS_URL"])
    wait_until(lambda: r.xlen("dialog-replies") >= 2, 5, what="stopped well before its 10 s")
    events = [f for _, f in r.xrange("dialog-replies")]
    assert [(e[b"msg_id"], e[b"outcome"]) for e in events] == [
        (b"c1", b"cancelled"),
        (b"c2", b"cancelled"),
    ]
