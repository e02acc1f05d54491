"""Processes that share one stdout (`run --processes N`) must each write a log line with one
write call: a line written in pieces interleaves with another process's line."""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from dialog_worker.log import configure


class Recording(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_each_log_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    out = Recording()
    monkeypatch.setattr(sys, "stdout", out)
    try:
        configure("info", "json", "c1")
        structlog.get_logger("t").info("hello", n=1)
    finally:
        structlog.reset_defaults()
    [call] = out.calls
    assert call.endswith("\n") and json.loads(call)["event"] == "hello"
