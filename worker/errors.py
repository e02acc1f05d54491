"""Error types. Whether a failure is retried is decided by its class, never by its text."""

from __future__ import annotations


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
    """Retry later with backoff: the same input may succeed (timeouts, outages)."""


class PermanentError(DialogWorkerError):
    """Dead-letter now: the same input will fail again (bad data, refused content)."""
