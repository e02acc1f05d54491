"""The engine `dialog-worker bench --step-ms MS` gives dialog-worker's workers: the built-in
rules behind an `async` wait of MS milliseconds, like a step that calls a remote model."""

from __future__ import annotations

import os
from typing import Any

import anyio

from dialog_worker.engine.rules import RuleEngine, load_rules


class SlowEngine:
    def __init__(self, step_s: float, rules: RuleEngine) -> None:
        self.step_s = step_s
        self.rules = rules

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        await anyio.sleep(self.step_s)
        return self.rules.step(state, message)


def make() -> SlowEngine:
    return SlowEngine(float(os.environ.get("BENCH_STEP_MS", "0")) / 1000, load_rules())
