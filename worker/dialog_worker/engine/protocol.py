"""The engine protocol and its loader: what every engine author reads (docs/engine.md).

An engine turns state and message into new state and reply, and does no other I/O with the
worker: the worker may run a step again for the same message after a crash or a lost lock, so
a step should depend only on its inputs and never change them.

`load_engine` builds the engine named by `DIALOG_ENGINE=package.module:attr` (the built-in
rules of `dialog_worker.engine.rules` when unset) and checks it once at start; `startup_engine` /
`shutdown_engine` run its optional hooks; `run_step` runs every step (``async def`` on the
event loop, plain ``def`` in a worker thread) and checks its result, so a broken engine fails
loudly and in one place; `fallback_reply` is the text of a reply to a message that could not be
processed.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import anyio
import anyio.to_thread
import structlog

from dialog_worker.errors import ConfigError, EngineHookError, PermanentError

# What a step returns: (new_state, reply), the reply being a string, one bubble (a dict with
# "text" and/or "data"), a list of bubbles, or None (no answer). See docs/engine.md.
ReplyValue = str | dict[str, Any] | list[dict[str, Any]] | None
StepResult = tuple[dict[str, Any], ReplyValue]

# Limits of a rich reply (docs/engine.md): past them the step fails like any bad result.
MAX_BUBBLES = 10
MAX_BUBBLES_BYTES = 16384  # the reply event's bubbles field, JSON in UTF-8
BUBBLE_KEYS = frozenset({"text", "data"})

INITIAL_STEP = "ROOT"
ENGINE_SETTING = "DIALOG_ENGINE"
# Fields of the state the worker sets after every step; the engine's values are overwritten.
WORKER_OWNED = ("session_id", "history", "applied_seq", "version", "usage")


log = structlog.get_logger("dialog_worker.engine.protocol")


class Engine(Protocol):
    """What drives a dialog: one ``step`` per message (docs/engine.md).

    ``step(state, message) -> (new_state, reply)`` may be ``async def`` (it runs on the event
    loop: never block in it) or a plain ``def`` (it runs in a worker thread). The state is
    ``{"session_id", "step", "memory", "history", "applied_seq", "version"}``; the engine owns
    ``step`` (a string) and ``memory`` (any JSON value). The message is ``{"session_id",
    "msg_id", "seq", "text", "entry_id", "enqueued_at", "attempt", "meta"}``.

    Optional, not part of the protocol's type: ``async def startup(self)`` before the first
    step (open HTTP clients, pools), ``async def shutdown(self)`` after the last one, and a
    ``fallback_reply`` string: the reply to a message that cannot be processed (dead-lettered),
    in your bot's language (default: `DIALOG_FALLBACK_REPLY`), and a ``budget_reply`` string:
    the reply to a message whose tenant or session spent its tokens of the day (default:
    `DIALOG_BUDGET_REPLY`).
    """

    def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> StepResult | Awaitable[StepResult]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RichReply:
    """A checked reply that is not one plain string: bubbles (each ``{"text": str}`` plus
    ``"data"`` when given, passed through untouched), or no answer at all (``no_reply``).
    ``text`` is what the reply event's ``reply`` field and the history keep: the bubbles' texts
    joined by a blank line ("" for no answer)."""

    text: str
    bubbles: tuple[dict[str, Any], ...] = ()
    no_reply: bool = False

    def event_fields(self) -> list[str]:
        """The reply event's extra fields: ``bubbles`` (JSON) or ``no_reply`` ("1")."""
        if self.no_reply:
            return ["no_reply", "1"]
        return ["bubbles", bubbles_json(self.bubbles)]

    def history_fields(self) -> dict[str, Any]:
        """What a history turn keeps besides its ``bot`` text."""
        if self.no_reply:
            return {"no_reply": True}
        return {"bubbles": list(self.bubbles)}


# A step's reply once checked: plain text stays a str (exactly the reply event of old).
CheckedReply = str | RichReply


def bubbles_json(bubbles: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> str:
    return json.dumps(list(bubbles), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def reply_text(reply: CheckedReply) -> str:
    return reply if isinstance(reply, str) else reply.text


class InlineEngine:
    """Base of the built-in engines that `run_step` calls inline, without copies or a thread:
    their step is synchronous, takes microseconds, never modifies its inputs (tested) and
    returns JSON-safe state. Not for engines of your own: a thread hop costs ~50x, not more."""

    __slots__ = ()


def initial_state(session_id: str) -> dict[str, Any]:
    """The state of a session that has never been seen."""
    return {
        "session_id": session_id,
        "step": INITIAL_STEP,
        "memory": {},
        "history": [],
        "applied_seq": 0,
        "version": 0,
    }


async def run_step(
    engine: Engine,
    state: dict[str, Any],
    message: dict[str, Any],
    *,
    limiter: anyio.CapacityLimiter | None = None,
) -> tuple[dict[str, Any], CheckedReply]:
    """Run one step of any engine and check what it returns.

    An ``async def`` step is awaited on the event loop. A plain ``def`` step runs in a worker
    thread (``limiter`` bounds how many at once; size it to the worker's concurrency), so a
    slow or blocking step never stops the loop that renews the session's lease. A cancelled
    thread step is abandoned: the caller moves on at once, the thread finishes on its own.

    The inputs are deep-copied first so that a plugin which mutates its arguments cannot
    corrupt the caller's copy, which is what the worker retries from. A result of the wrong
    shape would fail again on every delivery, so it is a `PermanentError` (dead-letter now)
    rather than a retryable failure. Errors raised by the engine itself pass through: their
    class already says whether to retry.
    """
    if isinstance(engine, InlineEngine):
        # Our own engine never mutates its inputs (tested) and takes microseconds (compiled
        # patterns, bounded text), so it runs inline: a thread hop would cost it ~50x.
        result: object = engine.step(state, message)
    elif _is_async(engine.step):
        result = engine.step(copy.deepcopy(state), copy.deepcopy(message))  # awaited below
    else:
        result = await anyio.to_thread.run_sync(
            _copied_step, engine.step, state, message, limiter=limiter, abandon_on_cancel=True
        )
    if inspect.isawaitable(result):
        # An async step's coroutine, or a plain def that returned one (a wrapper): on the loop.
        result = await result
    return _checked(
        type(engine).__qualname__, result, validate_json=not isinstance(engine, InlineEngine)
    )


def _copied_step(
    step: Callable[[dict[str, Any], dict[str, Any]], object],
    state: dict[str, Any],
    message: dict[str, Any],
) -> object:
    """In the worker thread: the copies cost the loop nothing there."""
    return step(copy.deepcopy(state), copy.deepcopy(message))


def _is_async(step: object) -> bool:
    if inspect.iscoroutinefunction(step):
        return True
    call = getattr(step, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    return call is not None and inspect.iscoroutinefunction(call)


def _checked(
    engine_name: str, result: object, validate_json: bool
) -> tuple[dict[str, Any], CheckedReply]:
    where = f"engine {engine_name}.step returned"
    if not (isinstance(result, tuple) and len(result) == 2):
        raise PermanentError(f"{where} {describe(result)}, expected (state, reply)")
    new_state, reply = cast(tuple[object, object], result)
    if not isinstance(new_state, dict):
        raise PermanentError(f"{where} state {describe(new_state)}, expected a dict")
    checked: CheckedReply = reply if isinstance(reply, str) else _rich(where, reply)
    if not isinstance(new_state.get("step"), str):
        raise PermanentError(
            f"{where} state whose step is {describe(new_state.get('step'))}, expected a string"
        )
    if "memory" not in new_state:
        raise PermanentError(f"{where} state without memory (keep it, even if empty)")
    if validate_json:
        # What the worker stores must read back the same, from any language: no sets, bytes,
        # objects, NaN or infinities. The worker-owned fields are replaced after the step.
        owned = {k: v for k, v in new_state.items() if k not in WORKER_OWNED}
        try:
            json.dumps(owned, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise PermanentError(f"{where} state that is not JSON: {exc}") from None
    return cast(dict[str, Any], new_state), checked


def _rich(where: str, reply: object) -> RichReply:
    """A reply that is not a string: None, one bubble or a list of bubbles, checked against
    the limits (a PermanentError, like any bad result, when it is past them)."""
    if reply is None:
        return RichReply(text="", no_reply=True)
    if isinstance(reply, dict):
        items: list[object] = [reply]
    elif isinstance(reply, list):
        items = list(reply)
        if not items:
            raise PermanentError(f"{where} an empty list of bubbles (return None for no answer)")
        if len(items) > MAX_BUBBLES:
            raise PermanentError(f"{where} {len(items)} bubbles; at most {MAX_BUBBLES} are allowed")
    else:
        raise PermanentError(
            f"{where} reply {describe(reply)}, expected a string, a dict, a list of dicts or None"
        )
    bubbles: list[dict[str, Any]] = []
    for position, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise PermanentError(f"{where} bubble {position} {describe(item)}, expected a dict")
        unknown = sorted(str(k) for k in item if k not in BUBBLE_KEYS)
        if unknown:
            raise PermanentError(
                f"{where} bubble {position} with key(s) {', '.join(unknown)}; a bubble has "
                "text and data (put everything else inside data)"
            )
        text = item.get("text", "")
        if not isinstance(text, str):
            raise PermanentError(
                f"{where} bubble {position} whose text is {describe(text)}, expected a string"
            )
        bubble: dict[str, Any] = {"text": text}
        if "data" in item:
            bubble["data"] = item["data"]
        bubbles.append(bubble)
    try:
        size = len(bubbles_json(bubbles).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError) as exc:
        raise PermanentError(f"{where} a reply whose data is not JSON: {exc}") from None
    if size > MAX_BUBBLES_BYTES:
        raise PermanentError(
            f"{where} a reply of {size} bytes of JSON; at most {MAX_BUBBLES_BYTES} are allowed"
        )
    # Deep-copied: what is committed cannot change if the engine keeps and edits its objects.
    frozen = tuple(copy.deepcopy(bubbles))
    return RichReply(text="\n\n".join(b["text"] for b in frozen if b["text"]), bubbles=frozen)


async def startup_engine(engine: Engine) -> None:
    """Call the engine's optional ``startup()`` (async, or plain def in a thread) before
    the first step. A failure is an `EngineHookError`: the worker should not take messages
    it cannot serve."""
    try:
        await _call_hook(engine, "startup")
    except Exception as exc:
        raise EngineHookError(
            f"engine {type(engine).__qualname__}.startup() raised {_one_line(exc)}"
        ) from exc


async def shutdown_engine(engine: Engine) -> None:
    """Call the engine's optional ``shutdown()`` after the last step. A failure is logged
    with its traceback and swallowed: shutting down goes on."""
    try:
        await _call_hook(engine, "shutdown")
    except Exception:
        log.exception("engine_shutdown_failed", engine=type(engine).__qualname__)


async def _call_hook(engine: Engine, name: str) -> None:
    hook = getattr(engine, name, None)
    if hook is None:
        return
    if not callable(hook):
        raise TypeError(f"{name} is {describe(hook)}, not a method")
    if _is_async(hook):
        await hook()
        return
    result = await anyio.to_thread.run_sync(hook)
    if inspect.isawaitable(result):
        await result


def describe(value: object) -> str:
    """A short, one-line description of an unexpected value for an error message."""
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{type(value).__name__} {shown}"


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def fallback_reply(engine: Engine, configured: str, default: str) -> str:
    """The reply to a message that cannot be processed: `DIALOG_FALLBACK_REPLY` when it was
    set (``configured`` differs from ``default``), else the engine's own ``fallback_reply``
    attribute, else the default."""
    return _own_reply(engine, "fallback_reply", configured, default)


def budget_reply(engine: Engine, configured: str, default: str) -> str:
    """The reply to a message over its tenant's or session's daily tokens: as `fallback_reply`,
    from `DIALOG_BUDGET_REPLY` or the engine's own ``budget_reply`` attribute."""
    return _own_reply(engine, "budget_reply", configured, default)


def _own_reply(engine: Engine, attribute: str, configured: str, default: str) -> str:
    own = getattr(engine, attribute, None)
    if configured != default or own is None:
        return configured
    if not isinstance(own, str) or not own.strip():
        raise ConfigError(
            ENGINE_SETTING,
            f"{type(engine).__qualname__}.{attribute} is {describe(own)}; it must be "
            "non-empty text",
        )
    return own
