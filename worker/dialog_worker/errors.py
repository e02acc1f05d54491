"""Error types. Whether a failure is retried is decided by its class, never by its text."""

from __future__ import annotations

import datetime
import email.utils
import math
import time

from redis.exceptions import ConnectionError as RedisConnectionError


class DialogWorkerError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(DialogWorkerError):
    """A setting has an invalid value. The message names the setting."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting}: {problem}")
        self.setting = setting
        self.problem = problem


class ValidationError(DialogWorkerError, ValueError):
    """A session id, message id or text was refused before anything was written."""


class TransientError(DialogWorkerError):
    """Retry later with backoff: the same input may succeed (timeouts, outages, rate limits).

    ``retry_after`` (seconds) is the earliest useful retry, e.g. an HTTP 429's ``Retry-After``:
    the next attempt waits at least that long (within a ceiling, see
    `dialog_worker.daemon.failures`). The header's text may be given as it came (seconds, or
    an HTTP date). A value that names no wait (not a finite number >= 0, a date that cannot be
    read) is ignored rather than raised over, so a bad header still gives an ordinary retry.
    """

    def __init__(self, message: str = "", retry_after: float | str | None = None) -> None:
        super().__init__(message)
        self.retry_after = _seconds_or_none(retry_after)


class RateLimited(TransientError):
    """The model provider refused a call for now (an HTTP 429): raise it from a step with
    the limit key the call went through and the provider's ``Retry-After`` (seconds, or the
    header's text as it came). The key is then paused for every worker of the deployment
    until then (at least a floor that grows with 429s in a row, at most
    DIALOG_MAX_PROVIDER_PAUSE_S), and the message goes back to its session's turn without
    spending an attempt (docs/engine.md). Outside a worker it is an ordinary
    `TransientError` with ``retry_after``."""

    def __init__(
        self, key: str, retry_after_s: float | str | None = None, message: str = ""
    ) -> None:
        super().__init__(
            message or f"model provider rate limit on {key!r}", retry_after=retry_after_s
        )
        self.key = key
        self.retry_after_s = self.retry_after


class LimitWait(RateLimited):
    """Raised by `model_call` (not by engines): the key's next free turn is further away than
    a step waits, so the message goes back to its turn until then (no attempt spent, the key
    not paused). ``retry_after_s`` is how long until the turn."""

    def __init__(self, key: str, retry_after_s: float, why: str) -> None:
        super().__init__(key, retry_after_s, f"{key!r} is busy ({why}) for {retry_after_s:.3f} s")
        self.why = why


class BudgetExceeded(DialogWorkerError):
    """The tenant's (or the session's) daily token budget would be passed by this call: the
    message ends ``budget_exceeded``, with no model call and no dead letter. Raised by
    `model_call`; an engine that catches it should let it go on."""

    def __init__(self, scope: str, name: str, budget: int, used: int) -> None:
        super().__init__(f"{scope} {name!r} used {used} of its {budget} tokens today")
        self.scope = scope
        self.name = name
        self.budget = budget
        self.used = used


class PermanentError(DialogWorkerError):
    """Dead-letter now: the same input will fail again (bad data, refused content)."""


class JournalFull(PermanentError):
    """`dialog_worker.once` could not record a result: the message's journal would pass
    DIALOG_JOURNAL_MAX_BYTES. Permanent: the same step would pass it again."""


class UnrecordableResult(PermanentError):
    """`dialog_worker.once` called its function but cannot record what it returned as JSON (a
    type the journal does not convert, a value nested too deeply, a NaN). Permanent: a
    retry would call the function again (a second refund) and fail the same way, so the
    message is dead-lettered after that one call, with the reason naming the type."""


class InterruptTimeout(PermanentError):
    """Raised by `dialog_worker.interrupt` in the run after its wait timed out
    (``timeout_s`` passed without a resume). Catch it to answer otherwise; uncaught, the
    message is dead-lettered (permanent)."""

    def __init__(self, interrupt_id: str) -> None:
        super().__init__(f"interrupt {interrupt_id} timed out without a resume")
        self.interrupt_id = interrupt_id


class EngineHookError(DialogWorkerError):
    """An engine's ``startup()`` failed: the worker cannot serve messages with it."""


class ReplyTimeout(DialogWorkerError, TimeoutError):
    """`DialogClient.ask` saw no reply in time. The message was sent and may still be
    answered: ask again with the same ``msg_id`` to wait for that same message (a resent
    ``msg_id`` is never applied twice)."""

    def __init__(self, session_id: str, msg_id: str, timeout_s: float, note: str = "") -> None:
        detail = f" ({note})" if note else ""
        super().__init__(
            f"no reply for session {session_id!r} msg_id {msg_id!r} within {timeout_s:g} s"
            f"{detail}; ask again with the same msg_id to keep waiting"
        )
        self.session_id = session_id
        self.msg_id = msg_id
        self.timeout_s = timeout_s


class UncertainSendError(DialogWorkerError, RedisConnectionError):
    """`DialogClient.send` (or `ask`) lost its connection or timed out while appending the
    message: it may or may not be in the stream. Send or ask again with ``msg_id`` (the one
    the client generated, or yours): if the first append did land, the second is answered
    as a duplicate and the message is applied once. A redis-py ``ConnectionError``, so an
    application's existing ``except redis.exceptions.RedisError`` still catches it."""

    def __init__(self, session_id: str, msg_id: str, cause: BaseException) -> None:
        super().__init__(
            f"the message for session {session_id!r} may or may not have been appended "
            f"({type(cause).__name__}: {cause}); send or ask again with msg_id {msg_id!r}"
        )
        self.session_id = session_id
        self.msg_id = msg_id


class ReplyStreamError(DialogWorkerError):
    """Reading a reply stream failed for a reason retrying will not fix (for example a
    missing permission); every waiting `ask` gets it instead of hanging."""


def _seconds_or_none(value: object) -> float | None:
    """Seconds from a number, or from a Retry-After header as it came: its seconds, or its
    HTTP date (a date in the past: 0); None if it names no usable wait."""
    if value is None or isinstance(value, bool):
        return None
    try:
        seconds = float(value)  # type: ignore[arg-type]  # any number-like value is welcome
    except (TypeError, ValueError):
        if not isinstance(value, str):
            return None
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110: an HTTP date is in GMT
            when = when.replace(tzinfo=datetime.UTC)
        seconds = max(0.0, when.timestamp() - time.time())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
