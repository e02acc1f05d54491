"""Traces in tests: an in-memory exporter turned on for one test, a small OTLP/HTTP receiver
(the protobuf types the OTLP exporter itself uses; a real worker process exports to it), and
the checks every trace test makes (one trace, no orphans).

Import only after ``pytest.importorskip("opentelemetry.sdk")``: the extra may be missing."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dialog_worker import tracing


class Traced(InMemorySpanExporter):
    """The spans of one test, and a tracer of the same provider for the test's own spans
    (the producer's)."""

    tracer: Any

    def seen(self) -> list[Seen]:
        return from_sdk(self.get_finished_spans())


@contextlib.contextmanager
def in_memory_tracing() -> Iterator[Traced]:
    """Tracing on for the block, each span exported as it ends; off again afterwards (the
    module's switch is process-wide: nothing leaks into other tests)."""
    exporter = Traced()
    provider = tracing.make_provider(exporter, batch=False)
    exporter.tracer = provider.get_tracer("tests")
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.disable()


@dataclass(frozen=True)
class Seen:
    """One span as a test looks at it, from the SDK or from OTLP."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int | None
    attributes: dict[str, Any]
    links: tuple[tuple[int, int, dict[str, Any]], ...] = ()
    status: str = ""
    events: tuple[str, ...] = field(default=())


def from_sdk(spans: Iterable[Any]) -> list[Seen]:
    return [
        Seen(
            s.name,
            s.context.trace_id,
            s.context.span_id,
            s.parent.span_id if s.parent is not None else None,
            dict(s.attributes or {}),
            tuple(
                (link.context.trace_id, link.context.span_id, dict(link.attributes or {}))
                for link in s.links
            ),
            s.status.status_code.name,
            tuple(e.name for e in s.events),
        )
        for s in spans
    ]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def from_otlp(request: ExportTraceServiceRequest) -> list[Seen]:
    seen = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                seen.append(
                    Seen(
                        s.name,
                        int.from_bytes(s.trace_id, "big"),
                        int.from_bytes(s.span_id, "big"),
                        int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else None,
                        {a.key: _value(a.value) for a in s.attributes},
                        tuple(
                            (
                                int.from_bytes(link.trace_id, "big"),
                                int.from_bytes(link.span_id, "big"),
                                {a.key: _value(a.value) for a in link.attributes},
                            )
                            for link in s.links
                        ),
                        ("UNSET", "OK", "ERROR")[s.status.code],
                        tuple(e.name for e in s.events),
                    )
                )
    return seen


class OtlpReceiver:
    """POST /v1/traces (OTLP over HTTP, protobuf, optionally gzip): keeps every span."""

    def __init__(self) -> None:
        self.spans: list[Seen] = []
        self.requests = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    receiver.spans += from_otlp(request)
                    receiver.requests += 1
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> list[Seen]:
        with self.lock:
            return list(self.spans)


def named(spans: Iterable[Seen], name: str) -> list[Seen]:
    return [s for s in spans if s.name == name]


def orphans(spans: Iterable[Seen], roots: Iterable[int] = ()) -> list[Seen]:
    """Spans whose parent is neither among ``spans`` nor one of ``roots`` (span ids known to
    exist elsewhere, the producer's)."""
    spans = list(spans)
    known = {s.span_id for s in spans} | set(roots)
    return [s for s in spans if s.parent_id is not None and s.parent_id not in known]


def of_message(spans: Iterable[Seen], msg_id: str) -> list[Seen]:
    """The worker's spans of one message, and whatever hangs from them (model calls)."""
    spans = list(spans)
    mine = {s.span_id for s in spans if s.attributes.get("dialog.msg_id") == msg_id}
    grew = True
    while grew:
        more = {s.span_id for s in spans if s.parent_id in mine} - mine
        grew = bool(more)
        mine |= more
    return [s for s in spans if s.span_id in mine]
