"""A tiny OTLP receiver for a first look at traces: it listens for OTLP over HTTP (protobuf, what
`dialog-worker[otel]` exports by default) and prints each trace as a tree once no span of it
has arrived for a second. For a laptop, not for production (use an OpenTelemetry Collector,
Jaeger or your vendor's endpoint there: docs/operations.md).

    pip install 'dialog-worker[otel]'
    python examples/otlp_print.py --port 4318
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 dialog-worker run

Each line: the span's name, its service, its length, and its dialog.* / gen_ai.* attributes.
"""

from __future__ import annotations

import argparse
import gzip
import http.server
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

QUIET_S = 1.0  # a trace is printed once no span of it arrived for this long


@dataclass
class Span:
    name: str
    service: str
    span_id: bytes
    parent_id: bytes
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


@dataclass
class Trace:
    spans: list[Span] = field(default_factory=list)
    last_seen: float = 0.0


class Traces:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[bytes, Trace] = {}

    def add(self, request: ExportTraceServiceRequest) -> None:
        now = time.monotonic()
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "?",
                )
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        trace = self.open.setdefault(s.trace_id, Trace())
                        trace.last_seen = now
                        trace.spans.append(
                            Span(
                                s.name,
                                service,
                                s.span_id,
                                s.parent_span_id,
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                                {a.key: _value(a.value) for a in s.attributes},
                            )
                        )

    def print_quiet(self) -> None:
        now = time.monotonic()
        with self.lock:
            done = [t for t, trace in self.open.items() if now - trace.last_seen >= QUIET_S]
            finished = [(t, self.open.pop(t)) for t in done]
        for trace_id, trace in finished:
            print(render(trace_id, trace.spans), flush=True)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def render(trace_id: bytes, spans: list[Span]) -> str:
    """The trace as an indented tree, children in start order; spans whose parent did not
    arrive are shown at the top, marked."""
    ids = {s.span_id for s in spans}
    children: dict[bytes, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else b"", []).append(s)
    lines = [f"trace {trace_id.hex()}"]

    def walk(parent: bytes, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            shown = " ".join(
                f"{k}={v}"
                for k, v in sorted(s.attributes.items())
                if k.startswith(("dialog.", "gen_ai.")) and k not in ("dialog.session_id",)
            )
            missing = " (parent not received)" if s.parent_id and depth == 1 else ""
            length_ms = max(0, s.end_ns - s.start_ns) / 1e6
            lines.append(
                f"{'  ' * depth}{s.name} [{s.service}] {length_ms:.1f} ms {shown}{missing}".rstrip()
            )
            walk(s.span_id, depth + 1)

    walk(b"", 1)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=4318, help="port (OTLP/HTTP's is 4318)")
    parser.add_argument(
        "--discard",
        action="store_true",
        help="accept spans and print nothing: a sink for measuring what exporting costs",
    )
    args = parser.parse_args()
    traces = Traces()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            encoding = self.headers.get("Content-Encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.path != "/v1/traces":  # metrics and logs are not shown here
                self.send_response(404)
                self.end_headers()
                return
            if not args.discard:
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                traces.add(request)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"otlp_print: listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        while True:
            time.sleep(0.25)
            traces.print_quiet()
    except KeyboardInterrupt:
        traces.print_quiet()
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
