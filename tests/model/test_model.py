"""Model-checked scripts: random interleavings of every Lua script on a real redis-server,
checked after every step against a model of what CONTRACT.md section 4 allows.

The machine calls the scripts exactly as the worker does (the arguments of
tests/integration/test_scripts.py's Harness): producers append plain entries (some with an
explicit msg_id, some repeating one, some malformed, some that the engine fails on every time),
three simulated workers take work (intake, resume), step it (a pure function: the state's
history gets one turn), commit it (alone or several at once: group commit), fail it (release
with a backoff), hand it back, renew their leases and crash (tokens forgotten, jobs never
committed). Any call may be sent twice, as a client does after losing a reply.

Time is never waited for. The scripts read Redis TIME and every lease in this test is a
minute long, so nothing expires by itself; `time_passes` does for one session exactly what
the clock would: its lock key is gone (the lease ended) and its ready-set score is in the past
(its look-again time came). An idle session's state expires by deleting it; its dedupe keys
go with it (a dedupe window no longer than the state TTL, as with the defaults: none is
younger than the state's idle TTL) or stay (a longer window).

Cancel and double-texting: a cancel (lua/cancel-1.lua) of any msg_id of a session, known or
not, at any moment; appends carry a multitask field now and then (enqueue, reject, interrupt,
coalesce). The model predicts the cancel's answer, which messages end cancelled / superseded
without a step (intake, resume, hand-off), a commit refused because its message was cancelled
meanwhile (the worker then commits it cancelled), the rejected ones, and the cancel marks.

Replies and expiry: a step answers, by its seq, with a string, one bubble, two bubbles or
nothing (the commit's reply extras: bubbles / no_reply), messages m2 and m3 carry a channel
field that intake and commit echo onto every event of theirs (copies answered by the
original's commit carry the original's), and m6 carries an expires_at long past: its turn
ends it expired, without a step, and frees its msg_id (checked against the dedupe key).

Model limits and budgets: a held job may be handed back as a rate-limited step is (a 429
paused its key, or its turn is a minute away): its attempt is not counted and its session's
later messages wait behind it; m4's tenant has spent its day's budget, so its turn ends it
budget_exceeded without a step (its msg_id freed); every applied commit carries its step's
usage, and the tenant's counters of the day must equal the usage of the commits written (a
commit sent twice, or fenced, adds nothing).

Checked after every step (the model predicts each script's answer and effects first):
- every reply event and dead letter is one the model expected from that call: an entry ends
  at most once, with the outcome, seq and extra fields it must have (applied / dead_lettered /
  duplicate / cancelled / rejected / superseded / expired);
- per session, seqs are given in stream order without gaps, and a job is always the session's
  next message, with the state (version, document) the previous commit wrote;
- a commit (or release) by a token that does not hold the lock is fenced and changes nothing;
- the state hash, lock, ready set, stream and pending list are what the model says: a session
  with outstanding messages has a place in the ready set (nothing wedges) and its state has no
  TTL; an idle session's state has one; nothing stays pending in the consumer group;
- custody: the stream holds only unread entries; a sequenced message lives in its session's
  state (q<seq>: its entry id and fields, byte for byte), so hostile producer commands (XDEL,
  XTRIM MAXLEN / MINID, XADD MAXLEN = 1, an explicit id far ahead) never touch it; unread
  entries they remove are counted by the next intake call (after the first, which sets the
  baseline) and end no other way; a pushed-ahead last id is reported once.
At the end of every example, a drain (every lease ends, resume and commit until nothing is
left, bounded) must finish everything: each appended entry ended exactly once, per-session
order equal to append order (read from the reply stream alone), stream and ready set empty,
no lock left.

One rule draws each step's action (see ACTIONS for why). CI runs the same examples every
time (`derandomize=True`, no example database): a red run is reproduced by running the test
again, anywhere, and Hypothesis prints the shrunk steps with a note of what each did.
`MODEL_EXPLORE=1` draws fresh random examples instead; `MODEL_EXAMPLES=N` sets how many;
`MODEL_NO_SHRINK=1` reports the first failing example as found (the mutation check's setting).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from redis_server import RedisServer

from dialog_worker.config import Settings
from dialog_worker.store.codec import MAX_EXTRA_FIELDS, unpack_custody
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, Release, source

pytestmark = pytest.mark.integration

SESSIONS = ("s1", "s2", "{s3}")  # braces: the escaped hash tag is part of every key
WORKERS = 3
LOCK_TTL_MS = 60_000  # never runs out by itself: `time_passes` ends leases
STATE_TTL_S = 3600
DEDUPE_TTL_S = 3600
MAX_BYTES = 1024
MAX_ATTEMPTS = 3
GAP_TIMEOUT_MS = 0  # a missing entry is a gap at its second sighting by resume
FALLBACK = "maaf"
# Rich replies, echoed fields, expiry: messages m2 and m3 carry a channel field, echoed onto
# every event of theirs; m6 carries an expires_at long past, so its turn ends it expired
# (the pipeline's decision, before any step); an applied message's step answers, by its seq,
# with a string, one bubble, two bubbles or nothing (reply extras: bubbles / no_reply).
ECHO_FIELD = "channel"
CHANNEL_OF = {"m2": "web", "m3": "wa"}
EXPIRED_MSG_ID = "m6"
# Model usage and budgets: m4's tenant has spent its budget, so its turn ends it
# budget_exceeded without a step (the pipeline's decision, like expiry); every applied commit
# carries the usage of its step (tokens by its seq), which the commit adds to the tenant's
# counters of the day: checked against the sum of what was committed, so a commit sent twice
# (or fenced) counts nothing more.
BUDGET_MSG_ID = "m4"
TENANT, DAY = "acme", "20260101"
UNAPPLIED = ("cancelled", "superseded", "expired", "budget_exceeded")
EVENT_FIELDS = {b"session_id", b"msg_id", b"seq", b"outcome", b"reply", b"produced_at",
                b"entry_id"}  # fmt: skip
DRAIN_ROUNDS = 12
WAITING_COPIES_BYTES = 1024  # lua/intake-5.lua MAX_WAITING_COPIES_BYTES

SETTINGS = settings(
    max_examples=int(os.environ.get("MODEL_EXAMPLES", "1000")),
    stateful_step_count=80,
    deadline=None,
    derandomize=not os.environ.get("MODEL_EXPLORE"),
    database=None,
    print_blob=True,
    # Shrink one failure well rather than several badly (Hypothesis stops after 500 shrinks).
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
    # The mutation check needs a failure, not its smallest form: MODEL_NO_SHRINK=1 (set by
    # tests/mutation/run.py) stops at the first failing example.
    **(
        {"phases": [Phase.explicit, Phase.reuse, Phase.generate]}
        if os.environ.get("MODEL_NO_SHRINK")
        else {}
    ),
)


# ---------------------------------------------------------------------------------------------
# The model


@dataclasses.dataclass(eq=False)
class Entry:
    """One appended stream entry and what became of it."""

    label: str  # e1, e2... in append order (notes and failure messages use it)
    id: str
    fields: list[tuple[bytes, bytes]]
    sid: str | None  # the session it names (one valid session_id), else None
    msg_id: str | None  # explicit msg_id
    refusal: str = ""  # the malformed shape; "" for a well-formed entry
    poison: bool = False  # the engine fails on it every time
    delivered: bool = False
    kind: str = ""  # at intake: refused | duplicate | sequenced
    seq: int = 0  # its seq (sequenced) or the original's (duplicate)
    deleted: bool = False  # sequenced, then its q<seq> field deleted by hand (a gap)
    trimmed: bool = False  # removed from the stream unread by a producer command
    anonymous: bool = False  # ended as a gap: its event and letter name no entry
    ended: str = ""  # applied | dead_lettered | duplicate | cancelled | rejected | superseded
    multitask: str | None = None  # its multitask field

    def __repr__(self) -> str:
        return f"{self.label}({self.sid}#{self.seq})" if self.seq else self.label


@dataclasses.dataclass(eq=False)
class Session:
    """What the session's keys must hold (its state hash, lock and ready-set place)."""

    sid: str
    life: int = 1  # a new life starts when idle state expires: seqs start again at 1
    last: int = 0  # s: last seq given
    applied: int = 0  # a: last seq finished (applied or dead-lettered in turn)
    version: int = 0
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    by_seq: dict[int, Entry] = dataclasses.field(default_factory=dict)
    # msg_id -> (seq, life): a dedupe key may outlive its state (a dedupe window longer
    # than the state TTL), and then names a seq of an earlier life.
    dedupe: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    waiting: dict[int, list[Entry]] = dataclasses.field(default_factory=dict)  # copies
    attempts: int = 0  # n: deliveries of the next message
    # msg_id -> its journal's r: attempts handed back for a limit key after streaming, which
    # spend none (lua/release-2.lua); the message's commit deletes its journal
    unspent: dict[str, int] = dataclasses.field(default_factory=dict)
    last_error: str = ""  # e
    failed: bool = False  # f present
    gap_seen: bool = False  # g present
    done: str = ""  # c: token:seq of the last commit
    lock: str | None = None
    ready: str | None = None  # None (not a member) | "due" | "later"
    age: int | None = None  # its score in the ages: when its next message was appended
    xc: int = 0  # messages below this seq end cancelled (an interrupting message)
    xs: int = 0  # messages below this seq, not running yet, end superseded (coalesce)
    # T: the tenant it counts in flight for, from a lock taken for a message until a commit or
    # release gives the lock up (a lease that runs out leaves it: its count expires instead)
    counted: bool = False

    @property
    def outstanding(self) -> bool:
        return self.last > self.applied


@dataclasses.dataclass(eq=False)
class Job:
    """A message whose lock a simulated worker was given (the pipeline's Job)."""

    sid: str
    token: str
    seq: int
    entry_id: str
    fields: list[bytes]
    doc: bytes
    version: int
    attempts: int
    gap: bool = False
    held: dict[str, list[bytes]] = dataclasses.field(default_factory=dict)
    commit: list[Any] | None = None  # the commit's 11 arguments once stepped
    ending: str = ""  # cancelled | superseded: ends without a step

    def __repr__(self) -> str:
        return f"{self.sid}#{self.seq}@{self.token}"


@dataclasses.dataclass(eq=False)
class SimWorker:
    name: str
    life: int = 1
    calls: int = 0
    jobs: list[Job] = dataclasses.field(default_factory=list)

    def token_base(self) -> str:
        self.calls += 1
        return f"{self.name}.{self.life}:{self.calls}"

    def crash(self) -> None:
        """kill -9: every job forgotten; the next life never reuses a token."""
        self.jobs = []
        self.life += 1
        self.calls = 0


# Malformed entries: shape -> (fields for a session, whether the entry names that session).
def _fields(*pairs: tuple[str, str | bytes]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v if isinstance(v, bytes) else v.encode()) for k, v in pairs]


MALFORMED: dict[str, tuple[Callable[[str], list[tuple[bytes, bytes]]], bool]] = {
    "no_session": (lambda sid: _fields(("text", "hi")), False),
    "blank_session": (lambda sid: _fields(("session_id", "  "), ("text", "hi")), False),
    "control_in_session": (lambda sid: _fields(("session_id", "a\nb"), ("text", "hi")), False),
    "session_not_utf8": (lambda sid: _fields(("session_id", b"\xff\xfe"), ("text", "hi")), False),
    "two_sessions": (
        lambda sid: _fields(("session_id", sid), ("session_id", "other"), ("text", "hi")),
        False,
    ),
    "no_text": (lambda sid: _fields(("session_id", sid)), True),
    "blank_text": (lambda sid: _fields(("session_id", sid), ("text", "   ")), True),
    "bad_msg_id": (
        lambda sid: _fields(("session_id", sid), ("text", "hi"), ("msg_id", "m\x01")),
        True,
    ),
    "too_large": (lambda sid: _fields(("session_id", sid), ("text", "x" * MAX_BYTES)), True),
    "too_many_fields": (
        lambda sid: _fields(
            ("session_id", sid),
            ("text", "hi"),
            *((f"f{i}", "v") for i in range(MAX_EXTRA_FIELDS + 1)),
        ),
        True,
    ),
    "text_twice": (lambda sid: _fields(("session_id", sid), ("text", "a"), ("text", "b")), True),
}


def echoed(pairs: list[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    """The reply extras an entry's fields give its events: its first channel field."""
    for name, value in pairs:
        if name == ECHO_FIELD.encode():
            return ((ECHO_FIELD, s(value)),)
    return ()


def _pairs(flat_fields: list[bytes]) -> list[tuple[bytes, bytes]]:
    return [(flat_fields[i], flat_fields[i + 1]) for i in range(0, len(flat_fields) - 1, 2)]


def engine_answer(seq: int, text: str) -> tuple[str, list[str]]:
    """What the worker commits for a step that answered, by seq: a string, one bubble, two
    bubbles or None (reply text and reply extras, as dialog_worker/engine/protocol.py's RichReply
    gives)."""
    kind = seq % 4
    if kind == 0:
        return text, []
    if kind == 1:
        bubbles = [{"text": text, "data": {"buttons": [{"title": "ok", "payload": "ok"}]}}]
    elif kind == 2:
        bubbles = [{"text": text}, {"text": "more"}]
    else:
        return "", ["no_reply", "1"]
    joined = "\n\n".join(b["text"] for b in bubbles if b["text"])
    return joined, ["bubbles", json.dumps(bubbles, separators=(",", ":"))]


def s(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, n = entry_id.partition("-")
    return int(ms), int(n)


def flat(pairs: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [x for pair in pairs for x in pair]


def field(flat_fields: list[bytes], name: bytes) -> bytes | None:
    for i in range(0, len(flat_fields) - 1, 2):
        if flat_fields[i] == name:
            return flat_fields[i + 1]
    return None


def job_msg_id(job: Job) -> str:
    """The msg_id the pipeline decodes: the field, else the entry id."""
    return s(field(job.fields, b"msg_id") or job.entry_id)


class Scripts:
    """The worker's scripts on a synchronous bytes client, with the worker's arguments."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.k = r, keys
        self.intake = r.register_script(source("intake"))
        self.resume = r.register_script(source("resume"))
        self.commit = r.register_script(source("commit"))
        self.release = r.register_script(source("release"))
        self.renew = r.register_script(source("renew"))
        self.cancel = r.register_script(source("cancel"))

    def call_cancel(self, sid: str, msg_id: str) -> tuple[str, int, str]:
        status, seq, outcome = self.cancel(
            keys=[self.k.session_prefix], args=[sid, msg_id, DEDUPE_TTL_S]
        )
        return s(status), int(seq), s(outcome)

    def call_intake(self, consumer: str, count: int, token_base: str) -> list[Any]:
        k = self.k
        return self.intake(
            keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
            args=[
                k.group, consumer, count, token_base, LOCK_TTL_MS, DEDUPE_TTL_S, MAX_BYTES,
                MAX_EXTRA_FIELDS, 0, "model", 0, FALLBACK, 0, 1, "enqueue", ECHO_FIELD,
            ],
        )  # fmt: skip

    def call_resume(self, token_base: str) -> list[Any]:
        k = self.k
        return self.resume(
            keys=[k.stream, k.ready, k.session_prefix],
            args=[1000, token_base, LOCK_TTL_MS, GAP_TIMEOUT_MS],
        )

    def call_commit(self, commits: list[list[Any]]) -> list[Any]:
        k = self.k
        args: list[Any] = [LOCK_TTL_MS, STATE_TTL_S, 0, len(commits)]
        for c in commits:
            args += [*c, *[""] * (15 - len(c))]  # extras, timers, usage, first part (left out)
        return self.commit(keys=[k.stream, k.ready, k.session_prefix, k.replies, k.dlq], args=args)

    def call_release(self, job: Job, delay_ms: int, error: str, mode: Release) -> int:
        k = self.k
        args: list[Any] = [job.token, job.sid, job.seq, delay_ms, error, mode.value]
        if mode is Release.HAND_BACK_UNSPENT:
            args += [job_msg_id(job), STATE_TTL_S]
        return int(self.release(keys=[k.ready, k.session_prefix], args=args))

    def call_renew(self, jobs: list[Job]) -> list[int]:
        k = self.k
        args: list[Any] = [LOCK_TTL_MS]
        for job in jobs:
            args += [job.token, job.sid]
        return [int(x) for x in self.renew(keys=[k.ready, k.session_prefix], args=args)]


# ---------------------------------------------------------------------------------------------
# The machine


class Append(NamedTuple):
    session: str
    msg_id: int | None  # explicit msg_id m<n>, or none (the entry id)
    poison: bool  # the engine fails on it every time
    policy: str | None  # its multitask field, if any


class Cancel(NamedTuple):
    session: str
    i: int  # which msg_id of the session's entries (or one never sent)


class AppendBurst(NamedTuple):
    session: str
    n: int


class AppendAgain(NamedTuple):
    i: int  # which earlier entry with an explicit msg_id is sent again


class AppendMalformed(NamedTuple):
    shape: str
    session: str


class Intake(NamedTuple):
    worker: int
    batch: int  # most entries to read
    resend: bool  # the reply is lost and the call sent again


class Resume(NamedTuple):
    worker: int
    resend: bool


class Step(NamedTuple):
    i: int  # which held, unstepped job
    backoff: bool  # a failed attempt waits (True) or is due at once


class Commit(NamedTuple):
    worker: int  # among the workers with stepped jobs
    mask: int  # which of its stepped jobs go in this call (none picked: all)
    resend: bool


class HandBack(NamedTuple):
    i: int
    how: str  # shutdown | streamed (its step had streamed text: the attempt stays counted)
    # | rate_limited (its key is paused or its turn is later: back in a minute, no attempt)
    # | rate_limited_streamed (the same after its step streamed: a new attempt number for its
    # readers, no attempt spent)


class Renew(NamedTuple):
    worker: int


class Crash(NamedTuple):
    worker: int


class TimePasses(NamedTuple):
    session: str
    lease_ends: bool  # False: only its look-again time passes (resume must see the lock)


class Expire(NamedTuple):
    what: str  # state | state_before_dedupe | dedupe | entry
    i: int


class Hostile(NamedTuple):
    what: str  # xdel | maxlen | minid | xadd_maxlen | ahead
    i: int


pick = st.integers(0, 63)
sessions = st.sampled_from(SESSIONS)
workers = st.integers(0, WORKERS - 1)
rarely = st.sampled_from([False] * 5 + [True])  # shrinks to False

# One rule draws one action, with these weights. Separate @rule methods would be switched off
# at random per example (Hypothesis's swarm testing disables each rule with a probability
# drawn uniformly per example): only about one example in five then had intake, step and
# commit all enabled, and the rest never finished a message before the drain. (Swarm testing
# still switches `act` or `nothing_happens` off in some examples.)
ACTIONS: list[tuple[int, st.SearchStrategy[Any]]] = [
    (
        4,
        st.builds(
            Append,
            sessions,
            st.one_of(st.none(), st.integers(1, 6)),
            rarely,
            st.sampled_from([None, None, None, "enqueue", "reject", "interrupt", "coalesce"]),
        ),
    ),
    (2, st.builds(Cancel, sessions, pick)),
    (1, st.builds(AppendBurst, sessions, st.integers(2, 4))),
    (1, st.builds(AppendAgain, pick)),
    (1, st.builds(AppendMalformed, st.sampled_from(sorted(MALFORMED)), sessions)),
    (3, st.builds(Intake, workers, st.integers(1, 4), rarely)),
    (2, st.builds(Resume, workers, rarely)),
    (4, st.builds(Step, pick, st.booleans())),
    (4, st.builds(Commit, workers, st.integers(0, 255), rarely)),
    (
        1,
        st.builds(
            HandBack,
            pick,
            st.sampled_from(["shutdown", "streamed", "rate_limited", "rate_limited_streamed"]),
        ),
    ),
    (1, st.builds(Renew, workers)),
    (1, st.builds(Crash, workers)),
    (2, st.builds(TimePasses, sessions, st.sampled_from([True, True, False]))),
    (
        2,
        st.builds(
            Expire, st.sampled_from(["state", "state_before_dedupe", "dedupe", "entry"]), pick
        ),
    ),
    (
        2,
        st.builds(
            Hostile, st.sampled_from(["xdel", "maxlen", "minid", "xadd_maxlen", "ahead"]), pick
        ),
    ),
]
action = st.sampled_from([s for weight, s in ACTIONS for _ in range(weight)]).flatmap(lambda s: s)


class DialogScripts(RuleBasedStateMachine):
    def __init__(self, r: redis.Redis, scripts: Scripts) -> None:
        super().__init__()
        self.r, self.sc, self.k = r, scripts, scripts.k
        r.flushall()
        r.xgroup_create(self.k.stream, self.k.group, id="0", mkstream=True)
        self.sessions = {sid: Session(sid) for sid in SESSIONS}
        self.workers = [SimWorker(f"w{i + 1}") for i in range(WORKERS)]
        self.entries: list[Entry] = []
        self.by_id: dict[str, Entry] = {}
        self.last_delivered = "0-0"
        # Trim detection: the first intake call sets the baseline; each later one reports the
        # unread entries removed since the call before, and a pushed-ahead id once.
        self.inbound_known = False
        self.trimmed_since = 0
        self.trimmed_counted = 0
        self.ahead = self.ahead_reported = False
        # What the calls since the last check must have written, and how far we have read.
        self.expect_events: list[tuple[Any, ...]] = []
        self.expect_letters: list[tuple[str, str]] = []
        self.replies_seen = "-"
        self.letters_seen = "-"
        self.changed = False  # since the last check
        self.marks: set[tuple[str, str]] = set()  # (session, msg_id) cancel marks
        self.usage = dict.fromkeys(("in", "out", "cost", "calls"), 0)  # committed, per the model

    @rule(a=action)
    def act(self, a: Any) -> None:
        name = "".join("_" + c.lower() if c.isupper() else c for c in type(a).__name__)
        getattr(self, name.lstrip("_"))(*a)
        self.changed = True

    @rule()
    def nothing_happens(self) -> None:
        """A step without action. Hypothesis shrinks a failing run by turning steps into this
        simplest one and then deleting them: with `act` as the only rule it could not delete
        steps, and failures came out with dozens of irrelevant appends."""

    # -------------------------------------------------------------------------------------
    # producers

    def _append(self, pairs: list[tuple[bytes, bytes]], **entry: Any) -> Entry:
        entry_id = s(self.r.execute_command("XADD", self.k.stream, "*", *flat(pairs)))
        e = Entry(label=f"e{len(self.entries) + 1}", id=entry_id, fields=pairs, **entry)
        self.entries.append(e)
        self.by_id[entry_id] = e
        return e

    def append(self, session: str, msg_id: int | None, poison: bool, policy: str | None) -> None:
        self._append_message(session, None if msg_id is None else f"m{msg_id}", poison, policy)

    def append_burst(self, session: str, n: int) -> None:
        for _ in range(n):
            self._append_message(session, None, poison=False)

    def _append_message(
        self, session: str, msg_id: str | None, poison: bool, policy: str | None = None
    ) -> None:
        pairs = _fields(("session_id", session), ("text", "boom" if poison else "hi"))
        if msg_id is not None:
            pairs += _fields(("msg_id", msg_id))
        if msg_id in CHANNEL_OF:
            pairs += _fields((ECHO_FIELD, CHANNEL_OF[msg_id]))
        if msg_id == EXPIRED_MSG_ID:
            pairs += _fields(("expires_at", "1"))
        if policy is not None:
            pairs += _fields(("multitask", policy))
        e = self._append(pairs, sid=session, msg_id=msg_id, poison=poison, multitask=policy)
        note(f"{e.label} = append {session} msg_id={msg_id} {'boom' if poison else ''}"
             f"{f' multitask={policy}' if policy else ''}")  # fmt: skip

    def append_again(self, i: int) -> None:
        """A producer retrying a send: the same fields again, explicit msg_id included."""
        originals = [e for e in self.entries if e.msg_id and not e.refusal]
        if not originals:
            return
        o = originals[i % len(originals)]
        e = self._append(
            list(o.fields), sid=o.sid, msg_id=o.msg_id, poison=o.poison, multitask=o.multitask
        )
        note(f"{e.label} = append again {o.label} ({o.sid} msg_id={o.msg_id})")

    def append_malformed(self, shape: str, session: str) -> None:
        make, names = MALFORMED[shape]
        e = self._append(make(session), sid=session if names else None, msg_id=None)
        e.refusal = shape
        note(f"{e.label} = append malformed {shape} ({session})")

    # -------------------------------------------------------------------------------------
    # intake

    def intake(self, worker: int, batch: int, resend: bool) -> None:
        self._intake(self.workers[worker], batch, resend)

    def _intake(self, w: SimWorker, count: int, resend: bool) -> int:
        base = w.token_base()
        expected = self._predict_intake(w, count, base)
        reply = self.sc.call_intake(w.name, count, base)
        self._check_intake(reply, expected)
        jobs = expected[2]
        if resend:
            # The reply was lost: the same call again. With jobs, the script answers them again
            # (a receipt; held entries come by hand-off instead); without, it reads anew.
            again = self.sc.call_intake(w.name, count, base)
            if jobs:
                for job in jobs:
                    job.held = {}
                self._check_intake(again, ("0-0", 0, jobs, [], [0, 0, 0, 0, 0, 0, 0]))
            else:
                more = self._predict_intake(w, count, base)
                self._check_intake(again, more)
                jobs = more[2]
                expected = more
        w.jobs += jobs
        note(f"intake {w.name} count={count}{' (sent twice)' if resend else ''}: read "
             f"{expected[1]}, jobs {jobs}, held {[e for _, e in expected[3]]}")  # fmt: skip
        return int(expected[1])

    def _predict_intake(self, w: SimWorker, count: int, base: str) -> tuple[Any, ...]:
        todo = [e for e in self.unread()][:count]
        trimmed = self.trimmed_since if self.inbound_known else 0
        self.trimmed_counted += trimmed
        self.inbound_known, self.trimmed_since = True, 0
        ahead = self.ahead and not self.ahead_reported
        self.ahead_reported = self.ahead
        jobs: list[Job] = []
        held: list[tuple[Job, Entry]] = []
        taken: dict[str, Job] = {}
        dups = refused = contended = rejected = 0
        for e in todo:
            e.delivered = True
            if e.refusal:
                e.kind = "refused"
                refused += 1
                self._end(e, "dead_lettered")
                self.expect_letters.append((e.id, "malformed"))
                if e.sid is not None:
                    self.expect_events.append(
                        (e.id, e.sid, "dead_lettered", 0, e.id, FALLBACK, echoed(e.fields))
                    )
                continue
            assert e.sid is not None
            ss = self.sessions[e.sid]
            seen = ss.dedupe.get(e.msg_id) if e.msg_id else None
            if seen is not None and e.msg_id:
                orig, life = seen
                e.kind, e.seq = "duplicate", orig
                dups += 1
                copies = ss.waiting.get(orig, [])
                # A copy waits for its original's commit while that is outstanding (and still
                # in the stream, where the script checks it is the same message).
                if (
                    life == ss.life
                    and ss.applied < orig <= ss.last
                    and not ss.by_seq[orig].deleted
                    and len(",".join(c.id for c in copies)) < WAITING_COPIES_BYTES
                ):
                    ss.waiting.setdefault(orig, []).append(e)
                else:
                    reply = self._reply_of(ss, orig, e.msg_id) if life == ss.life else ""
                    self._end(e, "duplicate")
                    self.expect_events.append(
                        (e.id, e.sid, "duplicate", orig, e.msg_id, reply, echoed(e.fields))
                    )
                continue
            busy = ss.last > ss.applied
            if e.multitask == "reject" and busy:
                e.kind = "rejected"
                rejected += 1
                self._end(e, "rejected")
                self.expect_events.append(
                    (e.id, e.sid, "rejected", 0, e.msg_id or e.id, "", echoed(e.fields))
                )
                continue
            e.kind = "sequenced"
            ss.last += 1
            e.seq = ss.last
            ss.by_seq[e.seq] = e
            if busy and e.multitask == "coalesce":
                ss.xs = e.seq
            elif busy and e.multitask == "interrupt":
                ss.xc = e.seq
                running = ss.by_seq[ss.applied + 1]
                if e.sid in taken:
                    taken[e.sid].ending = "cancelled"  # handed out by this call: unstepped
                elif ss.lock is not None and not running.deleted:
                    self.marks.add((e.sid, self._msg_id_of(running)))
            if e.msg_id:
                ss.dedupe[e.msg_id] = (e.seq, ss.life)
            if e.seq == ss.applied + 1:
                ss.age = id_key(e.id)[0]
                if ss.lock is None:
                    ss.lock = f"{base}:{len(taken) + 1}"
                    ss.counted = True
                    ss.attempts += 1
                    ss.ready = "later"
                    job = self._job(ss, ss.lock, e)
                    job.ending = self._ending(ss, e.seq, self._msg_id_of(e))
                    taken[e.sid] = job
                    jobs.append(job)
                else:
                    contended += 1
                    ss.ready = "later"
            elif e.sid in taken:
                taken[e.sid].held[e.id] = flat(e.fields)
                held.append((taken[e.sid], e))
            else:
                contended += 1
                ss.ready = ss.ready or "later"
        if todo:
            self.last_delivered = todo[-1].id
        return (
            self.last_delivered,
            len(todo),
            jobs,
            held,
            [dups, refused, contended, trimmed, int(ahead), rejected, 0],
        )

    def _check_intake(self, reply: list[Any], expected: tuple[Any, ...]) -> None:
        last_id, read, rows, held_rows, counts = reply
        want_last, want_read, jobs, held, want_counts = expected
        assert (s(last_id), int(read)) == (want_last, want_read), (
            f"intake read {read} up to {s(last_id)}; the model expected {want_read} up to "
            f"{want_last} (stream order, nothing skipped)"
        )
        assert [int(c) for c in counts] == want_counts, (
            f"intake counts (duplicates, refused, contended, trimmed, ahead) {counts} != "
            f"{want_counts}"
        )
        got = [(s(r[0]), s(r[1]), int(r[2]), s(r[3])) for r in rows]
        want = [(j.sid, j.token, j.seq, j.entry_id) for j in jobs]
        assert got == want, f"intake jobs {got} != model {want}"
        for row, job in zip(rows, jobs, strict=True):
            self._check_row(job, row[4], row[5], row[6], row[7], row[9])
            assert s(row[10]) == job.ending, f"{job}: ending {row[10]!r} != {job.ending!r}"
        got_held = [(s(h[0]), int(h[1]), s(h[2])) for h in held_rows]
        want_held = [(e.sid, e.seq, e.id) for _, e in held]
        assert got_held == want_held, f"intake held {got_held} != model {want_held}"

    def _job(self, ss: Session, token: str, e: Entry, gap: bool = False) -> Job:
        return Job(
            sid=ss.sid,
            token=token,
            seq=e.seq,
            entry_id="" if gap else e.id,  # nothing is left of a lost message
            fields=[] if gap else flat(e.fields),
            doc=self._doc(ss),
            version=ss.version,
            attempts=ss.attempts,
            gap=gap,
        )

    def _doc(self, ss: Session) -> bytes:
        return json.dumps({"history": ss.history}).encode() if ss.version else b""

    def _check_row(
        self, job: Job, fields: list[bytes], doc: bytes, version: bytes, attempts: int, err: bytes
    ) -> None:
        """A job as the script handed it out: the entry, and the state the last commit left."""
        assert list(fields) == job.fields, f"{job}: fields {fields} != {job.fields}"
        assert (doc, int(version)) == (job.doc, job.version), (
            f"{job}: state read (version {s(version)}, doc {doc!r}) != model (version "
            f"{job.version}, doc {job.doc!r})"
        )
        ss = self.sessions[job.sid]
        assert (int(attempts), s(err)) == (job.attempts, ss.last_error), (
            f"{job}: attempts/error ({attempts}, {err!r}) != model ({job.attempts}, "
            f"{ss.last_error!r})"
        )

    # -------------------------------------------------------------------------------------
    # resume

    def resume(self, worker: int, resend: bool) -> None:
        self._resume(self.workers[worker], resend)

    def _resume(self, w: SimWorker, resend: bool) -> None:
        base = w.token_base()
        reply = self.sc.call_resume(base)
        jobs = self._apply_resume(reply, base)
        if resend:
            again = self.sc.call_resume(base)
            if jobs:
                got = [(s(r[0]), s(r[1]), s(r[2]), int(r[3])) for r in again[0]]
                want = [("g" if j.gap else "m", j.sid, j.token, j.seq) for j in jobs]
                assert sorted(got) == sorted(want), f"resume sent twice: {got} != {want}"
            else:
                jobs = self._apply_resume(again, base)
        w.jobs += jobs
        note(f"resume {w.name}{' (sent twice)' if resend else ''}: jobs {jobs}")

    def _apply_resume(self, reply: list[Any], base: str) -> list[Job]:
        """Resume takes every due session (LIMIT is 1000): the model says what each gives."""
        rows, wait = reply
        by_sid = {s(r[1]): r for r in rows}
        tokens = sorted(s(r[2]) for r in rows)
        assert tokens == sorted(f"{base}:{i}" for i in range(1, len(rows) + 1)), tokens
        jobs: list[Job] = []
        for ss in self.sessions.values():
            if ss.ready != "due":
                continue
            row = by_sid.pop(ss.sid, None)
            expect_job = False
            if ss.lock is not None:
                ss.ready = "later"
            elif not ss.outstanding:
                ss.ready = None
            else:
                e = ss.by_seq[ss.applied + 1]
                if e.deleted and not ss.gap_seen:
                    ss.gap_seen = True  # first sighting of the gap: wait for it
                else:
                    expect_job = True
            assert (row is not None) == expect_job, (
                f"resume of due session {ss.sid}: got {row}, the model expected "
                f"{'a job' if expect_job else 'none'} (lock {ss.lock}, a={ss.applied}, "
                f"s={ss.last})"
            )
            if row is None:
                continue
            e = ss.by_seq[ss.applied + 1]
            gap = e.deleted
            ss.lock = s(row[2])
            ss.counted = ss.counted or not gap
            ss.attempts += 1
            ss.ready = "later"
            job = self._job(ss, ss.lock, e, gap=gap)
            assert (s(row[0]), int(row[3]), s(row[4])) == (
                "g" if gap else "m",
                e.seq,
                job.entry_id,
            ), f"resume of {ss.sid}: row {row[:5]} != model {job} (gap={gap})"
            self._check_row(job, row[5], row[6], row[7], row[8], row[10])
            if not gap:
                job.ending = self._ending(ss, e.seq, self._msg_id_of(e))
            assert s(row[11]) == job.ending, f"{job}: ending {row[11]!r} != {job.ending!r}"
            jobs.append(job)
        assert not by_sid, f"resume took sessions that were not due: {sorted(by_sid)}"
        members = [ss for ss in self.sessions.values() if ss.ready]
        assert (int(wait) == -1) == (not members), f"resume wait {wait}, ready {members}"
        return jobs

    # -------------------------------------------------------------------------------------
    # step, release, commit

    def _held_jobs(self) -> list[tuple[SimWorker, Job]]:
        return [(w, j) for w in self.workers for j in w.jobs]

    def step(self, i: int, backoff: bool) -> None:
        todo = [(w, j) for w, j in self._held_jobs() if j.commit is None]
        if not todo:
            return
        w, job = todo[i % len(todo)]
        self._step(w, job, backoff)

    def _step(self, w: SimWorker, job: Job, backoff: bool) -> None:
        """The pipeline's decisions for one job; the engine appends a history turn."""
        if job.ending:
            self._stepped(w, job, job.ending, "")
        elif job.gap:
            self._stepped(w, job, "dead_lettered", "gap")
        elif field(job.fields, b"expires_at") is not None:
            self._stepped(w, job, "expired", "")  # its turn came after its expiry: no step
        elif (
            field(job.fields, b"msg_id") == BUDGET_MSG_ID.encode() and job.attempts <= MAX_ATTEMPTS
        ):
            self._stepped(w, job, "budget_exceeded", "")  # its tenant's tokens are spent
        elif self._spent(job) > MAX_ATTEMPTS:
            self._stepped(w, job, "dead_lettered", "exhausted")
        elif field(job.fields, b"text") == b"boom":
            if self._spent(job) >= MAX_ATTEMPTS:
                self._stepped(w, job, "dead_lettered", "exhausted")
            else:
                self._release(w, job, 60_000 if backoff else 0, Release.FAILED)
        else:
            self._stepped(w, job, "applied", "")

    def _spent(self, job: Job) -> int:
        """Its deliveries less those handed back for a limit key after streaming (the
        pipeline's _spent: the journal's r)."""
        return job.attempts - self.sessions[job.sid].unspent.get(job_msg_id(job), 0)

    def _stepped(self, w: SimWorker, job: Job, outcome: str, kind: str) -> None:
        msg_id = field(job.fields, b"msg_id") or job.entry_id.encode()
        reply = f"reply to {job.entry_id}" if outcome == "applied" else FALLBACK
        old = json.loads(job.doc) if job.doc else {"history": []}
        turn: dict[str, Any] = {
            "seq": job.seq, "msg_id": s(msg_id), "entry_id": job.entry_id, "bot": reply
        }  # fmt: skip
        extras: list[str] = []
        if outcome in UNAPPLIED:
            reply = turn["bot"] = ""
            turn[outcome] = True
        elif outcome == "applied":
            reply, extras = engine_answer(job.seq, reply)
            turn["bot"] = reply
        for name, value in echoed(_pairs(job.fields)):
            extras += [name, value]
        doc = json.dumps({"history": [*old["history"], turn]})
        letter = ""
        if outcome == "dead_lettered":
            letter = json.dumps(
                ["error", f"model {kind}", "error_kind", kind, "attempts", str(job.attempts),
                 "consumer", w.name, "worker_version", "model"]
            )  # fmt: skip
        known_next = next(iter(job.held), "")
        job.commit = [
            job.token, job.sid, job.seq, job.version, doc, msg_id, reply, outcome,
            job.entry_id, letter, known_next, json.dumps(extras) if extras else "",
        ]  # fmt: skip
        if outcome == "applied":  # its step's model usage (timers: none)
            job.commit += ["", json.dumps({"t": TENANT, "d": DAY, "i": job.seq, "o": 1, "m": 7,
                                           "n": 1})]  # fmt: skip
        note(f"step {w.name} {job} -> {outcome} {kind}")

    def hand_back(self, i: int, how: str) -> None:
        """Shutdown: a job goes back unfinished, its attempt not counted unless its step had
        streamed text. Rate limited (a provider's 429 paused its key, or its turn is later):
        back until the key opens, its attempt not counted, its session's order kept."""
        held = self._held_jobs()
        if how == "rate_limited_streamed":  # only a step that ran streams (not a gap, an ending)
            held = [(w, j) for w, j in held if not (j.gap or j.ending)]
        if not held:
            return
        w, job = held[i % len(held)]
        mode = {
            "streamed": Release.HAND_BACK_STREAMED,
            "rate_limited_streamed": Release.HAND_BACK_UNSPENT,
        }.get(how, Release.HAND_BACK)
        self._release(w, job, 60_000 if how.startswith("rate_limited") else 0, mode)

    def _release(self, w: SimWorker, job: Job, delay_ms: int, mode: Release) -> None:
        ss = self.sessions[job.sid]
        ours = ss.lock == job.token and ss.applied == job.seq - 1
        before = self._session_keys(ss.sid)
        failed = mode is Release.FAILED
        error = {
            Release.FAILED: "boom",
            Release.HAND_BACK_STREAMED: "handed back",
            Release.HAND_BACK_UNSPENT: "waited for k (paused)",
        }.get(mode, "")
        code = self.sc.call_release(job, delay_ms, error, mode)
        w.jobs.remove(job)
        note(f"release {w.name} {job} delay={delay_ms} mode={mode.name} -> {Code(code).name}")
        if not ours:
            assert code == Code.FENCED_TOKEN, f"release of {job} without the lock: {code}"
            assert self._session_keys(ss.sid) == before, f"a fenced release of {job} wrote"
            return
        assert code == Code.RELEASED, f"release of {job} holding the lock: {code}"
        if failed:
            ss.failed, ss.last_error = True, "boom"
        elif mode is Release.HAND_BACK:
            ss.attempts -= 1
        else:
            ss.last_error = error  # why the attempt's number stays taken
        if mode is Release.HAND_BACK_UNSPENT:
            ss.unspent[job_msg_id(job)] = ss.unspent.get(job_msg_id(job), 0) + 1
        ss.lock = None
        ss.counted = False
        ss.ready = "due" if delay_ms == 0 else "later"

    def commit(self, worker: int, mask: int, resend: bool) -> None:
        """Group commit: the stepped jobs the mask picks (all if it picks none)."""
        ready = [w for w in self.workers if any(j.commit is not None for j in w.jobs)]
        if not ready:
            return
        w = ready[worker % len(ready)]
        stepped = [j for j in w.jobs if j.commit is not None]
        batch = [j for n, j in enumerate(stepped) if mask >> n & 1] or stepped
        self._commit(w, batch, resend)

    def _commit(self, w: SimWorker, batch: list[Job], resend: bool) -> None:
        before = {sid: self._session_keys(sid) for sid in {j.sid for j in batch}}
        expected = [self._predict_commit(job) for job in batch]
        results = self.sc.call_commit([j.commit for j in batch if j.commit])
        if resend:
            # The reply was lost; the same call again must answer the same and write nothing.
            again = self.sc.call_commit([j.commit for j in batch if j.commit])
            assert again == results, f"commit sent twice answered {again}, first {results}"
        note(f"commit {w.name} {batch}{' (sent twice)' if resend else ''} -> "
             f"{[Code(int(r[0])).name for r in results]}")  # fmt: skip
        for job, want, got in zip(batch, expected, results, strict=True):
            w.jobs.remove(job)
            code = int(got[0])
            assert code == want[0], (
                f"commit of {job}: {Code(code).name}, the model expected {Code(want[0]).name} "
                f"(lock {self.sessions[job.sid].lock!r} before the call)"
            )
            if code == Code.CANCELLED:
                # Cancelled while it ran: the worker commits it as cancelled instead.
                job.commit, job.ending = None, "cancelled"
                w.jobs.append(job)
                continue
            if code < 0:
                continue
            assert int(got[1]) == want[1], f"commit of {job}: version {got[1]} != {want[1]}"
            assert job.commit is not None
            msg_id, outcome = s(job.commit[5]), s(job.commit[7])
            if outcome in UNAPPLIED and msg_id:
                # It ended without being applied: its msg_id is free exactly when the model
                # says so (a re-send is then a new message).
                ss = self.sessions[job.sid]
                kept = self.r.exists(self.k.session(job.sid).dedupe(msg_id)) == 1
                assert kept == (msg_id in ss.dedupe), f"{outcome} {job}: dedupe key kept={kept}"
            if code == Code.HANDOFF:
                _, version, next_seq, next_id, next_fields, ending = want
                assert (int(got[2]), s(got[3]), list(got[4]), s(got[5])) == (
                    next_seq, next_id, next_fields, ending
                ), f"hand-off after {job}: {got[2:]} != {want[2:]}"  # fmt: skip
                assert job.commit is not None
                fields = job.held.pop(next_id, None) or list(got[4])
                doc = job.commit[4].encode()
                w.jobs.append(Job(job.sid, job.token, next_seq, next_id, fields, doc, version,
                                  attempts=1, held=job.held, ending=ending))  # fmt: skip
        for sid, keys in before.items():
            if all(int(r[0]) < 0 for j, r in zip(batch, results, strict=True) if j.sid == sid):
                assert self._session_keys(sid) == keys, f"a fenced commit changed {sid}"

    def _predict_commit(self, job: Job) -> tuple[Any, ...]:
        """The answer the commit must give, and its effects on the model (in batch order)."""
        assert job.commit is not None
        ss = self.sessions[job.sid]
        nxt = ss.by_seq.get(job.seq + 1) if ss.last > job.seq else None
        if ss.done == f"{job.token}:{job.seq}" and ss.version == job.version + 1:
            if ss.lock == job.token and nxt is not None:  # the same commit again
                return self._handoff_answer(ss, job, nxt)
            return (Code.COMMITTED, ss.version)
        if ss.lock != job.token:
            return (Code.FENCED_TOKEN,)
        if ss.version != job.version or ss.applied != job.seq - 1:
            return (Code.FENCED_VERSION,)
        e = ss.by_seq[job.seq]
        assert job.entry_id in (e.id, ""), f"{job} commits {job.entry_id}, seq {job.seq} is {e}"
        _, _, _, _, doc, msg_id, reply, outcome, _, letter, _, extras_json = job.commit[:12]
        extras = json.loads(extras_json) if extras_json else []
        event_extras = tuple(sorted(zip(extras[::2], extras[1::2], strict=True)))
        if (
            outcome in ("applied", "dead_lettered")
            and not e.deleted
            and msg_id
            and (ss.xc > job.seq or (ss.sid, s(msg_id)) in self.marks)
        ):
            return (Code.CANCELLED,)  # nothing written
        if msg_id:
            ss.unspent.pop(s(msg_id), None)  # the commit deletes the message's journal
        if msg_id and (outcome in UNAPPLIED or (e.deleted and letter)):
            # Ended without being applied: its msg_id is free (and its cancel mark gone).
            if ss.dedupe.get(s(msg_id)) == (job.seq, ss.life):
                del ss.dedupe[s(msg_id)]
            self.marks.discard((ss.sid, s(msg_id)))
        self._end(e, outcome)
        if len(job.commit) > 13 and job.commit[13]:
            usage = json.loads(job.commit[13])
            for name, got in (("in", "i"), ("out", "o"), ("cost", "m"), ("calls", "n")):
                self.usage[name] += usage[got]
        e.anonymous = not job.entry_id
        self.expect_events.append(
            (job.entry_id, ss.sid, outcome, e.seq, s(msg_id), reply, event_extras)
        )
        if letter:
            self.expect_letters.append((job.entry_id, json.loads(letter)[3]))
        for copy in ss.waiting.pop(job.seq, []):
            self._end(copy, "duplicate")
            # Answered by its original's commit: with the original's reply and extras.
            self.expect_events.append(
                (copy.id, ss.sid, "duplicate", e.seq, s(msg_id), reply, event_extras)
            )
        ss.applied, ss.version = job.seq, ss.version + 1
        ss.history = json.loads(doc)["history"]
        ss.done = f"{job.token}:{job.seq}"
        ss.gap_seen = ss.failed = False
        ss.last_error = ""
        if nxt is not None and not nxt.deleted:  # handed on from the session's keys
            ss.age = id_key(nxt.id)[0]
            ss.attempts = 1
            ss.ready = "later"
            return self._handoff_answer(ss, job, nxt)
        ss.attempts = 0
        ss.lock = None
        ss.counted = False
        ss.ready = "due" if ss.outstanding else None
        if not ss.outstanding:
            ss.age = None  # (with the next one missing, it keeps this one's age)
            ss.xc = ss.xs = 0
        return (Code.COMMITTED, ss.version)

    def _handoff_answer(self, ss: Session, job: Job, nxt: Entry) -> tuple[Any, ...]:
        assert job.commit is not None
        known = job.commit[10] == nxt.id
        fields = [] if known else flat(nxt.fields)
        ending = self._ending(ss, nxt.seq, self._msg_id_of(nxt))
        return (Code.HANDOFF, ss.version, nxt.seq, nxt.id, fields, ending)

    # -------------------------------------------------------------------------------------
    # cancel

    @staticmethod
    def _msg_id_of(e: Entry) -> str:
        return e.msg_id or e.id

    def _ending(self, ss: Session, seq: int, msg_id: str) -> str:
        """How a message handed out now ends without a step ('' : it is stepped)."""
        if ss.xc > seq or (ss.sid, msg_id) in self.marks:
            return "cancelled"
        return "superseded" if ss.xs > seq else ""

    def cancel(self, session: str, i: int) -> None:
        """DialogClient.cancel of one of the session's msg_ids (explicit or entry ids), or
        of one never sent."""
        ss = self.sessions[session]
        # In append order: entry ids come from the clock, so sorting them as text would pick
        # a different message for the same drawn index from one run to the next.
        known = list(dict.fromkeys(self._msg_id_of(e) for e in self.entries if e.sid == session))
        choices = [*known, "m9"]
        msg_id = choices[i % len(choices)]
        want = self._predict_cancel(ss, msg_id)
        got = self.sc.call_cancel(session, msg_id)
        note(f"cancel {session} {msg_id} -> {got}")
        assert got == want, f"cancel {session} {msg_id}: {got} != model {want}"

    def _predict_cancel(self, ss: Session, msg_id: str) -> tuple[str, int, str]:
        seen = ss.dedupe.get(msg_id)
        seq = seen[0] if seen else None
        if seq is not None and seq > ss.applied:
            e = ss.by_seq.get(seq) if seq <= ss.last else None
            if e is not None and not e.deleted and self._msg_id_of(e) == msg_id:
                self.marks.add((ss.sid, msg_id))
                return ("cancelled", seq, "")
        if (ss.sid, msg_id) in self.marks:
            return ("pending", 0, "")
        for turn in reversed(ss.history if ss.version else []):
            if turn["msg_id"] == msg_id:
                flags = [o for o in UNAPPLIED if turn.get(o)]
                return ("finished", turn["seq"], flags[0] if flags else "")
        if seq is not None and seq <= ss.applied:
            return ("finished", seq, "")
        self.marks.add((ss.sid, msg_id))
        return ("pending", 0, "")

    # -------------------------------------------------------------------------------------
    # leases, crashes, time

    def renew(self, worker: int) -> None:
        """The heartbeat of a worker with jobs (the worker-th of those)."""
        busy = [w for w in self.workers if w.jobs]
        if not busy:
            return
        w = busy[worker % len(busy)]
        results = self.sc.call_renew(w.jobs)
        for job, ok in zip(list(w.jobs), results, strict=True):
            ss = self.sessions[job.sid]
            assert ok == (ss.lock == job.token), f"renew of {job}: {ok}, lock {ss.lock}"
            if ok:
                ss.ready = "later"
            else:
                w.jobs.remove(job)  # the pipeline gives the result up
        note(f"renew {w.name}: {results}")

    def crash(self, worker: int) -> None:
        """kill -9 of a worker with jobs (the worker-th of those)."""
        busy = [w for w in self.workers if w.jobs]
        if not busy:
            return
        w = busy[worker % len(busy)]
        note(f"crash {w.name}: {w.jobs} forgotten")
        w.crash()

    def time_passes(self, session: str, lease_ends: bool) -> None:
        """The clock passes this session's look-again time and (usually) its lease end."""
        self._time_passes(self.sessions[session], lease_ends)

    def _time_passes(self, ss: Session, lease_ends: bool = True) -> None:
        if ss.lock is not None and lease_ends:
            self.r.delete(self.k.session(ss.sid).lock)
            ss.lock = None
        if ss.ready is not None:
            self.r.zadd(self.k.ready, {ss.sid: 0}, xx=True)
            ss.ready = "due"
        note(f"time passes for {ss.sid}{'' if lease_ends else ' (its lease holds)'}")

    def expire(self, what: str, i: int) -> None:
        """Something ends outside the scripts: an idle session's state reaches its TTL (its
        dedupe keys with it, or later when the dedupe window is the longer), a msg_id leaves
        the dedupe window, or an outstanding message is deleted by hand from its session's
        keys (custody: nothing else can remove it)."""
        if what.startswith("state"):
            idle = [ss for ss in self.sessions.values() if ss.last and not ss.outstanding]
            if idle:
                self._state_expires(idle[i % len(idle)], keep_dedupe=what != "state")
        elif what == "dedupe":
            ids = [(ss, m) for ss in self.sessions.values() for m in ss.dedupe]
            if ids:
                ss, msg_id = ids[i % len(ids)]
                self.r.delete(self.k.session(ss.sid).dedupe(msg_id))
                del ss.dedupe[msg_id]
                note(f"dedupe window of {ss.sid} {msg_id} ends: the same msg_id is new again")
        else:
            outstanding = [
                e
                for ss in self.sessions.values()
                for seq, e in ss.by_seq.items()
                if seq > ss.applied and not e.deleted
            ]
            if outstanding:
                e = outstanding[i % len(outstanding)]
                assert e.sid is not None
                self.r.hdel(self.k.session(e.sid).state, f"q{e.seq}")
                e.deleted = True  # a gap, whatever a worker already holds
                note(f"HDEL q{e.seq} of {e} by hand")

    # -------------------------------------------------------------------------------------
    # hostile producers: commands on the inbound stream that no ACL can forbid

    def unread(self) -> list[Entry]:
        return [e for e in self.entries if not e.delivered and not e.trimmed]

    def _trim(self, gone: list[Entry], what: str) -> None:
        for e in gone:
            e.trimmed = True
            self.trimmed_since += 1
        note(f"{what}: unread {gone} removed")

    def hostile(self, what: str, i: int) -> None:
        stream = self.k.stream
        if what == "xdel":
            # Any entry ever appended: a sequenced one is not in the stream any more.
            if not self.entries:
                return
            e = self.entries[i % len(self.entries)]
            deleted = self.r.xdel(stream, e.id)
            was_unread = not e.delivered and not e.trimmed
            assert deleted == int(was_unread), f"XDEL {e}: {deleted} (unread: {was_unread})"
            self._trim([e] if was_unread else [], f"XDEL {e}")
        elif what == "maxlen":
            keep = i % 3
            unread = self.unread()
            self.r.xtrim(stream, maxlen=keep, approximate=False)
            self._trim(unread[: max(0, len(unread) - keep)], f"XTRIM MAXLEN = {keep}")
        elif what == "minid":
            if not self.entries:
                return
            pivot = self.entries[i % len(self.entries)].id
            self.r.xtrim(stream, minid=pivot, approximate=False)
            self._trim([e for e in self.unread() if id_key(e.id) < id_key(pivot)],
                       f"XTRIM MINID = {pivot}")  # fmt: skip
        elif what == "xadd_maxlen":
            pairs = _fields(("session_id", SESSIONS[i % len(SESSIONS)]), ("text", "hi"))
            unread = self.unread()
            entry_id = s(self.r.xadd(stream, dict(pairs), maxlen=1, approximate=False))
            e = Entry(label=f"e{len(self.entries) + 1}", id=entry_id, fields=pairs,
                      sid=SESSIONS[i % len(SESSIONS)], msg_id=None)  # fmt: skip
            self.entries.append(e)
            self.by_id[entry_id] = e
            self._trim(unread, f"{e.label} = XADD MAXLEN = 1")
        elif not self.ahead:
            # An explicit id ten days ahead: later XADD * ids carry the same time part.
            now_s, _ = self.r.time()
            entry_id = f"{(int(now_s) + 864_000) * 1000}-0"
            pairs = _fields(("session_id", SESSIONS[i % len(SESSIONS)]), ("text", "hi"))
            self.r.execute_command("XADD", stream, entry_id, *flat(pairs))
            e = Entry(label=f"e{len(self.entries) + 1}", id=entry_id, fields=pairs,
                      sid=SESSIONS[i % len(SESSIONS)], msg_id=None)  # fmt: skip
            self.entries.append(e)
            self.by_id[entry_id] = e
            self.ahead = True
            note(f"{e.label} = XADD with the explicit id {entry_id}")

    def _state_expires(self, ss: Session, keep_dedupe: bool) -> None:
        """With a dedupe window no longer than the state TTL, the dedupe keys go too (none is
        younger than the state's idle TTL); with a longer one they stay."""
        sk = self.k.session(ss.sid)
        assert self.r.pttl(sk.state) > 0, f"idle {ss.sid} has no state TTL"
        self.r.delete(sk.state)
        if ss.dedupe and not keep_dedupe:
            self.r.delete(*(sk.dedupe(m) for m in ss.dedupe))
        note(f"state of {ss.sid} expires (life {ss.life} ends), dedupe keys "
             f"{'stay' if keep_dedupe else 'too'}")  # fmt: skip
        self.sessions[ss.sid] = Session(
            ss.sid, life=ss.life + 1, dedupe=ss.dedupe if keep_dedupe else {}, ready=ss.ready
        )

    # -------------------------------------------------------------------------------------
    # model bookkeeping

    def _end(self, e: Entry, outcome: str) -> None:
        assert not e.ended, f"{e} ends twice: {e.ended}, then {outcome}"
        e.ended = outcome

    def _reply_of(self, ss: Session, seq: int, msg_id: str) -> str:
        """The original's reply for a duplicate, while the history has it."""
        if seq > ss.applied:
            return ""
        turns = (t for t in ss.history if (t["seq"], t["msg_id"]) == (seq, msg_id))
        return next((t["bot"] for t in turns), "")

    def _session_keys(self, sid: str) -> tuple[Any, ...]:
        sk = self.k.session(sid)
        p = self.r.pipeline(transaction=False)
        p.hgetall(sk.state).get(sk.lock).zscore(self.k.ready, sid)
        return tuple(p.execute())

    # -------------------------------------------------------------------------------------
    # invariants

    @invariant()
    def redis_matches_the_model(self) -> None:
        if not self.changed:
            return
        self.changed = False
        k = self.k
        p = self.r.pipeline(transaction=False)
        p.xrange(k.replies, min=self.replies_seen)
        p.xrange(k.dlq, min=self.letters_seen)
        p.xrange(k.stream)
        p.xpending(k.stream, k.group)
        p.zrange(k.ready, 0, -1, withscores=True)
        p.zrange(k.ages, 0, -1, withscores=True)
        p.time()
        for sid in SESSIONS:
            sk = k.session(sid)
            p.get(sk.lock).hgetall(sk.state).pttl(sk.state)
        events, letters, stream, pending, ready, ages, now, *per_session = p.execute()

        # Every event and dead letter written is one the model expected, each exactly once.
        got = [
            (s(f[b"entry_id"]), s(f[b"session_id"]), s(f[b"outcome"]), int(f[b"seq"]),
             s(f[b"msg_id"]), s(f[b"reply"]),
             tuple(sorted((s(n), s(v)) for n, v in f.items() if n not in EVENT_FIELDS)))
            for _, f in events
        ]  # fmt: skip
        assert Counter(got) == Counter(self.expect_events), (
            f"reply events {sorted(got)} != expected {sorted(self.expect_events)}"
        )
        got_letters = [(s(f[b"source_entry_id"]), s(f[b"error_kind"])) for _, f in letters]
        assert Counter(got_letters) == Counter(self.expect_letters), (
            f"dead letters {got_letters} != expected {self.expect_letters}"
        )
        for _, f in letters:  # the original fields, byte for byte
            if not f[b"source_entry_id"]:
                continue  # a gap: nothing is left of the message
            e = self.by_id[s(f[b"source_entry_id"])]
            if not e.deleted and not e.refusal.endswith(("twice", "sessions")):
                assert all(f.get(n) == v for n, v in e.fields), f"letter of {e}: {f}"
        if events:
            self.replies_seen = f"({s(events[-1][0])}"
        if letters:
            self.letters_seen = f"({s(letters[-1][0])}"
        self.expect_events, self.expect_letters = [], []

        # Custody: the stream holds only unread entries (those no command removed); nothing
        # pending.
        in_stream = [s(i) for i, _ in stream]
        want = [e.id for e in self.unread()]
        assert in_stream == want, f"stream {in_stream} != model {want}"
        assert pending["pending"] == 0, f"entries left pending: {pending}"

        # The ages: every session with work outstanding, at its next message's append time.
        got_ages = {s(m): int(score) for m, score in ages}
        want_ages = {ss.sid: ss.age for ss in self.sessions.values() if ss.age is not None}
        assert got_ages == want_ages, f"ages {got_ages} != model {want_ages}"
        for ss in self.sessions.values():
            assert (ss.age is not None) == ss.outstanding, f"{ss.sid}: age {ss.age}"

        # Usage: the tenant's counters are exactly the usage of the commits written.
        counters = {s(n): int(v) for n, v in self.r.hgetall(k.usage(DAY)).items()}
        want_usage = (
            {f"{TENANT}:{n}": v for n, v in self.usage.items()} if self.usage["calls"] else {}
        )
        assert counters == want_usage, f"usage counters {counters} != model {want_usage}"

        # Journals: the hand-backs after streaming that spent no attempt, per message, until
        # its commit deletes them.
        got_unspent = {
            s(key): int(self.r.hget(key, "r") or 0)
            for key in self.r.scan_iter(match=f"{k.prefix}:*:journal:*")
        }
        want_unspent = {
            k.session(ss.sid).journal(m): n
            for ss in self.sessions.values()
            for m, n in ss.unspent.items()
        }
        assert got_unspent == want_unspent, f"journals {got_unspent} != model {want_unspent}"

        # Cancel marks: exactly those the model says (kept until their message ends).
        got_marks = {s(key) for key in self.r.scan_iter(match=f"{k.prefix}:*:cancel:*")}
        want_marks = {k.session(sid).cancel_mark(m) for sid, m in self.marks}
        assert got_marks == want_marks, f"cancel marks {got_marks} != model {want_marks}"

        now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
        scores = {s(m): score for m, score in ready}
        for i, sid in enumerate(SESSIONS):
            ss = self.sessions[sid]
            lock, state, pttl = per_session[3 * i : 3 * i + 3]
            self._check_session(ss, lock, state, pttl, scores.get(sid), now_ms)

    def _check_session(
        self,
        ss: Session,
        lock: bytes | None,
        state: dict[bytes, bytes],
        pttl: int,
        score: float | None,
        now_ms: int,
    ) -> None:
        sid = ss.sid
        assert (s(lock) if lock else None) == ss.lock, f"{sid}: lock {lock!r} != {ss.lock!r}"
        if ss.lock is not None:
            assert ss.outstanding, f"{sid}: a lock with nothing outstanding"
        # Nothing wedges: outstanding work always has a place in the ready set.
        if ss.outstanding:
            assert ss.ready is not None, f"{sid}: outstanding but not in the ready set (model)"
        assert (score is not None) == (ss.ready is not None), (
            f"{sid}: ready-set score {score}, model {ss.ready}"
        )
        if score is not None:
            assert (score <= now_ms) == (ss.ready == "due"), (
                f"{sid}: ready score {score} vs now {now_ms}, model {ss.ready}"
            )
        if not ss.last:
            assert not state, f"{sid}: state {state} for a session the model has not sequenced"
            return
        # Custody: each outstanding message, byte for byte, in the session's state.
        stored = {s(n): v for n, v in state.items() if n[:1] == b"q"}
        for seq in range(ss.applied + 1, ss.last + 1):
            e = ss.by_seq[seq]
            got_message = unpack_custody(stored.pop(f"q{seq}")) if not e.deleted else None
            want_message = None if e.deleted else (e.id, dict(e.fields))
            assert got_message == want_message, f"{sid}: q{seq} {got_message} != {want_message}"
        assert not stored, f"{sid}: messages kept that are not outstanding: {sorted(stored)}"
        h = {s(n): s(v) for n, v in state.items() if n[:1] != b"q"}
        want = {"s": str(ss.last)}
        if ss.version:
            want["a"] = str(ss.applied)
            want |= {"v": str(ss.version), "c": ss.done}
        for seq, copies in ss.waiting.items():
            want[f"u{seq}"] = ",".join(c.id for c in copies)
        if ss.last_error:
            want["e"] = ss.last_error
        if ss.xc:
            want["xc"] = str(ss.xc)
        if ss.xs:
            want["xs"] = str(ss.xs)
        if ss.counted:
            want["T"] = "default"
        # tc: whether the session has timers a user message cancels (none here: no timers);
        # ie: when its msg_id index expires (what intake last set it to)
        got = {n: v for n, v in h.items() if n not in ("d", "n", "f", "g", "tc", "ie")}
        if got.get("a") == "0" and not ss.version:
            del got["a"]
        assert got == want, f"{sid}: state {got} != model {want}"
        assert int(h.get("n", 0)) == ss.attempts, f"{sid}: attempts {h.get('n')} != {ss.attempts}"
        assert ("f" in h) == ss.failed and ("g" in h) == ss.gap_seen, f"{sid}: f/g in {h}"
        doc = json.loads(h["d"]) if "d" in h else None
        assert doc == ({"history": ss.history} if ss.version else None), (
            f"{sid}: state document {doc} != model history {ss.history}"
        )
        # Guarantee 5: never expires while anything is outstanding; expires once idle.
        if ss.outstanding:
            assert pttl == -1, f"{sid}: outstanding messages but the state has a TTL ({pttl} ms)"
        else:
            assert pttl > 0, f"{sid}: idle, yet its state never expires ({pttl})"

    # -------------------------------------------------------------------------------------
    # the end: drain, then check everything from Redis

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # a step failed (or Hypothesis stopped the run): that is the report
        self._drain()
        self._check_the_end()

    def _drain(self) -> None:
        for w in self.workers:
            w.crash()
        w = self.workers[0]
        for _ in range(DRAIN_ROUNDS):
            for ss in self.sessions.values():
                self._time_passes(ss)
            while self._intake(w, 1000, resend=False):
                pass
            self._resume(w, resend=False)
            while w.jobs:
                job = w.jobs[0]
                if job.commit is None:
                    self._step(w, job, backoff=False)
                else:
                    self._commit(w, [job], resend=False)
            self.changed = True
            self.redis_matches_the_model()
            if all(e.ended or e.trimmed for e in self.entries) and not any(
                ss.ready or ss.lock for ss in self.sessions.values()
            ):
                return
        raise AssertionError(
            f"not drained after {DRAIN_ROUNDS} rounds: unfinished "
            f"{[e for e in self.entries if not e.ended and not e.trimmed]}, sessions "
            f"{self.sessions}"
        )

    def _check_the_end(self) -> None:
        """From Redis alone: each entry ended exactly once; per-session order = append order."""
        k = self.k
        events = [f for _, f in self.r.xrange(k.replies)]
        letters = [f for _, f in self.r.xrange(k.dlq)]
        by_entry = Counter(s(f[b"entry_id"]) for f in events)
        lettered = Counter(s(f[b"source_entry_id"]) for f in letters)
        for e in self.entries:
            if e.anonymous:  # a gap: its event and letter name no entry
                by_entry[""] -= 1
                lettered[""] -= 1
                assert e.ended == "dead_lettered", f"{e} lost but ended {e.ended!r}"
                continue
            n_events, n_letters = by_entry.pop(e.id, 0), lettered.pop(e.id, 0)
            if e.trimmed:
                ok = (n_events, n_letters) == (0, 0)
                assert ok, f"{e} was trimmed unread, yet has {n_events} events"
                continue
            if e.ended == "dead_lettered":
                ok = n_letters == 1 and n_events == (1 if e.sid else 0)
            else:
                ok = n_letters == 0 and n_events == 1
            assert ok, f"{e} ({e.ended}): {n_events} events, {n_letters} dead letters"
        by_entry, lettered = +by_entry, +lettered  # drop the zero counts
        assert not by_entry and not lettered, f"endings of unknown entries {by_entry} {lettered}"
        # Every unread entry removed after the first intake call was counted, and no other.
        counted = int(self.r.hget(f"{k.ready}:inbound", "trimmed") or 0)
        assert counted == self.trimmed_counted, (
            f"{counted} trimmed entries counted, the model says {self.trimmed_counted}"
        )
        for sid in SESSIONS:
            in_turn = [
                s(f[b"entry_id"])
                for f in events
                if f[b"session_id"] == sid.encode()
                and f[b"outcome"]
                in (
                    b"applied",
                    b"dead_lettered",
                    b"cancelled",
                    b"superseded",
                    b"expired",
                    b"budget_exceeded",
                )
                and f[b"seq"] != b"0"
                and f[b"entry_id"]  # a gap names no entry
            ]
            assert in_turn == sorted(in_turn, key=id_key), f"{sid}: finished out of order"
            doc = self.r.hget(k.session(sid).state, "d")
            turns = json.loads(doc)["history"] if doc else []
            applied = [t["entry_id"] for t in turns if t["entry_id"]]
            assert applied == sorted(set(applied), key=id_key), f"{sid}: history {applied}"
        assert self.r.xlen(k.stream) == 0, "entries left in the stream"
        assert self.r.zcard(k.ready) == 0, "sessions left in the ready set"
        assert not list(self.r.scan_iter(match=f"{k.prefix}:*:lock")), "locks left"


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    server = RedisServer(Path(tmp_path_factory.mktemp("model-redis"))).start()
    r = redis.Redis.from_url(server.url)
    yield r
    r.close()
    server.stop()


def test_every_script_interleaving_keeps_the_contract(model_redis: redis.Redis) -> None:
    scripts = Scripts(model_redis, Keys.from_settings(Settings()))
    run_state_machine_as_test(lambda: DialogScripts(model_redis, scripts), settings=SETTINGS)
