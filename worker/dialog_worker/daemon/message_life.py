"""What one message lived through, for the console's message page ("why did this message take
40 s?"): each attempt (start, end, how it ended, its error), each wait (for the model's rate,
a pause) with its duration, each model call (key, tokens, its wait) and each journaled call.

`MessageLife` is one per attempt of a step, kept on the pipeline's job. It is written to a
small hash per message (`SessionKeys.life`: one field per record, at most `LIFE_ATTEMPTS`,
the oldest overwritten, numbered by the field "n"; each record capped), with an HINCRBY and a
pipelined HSET + EXPIRE (kept DIALOG_DEDUPE_TTL_S) where the attempt ends:

- on the paths that give the message back (a retry, a hand-back for the model's limit key, a
  shutdown), after their own script call: two round trips only there;
- after a commit, only when there is something to tell: a wait, a journaled call, or an
  earlier attempt (its model calls are then in the record too). A message answered at
  first try without a wait or a journaled call writes nothing: a deployment without limits
  pays nothing, nor one whose calls never wait.

`LifeCalls` wraps the attempt's `Calls` (dialog_worker/daemon/model_gate.py) to see each model
call: what it asked, how long it waited for its turn, what it used. Best effort throughout: a
failed write is logged, never the message's failure.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.exceptions
import structlog
from redis.asyncio import Redis

from dialog_worker.engine import emit
from dialog_worker.engine.model_calls import Calls, Usage
from dialog_worker.store.keys import Keys

log = structlog.get_logger("dialog_worker.daemon.message_life")

# Attempts kept per message (their fields are the attempt number modulo this).
LIFE_ATTEMPTS = 32
# Model calls, waits and journaled calls kept per attempt; an error's text kept.
LIFE_ITEMS = 32
LIFE_ERROR_CHARS = 300
# A wait for the model's turn inside the step shorter than this is not a wait worth a line
# (the same threshold as the answer's `waiting` event, model_gate.WAIT_SHOWN_MS).
LIFE_WAIT_MS = 200


def now_ms() -> int:
    return int(time.time() * 1000)


class MessageLife:
    """One attempt of one message, as the message page shows it."""

    def __init__(self, attempt: int, enqueued_ms: int = 0) -> None:
        self.attempt = attempt
        self.enqueued_ms = enqueued_ms  # when the message was sent (its entry's time)
        self.start_ms = now_ms()
        self.waits: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.once: list[dict[str, Any]] = []

    def wait(self, reason: str, ms: float, key: str = "", until_ms: int | None = None) -> None:
        if len(self.waits) < LIFE_ITEMS:
            row: dict[str, Any] = {"reason": reason, "ms": round(ms), "at_ms": now_ms()}
            if key:
                row["key"] = key
            if until_ms is not None:
                row["until_ms"] = until_ms
            self.waits.append(row)

    def call(self, row: dict[str, Any]) -> None:
        if len(self.calls) < LIFE_ITEMS:
            self.calls.append(row)

    def journaled(self, name: str, replayed: bool) -> None:
        if len(self.once) < LIFE_ITEMS:
            self.once.append({"name": name[:200], "replayed": replayed})

    def telling(self) -> bool:
        """Whether a commit has something to tell beyond "answered at first try": a wait, a
        journaled call, an earlier attempt (model calls alone are not: a deployment whose
        calls never wait writes nothing)."""
        return bool(self.waits or self.once or self.attempt > 1)

    def record(self, outcome: str, error: str = "") -> str:
        row: dict[str, Any] = {
            "attempt": self.attempt,
            "start_ms": self.start_ms,
            "end_ms": now_ms(),
            "outcome": outcome,
        }
        if self.enqueued_ms:
            row["enqueued_ms"] = self.enqueued_ms
        if error:
            row["error"] = error[:LIFE_ERROR_CHARS]
        for name in ("waits", "calls", "once"):
            if getattr(self, name):
                row[name] = getattr(self, name)
        return json.dumps(row, ensure_ascii=False)


async def write(
    client: Redis,
    keys: Keys,
    session_id: str,
    msg_id: str,
    life: MessageLife,
    outcome: str,
    ttl_s: int,
    error: str = "",
) -> None:
    """The attempt's record, in its message's life hash (two round trips)."""
    if not msg_id:
        return
    key = keys.session(session_id).life(msg_id)
    try:
        # The record's number (field "n"): an attempt that went back to wait keeps its attempt
        # number, so the attempt cannot name the field.
        n = int(await client.hincrby(key, "n", 1))
        async with client.pipeline(transaction=False) as pipe:
            pipe.hset(key, str(n % LIFE_ATTEMPTS), life.record(outcome, error))
            pipe.expire(key, ttl_s)
            await pipe.execute()
    except (redis.exceptions.RedisError, OSError) as exc:
        log.warning("message_life_not_written", error=str(exc))


class LifeCalls:
    """The attempt's `Calls`, seen by its `MessageLife`: each model call's key, estimate, wait
    for its turn (with the reason the answer's readers were told), tokens used and error."""

    def __init__(self, inner: Calls, life: MessageLife) -> None:
        self.inner = inner
        self.life = life

    async def acquire(self, key: str, tokens: int) -> object:
        started = time.monotonic()
        try:
            return await self.inner.acquire(key, tokens)
        finally:
            waited_ms = (time.monotonic() - started) * 1000
            if waited_ms >= LIFE_WAIT_MS:
                # The reason its readers were told (`waiting`), if they were.
                reason = getattr(emit.current_writer(), "last_wait", "") or "rate"
                self.life.wait(reason, waited_ms, key)

    async def settle(
        self, key: str, grant: object, reports: list[Usage], error: BaseException | None
    ) -> None:
        row: dict[str, Any] = {"key": key, "tokens": getattr(grant, "tokens", None)}
        if reports:
            row["used"] = sum(r.tokens for r in reports)
        if error is not None:
            row["error"] = type(error).__name__
        self.life.call(row)
        await self.inner.settle(key, grant, reports, error)

    def record(self, report: Usage) -> None:
        self.life.call({"model": report.model, "used": report.tokens})
        self.inner.record(report)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
