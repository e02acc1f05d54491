"""The gateway's front doors under measurement, on a `dialog-worker serve` process, real
`dialog-worker run` workers and a redis-server of its own.

    python -m dialog_worker.bench.gateway --pairs 200 --streams 1000

Prints one JSON line:

- ``first_token``: ``--pairs`` messages sent through each door, interleaved (one native, one
  ``useChat``, ...), to a model whose first token is written at once. For each door the time
  from the request to the first token on the client (the native route as a page does it: POST
  the message, then GET its stream; ``/ai-sdk/chat``: one POST), and from the worker's emit of
  that token to the client (the engine writes its clock into the token; same host), p50 and
  p99 in ms; ``overhead_ms_p50`` is the AI SDK door's p50 minus the native route's (emit to
  client).
- ``streams``: ``--streams`` ``useChat`` answers open at once on the one gateway process, each
  ``--tokens`` tokens at ``--rate`` per second, ``--rounds`` times one after the other: per
  round the gateway's resident memory before, at its peak while all are open, and after they
  ended (MiB), per open stream (KiB), and how many answers arrived whole. Memory is bounded
  when a later round's peak is no higher than the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from dialog_worker.bench.redis_server import EmbeddedRedis, free_port
from dialog_worker.bench.streaming import FakeModel, _percentile

TOKEN = "bench-gateway-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
__all__ = ["FakeModel"]  # the engine the workers load (dialog_worker.bench.gateway:FakeModel)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _native_first(http: httpx.AsyncClient, session: str) -> tuple[float, float]:
    """(request to first token, emit to client) in ms, for POST + GET of the native route."""
    started = time.perf_counter()
    posted = await http.post(f"/sessions/{session}/messages", json={"text": "5 1000"})
    async with http.stream("GET", posted.json()["stream"]) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"delta"' in line:
                arrived_us = time.time_ns() // 1000
                token = json.loads(line[6:])["text"].split()[0]
                return (time.perf_counter() - started) * 1000, (arrived_us - int(token)) / 1000
    raise RuntimeError("no token")


async def _ai_sdk_first(http: httpx.AsyncClient, session: str, msg_id: str) -> tuple[float, float]:
    """(request to first token, emit to client) in ms, for one POST of /ai-sdk/chat."""
    body = {
        "id": session,
        "messages": [{"id": msg_id, "role": "user", "parts": [{"type": "text", "text": "5 1000"}]}],
        "trigger": "submit-message",
    }
    started = time.perf_counter()
    async with http.stream("POST", "/ai-sdk/chat", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"text-delta"' in line:
                arrived_us = time.time_ns() // 1000
                token = json.loads(line[6:])["delta"].split()[0]
                return (time.perf_counter() - started) * 1000, (arrived_us - int(token)) / 1000
    raise RuntimeError("no token")


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    total = [s[0] for s in samples]
    emitted = [s[1] for s in samples]
    return {
        "request_to_token_ms_p50": round(_percentile(total, 50), 2),
        "request_to_token_ms_p99": round(_percentile(total, 99), 2),
        "emit_to_client_ms_p50": round(_percentile(emitted, 50), 2),
        "emit_to_client_ms_p99": round(_percentile(emitted, 99), 2),
    }


async def _first_token(url: str, pairs: int) -> dict[str, Any]:
    native: list[tuple[float, float]] = []
    ai_sdk: list[tuple[float, float]] = []
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as http:
        for i in range(pairs + 5):
            # Alternate which door goes first, so neither always meets a warmer worker.
            doors = [("n", native), ("a", ai_sdk)] if i % 2 else [("a", ai_sdk), ("n", native)]
            for door, samples in doors:
                session = f"ft-{door}-{i}"
                if door == "n":
                    got = await _native_first(http, session)
                else:
                    got = await _ai_sdk_first(http, session, f"m{i}")
                if i >= 5:  # the first few warm the connections and the workers up
                    samples.append(got)
    n, a = _summary(native), _summary(ai_sdk)
    return {
        "pairs": pairs,
        "native": n,
        "ai_sdk": a,
        "overhead_ms_p50": round(a["emit_to_client_ms_p50"] - n["emit_to_client_ms_p50"], 2),
    }


async def _one_stream(
    http: httpx.AsyncClient, i: int, tokens: int, rate: int, opened: asyncio.Event, count: list[int]
) -> bool:
    body = {
        "id": f"st-{i}",
        "messages": [
            {"id": f"s{i}", "role": "user", "parts": [{"type": "text", "text": f"{tokens} {rate}"}]}
        ],
    }
    text, final = "", None
    async with http.stream("POST", "/ai-sdk/chat", json=body) as response:
        count[0] += 1
        if count[0] == count[1]:
            opened.set()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["type"] == "text-delta":
                text += chunk["delta"]
            elif chunk["type"] == "finish":
                final = chunk["messageMetadata"]["outcome"]
    return final == "applied" and len(text.split()) == tokens


async def _streams(
    url: str, pid: int, streams: int, tokens: int, rate: int, first: int
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=streams + 10, max_keepalive_connections=streams + 10)
    before = _rss_mib(pid)
    peak = before
    opened = asyncio.Event()
    count = [0, streams]
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300, limits=limits) as http:
        started = time.monotonic()
        tasks = [
            asyncio.create_task(_one_stream(http, i, tokens, rate, opened, count))
            for i in range(first, first + streams)
        ]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.5)
            peak = max(peak, _rss_mib(pid))
        took = time.monotonic() - started
    await asyncio.sleep(1.0)
    after = _rss_mib(pid)
    whole = sum(t.result() for t in tasks)
    return {
        "streams": streams,
        "tokens": tokens,
        "rate": rate,
        "all_open": opened.is_set(),
        "whole_answers": whole,
        "took_s": round(took, 1),
        "gateway_rss_mib_before": round(before, 1),
        "gateway_rss_mib_peak": round(peak, 1),
        "gateway_rss_mib_after": round(after, 1),
        "kib_per_open_stream": round((peak - before) * 1024 / streams, 1),
    }


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=200, help="first-token pairs (default 200)")
    parser.add_argument("--streams", type=int, default=1000, help="useChat streams at once")
    parser.add_argument("--tokens", type=int, default=40, help="tokens per answer (default 40)")
    parser.add_argument("--rate", type=int, default=4, help="tokens per second (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of streams (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    redis = EmbeddedRedis()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("DIALOG_")},
            "REDIS_URL": redis.url,
            "DIALOG_ENGINE": "dialog_worker.bench.gateway:FakeModel",
            "DIALOG_CONCURRENCY": str(max(64, args.streams // args.workers + 32)),
            "DIALOG_METRICS_PORT": "0",
            "DIALOG_LOG_LEVEL": "warning",
            "DIALOG_HTTP_TOKEN": TOKEN,
        }
        try:
            for i in range(args.workers):
                with Path(tmp, f"worker-{i}.log").open("ab") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "dialog_worker", "run"],
                            env={**env, "DIALOG_CONSUMER": f"bench-{i}"},
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
            port = free_port()
            with Path(tmp, "gateway.log").open("ab") as log:
                gateway = subprocess.Popen(
                    [sys.executable, "-m", "dialog_worker", "serve", "--port", str(port)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            procs.append(gateway)
            url = f"http://127.0.0.1:{port}"
            _wait_up(url)
            time.sleep(2.0)  # the workers start (imports, script loads)
            result: dict[str, Any] = {"first_token": asyncio.run(_first_token(url, args.pairs))}
            rounds = [
                asyncio.run(
                    _streams(
                        url, gateway.pid, args.streams, args.tokens, args.rate, r * args.streams
                    )
                )
                for r in range(args.rounds if args.streams else 0)
            ]
            result["streams"] = rounds
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
            redis.stop()
    print(json.dumps(result), flush=True)
    whole = all(r["whole_answers"] == args.streams for r in result["streams"])
    return 0 if whole else 1


def _wait_up(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the gateway did not start")


if __name__ == "__main__":
    raise SystemExit(main())
