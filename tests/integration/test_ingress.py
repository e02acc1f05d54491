"""The producer protocol end to end: plain XADDs from any client, sequencing at intake, a
session's whole life across its state TTL, hostile entries, and the recorded shard count.
Real redis-server, real worker processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import redis
import structlog.testing
from redis_server import wait_until_async as poll

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.daemon.worker import Worker
from dialog_worker.errors import PermanentError
from dialog_worker.ops.verify import Sent, check, send_bursts, wait_applied
from dialog_worker.store.codec import unpack_custody
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.integration

FAULT_ENGINE = {"DIALOG_ENGINE": "fault_engine:make"}


async def drained(client: DialogClient) -> bool:
    r, k = client.redis, client.keys
    pending = (await r.xpending(k.stream, k.group))["pending"]
    return (await r.xlen(k.stream), pending, await r.zcard(k.ready)) == (0, 0, 0)


def raw_client(env: dict[str, str]) -> redis.Redis:
    return redis.Redis.from_url(env["REDIS_URL"])


async def events(client: DialogClient) -> list[dict[str, str]]:
    return [f for _, f in await client.redis.xrange(client.keys.replies)]


async def test_plain_xadds_from_a_raw_client_are_applied_in_xadd_order(client, workers, env):
    raw = raw_client(env)
    sent: list[Sent] = []
    for i in range(5):  # interleaved: session order is XADD order, whatever else is between
        for s in range(40):
            entry = raw.xadd("dialog", {"session_id": f"p{s}", "text": f"pesan {i}"})
            sent.append(Sent(f"p{s}", i + 1, entry.decode(), f"pesan {i}"))
    workers.start(2)
    assert await wait_applied(client, sent, timeout_s=30)
    assert await check(client, sent) == []
    await poll(lambda: drained(client), 10, "stream, pending and ready set to be empty")
    for s in range(40):
        state = await client.state(f"p{s}")
        assert [t["user"] for t in state["history"]] == [f"pesan {i}" for i in range(5)]
    assert len(await events(client)) == 200


async def test_a_session_outlives_its_state_ttl_while_messages_wait(client, workers, env):
    """The review's scenario: 3 messages to each of 20 sessions while no worker runs, a wait
    past the state TTL, then workers and 3 more messages each."""
    raw = raw_client(env)
    sessions = [f"ttl{i}" for i in range(20)]

    def send_round(first: int) -> None:
        for sid in sessions:
            for n in range(first, first + 3):
                raw.xadd("dialog", {"session_id": sid, "text": f"m{n}", "msg_id": f"{sid}-m{n}"})

    send_round(1)
    # Entries wait unread (no worker yet): nothing of the sessions exists that could expire.
    await anyio.sleep(4.5)
    workers.start(2, DIALOG_STATE_TTL_S="3")
    send_round(4)
    sent = [Sent(sid, n, f"{sid}-m{n}", f"m{n}") for sid in sessions for n in range(1, 7)]
    assert await wait_applied(client, sent, timeout_s=30)
    assert await check(client, sent) == []
    for sid in sessions:
        state = await client.state(sid)
        assert [t["user"] for t in state["history"]] == [f"m{n}" for n in range(1, 7)]


async def test_state_does_not_expire_while_a_backlog_waits_behind_a_slow_step(client, workers, env):
    """A state TTL shorter than the backlog: the session must not lose its counter or its
    queue while its messages wait their turn."""
    raw = raw_client(env)
    workers.start(1, DIALOG_STATE_TTL_S="1", **FAULT_ENGINE)
    raw.xadd("dialog", {"session_id": "slow", "text": "nama saya Budi", "msg_id": "a"})
    raw.xadd("dialog", {"session_id": "slow", "text": "sleep 2.5", "msg_id": "b"})
    for n in range(3):
        raw.xadd("dialog", {"session_id": "slow", "text": f"m{n}", "msg_id": f"c{n}"})
    sent = [Sent("slow", i + 1, m, "") for i, m in enumerate(["a", "b", "c0", "c1", "c2"])]
    assert await wait_applied(client, sent, timeout_s=15)  # about 3 s (the 2.5 s step)
    assert await check(client, sent) == []
    state = await client.state("slow")
    assert state["memory"]["userName"] == "Budi"
    ttl = await client.redis.ttl(client.keys.session("slow").state)
    assert 0 < ttl <= 1  # the idle TTL starts after the last applied message


async def test_bad_entries_among_good_ones_are_dead_lettered_alone(client, workers, env):
    raw = raw_client(env)
    good: list[Sent] = []
    for i in range(20):
        if i == 7:
            raw.xadd("dialog", {"session_id": "bad-utf8", "text": b"\xff\xfe\xfd"})
        if i == 13:
            raw.xadd("dialog", {f"f{n}": "x" for n in range(5000)} | {"session_id": "wide"})
        entry = raw.xadd("dialog", {"session_id": f"g{i}", "text": "nama saya Budi"})
        good.append(Sent(f"g{i}", 1, entry.decode(), "nama saya Budi"))
    procs = workers.start(2)
    assert await wait_applied(client, good, timeout_s=30)
    assert await check(client, good) == []
    await poll(lambda: drained(client), 10, "stream, pending and ready set to be empty")
    letters = [f for _, f in raw.xrange("dialog-dlq")]
    assert sorted(f[b"error_kind"] for f in letters) == [b"malformed", b"malformed"]
    assert {f.get(b"session_id") for f in letters} == {b"bad-utf8", None}
    assert any(f.get(b"text") == b"\xff\xfe\xfd" for f in letters)  # kept byte for byte
    wide = next(f for f in letters if b"raw_entry" in f)
    assert b"too many fields" in wide[b"error"]
    assert all(p.alive() for p in procs)
    # The non-UTF-8 message named a session: its user gets the fallback, in its turn.
    [event] = [e for e in await events(client) if e["session_id"] == "bad-utf8"]
    assert (event["outcome"], event["seq"]) == ("dead_lettered", "1")


async def test_forged_internal_fields_are_ignored(client, workers, env):
    raw = raw_client(env)
    forged = [{"requeues": str(10**12)}, {"seq": "-5"}, {"seq": str(10**23)}, {"attempts": "99"}]
    sent = []
    for n, extra in enumerate(forged):
        entry = raw.xadd("dialog", {"session_id": "forged", "text": f"m{n}", **extra})
        sent.append(Sent("forged", n + 1, entry.decode(), f"m{n}"))
    others = []
    for i in range(30):
        entry = raw.xadd("dialog", {"session_id": f"o{i}", "text": "halo"})
        others.append(Sent(f"o{i}", 1, entry.decode(), "halo"))
    workers.start(2, DIALOG_VISIBILITY_TIMEOUT_MS="1000", DIALOG_LOCK_TTL_MS="500")
    assert await wait_applied(client, sent + others, timeout_s=20)
    assert await check(client, sent + others) == []
    await poll(lambda: drained(client), 10, "stream, pending and ready set to be empty")
    state = await client.state("forged")
    assert [t["seq"] for t in state["history"]] == [1, 2, 3, 4]


def run_cli(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", *args],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_a_worker_configured_with_another_shard_count_refuses_and_writes_nothing(
    client, workers, env
):
    [running] = workers.start(1)
    await poll(lambda: client.redis.exists("dialog:shards"), 10, "the shard count recorded")
    assert await client.redis.get("dialog:shards") == "1"

    k = client.keys
    # Every key an idle worker of one shard keeps: the recorded count, the inbound stream with
    # its group, the wake stream, the inbound bookkeeping its first intake call writes, the
    # waiter lease its first idle wait takes, its worker lease on the shard (with the counter
    # that numbers them) and its presence (daemon/presence.py). Each appears at its own moment
    # after the count; a snapshot taken before the last of them would see it appear later.
    presence = k.presence(running.name)
    expected = sorted(
        [
            "dialog:shards",
            k.stream,
            k.wake,
            k.inbound,
            k.waiter,
            k.workers,
            f"{k.workers}:n",
            presence,
        ]
    )

    async def idle_worker_keys() -> bool:
        if sorted(await client.redis.keys("*")) != expected:
            return False
        groups = await client.redis.xinfo_groups(k.stream)
        return any(g["name"] == k.group for g in groups)

    async def keys_but_the_lease() -> list[str]:
        # The lease is the running worker's and renewed by it: a worker starved past it
        # (a loaded machine) lets it lapse and takes it again. It must stay the running one's.
        assert await client.redis.get(k.waiter) in (None, running.name)
        return sorted(key for key in await client.redis.keys("*") if key != k.waiter)

    await poll(idle_worker_keys, 10, f"the running worker's keys {expected}")
    before = await keys_but_the_lease()
    run = await anyio.to_thread.run_sync(
        lambda: run_cli(env, "run", DIALOG_SHARDS="3", DIALOG_METRICS_PORT="0")
    )
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "DIALOG_SHARDS" in run.stderr and "reshard" in run.stderr
    assert await keys_but_the_lease() == before
    sent = await anyio.to_thread.run_sync(
        lambda: run_cli(env, "send", "s1", "halo", DIALOG_SHARDS="3")
    )
    assert sent.returncode == 2 and "DIALOG_SHARDS" in sent.stderr
    assert await keys_but_the_lease() == before
    assert not [key for key in await client.redis.keys("dialog:{*") if "0." in key]


async def test_kill_9_between_intake_and_commit_keeps_the_seq(client, workers, env, tmp_path):
    raw = raw_client(env)
    flag = tmp_path / "hold"
    flag.touch()
    fault = {"DIALOG_LOCK_TTL_MS": "1000", "FAULT_FLAG_FILE": str(flag), **FAULT_ENGINE}
    [victim] = workers.start(1, **fault)
    first = raw.xadd("dialog", {"session_id": "k9", "text": "hold nama saya Budi"})
    second = raw.xadd("dialog", {"session_id": "k9", "text": "keluhan"})
    sk = client.keys.session("k9")
    await poll(lambda: client.redis.exists(sk.lock), 10, "the worker to hold the session")
    victim.kill()
    # Sequenced and moved into the session's keys at intake; nothing sits in a pending list
    # or in the stream.
    q1, q2, last, applied = raw.hmget(sk.state, ["q1", "q2", "s", "a"])
    assert [unpack_custody(q)[0] for q in (q1, q2)] == [first.decode(), second.decode()]
    assert (last, applied) == (b"2", None)
    assert (await client.redis.xpending("dialog", "dialog-workers"))["pending"] == 0
    assert await client.redis.xlen("dialog") == 0
    flag.unlink()
    started = time.monotonic()
    workers.start(1, **fault)
    sent = [Sent("k9", 1, first.decode(), ""), Sent("k9", 2, second.decode(), "")]
    assert await wait_applied(client, sent, timeout_s=20)
    print(f"\nresumed and applied {time.monotonic() - started:.2f}s after the restart")
    assert await check(client, sent) == []
    assert [(e["seq"], e["outcome"]) for e in await events(client)] == [
        ("1", "applied"),
        ("2", "applied"),
    ]
    state = await client.state("k9")
    assert state["memory"]["userName"] == "Budi"


async def test_a_hostile_xdel_of_a_queued_message_changes_nothing(client, workers, env):
    """Custody: the review's XDEL of a sequenced entry made a gap dead letter without the text
    or the msg_id, and a re-send was answered duplicate. Now the entry is gone from the stream
    at intake, and the message is applied with its own msg_id."""
    raw = raw_client(env)
    [w] = workers.start(1, DIALOG_LOCK_TTL_MS="500", **FAULT_ENGINE)
    raw.xadd("dialog", {"session_id": "xd", "text": "sleep 30", "msg_id": "m1"})
    sk = client.keys.session("xd")
    await poll(lambda: client.redis.exists(sk.lock), 10, "the worker to hold the session")
    second = raw.xadd("dialog", {"session_id": "xd", "text": "nama saya Budi", "msg_id": "m2"})
    await poll(lambda: client.redis.hexists(sk.state, "q2"), 10, "seq 2 to be sequenced")
    w.kill()
    assert raw.xdel("dialog", second) == 0  # nothing left to delete
    raw.xtrim("dialog", maxlen=0, approximate=False)
    workers.start(1, DIALOG_LOCK_TTL_MS="500")
    sent = [Sent("xd", 1, "m1", "sleep 30"), Sent("xd", 2, "m2", "nama saya Budi")]
    assert await wait_applied(client, sent, timeout_s=20)
    assert [(e["seq"], e["msg_id"], e["outcome"]) for e in await events(client)] == [
        ("1", "m1", "applied"),
        ("2", "m2", "applied"),
    ]
    assert (await client.state("xd"))["memory"]["userName"] == "Budi"


async def test_a_missing_predecessor_is_skipped_as_a_gap(client, workers, env):
    raw = raw_client(env)
    [w] = workers.start(1, DIALOG_GAP_TIMEOUT_S="0.5", DIALOG_LOCK_TTL_MS="500", **FAULT_ENGINE)
    raw.xadd("dialog", {"session_id": "gap", "text": "sleep 30", "msg_id": "m1"})
    sk = client.keys.session("gap")
    await poll(lambda: client.redis.exists(sk.lock), 10, "the worker to hold the session")
    w.kill()
    await client.redis.hdel(sk.state, "q1")  # the worker's own key edited by hand, or lost
    raw.xadd("dialog", {"session_id": "gap", "text": "nama saya Budi", "msg_id": "m2"})
    workers.start(1, DIALOG_GAP_TIMEOUT_S="0.5", DIALOG_LOCK_TTL_MS="500")
    sent = [Sent("gap", 2, "m2", "nama saya Budi")]
    assert await wait_applied(client, sent, timeout_s=10)  # about 1 s
    [letter] = [f for _, f in await client.redis.xrange(client.keys.dlq)]
    assert (letter["error_kind"], letter["seq"], letter["session_id"]) == ("gap", "1", "gap")
    outcomes = [(e["seq"], e["outcome"]) for e in await events(client)]
    assert outcomes == [("1", "dead_lettered"), ("2", "applied")]
    await poll(lambda: drained(client), 10, "stream, pending and ready set to be empty")


def test_keys_of_the_plain_layout_are_documented_names() -> None:
    from dialog_worker.config import Settings

    k = Keys.from_settings(Settings())
    assert (k.stream, k.replies, k.dlq, k.group) == (
        "dialog",
        "dialog-replies",
        "dialog-dlq",
        "dialog-workers",
    )
    assert k.ready == "dialog:{dialog}:ready"
    assert k.session("s1").state == "dialog:{dialog}:s:{s1}:state"


# ---------------------------------------------------------------------------------------------
# Settings that bound what a session and the deployment keep


async def test_history_keeps_the_last_history_limit_turns(client, workers):
    workers.start(1, DIALOG_HISTORY_LIMIT="3")
    texts = ["nama saya Budi", *(f"pesan {i}" for i in range(2, 8))]
    sent = await send_bursts(client, ["hist"], texts)
    assert await wait_applied(client, sent, timeout_s=20)
    state = await client.state("hist")
    assert [t["seq"] for t in state["history"]] == [5, 6, 7]
    assert [t["user"] for t in state["history"]] == texts[-3:]
    assert state["memory"]["userName"] == "Budi"  # memory is the engine's, not cut
    client.settings = client.settings.replace(history_limit=3)  # what check() compares
    assert await check(client, sent) == []


async def test_the_reply_stream_is_trimmed_to_about_the_reply_maxlen(client, workers):
    workers.start(1, DIALOG_REPLY_MAXLEN="10")
    sent = await send_bursts(client, [f"trim{i}" for i in range(150)], ["nama saya Budi"])
    sent += await send_bursts(client, ["trim-hot"], [f"pesan {i}" for i in range(1, 151)])
    assert await wait_applied(client, sent, timeout_s=30)
    # 300 reply events; MAXLEN ~ 10 drops whole nodes (100 entries) of the stream's head.
    assert 10 <= await client.redis.xlen(client.keys.replies) <= 200


async def test_a_msg_id_is_new_again_after_the_dedupe_window(client, workers):
    workers.start(1, DIALOG_DEDUPE_TTL_S="1")
    first = [Sent("dd", 1, (await client.send("dd", "nama saya Budi", msg_id="m-1")).msg_id, "")]
    assert await wait_applied(client, first, timeout_s=20)
    dedupe = client.keys.session("dd").dedupe("m-1")
    assert 0 < await client.redis.pttl(dedupe) <= 1000
    # Inside the window: a duplicate.
    await client.send("dd", "nama saya Budi", msg_id="m-1")
    await poll(lambda: _outcomes(client, "dd", ["applied", "duplicate"]), 10, "the duplicate")
    await poll(lambda: _gone(client, dedupe), 5, "the dedupe window to end")
    # After it: a new message, applied as the session's next one.
    await client.send("dd", "saya ada kendala", msg_id="m-1")
    again = [Sent("dd", 2, "m-1", "")]
    assert await wait_applied(client, again, timeout_s=20)
    assert await _outcomes(client, "dd", ["applied", "duplicate", "applied"])
    state = await client.state("dd")
    assert [(t["seq"], t["msg_id"]) for t in state["history"]] == [(1, "m-1"), (2, "m-1")]


async def _outcomes(client: DialogClient, sid: str, want: list[str]) -> bool:
    return [e["outcome"] for e in await events(client) if e["session_id"] == sid] == want


async def _gone(client: DialogClient, key: str) -> bool:
    return not await client.redis.exists(key)


class _CutSurrogateEngine:
    """Every step waits until all have started (so their commits meet in one group commit);
    the session "bad" fails with an error text cut inside a UTF-16 surrogate pair."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: dict[str, int] = {}
        self.all_started = anyio.Event()

    async def step(self, state: dict, message: dict) -> tuple[dict, str]:
        sid = message["session_id"]
        self.calls[sid] = self.calls.get(sid, 0) + 1
        if len(self.calls) >= self.n:
            self.all_started.set()
        with anyio.move_on_after(5):
            await self.all_started.wait()
        if sid == "bad":
            raise PermanentError("API said: cut \ud83d")
        return {**state, "step": "DONE"}, "ok"


async def test_an_engine_error_with_a_lone_surrogate_fails_alone_in_a_group_commit(client, env):
    """The review's case: the dead letter's JSON carried the escape \\ud83d, Redis' cjson
    refused it, and the whole group commit failed: every healthy session of the batch threw
    its finished step away and ran it again after its lease."""
    sessions = [f"ok{i}" for i in range(9)] + ["bad"] + [f"ok{i}" for i in range(9, 19)]
    raw = raw_client(env)
    for sid in sessions:
        raw.xadd("dialog", {"session_id": sid, "text": "hi"})
    engine = _CutSurrogateEngine(len(sessions))
    worker = Worker(load_settings(environ=env), engine)

    async def finished() -> bool:
        return len(await events(client)) >= len(sessions)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        try:
            await poll(finished, 10, "every session to finish")  # about 2 s
        finally:
            worker.stop()
    assert engine.calls == {sid: 1 for sid in sessions}  # no step ran twice
    outcomes = {e["session_id"]: e["outcome"] for e in await events(client)}
    assert outcomes == {sid: "dead_lettered" if sid == "bad" else "applied" for sid in sessions}
    [letter] = [f for _, f in await client.redis.xrange(client.keys.dlq)]
    assert (letter["session_id"], letter["seq"]) == ("bad", "1")
    # Escaped as text, not lost:
    assert letter["error"].splitlines()[0] == "PermanentError: API said: cut \\ud83d"


def _runbook_recovery_script() -> str:
    """The EVAL of docs/runbook.md's recovery, exactly as an operator would paste it."""
    runbook = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"
    section = runbook.read_text().split("## Inbound stream trimmed or pushed ahead", 1)[1]
    [line] = [x for x in section.splitlines() if x.startswith('redis-cli EVAL "')]
    script, _, rest = line.removeprefix('redis-cli EVAL "').rpartition('"')
    assert rest.strip() == "1 dialog dialog-workers", rest
    return script


async def test_a_pushed_ahead_stream_is_recovered_as_the_runbook_says(client, workers, env):
    raw = raw_client(env)
    workers.start(1)
    sent = [Sent(f"pa{i}", 1, f"pa{i}-1", "nama saya Budi") for i in range(5)]
    for s in sent[:3]:
        raw.xadd("dialog", {"session_id": s.session_id, "text": s.text, "msg_id": s.msg_id})
    top = "18446744073709551615-18446744073709551615"
    raw.xadd("dialog", {"session_id": "pa-top", "text": "hi", "msg_id": "top"}, id=top)
    with pytest.raises(redis.ResponseError, match="exhausted"):
        raw.xadd("dialog", {"session_id": "pa3", "text": "x"})
    script = _runbook_recovery_script()

    async def drained_stream() -> bool:
        return await client.redis.xlen("dialog") == 0

    async def not_ahead() -> bool:
        return not await client.redis.hexists(client.keys.inbound, "ahead")

    await poll(drained_stream, 10, "the workers to drain it")
    assert await client.redis.hget(client.keys.inbound, "ahead") == top  # detected

    async def recovered() -> bool:
        try:
            return raw.eval(script, 1, "dialog", "dialog-workers") == b"OK"
        except redis.ResponseError as exc:
            assert "still unread" in str(exc)
            return False

    await poll(recovered, 10, "the recovery to answer OK")
    for s in sent[3:]:
        raw.xadd("dialog", {"session_id": s.session_id, "text": s.text, "msg_id": s.msg_id})
    everything = [*sent, Sent("pa-top", 1, "top", "hi")]
    assert await wait_applied(client, everything, timeout_s=20)
    assert await check(client, everything) == []
    await poll(not_ahead, 10, "the ahead mark to clear")


async def test_a_redis_error_is_logged_with_redis_own_message(client, env):
    """redis-py 8's repr() of a ResponseError hides Redis' message: the log must carry it."""
    raw = raw_client(env)
    raw.set("dialog-replies", "not a stream")
    # A message to read: every intake call that has one now fails, saying why (one with
    # nothing to read writes no reply event and does not look at the reply stream).
    raw.xadd("dialog", {"session_id": "s", "text": "hi"})
    worker = Worker(load_settings(environ=env), _CutSurrogateEngine(1))
    with structlog.testing.capture_logs() as logs:

        async def logged() -> bool:
            return any(e.get("event") == "loop_error" for e in logs)

        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            try:
                await poll(logged, 10, "the intake's failure to be logged")
            finally:
                worker.stop()
    [first, *_] = [e for e in logs if e.get("event") == "loop_error"]
    assert "WRONGTYPE dialog-replies is a string" in first["error"]
    assert first["error_type"] == "ResponseError"
