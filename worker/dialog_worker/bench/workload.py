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

from dialog_worker.bench.stats import id_ms
from dialog_worker.config import Settings
from dialog_worker.ops.verify import Sent as VSent
from dialog_worker.store.keys import Keys

PIPELINE_CHUNK = 500
TICK_S = 0.002
RATE_TEXTS = ["nama saya Budi", "saya ada kendala billing", "pesan"]


@dataclasses.dataclass
class Sent(VSent):
    """A sent message as dialog_worker.ops.verify checks it, plus when the bench sent it."""

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
    """Enqueues for one system: plain XADDs, pipelined (ours and the comparison workers that
    read its stream), or taskiq's kicker (peer)."""

    def __init__(
        self,
        system: str,
        settings: Settings,
        redis: Redis,
        run: str,
        senders: int,
        msg_ids: bool = False,
    ):
        self.system = system
        self.msg_ids = msg_ids
        self.settings = settings
        self.redis = redis
        self.run = run
        self.senders = senders
        self.keys = Keys.from_settings(settings)
        self.peer: Any = None
        self.peer_seq: dict[str, int] = {}

    async def start(self) -> None:
        if self.system == "peer":
            module = importlib.import_module("bench.peer_worker")
            self.peer = module.Producer(self.settings, self.senders)
            await self.peer.start()

    async def close(self) -> None:
        if self.peer is not None:
            await self.peer.close()
            self.peer = None

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
            queued = []
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid, text in chunk:
                    queued.append(self._queue_send(pipe, sid, text))
                t = time.perf_counter()
                results = await pipe.execute()
            for (sid, text), (seq, msg_id), raw in zip(chunk, queued, results, strict=True):
                out.append(sent_from(sid, seq, msg_id, text, t, raw))
        return out

    def _queue_send(self, pipe: Pipeline, session_id: str, text: str) -> tuple[int, str]:
        """One send on the pipeline. dialog-worker's is a plain XADD, by default without a
        msg_id (the entry id stands in), as a producer in any language may send it; with
        --msg-ids with one, as DialogClient.send makes it (intake then looks each one up in
        the dedupe window). The comparison workers, which have no intake that sequences, get
        the seq and a msg_id from the producer, as their designs need."""
        seq = self.peer_seq[session_id] = self.peer_seq.get(session_id, 0) + 1
        fields = {"session_id": session_id, "text": text}
        msg_id = ""
        if self.system != "ours" or self.msg_ids:
            msg_id = uuid.uuid4().hex
            fields["msg_id"] = msg_id
        if self.system != "ours":
            fields["seq"] = str(seq)
        pipe.xadd(self.keys.stream, fields)  # type: ignore[arg-type]
        return seq, msg_id


def sent_from(session_id: str, seq: int, msg_id: str, text: str, t_send: float, raw: Any) -> Sent:
    """The one place that reads a send's reply: the entry id (the msg_id when none was
    given). `seq` is the message's place in its session (fresh sessions per run)."""
    entry_id = raw.decode() if isinstance(raw, bytes) else str(raw)
    return Sent(session_id, seq, msg_id or entry_id, text, t_send, id_ms(entry_id))


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
