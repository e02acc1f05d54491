"""An engine for the front doors' tests (the LangGraph protocol, the TypeScript client),
loaded by worker processes with DIALOG_ENGINE=chat_engines:Assistant. The message's text
says what the step does:

- ``words N [DELAY_MS]``: streams N words (``w0 w1 ...``), one every DELAY_MS, and answers
  them all;
- ``ask``: streams ``checking ``, a typed event ``tool``, then waits for a person
  (``interrupt({"question": "go on?"})``), streams ``approved `` and answers
  ``approved <value>``;
- anything else: answers ``echo <text>``.

The step keeps the last text in ``memory`` and names what it did in ``step``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import dialog_worker


class Assistant:
    async def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        text = message["text"]
        words = text.split()
        memory = {"last": text}
        if words[0] == "words":
            delay_s = float(words[2]) / 1000 if len(words) > 2 else 0.0
            out = [f"w{i} " for i in range(int(words[1]))]
            for word in out:
                dialog_worker.emit(word)
                await asyncio.sleep(delay_s)
            return {**state, "step": "WORDS", "memory": memory}, "".join(out)
        if words[0] == "ask":
            dialog_worker.emit("checking ")
            dialog_worker.emit_event("tool", {"name": "lookup", "state": "done"})
            value = await dialog_worker.interrupt({"question": "go on?"})
            dialog_worker.emit("approved ")
            return {**state, "step": "ASKED", "memory": memory}, f"approved {json.dumps(value)}"
        return {**state, "step": "ECHO", "memory": memory}, f"echo {text}"
