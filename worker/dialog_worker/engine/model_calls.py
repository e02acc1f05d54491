"""Calling a model, the engine's side: `model_call` (wait for a limit key's turn, then report
what the call used) and `usage` (report a call made without a limit key).

    async with dialog_worker.model_call("openai:gpt-4.1", tokens=1200) as call:
        answer = await client.chat(...)          # the provider call itself
        call.usage(answer.input_tokens, answer.output_tokens, cost=answer.cost)

The worker binds the step's attempt in a context variable (`bind`), as for `emit` and
`schedule`; the Redis side (limits shared by the fleet, budgets, usage counters) is the
worker's (dialog_worker/daemon/model_gate.py). Entering a `model_call` may wait a little inside
the step for the key's turn; a longer wait, a pause after a provider's 429 (`RateLimited`) or
a budget spent (`BudgetExceeded`) leave the step with an exception the worker handles: let them
pass. Usage is committed with the step's reply, so it is counted once, however often the step
runs. Outside a worker (an engine's own tests) `model_call` waits for nothing and the usage goes
nowhere, unless the test records it (`recording`).

While tracing is on, each call is a span of its own (``chat <model>``, GenAI attributes: the
model named by the key, what the call reported it used, how long it waited for the key's
turn), a child of the step's ``dialog.step`` (dialog_worker/tracing.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, Protocol, TypeVar, cast

import anyio.from_thread

from dialog_worker import tracing
from dialog_worker.config import limit_key_problem
from dialog_worker.errors import ValidationError

MAX_TOKENS = 10**12
MAX_MODEL_CHARS = 200

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """What one model call used. ``cost`` in your currency (None: not known)."""

    model: str
    input_tokens: int
    output_tokens: int
    cost: float | None = None

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def checked_usage(
    model: object, input_tokens: object, output_tokens: object, cost: object
) -> Usage:
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_CHARS:
        raise ValidationError(f"model is text of 1 to {MAX_MODEL_CHARS} characters, got {model!r}")
    for name, value in (("input_tokens", input_tokens), ("output_tokens", output_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
            raise ValidationError(f"{name} is a whole number from 0 to {MAX_TOKENS}, got {value!r}")
    if cost is not None and (
        isinstance(cost, bool)
        or not isinstance(cost, int | float)
        or not math.isfinite(cost)
        or not 0 <= cost <= 1e9
    ):
        raise ValidationError(f"cost is a number >= 0 or None, got {cost!r}")
    return Usage(
        model,
        cast(int, input_tokens),
        cast(int, output_tokens),
        None if cost is None else float(cast(float, cost)),
    )


class Calls(Protocol):
    """The worker's side of one attempt of one step."""

    async def acquire(self, key: str, tokens: int) -> object:
        """Wait for the key's turn (and reserve the tokens from the budget); returns what
        `settle` is given. Raises `LimitWait` / `BudgetExceeded` for the worker."""
        ...

    async def settle(
        self, key: str, grant: object, reports: list[Usage], error: BaseException | None
    ) -> None:
        """The call ended (``error``: what left its block, if anything)."""
        ...

    def record(self, report: Usage) -> None:
        """Usage of a call made without a limit key."""
        ...


_calls: contextvars.ContextVar[Calls | None] = contextvars.ContextVar(
    "dialog_worker_model_calls", default=None
)
# The innermost `model_call` block running in this context: `usage()` inside it is its usage.
_active: contextvars.ContextVar[ModelCall | None] = contextvars.ContextVar(
    "dialog_worker_model_call", default=None
)


def bind(calls: Calls | None) -> contextvars.Token[Calls | None]:
    """For the worker: the attempt of the step about to run in this context."""
    return _calls.set(calls)


def unbind(token: contextvars.Token[Calls | None]) -> None:
    _calls.reset(token)


class ModelCall:
    """One call to a model through a limit key: ``async with`` in an ``async def`` step,
    ``with`` in a plain ``def`` step, or a decorator of the function that makes the call."""

    def __init__(self, key: str, tokens: int) -> None:
        problem = limit_key_problem(key)
        if problem:
            raise ValidationError(f"{problem}, got {str(key)[:60]!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS:
            raise ValidationError(
                f"tokens is a whole number from 0 to {MAX_TOKENS}, got {tokens!r}"
            )
        self.key = key
        self.tokens = tokens
        self.reports: list[Usage] = []
        self._calls: Calls | None = None
        self._grant: object = None
        self._active: contextvars.Token[ModelCall | None] | None = None
        # The call's span while it is open: its context manager, and the span (None while
        # tracing is off).
        self._span_cm: contextlib.AbstractContextManager[Any] | None = None
        self._span: Any = None

    def usage(
        self,
        input_tokens: int,
        output_tokens: int,
        cost: float | None = None,
        *,
        model: str | None = None,
    ) -> None:
        """What this call used (from the provider's answer: its ``usage``). ``model``
        defaults to the limit key. Call it once per call; several reports add up."""
        self.reports.append(checked_usage(model or self.key, input_tokens, output_tokens, cost))

    # --- async with ---

    async def __aenter__(self) -> ModelCall:
        self._enter_checks()
        span = self._begin_span()
        calls = _calls.get()
        if calls is not None:
            started = time.monotonic()
            try:
                self._grant = await calls.acquire(self.key, self.tokens)
            except BaseException as exc:
                self._end_span(exc)  # no call: a wait handed back, a budget spent
                raise
            tracing.record_turn_wait(span, (time.monotonic() - started) * 1000)
            self._calls = calls
        self._active = _active.set(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()
        calls, self._calls = self._calls, None
        try:
            if calls is not None:
                with anyio.CancelScope(shield=True):  # its slot is given back when cancelled
                    await calls.settle(self.key, self._grant, self.reports, exc)
        finally:
            self._end_span(exc)

    # --- begin / end: a call whose start and end are seen in different contexts ---

    async def begin(self) -> ModelCall:
        """Wait for the key's turn, as ``async with`` does, for a caller that sees the call's
        start and end in different contexts (a framework's callbacks): report its usage with
        `usage` on this object, then `end` it, also when it failed."""
        self._enter_checks()
        span = self._begin_span(current=False)  # ended in another context: never current
        calls = _calls.get()
        if calls is not None:
            started = time.monotonic()
            try:
                self._grant = await calls.acquire(self.key, self.tokens)
            except BaseException as exc:
                self._end_span(exc)
                raise
            tracing.record_turn_wait(span, (time.monotonic() - started) * 1000)
            self._calls = calls
        return self

    async def end(self, error: BaseException | None = None) -> None:
        """The call `begin` started ended (``error``: how it failed, if it did)."""
        calls, self._calls = self._calls, None
        try:
            if calls is not None:
                with anyio.CancelScope(shield=True):
                    await calls.settle(self.key, self._grant, self.reports, error)
        finally:
            self._end_span(error)

    # --- with (a plain def step runs in a worker thread) ---

    def __enter__(self) -> ModelCall:
        self._enter_checks()
        span = self._begin_span()
        calls = _calls.get()
        if calls is not None:
            started = time.monotonic()
            try:
                self._grant = _from_thread(calls.acquire, self.key, self.tokens)
            except BaseException as exc:
                self._end_span(exc)
                raise
            tracing.record_turn_wait(span, (time.monotonic() - started) * 1000)
            self._calls = calls
        self._active = _active.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()
        calls, self._calls = self._calls, None
        try:
            if calls is not None:
                _from_thread(calls.settle, self.key, self._grant, self.reports, exc)
        finally:
            self._end_span(exc)

    # --- its span (while tracing is on) ---

    def _begin_span(self, current: bool = True) -> Any:
        """Open the call's span until `_end_span`: from before the wait for the key's turn to
        after its slot is given back; ``current`` (as in a ``with`` block) while it is open.
        The model is the key's part after its ``provider:`` prefix (the whole key without
        one). Returns the span, or None."""
        provider, _, model = self.key.partition(":")
        if current:
            self._span_cm = tracing.model_call_span(model or provider, self.key)
            self._span = self._span_cm.__enter__()
        else:
            self._span = tracing.start_model_call(model or provider, self.key)
        return self._span

    def _end_span(self, error: BaseException | None) -> None:
        span_cm, span, self._span_cm, self._span = self._span_cm, self._span, None, None
        if self.reports:
            costs = [r.cost for r in self.reports]
            model = self.reports[-1].model
            tracing.record_usage(
                span,
                sum(r.input_tokens for r in self.reports),
                sum(r.output_tokens for r in self.reports),
                None if None in costs else sum(c for c in costs if c is not None),
                model if model != self.key else None,
            )
        if span_cm is None:
            tracing.end_model_call(span, error)
        elif error is None:
            span_cm.__exit__(None, None, None)
        else:
            span_cm.__exit__(type(error), error, error.__traceback__)

    # --- as a decorator ---

    def __call__(self, fn: F) -> F:
        """Each call of ``fn`` is one model call on this key (``usage()`` inside it reports
        its usage)."""
        key, tokens = self.key, self.tokens
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                async with ModelCall(key, tokens):
                    return await fn(*args, **kwargs)

            return cast(F, run_async)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with ModelCall(key, tokens):
                return fn(*args, **kwargs)

        return cast(F, run)

    def _enter_checks(self) -> None:
        if self._active is not None or self._calls is not None:
            raise RuntimeError("a model_call is entered once: make one per call")

    def _leave(self) -> None:
        if self._active is not None:
            _active.reset(self._active)
            self._active = None


def model_call(key: str, *, tokens: int = 0) -> ModelCall:
    """Wait for ``key``'s turn (its rpm, tpm and max_in_flight, shared by every worker; no
    wait and no Redis call for a key without limits), with ``tokens`` the call's estimate
    (prompt plus expected answer: what the key's tpm and the tenant's budget are charged until
    the call reports what it used). See docs/engine.md, "Calling a model"."""
    return ModelCall(key, tokens)


def usage(model: str, input_tokens: int, output_tokens: int, cost: float | None = None) -> None:
    """Report what a model call used. Inside a `model_call` block it is that call's usage;
    elsewhere in a step, a call made without a limit key. Committed with the step's reply
    (per session in the state, per tenant and day in the usage counters); outside a step it
    is ignored."""
    report = checked_usage(model, input_tokens, output_tokens, cost)
    active = _active.get()
    if active is not None:
        active.reports.append(report)
        return
    calls = _calls.get()
    if calls is not None:
        calls.record(report)


def _from_thread(fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
    try:
        return anyio.from_thread.run(fn, *args)
    except RuntimeError as exc:
        if "worker thread" in str(exc) or "event loop" in str(exc):
            raise RuntimeError(
                "a plain `with model_call(...)` runs in a plain def step (a worker thread); "
                "in an async def step use `async with`"
            ) from exc
        raise


class _Recorder:
    """`recording`'s attempt: every call is granted at once; the usage is kept."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    async def acquire(self, key: str, tokens: int) -> object:
        return None

    async def settle(
        self, key: str, grant: object, reports: list[Usage], error: BaseException | None
    ) -> None:
        for r in reports:
            self.reports.append({"key": key, **dataclasses.asdict(r)})
        if not reports:
            self.reports.append({"key": key, "model": None})

    def record(self, report: Usage) -> None:
        self.reports.append({"key": None, **dataclasses.asdict(report)})


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """For an engine's own tests: the usage that steps run inside the block report, one
    dict per report (``key`` (None for `usage` outside a `model_call`), ``model``,
    ``input_tokens``, ``output_tokens``, ``cost``; a `model_call` that reported nothing adds
    ``{"key": key, "model": None}``). Calls are granted at once."""
    recorder = _Recorder()
    token = bind(recorder)
    try:
        yield recorder.reports
    finally:
        unbind(token)
