"""The step journal, the engine's side: `once(name, fn, *args, **kwargs)` runs ``fn`` at most
once per message and name, and every later attempt of the same message gets the result the
first one recorded.

A step may run again for the same message (a crash, a lost lease, a retry, or the run after a
person answered an interrupt). What it did through `once` is not done again: the result of
``fn`` (its JSON) is recorded in Redis, fenced by the message's lease (lua/journal-1.lua),
before `once` returns it, and the message's commit deletes the journal. Only results are
kept (never ``fn``'s arguments), at most ``DIALOG_JOURNAL_MAX_BYTES`` per message.

A result is encoded after ``fn`` ran, so whatever cannot be encoded must never send the
message back for another attempt (which would call ``fn`` again: a second refund). The types
payment and model SDKs return (dates, decimals, UUIDs, enums, dataclasses, pydantic models)
are converted to JSON; anything else is refused with `UnrecordableResult`, a permanent error.

One name, two call styles: in an ``async def`` step, ``await once(...)`` (``fn`` may be a
plain function or a coroutine function); in a plain ``def`` step, which runs in a worker
thread, ``once(...)`` returns the value (``fn`` runs in that thread). The journal of the
running step travels in a context variable bound by the worker's pipeline (`bind`), which
``anyio.to_thread.run_sync`` copies into a plain step's thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import datetime
import enum
import inspect
import json
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from decimal import Decimal
from typing import Any, Protocol, TypeVar

from dialog_worker.errors import UnrecordableResult, ValidationError

T = TypeVar("T")

MAX_NAME_BYTES = 128  # lua/journal-1.lua refuses longer names


class StepJournal(Protocol):
    """What the engine's side needs of the running step's journal (the worker's
    dialog_worker/daemon/step_journal.py)."""

    async def result(self, name: str) -> str | None:
        """The JSON text recorded for ``name`` by an earlier attempt (or this one), or None."""

    async def record(self, name: str, value: str) -> str:
        """Record ``value`` (JSON text) for ``name``; returns the JSON text that is recorded
        (an earlier one wins). Raises `JournalFull`, or the step's lease-lost error."""

    async def interrupt_ended(self, n: int) -> dict[str, Any] | None:
        """How the step's ``n``-th interrupt ended (``{"value": ...}`` or
        ``{"timeout": True}``), or None while it has not been asked or answered."""

    def interrupt_id(self, n: int) -> str:
        """The id of the step's ``n``-th interrupt (the same in every attempt)."""

    def next_interrupt(self) -> int:
        """Count one more interrupt() call of this attempt; its number (1, 2, ...)."""

    def interrupt_answered(self) -> None:
        """The last interrupt() call got its value (so the step did await it)."""

    def run_sync(self, call: Coroutine[Any, Any, T]) -> T:
        """From a plain step's thread: run ``call`` on the worker's event loop, wait, return."""


_current: contextvars.ContextVar[StepJournal | None] = contextvars.ContextVar(
    "dialog_worker_step_journal", default=None
)


def bind(journal: StepJournal | None) -> contextvars.Token[StepJournal | None]:
    """For the pipeline: the journal of the step about to run in this context."""
    return _current.set(journal)


def unbind(token: contextvars.Token[StepJournal | None]) -> None:
    _current.reset(token)


def current() -> StepJournal | None:
    return _current.get()


def on_event_loop() -> bool:
    """Called from a thread running an event loop (an ``async def`` step), not from a plain
    step's worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def check_name(name: object) -> str:
    if (
        not isinstance(name, str)
        or not name
        or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
        or any(ord(ch) < 32 or ord(ch) == 127 or 0xD800 <= ord(ch) <= 0xDFFF for ch in name)
    ):
        # A lone surrogate (text cut inside a UTF-16 pair) cannot go to Redis: refused here,
        # before fn runs, not when its result is recorded.
        raise ValidationError(
            f"a once() name is 1 to {MAX_NAME_BYTES} bytes of text without control "
            f"characters, got {name!r}"
        )
    return name


def as_json(value: object, what: str) -> str:
    """``value`` as compact JSON text, or a ValidationError naming ``what``."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{what} is not JSON: {exc}") from None


def result_json(value: object, name: str) -> str:
    """The result of ``once(name)`` as the JSON text the journal records: JSON values as they
    are, `sdk_json` for the types SDK results hold. Raises `UnrecordableResult` (permanent)
    for anything else: ``fn`` has run, and a retry would run it again."""
    try:
        text = json.dumps(
            value, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=sdk_json
        )
    except RecursionError:
        raise UnrecordableResult(_unrecordable(name, value, "it is nested too deeply")) from None
    except Exception as exc:  # whatever encoding raised (a model_dump's own errors too)
        raise UnrecordableResult(_unrecordable(name, value, str(exc))) from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Text cut inside a UTF-16 pair (a lone surrogate) is not UTF-8: kept as \u escapes,
        # which read back as the same string.
        text = json.dumps(value, separators=(",", ":"), allow_nan=False, default=sdk_json)
    return text


def sdk_json(value: object) -> object:
    """``json.dumps``' ``default``: the types payment and model SDKs put in their results, as
    JSON. Dates and times as ISO 8601 text, a Decimal as its text (no float rounding of an
    amount), a UUID as its text, an Enum as its value, a dataclass as a dict, a pydantic
    model (the OpenAI and Anthropic SDKs' results) as ``model_dump(mode="json")``."""
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):
        return model_dump(mode="json")
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _unrecordable(name: str, value: object, why: str) -> str:
    return (
        f"the result of once({name!r}) (a {type(value).__name__}) cannot be recorded as JSON: "
        f"{why}. Its function ran once and is not called again for this message; return "
        "JSON from it (convert other types inside the function)"
    )


def once(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` at most once for this message and ``name``: its result is
    recorded as JSON before `once` returns it, and every later attempt of the message gets
    the recorded result without calling ``fn``. What is returned is the JSON read back (a
    tuple comes back as a list, a datetime as its ISO 8601 text: see `sdk_json`), the same
    in the first attempt as in every later one. A result that cannot be recorded raises
    `UnrecordableResult` (the message is dead-lettered; ``fn`` is not called again).

    ``await dialog_worker.once(...)`` in an ``async def`` step; ``dialog_worker.once(...)``
    (no await) in a plain ``def`` step. An exception raised by ``fn`` is not recorded: it
    passes through, and a later attempt calls ``fn`` again. Give every distinct call its own
    name (``"search:1"``, ``"refund:" + order_id``); a name used twice returns the first
    result. Outside a step (an engine's own unit tests) ``fn`` is simply called."""
    check_name(name)
    if not callable(fn):
        raise ValidationError(f"once() needs a function to call, got {type(fn).__name__}")
    journal = _current.get()
    if on_event_loop():
        return _once(journal, name, fn, args, kwargs)
    if journal is None:
        return _plain(_value(fn(*args, **kwargs)), name)
    recorded = journal.run_sync(journal.result(name))
    if recorded is not None:
        return json.loads(recorded)
    value = fn(*args, **kwargs)
    if inspect.isawaitable(value):
        value = journal.run_sync(_awaited(value))
    return json.loads(journal.run_sync(journal.record(name, result_json(value, name))))


async def _once(
    journal: StepJournal | None,
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if journal is not None:
        recorded = await journal.result(name)
        if recorded is not None:
            return json.loads(recorded)
    value = fn(*args, **kwargs)
    if inspect.isawaitable(value):
        value = await value
    if journal is None:
        return _plain(value, name)
    return json.loads(await journal.record(name, result_json(value, name)))


async def _awaited(value: Awaitable[T]) -> T:
    return await value


def _value(value: object) -> object:
    if inspect.isawaitable(value):
        raise ValidationError("once() in a plain def step needs a plain function, not a coroutine")
    return value


def _plain(value: object, name: str) -> Any:
    return json.loads(result_json(value, name))
