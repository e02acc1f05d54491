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


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream", "coloured"), [(io.StringIO, False), (Terminal, True)])
def test_console_format_has_colour_codes_only_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, stream: type[io.StringIO], coloured: bool
) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = stream()
    monkeypatch.setattr(sys, "stdout", out)
    try:
        configure("info", "console", "c1")
        structlog.get_logger("t").info("hello", n=1)
    finally:
        structlog.reset_defaults()
    assert "hello" in out.getvalue()
    assert ("\x1b[" in out.getvalue()) is coloured
