"""The walk-through of docs/operations.md ("Traces (OpenTelemetry)"), as its reader runs it: the
small receiver of examples/otlp_print.py, a worker and `dialog-worker ask`, each a process of
its own with only the OTEL_* variables set, and one message's trace printed as a tree."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from examples_path import EXAMPLES
from redis_server import wait_until
from worker_procs import WorkerPool, run_cli

pytest.importorskip("opentelemetry.proto", reason="needs the otel extra")

pytestmark = pytest.mark.integration


class Printed:
    """examples/otlp_print.py running, its stdout gathered line by line."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "otlp_print.py"), "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        port = re.search(r":(\d+)$", first.strip())
        assert port is not None, first
        self.endpoint = f"http://127.0.0.1:{port.group(1)}"
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def trace(self, trace_id: str) -> list[str]:
        """The lines printed under ``trace <trace_id>`` (every block of it)."""
        shown, inside = [], False
        for line in list(self.lines):
            if line.startswith("trace "):
                inside = line == f"trace {trace_id}"
            elif inside:
                shown.append(line)
        return shown

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def printed() -> Iterator[Printed]:
    p = Printed()
    yield p
    p.stop()


def test_one_message_shows_as_one_trace_from_the_cli_through_the_worker(
    env: dict[str, str], workers: WorkerPool, printed: Printed
) -> None:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": printed.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    workers.start(1, **otel)
    asked = run_cli(env, "ask", "walk-1", "nama saya Budi", **otel)
    assert asked.returncode == 0, asked.stderr
    reply = json.loads(asked.stdout)
    assert reply["text"] == "Halo Budi, ada yang bisa dibantu?"
    trace_id = reply["traceparent"].split("-")[1]

    def whole() -> list[str] | None:
        lines = printed.trace(trace_id)
        return lines if any("dialog.commit" in x for x in lines) and lines[0:1] else None

    lines = wait_until(whole, 30, what="the message's trace printed")
    names = [(len(x) - len(x.lstrip()), x.split()[0], x.split()[1]) for x in lines]
    assert names[:4] == [
        (2, "dialog.send", "[dialog-worker-cli]"),
        (4, "dialog.intake", "[dialog-worker]"),
        (4, "dialog.step", "[dialog-worker]"),
        (6, "dialog.commit", "[dialog-worker]"),
    ], lines
    assert "dialog.attempt=1" in lines[2] and "dialog.outcome=applied" in lines[3]
    assert "dialog.queue_wait_ms=" in lines[1]
