"""`dialog-worker serve` as a real process for the gateway's tests, and a reader of
server-sent events."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis_server import free_port, wait_until

REPO_DIR = Path(__file__).resolve().parent.parent.parent


class GatewayProc:
    def __init__(self, env: dict[str, str], logdir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logdir / "gateway.log"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dialog_worker", "serve", "--port", str(self.port), *args],
                env=env,
                cwd=REPO_DIR,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_until(self._healthy, 20, what="gateway /healthz")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class SSE:
    kind: str
    data: dict[str, Any]
    id: str | None


@dataclass
class SSEParser:
    """Feeds lines of an event stream; collects events, the retry and comment lines."""

    events: list[SSE] = field(default_factory=list)
    retry: int | None = None
    comments: int = 0
    _lines: list[str] = field(default_factory=list)

    def line(self, line: str) -> SSE | None:
        if line:
            self._lines.append(line)
            return None
        lines, self._lines = self._lines, []
        fields: dict[str, str] = {}
        for item in lines:
            if item.startswith(":"):
                self.comments += 1
                continue
            name, _, value = item.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value
        if "retry" in fields:
            self.retry = int(fields["retry"])
        if "event" not in fields:
            return None
        event = SSE(fields["event"], json.loads(fields.get("data", "{}")), fields.get("id"))
        self.events.append(event)
        return event
