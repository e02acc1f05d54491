"""A stand-in for the worker's reply side, for client tests that need no real worker: it reads
every inbound stream of a deployment and writes one reply event per message, with the fields a
worker writes (session_id, msg_id, seq, outcome, reply, produced_at, entry_id).

The text decides the outcome: "fatal ..." is dead_lettered with the fallback reply, "dup ..."
is a duplicate, "silent ..." gets no reply at all, anything else is applied with the reply
"echo: <text>". Each batch is answered in reverse order, so a client that matched replies to
asks by arrival order instead of by msg_id would fail.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import anyio
from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.store.keys import Topology

FALLBACK = "Maaf, pesan Anda tidak dapat diproses. Silakan coba lagi nanti."


def reply_for(text: str) -> tuple[str, str] | None:
    if text.startswith("silent"):
        return None
    if text.startswith("fatal"):
        return "dead_lettered", FALLBACK
    if text.startswith("dup"):
        return "duplicate", f"echo: {text}"
    return "applied", f"echo: {text}"


async def fake_replier(
    redis: Redis, settings: Settings, *, ready: anyio.Event | None = None
) -> None:
    """Run until cancelled. `redis` decodes responses (as the client's own connection does)."""
    shards = Topology.from_settings(settings).shards
    cursors = {keys.stream: "0" for keys in shards}
    replies_of = {keys.stream: keys.replies for keys in shards}
    seqs: dict[str, int] = defaultdict(int)
    if ready is not None:
        ready.set()
    while True:
        got: Any = await redis.xread(cursors, count=500, block=200)
        for stream, entries in got or []:
            for entry_id, fields in reversed(entries):
                decided = reply_for(fields.get("text", ""))
                if decided is None:
                    continue
                outcome, reply = decided
                seqs[fields["session_id"]] += 1
                await redis.xadd(
                    replies_of[stream],
                    {
                        "session_id": fields["session_id"],
                        "msg_id": fields.get("msg_id") or entry_id,
                        "seq": str(seqs[fields["session_id"]]),
                        "outcome": outcome,
                        "reply": reply,
                        "produced_at": str(time.time_ns() // 1_000_000),
                        "entry_id": entry_id,
                    },
                )
            cursors[stream] = entries[-1][0]
