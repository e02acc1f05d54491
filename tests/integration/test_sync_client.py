"""`SyncDialogClient` against a real worker, as a Flask or Django app uses it: plain calls from
several threads, a client made before a pre-forking server forks, and a clear refusal inside
an event loop."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest
from worker_procs import WorkerPool

from dialog_worker import SyncDialogClient
from dialog_worker.config import load_settings

pytestmark = pytest.mark.integration

HELLO = "Halo Budi, ada yang bisa dibantu?"


def test_send_ask_and_state_without_an_event_loop(env: dict[str, str], workers: WorkerPool):
    workers.start(1)
    with SyncDialogClient(settings=load_settings(environ=env)) as client:
        sent = client.send("sync-1", "nama saya Budi", msg_id="m-1")
        assert (sent.session_id, sent.msg_id) == ("sync-1", "m-1") and sent.entry_id
        reply = client.ask("sync-1", "saya ada kendala billing", timeout=20)
        assert (reply.outcome, reply.seq) == ("applied", 2)
        state = client.state("sync-1")
        assert state is not None and state["memory"] == {"userName": "Budi"}
        again = client.ask("sync-1", "nama saya Budi", msg_id="m-1", timeout=20)
        assert (again.outcome, again.seq, again.text) == ("duplicate", 1, HELLO)
        assert client.state("never-seen") is None


def test_one_client_serves_many_threads_at_once(env: dict[str, str], workers: WorkerPool):
    workers.start(1)
    replies: dict[int, str] = {}
    errors: list[BaseException] = []
    with SyncDialogClient(settings=load_settings(environ=env)) as client:

        def request(i: int) -> None:  # one web request, on its own server thread
            try:
                replies[i] = client.ask(f"thread-{i}", f"nama saya U{i}", timeout=30).text
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=request, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert errors == []
    assert replies == {i: f"Halo U{i}, ada yang bisa dibantu?" for i in range(16)}


FORKING_SERVER = """
import gc, os, sys
from dialog_worker import SyncDialogClient

client = SyncDialogClient()  # made at import, as a module of a pre-forking app
print("parent", client.send("fork-parent", "nama saya Budi", msg_id="p1").msg_id, flush=True)
for _ in range(2):  # two workers of a pre-forking server, each ending with a normal exit
    pid = os.fork()
    if pid == 0:
        print("child", client.ask(f"fork-{os.getpid()}", "nama saya Budi", timeout=20).seq,
              flush=True)
        gc.collect()  # a long-lived worker collects its garbage sooner or later
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
# The parent's own connections and loop are untouched by its children (its loop is idle
# here: nothing else would wake it if a child had unregistered its descriptors).
client.state("fork-parent")
print("parent read its state", flush=True)
"""


def test_a_client_made_before_a_fork_works_in_the_children_and_the_parent(
    env: dict[str, str], workers: WorkerPool, tmp_path: Path
):
    workers.start(1)
    (tmp_path / "server.py").write_text(FORKING_SERVER, encoding="utf-8")
    ran = subprocess.run(
        [sys.executable, "server.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=15,  # about a second normally; a hung child (the bug it guards) ends the test
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "parent p1",
        "child 1",
        "child exit 0",
        "child 1",
        "child exit 0",
        "parent read its state",
    ], ran.stderr


def test_inside_an_event_loop_it_refuses_instead_of_blocking_the_loop(env: dict[str, str]):
    client = SyncDialogClient(settings=load_settings(environ=env))

    async def view() -> None:
        with pytest.raises(RuntimeError, match="use DialogClient"):
            client.state("x")

    anyio.run(view)
    client.close()


def test_reset_and_delete_without_an_event_loop(env: dict[str, str], workers: WorkerPool):
    import time

    import redis

    from dialog_worker.errors import ValidationError
    from dialog_worker.store.keys import Keys, audit_key

    workers.start(1)
    settings = load_settings(environ=env)
    keys = Keys.from_settings(settings)
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    with SyncDialogClient(settings=settings) as client:
        client.ask("sync-e", "nama saya Budi", timeout=20)
        assert client.ask("sync-e", "saya ada kendala billing", timeout=20).seq == 2
        reset = client.reset("sync-e", who="admin", reason="start over")
        assert (reset.action, reset.found, reset.waiting, reset.running) == (
            "reset",
            True,
            0,
            False,
        )
        state = client.state("sync-e")
        assert state is not None and (state["memory"], state["history"]) == ({}, [])

        # A timer (a message sent to be delivered in an hour) and a dead letter.
        r.xadd(
            keys.stream,
            {"session_id": "sync-e", "text": "later", "deliver_at": f"{time.time() + 3600:.3f}"},
        )
        r.xadd(keys.dlq, {"session_id": "sync-e", "text": "failed", "error_kind": "engine_error"})
        timers = keys.session("sync-e").timers
        deadline = time.monotonic() + 20
        while not r.exists(timers):
            assert time.monotonic() < deadline, "the timer was never scheduled"
            time.sleep(0.05)
        deleted = client.delete("sync-e", who="admin", reason="user asked")
        assert (deleted.action, deleted.found, deleted.timers, deleted.dead_letters) == (
            "delete",
            True,
            1,
            1,
        )
        assert client.state("sync-e") is None
        assert [k for k in r.scan_iter(match="*sync-e*")] == []
        assert r.zcard(keys.timers) == 0
        with pytest.raises(ValidationError):
            client.reset("")
    events = [f for _, f in r.xrange(audit_key(settings))]
    assert [(e["action"], e["target"], e["who"], e["reason"]) for e in events] == [
        ("session_reset", "sync-e", "admin", "start over"),
        ("session_delete", "sync-e", "admin", "user asked"),
    ]


def test_stream_ask_stream_and_cancel_without_an_event_loop(
    env: dict[str, str], workers: WorkerPool
):
    """For Flask and Django: an answer streams as a plain iterator, event by event, and a
    message can be stopped; leaving the loop early closes the reader."""
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    with SyncDialogClient(settings=load_settings(environ=env)) as c:
        events = list(c.ask_stream("sy-s", "30 5", msg_id="s1", timeout=30))
        answer = "".join(f"w{i} " for i in range(30))
        assert (events[-1].kind, events[-1].outcome, events[-1].text) == ("end", "applied", answer)
        assert "".join(e.text for e in events[:-1]) == answer
        again = list(c.stream("sy-s", "s1", after=events[1].cursor, timeout=10))
        assert [e.pos for e in again[:-1]] == [e.pos for e in events[2:-1]]
        shown = []
        for event in c.ask_stream("sy-s", "400 20", msg_id="s2", timeout=30):
            shown.append(event)
            if len(shown) == 2:
                assert c.cancel("sy-s", "s2").status == "cancelled"
        assert (shown[-1].kind, shown[-1].outcome) == ("end", "cancelled")
        for _event in c.stream("sy-s", "s1", timeout=10):
            break  # stopping early is fine: the next call still works
        assert c.state("sy-s") is not None
