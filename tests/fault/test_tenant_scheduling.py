"""Tenants share the workers' slots fairly, with real worker processes: a tenant that arrives
behind another's flood is served within a round of slots, however that flood is spread over
sessions; weights give shares; a maximum holds across the whole pool (lua/_common.lua,
"Tenants")."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import redis
from redis_server import wait_until
from tenant_engines import most_at_once, share, steps

pytestmark = pytest.mark.fault


def flood(r: redis.Redis, tenant: str, sessions: int, messages: int, sleep: str = "0.05") -> None:
    pipe = r.pipeline(transaction=False)
    for i in range(messages):
        sid = f"{tenant}-{i % sessions}"
        pipe.xadd("dialog", {"session_id": sid, "text": "hi", "tenant": tenant, "sleep": sleep})
    pipe.execute()


def replies(r: redis.Redis) -> int:
    return int(r.xlen("dialog-replies"))


@pytest.mark.parametrize("sessions", [20, 200], ids=["bursts", "spread-over-sessions"])
def test_a_tenant_behind_a_flood_is_served_within_a_round_of_slots(
    workers, env, tmp_path, sessions
):
    """a's 200 messages (over 20 sessions, or one per session: the "sybil" shape) are in the
    stream before b's one: b's step starts before a runs more than a round of the slots
    (two rounds of 4 here), not after a's backlog (which would take 50 rounds)."""
    r = redis.Redis.from_url(env["REDIS_URL"])
    log = tmp_path / "steps.jsonl"
    workers.start(
        1,
        DIALOG_CONCURRENCY="4",
        DIALOG_ENGINE="tenant_engines:Paced",
        TENANT_ENGINE_LOG=str(log),
        DIALOG_TENANT_PATTERN="^([a-z]+)-",  # tenants in use: the workers read ahead
    )
    flood(r, "a", sessions, 200)
    wait_until(lambda: log.exists(), 20, what="a's first steps")
    r.xadd("dialog", {"session_id": "b-0", "text": "hi", "tenant": "b", "sleep": "0.05"})
    wait_until(lambda: replies(r) == 201, 60, what="every message answered")
    ran = steps(str(log))
    b = next(s for s in ran if s["tenant"] == "b")
    a_before_b = [s for s in ran if s["tenant"] == "a" and s["start"] < b["start"]]
    assert len(a_before_b) < 20, f"{len(a_before_b)} of a's steps started before b's"
    assert len(ran) == 201


def test_a_tenant_field_alone_puts_tenants_in_use_behind_a_flood_of_2000(workers, env, tmp_path):
    """No pattern and no `tenants set`: entries that name their tenant are enough. a's 2,000
    messages are in the stream before each of b's lone ones: each of b's steps starts before
    a runs more than a round or two of the slots after it was sent, not after a's backlog
    (without the intake's mark the reader waited for a slot, and read b's entry only after
    a's backlog: hundreds of a's steps first)."""
    r = redis.Redis.from_url(env["REDIS_URL"])
    log = tmp_path / "steps.jsonl"
    workers.start(
        1, DIALOG_CONCURRENCY="4", DIALOG_ENGINE="tenant_engines:Paced", TENANT_ENGINE_LOG=str(log)
    )
    flood(r, "a", 200, 2000, sleep="0.01")
    wait_until(lambda: log.exists(), 20, what="a's first steps")
    sent = []
    for i in range(3):
        sent.append(time.time())
        r.xadd("dialog", {"session_id": f"b-{i}", "text": "hi", "tenant": "b", "sleep": "0.01"})
        wait_until(lambda i=i: f"b-{i}" in log.read_text(), 60, what=f"b-{i}'s step")
    ran = steps(str(log))
    for i, at in enumerate(sent):
        b = next(s for s in ran if s["session_id"] == f"b-{i}")
        a_between = [s for s in ran if s["tenant"] == "a" and at <= s["start"] < b["start"]]
        assert len(a_between) < 20, f"{len(a_between)} of a's steps started before b-{i}'s"
    # b was served within a's backlog: a's steps go on after b's last. Each line is written
    # when its step ends, so a step of a that started after b-2's may not be logged yet (CI
    # read the log right after b-2's line once): wait for one.
    last_b = max(s["start"] for s in ran if s["tenant"] == "b")
    wait_until(
        lambda: any(s["tenant"] == "a" and s["start"] > last_b for s in steps(str(log))),
        30,
        what="a's backlog to go on after b's steps",
    )
    wait_until(lambda: replies(r) == 2003, 120, what="every message answered")


def test_weights_give_tenants_shares_of_the_slots(workers, env, tmp_path):
    r = redis.Redis.from_url(env["REDIS_URL"])
    log = tmp_path / "steps.jsonl"
    share(r, "a", weight=3)
    flood(r, "a", 30, 120)
    flood(r, "b", 30, 120)
    workers.start(
        1, DIALOG_CONCURRENCY="4", DIALOG_ENGINE="tenant_engines:Paced", TENANT_ENGINE_LOG=str(log)
    )
    wait_until(lambda: replies(r) == 240, 60, what="every message answered")
    first = Counter(s["tenant"] for s in steps(str(log))[:120])  # both still have a backlog
    assert 2.4 <= first["a"] / first["b"] <= 3.6, first


def test_a_tenants_maximum_holds_across_the_pool(workers, env, tmp_path):
    r = redis.Redis.from_url(env["REDIS_URL"])
    log = tmp_path / "steps.jsonl"
    share(r, "a", most=2)  # at most 2 of a's sessions in flight, fleet-wide
    flood(r, "a", 20, 60, sleep="0.1")
    flood(r, "b", 20, 60, sleep="0.1")
    workers.start(
        2, DIALOG_CONCURRENCY="4", DIALOG_ENGINE="tenant_engines:Paced", TENANT_ENGINE_LOG=str(log)
    )
    wait_until(lambda: replies(r) == 120, 90, what="every message answered")
    ran = steps(str(log))
    assert most_at_once([s for s in ran if s["tenant"] == "a"]) <= 2
    # Work-conserving: b used the slots a could not (more than a's 2 at once).
    assert most_at_once([s for s in ran if s["tenant"] == "b"]) > 2
    # Order kept per session, each message once.
    seqs: dict[str, list[int]] = {}
    for s in ran:
        seqs.setdefault(s["session_id"], []).append(s["seq"])
    assert all(v == list(range(1, len(v) + 1)) for v in seqs.values())
