"""OpenTelemetry traces of a message's life (optional: ``pip install 'dialog-worker[otel]'``).

Everything that touches OpenTelemetry is here; the rest of the package calls the small API
below and, while tracing is off, pays one check of `enabled` (a plain module attribute). Off
means: the extra is not installed, or the standard ``OTEL_*`` variables do not ask for traces
(`wanted`). Nothing from ``opentelemetry`` is imported then.

The spans of one message (docs/operations.md shows them in a trace viewer):

    <the producer's span>              its context travels in the entry's ``traceparent`` and
      dialog.send       (producer)     ``tracestate`` fields (W3C Trace Context); DialogClient,
      |                                the sync client and the HTTP gateway add them
      +- dialog.intake  (consumer)     first delivery only: from the append to the first pick-up
      |                                (its length is the queue wait, also dialog.queue_wait_ms)
      +- dialog.step    (consumer)     one per attempt, siblings, never nested in one another;
      |  |                             attempt k links to attempts 1..k-1
      |  +- chat <model> (client)      each dialog_worker.model_call (GenAI attributes, usage,
      |  |                             the wait for the key's turn)
      |  +- dialog.commit              the fenced commit; the reply event's ``traceparent``
      |                                names the attempt that produced it
      dialog.stream     (consumer)     a reader of the streamed answer (DialogClient.stream,
                                       the gateway's SSE): its first event's delay, its outcome

Every worker-side span is a child of the message's own context, never of another worker's
span, so a worker killed in the middle of a step leaves no orphan behind: the next attempt
hangs from the same parent. A message without a (valid) ``traceparent`` gets a trace of its
own whose root is its ``dialog.intake``; the ids of that root, and of each attempt's
``dialog.step``, are derived from the message (its session, entry id and attempt number), so
every worker that picks it up, in any process, places its spans in the same trace and links
to the attempts before it without asking Redis. That needs the provider this module makes
(`make_provider`, which `setup` installs); under another provider (a program that set its own
up first) the ids are random, an untraced message's deliveries are separate traces and the
links are left out.

Bad trace context (a malformed ``traceparent`` or ``tracestate``, written by any client with
XADD) is ignored and counted (``dialog_trace_context_invalid_total``): never an error, never a
dead letter. Both fields also reach the engine in ``message["meta"]``, as every other field.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib.util
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dialog_worker.version import __version__

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanContext, Tracer

log = logging.getLogger("dialog_worker.tracing")

# True while spans are made and context is propagated. Read on every hot path: keep it a plain
# module attribute (set by `setup`, `enable`, `disable`).
enabled = False

# The inbound (and reply event) fields that carry W3C Trace Context.
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
TRACE_FIELDS = (TRACEPARENT, TRACESTATE)
TRACE_FIELD_BYTES = frozenset(name.encode() for name in TRACE_FIELDS)

# W3C Trace Context: version 00 is 55 characters; a later version may append fields after a
# dash, so a longer one is read as 00 when its first four fields parse.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
TRACEPARENT_MAX_CHARS = 512
# tracestate: at most 32 list members and 512 characters are propagated (the W3C limits a
# vendor must keep); a longer or malformed one is dropped alone, the traceparent still counts.
TRACESTATE_MAX_CHARS = 512
TRACESTATE_MAX_MEMBERS = 32
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
# Most earlier attempts one dialog.step links to (the most recent ones).
MAX_ATTEMPT_LINKS = 16
# Attribute values cut to this many characters (ids are at most 256 bytes already).
MAX_ATTRIBUTE_CHARS = 256

_tracer: Tracer | None = None
_provider: TracerProvider | None = None  # the one `setup` installed (flushed by `shutdown`)
_own_ids = False  # the tracer's provider uses `_DerivedIds`: ids may be chosen
_sampler: Any = None  # that provider's sampler: an untraced message's root is sampled alike
# (trace id, span id) the next span started in this context must get (see _DerivedIds).
_forced: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "dialog_worker_forced_span_ids", default=None
)


# ----------------------------------------------------------------------------------------
# Turning tracing on and off


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard variables ask for traces: ``OTEL_SDK_DISABLED`` is not ``true``,
    and an exporter is named (``OTEL_TRACES_EXPORTER`` other than ``none``) or an OTLP
    endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``).
    Installing the extra alone turns nothing on. Imports nothing."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporter_names(environ)
    if exporters is not None:
        return bool(exporters)
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    )


def installed() -> bool:
    """Whether the extra's packages are there (without importing them)."""
    try:
        return all(
            importlib.util.find_spec(name) is not None
            for name in ("opentelemetry", "opentelemetry.sdk", "opentelemetry.trace")
        )
    except (ImportError, ValueError):  # a broken install is a missing one
        return False


def setup(service_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """For a process of this package (``dialog-worker run``, ``serve``, ``ask``, ``send``):
    turn tracing on when `wanted`, exporting as the ``OTEL_*`` variables say (the OTLP
    exporter over HTTP by default; ``OTEL_TRACES_SAMPLER`` chooses the sampler). A tracer
    provider that the program had already installed (``opentelemetry-instrument``, your own
    code) is used as it is. Returns whether tracing is on."""
    if not wanted(environ):
        return False
    if not installed():
        log.warning(
            "OTEL_* variables ask for traces, but the opentelemetry packages are missing: "
            "tracing is off (pip install 'dialog-worker[otel]')"
        )
        return False
    from opentelemetry import trace

    global _provider
    current = trace.get_tracer_provider()
    if _is_sdk_provider(current):
        enable(current)
        return True
    exporters = _exporters(environ)
    provider = make_provider(*exporters, service_name=service_name, environ=environ)
    trace.set_tracer_provider(provider)
    _provider = provider
    enable(provider)
    return True


def make_provider(
    *exporters: SpanExporter,
    service_name: str = "dialog-worker",
    batch: bool = True,
    sampler: Any = None,
    environ: Mapping[str, str] = os.environ,
) -> TracerProvider:
    """An SDK tracer provider whose ids this module may derive from a message (see the module
    docstring), exporting to ``exporters`` (in batches, or each span as it ends with
    ``batch=False``: tests). ``sampler`` None: from ``OTEL_TRACES_SAMPLER``."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attributes: dict[str, str] = {"service.version": __version__}
    named = environ.get("OTEL_SERVICE_NAME", "").strip() or "service.name=" in environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    if not named:  # the variables win over our default name
        attributes["service.name"] = service_name
    provider = TracerProvider(
        sampler=sampler, resource=Resource.create(attributes), id_generator=_derived_ids()
    )
    for exporter in exporters:
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
    return provider


def enable(provider: Any = None) -> None:
    """Turn tracing on with ``provider`` (None: the global one, ``trace.get_tracer_provider``):
    for a program that sets OpenTelemetry up in code rather than with ``OTEL_*`` variables,
    and for tests (``enable(make_provider(InMemorySpanExporter(), batch=False))``)."""
    from opentelemetry import trace

    global enabled, _tracer, _own_ids, _sampler
    if provider is None:
        provider = trace.get_tracer_provider()
    _tracer = provider.get_tracer("dialog_worker", __version__)
    # Only a provider `make_provider` made has our id generator (and the class exists then).
    ids = getattr(provider, "id_generator", None)
    _own_ids = _ids_class is not None and isinstance(ids, _ids_class)
    _sampler = getattr(provider, "sampler", None) if _own_ids else None
    enabled = True


def disable() -> None:
    """Turn tracing off (spans already started still end)."""
    global enabled, _tracer, _own_ids, _sampler
    enabled, _tracer, _own_ids, _sampler = False, None, False, None


def shutdown() -> None:
    """Export what is still buffered (at a clean exit) and stop the provider `setup` made."""
    global _provider
    provider, _provider = _provider, None
    disable()
    if provider is not None:
        provider.shutdown()


def _exporter_names(environ: Mapping[str, str]) -> list[str] | None:
    raw = environ.get("OTEL_TRACES_EXPORTER")
    if raw is None or not raw.strip():
        return None
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    return [n for n in names if n != "none"]


def _exporters(environ: Mapping[str, str]) -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    for name in _exporter_names(environ) or ["otlp"]:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            protocol = (
                environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf"
            ).strip()
            exporters.append(_otlp_exporter(protocol))
        else:
            log.warning("OTEL_TRACES_EXPORTER names %r, which is not supported: skipped", name)
    return exporters


def _otlp_exporter(protocol: str) -> SpanExporter:
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            log.warning(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc; "
                "exporting over http/protobuf instead"
            )
        else:
            exporter: SpanExporter = GrpcExporter()
            return exporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _is_sdk_provider(provider: object) -> bool:
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(provider, TracerProvider)


_ids_class: type | None = None


def _derived_ids_class() -> type:
    """`_DerivedIds`, made on first use (it subclasses an SDK class: nothing imported before
    tracing is turned on)."""
    global _ids_class
    if _ids_class is None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        class _DerivedIds(RandomIdGenerator):
            """Random ids, except for a span started under `_forcing`: then the ids derived
            from its message, so any process that starts that span again gives it the same
            ids (and one that links to it finds it)."""

            def generate_span_id(self) -> int:
                forced = _forced.get()
                return forced[1] if forced is not None else super().generate_span_id()

            def generate_trace_id(self) -> int:
                forced = _forced.get()
                return forced[0] if forced is not None else super().generate_trace_id()

        _ids_class = _DerivedIds
    return _ids_class


def _derived_ids() -> Any:
    return _derived_ids_class()()


@contextlib.contextmanager
def _forcing(trace_id: int, span_id: int) -> Iterator[None]:
    token = _forced.set((trace_id, span_id))
    try:
        yield
    finally:
        _forced.reset(token)


def _derive(bits: int, *parts: str | int) -> int:
    """A non-zero id of ``bits`` bits derived from ``parts`` (the same in every process)."""
    data = "\x00".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
    value = int.from_bytes(hashlib.blake2b(data, digest_size=bits // 8).digest(), "big")
    return value or 1


# ----------------------------------------------------------------------------------------
# Trace context in fields and headers


def parse_traceparent(value: str) -> SpanContext | None:
    """The remote span context of a ``traceparent`` value, or None when it is not one (W3C
    rules: lower-case hex, version ff and all-zero ids refused)."""
    from opentelemetry.trace import SpanContext, TraceFlags

    if len(value) > TRACEPARENT_MAX_CHARS:
        return None
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    context = SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16))
    )
    return context if context.is_valid else None


def valid_tracestate(value: str) -> bool:
    """Whether ``value`` is a tracestate this module propagates (W3C list members, at most
    TRACESTATE_MAX_MEMBERS of them and TRACESTATE_MAX_CHARS characters, no repeated key)."""
    if len(value) > TRACESTATE_MAX_CHARS:
        return False
    keys: set[str] = set()
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        if not _TRACESTATE_MEMBER.fullmatch(member):
            return False
        key = member.split("=", 1)[0]
        if key in keys:
            return False
        keys.add(key)
    return len(keys) <= TRACESTATE_MAX_MEMBERS


def _remote_context(traceparent: str | None, tracestate: str | None) -> tuple[Context | None, bool]:
    """(the context to continue, whether anything given was bad)."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanContext, TraceState

    if traceparent is None:
        return None, tracestate is not None  # a tracestate alone means nothing
    parent = parse_traceparent(traceparent)
    if parent is None:
        return None, True
    bad = False
    if tracestate is not None and tracestate.strip(" \t"):
        if valid_tracestate(tracestate):
            parent = SpanContext(
                parent.trace_id,
                parent.span_id,
                is_remote=True,
                trace_flags=parent.trace_flags,
                trace_state=TraceState.from_header([tracestate]),
            )
        else:
            bad = True
    return trace.set_span_in_context(trace.NonRecordingSpan(parent)), bad


def header(span_context: SpanContext) -> str:
    """The ``traceparent`` value of ``span_context``."""
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
        f"{int(span_context.trace_flags) & 0xFF:02x}"
    )


def inject() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the current span, for an entry or a request:
    empty when tracing is off or nothing is current."""
    if not enabled:
        return {}
    from opentelemetry import trace

    return _carrier(trace.get_current_span().get_span_context())


def _carrier(span_context: SpanContext) -> dict[str, str]:
    if not span_context.is_valid:
        return {}
    fields = {TRACEPARENT: header(span_context)}
    state = span_context.trace_state.to_header() if span_context.trace_state else ""
    if state:
        fields[TRACESTATE] = state
    return fields


def from_headers(headers: Mapping[str, str]) -> Context | None:
    """The context of an HTTP request's ``traceparent`` / ``tracestate`` headers (the
    gateway), or None (off, absent or bad)."""
    if not enabled:
        return None
    parent = headers.get(TRACEPARENT)
    if parent is None:
        return None
    context, _ = _remote_context(parent, headers.get(TRACESTATE))
    return context


def current() -> Context | None:
    """The current context, to carry to another thread's loop (the sync client); None when
    off."""
    if not enabled:
        return None
    from opentelemetry import context

    return context.get_current()


@contextlib.contextmanager
def attached(ctx: Context | None) -> Iterator[None]:
    """Run the block with ``ctx`` current (nothing when None). Attach and detach happen in one
    task: do not yield to the caller of an async generator inside it."""
    if ctx is None:
        yield
        return
    from opentelemetry import context

    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


# ----------------------------------------------------------------------------------------
# The producer's side


@contextlib.contextmanager
def producing(stream: str, session_id: str, msg_id: str) -> Iterator[dict[str, str]]:
    """A ``dialog.send`` span (kind producer) around one append; yields the fields to add to
    the entry (empty when tracing is off). An exception in the block marks the span failed."""
    tracer = _tracer
    if not enabled or tracer is None:
        yield {}
        return
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span(
        "dialog.send",
        kind=SpanKind.PRODUCER,
        attributes={
            "messaging.system": "redis",
            "messaging.operation.type": "send",
            "messaging.destination.name": _cut(stream),
            "messaging.message.id": _cut(msg_id),
            "dialog.session_id": _cut(session_id),
        },
    ) as span:
        yield _carrier(span.get_span_context())


def fit_fields(
    fields: dict[str, str], carried: Mapping[str, str], extra_room: int, byte_room: int
) -> None:
    """Add the trace fields ``carried`` to an entry's ``fields`` only where they fit: a field
    the caller set itself is kept, and the message's limits (``extra_room`` more extra fields,
    ``byte_room`` more bytes) are never broken for tracing: ``tracestate`` goes first, then
    ``traceparent``."""
    if TRACEPARENT in fields:
        return  # the caller's own context: not mixed with ours
    for name in TRACE_FIELDS:
        value = carried.get(name)
        if value is None or name in fields:
            continue
        size = len(name) + len(value)
        if extra_room < 1 or size > byte_room:
            if name == TRACEPARENT:
                return  # a tracestate without its traceparent means nothing
            continue
        fields[name] = value
        extra_room -= 1
        byte_room -= size


# ----------------------------------------------------------------------------------------
# The worker's side


class MessageTrace:
    """The spans of one delivery of one message (the pipeline makes one per message it takes
    up; `message_trace`). Its methods are called in the task that works the message, in
    order: `begin_step` (an attempt starts, its span current until `end`), `failed` /
    `handed_back`, `reply_fields` (for the reply event), `begin_commit` / `end_commit`, and
    finally `end`, always."""

    __slots__ = (
        "_commit",
        "_step",
        "_token",
        "all_lost",
        "attempt",
        "entry_id",
        "msg_id",
        "parent",
        "quiet",
        "root_ids",
        "seq",
        "session_id",
        "stream",
    )

    def __init__(
        self,
        tracer: Tracer,
        fields: Mapping[bytes, bytes],
        session_id: str,
        entry_id: str,
        seq: int,
        attempt: int,
        stream: str,
        invalid: Callable[[], object] | None,
        failed_before: bool = False,
    ) -> None:
        self.session_id, self.entry_id, self.seq, self.attempt = session_id, entry_id, seq, attempt
        self.stream = stream
        raw_id = fields.get(b"msg_id")
        self.msg_id = raw_id.decode("utf-8", "replace") if raw_id is not None else entry_id
        self._step: Span | None = None
        self._commit: Span | None = None
        self._token: object = None
        # (trace id, span id) of the message's own root when it carries no context and ids
        # may be derived; else None.
        self.root_ids: tuple[int, int] | None = None
        parent, bad = _remote_context(_field(fields, b"traceparent"), _field(fields, b"tracestate"))
        if bad and invalid is not None:
            invalid()
        if parent is None and _own_ids and entry_id:
            trace_id = _derive(128, "message", session_id, entry_id)
            self.root_ids = (trace_id, _derive(64, "intake", trace_id))
            parent = self._root_context(trace_id, self.root_ids[1])
        self.parent = parent
        # Not sampled (the producer's choice, or the sampler's for an untraced message):
        # no span is made, the context is only passed on (the step's own calls inherit it,
        # the reply event carries it). Most of what a message costs traced is then saved.
        self.quiet = parent is not None and not _sampled(parent)
        # No attempt before this one ended in a way the worker recorded (a failure, a
        # hand-back that kept its attempt): each was lost with its worker (kill -9, a pause
        # past the lease) before its dialog.step was exported. This delivery stands in for
        # the one before it, under its id (that one stood in for its own predecessor when it
        # started); a lost delivery of this kind leaves its span to its successor.
        self.all_lost = _own_ids and bool(entry_id) and not failed_before
        if self.quiet:
            return
        if attempt == 1 and entry_id:
            self._intake(tracer)
        elif self.all_lost:
            self._stand_in(tracer)

    def _attributes(self) -> dict[str, str | int]:
        # Few on purpose: each attribute is encoded for every span, and at thousands of
        # messages a second the encoding is most of what tracing costs (docs/benchmarks.md).
        return {
            "dialog.session_id": _cut(self.session_id),
            "dialog.msg_id": _cut(self.msg_id),
            "dialog.seq": self.seq,
        }

    def _root_context(self, trace_id: int, span_id: int) -> Context:
        """The context of an untraced message's derived root, sampled as its dialog.intake
        was (or will be): same trace id, same sampler, same answer in every process."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        sampled = True
        if _sampler is not None:
            try:
                result = _sampler.should_sample(None, trace_id, "dialog.intake", SpanKind.CONSUMER)
                sampled = result.decision.is_sampled()
            except Exception:  # a sampler of the user's: keep the trace rather than fail
                sampled = True
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        root = SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)
        return trace.set_span_in_context(trace.NonRecordingSpan(root))

    def _intake(self, tracer: Tracer) -> None:
        from opentelemetry.trace import SpanKind

        now_ns = time.time_ns()
        appended_ns = min(now_ns, _entry_time_ms(self.entry_id) * 1_000_000) or now_ns
        attributes = self._attributes()
        attributes["messaging.destination.name"] = _cut(self.stream)
        attributes["dialog.queue_wait_ms"] = (now_ns - appended_ns) // 1_000_000
        if self.root_ids is not None:
            with _forcing(*self.root_ids):  # the message's root: no parent
                span = tracer.start_span(
                    "dialog.intake",
                    context=_empty_context(),
                    kind=SpanKind.CONSUMER,
                    attributes=attributes,
                    start_time=appended_ns,
                )
        else:
            span = tracer.start_span(
                "dialog.intake",
                context=self.parent or _empty_context(),
                kind=SpanKind.CONSUMER,
                attributes=attributes,
                start_time=appended_ns,
            )
            if self.parent is None:  # untraced, random ids: this delivery hangs from it
                from opentelemetry import trace

                self.parent = trace.set_span_in_context(span)
        span.end(end_time=now_ns)

    def _stand_in(self, tracer: Tracer) -> None:
        """A dialog.step for the attempt before this one, lost: zero length, at the time the
        loss was found, under the lost attempt's id (what its exported children name)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        trace_id = self._trace_id()
        if trace_id is None:
            return
        now_ns = time.time_ns()
        attributes = self._attributes()
        attributes["dialog.attempt"] = lost = self.attempt - 1
        attributes["dialog.outcome"] = "lost"
        with _forcing(trace_id, self._step_ids(trace_id, lost)):
            span = tracer.start_span(
                "dialog.step",
                context=self.parent or _empty_context(),
                kind=SpanKind.CONSUMER,
                attributes=attributes,
                start_time=now_ns,
            )
        span.set_status(
            Status(
                StatusCode.ERROR, "worker lost during the step (killed, or paused past its lease)"
            )
        )
        span.end(end_time=now_ns)

    def _step_ids(self, trace_id: int, attempt: int) -> int:
        return _derive(64, "step", trace_id, self.session_id, self.entry_id, attempt)

    def begin_step(self) -> None:
        """The engine's step for this attempt starts: a ``dialog.step`` span, current (model
        calls made in the step hang from it) until `end`."""
        tracer = _tracer
        if tracer is None or self._step is not None or self._token is not None:
            return
        from opentelemetry import context, trace
        from opentelemetry.trace import Link, SpanKind

        if self.quiet:
            assert self.parent is not None
            self._token = context.attach(self.parent)  # the step's calls stay unsampled
            return

        attributes = self._attributes()
        attributes["dialog.attempt"] = self.attempt
        trace_id = self._trace_id()
        if trace_id is not None and _own_ids and self.entry_id:
            first = max(1, self.attempt - MAX_ATTEMPT_LINKS)
            links = [
                Link(
                    _earlier(trace_id, self._step_ids(trace_id, k), self.parent),
                    {"dialog.attempt": k},
                )
                for k in range(first, self.attempt)
            ]
            with _forcing(trace_id, self._step_ids(trace_id, self.attempt)):
                span = tracer.start_span(
                    "dialog.step",
                    context=self.parent or _empty_context(),
                    kind=SpanKind.CONSUMER,
                    attributes=attributes,
                    links=links,
                )
        else:
            span = tracer.start_span(
                "dialog.step",
                context=self.parent or _empty_context(),
                kind=SpanKind.CONSUMER,
                attributes=attributes,
            )
        self._step = span
        self._token = context.attach(trace.set_span_in_context(span))

    def _trace_id(self) -> int | None:
        if self.parent is None:
            return None
        from opentelemetry import trace

        span_context = trace.get_current_span(self.parent).get_span_context()
        return span_context.trace_id if span_context.is_valid else None

    def failed(self, error: str) -> None:
        """The attempt failed and is retried later (its span says why)."""
        span = self._step
        if span is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, _cut(error)))
            span.set_attribute("dialog.outcome", "retry")

    def handed_back(self, counted: bool) -> None:
        """Shutdown gave the message back. When its attempt is not counted, the next delivery
        runs the same attempt again, under the same span id: this span is dropped (never
        ended, so never exported); the other's takes its place."""
        span = self._step
        if span is None:
            return
        if counted:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, "handed back at shutdown"))
            span.set_attribute("dialog.outcome", "handed_back")
        else:
            self._detach()
            self._step = None

    def reply_fields(self) -> list[str]:
        """``["traceparent", value]`` for the reply event: the attempt that produced the
        reply, or the message's context when it ends without a step."""
        from opentelemetry import trace

        if self._step is not None:
            span_context = self._step.get_span_context()
        elif self.parent is not None:
            span_context = trace.get_current_span(self.parent).get_span_context()
        else:
            return []
        return [TRACEPARENT, header(span_context)] if span_context.is_valid else []

    def begin_commit(self, outcome: str, error: str = "") -> None:
        tracer = _tracer
        if tracer is None or self.quiet:
            return
        from opentelemetry import trace

        parent = trace.set_span_in_context(self._step) if self._step is not None else self.parent
        attributes: dict[str, str | int] = {"dialog.outcome": outcome}  # its step has the ids
        if self._step is None:
            attributes.update(self._attributes())
        self._commit = tracer.start_span(
            "dialog.commit", context=parent or _empty_context(), attributes=attributes
        )
        if self._step is not None:
            self._step.set_attribute("dialog.outcome", outcome)
            if outcome == "dead_lettered":
                from opentelemetry.trace import Status, StatusCode

                self._step.set_status(Status(StatusCode.ERROR, _cut(error) or outcome))

    def end_commit(self, result: str) -> None:
        span, self._commit = self._commit, None
        if span is not None:
            span.set_attribute("dialog.commit_result", result)
            span.end()

    def end(self, lost: bool = False) -> None:
        """The delivery is over (whatever happened): end what is open."""
        if self._commit is not None:
            self.end_commit("unknown")
        span, self._step = self._step, None
        self._detach()
        if span is not None and lost and self.all_lost:
            return  # the successor stands in for it (see __init__): not ended, not exported
        if span is not None:
            if lost:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, "lease lost: another worker took over"))
                span.set_attribute("dialog.outcome", "lease_lost")
            span.end()

    def _detach(self) -> None:
        token, self._token = self._token, None
        if token is not None:
            from opentelemetry import context

            context.detach(token)  # type: ignore[arg-type]


def message_trace(
    fields: Mapping[bytes, bytes],
    session_id: str,
    entry_id: str,
    seq: int,
    attempt: int,
    stream: str,
    invalid: Callable[[], object] | None = None,
    failed_before: bool = False,
) -> MessageTrace | None:
    """The spans of one delivery of a message (None when tracing is off). ``invalid`` is
    called once when its trace context fields are bad (they are ignored). ``failed_before``:
    an earlier attempt's end was recorded (its error: a failure, or a hand-back that kept
    its attempt)."""
    tracer = _tracer
    if not enabled or tracer is None:
        return None
    return MessageTrace(
        tracer, fields, session_id, entry_id, seq, attempt, stream, invalid, failed_before
    )


def _sampled(ctx: Context) -> bool:
    from opentelemetry import trace

    return trace.get_current_span(ctx).get_span_context().trace_flags.sampled


def _earlier(trace_id: int, span_id: int, parent: Context | None) -> SpanContext:
    from opentelemetry import trace
    from opentelemetry.trace import SpanContext

    flags = (
        trace.get_current_span(parent).get_span_context().trace_flags
        if parent is not None
        else None
    )
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)


def _field(fields: Mapping[bytes, bytes], name: bytes) -> str | None:
    value = fields.get(name)
    if value is None:
        return None
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
        return "\x00"  # not text: refused by the parser, counted as bad


def _entry_time_ms(entry_id: str) -> int:
    head = entry_id.split("-", 1)[0]
    return int(head) if head.isdigit() and len(head) <= 15 else 0


def _empty_context() -> Context:
    from opentelemetry.context import Context

    return Context()


def _cut(value: str) -> str:
    return value if len(value) <= MAX_ATTRIBUTE_CHARS else value[:MAX_ATTRIBUTE_CHARS] + "…"


# ----------------------------------------------------------------------------------------
# The reader's side


class StreamTrace:
    """A ``dialog.stream`` span: one reader of one message's streamed answer, from its start
    to its end (or until it stops reading). Not made current: the reader is an async
    generator, which may resume in another task."""

    __slots__ = ("_first", "_started_ns", "events", "span")

    def __init__(self, tracer: Tracer, session_id: str, msg_id: str, resumed: bool) -> None:
        from opentelemetry.trace import SpanKind

        self.span = tracer.start_span(
            "dialog.stream",
            kind=SpanKind.CONSUMER,
            attributes={
                "dialog.session_id": _cut(session_id),
                "dialog.msg_id": _cut(msg_id),
                "dialog.resumed": resumed,
            },
        )
        self._started_ns = time.monotonic_ns()
        self._first = False
        self.events = 0

    def saw(self, kind: str, outcome: str | None = None) -> None:
        """One event went to the reader: the first with text marks how long it waited."""
        self.events += 1
        if not self._first and kind in ("delta", "resync", "end"):
            self._first = True
            waited_ms = (time.monotonic_ns() - self._started_ns) // 1_000_000
            self.span.set_attribute("dialog.first_event_ms", waited_ms)
            self.span.add_event("first_event", {"dialog.event": kind})
        if outcome is not None:
            self.span.set_attribute("dialog.outcome", outcome)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The span current for the block (the send of ``ask_stream`` hangs from it)."""
        from opentelemetry import trace

        with attached(trace.set_span_in_context(self.span)):
            yield

    def end(self, error: BaseException | None = None, reply_traceparent: str = "") -> None:
        """End it; ``reply_traceparent`` (the reply event's) links to the attempt that
        answered, when that is in another trace."""
        self.span.set_attribute("dialog.events", self.events)
        answered = parse_traceparent(reply_traceparent) if reply_traceparent else None
        if answered is not None and answered.trace_id != self.span.get_span_context().trace_id:
            add_link = getattr(self.span, "add_link", None)
            if add_link is not None:
                add_link(answered, {"dialog.link": "answer"})
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, _cut(f"{type(error).__name__}")))
        self.span.end()


def active(trace: StreamTrace | None) -> contextlib.AbstractContextManager[None]:
    """``trace``'s span current for a block (nothing when None)."""
    return contextlib.nullcontext() if trace is None else trace.active()


def stream_trace(session_id: str, msg_id: str, resumed: bool = False) -> StreamTrace | None:
    """A reader's span (None when tracing is off), a child of the current context."""
    tracer = _tracer
    if not enabled or tracer is None:
        return None
    return StreamTrace(tracer, session_id, msg_id, resumed)


# ----------------------------------------------------------------------------------------
# Model calls (the engine API)


@contextlib.contextmanager
def model_call_span(model: str, key: str = "", operation: str = "chat") -> Iterator[Any]:
    """A span for one call to a model provider, inside the running step's ``dialog.step``
    (GenAI semantic conventions: named ``<operation> <model>``, kind client,
    ``gen_ai.request.model``, ``gen_ai.operation.name``, ``gen_ai.provider.name`` from a
    limit key's ``provider:`` prefix). Yields the span (None when tracing is off) for
    `record_usage`; an exception in the block marks it failed."""
    tracer = _tracer
    if not enabled or tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span(
        _cut(f"{operation} {model}"),
        kind=SpanKind.CLIENT,
        attributes=_model_call_attributes(model, key, operation),
    ) as span:
        yield span


def start_model_call(model: str, key: str = "", operation: str = "chat") -> Any:
    """As `model_call_span`, for a call whose start and end are seen in different contexts (a
    framework's callbacks): the span is a child of the current one but not made current, and
    `end_model_call` ends it. None when tracing is off."""
    tracer = _tracer
    if not enabled or tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return tracer.start_span(
        _cut(f"{operation} {model}"),
        kind=SpanKind.CLIENT,
        attributes=_model_call_attributes(model, key, operation),
    )


def end_model_call(span: Any, error: BaseException | None = None) -> None:
    """End a span of `start_model_call`, failed when ``error`` is given."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def _model_call_attributes(model: str, key: str, operation: str) -> dict[str, str]:
    attributes: dict[str, str] = {
        "gen_ai.operation.name": _cut(operation),
        "gen_ai.request.model": _cut(model),
    }
    if key:
        attributes["dialog.limit_key"] = _cut(key)
        provider = key.split(":", 1)[0] if ":" in key else ""
        if provider:
            attributes["gen_ai.provider.name"] = _cut(provider)
    return attributes


def record_usage(
    span: Any,
    input_tokens: int,
    output_tokens: int,
    cost: float | None = None,
    response_model: str | None = None,
) -> None:
    """What a model call used, on its span (``gen_ai.usage.input_tokens`` /
    ``output_tokens``, ``dialog.cost``, and ``gen_ai.response.model`` when the answer named
    its model); nothing when ``span`` is None (tracing off)."""
    if span is None:
        return
    span.set_attribute("gen_ai.usage.input_tokens", int(input_tokens))
    span.set_attribute("gen_ai.usage.output_tokens", int(output_tokens))
    if cost is not None:
        span.set_attribute("dialog.cost", float(cost))
    if response_model:
        span.set_attribute("gen_ai.response.model", _cut(response_model))


def record_turn_wait(span: Any, wait_ms: float) -> None:
    """How long a model call waited for its limit key's turn (``dialog.turn_wait_ms``);
    nothing when ``span`` is None."""
    if span is not None:
        span.set_attribute("dialog.turn_wait_ms", round(float(wait_ms), 3))
