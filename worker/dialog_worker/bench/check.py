"""Correctness of one run, per session: lost, duplicated, out of order, missing or extra reply,
not applied (ours), from the replies the reader saw and the session states in Redis; plus
dialog-worker's own checker (dialog_worker.ops.verify) for ours."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

from dialog_worker.bench.measure import ReplyReader
from dialog_worker.bench.stats import inversions
from dialog_worker.bench.target import Target
from dialog_worker.bench.workload import Sent
from dialog_worker.ops.verify import Sent as VSent

# Systems that keep dialog-worker's state document (bare keeps none).
STATEFUL = {"ours", "naive", "seed", "peer"}


async def load_states(target: Target, sids: list[str]) -> dict[str, Any]:
    states: dict[str, Any] = {}
    for start in range(0, len(sids), 500):
        chunk = sids[start : start + 500]
        async with target.redis.pipeline(transaction=False) as pipe:
            for sid in chunk:
                pipe.hget(target.keys.session(sid).state, "d")
            docs = await pipe.execute()
        for sid, doc in zip(chunk, docs, strict=True):
            states[sid] = json.loads(doc) if doc else None
    return states


async def correctness(
    target: Target, sent: list[Sent], reader: ReplyReader, timed_out: bool
) -> dict[str, Any]:
    by_session: dict[str, list[Sent]] = defaultdict(list)
    for s in sent:
        by_session[s.session_id].append(s)
    stateful = target.system in STATEFUL
    states = await load_states(target, list(by_session)) if stateful else {}
    c: Counter[str] = Counter()
    sessions_lost = sessions_ooo = 0
    for sid, msgs in by_session.items():
        found = _session(target, sid, msgs, reader, states.get(sid), stateful)
        c.update(found)
        sessions_lost += 1 if found["lost"] else 0
        sessions_ooo += 1 if found["out_of_order"] else 0
    result: dict[str, Any] = {
        "lost": c["lost"],
        "duplicated": c["duplicated"],
        "out_of_order": c["out_of_order"],
        "missing_replies": c["missing_replies"],
        "extra_replies": c["extra_replies"],
        "not_applied": c["not_applied"],
        "dead_lettered": c["dead_lettered"],
        "sessions": len(by_session),
        "sessions_with_lost": sessions_lost,
        "sessions_out_of_order": sessions_ooo,
        "state_checked": stateful,
    }
    if target.system == "ours" and not timed_out:
        result["problems"] = await verify_check(target, sent, reader)
    return result


def _session(
    target: Target,
    sid: str,
    msgs: list[Sent],
    reader: ReplyReader,
    state: dict[str, Any] | None,
    stateful: bool,
) -> Counter[str]:
    """`msgs` in the order they were sent, which is the session's order: replies and history
    turns are placed by msg_id in it (no seq needed)."""
    c: Counter[str] = Counter()
    position = {m.msg_id: i for i, m in enumerate(msgs)}
    keys = [(sid, m.msg_id) for m in msgs]
    dead = sum(1 for k in keys if k in reader.dead_lettered)
    c["dead_lettered"] += dead
    c["missing_replies"] += sum(1 for k in keys if reader.count[k] == 0)
    c["extra_replies"] += sum(max(0, reader.count[k] - 1) for k in keys)
    late = inversions([position[m] for m in reader.order.get(sid, []) if m in position])
    lost = dup = 0
    if stateful:
        if state is None:
            lost = len(msgs) - dead
        else:
            history = state.get("history", [])
            turns = [position[t["msg_id"]] for t in history if t.get("msg_id") in position]
            late = max(late, inversions(turns))
            hcount = Counter(turn["msg_id"] for turn in history)
            dup = sum(v - 1 for v in hcount.values() if v > 1)
            version = int(state.get("version", 0))
            # version counts the writes that survived; one per applied message
            lost = max(0, len(msgs) - dead - version)
            dup = max(dup, version - (len(msgs) - dead))
            applied = [m for m in msgs if (sid, m.msg_id) not in reader.dead_lettered]
            limit = target.settings.history_limit
            if len(applied) <= len(history) or len(history) < limit:
                # history is not truncated: every applied message must be in it
                lost = max(lost, sum(1 for m in applied if m.msg_id not in hcount))
            # A fresh session's seqs are 1..n in send order: the last one applied is n.
            if target.system == "ours" and int(state.get("applied_seq", 0)) != len(msgs):
                c["not_applied"] += 1
    c["lost"] += lost
    c["duplicated"] += dup
    c["out_of_order"] += late
    return c


async def verify_check(target: Target, sent: list[Sent], reader: ReplyReader) -> list[str]:
    """dialog-worker's own checker (dialog_worker.ops.verify.check) over this run."""
    from dialog_worker.client.dialog_client import DialogClient
    from dialog_worker.ops.verify import check

    checked: list[VSent] = list(sent)
    async with DialogClient(settings=target.settings, max_connections=8) as client:
        problems = await check(client, checked, reader.after)
    return problems[:20]


def violations(c: dict[str, Any]) -> int:
    keys: tuple[str, ...] = ("lost", "duplicated", "out_of_order", "missing_replies")
    keys += ("extra_replies",)
    if not c.get("state_checked"):
        # bare round trip: no state and no ordering promise; replies only
        keys = ("missing_replies", "extra_replies")
    return (
        sum(int(c.get(k, 0)) for k in keys)
        + int(c.get("not_applied", 0))
        + len(c.get("problems", []))
    )
