"""The scheduling model (test_schedule_model.py) under worker leases: every lock is taken under
its worker's lease (lua/lease-2.lua), a crash is that lease lapsing (nothing else: no lock is
deleted, no count dropped by hand), and a worker can also stall past its lease and send its
results late. Besides the scheduling model's checks after every step (caps, one job per
session, every job's lock its own) and at the end (every message once, in order, nothing
counted in flight):

- a lapsed lease's sessions come back through the next lease call of another worker alone
  (the drain takes them up);
- a stalled worker's late commit is refused (fenced by its token) and writes nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import rule, run_state_machine_as_test
from test_schedule_model import (
    MERGE,
    PATTERN,
    SETTINGS,
    SLOTS,
    TTL_MS,
    WORKERS,
    Job,
    K,
    Scheduling,
    model_redis,  # noqa: F401  (the fixture)
)

from dialog_worker.store.scripts import Code, source

pytestmark = pytest.mark.integration


class LeasedScheduling(Scheduling):
    def __init__(self, r: redis.Redis) -> None:
        super().__init__(r)
        self.lease = r.register_script(source("lease"))
        self.numbers = {w: 0 for w in range(WORKERS)}
        self.current = 0
        self.stale: list[Job] = []
        for w in range(WORKERS):
            self.lease_call(w)

    def lease_call(self, worker: int) -> tuple[int, int, int]:
        number, lapsed, swept = (
            int(x)
            for x in self.lease(
                keys=[K.ready, K.session_prefix], args=[self.numbers[worker], TTL_MS, 1000]
            )
        )
        self.numbers[worker] = number
        return number, lapsed, swept

    def base(self) -> str:
        self.calls += 1
        return f"c:L{self.numbers[self.current]}.ab:{self.calls}"

    # The scheduling model's rules, each sending its worker's token base.

    @rule(worker=st.integers(0, WORKERS - 1))
    def intake(self, worker: int) -> None:
        self.current = worker
        Scheduling.intake(self, worker)

    @rule(worker=st.integers(0, WORKERS - 1))
    def resume(self, worker: int) -> None:
        self.current = worker
        Scheduling.resume(self, worker)

    @rule(worker=st.integers(0, WORKERS - 1), i=st.integers(0, SLOTS - 1), slow=st.booleans())
    def finish(self, worker: int, i: int, slow: bool) -> None:
        self.current = worker
        Scheduling.finish(self, worker, i, slow)

    # Failures: a lease that lapses, and nothing else.

    def lapse(self, worker: int) -> None:
        """The worker's lease ends (long ago); another worker's lease call brings its
        sessions back; the worker (restarted, or woken) takes a new number."""
        old = self.numbers[worker]
        self.r.zadd(K.workers, {str(old): 0})
        _, _, swept = self.lease_call((worker + 1) % WORKERS)
        note(f"worker {worker}'s lease {old} lapsed: {swept} session(s) brought back")
        assert swept >= len(self.jobs[worker]), "a lapsed lease's session was not brought back"
        number, lapsed, _ = self.lease_call(worker)
        assert lapsed == 1 and number != old

    @rule(worker=st.integers(0, WORKERS - 1))
    def crash(self, worker: int) -> None:
        """kill -9: its jobs are forgotten; its lease lapses."""
        self.lapse(worker)
        self.jobs[worker] = []

    @rule(worker=st.integers(0, WORKERS - 1))
    def stall(self, worker: int) -> None:
        """Paused past its lease: woken, it sends its first result at once (before its
        heartbeat learns of the lapse), the others later (late_commit)."""
        self.lapse(worker)
        self.stale += self.jobs[worker]
        self.jobs[worker] = []
        if self.stale:
            self.late_commit(len(self.stale) - 1)

    @rule(i=st.integers(0, 3))
    def late_commit(self, i: int) -> None:
        if i >= len(self.stale):
            return
        job = self.stale.pop(i)
        note(f"late commit of {job.sid} {job.first}..{job.seq} ({job.token})")
        before = self.r.hgetall(K.session(job.sid).state)
        args: list[Any] = [TTL_MS, 3600, 0, 1, job.token, job.sid, job.seq, job.version, "{}"]
        args += [job.msg_id, "r", "applied", job.entry_id, "", "", "", "", ""]
        args += [str(job.first) if job.first < job.seq else ""]
        args += ["continue", "1", self.base(), PATTERN, "0", MERGE]
        (result,) = self.scripts["commit"](
            keys=[K.stream, K.ready, K.session_prefix, K.replies, K.dlq], args=args
        )
        assert Code(int(result[0])) is Code.FENCED_TOKEN, f"late commit of {job}: {result}"
        assert self.r.hgetall(K.session(job.sid).state) == before, "a late commit wrote"


def test_worker_leases_keep_caps_order_and_every_message_once(
    model_redis: redis.Redis,  # noqa: F811
) -> None:
    run_state_machine_as_test(lambda: LeasedScheduling(model_redis), settings=SETTINGS)
