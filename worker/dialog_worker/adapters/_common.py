"""What the three adapters share, free of any framework: their options, the bounds of the
conversation kept in the session's state, the step journal for model answers, a provider's
429 as `RateLimited`, and the worker's own signals out of a framework's exception groups.

Why model answers are journaled: a step runs again after a crash, a lost lease, a retry or a
resume. A model asked again answers differently, with new tool-call ids, so the journal of
tool calls keyed by those ids would miss and the tools would run again. Recording each answer
(`replayed` / `record`, under ``model:<n>``, the n-th call of the step) makes the run after a
crash follow the first one: same answers, same tool-call ids, tools answered from the journal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import hashlib
import json
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import anyio

from dialog_worker.config import limit_key_problem
from dialog_worker.engine.interrupts import Interrupted
from dialog_worker.engine.journal import as_json, check_name, current
from dialog_worker.errors import (
    BudgetExceeded,
    PermanentError,
    RateLimited,
    TransientError,
    ValidationError,
)

T = TypeVar("T")

# The conversation kept in the session's state (docs/engine.md, "Agent frameworks"): the last
# DEFAULT_MAX_TURNS turns, and at most DEFAULT_MAX_MEMORY_BYTES of their JSON (oldest turns
# dropped first; the latest turn is always kept). The state itself is capped at
# DIALOG_MAX_STATE_BYTES (1 MiB) by the worker.
DEFAULT_MAX_TURNS = 20
DEFAULT_MAX_MEMORY_BYTES = 64 * 1024
# A model call's token estimate before it is made: its prompt (4 bytes a token) plus this many
# for the answer, unless the model's settings cap the answer.
DEFAULT_ANSWER_TOKENS = 1024
# How long a cancelled step waits for the framework's run to clean up (close its model stream,
# cancel its tasks) before it gives up on it.
STOP_WAIT_S = 2.0
# Journal names are at most 128 bytes (engine/journal.py): a longer tool-call id is hashed.
MAX_CALL_ID_CHARS = 96


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """An adapter's settings, checked once when the engine is made."""

    limit_key: str | None
    memory_turns: int | None
    memory_bytes: int | None
    answer_tokens: int
    interrupt_timeout_s: float | None

    def key_for(self, model_name: str) -> str:
        """The limit key of a model's calls: the configured one, else ``llm:<model>``."""
        if self.limit_key is not None:
            return self.limit_key
        key = "llm:" + "".join(ch for ch in model_name if not ch.isspace())[:200]
        return key if limit_key_problem(key) is None else "llm:model"


def options(
    limit_key: str | None,
    memory_turns: int | None,
    memory_bytes: int | None,
    answer_tokens: int,
    interrupt_timeout_s: float | None,
) -> Options:
    if limit_key is not None and (problem := limit_key_problem(limit_key)):
        raise ValidationError(f"limit_key: {problem}, got {str(limit_key)[:60]!r}")
    for name, value in (("memory_turns", memory_turns), ("memory_bytes", memory_bytes)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValidationError(f"{name} is a whole number >= 1 or None, got {value!r}")
    if isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int) or answer_tokens < 0:
        raise ValidationError(f"answer_tokens is a whole number >= 0, got {answer_tokens!r}")
    if interrupt_timeout_s is not None and (
        isinstance(interrupt_timeout_s, bool)
        or not isinstance(interrupt_timeout_s, int | float)
        or not math.isfinite(interrupt_timeout_s)
        or interrupt_timeout_s <= 0
    ):
        raise ValidationError(
            f"interrupt_timeout_s is seconds > 0 or None, got {interrupt_timeout_s!r}"
        )
    return Options(limit_key, memory_turns, memory_bytes, answer_tokens, interrupt_timeout_s)


def missing_extra(extra: str, package: str) -> ImportError:
    """The error an adapter raises when its framework is not installed."""
    return ImportError(
        f"this adapter needs the {package!r} package: pip install 'dialog-worker[{extra}]'"
    )


# --- the conversation kept in the state ---


def trim_turns(
    items: Sequence[T],
    starts_turn: Callable[[T], bool],
    max_turns: int | None,
    max_bytes: int | None,
    size_of: Callable[[Sequence[T]], int],
) -> list[T]:
    """The items to keep: whole turns only (a turn starts at an item ``starts_turn`` says, a
    user's message, so a tool call is never cut from its result), the last ``max_turns`` of
    them, then the oldest dropped until ``size_of`` the rest is at most ``max_bytes``. Items
    before the first turn (a system prompt) stay. The latest turn is always kept."""
    starts = [i for i, item in enumerate(items) if starts_turn(item)]
    if not starts:
        return list(items)
    head = list(items[: starts[0]])
    cut = 0  # index into starts: the first kept turn
    if max_turns is not None and len(starts) > max_turns:
        cut = len(starts) - max_turns
    kept = head + list(items[starts[cut] :])
    while max_bytes is not None and cut < len(starts) - 1 and size_of(kept) > max_bytes:
        cut += 1
        kept = head + list(items[starts[cut] :])
    return kept


def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact JSON (UTF-8)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str).encode())


def memory_of(state: dict[str, Any], key: str) -> Any:
    """What the adapter kept under ``key`` of the state's memory (None for a new session or
    a memory that is not a dict)."""
    memory = state.get("memory")
    return memory.get(key) if isinstance(memory, dict) else None


def with_memory(state: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """The new state: ``value`` under ``key`` of the memory (other keys kept), step AGENT."""
    memory = state.get("memory")
    memory = dict(memory) if isinstance(memory, dict) else {}
    memory[key] = value
    return {**state, "step": "AGENT", "memory": memory}


# --- the step journal (model answers; tools go through dialog_worker.once) ---


async def replayed(name: str) -> Any:
    """The value an earlier attempt of this message recorded under ``name`` (JSON), or None
    (nothing recorded, or outside a worker)."""
    journal = current()
    if journal is None:
        return None
    text = await journal.result(check_name(name))
    return None if text is None else json.loads(text)


async def record(name: str, value: Any) -> Any:
    """Record ``value`` (JSON) under ``name`` before it is used; returns what is recorded (an
    earlier record wins). Outside a worker it returns ``value`` as JSON would."""
    text = as_json(value, f"the journal entry {name!r}")
    journal = current()
    if journal is None:
        return json.loads(text)
    return json.loads(await journal.record(check_name(name), text))


def call_name(call_id: str) -> str:
    """The journal name of a tool call: ``tool:<call id>`` (long ids hashed)."""
    if not call_id or len(call_id) > MAX_CALL_ID_CHARS or not call_id.isprintable():
        call_id = "h" + hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    return f"tool:{call_id}"


def approval_question(tool: Any, arguments: Any) -> str:
    """What an approval asks a person (a chat page shows a payload's ``question``)."""
    shown = json.dumps(arguments, ensure_ascii=False, default=str)
    return f"Allow {tool} {shown[:500]}?"


def estimate_tokens(prompt: Any, answer_tokens: int) -> int:
    """A call's tokens before it is made: its prompt's JSON at 4 bytes a token, plus the
    answer allowed."""
    return json_size(prompt) // 4 + 1 + answer_tokens


# --- cancel ---


async def stoppable(run: Coroutine[Any, Any, T]) -> T:
    """Await a framework's run in a task of its own, and cancel that task when the step is
    cancelled. The worker stops a step with an anyio cancel scope, which cancels every await
    of the step again until it returns; a framework's own clean-up (cancel its node tasks,
    close the model's stream) awaits too, and would be cut short, leaving the run going on in
    tasks nobody awaits. Its own task is cancelled once, as asyncio code expects, and given
    `STOP_WAIT_S` to finish."""
    task = asyncio.ensure_future(run)  # a copy of the step's context: journal, emit, limits
    try:
        return await asyncio.shield(task)
    except BaseException:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([task], timeout=STOP_WAIT_S)
        raise


# --- errors ---


def retry_after_s(headers: Any) -> float | None:
    """``Retry-After`` of an HTTP answer's headers, in seconds (a number or an HTTP date)."""
    try:
        value = headers.get("retry-after") if headers is not None else None
    except (AttributeError, TypeError):
        return None
    if not isinstance(value, str) or not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _status_and_headers(exc: BaseException) -> tuple[Any, Any]:
    response = getattr(exc, "response", None)
    status = getattr(exc, "status_code", None) or getattr(response, "status_code", None)
    return status, getattr(response, "headers", None)


def rate_limited(exc: BaseException, key: str) -> RateLimited | None:
    """A provider's 429 found in ``exc`` or what caused it (the frameworks wrap their
    client's errors), as `RateLimited` on ``key`` with its ``Retry-After``; else None."""
    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        if isinstance(found, RateLimited):
            return found
        seen.add(id(found))
        status, headers = _status_and_headers(found)
        if status == 429:
            return RateLimited(
                key, retry_after_s(headers), f"the model provider answered 429 on {key!r}"
            )
        found = found.__cause__ or found.__context__
    return None


# What a step must let reach the worker unchanged (a framework may wrap them in an exception
# group, or in its own error around a tool's or a hook's failure).
WORKER_SIGNALS: tuple[type[BaseException], ...] = (
    Interrupted,
    TransientError,  # RateLimited and the worker's LimitWait among them
    BudgetExceeded,
    PermanentError,
)


def worker_signal(exc: BaseException) -> BaseException | None:
    """The worker's own signal inside ``exc`` (an exception group, or the cause of a
    framework's error), or None."""
    if isinstance(exc, WORKER_SIGNALS):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := worker_signal(inner)) is not None:
                return found
    cause = exc.__cause__
    if cause is not None and cause is not exc:
        return worker_signal(cause)
    return None


def raise_for_worker(exc: BaseException, key: str | None) -> None:
    """Re-raise what the worker must see from a framework's failure: its own signals, a 429
    as `RateLimited`; otherwise return (the caller re-raises ``exc``)."""
    signal = worker_signal(exc)
    if signal is not None and signal is not exc:
        raise signal from None
    if key is not None and signal is None and (limited := rate_limited(exc, key)) is not None:
        raise limited from exc


def reply_text(output: Any) -> str:
    """A framework's final output as the reply: text as is, anything else as JSON."""
    if isinstance(output, str):
        return output
    dump = getattr(output, "model_dump", None)
    if callable(dump):
        output = dump(mode="json")
    return json.dumps(output, ensure_ascii=False, default=str)
