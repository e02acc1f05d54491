"""structlog set-up: JSON (or console) lines on stdout, per-message context via contextvars.

Every line carries ``consumer``; lines about one message also carry ``session_id``,
``msg_id``, ``seq``, ``entry_id`` and ``attempt`` (bound by the pipeline for the life of the
message) and, where it has one, ``outcome`` and ``duration_ms``. The Redis URL is only ever
logged redacted (``Settings.redacted_url``), and values that look like a URL with credentials
are redacted again here as a last line of defence.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from dialog_worker.config import redact_url


def _static(**fields: Any) -> structlog.types.Processor:
    def add(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in fields.items():
            event.setdefault(key, value)
        return event

    return add


def _redact_urls(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in event.items():
        if isinstance(value, str) and "://" in value and "@" in value:
            event[key] = redact_url(value)
    return event


def _colour(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def configure(level: str = "info", fmt: str = "json", consumer: str | None = None) -> None:
    renderer: structlog.types.Processor = (
        # Colour codes only for a terminal: in a file or a log collector they are noise.
        structlog.dev.ConsoleRenderer(colors=_colour(sys.stdout))
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _static(**({"consumer": consumer} if consumer else {})),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redact_urls,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # One write per line (PrintLogger writes the newline apart): under `run --processes N`
        # every child shares the supervisor's stdout, and with PYTHONUNBUFFERED set, lines
        # written in two pieces interleave into invalid JSON.
        logger_factory=structlog.WriteLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
