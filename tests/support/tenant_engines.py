"""An engine for the tenant scheduling tests, loaded by worker processes with
DIALOG_ENGINE=tenant_engines:Paced. Each step sleeps as long as its message's ``sleep`` field
says (seconds, default 0.05) and appends a JSON line (tenant, session, seq, start and end
times, pid) to the file named by TENANT_ENGINE_LOG, so a test can count who ran when, and
how many steps of a tenant overlapped, across worker processes."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import anyio


class Paced:
    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        started = time.time()
        await anyio.sleep(float(message["meta"].get("sleep", "0.05")))
        line = {
            "tenant": message["meta"].get("tenant", "default"),
            "session_id": message["session_id"],
            "seq": message["seq"],
            "start": started,
            "end": time.time(),
            "pid": os.getpid(),
        }
        with open(os.environ["TENANT_ENGINE_LOG"], "a", encoding="utf-8") as log:  # noqa: ASYNC230 (a short local append)
            log.write(json.dumps(line) + "\n")
        return state, "ok"


def steps(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as log:
        return sorted((json.loads(line) for line in log), key=lambda s: s["start"])


def most_at_once(runs: list[dict[str, Any]]) -> int:
    """The most steps of `runs` that overlapped in time."""
    edges = sorted([(r["start"], 1) for r in runs] + [(r["end"], -1) for r in runs])
    most = now = 0
    for _, change in edges:
        now += change
        most = max(most, now)
    return most


def share(r: Any, tenant: str, weight: float = 1, least: int = 0, most: int = 0) -> None:
    """A tenant's settings as `dialog-worker tenants set` leaves them (one shard, the default
    names): the deployment's hash, and the shard's copy the scripts read (a worker makes the
    copy match the hash when it starts)."""
    doc = {"weight": float(weight), "min": least, "max": most}
    r.hset("dialog:tenants", tenant, json.dumps(doc, sort_keys=True))
    r.hset("dialog:{dialog}:ready:tset", tenant, f"{float(weight)!r} {least} {most}")
    if least:
        r.zadd("dialog:{dialog}:ready:tmin", {tenant: least})
