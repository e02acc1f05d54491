"""What a failed step leads to: how long until the next attempt, and what the dead letter and
the log say about it. Pure functions, so the pipeline and the tests share one definition."""

from __future__ import annotations

import os
import random
import sysconfig
import traceback

from dialog_worker.errors import TransientError

# A `retry_after` longer than this is cut to it: the session's later messages wait behind a
# message in backoff, so an upstream that asks for an hour must not hold a conversation an hour.
RETRY_AFTER_CEILING_MS = 10 * 60 * 1000
# How many of the innermost frames a dead letter keeps, and its total size.
FAILURE_FRAMES = 5
FAILURE_MAX_CHARS = 2000
_CAUSE_MAX_CHARS = 300


def retry_delay_ms(
    attempt: int,
    base_ms: int,
    max_ms: int,
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> int:
    """The wait before attempt ``attempt + 1``, after ``attempt`` (1, 2, ...) failed.

    Capped exponential backoff with equal jitter: ``ceiling = min(max_ms, base_ms * 2**(n-1))``,
    half of it fixed and half random, so the retries of a burst spread out but never come back
    sooner than half a step. When the failure named a ``retry_after_s`` (an HTTP 429's
    Retry-After), the wait is at least that, plus up to a tenth of it at random so that many
    messages told the same time do not all return at once; capped at
    `RETRY_AFTER_CEILING_MS` (or ``max_ms`` if that is larger).
    """
    draw = (rng or random).uniform
    exponent = min(max(0, attempt - 1), 62)  # 2**62 * base already exceeds any max_ms
    ceiling = min(max_ms, base_ms * 2**exponent)
    delay = ceiling / 2 + draw(0, ceiling / 2)
    if retry_after_s is not None and retry_after_s > 0:
        wanted = retry_after_s * 1000
        delay = max(delay, wanted + draw(0, wanted / 10))
        delay = min(delay, max(RETRY_AFTER_CEILING_MS, max_ms))
    return int(delay)


def retry_after_of(exc: BaseException) -> float | None:
    """The ``retry_after`` (seconds) a step's failure asked for, if any."""
    return exc.retry_after if isinstance(exc, TransientError) else None


def describe_failure(exc: BaseException, max_chars: int = FAILURE_MAX_CHARS) -> str:
    """``Type: message``, the cause if the error was raised from another, and the innermost
    traceback frames, the engine's own before those of libraries and of the worker, in at most
    ``max_chars`` characters: what a dead letter keeps so that an engine bug can be found
    without the worker's logs.

        ValueError: memory is not a dict
        caused by KeyError: 'user'
        Traceback (innermost 2 frames):
          File "/app/bot.py", line 40, in step
            name = state["memory"]["user"]
          ...
    """
    head = _headline(exc)
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None:
        head += "\ncaused by " + _headline(cause)[:_CAUSE_MAX_CHARS]
    frames = list(traceback.extract_tb(exc.__traceback__))
    # The engine's own frames first (the step, the code it calls): a failure inside a
    # library (an HTTP client, a JSON parser) is found from where the engine called it.
    own = [f for f in frames if not _library_file(f.filename)][-FAILURE_FRAMES:]
    others = [f for f in frames if _library_file(f.filename)][-FAILURE_FRAMES:]
    frames = own + others if own else others
    body = ""
    if frames:
        lines = [_without_carets(line) for line in traceback.format_list(frames)]
        # Keep the innermost frames first when space is short: that is where the error is.
        budget = max(0, max_chars - min(len(head), max_chars // 2) - 60)
        kept: list[str] = []
        for line in lines:  # the engine's frames first: when space is short they stay
            if sum(map(len, kept)) + len(line) > budget:
                break
            kept.append(line)
        if kept:
            where = ", the engine's first" if own and others else ""
            body = f"\nTraceback (innermost {len(kept)} frames{where}):\n" + "".join(kept).rstrip(
                "\n"
            )
    room = max_chars - len(body)
    if len(head) > room:
        head = head[: max(0, room - 1)] + "…"
    return (head + body)[:max_chars]


_LIBRARY_DIRS = tuple(
    {
        os.path.realpath(path) + os.sep
        for name in ("stdlib", "platstdlib", "purelib", "platlib")
        if (path := sysconfig.get_paths().get(name))
    }
    | {os.path.realpath(os.path.dirname(os.path.dirname(__file__))) + os.sep}  # the package
)


def _library_file(filename: str) -> bool:
    """A frame of the standard library, an installed package or this worker (not the
    engine's own code)."""
    return os.path.realpath(filename).startswith(_LIBRARY_DIRS) or filename.startswith("<")


def _without_carets(frame: str) -> str:
    """Python 3.11+ underlines the failing expression with ~ and ^: noise in a dead letter."""
    kept = [line for line in frame.splitlines(keepends=True) if line.strip(" ~^\n")]
    return "".join(kept)


def _headline(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
