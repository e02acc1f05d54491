"""The engine the worker runs: ``DIALOG_ENGINE=mybot.worker:Bot`` (set by the Dockerfile).

It counts the turns of its session and writes its answer word by word (`emit`), so a page
on the gateway shows it as it is written. Replace the body of `step` with your bot.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dialog_worker import emit


class Bot:
    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        memory = dict(state["memory"] or {})
        memory["turns"] = int(memory.get("turns", 0)) + 1
        answer = f"mybot heard: {message['text']} (turn {memory['turns']})"
        words = answer.split(" ")
        for i, word in enumerate(words):
            emit(word if i == 0 else f" {word}")
            await asyncio.sleep(0.02)
        return {**state, "step": "CHATTING", "memory": memory}, answer
