"""A dialog engine that answers with the attempt it was given, after a short step
(DIALOG_ENGINE=attempt_engine:make). A test that must show a fault counted no attempt checks
that every reply says ``attempt=1``; the step's length (ATTEMPT_ENGINE_STEP_S, default 0.05 s)
keeps messages in flight while the fault happens."""

from __future__ import annotations

import os
from typing import Any

import anyio


class AttemptEngine:
    def __init__(self) -> None:
        self.step_s = float(os.environ.get("ATTEMPT_ENGINE_STEP_S", "0.05"))

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        await anyio.sleep(self.step_s)
        return {**state, "step": "ROOT"}, f"attempt={message['attempt']}"


def make() -> AttemptEngine:
    return AttemptEngine()
