"""Engines that report model usage, for tests (DIALOG_ENGINE=usage_engines:UsageEngine). Each
step reports 10 input and 5 output tokens of model "m" (cost 0.01); the text decides the rest:
    "fail-once ..."   its first attempt fails after reporting (a TransientError)
    "limit ..."       its first call is refused as a provider 429 would be (RateLimited on
                      key "k", retry after 0.2 s), after reporting; the attempt it comes
                      back with is the same (a 429 spends none), so "first" is per process
    "thread ..."      a plain def step reporting through a plain `with model_call`
    "pre ..."         reports 1 + 1 tokens (model "pre") before its model_call
    "... once"        a journaled call ("lookup") before its model_call
``PoliteUsageEngine`` is the same with its own ``budget_reply``. ``ReportOnlyEngine`` makes
no `model_call`: each step reports 6 input and 4 output tokens of model "m" costing 0.000251
with `dialog_worker.usage` (a call made without a limit key).
"""

from __future__ import annotations

from typing import Any

import anyio

import dialog_worker


class UsageEngine:
    def __init__(self) -> None:
        self.limited: set[str] = set()

    async def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        text = message["text"]
        if text.startswith("thread"):
            return await anyio.to_thread.run_sync(_thread_step, state, message)
        if text.startswith("pre"):
            dialog_worker.usage("pre", 1, 1)
        if "once" in text.split():
            await dialog_worker.once("lookup", lambda: 1)
        async with dialog_worker.model_call("k", tokens=15) as call:
            call.usage(10, 5, cost=0.01, model="m")
            if text.startswith("limit") and message["msg_id"] not in self.limited:
                self.limited.add(message["msg_id"])
                raise dialog_worker.RateLimited("k", 0.2)
        if message["attempt"] == 1 and text.startswith("fail-once"):
            raise dialog_worker.TransientError("after the call")
        return {**state, "step": "ok"}, f"ok {text}"


def _thread_step(state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
    with dialog_worker.model_call("k", tokens=15) as call:
        call.usage(10, 5, cost=0.01, model="m")
    return {**state, "step": "ok"}, f"ok {message['text']}"


class PoliteUsageEngine(UsageEngine):
    budget_reply = "You have used today's messages; see you tomorrow."


class ReportOnlyEngine:
    async def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        dialog_worker.usage("m", 6, 4, cost=0.000251)
        return {**state, "step": "ok"}, f"ok {message['text']}"
