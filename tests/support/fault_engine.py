"""A dialog engine for fault tests, loaded by worker processes with
DIALOG_ENGINE=fault_engine:make. The text decides what happens, so a test chooses the fault
per message:
    "boom ..."      raises RuntimeError every time (a failed attempt)
    "fatal ..."     raises PermanentError (dead-letter at once)
    "exit ..."      kills its worker process with os._exit (a poison message)
    "sleep S ..."   sleeps S seconds, then behaves as the default rules
    "pause ..."     on its first attempt, stops its own worker process (SIGSTOP) as the step
                    ends, so a test can resume it (SIGCONT) after its lease ran out: the
                    commit is the first thing it sends when it wakes; then the default rules
    "flaky ..."     raises while the file named by FAULT_FLAG_FILE exists
    "hold ..."      waits while the file named by FAULT_FLAG_FILE exists, then default rules
    "big N ..."     returns a state whose memory holds N more bytes
    anything else   the default rules
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio

from dialog_worker.engine.rules import load_rules
from dialog_worker.errors import PermanentError


class FaultEngine:
    def __init__(self) -> None:
        self.rules = load_rules()

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        text = message["text"]
        if text.startswith("boom"):
            raise RuntimeError(f"boom on seq {message['seq']}")
        if text.startswith("fatal"):
            raise PermanentError("refused by the engine")
        if text.startswith("exit"):
            os._exit(3)
        flag = os.environ.get("FAULT_FLAG_FILE")
        if text.startswith("flaky") and flag and os.path.exists(flag):  # noqa: ASYNC240 - a test toggle
            raise RuntimeError("flaky: flag file present")
        # A test toggle polled from another process: no event to wait on.
        while text.startswith("hold") and flag and os.path.exists(flag):  # noqa: ASYNC110, ASYNC240
            await anyio.sleep(0.02)
        if text.startswith("sleep "):
            await anyio.sleep(float(text.split()[1]))
        if text.startswith("pause") and message["attempt"] == 1:
            # Synchronously, inside the event loop: when the process wakes, the step returns
            # and its commit is queued before any timer (the lease heartbeat) can run.
            os.kill(os.getpid(), signal.SIGSTOP)
        if text.startswith("big "):
            size = int(text.split()[1])
            return {**state, "memory": {**state["memory"], "blob": "x" * size}}, "big"
        return self.rules.step(state, message)


def make() -> FaultEngine:
    return FaultEngine()
