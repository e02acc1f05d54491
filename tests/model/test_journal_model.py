"""Model-checked journal and interrupt scripts: random interleavings of intake, resume,
commit, lease loss, lua/journal-1.lua, lua/interrupt-3.lua and lua/resolve-2.lua (resumes
right, repeated, stale and wrong) on a real redis-server, checked after every step against a
model of what docs/guarantees.md B-journal and B-interrupts allow.

One session gets three messages; two simulated workers take them (intake, resume after their
lease ends), record results (some of them as attempts that lost their lease, or whose
message was committed meanwhile), wait for a person, and commit. Time is never waited for:
`lease_ends` deletes the lock and makes the session due, as the clock would.

Checked after every step (the model predicts each script's answer first):
- journal fencing: a result is recorded only by the lock holder of the session's next
  message; the first result of a name stays; the journal holds exactly the recorded results,
  and is gone once its message is committed;
- journal expiry: a recorded result gives the journal the journal expiry (seconds); a wait for
  a person keeps it as long as the wait (no expiry without a timeout, the expiry after the
  timeout with one); the take-up after a resume gives it a day again;
- resume once: a resume is applied only while the session waits on that interrupt, at most
  once per interrupt, and the run after it finds the value; a parked session is never handed
  out (not in the ready set, no lock) until the resume;
- at the end every message is applied once, in order.

`derandomize=True`, as the main model test; `MODEL_EXAMPLES=N` sets how many examples.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from redis_server import RedisServer

from dialog_worker.config import Settings
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, source

pytestmark = pytest.mark.integration

SID = "j1"
MESSAGES = ("m1", "m2", "m3")
WORKERS = 2
TTL_MS = 60_000
MAX_BYTES = 40  # small: a few results fill a journal
NAMES = ("a", "b", "c")
JOURNAL_TTL_S = 3600
LONG_WAIT_MS = 2 * 86_400_000  # a timeout longer than the journal expiry
RESUMED_TTL_S = 86_400  # a resumed message's journal, once resume-3.lua took it up
K = Keys.from_settings(Settings())
SK = K.session(SID)

SETTINGS = settings(
    max_examples=int(os.environ.get("MODEL_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    derandomize=not os.environ.get("MODEL_EXPLORE"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclasses.dataclass
class Job:
    token: str
    seq: int
    msg_id: str
    version: int


class JournalScripts(RuleBasedStateMachine):
    def __init__(self, r: redis.Redis) -> None:
        super().__init__()
        self.r = r
        r.flushall()
        r.xgroup_create(K.stream, K.group, id="0", mkstream=True)
        names = ("intake", "resume", "commit", "journal", "interrupt", "resolve")
        self.scripts = {n: r.register_script(source(n)) for n in names}
        for msg_id in MESSAGES:
            r.xadd(K.stream, {"session_id": SID, "text": "t", "msg_id": msg_id})
        self.calls = 0
        self.jobs: dict[int, Job] = {}  # worker -> the job it believes it holds
        self.holder: str | None = None  # the lock's token, as the model knows it
        self.applied = 0
        self.version = 0
        self.journal: dict[str, dict[str, str]] = {m: {} for m in MESSAGES}
        self.used: dict[str, int] = Counter()
        # The expiry each message's journal should have (seconds; -1: none; absent: no journal).
        self.expiry: dict[str, int] = {}
        self.unparked: str | None = None  # a message resumed and not yet taken up
        self.waits: Counter[str] = Counter()  # attempts of each message that ended awaiting
        self.pending: tuple[str, str, int] | None = None  # (interrupt id, msg_id, n)
        self.asked: Counter[str] = Counter()  # interrupts asked per message (the next n)
        self.resolved: dict[str, str] = {}  # interrupt id -> the value it was resumed with
        self.applied_resumes: Counter[str] = Counter()
        self.intake(0)

    # -- calls -----------------------------------------------------------------------------

    def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self.scripts[name](keys=keys, args=args)

    def take(self, worker: int, row: list[Any]) -> None:
        token, seq = row[0].decode(), int(row[1])
        job = Job(token, seq, MESSAGES[seq - 1], int(row[5]))
        assert seq == self.applied + 1, f"handed out seq {seq} with {self.applied} applied"
        assert self.pending is None, "a parked session was handed out"
        self.jobs[worker] = job
        self.holder = token

    def intake(self, worker: int) -> None:
        self.calls += 1
        _, _, jobs, _, _ = self.run(
            "intake",
            [K.stream, K.ready, K.session_prefix, K.dlq, K.replies],
            [K.group, "c", 100, f"i{self.calls}", TTL_MS, 3600, 65536, 32, 0, "v", 0, "x"],
        )
        for row in jobs:
            self.take(worker, row[1:])

    # -- rules -----------------------------------------------------------------------------

    @rule(worker=st.integers(0, WORKERS - 1))
    def lease_ends(self, worker: int) -> None:
        """The clock passes the holder's lease: the lock is gone, the session is due."""
        self.r.delete(SK.lock)
        self.holder = None
        if self.r.zscore(K.ready, SID) is not None:
            self.r.zadd(K.ready, {SID: 0})

    @rule(worker=st.integers(0, WORKERS - 1))
    def resume(self, worker: int) -> None:
        self.calls += 1
        rows, _ = self.run(
            "resume", [K.stream, K.ready, K.session_prefix], [10, f"r{self.calls}", TTL_MS, 0]
        )
        if self.unparked is not None:  # due at once after the resume: looked at here
            self.expiry[self.unparked] = RESUMED_TTL_S
            self.unparked = None
        for row in rows:
            self.take(worker, row[2:])
            note(f"worker {worker} took seq {int(row[3])}")

    @rule(worker=st.integers(0, WORKERS - 1), name=st.sampled_from(NAMES),
          size=st.integers(1, 20))  # fmt: skip
    def record(self, worker: int, name: str, size: int) -> None:
        job = self.jobs.get(worker)
        if job is None:
            return
        value = json.dumps(f"{worker}" * size)
        got = self.run(
            "journal",
            [K.session_prefix],
            [job.token, SID, job.seq, job.msg_id, name, value, MAX_BYTES, JOURNAL_TTL_S],
        )
        code = Code(int(got[0]))
        fresh = job.token == self.holder and job.seq == self.applied + 1
        recorded = self.journal[job.msg_id]
        note(f"worker {worker} records {name} for seq {job.seq}: {code.name}")
        if not fresh:
            assert code in (Code.FENCED_TOKEN, Code.FENCED_VERSION), f"stale write {code.name}"
        elif name in recorded:
            assert (code, got[1].decode()) == (Code.JOURNAL_HAD, recorded[name])
        elif self.used[job.msg_id] + len(name) + len(value) > MAX_BYTES:
            assert code is Code.JOURNAL_FULL
        else:
            assert code is Code.JOURNALED
            recorded[name] = value
            self.used[job.msg_id] += len(name) + len(value)
            self.expiry[job.msg_id] = JOURNAL_TTL_S

    @rule(worker=st.integers(0, WORKERS - 1), timeout_ms=st.sampled_from([0, LONG_WAIT_MS]))
    def interrupt(self, worker: int, timeout_ms: int) -> None:
        job = self.jobs.get(worker)
        if job is None:
            return
        n = self.asked[job.msg_id] + 1
        iid = f"{job.msg_id}:{job.seq}:{n}"
        got = self.run(
            "interrupt",
            [K.ready, K.session_prefix, K.replies],
            [job.token, SID, job.seq, job.msg_id, "1-1", iid, n, '{"q":1}', timeout_ms, 0, "",
             JOURNAL_TTL_S,
             json.dumps({"interrupt_id": iid}), 1, 0, 100, 600],
        )  # fmt: skip
        code = Code(int(got[0]))
        fresh = job.token == self.holder and job.seq == self.applied + 1
        note(f"worker {worker} interrupts seq {job.seq} ({iid}): {code.name}")
        if not fresh:
            assert code in (Code.FENCED_TOKEN, Code.FENCED_VERSION), f"stale park {code.name}"
            return
        assert code is Code.PARKED
        self.pending = (iid, job.msg_id, n)
        self.asked[job.msg_id] = n
        self.waits[job.msg_id] += 1
        self.expiry[job.msg_id] = JOURNAL_TTL_S + timeout_ms // 1000 if timeout_ms else -1
        self.holder = None
        del self.jobs[worker]

    @rule(choice=st.sampled_from(["pending", "old", "wrong"]), value=st.integers(0, 9))
    def resolve(self, choice: str, value: int) -> None:
        if choice == "pending" and self.pending is not None:
            iid = self.pending[0]
        elif choice == "old" and self.resolved:
            iid = sorted(self.resolved)[value % len(self.resolved)]
        else:
            iid = f"m9:9:{value}"
        got = [v.decode() for v in self.run(
            "resolve", [K.ready, K.session_prefix], ["resume", SID, iid, str(value)]
        )]  # fmt: skip
        note(f"resume {iid} with {value}: {got}")
        if self.pending is not None and iid == self.pending[0]:
            assert got == ["resumed"]
            self.resolved[iid] = str(value)
            self.applied_resumes[iid] += 1
            self.unparked = self.pending[1]
            self.pending = None
        elif iid in self.resolved:
            assert got == ["ended", f'{{"value":{self.resolved[iid]}}}']
        else:
            assert got == ["unknown"]

    @rule(worker=st.integers(0, WORKERS - 1))
    def commit(self, worker: int) -> None:
        job = self.jobs.pop(worker, None)
        if job is None:
            return
        args = [TTL_MS, 3600, 0, 1, job.token, SID, job.seq, job.version, "{}", job.msg_id,
                "r", "applied", "1-1", "", "", "", "", "", ""]  # fmt: skip
        [result] = self.run("commit", [K.stream, K.ready, K.session_prefix, K.replies, K.dlq], args)
        code = Code(int(result[0]))
        fresh = job.token == self.holder and job.seq == self.applied + 1
        note(f"worker {worker} commits seq {job.seq}: {code.name}")
        if not fresh:
            assert code in (Code.FENCED_TOKEN, Code.FENCED_VERSION), f"stale commit {code.name}"
            return
        assert code in (Code.COMMITTED, Code.HANDOFF)
        self.applied += 1
        self.version += 1
        self.journal[job.msg_id] = {}
        self.used[job.msg_id] = 0
        self.expiry.pop(job.msg_id, None)
        if code is Code.HANDOFF:
            nxt = Job(job.token, int(result[2]), MESSAGES[int(result[2]) - 1], self.version)
            self.jobs[worker] = nxt
        else:
            self.holder = None

    # -- checks ----------------------------------------------------------------------------

    @invariant()
    def redis_agrees(self) -> None:
        for msg_id in MESSAGES:
            stored = {
                k.decode()[2:]: v.decode()
                for k, v in self.r.hgetall(SK.journal(msg_id)).items()
                if k.startswith(b"o:")
            }
            assert stored == self.journal[msg_id], f"journal of {msg_id}"
            ttl = self.r.ttl(SK.journal(msg_id))
            want = self.expiry.get(msg_id, -2)  # -2: no such key
            if want > 0:
                assert want - 60 <= ttl <= want, f"journal of {msg_id} expires in {ttl} s"
            else:
                assert ttl == want, f"journal of {msg_id} expires in {ttl} s, not {want}"
        parked = self.r.get(SK.awaiting)
        if self.pending is None:
            assert parked is None, "a resumed session still waits"
        else:
            assert json.loads(parked)["id"] == self.pending[0]
            assert self.r.zscore(K.ready, SID) is None, "a parked session is in the ready set"
            assert not self.r.exists(SK.lock), "a parked session is locked"
        for iid, value in self.resolved.items():
            # Where the run after the resume reads its answer.
            assert self.r.hget(SK.interrupts, iid) == f'{{"value":{value}}}'.encode()
        assert all(n == 1 for n in self.applied_resumes.values()), self.applied_resumes

    def teardown(self) -> None:
        """Drain: answer what waits, end every lease, resume and commit until all is applied."""
        for _ in range(12):
            if self.applied == len(MESSAGES):
                break
            if self.pending is not None:
                self.resolve("pending", 1)
            self.lease_ends(0)
            self.jobs.clear()
            self.resume(0)
            while 0 in self.jobs:
                self.commit(0)
        assert self.applied == len(MESSAGES), f"only {self.applied} applied"
        outcomes = [
            (f[b"msg_id"].decode(), f[b"outcome"].decode())
            for _, f in self.r.xrange(K.replies)
            if f[b"outcome"] == b"applied"
        ]
        assert outcomes == [(m, "applied") for m in MESSAGES]
        for msg_id in MESSAGES:
            assert not self.r.exists(SK.journal(msg_id)), f"{msg_id}'s journal outlived it"


@pytest.fixture(scope="module")
def model_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    server = RedisServer(Path(tmp_path_factory.mktemp("journal-model-redis"))).start()
    r = redis.Redis.from_url(server.url)
    yield r
    r.close()
    server.stop()


def test_journal_and_interrupt_scripts_against_the_model(model_redis: redis.Redis) -> None:
    run_state_machine_as_test(lambda: JournalScripts(model_redis), settings=SETTINGS)
