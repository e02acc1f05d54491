"""`dialog-worker bench`: a load generator that measures throughput, latency, Redis cost and
correctness of dialog-worker, optionally side by side with the comparison workers of bench/.

One JSON object on stdout; progress and a human summary on stderr. Exit 0, or 1 when any run
of dialog-worker ("ours") breaks a guarantee (lost, duplicated, out of order, missing or extra
reply, not applied), or 2 for a usage problem (e.g. --plot without matplotlib).

Workload. N sessions x B messages ("nama saya Budi", then "pesan 2".."pesan B"), sent through
lua/send-3.lua in pipelines on one connection, so a session's messages are enqueued in order.
`--mode burst` sends everything at once while the workers run, sessions in groups of
`--senders` with a group's messages interleaved (a session's consecutive messages are about
`--senders` entries apart, as `dialog-worker verify` sends them). `--rate R --duration S` sends
R messages/s for S seconds, round robin over the N sessions, in ticks of 2 ms.

Latency. Primary: enqueue to reply as the bench client sees it (perf_counter just before the
send pipeline is written, to the moment the bench's XREAD BLOCK on the reply stream returns the
reply). It includes the bench's own scheduling, the same for every system. Secondary
(`latency_redis_ms`): reply entry ID time minus inbound entry ID time, both Redis clock, 1 ms
resolution.

Redis cost. INFO commandstats deltas over the run. Top-level commands and round trips of the
worker processes are counted inside them: spawned workers run under a counting shim
(`python -m worker.bench _count MODULE ...`, which wraps redis-py's pack_command and
send_packed_command) and the bench counts its own the same way, so commands inside scripts =
all commands - top-level commands (the producer's send script is calibrated once). CPU: INFO cpu
delta for Redis, /proc/<pid>/stat utime+stime for the spawned workers, getrusage for the bench.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import importlib
import json
import math
import os
import platform
import resource
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import anyio
from redis.asyncio import Redis

from worker.config import Settings
from worker.errors import ValidationError
from worker.keys import Keys
from worker.redis_conn import connect
from worker.scripts import source
from worker.verify import Sent as VSent

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
SYSTEMS = ("ours", "naive", "seed", "peer", "bare")
# How each system's worker process is started (python -m MODULE ARGS).
WORKER_MODULES: dict[str, list[str]] = {
    "ours": ["worker", "run"],
    "naive": ["bench.naive_worker"],
    "seed": ["bench.seed_worker"],
    "peer": ["bench.peer_worker"],
    "bare": ["bench.bare_roundtrip"],
}
STATEFUL = {"ours", "naive", "seed", "peer"}
PIPELINE_CHUNK = 500
TICK_S = 0.002
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Commands the bench issues for itself and that no worker ever counts (kept out of totals).
_ADMIN_COMMANDS = {"info", "config", "client", "script", "hello", "ping", "select"}


# ------------------------------------------------------------------------------------------
# small pure helpers


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation between closest ranks (as
    numpy's default); None for no values."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {
        "p50": r(percentile(values, 50)),
        "p95": r(percentile(values, 95)),
        "p99": r(percentile(values, 99)),
        "max": r(max(values)) if values else None,
        "mean": r(sum(values) / len(values)) if values else None,
        "count": len(values),
    }


def inversions(seqs: Sequence[int]) -> int:
    """Messages applied after one with a higher seq (each counted once)."""
    late, highest = 0, -1
    for s in seqs:
        if s < highest:
            late += 1
        highest = max(highest, s)
    return late


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def id_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------
# the round-trip counting shim (runs inside worker processes and inside the bench itself)


class CommandCounter:
    """Counts redis-py commands (per name) and round trips (one per packed write) of this
    process by wrapping redis.asyncio's Connection methods. Installed once per process."""

    def __init__(self) -> None:
        self.round_trips = 0
        self.setup_round_trips = 0
        self.commands = 0
        self.by_name: Counter[str] = Counter()
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        from redis.asyncio.connection import AbstractConnection

        counter = self
        original_pack = AbstractConnection.pack_command
        original_send = AbstractConnection.send_packed_command

        def pack_command(conn: Any, *args: Any) -> Any:
            head = args[0] if args else b""
            name = (head.decode() if isinstance(head, bytes) else str(head)).split(" ", 1)[0]
            name = name.lower()
            counter.commands += 1
            counter.by_name[name] += 1
            conn._bench_last_command = name
            return original_pack(conn, *args)

        async def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> Any:
            # Connection set-up (HELLO, CLIENT SETINFO, ...) is counted apart: it is paid
            # once per pooled connection, not per message.
            if getattr(conn, "_bench_last_command", "") in _ADMIN_COMMANDS:
                counter.setup_round_trips += 1
            else:
                counter.round_trips += 1
            return await original_send(conn, command, check_health)

        setattr(AbstractConnection, "pack_command", pack_command)  # noqa: B010
        setattr(AbstractConnection, "send_packed_command", send_packed_command)  # noqa: B010
        self.installed = True

    def snapshot(self) -> dict[str, Any]:
        return {
            "round_trips": self.round_trips,
            "setup_round_trips": self.setup_round_trips,
            "commands": self.commands,
            "by_name": dict(self.by_name),
        }


COUNTER = CommandCounter()


def _count_main(argv: list[str]) -> int:
    """`python -m worker.bench _count MODULE [ARGS...]`: run MODULE as __main__ with the
    counter installed, dumping counts to $BENCH_COUNTS_FILE every 0.2 s and at exit."""
    if not argv:
        print("usage: python -m worker.bench _count MODULE [ARGS...]", file=sys.stderr)
        return EXIT_USAGE
    COUNTER.install()
    path = os.environ.get("BENCH_COUNTS_FILE", "")

    def dump() -> None:
        if not path:
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(COUNTER.snapshot(), fh)
        os.replace(tmp, path)

    def loop() -> None:
        while True:
            with contextlib.suppress(Exception):
                dump()
            time.sleep(0.2)

    threading.Thread(target=loop, daemon=True).start()
    atexit.register(dump)
    module = argv[0]
    sys.argv = [module, *argv[1:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        dump()
        return int(exc.code) if isinstance(exc.code, int) else 0
    dump()
    return 0


# ------------------------------------------------------------------------------------------
# machine and processes


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "mem_total_gib": round(mem_kb / 1024 / 1024, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def proc_cpu_s(pid: int) -> float | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = data[data.rfind(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def proc_rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def source_root() -> Path | None:
    """The checkout that holds bench/ next to worker/ (comparisons need it)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "bench" / "common.py").is_file() else None


class EmbeddedRedis:
    """A redis-server of the bench's own on a free loopback port (AOF everysec, as the README's
    guarantees assume; no RDB snapshots; noeviction)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ValidationError(
                "--redis embedded needs redis-server (apt-get install redis-server)"
            )
        self.dir = Path(tempfile.mkdtemp(prefix="dialog-bench-redis-"))
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                "noeviction",
                "--logfile",
                str(self.dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("could not start the embedded redis-server")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclasses.dataclass
class WorkerProcess:
    system: str
    name: str
    proc: subprocess.Popen[bytes]
    metrics_port: int
    counts_file: Path
    stats_file: Path
    log_file: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def counts(self) -> dict[str, Any]:
        return _read_json(self.counts_file)

    def ready(self) -> bool:
        if self.metrics_port:
            try:
                url = f"http://127.0.0.1:{self.metrics_port}/readyz"
                with urllib.request.urlopen(url, timeout=1) as r:
                    return int(r.status) == 200
            except OSError:
                return False
        return self.stats_file.exists()

    def stats(self) -> dict[str, Any]:
        return _read_json(self.stats_file)

    def metrics(self) -> dict[str, float]:
        if not self.metrics_port:
            return {}
        return scrape_metrics(f"http://127.0.0.1:{self.metrics_port}/metrics")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return cast(dict[str, Any], json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def scrape_metrics(url: str) -> dict[str, float]:
    """`name{labels}` -> value for every dialog_ sample of a /metrics page ({} if unreachable)."""
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("dialog_"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


# ------------------------------------------------------------------------------------------
# one system under test: its settings, worker processes and producer


@dataclasses.dataclass
class Sent(VSent):
    """A sent message as worker.verify checks it, plus when the bench sent it."""

    t_send: float
    enq_ms: int


class Target:
    """A system (ours or a comparison worker) with its own key namespace and processes."""

    def __init__(self, system: str, settings: Settings, args: argparse.Namespace, run: str):
        self.system = system
        self.settings = settings
        self.args = args
        self.run = run
        self.keys = Keys.from_settings(settings)
        self.workers: list[WorkerProcess] = []
        self.tmp = Path(tempfile.mkdtemp(prefix=f"dialog-bench-{system}-"))
        self.redis: Redis = connect(settings, max_connections=16)
        self.send_sha = ""
        self.peer: Any = None
        self.send_internal_cmds: float = 0.0
        self.peer_seq: dict[str, int] = {}

    # -- processes ----------------------------------------------------------------------

    def env(self, name: str, metrics_port: int, counts: Path, stats: Path) -> dict[str, str]:
        env = dict(os.environ)
        root = source_root()
        pkg_parent = str(Path(__file__).resolve().parent.parent)
        paths = [p for p in (str(root) if root else "", pkg_parent) if p]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        s = self.settings
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
                "REDIS_URL": s.redis_url,
                "DIALOG_STREAM": s.stream,
                "DIALOG_GROUP": s.group,
                "DIALOG_REPLY_STREAM": s.reply_stream,
                "DIALOG_DLQ_STREAM": s.dlq_stream,
                "DIALOG_KEY_PREFIX": s.prefix,
                "DIALOG_CONSUMER": name,
                "DIALOG_LOG_LEVEL": "warning",
                "DIALOG_METRICS_HOST": "127.0.0.1",
                "DIALOG_METRICS_PORT": str(metrics_port),
                "BENCH_COUNTS_FILE": str(counts),
                "BENCH_STATS_FILE": str(stats),
            }
        )
        if self.args.concurrency:
            env["DIALOG_CONCURRENCY"] = str(self.args.concurrency)
        return env

    async def start_workers(self, n: int) -> None:
        if n and self.system != "ours" and source_root() is None:
            raise ValidationError("--compare needs a source checkout (bench/ next to worker/)")
        self._spawn(n)
        await self._wait_ready()

    def _spawn(self, n: int) -> None:
        for i in range(n):
            name = f"bench-{self.system}-{i + 1}-{self.run}"
            port = free_port() if self.system == "ours" else 0
            counts, stats = self.tmp / f"{name}.counts.json", self.tmp / f"{name}.stats.json"
            log = self.tmp / f"{name}.log"
            cmd = [sys.executable, "-m", "worker.bench", "_count", *WORKER_MODULES[self.system]]
            with log.open("wb") as fh:
                proc = subprocess.Popen(
                    cmd,
                    env=self.env(name, port, counts, stats),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.workers.append(WorkerProcess(self.system, name, proc, port, counts, stats, log))

    async def _wait_ready(self) -> None:
        """Every spawned worker is ready: /readyz answers 200 (ours), or the worker has
        created its group and written its first counters file (comparison workers)."""
        deadline = time.monotonic() + 30
        waiting = list(self.workers)
        while waiting:
            for w in self.workers:
                if w.proc.poll() is not None:
                    raise RuntimeError(
                        f"{w.name} exited with {w.proc.returncode}: "
                        f"{w.log_file.read_text(errors='replace')[-1500:]}"
                    )
            waiting = [w for w in waiting if not await anyio.to_thread.run_sync(w.ready)]
            if waiting and time.monotonic() > deadline:
                names = [w.name for w in waiting]
                raise RuntimeError(f"workers not ready within 30 s: {names}")
            if waiting:
                await anyio.sleep(0.05)

    def stop_workers(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.proc.wait(30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(10)

    async def close(self, keep_data: bool, namespaced: bool) -> None:
        self.stop_workers()
        if namespaced and not keep_data:
            # Everything of this system's namespace: streams, session keys, delayed set.
            for pattern in (f"{self.settings.prefix}*", f"{self.settings.stream}*"):
                async for key in self.redis.scan_iter(match=pattern, count=1000):
                    await self.redis.unlink(key)
        await self.redis.aclose()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- producing ----------------------------------------------------------------------

    async def start_producer(self) -> None:
        if self.system == "peer":
            module = importlib.import_module("bench.peer_worker")
            self.peer = module.Producer(self.settings, self.args.senders)
            await self.peer.start()
            return
        self.send_sha = await self.redis.script_load(source("send"))
        self.send_internal_cmds = await self._calibrate_send()

    async def _calibrate_send(self) -> float:
        """Commands the send script runs inside Redis per message (for the split of script
        commands between producer and workers): 50 sends to a scratch stream, INFO delta."""
        scratch = f"{self.settings.prefix}-calibration-{self.run}"
        sk = self.keys.session(scratch)
        before = await command_calls(self.redis)
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in range(50):
                pipe.evalsha(
                    self.send_sha,
                    3,
                    sk.state,
                    sk.dedupe(f"c{i}"),
                    scratch,
                    scratch,
                    f"c{i}",
                    "x",
                    60,
                    60,
                )
            await pipe.execute()
        after = await command_calls(self.redis)
        await self.redis.delete(scratch, sk.state, *[sk.dedupe(f"c{i}") for i in range(50)])
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        inside = sum(v for k, v in delta.items() if k not in _ADMIN_COMMANDS and k != "evalsha")
        return inside / 50

    async def send(self, items: list[tuple[str, str]]) -> list[Sent]:
        """Enqueue in order; returns what was sent with its seq and send time."""
        out: list[Sent] = []
        if self.peer is not None:
            t = time.perf_counter()
            wall = time.time_ns() // 1_000_000
            batch = []
            for sid, text in items:
                self.peer_seq[sid] = self.peer_seq.get(sid, 0) + 1
                msg_id = uuid.uuid4().hex
                batch.append((sid, self.peer_seq[sid], msg_id, text))
                out.append(Sent(sid, self.peer_seq[sid], msg_id, text, t, wall))
            await self.peer.send(batch)
            return out
        s = self.settings
        for start in range(0, len(items), PIPELINE_CHUNK):
            chunk = items[start : start + PIPELINE_CHUNK]
            ids = [uuid.uuid4().hex for _ in chunk]
            async with self.redis.pipeline(transaction=False) as pipe:
                for (sid, text), msg_id in zip(chunk, ids, strict=True):
                    sk = self.keys.session(sid)
                    pipe.evalsha(
                        self.send_sha,
                        3,
                        sk.state,
                        sk.dedupe(msg_id),
                        self.keys.stream,
                        sid,
                        msg_id,
                        text,
                        s.dedupe_ttl_s,
                        s.state_ttl_s,
                    )
                t = time.perf_counter()
                results = await pipe.execute()
            for (sid, text), msg_id, raw in zip(chunk, ids, results, strict=True):
                out.append(Sent(sid, int(raw[0]), msg_id, text, t, id_ms(str(raw[2]))))
        return out

    async def close_producer(self) -> None:
        if self.peer is not None:
            await self.peer.close()
            self.peer = None


async def command_calls(redis: Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


# ------------------------------------------------------------------------------------------
# one measured run


@dataclasses.dataclass
class Snapshot:
    t: float
    calls: dict[str, int]
    redis_cpu_s: float
    bench: dict[str, Any]
    bench_cpu_s: float
    workers_cpu_s: dict[int, float]
    workers_rss_kb: dict[int, int]
    counts: dict[str, dict[str, Any]]
    stats: dict[str, dict[str, Any]]
    metrics: dict[str, dict[str, float]]


async def snapshot(target: Target, metrics_urls: list[str]) -> Snapshot:
    bench = COUNTER.snapshot()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    calls = await command_calls(target.redis)
    cpu = await target.redis.info("cpu")
    metrics: dict[str, dict[str, float]] = {}
    for w in target.workers:
        metrics[w.name] = await anyio.to_thread.run_sync(w.metrics)
    for url in metrics_urls:
        metrics[url] = await anyio.to_thread.run_sync(scrape_metrics, url)
    return Snapshot(
        t=time.perf_counter(),
        calls=calls,
        redis_cpu_s=float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        bench=bench,
        bench_cpu_s=ru.ru_utime + ru.ru_stime,
        workers_cpu_s={w.pid: proc_cpu_s(w.pid) or 0.0 for w in target.workers},
        workers_rss_kb={w.pid: proc_rss_kb(w.pid) or 0 for w in target.workers},
        counts={w.name: w.counts() for w in target.workers},
        stats={w.name: w.stats() for w in target.workers},
        metrics=metrics,
    )


class ReplyReader:
    """Reads the reply stream (XREAD BLOCK from the last ID before the run) and records, per
    (session, seq), when each reply reached the bench and its Redis time."""

    def __init__(self, target: Target, after: str, prefix: str) -> None:
        self.target = target
        self.after = after
        self.prefix = prefix
        self.first: dict[tuple[str, int], tuple[float, int]] = {}
        self.count: Counter[tuple[str, int]] = Counter()
        self.order: dict[str, list[int]] = defaultdict(list)
        self.dead_lettered: set[tuple[str, int]] = set()
        self.stop = False

    async def run(self) -> None:
        last = self.after
        redis = self.target.redis
        stream = self.target.keys.replies
        while not self.stop:
            reply = await redis.xread({stream: last}, count=2000, block=100)
            now = time.perf_counter()
            for _, entries in cast(list[tuple[str, list[tuple[str, dict[str, str]]]]], reply):
                for entry_id, f in entries:
                    last = entry_id
                    sid = f.get("session_id", "")
                    if not sid.startswith(self.prefix):
                        continue
                    try:
                        key = (sid, int(f.get("seq", "")))
                    except ValueError:
                        continue
                    self.count[key] += 1
                    self.order[sid].append(key[1])
                    if f.get("dead_lettered") == "1":
                        self.dead_lettered.add(key)
                    if key not in self.first:
                        self.first[key] = (now, id_ms(entry_id))


def workload_items(sessions: list[str], burst: int, senders: int) -> list[tuple[str, str]]:
    """Sessions in groups of `senders`; within a group, message k of every session before
    message k+1 of any (a session's messages go out in order)."""
    texts = ["nama saya Budi", *[f"pesan {i}" for i in range(2, burst + 1)]]
    items: list[tuple[str, str]] = []
    for g in range(0, len(sessions), senders):
        group = sessions[g : g + senders]
        for text in texts:
            items += [(sid, text) for sid in group]
    return items


class Run:
    def __init__(self, target: Target, phase: str, args: argparse.Namespace) -> None:
        self.target = target
        self.phase = phase
        self.args = args
        self.label = uuid.uuid4().hex[:6]
        self.prefix = f"bench-{target.run}-{self.label}-"
        self.sent: list[Sent] = []
        self.rss_samples: list[dict[str, Any]] = []

    def sessions(self, n: int) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(n)]

    async def execute(
        self, mode: str, sessions: int, burst: int, rate: float = 0.0, duration: float = 0.0
    ) -> dict[str, Any]:
        t = self.target
        last = cast(list[tuple[str, Any]], await t.redis.xrevrange(t.keys.replies, count=1))
        after = last[0][0] if last else "0-0"
        reader = ReplyReader(t, after, self.prefix)
        before = await snapshot(t, self.args.metrics_url)
        names = self.sessions(sessions)
        timed_out = False
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.run)
            t_start = time.perf_counter()
            if mode == "burst":
                self.sent = await t.send(workload_items(names, burst, self.args.senders))
            else:
                await self._send_at_rate(names, rate, duration)
            t_sent = time.perf_counter()
            deadline = time.monotonic() + self.args.timeout
            while True:
                missing = sum(1 for s in self.sent if (s.session_id, s.seq) not in reader.first)
                if not missing:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    progress(f"{t.system}/{self.phase}: timed out with {missing} without a reply")
                    break
                await anyio.sleep(0.01)
            t_done = max((v[0] for v in reader.first.values()), default=time.perf_counter())
            await anyio.sleep(0.4)  # let straggling duplicates arrive and counters files flush
            reader.stop = True
        after_snap = await snapshot(t, self.args.metrics_url)
        result = self._result(mode, sessions, burst, rate, duration, reader, before, after_snap)
        result["send_s"] = round(t_sent - t_start, 3)
        result["drain_s"] = round(t_done - t_start, 3)
        n = len(self.sent)
        result["throughput_msg_s"] = round(n / (t_done - t_start), 1) if t_done > t_start else None
        result["timed_out"] = timed_out
        result["correctness"] = await self._check(reader, timed_out)
        result["violations"] = violations(result["correctness"])
        if self.rss_samples:
            result["rss_samples"] = self.rss_samples
        return result

    async def _send_at_rate(self, names: list[str], rate: float, duration: float) -> None:
        t = self.target
        texts = ["nama saya Budi", "saya ada kendala billing", "pesan"]
        next_msg: dict[str, int] = defaultdict(int)
        start = time.perf_counter()
        total = int(rate * duration)
        sent = 0
        idx = 0
        sample_every = max(1.0, duration / 10)
        next_sample = 0.0
        while sent < total:
            elapsed = time.perf_counter() - start
            if elapsed >= next_sample and self.phase == "memory":
                self.rss_samples.append(
                    {
                        "t_s": round(elapsed, 1),
                        "rss_kb": {w.name: proc_rss_kb(w.pid) for w in t.workers},
                    }
                )
                next_sample += sample_every
            due = min(total, int(rate * elapsed) + 1) - sent
            if due > 0:
                items = []
                for _ in range(due):
                    sid = names[idx % len(names)]
                    idx += 1
                    k = next_msg[sid]
                    next_msg[sid] += 1
                    items.append((sid, texts[min(k, 2)] if k < 2 else f"pesan {k + 1}"))
                self.sent += await t.send(items)
                sent += due
            await anyio.sleep(TICK_S)
        if self.phase == "memory":
            self.rss_samples.append(
                {
                    "t_s": round(time.perf_counter() - start, 1),
                    "rss_kb": {w.name: proc_rss_kb(w.pid) for w in t.workers},
                }
            )

    def _result(
        self,
        mode: str,
        sessions: int,
        burst: int,
        rate: float,
        duration: float,
        reader: ReplyReader,
        a: Snapshot,
        b: Snapshot,
    ) -> dict[str, Any]:
        n = len(self.sent) or 1
        lat, lat_redis = [], []
        for s in self.sent:
            got = reader.first.get((s.session_id, s.seq))
            if got is not None:
                lat.append((got[0] - s.t_send) * 1000)
                lat_redis.append(float(got[1] - s.enq_ms))
        wall = b.t - a.t
        offered = rate if mode == "rate" else None
        achieved = None
        if mode == "rate" and self.sent:
            span = max(s.t_send for s in self.sent) - min(s.t_send for s in self.sent)
            achieved = round(len(self.sent) / span, 1) if span > 0 else None
        return {
            "system": self.target.system,
            "phase": self.phase,
            "mode": mode,
            "sessions": sessions,
            "burst": burst if mode == "burst" else None,
            "duration_s": duration if mode == "rate" else None,
            "workers": len(self.target.workers) or None,
            "messages": len(self.sent),
            "offered_rate": offered,
            "achieved_send_rate": achieved,
            "latency_ms": summarize(lat),
            "latency_redis_ms": summarize(lat_redis),
            "requeues": self._requeues(a, b, n),
            "redis": self._redis_cost(a, b, n),
            "cpu": {
                "window_s": round(wall, 3),
                "redis_ms_per_msg": round((b.redis_cpu_s - a.redis_cpu_s) * 1000 / n, 4),
                "workers_ms_per_msg": round(
                    sum(b.workers_cpu_s[p] - a.workers_cpu_s.get(p, 0) for p in b.workers_cpu_s)
                    * 1000
                    / n,
                    4,
                )
                if b.workers_cpu_s
                else None,
                "bench_ms_per_msg": round((b.bench_cpu_s - a.bench_cpu_s) * 1000 / n, 4),
                "redis_core_utilisation": round((b.redis_cpu_s - a.redis_cpu_s) / wall, 3),
                "workers_core_utilisation": round(
                    sum(b.workers_cpu_s[p] - a.workers_cpu_s.get(p, 0) for p in b.workers_cpu_s)
                    / wall,
                    3,
                )
                if b.workers_cpu_s
                else None,
            },
            "workers_rss_kb": {
                "start": list(a.workers_rss_kb.values()),
                "end": list(b.workers_rss_kb.values()),
            }
            if b.workers_rss_kb
            else None,
        }

    def _requeues(self, a: Snapshot, b: Snapshot, n: int) -> dict[str, Any]:
        by_reason: Counter[str] = Counter()
        extra: Counter[str] = Counter()
        for name, after in b.metrics.items():
            before = a.metrics.get(name, {})
            for key, value in after.items():
                delta = value - before.get(key, 0.0)
                if key.startswith("dialog_retries_total{"):
                    by_reason[key.split('"')[1]] += int(delta)
                elif key in ("dialog_handoffs_total", "dialog_fencing_rejections_total"):
                    extra[key.removeprefix("dialog_").removesuffix("_total")] += int(delta)
        for name, after in b.stats.items():
            before = a.stats.get(name, {})
            for key, value in after.items():
                if key.startswith("requeued_"):
                    by_reason[key.removeprefix("requeued_")] += int(value) - int(before.get(key, 0))
        total = sum(by_reason.values())
        return {
            "total": total,
            "per_msg": round(total / n, 4),
            "by_reason_per_msg": {k: round(v / n, 4) for k, v in sorted(by_reason.items())},
            "by_reason": dict(sorted(by_reason.items())),
            **dict(extra),
        }

    def _redis_cost(self, a: Snapshot, b: Snapshot, n: int) -> dict[str, Any]:
        delta = {
            k: v - a.calls.get(k, 0)
            for k, v in b.calls.items()
            if v - a.calls.get(k, 0) and k not in _ADMIN_COMMANDS
        }
        total = sum(delta.values())
        script_calls = sum(delta.get(k, 0) for k in ("evalsha", "eval", "fcall"))
        bench_top = sum(
            v - a.bench["by_name"].get(k, 0)
            for k, v in b.bench["by_name"].items()
            if k not in _ADMIN_COMMANDS
        )
        bench_scripts = sum(
            b.bench["by_name"].get(k, 0) - a.bench["by_name"].get(k, 0) for k in ("evalsha", "eval")
        )
        producer_inside = self.target.send_internal_cmds * (
            len(self.sent) if self.target.peer is None and self.target.send_sha else 0
        )
        out: dict[str, Any] = {
            "commands_per_msg": round(total / n, 3),
            "by_command_per_msg": {
                k: round(v / n, 3) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])[:14]
            },
            "producer_commands_per_msg": round((bench_top + producer_inside) / n, 3),
        }
        counted = bool(b.counts) and all(b.counts.values())
        if counted:
            w_rt = sum(
                c.get("round_trips", 0) - a.counts.get(k, {}).get("round_trips", 0)
                for k, c in b.counts.items()
            )
            w_by: Counter[str] = Counter()
            for k, c in b.counts.items():
                before = a.counts.get(k, {}).get("by_name", {})
                for cmd, v in c.get("by_name", {}).items():
                    if cmd not in _ADMIN_COMMANDS:
                        w_by[cmd] += v - before.get(cmd, 0)
            w_top = sum(w_by.values())
            w_scripts = sum(w_by.get(k, 0) for k in ("evalsha", "eval"))
            w_inside = total - bench_top - producer_inside - w_top
            out.update(
                {
                    "worker_round_trips_per_msg": round(w_rt / n, 3),
                    "worker_top_level_commands_per_msg": round(w_top / n, 3),
                    "worker_script_calls_per_msg": round(w_scripts / n, 3),
                    "worker_commands_inside_scripts_per_msg": round(max(0.0, w_inside) / n, 3),
                    "worker_commands_per_msg": round((w_top + max(0.0, w_inside)) / n, 3),
                    "worker_top_level_by_command_per_msg": {
                        k: round(v / n, 3) for k, v in w_by.most_common(10) if v
                    },
                }
            )
        else:
            out["worker_script_calls_per_msg"] = round((script_calls - bench_scripts) / n, 3)
        return out

    async def _check(self, reader: ReplyReader, timed_out: bool) -> dict[str, Any]:
        t = self.target
        by_session: dict[str, list[Sent]] = defaultdict(list)
        for s in self.sent:
            by_session[s.session_id].append(s)
        c: Counter[str] = Counter()
        sessions_lost = sessions_ooo = 0
        limit = t.settings.history_limit
        states: dict[str, Any] = {}
        if t.system in STATEFUL:
            sids = list(by_session)
            for start in range(0, len(sids), 500):
                chunk = sids[start : start + 500]
                async with t.redis.pipeline(transaction=False) as pipe:
                    for sid in chunk:
                        pipe.hget(t.keys.session(sid).state, "d")
                    docs = await pipe.execute()
                for sid, doc in zip(chunk, docs, strict=True):
                    states[sid] = json.loads(doc) if doc else None
        for sid, msgs in by_session.items():
            msgs.sort(key=lambda m: m.seq)
            keys = [(sid, m.seq) for m in msgs]
            dead = sum(1 for k in keys if k in reader.dead_lettered)
            c["dead_lettered"] += dead
            c["missing_replies"] += sum(1 for k in keys if reader.count[k] == 0)
            c["extra_replies"] += sum(max(0, reader.count[k] - 1) for k in keys)
            late = inversions(reader.order.get(sid, []))
            lost = dup = 0
            if t.system in STATEFUL:
                state = states.get(sid)
                if state is None:
                    lost = len(msgs) - dead
                else:
                    history = state.get("history", [])
                    hseqs = [int(turn["seq"]) for turn in history]
                    late = max(late, inversions(hseqs))
                    hcount = Counter(turn["msg_id"] for turn in history)
                    dup = sum(v - 1 for v in hcount.values() if v > 1)
                    version = int(state.get("version", 0))
                    # version counts the writes that survived; one per applied message
                    lost = max(0, len(msgs) - dead - version)
                    dup = max(dup, version - (len(msgs) - dead))
                    applied = [m for m in msgs if (sid, m.seq) not in reader.dead_lettered]
                    if len(applied) <= len(history) or len(history) < limit:
                        # history is not truncated: every applied message must be in it
                        lost = max(lost, sum(1 for m in applied if m.msg_id not in hcount))
                    if t.system == "ours" and int(state.get("applied_seq", 0)) != msgs[-1].seq:
                        c["not_applied"] += 1
            c["lost"] += lost
            c["duplicated"] += dup
            c["out_of_order"] += late
            sessions_lost += 1 if lost else 0
            sessions_ooo += 1 if late else 0
        result: dict[str, Any] = {
            "lost": c["lost"],
            "duplicated": c["duplicated"],
            "out_of_order": c["out_of_order"],
            "missing_replies": c["missing_replies"],
            "extra_replies": c["extra_replies"],
            "not_applied": c["not_applied"],
            "dead_lettered": c["dead_lettered"],
            "sessions": len(by_session),
            "sessions_with_lost": sessions_lost,
            "sessions_out_of_order": sessions_ooo,
            "state_checked": t.system in STATEFUL,
        }
        if t.system == "ours" and not timed_out:
            result["problems"] = await self._verify_check(reader)
        return result

    async def _verify_check(self, reader: ReplyReader) -> list[str]:
        """dialog-worker's own checker (worker.verify.check) over this run."""
        from worker.client import DialogClient
        from worker.verify import check

        sent: list[VSent] = list(self.sent)
        async with DialogClient(settings=self.target.settings, max_connections=8) as client:
            problems = await check(client, sent, reader.after)
        return problems[:20]


def violations(c: dict[str, Any]) -> int:
    keys: tuple[str, ...] = ("lost", "duplicated", "out_of_order", "missing_replies")
    keys += ("extra_replies",)
    if not c.get("state_checked"):
        # bare round trip: no state and no ordering promise; replies only
        keys = ("missing_replies", "extra_replies")
    return (
        sum(int(c.get(k, 0)) for k in keys)
        + int(c.get("not_applied", 0))
        + len(c.get("problems", []))
    )


# ------------------------------------------------------------------------------------------
# the command


def add_parser(sub: Any) -> None:
    """Register `dialog-worker bench` on the CLI's subparsers."""
    p = sub.add_parser(
        "bench",
        help="load generator: throughput, latency, Redis cost, correctness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sessions", type=int, default=500, help="sessions (default 500)")
    p.add_argument("--burst", type=int, default=10, help="messages per session (default 10)")
    p.add_argument(
        "--mode",
        choices=["burst", "rate"],
        help="burst: all at once (default); rate: --rate msg/s for --duration s",
    )
    p.add_argument("--rate", type=float, help="fixed arrival rate, messages/s (implies rate)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of a rate run")
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes to spawn per system (0: use running workers; ours only)",
    )
    p.add_argument("--concurrency", type=int, help="DIALOG_CONCURRENCY of spawned workers")
    p.add_argument(
        "--redis",
        default="url",
        help="'url' (REDIS_URL, default) or 'embedded' (a redis-server of its own)",
    )
    p.add_argument(
        "--compare",
        default="ours",
        help=f"comma-separated systems, run one after the other: {','.join(SYSTEMS)}",
    )
    p.add_argument(
        "--latency-sweep",
        action="store_true",
        help="a max-throughput burst, then fixed-rate runs at --loads of that maximum",
    )
    p.add_argument("--loads", default="0.5,0.8", help="fractions of the max for the sweep")
    p.add_argument(
        "--max-rate",
        type=float,
        help="known maximum (msg/s) for --latency-sweep / --memory-run (skips the max run)",
    )
    p.add_argument(
        "--memory-run",
        type=float,
        metavar="SECONDS",
        help="fixed rate at 50%% of the max for SECONDS, sampling worker RSS",
    )
    p.add_argument("--plot", metavar="FILE.png", help="latency percentiles vs offered load")
    p.add_argument(
        "--senders",
        type=int,
        default=1,
        help="sessions whose bursts are interleaved (1: each burst back to back)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="drain deadline per run (s)")
    p.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="/metrics of running workers to scrape with --workers 0 (repeatable)",
    )
    p.add_argument(
        "--warmup", type=int, default=200, help="unreported warm-up messages per system (0: none)"
    )
    p.add_argument("--keep-data", action="store_true", help="keep the comparison namespaces")


def _validate(args: argparse.Namespace) -> list[str]:
    systems = [s.strip() for s in args.compare.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValidationError(f"--compare: unknown system(s) {unknown}; choose from {SYSTEMS}")
    if args.sessions < 1 or args.burst < 1 or args.senders < 1:
        raise ValidationError("--sessions, --burst and --senders must be >= 1")
    if args.workers < 0:
        raise ValidationError("--workers must be >= 0")
    if args.workers == 0 and systems != ["ours"]:
        raise ValidationError("--workers 0 (running workers) works only with --compare ours")
    if args.rate is not None and args.rate <= 0:
        raise ValidationError("--rate must be positive")
    if args.mode == "rate" and args.rate is None:
        raise ValidationError("--mode rate needs --rate")
    if args.redis not in ("url", "embedded"):
        raise ValidationError("--redis must be 'url' or 'embedded'")
    if args.memory_run is not None and args.workers == 0:
        raise ValidationError("--memory-run samples spawned workers: needs --workers >= 1")
    try:
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        raise ValidationError("--loads: comma-separated fractions, e.g. 0.5,0.8") from None
    if not loads or any(not 0 < x <= 1.5 for x in loads):
        raise ValidationError("--loads: fractions within (0, 1.5]")
    args.loads_list = loads
    if "peer" in systems:
        try:
            importlib.import_module("taskiq_redis")
        except ImportError:
            raise ValidationError(
                "--compare peer needs taskiq-redis: pip install -r bench/requirements.txt"
            ) from None
    return systems


def _check_plot(path: str | None) -> bool:
    if not path:
        return True
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        print(
            "dialog-worker: --plot needs matplotlib, which is not installed "
            "(pip install matplotlib)",
            file=sys.stderr,
        )
        return False
    return True


async def bench_command(settings: Settings, args: argparse.Namespace) -> int:
    systems = _validate(args)
    if not _check_plot(args.plot):
        return EXIT_USAGE
    if settings.redis_mode != "standalone" or settings.shards != 1:
        raise ValidationError("bench supports the plain (standalone, one shard) layout only")
    COUNTER.install()
    embedded: EmbeddedRedis | None = None
    if args.redis == "embedded":
        embedded = await anyio.to_thread.run_sync(EmbeddedRedis)
        settings = settings.replace(redis_url=embedded.url)
        progress(f"embedded redis-server on 127.0.0.1:{embedded.port}")
    run_id = uuid.uuid4().hex[:6]
    report: dict[str, Any] = {
        "bench": 1,
        "machine": machine_info(),
        "config": {
            "sessions": args.sessions,
            "burst": args.burst,
            "workers": args.workers,
            "concurrency": args.concurrency or settings.concurrency,
            "redis": "embedded" if embedded else settings.redacted_url(),
            "systems": systems,
            "latency": "client: send pipeline written -> reply read by XREAD (ms)",
        },
        "runs": [],
    }
    try:
        probe = connect(settings, 2)
        info = await probe.info("server")
        report["machine"]["redis_version"] = info.get("redis_version")
        await probe.aclose()
        reference_max: float | None = args.max_rate
        for system in systems:
            try:
                runs, reference_max = await _bench_system(
                    system, settings, args, run_id, len(systems) > 1, reference_max
                )
            except (RuntimeError, OSError, ImportError) as exc:
                if system == "ours":
                    raise
                progress(f"{system}: skipped: {exc}")
                report.setdefault("skipped", {})[system] = str(exc)[-2000:]
                continue
            report["runs"] += runs
    finally:
        if embedded is not None:
            await anyio.to_thread.run_sync(embedded.stop)
    ours_bad = sum(r["violations"] for r in report["runs"] if r["system"] == "ours")
    report["violations"] = {
        s: sum(r["violations"] for r in report["runs"] if r["system"] == s) for s in systems
    }
    report["ok"] = ours_bad == 0
    if args.plot:
        plot(report["runs"], args.plot)
        report["plot"] = args.plot
    _summary(report)
    print(json.dumps(report, ensure_ascii=False), flush=True)
    return EXIT_OK if ours_bad == 0 else EXIT_FAILURE


async def _bench_system(
    system: str,
    settings: Settings,
    args: argparse.Namespace,
    run_id: str,
    namespaced: bool,
    reference_max: float | None,
) -> tuple[list[dict[str, Any]], float | None]:
    if namespaced:
        ns = f"bench-{run_id}-{system}"
        settings = settings.replace(
            stream=ns,
            group=f"{ns}-group",
            reply_stream=f"{ns}-replies",
            dlq_stream=f"{ns}-dlq",
            key_prefix=ns,
        )
    target = Target(system, settings, args, run_id)
    runs: list[dict[str, Any]] = []

    async def one(phase: str, mode: str, rate: float = 0.0, duration: float = 0.0) -> float:
        label = f"{system}/{phase}" + (f" at {rate:.0f} msg/s for {duration:g}s" if rate else "")
        progress(f"{label} ...")
        result = await Run(target, phase, args).execute(
            mode, args.sessions, args.burst, rate, duration
        )
        runs.append(result)
        progress(_line(result))
        return float(result["throughput_msg_s"] or 0.0)

    try:
        if args.workers:
            progress(f"{system}: starting {args.workers} worker process(es)")
        await target.start_workers(args.workers)
        await target.start_producer()
        if args.warmup:
            # Not reported: fills connection pools, loads scripts, warms caches.
            progress(f"{system}: warm-up ({args.warmup} messages)")
            await Run(target, "warmup", args).execute(
                "burst", max(1, args.warmup // 5), min(5, args.warmup)
            )
        rate_mode = args.mode == "rate" or (args.rate is not None and args.mode != "burst")
        if args.memory_run is not None:
            maximum = reference_max or await one("max", "burst")
            reference_max = reference_max or maximum
            await one("memory", "rate", 0.5 * reference_max, args.memory_run)
        elif args.latency_sweep:
            measured = await one("max", "burst")
            reference_max = reference_max or measured
            for load in args.loads_list:
                await one(f"load{int(load * 100)}", "rate", load * reference_max, args.duration)
        elif rate_mode:
            await one("rate", "rate", float(args.rate), args.duration)
        else:
            await one("burst", "burst")
        await target.close_producer()
    finally:
        await target.close(args.keep_data, namespaced)
    for r in runs:
        r["reference_max_msg_s"] = reference_max
        if r["offered_rate"] and reference_max:
            r["load_fraction"] = round(r["offered_rate"] / reference_max, 3)
    return runs, reference_max


def _line(r: dict[str, Any]) -> str:
    lat, c = r["latency_ms"], r["correctness"]
    red = r["redis"]
    rt = red.get("worker_round_trips_per_msg")
    return (
        f"{r['system']}/{r['phase']}: {r['messages']} msgs, "
        f"{r['throughput_msg_s']} msg/s, drain {r['drain_s']}s, "
        f"latency p50/p95/p99 {lat['p50']}/{lat['p95']}/{lat['p99']} ms, "
        f"requeues/msg {r['requeues']['per_msg']}, "
        f"redis cmds/msg {red['commands_per_msg']} (worker round trips/msg {rt}), "
        f"cpu ms/msg redis {r['cpu']['redis_ms_per_msg']} workers {r['cpu']['workers_ms_per_msg']}"
        f" | lost {c['lost']} dup {c['duplicated']} out-of-order {c['out_of_order']} "
        f"missing {c['missing_replies']} dead-lettered {c['dead_lettered']}"
    )


def _summary(report: dict[str, Any]) -> None:
    print("\n== dialog-worker bench ==", file=sys.stderr)
    m = report["machine"]
    print(
        f"{m['nproc']} cpu ({m['cpu_model']}), {m['mem_total_gib']} GiB, Python {m['python']}, "
        f"redis {m.get('redis_version')}",
        file=sys.stderr,
    )
    for r in report["runs"]:
        print("  " + _line(r), file=sys.stderr)
    print(f"violations by system: {report['violations']}", file=sys.stderr)
    print("OK" if report["ok"] else "FAILED: dialog-worker broke a guarantee", file=sys.stderr)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Latency percentiles (client-observed) against offered load, one colour per system."""
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"p50": ":", "p95": "--", "p99": "-"}
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        if r["mode"] == "rate" and r["offered_rate"]:
            series[r["system"]].append(r)
    colours = dict(zip(SYSTEMS, ["C0", "C3", "C1", "C2", "C7"], strict=True))
    for system, rs in series.items():
        rs.sort(key=lambda r: r["offered_rate"])
        xs = [r["offered_rate"] for r in rs]
        for pct, style in styles.items():
            ys = [r["latency_ms"][pct] for r in rs]
            ax.plot(xs, ys, style, marker="o", color=colours[system], label=f"{system} {pct}")
    ax.set_xlabel("offered load (messages/s)")
    ax.set_ylabel("enqueue -> reply latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("dialog-worker bench: latency vs offered load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_count":
        raise SystemExit(_count_main(sys.argv[2:]))
    print("usage: python -m worker.bench _count MODULE [ARGS...]", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)
