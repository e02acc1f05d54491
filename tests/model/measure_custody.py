"""What custody costs: bytes per queued message and Redis commands per message, measured on a
private redis-server with the worker's own scripts (not a test; docs/benchmarks.md quotes it).

    .venv/bin/python tests/model/measure_custody.py [LUA_DIR] [--history]

LUA_DIR defaults to this checkout's lua/; point it at another version's scripts to compare
(`git archive <commit> lua | tar -x -C /tmp/old` then `/tmp/old/lua`). 1,000 sessions x 10
messages (text of 40 bytes, an explicit 36-character msg_id, one extra field) are appended,
read by intake (1,000 per call) and left queued: "queued" is the memory of sequenced,
unapplied messages (stream, state hashes, dedupe keys) per message. Then every message is
applied by group commits of what each intake returned plus hand-off, and `INFO commandstats`
gives the commands Redis ran (script calls and the commands inside them) per message.
With --history every session already has a state of about 1 KB (a few turns of history, as
after its first messages), so its state hash is already in Redis' hashtable encoding.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))
from redis_server import RedisServer

from dialog_worker.config import Settings
from dialog_worker.store.keys import Keys

SESSIONS, PER_SESSION = 1000, 10
TTL_MS = 60_000


def scripts(r: redis.Redis, lua: Path) -> dict[str, Any]:
    prelude = (lua / "_common.lua").read_text()
    found = {}
    for name in ("intake", "commit"):
        [path] = sorted(lua.glob(f"{name}-*.lua"))
        found[name] = r.register_script(prelude + "\n" + path.read_text())
    return found


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def calls(r: redis.Redis) -> dict[str, int]:
    return {k: int(v["calls"]) for k, v in r.info("commandstats").items()}


def main(lua: Path, history: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            return measure(redis.Redis.from_url(server.url), lua, history)
        finally:
            server.stop()


def measure(r: redis.Redis, lua: Path, history: bool) -> dict[str, Any]:
    k = Keys.from_settings(Settings())
    sc = scripts(r, lua)
    # Values per commit: 11, or 13 in scripts with the reserved and timer arguments.
    found = re.search(r"local WIDTH = (\d+)", (lua / "commit-5.lua").read_text())
    width = int(found.group(1)) if found else 11
    r.xgroup_create(k.stream, k.group, id="0", mkstream=True)
    if history:
        turn = {"seq": 0, "msg_id": str(uuid.uuid4()), "user": "x" * 60, "bot": "y" * 60}
        doc = json.dumps({"step": "ROOT", "memory": {}, "history": [turn] * 5})
        p = r.pipeline(transaction=False)
        for s in range(SESSIONS):
            p.hset(k.session(f"sesi-{s:04d}").state, mapping={"d": doc, "v": 0, "s": 0})
        p.execute()
    base = used(r)
    n = SESSIONS * PER_SESSION
    for i in range(PER_SESSION):
        p = r.pipeline(transaction=False)
        for s in range(SESSIONS):
            text = f"pesan nomor {i:02d} " + "x" * 25
            fields = {"session_id": f"sesi-{s:04d}", "text": text, "channel": "web"}
            p.xadd(k.stream, {**fields, "msg_id": str(uuid.uuid4())})
        p.execute()
    unread = used(r)
    r.config_resetstat()
    jobs: list[list[Any]] = []
    calls_token = 0
    while True:
        calls_token += 1
        reply = sc["intake"](
            keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
            args=[k.group, "m1", 1000, f"t{calls_token}", TTL_MS, 86400, 65536, 32, 1000,
                  "measure", 0, "maaf"],
        )  # fmt: skip
        jobs += reply[2]
        if int(reply[1]) == 0:
            break
    queued = used(r)
    applied = 0
    pending = [(j[0], j[1], int(j[2]), j[3], int(j[6])) for j in jobs]
    while pending:
        args: list[Any] = [TTL_MS, 86400, 1000, len(pending)]
        for sid, token, seq, entry_id, version in pending:
            doc = json.dumps({"history": [{"seq": seq}], "pad": "z" * 900 * history})
            args += [token, sid, seq, version, doc, "m", "ok", "applied", entry_id, "", ""]
            args += [""] * (width - 11)  # newer scripts: reply extras, timer operations
        results = sc["commit"](keys=[k.stream, k.ready, k.session_prefix, k.replies, k.dlq],
                               args=args)  # fmt: skip
        applied += len(pending)
        pending = [
            (sid, token, int(res[2]), res[3], int(res[1]))
            for (sid, token, *_), res in zip(pending, results, strict=True)
            if int(res[0]) == 2
        ]
    stats = calls(r)
    script_calls = stats.get("cmdstat_evalsha", 0) + stats.get("cmdstat_eval", 0)
    total = sum(stats.values())
    assert applied == n, (applied, n)
    return {
        "messages": n,
        "bytes_per_unread_message": round((unread - base) / n, 1),
        "bytes_per_queued_message": round((queued - base) / n, 1),
        "redis_commands_per_message": round(total / n, 2),
        "script_calls_per_message": round(script_calls / n, 3),
        "commands": {c.removeprefix("cmdstat_"): v for c, v in sorted(stats.items())},
    }


if __name__ == "__main__":
    here = Path(__file__).resolve().parent.parent.parent / "lua"
    given = [a for a in sys.argv[1:] if not a.startswith("--")]
    result = main(Path(given[0]) if given else here, "--history" in sys.argv)
    print(json.dumps(result, indent=1))
