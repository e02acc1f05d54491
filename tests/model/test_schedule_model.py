"""Model-checked scheduling: tenants' queues, caps, priorities and merged bursts. Random
interleavings of appends (some merge, some with a priority), intake with the workers' free
slots, commits that hand on, give their slot up or fill it from the queues, failed attempts,
crashes and time passing, on a real redis-server, checked after every step:

- a tenant never has more sessions in flight than its maximum (tenant a: 1), counted from the
  jobs the workers hold (the locks);
- no session is worked by two jobs at once, and every job's lock is its own;
- at the end every message has exactly one reply event (``applied``, or ``merged`` naming a
  later message of its session that was applied in the same step), and each session's
  applied messages came in stream order.

`derandomize=True` as the main model test; `MODEL_EXAMPLES=N` sets how many examples.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from redis_server import RedisServer

from dialog_worker.config import Settings, tenant_pattern_forms
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, source

pytestmark = pytest.mark.integration

SESSIONS = ("a-1", "a-2", "a-3", "b-1", "b-2")
WORKERS, SLOTS = 2, 2
TTL_MS = 60_000
MAX_A = 1  # tenant a's maximum in flight
PATTERN = tenant_pattern_forms("^([a-z]+)-")[0]
MERGE = "enqueue,1,40"  # a 1 ms window, 40 ms at most: bursts appended together merge
K = Keys.from_settings(Settings())

SETTINGS = settings(
    max_examples=int(os.environ.get("MODEL_EXAMPLES", "120")),
    stateful_step_count=40,
    deadline=None,
    derandomize=not os.environ.get("MODEL_EXPLORE"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclasses.dataclass
class Job:
    sid: str
    token: str
    first: int  # the first part's seq (a merged burst's), else its own
    seq: int  # the answering message's seq
    entry_id: str
    msg_id: str
    version: int


def msg_id_of(entry_id: bytes, flat: list[bytes]) -> str:
    for i in range(0, len(flat) - 1, 2):
        if flat[i] == b"msg_id":
            return flat[i + 1].decode()
    return entry_id.decode()


class Scheduling(RuleBasedStateMachine):
    def __init__(self, r: redis.Redis) -> None:
        super().__init__()
        self.r = r
        r.flushall()
        r.xgroup_create(K.stream, K.group, id="0", mkstream=True)
        r.hset(K.tenant_settings, mapping={"a": f"1.0 0 {MAX_A}", "b": "2.0 0 0"})
        names = ("intake", "resume", "commit", "release")
        self.scripts = {n: r.register_script(source(n)) for n in names}
        self.jobs: dict[int, list[Job]] = {w: [] for w in range(WORKERS)}
        self.sent: dict[str, list[str]] = {s: [] for s in SESSIONS}
        self.calls = 0
        self.n = 0

    def base(self) -> str:
        self.calls += 1
        return f"w{self.calls}"

    # -- turning script rows into jobs ---------------------------------------------------

    def job_of(self, row: list[Any]) -> Job:
        """An intake/dispatch row (no kind): the job, as the pipeline makes it."""
        sid, token, seq, entry_id, flat = row[0], row[1], int(row[2]), row[3], row[4]
        first = seq
        parts = row[11] if len(row) > 11 else []
        if parts:
            seq, entry_id, flat = int(parts[-1][0]), parts[-1][1], parts[-1][2]
        return Job(
            sid.decode(),
            token.decode(),
            first,
            seq,
            entry_id.decode(),
            msg_id_of(entry_id, flat),
            int(row[6]),
        )

    def hold(self, worker: int, job: Job) -> None:
        note(f"worker {worker} holds {job.sid} seqs {job.first}..{job.seq} ({job.token})")
        self.jobs[worker].append(job)

    # -- rules -----------------------------------------------------------------------------

    @rule(
        sid=st.sampled_from(SESSIONS),
        merge=st.booleans(),
        priority=st.sampled_from([None, "0", "9"]),
        burst=st.integers(1, 3),
    )
    def append(self, sid: str, merge: bool, priority: str | None, burst: int) -> None:
        for _ in range(burst):
            self.n += 1
            fields = {"session_id": sid, "text": "t", "msg_id": f"m{self.n}"}
            if merge:
                fields["multitask"] = "merge"
            if priority:
                fields["priority"] = priority
            self.r.xadd(K.stream, fields)
            self.sent[sid].append(f"m{self.n}")

    @rule(worker=st.integers(0, WORKERS - 1))
    def intake(self, worker: int) -> None:
        free = SLOTS - len(self.jobs[worker])
        k = K
        _, _, rows, _, _ = self.scripts["intake"](
            keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
            args=[
                k.group, "c", 100, self.base(), TTL_MS, 3600, 65536, 32, 0, "v", 0, "x", 0, 1,
                "enqueue", "", free, PATTERN, 60, MERGE,
            ],
        )  # fmt: skip
        assert len(rows) <= free, f"intake handed out {len(rows)} with {free} free slots"
        for row in rows:
            self.hold(worker, self.job_of(row))

    @rule(worker=st.integers(0, WORKERS - 1))
    def resume(self, worker: int) -> None:
        free = SLOTS - len(self.jobs[worker])
        if not free:
            return
        rows, _ = self.scripts["resume"](
            keys=[K.stream, K.ready, K.session_prefix],
            args=[free, self.base(), TTL_MS, 60_000, PATTERN, MERGE],
        )
        assert len(rows) <= free
        for row in rows:
            assert row[0] == b"m", row  # no gaps here
            self.hold(worker, self.job_of(row[1:]))

    @rule(worker=st.integers(0, WORKERS - 1), i=st.integers(0, SLOTS - 1), slow=st.booleans())
    def finish(self, worker: int, i: int, slow: bool) -> None:
        if i >= len(self.jobs[worker]):
            return
        job = self.jobs[worker].pop(i)
        args: list[Any] = [TTL_MS, 3600, 0, 1, job.token, job.sid, job.seq, job.version, "{}"]
        args += [job.msg_id, "r", "applied", job.entry_id, "", "", "", "", ""]
        args += [str(job.first) if job.first < job.seq else ""]
        args += ["continue", "1", self.base(), PATTERN, "1" if slow else "0", MERGE]
        (result,) = self.scripts["commit"](
            keys=[K.stream, K.ready, K.session_prefix, K.replies, K.dlq], args=args
        )
        code = Code(int(result[0]))
        note(f"worker {worker} commits {job.sid} {job.first}..{job.seq}: {code.name}")
        if code is Code.HANDOFF:
            version, seq, entry_id, flat = int(result[1]), int(result[2]), result[3], result[4]
            parts = result[6] if len(result) > 6 else []
            first = seq
            if parts:
                seq, entry_id, flat = int(parts[-1][0]), parts[-1][1], parts[-1][2]
            if not flat:
                flat = self.r.hget(K.session(job.sid).state, f"q{seq}") and []
            nxt = Job(job.sid, job.token, first, seq, entry_id.decode(), "", version)
            nxt.msg_id = self.msg_id_in_custody(job.sid, seq, entry_id)
            self.hold(worker, nxt)
        elif code is Code.COMMITTED:
            if len(result) > 2:
                self.hold(worker, self.job_of(result[2]))
        else:
            raise AssertionError(f"commit of a held job answered {code.name}")

    def msg_id_in_custody(self, sid: str, seq: int, entry_id: bytes) -> str:
        from dialog_worker.store.codec import unpack_custody

        stored = self.r.hget(K.session(sid).state, f"q{seq}")
        assert stored is not None, f"{sid} q{seq} missing"
        _, fields = unpack_custody(stored)
        value = fields.get(b"msg_id")
        return value.decode() if value is not None else entry_id.decode()

    @rule(worker=st.integers(0, WORKERS - 1), i=st.integers(0, SLOTS - 1))
    def fail(self, worker: int, i: int) -> None:
        """A failed attempt: released, due again at once (the next resume takes it)."""
        if i >= len(self.jobs[worker]):
            return
        job = self.jobs[worker].pop(i)
        code = self.scripts["release"](
            keys=[K.ready, K.session_prefix],
            args=[job.token, job.sid, job.first, 0, "boom", "1"],
        )
        assert int(code) == Code.RELEASED

    @rule(worker=st.integers(0, WORKERS - 1))
    def crash(self, worker: int) -> None:
        """kill -9: its jobs are forgotten; their leases run out (locks and in-flight counts)."""
        for job in self.jobs[worker]:
            self.r.delete(K.session(job.sid).lock)
            for tenant in ("a", "b"):
                self.r.zadd(K.tenant_busy(tenant), {job.sid: 0}, xx=True)
            self.r.zadd(K.ready, {job.sid: 0}, xx=True)
        self.jobs[worker] = []

    @rule()
    def time_passes(self) -> None:
        for sid, _ in self.r.zrange(K.ready, 0, -1, withscores=True):
            if not self.r.exists(K.session(sid.decode()).lock):
                self.r.zadd(K.ready, {sid: 0}, xx=True)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def caps_and_locks_hold(self) -> None:
        held = [job for jobs in self.jobs.values() for job in jobs]
        sids = [job.sid for job in held]
        assert len(sids) == len(set(sids)), f"a session worked twice: {sids}"
        in_flight_a = sum(1 for s in sids if s.startswith("a-"))
        assert in_flight_a <= MAX_A, f"tenant a has {in_flight_a} in flight (max {MAX_A})"
        for job in held:
            assert self.r.get(K.session(job.sid).lock) == job.token.encode(), job

    def teardown(self) -> None:
        try:
            self.drain()
            self.check_the_end()
        finally:
            super().teardown()

    def drain(self) -> None:
        for _ in range(400):
            busy = any(self.jobs.values())
            for worker in range(WORKERS):
                while self.jobs[worker]:
                    self.finish(worker, 0, False)
            outstanding = [
                s
                for s in SESSIONS
                if int(self.r.hget(K.session(s).state, "s") or 0)
                > int(self.r.hget(K.session(s).state, "a") or 0)
            ]
            if not outstanding and not busy and self.r.xlen(K.stream) == 0:
                return
            self.time_passes()
            self.intake(0)
            self.resume(1)
        raise AssertionError("the drain did not finish")

    def check_the_end(self) -> None:
        events = [f for _, f in self.r.xrange(K.replies)]
        by_msg: dict[str, list[dict[bytes, bytes]]] = {}
        for e in events:
            by_msg.setdefault(e[b"msg_id"].decode(), []).append(e)
        for sid, msg_ids in self.sent.items():
            applied_order = []
            for msg_id in msg_ids:
                got = by_msg.get(msg_id, [])
                assert len(got) == 1, f"{sid} {msg_id}: {len(got)} reply events"
                outcome = got[0][b"outcome"]
                assert outcome in (b"applied", b"merged"), (msg_id, outcome)
                if outcome == b"merged":
                    by = got[0][b"answered_by"].decode()
                    assert msg_ids.index(by) > msg_ids.index(msg_id), (msg_id, by)
                applied_order.append(int(got[0][b"seq"]))
            assert applied_order == sorted(applied_order), f"{sid} out of order"
        # Nothing left in the queues or counted in flight.
        assert not self.r.exists(K.tenants_active)
        for tenant in ("a", "b"):
            assert self.r.zcount(K.tenant_busy(tenant), 1, "+inf") == 0


@pytest.fixture(scope="module")
def model_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    server = RedisServer(Path(tmp_path_factory.mktemp("schedule-model"))).start()
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()
    server.stop()


def test_scheduling_keeps_caps_order_and_every_message_once(model_redis: redis.Redis) -> None:
    run_state_machine_as_test(lambda: Scheduling(model_redis), settings=SETTINGS)
