"""How fast the console's pages answer on a large Redis (docs/benchmarks.md, "Console pages").

    .venv/bin/python tests/console/measure_scale.py [--sessions 100000] [--letters 10000]
        [--history 10]

Starts its own redis-server, writes N session state hashes (as the worker leaves them: state
JSON with a ten-turn history, version, seqs) and M dead letters spread over 1,000 sessions
(each indexed in its session's letter index, as the scripts do),
starts `dialog-worker console` on it, and times each page over real HTTP: the median and the
95th percentile of 30 requests after 3 warm-up ones. Not part of the suite (it takes a
minute to fill Redis)."""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))

import redis  # noqa: E402
from redis_server import RedisServer, free_port, wait_until  # noqa: E402

from dialog_worker.config import load_settings  # noqa: E402
from dialog_worker.store.keys import Keys  # noqa: E402

USER = ("olga", "operator-token-0001")


def fill(url: str, sessions: int, letters: int, turns: int) -> Keys:
    r = redis.Redis.from_url(url)
    keys = Keys.from_settings(load_settings(environ={"REDIS_URL": url}))
    history = [
        {"seq": i, "msg_id": f"m{i}", "user": "halo " * 8, "bot": "hai " * 12} for i in range(turns)
    ]
    pipe = r.pipeline(transaction=False)
    for i in range(sessions):
        sid = f"user-{i:07d}"
        state = {"step": "ROOT", "memory": {"name": "x"}, "history": history, "session_id": sid}
        pipe.hset(
            keys.session(sid).state,
            mapping={"d": json.dumps(state), "v": "10", "a": "10", "s": "10"},
        )
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    owners: list[str] = []
    for i in range(letters):
        sid = f"user-{i % 1000:07d}"
        owners.append(sid)
        pipe.xadd(
            keys.dlq,
            {
                "session_id": sid,
                "msg_id": f"letter-{i}",
                "text": "please help " * 4,
                "seq": str(11 + i // 1000),
                "error_kind": "engine_error" if i % 50 else "timeout",
                "error": "RuntimeError: upstream said 503",
                "attempts": "5",
                "source_stream": keys.stream,
            },
        )
        if i % 1000 == 999:
            _index(r, keys, owners, pipe.execute())
            owners = []
    _index(r, keys, owners, pipe.execute())
    return keys


def _index(r: redis.Redis, keys: Keys, owners: list[str], ids: list[bytes]) -> None:
    """What the scripts write with each letter: its session's letter index (newest 1,000)
    and the first indexed letter."""
    pipe = r.pipeline(transaction=False)
    for sid, raw in zip(owners, ids, strict=True):
        entry_id = raw.decode()
        pipe.set(keys.letters_since, entry_id, nx=True)
        pipe.zadd(keys.session(sid).letters, {entry_id: int(entry_id.split("-")[0])})
        pipe.zremrangebyrank(keys.session(sid).letters, 0, -1001)
    pipe.execute()


def timed(url: str, runs: int = 30) -> tuple[float, float, int]:
    token = base64.b64encode(f"{USER[0]}:{USER[1]}".encode()).decode()
    request = urllib.request.Request(url, headers={"authorization": f"Basic {token}"})
    samples = []
    status = 0
    for n in range(runs + 3):
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        if n >= 3:
            samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.95) - 1], status


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=100_000)
    p.add_argument("--letters", type=int, default=10_000)
    p.add_argument("--history", type=int, default=10, help="turns kept in each state")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            started = time.monotonic()
            fill(server.url, args.sessions, args.letters, args.history)
            r = redis.Redis.from_url(server.url)
            print(
                f"filled: {r.dbsize()} keys, {args.letters} dead letters, "
                f"{r.info('memory')['used_memory_human']} in {time.monotonic() - started:.0f} s"
            )
            port = free_port()
            env = {
                "REDIS_URL": server.url,
                "DIALOG_CONSOLE_OPERATORS": f"{USER[0]}:{USER[1]}",
                "DIALOG_CONSOLE_PORT": str(port),
                "PATH": "/usr/bin:/bin",
            }
            console = subprocess.Popen([sys.executable, "-m", "dialog_worker", "console"], env=env)
            base = f"http://127.0.0.1:{port}"
            try:
                wait_until(lambda: _up(base), 30, what="the console")
                pages = [
                    "/",
                    "/api/overview",
                    "/session?id=user-0000500",  # 10 dead letters of its own
                    "/session?id=user-0099999",  # none
                    "/letters",
                    "/letters?limit=200",
                    "/letters?kind=timeout",
                    "/letters?session=user-0000500",
                    "/letters?older_than=1h",
                    "/message?msg_id=nothing-like-it",  # 404: one GET
                    "/api/sessions?prefix=user-00005",
                    "/audit",
                ]
                print(f"{'page':40} {'median ms':>10} {'p95 ms':>8}  status")
                for page in pages:
                    median, p95, status = timed(base + page)
                    print(f"{page:40} {median:10.1f} {p95:8.1f}  {status}")
            finally:
                console.terminate()
                console.wait(10)
        finally:
            server.stop()


def _up(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


if __name__ == "__main__":
    main()
