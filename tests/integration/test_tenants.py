"""Tenants share a shard's slots fairly (lua/_common.lua, "Tenants"): the scripts on a real
redis-server, called directly. Who gets a slot when several tenants wait, weights, the
guaranteed minimum and the maximum in flight, priorities inside a tenant, the tenant a
message belongs to (the same in the scripts as in Python), and the keys it all leaves
behind."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from dialog_worker.config import Settings, tenant_pattern_forms
from dialog_worker.store.codec import DEFAULT_TENANT, tenant_of
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, Release, Scripts, source

pytestmark = pytest.mark.integration

TTL_MS = 5000


class Harness:
    """The scripts with the worker's arguments and the scheduling values."""

    def __init__(self, redis: Redis, keys: Keys, pattern: str = "") -> None:
        self.r, self.k, self.s = redis, keys, Scripts.register(redis)
        self.calls = 0
        self.pattern = tenant_pattern_forms(pattern)[0] if pattern else ""

    async def intake(self, free: int, count: int = 1000) -> list[Any]:
        self.calls += 1
        k = self.k
        return await self.s.intake(
            keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
            args=[
                k.group, "c1", count, f"t{self.calls}", TTL_MS, 3600, 65536, 32, 0, "test", 0,
                "maaf", 0, 1, "enqueue", "", free, self.pattern,
            ],
        )  # fmt: skip

    async def resume(self, count: int) -> list[Any]:
        self.calls += 1
        k = self.k
        return await self.s.resume(
            keys=[k.stream, k.ready, k.session_prefix],
            args=[count, f"r{self.calls}", TTL_MS, 60_000, self.pattern],
        )

    async def finish(self, job: list[Any], dispatch: bool = True, slow: bool = False) -> list[Any]:
        """Commit a job as applied; the answer (a hand-off, or the freed slot's new job)."""
        self.calls += 1
        k = self.k
        sid, token, seq, entry_id, version = job[0], job[1], int(job[2]), job[3], int(job[6])
        args: list[Any] = [TTL_MS, 3600, 0, 1]
        args += [token, sid, seq, version, json.dumps({"seq": seq}), b"m", b"r", "applied"]
        args += [entry_id, "", "", "", "", "", ""]
        args += ["continue", "1" if dispatch else "0", f"c{self.calls}", self.pattern]
        args += ["1" if slow else "0"]
        (result,) = await self.s.commit(
            keys=[k.stream, k.ready, k.session_prefix, k.replies, k.dlq], args=args
        )
        return list(result)

    async def share(self, tenant: str, weight: float = 1, least: int = 0, most: int = 0) -> None:
        await self.r.hset(self.k.tenant_settings, tenant, f"{weight} {least} {most}")
        if least:
            await self.r.zadd(self.k.tenants_guaranteed, {tenant: least})
        else:
            await self.r.zrem(self.k.tenants_guaranteed, tenant)

    async def in_flight(self, tenant: str) -> int:
        return int(await self.r.zcard(self.k.tenant_busy(tenant)))

    async def queued(self, tenant: str) -> list[str]:
        return [m.decode() for m in await self.r.zrange(self.k.tenant_queue(tenant), 0, -1)]


@pytest_asyncio.fixture
async def h(redis_server) -> AsyncIterator[Harness]:
    r = Redis.from_url(redis_server.url)
    await r.flushall()
    harness = Harness(r, Keys.from_settings(Settings()))
    await r.xgroup_create(harness.k.stream, harness.k.group, id="0", mkstream=True)
    yield harness
    await r.aclose()


async def send(h: Harness, sid: str, tenant: str | None = None, **extra: Any) -> bytes:
    fields: dict[str, Any] = {"session_id": sid, "text": "hi", **extra}
    if tenant is not None:
        fields["tenant"] = tenant
    return await h.r.xadd(h.k.stream, fields)


def sid_of(job: list[Any]) -> str:
    return bytes(job[0]).decode()


def tenant_of_sid(sid: str) -> str:
    return sid.split("-")[0]


async def run_slots(h: Harness, first: list[list[Any]], grants: int) -> list[str]:
    """Work the jobs one commit at a time, each commit's freed slot going to its dispatched
    job, until `grants` jobs ran: the sessions in the order they got a slot."""
    order = [sid_of(j) for j in first]
    running = list(first)
    while running and len(order) < grants:
        job = running.pop(0)
        result = await h.finish(job)
        assert int(result[0]) == Code.COMMITTED, result
        if len(result) > 2:
            order.append(sid_of(result[2]))
            running.append(result[2])
    return order


async def test_a_busy_shard_queues_what_it_reads_and_each_freed_slot_goes_in_fair_order(h):
    """Tenant a's backlog came first, then b's and c's: with one slot, each commit hands its
    freed slot on in turn a, b, c, a, b, c (equal weights), not a's whole backlog first."""
    for i in range(6):
        await send(h, f"a-{i}", "a")
    for i in range(3):
        await send(h, f"b-{i}", "b")
        await send(h, f"c-{i}", "c")
    _, read, jobs, _, counts = await h.intake(free=1)
    assert int(read) == 12 and [sid_of(j) for j in jobs] == ["a-0"]
    assert int(counts[6]) == 1  # sessions still wait for a slot
    assert await h.queued("a") == [f"a-{i}" for i in range(1, 6)]  # stream order
    order = await run_slots(h, jobs, 10)
    assert [tenant_of_sid(s) for s in order] == list("abcabcabca")
    assert order[:4] == ["a-0", "b-0", "c-0", "a-1"]


async def test_weights_share_the_slots_in_proportion(h):
    await h.share("a", weight=3)
    for i in range(40):
        await send(h, f"a-{i}", "a")
        await send(h, f"b-{i}", "b")
    _, _, jobs, _, _ = await h.intake(free=4)
    order = await run_slots(h, jobs, 40)
    shares = Counter(tenant_of_sid(s) for s in order)
    assert shares["a"] == 3 * shares["b"] or abs(shares["a"] - 3 * shares["b"]) <= 3, shares


async def test_weights_hold_when_slow_steps_take_turns(h):
    """Sessions with several messages and slow steps give their slot up after each step; the
    slot is charged to the tenant it goes to, once, so 3:1 weights still give 3:1 (charging the
    tenant that gave it up as well took the lead of the tenant owed it: 2.3:1)."""
    await h.share("a", weight=3)
    for i in range(400):
        await send(h, f"a-{i % 40}", "a")
    for i in range(400):
        await send(h, f"b-{i % 40}", "b")
    _, _, jobs, _, _ = await h.intake(free=8)
    for _ in range(3):
        await h.intake(free=0)  # the rest of the backlog into the queues
    order = [sid_of(j) for j in jobs]
    running = list(jobs)
    while running and len(order) < 400:
        job = running.pop(0)
        result = await h.finish(job, slow=True)
        if int(result[0]) == Code.HANDOFF:  # it kept its slot: its next message
            order.append(sid_of(job))
            running.append([job[0], job[1], result[2], result[3], b"", b"", result[1]])
        else:
            assert int(result[0]) == Code.COMMITTED and len(result) > 2, result
            order.append(sid_of(result[2]))
            running.append(result[2])
    shares = Counter(tenant_of_sid(s) for s in order)
    assert abs(shares["a"] - 3 * shares["b"]) <= 8, shares


async def test_a_tenant_arriving_late_starts_at_the_shards_virtual_clock_and_takes_turns(h):
    """a and b share one slot for 20 turns; then c arrives with a backlog. It starts at the
    shard's virtual clock (where a and b are), not at 0: the next slots go round a, b and c,
    not all to c until its virtual time has caught up with theirs."""
    for i in range(20):
        await send(h, f"a-{i}", "a")
        await send(h, f"b-{i}", "b")
    _, _, [job], _, _ = await h.intake(free=1)
    for _ in range(19):
        job = (await h.finish(job))[2]
    for i in range(6):
        await send(h, f"c-{i}", "c")
    await h.intake(free=0)  # c's sessions join the queues
    later = []
    for _ in range(6):
        job = (await h.finish(job))[2]
        later.append(tenant_of_sid(sid_of(job)))
    assert Counter(later) == {"a": 2, "b": 2, "c": 2}, later


async def test_a_tenant_alone_takes_every_slot_work_conserving(h):
    """Weights are shares of what is contended: a tenant alone gets every free slot."""
    await h.share("b", weight=100)
    for i in range(10):
        await send(h, f"a-{i}", "a")
    _, _, jobs, _, _ = await h.intake(free=10)
    assert len(jobs) == 10


async def test_a_tenant_never_has_more_in_flight_than_its_maximum(h):
    await h.share("a", most=2)
    for i in range(6):
        await send(h, f"a-{i}", "a")
    await send(h, "b-0", "b")
    _, _, jobs, _, _ = await h.intake(free=5)
    got = sorted(sid_of(j) for j in jobs)
    assert got == ["a-0", "a-1", "b-0"]  # a at its maximum, the other slots stay free
    assert await h.in_flight("a") == 2
    # A freed slot of a's goes to a's next (it is below its maximum again).
    result = await h.finish(jobs[0] if sid_of(jobs[0]).startswith("a") else jobs[1])
    assert sid_of(result[2]) == "a-2"
    assert await h.in_flight("a") == 2


async def test_a_guaranteed_minimum_comes_before_a_lower_virtual_time(h):
    await h.share("b", weight=0.01, least=2)  # tiny share, but two slots guaranteed
    for i in range(10):
        await send(h, f"a-{i}", "a")
    for i in range(3):
        await send(h, f"b-{i}", "b")
    _, _, jobs, _, _ = await h.intake(free=3)
    assert Counter(tenant_of_sid(sid_of(j)) for j in jobs) == {"b": 2, "a": 1}


async def test_a_hand_off_gives_the_slot_to_the_tenant_owed_it(h):
    """A session with more messages hands its next one on only while no other tenant is owed
    the slot: b waits, so a's session queues its next message and b's runs."""
    await send(h, "a-0", "a")
    _, _, jobs, _, _ = await h.intake(free=1)
    await send(h, "a-0", "a")  # its next message
    await send(h, "b-0", "b")
    _, _, none, _, _ = await h.intake(free=0)
    assert none == [] and await h.queued("b") == ["b-0"]
    result = await h.finish(jobs[0])
    assert int(result[0]) == Code.COMMITTED and sid_of(result[2]) == "b-0"
    assert await h.queued("a") == ["a-0"]  # behind, its order kept (seq 2 next)
    result = await h.finish(result[2])
    assert sid_of(result[2]) == "a-0" and int(result[2][2]) == 2


async def test_a_hand_off_keeps_the_slot_when_nobody_waits(h):
    await send(h, "a-0", "a")
    await send(h, "a-0", "a")
    _, _, jobs, held, _ = await h.intake(free=1)
    assert len(held) == 1
    result = await h.finish(jobs[0])
    assert int(result[0]) == Code.HANDOFF


async def test_a_slow_step_takes_turns_with_its_own_tenants_waiting_sessions(h):
    await send(h, "a-0", "a")
    _, _, jobs, _, _ = await h.intake(free=1)
    await send(h, "a-0", "a")
    await send(h, "a-1", "a")
    await h.intake(free=0)
    fast = await h.finish(jobs[0], slow=False)
    assert int(fast[0]) == Code.HANDOFF  # a fast step keeps its slot
    slow = await h.finish([jobs[0][0], jobs[0][1], fast[2], fast[3], b"", b"", fast[1]], slow=True)
    assert sid_of(slow[2]) == "a-1"  # a slow one gives it to the next waiting session


async def test_a_slow_step_takes_turns_while_another_tenant_waits_at_its_maximum(h):
    """b waits too, but at its maximum: the slot is a's to keep, and after a slow step it
    goes to a's waiting session rather than to the slow session's next message."""
    await h.share("b", most=1)
    await send(h, "a-0", "a")
    await send(h, "b-0", "b")
    _, _, jobs, _, _ = await h.intake(free=2)
    assert sorted(sid_of(j) for j in jobs) == ["a-0", "b-0"]
    await send(h, "a-0", "a")  # its next message
    await send(h, "a-1", "a")
    await send(h, "b-1", "b")
    await h.intake(free=0)
    assert await h.queued("a") == ["a-1"] and await h.queued("b") == ["b-1"]
    a0 = next(j for j in jobs if sid_of(j) == "a-0")
    slow = await h.finish(a0, slow=True)
    assert int(slow[0]) == Code.COMMITTED and sid_of(slow[2]) == "a-1"
    assert await h.queued("a") == ["a-0"]  # its next message waits its turn


async def test_a_session_that_gives_its_slot_up_queues_behind_one_appended_in_the_same_ms(h):
    """The messages and the slow step's commit in one transaction: when all of it falls in one
    millisecond, a-0's next message still queues behind a-1, appended before the commit in that
    same ms. A try that straddles a millisecond is repeated (it would pass either way)."""
    k = h.k
    assert await h.r.script_load(source("commit")) == h.s.commit.sha
    same_ms = 0
    for n in range(30):
        await h.r.flushall()
        await h.r.xgroup_create(k.stream, k.group, id="0", mkstream=True)
        await h.share("b", most=1)
        await send(h, "a-0", "a")
        await send(h, "b-0", "b")
        _, _, jobs, _, _ = await h.intake(free=2)
        a0 = next(j for j in jobs if sid_of(j) == "a-0")
        args: list[Any] = [TTL_MS, 3600, 0, 1, a0[1], a0[0], int(a0[2]), int(a0[6])]
        args += [json.dumps({"seq": 1}), b"m", b"r", "applied", a0[3], "", "", "", "", "", ""]
        args += ["continue", "1", f"mc{n}", h.pattern, "1"]  # call ids of their own
        async with h.r.pipeline(transaction=True) as pipe:
            for sid, tenant in (("a-0", "a"), ("a-1", "a"), ("b-1", "b")):
                pipe.xadd(k.stream, {"session_id": sid, "text": "hi", "tenant": tenant})
            pipe.evalsha(
                h.s.intake.sha, 5, k.stream, k.ready, k.session_prefix, k.dlq, k.replies,
                k.group, "c1", 1000, f"mt{n}", TTL_MS, 3600, 65536, 32, 0, "test", 0,
                "maaf", 0, 1, "enqueue", "", 0, h.pattern,
            )  # fmt: skip
            keys = [k.stream, k.ready, k.session_prefix, k.replies, k.dlq]
            pipe.evalsha(h.s.commit.sha, 5, *keys, *args)
            *ids, _, (slow,) = await pipe.execute()
        assert int(slow[0]) == Code.COMMITTED and sid_of(slow[2]) == "a-1"
        assert await h.queued("a") == ["a-0"]
        # the commit's clock: the integer part of where it queued a-0 (same priority as a-1)
        queued_at = int((await h.r.zscore(k.tenant_queue("a"), "a-0")) or 0)
        if len({int(i.split(b"-")[0]) for i in ids} | {queued_at}) == 1:
            same_ms += 1
            if same_ms == 3:
                break
    assert same_ms >= 1  # at least one try fell in one millisecond


async def test_priority_moves_a_session_forward_in_its_tenants_queue(h):
    await send(h, "a-0", "a")
    await h.intake(free=1)  # a-0 runs: the later ones queue
    await send(h, "a-1", "a")
    await send(h, "a-2", "a", priority="9")
    await send(h, "a-3", "a", priority="oops")  # not 0-9: the default
    await h.intake(free=0)
    assert await h.queued("a") == ["a-2", "a-1", "a-3"]


async def test_a_crashed_sessions_lease_stops_counting_and_resume_queues_it_fairly(h):
    await h.share("a", most=1)
    await send(h, "a-0", "a")
    await send(h, "a-1", "a")
    _, _, jobs, _, _ = await h.intake(free=2)
    assert [sid_of(j) for j in jobs] == ["a-0"] and await h.in_flight("a") == 1
    # The holder dies: its lock and in-flight lease run out.
    await h.r.delete(h.k.session("a-0").lock)
    await h.r.zadd(h.k.tenant_busy("a"), {"a-0": 0})
    await h.r.zadd(h.k.ready, {"a-0": 0})
    rows, _ = await h.resume(count=2)
    got = [bytes(r[1]).decode() for r in rows]
    assert sorted(got) == ["a-0"] or sorted(got) == ["a-1"]
    assert await h.in_flight("a") == 1  # never above its maximum


async def test_tenants_stops_counting_a_crashed_workers_session_in_flight_when_its_lease_ends(
    h, redis_server
):
    """A worker takes a-0 with a 300 ms lease and dies: `tenants` shows it in flight until the
    lease ends, then not (a crashed worker's sessions were counted in flight until taken up
    again, however long that was)."""
    from dialog_worker.ops.model_limits import list_tenants
    from dialog_worker.store import tenants

    await tenants.set_settings(h.r, h.k, "a", max=4)  # `tenants set a --max 4`: listed
    await send(h, "a-0", "a")
    h.calls += 1
    k = h.k
    _, _, jobs, _, _ = await h.s.intake(
        keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
        args=[k.group, "c1", 10, "crash", 300, 3600, 65536, 32, 0, "test", 0, "maaf", 0, 1,
              "enqueue", "", 1, ""],
    )  # fmt: skip
    assert [sid_of(j) for j in jobs] == ["a-0"]

    async def row() -> dict[str, Any]:
        [found] = [r for r in await list_tenants(h.r, Settings()) if r["tenant"] == "a"]
        return found

    assert (await row())["in_flight"] == 1
    await anyio.sleep(0.4)  # the lease ran out; nobody took the session up yet
    assert (await row())["in_flight"] == 0
    assert (await row())["waiting"] == 0


async def test_a_crashed_session_resumed_goes_back_to_its_stream_order_place_in_the_queue(h):
    """a-0's message was appended before a-1's and a-2's; its holder dies. Taken up again by
    resume while a's queue holds a-1 and a-2, it queues in its message's place (first), not
    behind them: the freed slot is a-0's."""
    await h.share("a", most=1)
    await send(h, "a-0", "a")
    _, _, jobs, _, _ = await h.intake(free=1)
    assert [sid_of(j) for j in jobs] == ["a-0"]
    await send(h, "a-1", "a")
    await send(h, "a-2", "a")
    await h.intake(free=0)
    assert await h.queued("a") == ["a-1", "a-2"]
    # The holder dies: its lock and in-flight lease run out; the session is due.
    await h.r.delete(h.k.session("a-0").lock)
    await h.r.zadd(h.k.tenant_busy("a"), {"a-0": 0})
    await h.r.zadd(h.k.ready, {"a-0": 0})
    rows, _ = await h.resume(count=1)
    assert [bytes(r[1]).decode() for r in rows] == ["a-0"]
    assert await h.queued("a") == ["a-1", "a-2"]


async def test_a_crashed_session_back_while_its_tenant_is_at_its_maximum_waits_its_turn(h):
    """The queues are empty, so a session that comes back through the ready set would take a
    slot at once, but only within its tenant's maximum: a's other session took a's one slot
    after the crashed holder's lease ran out, so the crashed one queues and gets the slot
    that session frees."""
    await h.share("a", most=1)
    await send(h, "a-0", "a")
    _, _, jobs, _, _ = await h.intake(free=2)
    assert [sid_of(j) for j in jobs] == ["a-0"]
    # a-0's holder dies: its lock and in-flight lease run out, and a-1 takes a's slot.
    await h.r.delete(h.k.session("a-0").lock)
    await h.r.zadd(h.k.tenant_busy("a"), {"a-0": 0})
    await h.r.zadd(h.k.ready, {"a-0": 0})
    await send(h, "a-1", "a")
    _, _, later, _, _ = await h.intake(free=2)
    assert [sid_of(j) for j in later] == ["a-1"] and await h.in_flight("a") == 1
    rows, _ = await h.resume(count=2)
    assert rows == [] and await h.in_flight("a") == 1
    assert await h.queued("a") == ["a-0"]
    result = await h.finish(later[0])
    assert int(result[0]) == Code.COMMITTED and sid_of(result[2]) == "a-0"
    assert await h.in_flight("a") == 1


async def test_a_release_and_a_delete_leave_no_count_and_no_queue_place(h, redis_server):
    await h.share("a", most=5)
    await send(h, "a-0", "a")
    _, _, jobs, _, _ = await h.intake(free=1)
    assert await h.in_flight("a") == 1
    code = await h.s.release(
        keys=[h.k.ready, h.k.session_prefix],
        args=[jobs[0][1], jobs[0][0], 1, 0, "", Release.HAND_BACK.value],
    )
    assert int(code) == Code.RELEASED and await h.in_flight("a") == 0
    assert b"T" not in await h.r.hgetall(h.k.session("a-0").state)
    await send(h, "a-1", "a")
    await h.intake(free=0)
    assert await h.queued("a") == ["a-1"]
    await h.s.erase(keys=[h.k.ready, h.k.session_prefix], args=["delete", "a-1", "", 3600])
    assert await h.queued("a") == []


async def test_a_pattern_names_the_tenant_and_a_field_wins(redis_server):
    r = Redis.from_url(redis_server.url)
    await r.flushall()
    h = Harness(r, Keys.from_settings(Settings()), pattern=r"^([^:]+):")
    await r.xgroup_create(h.k.stream, h.k.group, id="0", mkstream=True)
    await send(h, "acme:1")
    await send(h, "acme:2", "globex")
    await send(h, "nocolon")
    await send(h, "acme:3", "has space")  # not a tenant name: the pattern's tenant
    await send(h, "acme:4", "x" * 65)  # too long: likewise
    await h.intake(free=0)
    assert await h.queued("acme") == ["acme:1", "acme:3", "acme:4"]
    assert await h.queued("globex") == ["acme:2"]
    assert await h.queued(DEFAULT_TENANT) == ["nocolon"]
    await r.aclose()


# --- the tenant of a message: the scripts and Python agree ----------------------------------

_ATOMS = [r"[^:]", r"\w", r"\d", r"[a-z0-9_-]", r"\.", ":", "-", "x", ".", r"\s", r"[^/]"]
_QUANTS = ["", "+", "*", "?", "*?", "+?"]


@st.composite
def patterns(draw: st.DrawFn) -> str:
    def atoms(n_min: int) -> str:
        n = draw(st.integers(n_min, 3))
        pieces = [draw(st.sampled_from(_ATOMS)) + draw(st.sampled_from(_QUANTS)) for _ in range(n)]
        return "".join(pieces)

    before, inside, after = atoms(0), atoms(1), atoms(0)
    start = draw(st.sampled_from(["", "^"]))
    end = draw(st.sampled_from(["", "$"]))
    return f"{start}{before}({inside}){after}{end}"


_ID_CHARS = st.sampled_from([*"ab:-_./x 1", "é", "ü", "中"])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(pattern=patterns(), sid=st.text(_ID_CHARS, min_size=1, max_size=12))
def test_the_scripts_and_python_find_the_same_tenant(redis_server, pattern: str, sid: str) -> None:
    r = SyncRedis.from_url(redis_server.url)
    prelude = source("intake").split("\n", 1)[1].split("--[[\n  intake:")[0]
    lua = prelude + "\nreturn tenant_of({}, ARGV[1], ARGV[2])\n"
    got = r.eval(lua, 0, sid.encode(), tenant_pattern_forms(pattern)[0])
    r.close()
    assert got.decode() == tenant_of({}, sid, pattern), (pattern, sid)
