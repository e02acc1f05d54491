"""The concurrency verification: send bursts, wait until they are applied, and check that
every message was applied exactly once, in order, with exactly one reply.

Used by `dialog-worker verify` against live workers and by the test suite."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

import anyio

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.store.stream_entries import scan_all, xrevrange


@dataclasses.dataclass
class Sent:
    session_id: str
    seq: int  # its place in the session's order: the seq the workers give it (fresh sessions)
    msg_id: str
    text: str


@dataclasses.dataclass
class Report:
    sessions: int
    messages: int
    seconds: float
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "sessions": self.sessions,
            "messages": self.messages,
            "seconds": round(self.seconds, 3),
            "messages_per_s": round(self.messages / self.seconds, 1) if self.seconds else None,
            "problems": self.problems[:50],
            "problem_count": len(self.problems),
        }


async def send_bursts(
    client: DialogClient, sessions: list[str], texts: list[str], senders: int = 200
) -> list[Sent]:
    """Send every text to every session; a session's texts go out back to back in order,
    sessions in parallel (up to `senders` coroutines at once)."""
    sent: list[Sent] = []
    limiter = anyio.Semaphore(senders)

    async def burst(session_id: str) -> None:
        async with limiter:
            for position, text in enumerate(texts, start=1):
                r = await client.send(session_id, text)
                sent.append(Sent(session_id, position, r.msg_id, text))

    async with anyio.create_task_group() as tg:
        for sid in sessions:
            tg.start_soon(burst, sid)
    return sent


async def wait_applied(
    client: DialogClient, sent: list[Sent], timeout_s: float, poll_s: float = 0.05
) -> bool:
    """Poll until every session's applied_seq reaches its last sent seq, or the deadline."""
    last: dict[str, int] = {}
    for s in sent:
        last[s.session_id] = max(last.get(s.session_id, 0), s.seq)
    deadline = time.monotonic() + timeout_s
    waiting = dict(last)
    while waiting and time.monotonic() < deadline:
        keys = [client.keys_for(sid).session(sid).state for sid in waiting]
        async with client.redis.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.hget(k, "a")
            applied = await pipe.execute()
        for (sid, want), got in zip(list(waiting.items()), applied, strict=True):
            if got is not None and int(got) >= want:
                del waiting[sid]
        if waiting:
            await anyio.sleep(poll_s)
    return not waiting


async def reply_marks(client: DialogClient) -> dict[int, str]:
    """The last entry ID of each shard's reply stream, to check only replies that come after."""
    marks = {}
    for keys in client.topology.shards:
        last = await xrevrange(client.redis, keys.replies, count=1)
        marks[keys.shard] = last[0][0] if last else "0-0"
    return marks


async def check(
    client: DialogClient, sent: list[Sent], replies_after: str | Mapping[int, str] = "0-0"
) -> list[str]:
    """Exactly once, in order, one reply each (`duplicate` events, which answer a re-sent
    entry with the same msg_id, are not counted as replies but must carry the original seq).
    Order is checked twice: in the state's history (its last DIALOG_HISTORY_LIMIT turns) and
    in the order of the sessions' reply events (every message: events are written by the
    commits, so a session's events follow its apply order).
    `replies_after`: the reply stream ID before sending (one for all shards, or per shard as
    `reply_marks` returns)."""
    problems: list[str] = []
    by_session: dict[str, list[Sent]] = defaultdict(list)
    for s in sent:
        by_session[s.session_id].append(s)
    for sid, msgs in by_session.items():
        msgs.sort(key=lambda m: m.seq)
        state = await client.state(sid)
        if state is None:
            problems.append(f"{sid}: no state")
            continue
        if state["applied_seq"] != msgs[-1].seq:
            problems.append(f"{sid}: applied_seq {state['applied_seq']} != {msgs[-1].seq}")
        turns = state["history"]
        ours = {m.msg_id for m in msgs}
        seen = [t for t in turns if t["msg_id"] in ours]
        expected = [m.msg_id for m in msgs][-len(turns) :] if turns else []
        if len(msgs) <= client.settings.history_limit:
            expected = [m.msg_id for m in msgs]
        got = [t["msg_id"] for t in seen]
        if got != expected:
            dup = [k for k, n in Counter(got).items() if n > 1]
            kind = "applied twice" if dup else "out of order or missing"
            problems.append(f"{sid}: history {kind}: got {got[:12]} expected {expected[:12]}")
        seqs = [t["seq"] for t in turns]
        if seqs != sorted(seqs):
            problems.append(f"{sid}: history seqs not increasing: {seqs[:12]}")
    counts: Counter[tuple[str, str]] = Counter()
    wanted = {(s.session_id, s.msg_id): str(s.seq) for s in sent}
    applied_seqs: dict[str, list[int]] = defaultdict(list)
    for keys in client.topology.shards:
        after = replies_after if isinstance(replies_after, str) else replies_after[keys.shard]
        for _, f in await scan_all(client.redis, keys.replies, start=f"({after}"):
            key = (f.get("session_id", ""), f.get("msg_id", ""))
            if key in wanted and f.get("outcome") == "duplicate":
                # The answer to a re-sent entry (a producer's retry with the same msg_id), not
                # a second reply to the message: it must name the original seq.
                if f.get("seq") != wanted[key]:
                    problems.append(
                        f"{key}: duplicate event with seq {f.get('seq')}, expected {wanted[key]}"
                    )
            elif key in wanted:
                counts[key] += 1
                if f.get("outcome") == "applied" and f.get("seq", "").isdigit():
                    applied_seqs[key[0]].append(int(f["seq"]))
                if f.get("outcome") != "applied" or f.get("seq") != wanted[key]:
                    problems.append(
                        f"{key}: reply outcome {f.get('outcome')} seq {f.get('seq')}, "
                        f"expected applied seq {wanted[key]}"
                    )
    for sid in applied_seqs:
        if applied_seqs[sid] != sorted(applied_seqs[sid]):
            problems.append(f"{sid}: applied out of order (reply events): {applied_seqs[sid][:12]}")
    missing = [k for k in wanted if counts[k] == 0]
    extra = [k for k, n in counts.items() if n > 1]
    if missing:
        problems.append(f"{len(missing)} messages without a reply, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} messages with more than one reply, e.g. {extra[:3]}")
    return problems


SEED_TEXTS = ["nama saya Budi", "saya ada kendala billing"]


async def verify(
    client: DialogClient, sessions: int, burst: int, timeout_s: float, *, rules: bool = True
) -> Report:
    """`sessions` x `burst` messages checked for exactly once, in order, one reply each: true
    of any engine. With ``rules`` (the workers run the built-in rules), also a two-message
    conversation whose outcome those rules define (the name stored, step COMPLETED)."""
    run = uuid.uuid4().hex[:8]
    replies_after = await reply_marks(client)
    started = time.monotonic()
    sent = await send_bursts(client, [f"verify-{run}-seed"], SEED_TEXTS) if rules else []
    texts = [f"pesan {i}" for i in range(1, burst)]
    sent += await send_bursts(
        client, [f"verify-{run}-{i}" for i in range(sessions)], ["nama saya Budi", *texts]
    )
    problems: list[str] = []
    if not await wait_applied(client, sent, timeout_s):
        problems.append(f"not everything applied within {timeout_s}s (are workers running?)")
    seconds = time.monotonic() - started
    problems += await check(client, sent, replies_after)
    if rules:
        seed = await client.state(f"verify-{run}-seed")
        memory = seed.get("memory") if seed is not None else None
        if seed is not None and (
            not isinstance(memory, dict)
            or memory.get("userName") != "Budi"
            or seed.get("step") != "COMPLETED"
        ):
            problems.append(f"seed session: expected userName Budi and COMPLETED, got {seed}")
    return Report(sessions + rules, len(sent), seconds, problems)
