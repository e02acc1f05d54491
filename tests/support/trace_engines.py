"""A dialog engine for trace tests (DIALOG_ENGINE=trace_engines:make, or in-process). Each
step makes one model call (`dialog_worker.model_call`, which makes its span), then the text
decides:
    "fail-once ..."      raises on its first attempt (a failed attempt, retried)
    "sleep-first S ..."  sleeps S seconds on its first attempt (a test kills the worker then)
    anything else        answers at once
The reply names the attempt; the state's memory keeps the message's meta (the trace fields
reach the engine there)."""

from __future__ import annotations

from typing import Any

import anyio

import dialog_worker


class TraceEngine:
    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        text, attempt = message["text"], message["attempt"]
        async with dialog_worker.model_call("test:test-model", tokens=8) as call:
            call.usage(3, 5)
        if text.startswith("fail-once") and attempt == 1:
            raise RuntimeError("the first attempt fails")
        if text.startswith("sleep-first") and attempt == 1:
            await anyio.sleep(float(text.split()[1]))
        return {**state, "memory": {"meta": message["meta"]}}, f"attempt={attempt}"


def make() -> TraceEngine:
    return TraceEngine()
