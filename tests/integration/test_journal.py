"""The step journal and interrupts against real worker processes and a real Redis: once per
message across re-runs, a step that waits for a person and goes on where it stopped, a resume
applied once, timeouts, restarts, cancel, reset and delete (tests/support/journal_engines.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis_server import wait_for

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.integration

KEYS = Keys.from_settings(Settings())


def calls(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def start(workers: Any, tmp_path: Path, engine: str = "Agent", n: int = 1, **env: str) -> Path:
    log = tmp_path / "calls.txt"
    workers.start(
        n,
        DIALOG_ENGINE=f"journal_engines:{engine}",
        JOURNAL_CALLS=str(log),
        JOURNAL_HOLD=str(tmp_path / "hold"),
        **env,
    )
    return log


def events(url: str, sid: str) -> list[dict[str, str]]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [f for _, f in r.xrange("dialog-replies") if f["session_id"] == sid]


async def pending_one(client: DialogClient, sid: str) -> Any:
    async def found() -> Any:
        got = await client.pending(sid)
        return got[0] if got else None

    return await wait_for(found)


@pytest.mark.parametrize("engine", ["Agent", "SyncAgent"])
async def test_a_step_waits_for_a_person_and_goes_on_where_it_stopped(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path, engine: str
) -> None:
    log = start(workers, tmp_path, engine)
    reply = await client.ask("r1", "refund 40", msg_id="m1", timeout=20)
    assert reply.outcome == "awaiting" and reply.seq == 1
    assert reply.interrupt_id == "m1:1:1"
    assert reply.payload == {"approve": "refund 40", "quote": {"i": 0}}
    waiting = await client.pending("r1")
    assert [(p.interrupt_id, p.msg_id, p.seq, p.payload) for p in waiting] == [
        ("m1:1:1", "m1", 1, {"approve": "refund 40", "quote": {"i": 0}})
    ]
    assert calls(log) == ["m1 0"]  # the quote, once
    result = await client.resume("r1", "m1:1:1", True)
    assert result.status == "resumed"
    url = env["REDIS_URL"]
    done = await wait_for(lambda: [e for e in events(url, "r1") if e["outcome"] == "applied"])
    assert [(e["seq"], e["reply"]) for e in done] == [("1", "refunded")]
    # The quote was answered by the journal in the run after the resume; the refund ran once.
    assert calls(log) == ["m1 0", "m1 99"]
    assert await client.pending("r1") == []
    r = redis.Redis.from_url(url)
    assert r.exists(KEYS.session("r1").journal("m1")) == 0  # deleted with the commit
    state = await client.state("r1")
    assert state is not None and state["applied_seq"] == 1
