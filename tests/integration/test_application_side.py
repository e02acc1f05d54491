"""The application's side end to end, with real worker processes: ask() and the `ask` command
against the built-in rules, every outcome, and the engine API (threads, any-JSON memory,
retry_after, hooks, tracebacks in dead letters)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from redis_server import wait_until_async
from worker_procs import WorkerPool

from dialog_worker import DialogClient, Reply

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FALLBACK_APPLIED = "Maaf, saya tidak mengerti."


async def test_ask_returns_the_builtin_rules_exact_replies(
    client: DialogClient, workers: WorkerPool
):
    workers.start(1)
    first = await client.ask("session_123", "nama saya Budi", timeout=20)
    second = await client.ask("session_123", "saya ada kendala billing", timeout=20)
    third = await client.ask("session_123", "terima kasih", timeout=20)
    assert [(r.seq, r.outcome, r.text) for r in (first, second, third)] == [
        (1, "applied", "Halo Budi, ada yang bisa dibantu?"),
        (
            2,
            "applied",
            'Mencatat keluhan Anda: "saya ada kendala billing". Tim kami akan meninjau.',
        ),
        (3, "applied", FALLBACK_APPLIED),
    ]
    assert first.session_id == "session_123" and first.entry_id and first.produced_at


async def test_300_concurrent_asks_over_100_sessions_each_get_their_own_reply(
    client: DialogClient, workers: WorkerPool
):
    workers.start(2)
    results: dict[tuple[int, int], Reply] = {}

    async def one(session: int, k: int) -> None:
        results[session, k] = await client.ask(
            f"q{session}", f"nama saya U{session}x{k}", timeout=60
        )

    async with anyio.create_task_group() as tg:
        for k in range(3):
            for session in range(100):
                tg.start_soon(one, session, k)
    assert len(results) == 300
    for (session, k), rep in results.items():
        assert rep.session_id == f"q{session}"
        assert rep.text == f"Halo U{session}x{k}, ada yang bisa dibantu?"
        assert rep.outcome == "applied"
    for session in range(100):
        assert sorted(results[session, k].seq for k in range(3)) == [1, 2, 3]
    assert client.waiting_replies == 0


async def test_a_dead_lettered_message_ends_the_ask_with_its_outcome(
    client: DialogClient, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="fault_engine:make")
    rep = await client.ask("dl-1", "fatal: refused", timeout=20)
    assert (rep.outcome, rep.text) == ("dead_lettered", client.settings.fallback_reply)
    after = await client.ask("dl-1", "nama saya Ani", timeout=20)
    assert (after.outcome, after.seq) == ("applied", 2)


async def test_asking_again_with_a_seen_msg_id_ends_with_the_duplicate_event(
    client: DialogClient, workers: WorkerPool
):
    workers.start(1)
    first = await client.ask("dup-1", "nama saya Budi", msg_id="m-1", timeout=20)
    again = await client.ask("dup-1", "nama saya Budi", msg_id="m-1", timeout=20)
    assert (again.outcome, again.seq, again.msg_id) == ("duplicate", first.seq, "m-1")
    state = await client.state("dup-1")
    assert state is not None and state["applied_seq"] == 1


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_cli_ask_prints_the_reply_event(env: dict[str, str], workers: WorkerPool):
    workers.start(1)
    done = await anyio.to_thread.run_sync(
        lambda: cli(env, "ask", "cli-real", "nama saya Budi", "--timeout", "20")
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert (printed["outcome"], printed["text"], printed["seq"]) == (
        "applied",
        "Halo Budi, ada yang bisa dibantu?",
        1,
    )


# ---------------------------------------------------------------------------------------------
# the engine API


async def test_engines_with_int_and_nested_memory_work(client: DialogClient, workers: WorkerPool):
    workers.start(1, DIALOG_ENGINE="app_engines:Counter")
    sent = [await client.send("count-1", text) for text in ("a", "b", "c")]
    await wait_until_async(_applied(client, "count-1", 3), 20, "three messages counted")
    state = await client.state("count-1")
    assert state is not None
    assert (state["step"], state["memory"]) == ("COUNTING", 3)
    assert [t["bot"] for t in state["history"]] == ["message 1", "message 2", "message 3"]
    assert len(sent) == 3
    workers.stop_all()

    workers.start(1, DIALOG_ENGINE="app_engines:Profile")
    for text in ("halo dunia", "apa kabar"):
        await client.send("profile-1", text)
    await wait_until_async(_applied(client, "profile-1", 2), 20, "two messages profiled")
    state = await client.state("profile-1")
    assert state is not None
    assert state["memory"] == {"profile": {"words": ["halo", "apa"]}, "chars": 19}
    assert await client.redis.xlen(client.keys.dlq) == 0


def _applied(client: DialogClient, session_id: str, seq: int):
    async def check() -> bool:
        state = await client.state(session_id)
        return state is not None and state["applied_seq"] >= seq

    return check


async def test_a_blocking_plain_def_step_longer_than_the_lease_is_applied_not_fenced(
    client: DialogClient, workers: WorkerPool
):
    """It runs in a thread, so the event loop keeps renewing the 600 ms lease meanwhile."""
    workers.start(
        1,
        DIALOG_ENGINE="app_engines:SlowBlocking",
        DIALOG_LOCK_TTL_MS="600",
        APP_ENGINE_SLEEP_S="1.5",
    )
    await client.send("slow-1", "nama saya Budi")
    await wait_until_async(_applied(client, "slow-1", 1), 30, "the slow step applied")
    state = await client.state("slow-1")
    assert state is not None and state["memory"] == {"userName": "Budi"}
    assert [t["bot"] for t in state["history"]] == ["Halo Budi, ada yang bisa dibantu?"]
    assert await client.redis.xlen(client.keys.dlq) == 0


def engine_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_transient_error_with_retry_after_2_waits_about_2_seconds(
    client: DialogClient, workers: WorkerPool, tmp_path: Path
):
    log = tmp_path / "engine.log"
    workers.start(1, DIALOG_ENGINE="app_engines:RateLimited", APP_ENGINE_LOG=str(log))
    rep = await client.ask("rl-1", "halo", timeout=30)
    assert (rep.outcome, rep.text) == ("applied", "finally")
    first, second = [e for e in engine_log(log) if e["event"] == "attempt"]
    waited = second["t"] - first["t"]
    print(f"\nretry_after=2 -> next attempt after {waited:.2f} s")
    assert 2.0 <= waited < 3.5
    assert (first["attempt"], second["attempt"]) == (1, 2)


async def test_startup_runs_before_the_first_step_and_shutdown_after_the_last(
    client: DialogClient, workers: WorkerPool, tmp_path: Path
):
    log = tmp_path / "engine.log"
    [w] = workers.start(1, DIALOG_ENGINE="app_engines:Hooked", APP_ENGINE_LOG=str(log))
    rep = await client.ask("hook-1", "halo", timeout=20)
    assert (rep.outcome, rep.text) == ("applied", "hooked")
    assert w.terminate() == 0
    assert [e["event"] for e in engine_log(log)] == ["startup", "shutdown"]


async def test_an_engine_bug_is_dead_lettered_with_its_traceback_and_logged_with_it(
    client: DialogClient, workers: WorkerPool
):
    [w] = workers.start(
        1,
        DIALOG_ENGINE="app_engines:Buggy",
        DIALOG_MAX_ATTEMPTS="2",
        DIALOG_BACKOFF_BASE_MS="20",
        DIALOG_BACKOFF_MAX_MS="50",
    )
    rep = await client.ask("bug-1", "halo", timeout=30)
    assert rep.outcome == "dead_lettered"
    [(_, letter)] = await client.redis.xrange(client.keys.dlq)
    error = letter["error"]
    assert error.startswith("KeyError: 'userName'")
    assert "Traceback (innermost" in error
    assert "in _name" in error and 'state["memory"]["userName"]' in error
    assert len(error) <= 2000
    deadline = time.monotonic() + 10
    while "Traceback (most recent call last)" not in w.log_text():
        assert time.monotonic() < deadline, "the engine's traceback never reached the log"
        await anyio.sleep(0.1)
