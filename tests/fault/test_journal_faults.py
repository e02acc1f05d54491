"""The step journal under kill -9: a worker killed after the second of three journaled calls
of a step; the message's next attempt, on another worker, gets calls 1-2 from the journal
(each seen exactly once) and makes call 3 only, and the answer completes; its log says which
calls the journal answered (by name, never their results)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import wait_for

from dialog_worker.client.dialog_client import DialogClient

pytestmark = pytest.mark.fault


@pytest.mark.parametrize("engine", ["Agent", "SyncAgent"])
async def test_a_worker_killed_mid_step_does_not_repeat_the_calls_already_journaled(
    workers: Any, client: DialogClient, env: dict[str, str], tmp_path: Path, engine: str
) -> None:
    log, hold = tmp_path / "calls.txt", tmp_path / "hold"
    hold.touch()
    extra = {
        "DIALOG_ENGINE": f"journal_engines:{engine}",
        "JOURNAL_CALLS": str(log),
        "JOURNAL_HOLD": str(hold),
        "DIALOG_LOCK_TTL_MS": "1000",
    }
    [first] = workers.start(1, **extra)
    await client.send("k1", "tools 3 hold", msg_id="m1")
    await wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == 2)
    first.kill()  # kill -9 after the 2nd of 3 journaled calls
    hold.unlink()
    [second] = workers.start(1, DIALOG_LOG_LEVEL="info", **extra)
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)

    def answered() -> list[dict[str, str]]:
        return [f for _, f in r.xrange("dialog-replies") if f["outcome"] == "applied"]

    [reply] = await wait_for(answered, timeout_s=30)
    assert reply["reply"] == "done 1 2 3"
    assert log.read_text().splitlines() == ["m1 1", "m1 2", "m1 3"]  # each call once
    assert r.exists("dialog:{dialog}:s:{k1}:journal:m1") == 0
    lines = [json.loads(line) for line in second.log_text().splitlines() if line.startswith("{")]
    replayed = [
        (e["once"], e["session_id"], e["msg_id"], e["attempt"])
        for e in lines
        if e.get("event") == "journal_replayed"
    ]
    assert replayed == [("tool:1", "k1", "m1", 2), ("tool:2", "k1", "m1", 2)]
    assert not any('"i"' in line for line in second.log_text().splitlines())  # no results
