"""What the bench sends and how: the workload (N sessions x B messages, as a burst or at a fixed
rate) and the producer that enqueues it in pipelines on one connection, so a session's
messages are enqueued in order."""

from __future__ import annotations

import dataclasses
import importlib
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from worker.bench.counting import ADMIN_COMMANDS, command_calls
from worker.bench.stats import id_ms
from worker.config import Settings
from worker.keys import Keys
from worker.scripts import source
from worker.verify import Sent as VSent

PIPELINE_CHUNK = 500
TICK_S = 0.002
RATE_TEXTS = ["nama saya Budi", "saya ada kendala billing", "pesan"]


@dataclasses.dataclass
class Sent(VSent):
    """A sent message as worker.verify checks it, plus when the bench sent it."""

    t_send: float
    enq_ms: int


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


class Producer:
    """Enqueues for one system: dialog-worker's send script, pipelined (ours and the comparison
    workers that read its stream), or taskiq's kicker (peer)."""

    def __init__(self, system: str, settings: Settings, redis: Redis, run: str, senders: int):
        self.system = system
        self.settings = settings
        self.redis = redis
        self.run = run
        self.senders = senders
        self.keys = Keys.from_settings(settings)
        self.send_sha = ""
        self.peer: Any = None
        self.send_internal_cmds: float = 0.0
        self.peer_seq: dict[str, int] = {}

    async def start(self) -> None:
        if self.system == "peer":
            module = importlib.import_module("bench.peer_worker")
            self.peer = module.Producer(self.settings, self.senders)
            await self.peer.start()
            return
        self.send_sha = await self.redis.script_load(source("send"))
        self.send_internal_cmds = await self._calibrate_send()

    async def close(self) -> None:
        if self.peer is not None:
            await self.peer.close()
            self.peer = None

    @property
    def scripted(self) -> bool:
        """Sends through the send script (whose inner commands are Redis cost of the producer)."""
        return self.peer is None and bool(self.send_sha)

    async def _calibrate_send(self) -> float:
        """Commands the send script runs inside Redis per message (for the split of script
        commands between producer and workers): 50 sends to a scratch stream, INFO delta."""
        scratch = f"{self.settings.prefix}-calibration-{self.run}"
        sk = self.keys.session(scratch)
        before = await command_calls(self.redis)
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in range(50):
                self._queue_send(pipe, scratch, f"c{i}", "x", stream=scratch, ttl_s=60)
            await pipe.execute()
        after = await command_calls(self.redis)
        await self.redis.delete(scratch, sk.state, *[sk.dedupe(f"c{i}") for i in range(50)])
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        inside = sum(v for k, v in delta.items() if k not in ADMIN_COMMANDS and k != "evalsha")
        return inside / 50

    async def send(self, items: list[tuple[str, str]]) -> list[Sent]:
        """Enqueue in order; returns what was sent with its send time."""
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
        for start in range(0, len(items), PIPELINE_CHUNK):
            chunk = items[start : start + PIPELINE_CHUNK]
            ids = [uuid.uuid4().hex for _ in chunk]
            async with self.redis.pipeline(transaction=False) as pipe:
                for (sid, text), msg_id in zip(chunk, ids, strict=True):
                    self._queue_send(pipe, sid, msg_id, text)
                t = time.perf_counter()
                results = await pipe.execute()
            for (sid, text), msg_id, raw in zip(chunk, ids, results, strict=True):
                out.append(sent_from(sid, msg_id, text, t, raw))
        return out

    def _queue_send(
        self,
        pipe: Pipeline,
        session_id: str,
        msg_id: str,
        text: str,
        *,
        stream: str | None = None,
        ttl_s: int | None = None,
    ) -> None:
        """One send on the pipeline, as DialogClient.send makes it."""
        sk = self.keys.session(session_id)
        pipe.evalsha(
            self.send_sha,
            3,
            sk.state,
            sk.dedupe(msg_id),
            stream or self.keys.stream,
            session_id,
            msg_id,
            text,
            ttl_s or self.settings.dedupe_ttl_s,
            ttl_s or self.settings.state_ttl_s,
        )


def sent_from(session_id: str, msg_id: str, text: str, t_send: float, raw: Any) -> Sent:
    """The one place that reads a send's reply ([seq, duplicate, entry id]). The checks do
    not use `seq` (they go by msg_id and send order); only worker.verify's does."""
    return Sent(session_id, int(raw[0]), msg_id, text, t_send, id_ms(str(raw[2])))


async def send_at_rate(
    producer: Producer,
    names: list[str],
    rate: float,
    duration: float,
    sample: Callable[[float], None] | None = None,
) -> list[Sent]:
    """`rate` messages/s for `duration` s, round robin over the sessions, in ticks of TICK_S;
    `sample(elapsed_s)` is called about ten times along the way (and once at the end)."""
    sent: list[Sent] = []
    next_msg: dict[str, int] = defaultdict(int)
    start = time.perf_counter()
    total = int(rate * duration)
    count = 0
    idx = 0
    sample_every = max(1.0, duration / 10)
    next_sample = 0.0
    while count < total:
        elapsed = time.perf_counter() - start
        if sample is not None and elapsed >= next_sample:
            sample(elapsed)
            next_sample += sample_every
        due = min(total, int(rate * elapsed) + 1) - count
        if due > 0:
            items = []
            for _ in range(due):
                sid = names[idx % len(names)]
                idx += 1
                k = next_msg[sid]
                next_msg[sid] += 1
                items.append((sid, RATE_TEXTS[min(k, 2)] if k < 2 else f"pesan {k + 1}"))
            sent += await producer.send(items)
            count += due
        await anyio.sleep(TICK_S)
    if sample is not None:
        sample(time.perf_counter() - start)
    return sent
