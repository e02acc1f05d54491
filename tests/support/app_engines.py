"""Engines for the end-to-end tests of the engine API, loaded by worker processes with
DIALOG_ENGINE=app_engines:<Name>. Each is what a user would write; the ones that must report
what happened append JSON lines to the file named by APP_ENGINE_LOG."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from dialog_worker import PermanentError, TransientError
from dialog_worker.engine.rules import load_rules


def record(event: str, **fields: Any) -> None:
    path = os.environ.get("APP_ENGINE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


class Counter:
    """A plain def step whose memory is an int: how many messages the session sent."""

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        count = (state["memory"] if isinstance(state["memory"], int) else 0) + 1
        return {**state, "step": "COUNTING", "memory": count}, f"message {count}"


class Profile:
    """An async step whose memory is nested JSON: a profile with a list and a number."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        memory = state["memory"] or {"profile": {"words": []}, "chars": 0}
        memory["profile"]["words"].append(message["text"].split()[0])
        memory["chars"] += len(message["text"])
        return {**state, "step": "PROFILING", "memory": memory}, json.dumps(memory)


class RateLimited:
    """The first attempt at every message is refused like an HTTP 429 with Retry-After: 2."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        record("attempt", msg_id=message["msg_id"], attempt=message.get("attempt"))
        marker = f"{os.environ['APP_ENGINE_LOG']}.{message['msg_id']}"
        if not os.path.exists(marker):  # noqa: ASYNC240 - a test toggle, microseconds
            open(marker, "w").close()  # noqa: ASYNC230 - as above
            raise TransientError("LLM API returned 429", retry_after=2)
        return {**state, "step": "ANSWERED"}, "finally"


class SlowBlocking:
    """A plain def step that blocks longer than the lock lease, as a synchronous HTTP client
    would: it runs in a thread, so the worker keeps renewing the lease meanwhile."""

    def __init__(self) -> None:
        self.rules = load_rules()

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        time.sleep(float(os.environ.get("APP_ENGINE_SLEEP_S", "1.5")))
        return self.rules.step(state, message)


class Hooked:
    """startup() and shutdown() leave a trace; a step before startup would be a bug."""

    def __init__(self) -> None:
        self.started = False

    async def startup(self) -> None:
        self.started = True
        record("startup", pid=os.getpid())

    async def shutdown(self) -> None:
        record("shutdown", pid=os.getpid())

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        if not self.started:
            raise RuntimeError("step before startup()")
        return {**state, "step": "HOOKED"}, "hooked"


class Buggy:
    """An engine bug: a KeyError three frames deep."""

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return self._reply(state, message)

    def _reply(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return state, self._name(state)

    def _name(self, state: dict[str, Any]) -> str:
        return str(state["memory"]["userName"])


class StartupFails:
    """startup() cannot reach what it needs, as a wrong API key or a missing model would."""

    async def startup(self) -> None:
        raise ConnectionRefusedError("model server at 127.0.0.1:9 refused the connection")

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        raise AssertionError("step without a started engine")


class English:
    """A bot in English: it apologises in English when a message cannot be processed."""

    fallback_reply = "Sorry, we could not process your message. Please try again later."

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        if message["text"] == "poison":
            raise PermanentError("this message can never be answered")
        return {**state, "step": "CHATTING"}, f"you said {message['text']}"
