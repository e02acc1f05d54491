"""Streaming engines for the tests of streamed replies, loaded by worker processes with
DIALOG_ENGINE=stream_engines:<Name>. The message text says what to stream:
``<words> <delay_ms>`` (for example ``40 10``: forty words, one every 10 ms)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from dialog_worker import PermanentError, RateLimited, TransientError, emit, model_call


def _plan(message: dict[str, Any]) -> tuple[list[str], float]:
    parts = message["text"].split()
    words, delay_ms = int(parts[0]), float(parts[1]) if len(parts) > 1 else 0.0
    return [f"w{i} " for i in range(words)], delay_ms / 1000


class AsyncWords:
    """An async step that emits word by word, then returns the same text."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        words, delay = _plan(message)
        for word in words:
            emit(word)
            await asyncio.sleep(delay)
        return {**state, "step": "STREAMED"}, "".join(words)


class ThreadWords:
    """A plain def step (in its worker thread) that emits word by word."""

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        words, delay = _plan(message)
        for word in words:
            emit(word)
            time.sleep(delay)
        return {**state, "step": "STREAMED"}, "".join(words)


class FailsFirstAttempt:
    """The first attempt emits a wrong beginning and fails; the second answers properly: a
    reader must replace, not append."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        words, delay = _plan(message)
        if message["attempt"] == 1:
            for word in ("WRONG ", "START "):
                emit(word)
                await asyncio.sleep(delay)
            await asyncio.sleep(0.1)
            raise TransientError("model connection reset", retry_after=0)
        for word in words:
            emit(word)
            await asyncio.sleep(delay)
        return {**state, "step": "STREAMED"}, "".join(words)


class LimitedAfterEmit:
    """Streams a beginning, then its model call (key "k") is refused with a provider's 429
    (Retry-After 0) on its first N attempts (the text's third number: ``<words> <delay_ms>
    <n>``); then it streams the whole answer. Counted per message in this process."""

    def __init__(self) -> None:
        self.refused: dict[str, int] = {}

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        words, delay = _plan(message)
        refusals = int(message["text"].split()[2])
        emit("THINKING ")
        await asyncio.sleep(0.2)  # written to the stream (readers have it) before the call
        async with model_call("k", tokens=5):
            if self.refused.get(message["msg_id"], 0) < refusals:
                self.refused[message["msg_id"]] = self.refused.get(message["msg_id"], 0) + 1
                raise RateLimited("k", 0)
        for word in words:
            emit(word)
            await asyncio.sleep(delay)
        return {**state, "step": "STREAMED"}, "".join(words)


class EmitsOtherThanReturns:
    """Emits a draft, returns a different final text: the end carries the returned text."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        emit("draft ")
        await asyncio.sleep(0.05)
        return {**state, "step": "STREAMED"}, "final answer"


class SlowOnFirstWorker:
    """Streams slowly; writes its pid to APP_ENGINE_LOG.<msg_id>.started once it has emitted
    half, so a test can kill the worker mid-answer."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        words, delay = _plan(message)
        for i, word in enumerate(words):
            emit(word)
            await asyncio.sleep(delay)
            if i == len(words) // 2 and message["attempt"] == 1:
                marker = f"{os.environ['APP_ENGINE_LOG']}.started"
                with open(marker, "w") as f:  # noqa: ASYNC230 - a test signal, microseconds
                    f.write(str(os.getpid()))
        return {**state, "step": "STREAMED"}, "".join(words)


def _tagged(message: dict[str, Any]) -> tuple[list[str], float]:
    """``<words> <delay_ms> <tag>``: words ``<tag>.0 <tag>.1 ...``, so no two messages'
    answers share a piece (a piece of the wrong answer cannot pass for a right one)."""
    parts = message["text"].split()
    tag = parts[2]
    return [f"{tag}.{i} " for i in range(int(parts[0]))], float(parts[1]) / 1000


class TaggedAsync:
    """AsyncWords with words of the message's own tag."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        words, delay = _tagged(message)
        for word in words:
            emit(word)
            await asyncio.sleep(delay)
        return {**state, "step": "STREAMED"}, "".join(words)


class TaggedThread:
    """ThreadWords (a plain def step in its thread) with words of the message's own tag: the
    same answer as TaggedAsync, so a message can move between the two kinds of worker."""

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        words, delay = _tagged(message)
        for word in words:
            emit(word)
            time.sleep(delay)
        return {**state, "step": "STREAMED"}, "".join(words)


class PerProcessWords:
    """AsyncWords whose words name the worker process (``p<pid>.<i>``): two workers' answers to
    the same message differ, so a reader shown pieces of both would notice."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        words, delay = _plan(message)
        words = [f"p{os.getpid()}.{word}" for word in words]
        for word in words:
            emit(word)
            await asyncio.sleep(delay)
        return {**state, "step": "STREAMED"}, "".join(words)


class FailsWhileFlagged:
    """For the tests of a held session's redrive. While the file named by FAULT_FLAG_FILE
    exists: ``letter ...`` fails for good (a dead letter), and ``<words> <delay_ms>`` streams
    two pieces ``OLD.0 OLD.1`` and fails for a retry in a minute (a held session keeps it
    waiting). Without the file: ``letter ...`` answers ``letter ok``, the others stream as
    AsyncWords."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        flag = os.environ.get("FAULT_FLAG_FILE")
        flagged = bool(flag) and os.path.exists(flag)  # noqa: ASYNC240 - a test toggle
        if message["text"].startswith("letter"):
            if flagged:
                raise PermanentError("letter refused while flagged")
            return state, "letter ok"
        if flagged:
            for word in ("OLD.0 ", "OLD.1 "):
                emit(word)
                await asyncio.sleep(0.15)  # each its own batch
            raise TransientError("flagged", retry_after=60)
        words, delay = _plan(message)
        for word in words:
            emit(word)
            await asyncio.sleep(delay)
        return {**state, "step": "STREAMED"}, "".join(words)
