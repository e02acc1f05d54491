"""The command line as users call it: JSON on stdout, errors on stderr, exit 0/1/2."""

from __future__ import annotations

import collections
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime

import anyio
import pytest

from dialog_worker.ops.verify import check, send_bursts, wait_applied

pytestmark = pytest.mark.integration


def cli(env: dict[str, str], *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", *args],
        env={**env, **extra_env},
        capture_output=True,
        text=True,
        timeout=120,
    )


async def acli(env, *args, **extra_env):
    return await anyio.to_thread.run_sync(lambda: cli(env, *args, **extra_env))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DIALOG_CONCURRENCY", "many"),
        ("DIALOG_LOCK_TTL_MS", "-5"),
        ("DIALOG_LOG_FORMAT", "xml"),
        ("REDIS_URL", "http://user:s3cret@host"),
        ("REDIS_URL", "redis://localhost:notaport/0"),
    ],
)
def test_invalid_setting_fails_with_one_line_naming_it_and_exit_2(env, name, value):
    result = cli(env, "stats", **{name: value})
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0]
    assert "s3cret" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["dlq", "list", "--limit", "-5"],
        ["dlq", "show", "nonsense"],
        ["dlq", "redrive", "--id", "nonsense"],
        ["dlq", "purge"],
        ["send", "   ", "hi"],
        ["state", "  "],
        ["session", " "],
        ["stats", "--shard", "x"],
        ["verify", "--sessions", "0"],
        ["run", "--processes", "0"],
        ["run", "--processes", "many"],
        ["frobnicate"],
        [],
    ],
    ids=lambda a: " ".join(a) or "nothing",
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(env, args):
    result = cli(env, *args)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("dialog-worker: "), result.stderr


async def test_purge_of_everything_needs_yes(env, client):
    await client.redis.xadd(client.keys.dlq, {"session_id": "p", "error": "x"})
    refused = await acli(env, "dlq", "purge")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert await client.redis.xlen(client.keys.dlq) == 1
    done = await acli(env, "dlq", "purge", "--yes")
    assert done.returncode == 0 and json.loads(done.stdout) == {"purged": 1}
    assert await client.redis.xlen(client.keys.dlq) == 0


def test_version_and_help_for_every_argument(env):
    import argparse

    from dialog_worker import __version__
    from dialog_worker.cli import _parser

    result = cli(env, "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"dialog-worker {__version__}"

    def walk(parser: argparse.ArgumentParser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from ((f"{name} {where}", a) for where, a in walk(child))
            elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
                yield "", action

    missing = [
        f"{where}{a.dest}" for where, a in walk(_parser()) if not a.help or a.help == "==SUPPRESS=="
    ]
    assert missing == []


@pytest.mark.parametrize("processes", ["1", "2"])
def test_run_with_metrics_port_in_use_is_one_line_naming_it_and_exit_2(env, processes, tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        result = cli(
            env,
            "run",
            "--processes",
            processes,
            DIALOG_METRICS_HOST="127.0.0.1",
            DIALOG_METRICS_PORT=port,
            TMPDIR=str(tmp_path),
        )
    assert result.returncode == 2, result
    assert list(tmp_path.iterdir()) == []  # the supervisor's metrics directory is gone too
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "DIALOG_METRICS_PORT" in lines[0] and port in lines[0]


def test_run_with_unloadable_engine_exits_2(env):
    result = cli(env, "run", DIALOG_ENGINE="no_such_module:make")
    assert result.returncode == 2
    assert "DIALOG_ENGINE" in result.stderr


def test_engine_startup_failure_is_one_stderr_line_naming_the_exception_and_exit_1(env):
    result = cli(env, "run", DIALOG_ENGINE="app_engines:StartupFails", DIALOG_METRICS_PORT="0")
    assert result.returncode == 1, result
    # The suite's Redis runs without AOF, which `run` warns about first (one line of its own).
    lines = [
        line
        for line in result.stderr.strip().splitlines()
        if not line.startswith("dialog-worker: Redis runs without AOF")
    ]
    assert len(lines) == 1, result.stderr
    assert "StartupFails.startup()" in lines[0]
    assert "ConnectionRefusedError: model server at 127.0.0.1:9 refused" in lines[0]


def test_supervisor_gives_up_on_a_child_that_cannot_start_with_growing_backoff(env, tmp_path):
    from dialog_worker.daemon.supervisor import GIVE_UP_AFTER, RESTART_MAX_S

    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dialog_worker", "run", "--processes", "2"],
        env={
            **env,
            "DIALOG_ENGINE": "app_engines:StartupFails",
            "DIALOG_METRICS_PORT": "0",
            "DIALOG_LOG_LEVEL": "info",
            "TMPDIR": str(tmp_path),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # A supervisor that never gives up is killed after 60 s; it fails sooner if it restarts a
    # slot after that slot's GIVE_UP_AFTER-th quick failure (the death it must give up at).
    deadline = threading.Timer(60, proc.kill)
    deadline.start()
    stderr: list[str] = []
    drain = threading.Thread(target=lambda: stderr.append(proc.stderr.read()), daemon=True)
    drain.start()
    stdout: list[str] = []
    restarts: collections.Counter[int] = collections.Counter()
    try:
        for line in proc.stdout:
            stdout.append(line)
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("event") == "worker_process_died":
                restarts[event["slot"]] += 1
                assert restarts[event["slot"]] < GIVE_UP_AFTER, ("restarted", "".join(stdout))
        proc.wait()
    finally:
        deadline.cancel()
        proc.kill()
        proc.wait()
        drain.join(10)
    result = subprocess.CompletedProcess(
        proc.args, proc.returncode, "".join(stdout), "".join(stderr)
    )
    took = time.monotonic() - started
    assert result.returncode == 1, result
    last = result.stderr.strip().splitlines()[-1]
    assert f"died {GIVE_UP_AFTER} times in a row" in last, result.stderr
    assert "Its last error: engine StartupFails.startup() raised ConnectionRefusedError: " in last
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for slot in (1, 2):
        delays = [
            e["restart_in_s"]
            for e in events
            if e["event"] == "worker_process_died" and e["slot"] == slot
        ]
        # Each restart waits longer than the one before: a child that cannot start never spins.
        assert len(delays) >= 2 and delays == sorted(set(delays)), (slot, delays)
        assert delays[-1] <= RESTART_MAX_S
        # And it really waits that long: from each death to the next start of that slot, at
        # least the delay the death announced (not only the logged figure).
        times = [
            (e["event"], datetime.fromisoformat(e["timestamp"]).timestamp())
            for e in events
            if e["event"] in ("worker_process_died", "worker_process_started") and e["slot"] == slot
        ]
        waited = [
            started - died
            for (was, died), (now, started) in itertools.pairwise(times)
            if (was, now) == ("worker_process_died", "worker_process_started")
        ]
        assert len(waited) == len(delays), (slot, times)
        for delay, wait in zip(delays, waited, strict=True):
            assert wait >= delay - 0.05, (slot, delays, waited)
    assert list(tmp_path.iterdir()) == []  # the metrics directory is gone
    assert took < 60, took


def test_send_and_state_print_json(env):
    first = json.loads(cli(env, "send", "c1", "nama saya Budi", "--msg-id", "m1").stdout)
    assert first.keys() == {"session_id", "msg_id", "entry_id"}
    assert (first["session_id"], first["msg_id"]) == ("c1", "m1")
    plain = json.loads(cli(env, "send", "c1", "lagi").stdout)
    # Without --msg-id the client generates one before it appends (a retry can reuse it).
    assert len(plain["msg_id"]) == 32 and plain["entry_id"] > first["entry_id"]
    assert json.loads(cli(env, "state", "nobody").stdout) is None


def test_send_and_ask_take_a_tenant_and_a_priority(env, workers):
    import redis

    cli(env, "send", "t1", "hi", "--msg-id", "m1", "--tenant", "acme", "--priority", "9")
    [(_, fields)] = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True).xrange("dialog")
    assert (fields["tenant"], fields["priority"]) == ("acme", "9")
    workers.start(1)
    asked = cli(env, "ask", "t2", "nama saya Ani", "--tenant", "acme", "--priority", "0")
    assert asked.returncode == 0 and json.loads(asked.stdout)["outcome"] == "applied"
    for bad in (["--priority", "10"], ["--priority", "-1"], ["--tenant", "a b"]):
        for command in ("send", "ask"):
            refused = cli(env, command, "t3", "hi", *bad)
            assert refused.returncode == 2, refused.stderr
            assert refused.stderr.startswith("dialog-worker: ") or "error:" in refused.stderr
            assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["send", "", "hi"], ["send", "s", ""], ["state", "x" * 300]])
def test_refused_input_is_a_usage_error(env, args):
    result = cli(env, *args)
    assert result.returncode == 2
    assert result.stderr.startswith("dialog-worker: ")


def test_unreachable_redis_is_a_failure_without_password(env):
    result = cli(env, "stats", REDIS_URL="redis://user:s3cret@127.0.0.1:1/0")
    assert result.returncode == 1
    assert "s3cret" not in result.stderr and "***" in result.stderr


async def test_stats_and_session_show_queue_and_a_held_lock(env, client):
    await client.send("held", "nama saya Budi")
    await client.redis.set(client.keys.session("held").lock, "someone-else", px=30_000)
    stats = json.loads((await acli(env, "stats")).stdout)
    # Every field with its value: one unread entry, nothing else anywhere.
    age = stats.pop("oldest_pending_age_s")
    assert 0 <= age < 60
    assert stats == {
        "stream": "dialog",
        "group": "dialog-workers",
        "stream_length": 1,
        "lag": 1,
        "pending": 0,
        "waiting": 0,
        "queued": 0,
        "delayed": 0,
        "dlq_length": 0,
        "consumers": 0,
        "trimmed": 0,
        "id_ahead": None,
        "trim_check_error": None,
    }
    view = json.loads((await acli(env, "session", "held")).stdout)
    assert 0 < view["lock"].pop("ttl_ms") <= 30_000
    assert view == {
        "session_id": "held",
        "lock": {"token": "someone-else"},
        "applied_seq": 0,
        "last_seq": 0,
        "version": 0,
        "step": None,
        "in_flight": None,
        "next_look_in_s": None,
        "waiting": [],
        "dead_letters": [],
    }


async def test_verify_passes_against_running_workers_and_fails_without(env, workers):
    failed = await acli(env, "verify", "--sessions", "2", "--burst", "2", "--timeout", "1")
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["ok"] is False
    workers.start(2)
    result = await acli(env, "verify", "--sessions", "50", "--burst", "10", "--timeout", "60")
    report = json.loads(result.stdout)
    assert result.returncode == 0, report
    assert report["ok"] and report["messages"] == 2 + 50 * 10


async def test_verify_passes_against_workers_running_a_custom_engine(env, workers):
    engine = {"DIALOG_ENGINE": "app_engines:Counter"}  # its memory is an int, not a dict
    workers.start(1, **engine)
    result = await acli(env, "verify", "--sessions", "5", "--burst", "3", **engine)
    report = json.loads(result.stdout)
    assert result.returncode == 0, (report, result.stderr)
    assert report["ok"] and (report["sessions"], report["messages"]) == (5, 15)


async def test_idle_consumers_are_deleted_only_when_they_own_nothing(client, workers):
    k = client.keys
    await client.redis.xgroup_create(k.stream, k.group, id="0", mkstream=True)
    await client.redis.xgroup_createconsumer(k.stream, k.group, "ghost")
    sent = await send_bursts(client, ["orphan"], ["nama saya Budi"])
    await client.redis.xreadgroup(k.group, "crashed", {k.stream: ">"}, count=1)
    workers.start(
        1,
        DIALOG_CONSUMER_IDLE_DELETE_S="1",
        DIALOG_RECLAIM_INTERVAL_MS="100",
        DIALOG_VISIBILITY_TIMEOUT_MS="1500",
        DIALOG_LOCK_TTL_MS="1000",
    )
    # "crashed" still owns an entry: it is reclaimed first, then the consumer may go.
    assert await wait_applied(client, sent, timeout_s=20)
    assert await check(client, sent) == []
    deadline = time.monotonic() + 20
    while True:
        names = {c["name"] for c in await client.redis.xinfo_consumers(k.stream, k.group)}
        if not names & {"ghost", "crashed"}:
            break
        assert time.monotonic() < deadline, f"idle consumers not deleted: {names}"
        await anyio.sleep(0.1)


async def test_dead_letters_that_are_not_utf8_are_shown_escaped_and_not_redriven(env, client):
    raw = client.raw
    bad = await raw.xadd(
        "dialog-dlq",
        {"session_id": "s1", "text": b"\xff\xfe", "error": "text is not valid UTF-8",
         "error_kind": "malformed", "source_stream": "dialog"},
    )  # fmt: skip
    good = await raw.xadd(
        "dialog-dlq",
        {"session_id": "s2", "text": "halo", "channel": "web", "error": "boom",
         "error_kind": "exhausted", "attempts": "5", "source_stream": "dialog"},
    )  # fmt: skip
    listed = await acli(env, "dlq", "list")
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["session_id"] for line in listed.stdout.splitlines()] == ["s1", "s2"]
    shown = await acli(env, "dlq", "show", bad.decode())
    assert shown.returncode == 0, shown.stderr
    assert "\\xff\\xfe" in json.loads(shown.stdout)["text"]
    view = await acli(env, "session", "s1")
    assert view.returncode == 0 and len(json.loads(view.stdout)["dead_letters"]) == 1
    redriven = await acli(env, "dlq", "redrive")
    assert redriven.returncode == 0, redriven.stderr
    assert json.loads(redriven.stdout) == {"redriven": 1, "skipped": 1}
    assert "not UTF-8" in redriven.stderr
    assert [i for i, _ in await raw.xrange("dialog-dlq")] == [bad]  # kept for a human
    [(_, resent)] = await client.redis.xrange("dialog")
    assert resent == {"session_id": "s2", "text": "halo", "channel": "web",
                      "msg_id": f"redrive:{good.decode()}"}  # fmt: skip
