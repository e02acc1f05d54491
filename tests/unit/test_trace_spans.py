"""Traces without Redis (dialog_worker/tracing.py): when tracing is on, what a bad trace
context does, the spans of a message's deliveries (one dialog.step per attempt, siblings,
linked; ids any process derives alike), model-call spans with the GenAI attributes, and that
nothing from opentelemetry is imported while tracing is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import anyio
import anyio.to_thread
import pytest

import dialog_worker
from dialog_worker import tracing
from dialog_worker.client.replies import reply_from_entry
from dialog_worker.engine import model_calls
from dialog_worker.errors import LimitWait
from dialog_worker.store.codec import decode_message

otel = pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra")

from trace_support import Seen, from_sdk, in_memory_tracing, named, orphans  # noqa: E402

PRODUCER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PRODUCER_TRACE, PRODUCER_SPAN = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331


def deliveries(fields: dict[bytes, bytes], attempts: int, entry_id: str = "1700000000000-0"):
    """What the pipeline does for ``attempts`` deliveries of one message, the last applied."""
    for attempt in range(1, attempts + 1):
        trace = tracing.message_trace(
            fields, "s1", entry_id, 1, attempt, "dialog", failed_before=attempt > 1
        )
        assert trace is not None
        trace.begin_step()
        with tracing.model_call_span("m", "p:m"):
            pass
        if attempt < attempts:
            trace.failed("RuntimeError: no")
        else:
            trace.begin_commit("applied")
            trace.end_commit("committed")
        trace.end()


def spans_of(exporter: Any) -> list[Seen]:
    return from_sdk(exporter.get_finished_spans())


# ---------------------------------------------------------------------------------------------
# when tracing is on


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, True),
    ],
)
def test_tracing_is_on_only_when_the_otel_variables_ask_for_traces(
    environ: dict[str, str], on: bool
) -> None:
    assert tracing.wanted(environ) is on


_NO_OTEL = """
import importlib.abc, sys
class NoOtel(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError(name)
sys.meta_path.insert(0, NoOtel())
"""
_OFF_PATHS = """
import sys
import redis, redis.asyncio
before = {m for m in sys.modules if m.startswith("opentelemetry")}
import dialog_worker, dialog_worker.cli, dialog_worker.daemon.worker
from dialog_worker import tracing
from dialog_worker.store.codec import decode_message
assert tracing.setup("t") is False and tracing.enabled is False
assert tracing.message_trace({b"traceparent": b"x"}, "s", "1-0", 1, 1, "d") is None
assert tracing.stream_trace("s", "m") is None and tracing.inject() == {}
with tracing.producing("d", "s", "m") as carried, tracing.model_call_span("m") as span:
    tracing.record_usage(span, 1, 2)
assert carried == {}
decode_message("s", 1, "1-0", 1, {b"text": b"t", b"traceparent": b"\\xff"})
print(sorted(m for m in sys.modules if m.startswith("opentelemetry") and m not in before))
"""


@pytest.mark.parametrize("extra", ["installed", "missing"])
def test_nothing_from_opentelemetry_is_imported_while_tracing_is_off(extra: str) -> None:
    """redis-py 8 imports parts of opentelemetry (its metrics) whenever they are installed:
    what it loads is the baseline; the package must load nothing more. "missing": every
    opentelemetry import fails, as without the extra, and every path still works."""
    code = (_NO_OTEL if extra == "missing" else "") + _OFF_PATHS
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"  # asked for, not installed
    if extra == "installed":
        environ["OTEL_SDK_DISABLED"] = "true"
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.replace("'", '"')) == []
    if extra == "missing":
        assert "opentelemetry packages are missing" in out.stderr


def test_setup_installs_an_exporting_provider_from_the_variables(monkeypatch) -> None:
    from opentelemetry import trace

    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", trace.Once())
    try:
        assert tracing.setup("svc", {"OTEL_TRACES_EXPORTER": "console"})
        provider = trace.get_tracer_provider()
        assert tracing.enabled and provider.resource.attributes["service.name"] == "svc"
        assert tracing._own_ids
    finally:
        tracing.shutdown()
    assert not tracing.enabled


# ---------------------------------------------------------------------------------------------
# trace context in, bad context ignored


@pytest.mark.parametrize(
    "value",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0",  # short flags
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff
        PRODUCER + "-extra",  # version 00 has nothing after the flags
        "x" * 10_000,
        "",
    ],
)
def test_a_malformed_traceparent_is_not_trace_context(value: str) -> None:
    assert tracing.parse_traceparent(value) is None


def test_a_later_traceparent_version_is_read_for_its_known_fields() -> None:
    parsed = tracing.parse_traceparent("01-" + PRODUCER[3:] + "-what-comes-later")
    assert parsed is not None and parsed.trace_id == PRODUCER_TRACE


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE", True),
        ("tenant@vendor=x", True),
        ("", True),
        ("Rojo=1", False),
        ("a=1,a=2", False),
        ("a=" + "v" * 600, False),
        (",".join(f"k{i}=v" for i in range(33)), False),
        ("a=b\x00", False),
    ],
)
def test_tracestate_members_follow_w3c(value: str, ok: bool) -> None:
    assert tracing.valid_tracestate(value) is ok


@pytest.mark.parametrize(
    "fields",
    [
        {b"traceparent": b"nonsense"},
        {b"traceparent": b"\xff\xfe"},
        {b"traceparent": PRODUCER.encode(), b"tracestate": b"BAD STATE"},
        {b"tracestate": b"rojo=1"},  # a tracestate without its traceparent
    ],
)
def test_bad_trace_context_is_counted_and_the_message_still_traced(
    fields: dict[bytes, bytes],
) -> None:
    counted: list[int] = []
    with in_memory_tracing() as exporter:
        trace = tracing.message_trace(
            fields, "s1", "1700000000000-0", 1, 1, "dialog", lambda: counted.append(1)
        )
        assert trace is not None
        trace.begin_step()
        trace.end()
    assert counted == [1]
    [intake] = named(spans_of(exporter), "dialog.intake")
    [step] = named(spans_of(exporter), "dialog.step")
    if fields.get(b"traceparent") == PRODUCER.encode():  # only the tracestate was bad
        assert intake.trace_id == PRODUCER_TRACE and step.parent_id == PRODUCER_SPAN
    else:
        assert intake.parent_id is None and step.parent_id == intake.span_id


def test_trace_fields_that_are_not_utf8_never_make_a_message_malformed() -> None:
    fields = {b"text": b"hi", b"traceparent": b"\xff", b"tracestate": b"\xfe", b"x": b"y"}
    message = decode_message("s1", 1, "1-0", 1, fields)
    assert message.meta == {"x": "y"}  # the bad ones are left out, the message goes on


def test_valid_trace_fields_reach_the_engine_as_meta() -> None:
    fields = {b"text": b"hi", b"traceparent": PRODUCER.encode(), b"tracestate": b"r=1"}
    assert decode_message("s1", 1, "1-0", 1, fields).meta == {
        "traceparent": PRODUCER,
        "tracestate": "r=1",
    }


# ---------------------------------------------------------------------------------------------
# the spans of a message


def test_each_attempt_is_a_sibling_step_under_the_producer_linked_to_the_earlier_ones() -> None:
    with in_memory_tracing() as exporter:
        deliveries({b"traceparent": PRODUCER.encode()}, attempts=3)
    spans = spans_of(exporter)
    assert {s.trace_id for s in spans} == {PRODUCER_TRACE}
    assert orphans(spans, roots=[PRODUCER_SPAN]) == []
    [intake] = named(spans, "dialog.intake")
    steps = sorted(named(spans, "dialog.step"), key=lambda s: s.attributes["dialog.attempt"])
    assert [s.attributes["dialog.attempt"] for s in steps] == [1, 2, 3]
    assert intake.parent_id == PRODUCER_SPAN
    assert all(s.parent_id == PRODUCER_SPAN for s in steps)  # never nested in one another
    assert [s.status for s in steps] == ["ERROR", "ERROR", "UNSET"]
    assert [[(link[1], link[2]["dialog.attempt"]) for link in s.links] for s in steps] == [
        [],
        [(steps[0].span_id, 1)],
        [(steps[0].span_id, 1), (steps[1].span_id, 2)],
    ]
    [commit] = named(spans, "dialog.commit")
    assert commit.parent_id == steps[2].span_id
    assert commit.attributes["dialog.outcome"] == "applied"
    calls = named(spans, "chat m")
    assert sorted(c.parent_id for c in calls) == sorted(s.span_id for s in steps)


def test_a_step_span_has_the_same_id_in_whichever_process_runs_that_attempt() -> None:
    fields = {b"traceparent": PRODUCER.encode()}
    with in_memory_tracing() as first:
        deliveries(fields, attempts=2)
    with in_memory_tracing() as second:  # another provider: another process
        deliveries(fields, attempts=2)
    ids = [sorted(s.span_id for s in named(spans_of(e), "dialog.step")) for e in (first, second)]
    assert ids[0] == ids[1]
    with in_memory_tracing() as other:  # another message: other ids
        deliveries(fields, attempts=2, entry_id="1700000000000-1")
    assert not set(ids[0]) & {s.span_id for s in named(spans_of(other), "dialog.step")}


def test_an_untraced_message_gets_one_trace_rooted_at_its_intake_for_all_deliveries() -> None:
    with in_memory_tracing() as exporter:
        deliveries({b"text": b"no context"}, attempts=2)
    spans = spans_of(exporter)
    [intake] = named(spans, "dialog.intake")
    assert intake.parent_id is None
    assert {s.trace_id for s in spans} == {intake.trace_id}
    assert {s.parent_id for s in named(spans, "dialog.step")} == {intake.span_id}
    assert orphans(spans) == []


def test_intake_span_covers_the_queue_wait() -> None:
    with in_memory_tracing() as exporter:
        trace = tracing.message_trace({}, "s1", "1000-0", 1, 1, "dialog")
        assert trace is not None
        trace.end()
        later = tracing.message_trace({}, "s1", "1000-0", 1, 2, "dialog", failed_before=True)
        assert later is not None
        later.end()
    [intake] = exporter.get_finished_spans()  # the first delivery only
    assert intake.start_time == 1000 * 1_000_000
    assert (
        intake.attributes["dialog.queue_wait_ms"] == (intake.end_time - intake.start_time) // 10**6
    )


def test_attempts_lost_with_their_worker_get_a_stand_in_from_the_next_delivery() -> None:
    """kill -9 (or a pause past the lease) during attempts 1 and 2: their spans were never
    exported. Each next delivery finds no recorded end of any attempt and stands in for the
    one before it, under its id; a paused delivery that wakes to a lost lease leaves its span
    to that."""
    fields = {b"traceparent": PRODUCER.encode()}
    with in_memory_tracing() as exporter:
        for attempt in (1, 2):
            lost = tracing.message_trace(fields, "s1", "1-0", 1, attempt, "dialog")
            assert lost is not None
            lost.begin_step()
            with tracing.model_call_span("m"):
                pass  # exported before the worker died
            if attempt == 1:
                lost._detach()  # killed: nothing ended (the test's context is left clean)
            else:
                lost.end(lost=True)  # paused past its lease, woke to find it gone
        third = tracing.message_trace(fields, "s1", "1-0", 1, 3, "dialog")
        assert third is not None
        third.begin_step()
        third.end()
    spans = spans_of(exporter)
    steps = sorted(named(spans, "dialog.step"), key=lambda s: s.attributes["dialog.attempt"])
    assert [s.attributes["dialog.attempt"] for s in steps] == [1, 2, 3]
    assert [s.attributes.get("dialog.outcome") for s in steps] == ["lost", "lost", None]
    assert orphans(spans, roots=[PRODUCER_SPAN]) == []
    assert [link[1] for link in steps[2].links] == [steps[0].span_id, steps[1].span_id]


def test_no_stand_in_once_an_attempt_ended_on_record() -> None:
    with in_memory_tracing() as exporter:
        trace = tracing.message_trace({}, "s1", "1-0", 1, 2, "dialog", failed_before=True)
        assert trace is not None
        trace.end(lost=True)  # its own span is exported: no successor stands in
        trace = tracing.message_trace({}, "s1", "1-0", 1, 3, "dialog", failed_before=True)
        assert trace is not None
        trace.begin_step()
        trace.end(lost=True)
    [step] = named(spans_of(exporter), "dialog.step")
    assert step.attributes["dialog.outcome"] == "lease_lost"


def test_a_handed_back_attempt_leaves_its_span_to_the_delivery_that_runs_it_again() -> None:
    with in_memory_tracing() as exporter:
        for counted in (False, True):
            trace = tracing.message_trace({}, "s1", "1-0", 1, 1, "dialog")
            assert trace is not None
            trace.begin_step()
            trace.handed_back(counted)
            trace.end()
    [step] = named(spans_of(exporter), "dialog.step")  # one span for attempt 1
    assert step.attributes["dialog.outcome"] == "handed_back"


def test_the_reply_names_the_attempt_that_answered_or_the_message_without_a_step() -> None:
    with in_memory_tracing():
        trace = tracing.message_trace({b"traceparent": PRODUCER.encode()}, "s", "1-0", 1, 1, "d")
        assert trace is not None
        assert trace.reply_fields() == ["traceparent", PRODUCER]
        trace.begin_step()
        name, value = trace.reply_fields()
        parsed = tracing.parse_traceparent(value)
        assert name == "traceparent" and parsed is not None
        assert parsed.trace_id == PRODUCER_TRACE and parsed.span_id != PRODUCER_SPAN
        trace.end()


def test_an_unsampled_producer_keeps_the_message_unsampled() -> None:
    unsampled = PRODUCER[:-2] + "00"
    with in_memory_tracing() as exporter:
        deliveries({b"traceparent": unsampled.encode()}, attempts=1)
        trace = tracing.message_trace({b"traceparent": unsampled.encode()}, "s", "1-0", 1, 1, "d")
        assert trace is not None
        assert trace.reply_fields()[1].endswith("-00")  # propagated as unsampled
        trace.end()
    assert exporter.get_finished_spans() == ()


# ---------------------------------------------------------------------------------------------
# producers and readers


def test_trace_fields_never_break_the_limits_of_a_message() -> None:
    carried = {"traceparent": PRODUCER, "tracestate": "r=1"}
    fields = {"session_id": "s"}
    tracing.fit_fields(fields, carried, extra_room=2, byte_room=1000)
    assert fields == {"session_id": "s", **carried}
    fields = {"session_id": "s"}
    tracing.fit_fields(fields, carried, extra_room=1, byte_room=1000)
    assert fields == {"session_id": "s", "traceparent": PRODUCER}
    fields = {"session_id": "s"}
    tracing.fit_fields(fields, carried, extra_room=2, byte_room=60)
    assert fields == {"session_id": "s"}
    own = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    tracing.fit_fields(own, carried, extra_room=5, byte_room=1000)
    assert "tracestate" not in own  # the caller's context is not mixed with ours


def test_send_span_is_the_parent_of_what_it_injects() -> None:
    with in_memory_tracing() as exporter:
        with tracing.producing("dialog", "s1", "m1") as carried:
            pass
    [send] = spans_of(exporter)
    assert send.name == "dialog.send"
    parsed = tracing.parse_traceparent(carried["traceparent"])
    assert parsed is not None and parsed.span_id == send.span_id


def test_reply_event_traceparent_is_read_and_not_taken_for_an_echoed_field() -> None:
    fields = {
        b"session_id": b"s",
        b"msg_id": b"m",
        b"outcome": b"applied",
        b"reply": b"hi",
        b"traceparent": PRODUCER.encode(),
    }
    reply = reply_from_entry(b"1-0", fields, "dialog-replies")
    assert reply.traceparent == PRODUCER and reply.echo == {}
    assert reply.as_dict()["traceparent"] == PRODUCER
    forged = reply_from_entry(b"1-0", {**fields, b"traceparent": b"\x00" * 300}, "r")
    assert forged.traceparent == "" and "traceparent" not in forged.as_dict()


def test_stream_span_marks_the_first_event_and_links_to_the_answer_in_another_trace() -> None:
    with in_memory_tracing() as exporter:
        trace = tracing.stream_trace("s1", "m1")
        assert trace is not None
        trace.saw("reset")
        trace.saw("delta")
        trace.saw("end", "applied")
        trace.end(reply_traceparent=PRODUCER)
    [stream] = spans_of(exporter)
    assert stream.attributes["dialog.events"] == 3
    assert stream.attributes["dialog.outcome"] == "applied"
    assert stream.attributes["dialog.first_event_ms"] >= 0 and stream.events == ("first_event",)
    assert [(link[0], link[1]) for link in stream.links] == [(PRODUCER_TRACE, PRODUCER_SPAN)]


def test_headers_of_a_request_give_its_context() -> None:
    with in_memory_tracing():
        assert tracing.from_headers({}) is None
        assert tracing.from_headers({"traceparent": "bad"}) is None
        context = tracing.from_headers({"traceparent": PRODUCER})
        with tracing.attached(context):
            assert tracing.inject() == {"traceparent": PRODUCER}
        assert tracing.inject() == {}


# ---------------------------------------------------------------------------------------------
# model calls


class TurnAfter:
    """A worker side whose key gives its turn after ``wait_s`` (or refuses with ``error``)."""

    def __init__(self, wait_s: float, error: BaseException | None = None) -> None:
        self.wait_s, self.error = wait_s, error
        self.settled: list[str] = []

    async def acquire(self, key: str, tokens: int) -> object:
        await anyio.sleep(self.wait_s)
        if self.error is not None:
            raise self.error
        return "grant"

    async def settle(self, key: str, grant: object, reports: Any, error: Any) -> None:
        self.settled.append(key)

    def record(self, report: Any) -> None:
        pass


async def test_model_call_makes_its_own_span_with_usage_and_its_wait_for_a_turn() -> None:
    """An engine that only calls `model_call` (no tracing code of its own) gets one span per
    call under the attempt's dialog.step, in both step styles and through begin()/end(): what
    it reported it used, the model the answer named, how long it waited for the key's turn; a
    call refused before it was made (its turn too far, a budget spent) and one that failed are
    marked failed."""
    calls = TurnAfter(0.05)
    with in_memory_tracing() as exporter:
        trace = tracing.message_trace({}, "s1", "1-0", 1, 1, "dialog")
        assert trace is not None
        trace.begin_step()
        token = model_calls.bind(calls)
        try:
            async with dialog_worker.model_call("openai:gpt-4.1", tokens=200) as call:
                call.usage(100, 40, cost=0.001, model="gpt-4.1-2025-04-14")
                call.usage(20, 5, cost=0.001, model="gpt-4.1-2025-04-14")

            def plain_step() -> None:
                with dialog_worker.model_call("local", tokens=10) as call:
                    call.usage(1, 2)

            await anyio.to_thread.run_sync(plain_step)
            with pytest.raises(RuntimeError):
                async with dialog_worker.model_call("openai:gpt-4.1"):
                    raise RuntimeError("the provider is down")
            # A framework's callbacks start and end a call in different contexts.
            begun = await dialog_worker.model_call("openai:gpt-4o", tokens=20).begin()
            begun.usage(7, 3)
            await begun.end()
            calls.error = LimitWait("openai:gpt-4.1", 30.0, "rpm")
            with pytest.raises(LimitWait):
                async with dialog_worker.model_call("openai:gpt-4.1"):
                    raise AssertionError("not reached: no turn")
        finally:
            model_calls.unbind(token)
        trace.end()
    spans = spans_of(exporter)
    [step] = named(spans, "dialog.step")
    answered, failed, refused = named(spans, "chat gpt-4.1")
    [local] = named(spans, "chat local")
    [callback] = named(spans, "chat gpt-4o")
    assert {s.parent_id for s in (answered, failed, refused, local, callback)} == {step.span_id}
    assert callback.attributes["gen_ai.usage.input_tokens"] == 7
    assert callback.attributes["dialog.turn_wait_ms"] >= 50 and callback.status == "UNSET"
    assert answered.attributes["gen_ai.request.model"] == "gpt-4.1"
    assert answered.attributes["gen_ai.response.model"] == "gpt-4.1-2025-04-14"
    assert answered.attributes["gen_ai.provider.name"] == "openai"
    assert answered.attributes["dialog.limit_key"] == "openai:gpt-4.1"
    assert answered.attributes["gen_ai.usage.input_tokens"] == 120
    assert answered.attributes["gen_ai.usage.output_tokens"] == 45
    assert answered.attributes["dialog.cost"] == pytest.approx(0.002)
    assert answered.attributes["dialog.turn_wait_ms"] >= 50
    assert answered.status == "UNSET"
    assert local.attributes["gen_ai.usage.output_tokens"] == 2
    assert "gen_ai.response.model" not in local.attributes  # its usage named the key only
    assert local.attributes["dialog.turn_wait_ms"] >= 50
    assert failed.status == refused.status == "ERROR"
    assert "dialog.turn_wait_ms" not in refused.attributes
    assert calls.settled == ["openai:gpt-4.1", "local", "openai:gpt-4.1", "openai:gpt-4o"]


def test_model_call_span_carries_the_genai_attributes_inside_the_step() -> None:
    with in_memory_tracing() as exporter:
        trace = tracing.message_trace({}, "s1", "1-0", 1, 1, "dialog")
        assert trace is not None
        trace.begin_step()
        with tracing.model_call_span("gpt-4.1", "openai:gpt-4.1") as call:
            tracing.record_usage(call, 120, 45, cost=0.002)
        with pytest.raises(RuntimeError), tracing.model_call_span("gpt-4.1"):
            raise RuntimeError("429")
        trace.end()
    spans = spans_of(exporter)
    [step] = named(spans, "dialog.step")
    ok, failed = named(spans, "chat gpt-4.1")
    assert ok.parent_id == step.span_id and failed.parent_id == step.span_id
    assert ok.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "gpt-4.1",
        "gen_ai.provider.name": "openai",
        "dialog.limit_key": "openai:gpt-4.1",
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 45,
        "dialog.cost": 0.002,
    }
    assert failed.status == "ERROR"
