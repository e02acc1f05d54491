"""A tiny HTTP server on 127.0.0.1 for the examples' tests: a fake chat completions API or a
webhook. A test gives it a handler (method, path, JSON body) -> (status, headers, JSON body)
and reads what it received."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = tuple[int, dict[str, str], Any]


class Chunks(list[str]):
    """An answer sent as server-sent events: each item one ``data:`` event, flushed on its own,
    ``delay_s`` apart (a model producing tokens)."""

    def __init__(self, items: list[str], delay_s: float = 0.0) -> None:
        super().__init__(items)
        self.delay_s = delay_s


Handler = Callable[[str, str, Any], Answer]


class HttpStub:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        stub = self

        class RequestHandler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                body = json.loads(raw) if raw else None
                with stub._lock:
                    stub.requests.append(
                        {"path": self.path, "headers": dict(self.headers), "body": body}
                    )
                status, headers, answer = stub.handler("POST", self.path, body)
                if isinstance(answer, Chunks):
                    self._send_events(status, headers, answer)
                    return
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _send_events(self, status: int, headers: dict[str, str], chunks: Chunks) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.close_connection = True
                for item in chunks:
                    self.wfile.write(f"data: {item}\n\n".encode())
                    self.wfile.flush()
                    if chunks.delay_s:
                        time.sleep(chunks.delay_s)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the tests assert on `requests`

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), RequestHandler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HttpStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def bodies(self, path: str | None = None) -> list[Any]:
        with self._lock:
            return [r["body"] for r in self.requests if path is None or r["path"] == path]
