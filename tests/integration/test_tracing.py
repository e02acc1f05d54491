"""Traces across producer, worker and reader, on the suite's real redis-server: in-process with
the SDK's in-memory exporter (client, worker and gateway share it), and once with a real
worker process exporting over OTLP/HTTP to a receiver made of the OTLP protobuf types. A
message is one trace rooted at the producer's span, with one dialog.step per attempt."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
import redis.asyncio

from dialog_worker import tracing
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.client.sync import SyncDialogClient
from dialog_worker.config import Settings, load_settings
from dialog_worker.daemon.worker import Worker

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra")

from redis_server import wait_until
from trace_engines import TraceEngine
from trace_support import (
    OtlpReceiver,
    Seen,
    in_memory_tracing,
    named,
    of_message,
    orphans,
)
from worker_procs import WorkerPool

pytestmark = pytest.mark.integration

FAST_RETRY = {"DIALOG_BACKOFF_BASE_MS": "10", "DIALOG_BACKOFF_MAX_MS": "20"}


def fast_settings(env: dict[str, str], **extra: str) -> Settings:
    return load_settings(environ={**env, **FAST_RETRY, "DIALOG_READ_BLOCK_MS": "100", **extra})


def step_attempt(span: Seen) -> int:
    return int(span.attributes["dialog.attempt"])


def assert_one_trace_per_attempt(spans: list[Seen], producer: Seen, attempts: int) -> list[Seen]:
    """The worker's spans of a message: all in the producer's trace, nothing orphaned, one
    dialog.intake, one dialog.step per attempt (siblings, each linked to the ones before),
    one dialog.commit under the last attempt. Returns the steps, by attempt."""
    assert {s.trace_id for s in spans} == {producer.trace_id}, spans
    assert orphans(spans, roots=[producer.span_id]) == []
    assert len(named(spans, "dialog.intake")) == 1
    steps = sorted(named(spans, "dialog.step"), key=step_attempt)
    assert [step_attempt(s) for s in steps] == list(range(1, attempts + 1))
    assert len({s.parent_id for s in steps}) == 1  # siblings, under the producer's side
    for n, step in enumerate(steps):
        assert [link[1] for link in step.links] == [s.span_id for s in steps[:n]]
    [commit] = named(spans, "dialog.commit")
    assert commit.parent_id == steps[-1].span_id
    calls = named(spans, "chat test-model")
    assert sorted(c.parent_id for c in calls) == sorted(s.span_id for s in steps)
    return steps


async def test_a_retried_message_is_one_trace_rooted_at_the_producer_span(
    client: DialogClient, env: dict[str, str]
) -> None:
    with in_memory_tracing() as traced:
        worker = Worker(fast_settings(env), TraceEngine())
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            with traced.tracer.start_as_current_span("producer"):
                reply = await client.ask("tr-1", "fail-once, then answer", timeout=30)
            worker.stop()
        spans = traced.seen()
    assert reply.outcome == "applied" and reply.text == "attempt=2"
    [producer] = named(spans, "producer")
    [send] = named(spans, "dialog.send")
    assert send.parent_id == producer.span_id
    mine = of_message(spans, reply.msg_id)
    steps = assert_one_trace_per_attempt([*mine, send], producer, attempts=2)
    assert steps[0].parent_id == send.span_id and steps[0].status == "ERROR"
    # The reply event names the attempt that answered; the engine saw the producer's context.
    parsed = tracing.parse_traceparent(reply.traceparent)
    assert parsed is not None and parsed.span_id == steps[1].span_id
    state = await client.state("tr-1")
    assert state is not None
    meta = state["memory"]["meta"]
    assert meta["traceparent"].startswith(f"00-{send.trace_id:032x}-{send.span_id:016x}-")


async def test_bad_trace_context_from_a_plain_xadd_is_counted_and_the_message_applied(
    client: DialogClient, env: dict[str, str]
) -> None:
    raw = redis.asyncio.Redis.from_url(env["REDIS_URL"])
    with in_memory_tracing() as traced:
        worker = Worker(fast_settings(env), TraceEngine())
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            for n, (parent, state) in enumerate(
                [(b"not-a-traceparent", b"r=1"), (b"\xff\xfe", b"\xff"), (b"00-x", None)]
            ):
                fields: dict[bytes, bytes] = {
                    b"session_id": b"tr-bad",
                    b"text": b"hello",
                    b"msg_id": f"bad-{n}".encode(),
                    b"traceparent": parent,
                }
                if state is not None:
                    fields[b"tracestate"] = state
                await raw.xadd(client.keys.stream, fields)  # type: ignore[arg-type]
            replies = [await client.ask("tr-bad", "and a good one", timeout=30)]
            worker.stop()
        spans = traced.seen()
    await raw.aclose()
    history = (await client.state("tr-bad") or {})["history"]
    assert [t["msg_id"] for t in history][:3] == ["bad-0", "bad-1", "bad-2"]
    assert replies[0].outcome == "applied"
    assert worker.metrics.trace_context_invalid._value.get() == 3
    assert await client.raw.xlen(client.keys.dlq) == 0  # nothing dead-lettered for it
    for n in range(3):  # each still traced, as a trace of its own
        intake = named(of_message(spans, f"bad-{n}"), "dialog.intake")
        assert len(intake) == 1 and intake[0].parent_id is None


async def test_ask_stream_sync_client_and_gateway_continue_the_callers_trace(
    client: DialogClient, env: dict[str, str]
) -> None:
    from dialog_worker.gateway.app import create_app

    settings = fast_settings(env)
    with in_memory_tracing() as traced:
        worker = Worker(settings, TraceEngine())
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            # ask_stream: the reader's span is the parent of the send.
            with traced.tracer.start_as_current_span("page"):
                events = [e async for e in client.ask_stream("tr-s", "hi", msg_id="st-1")]
            assert events[-1].kind == "end"

            # The sync client: the caller's thread's span, carried into its loop thread.
            def sync_send() -> str:
                with SyncDialogClient(settings=settings) as sync:
                    with traced.tracer.start_as_current_span("flask-view"):
                        return sync.ask("tr-sync", "hi", msg_id="sy-1", timeout=30).msg_id

            await anyio.to_thread.run_sync(sync_send)

            # The gateway: a browser's traceparent header is the parent of send and stream.
            app = create_app(settings, None, client=client)
            header = "00-11111111111111111111111111111111-2222222222222222-01"
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://gw.test"
                ) as http,
            ):
                posted = await http.post(
                    "/sessions/tr-gw/messages",
                    json={"text": "hi", "msg_id": "gw-1"},
                    headers={"traceparent": header},
                )
                assert posted.status_code == 202
                await wait_for_reply(client, "tr-gw")
                streamed = await http.get(
                    "/sessions/tr-gw/messages/gw-1/stream", headers={"traceparent": header}
                )
                assert "event: end" in streamed.text
            worker.stop()
        spans = traced.seen()

    [page] = named(spans, "page")
    [reader] = [s for s in named(spans, "dialog.stream") if s.attributes["dialog.msg_id"] == "st-1"]
    assert reader.parent_id == page.span_id and reader.attributes["dialog.outcome"] == "applied"
    assert reader.attributes["dialog.first_event_ms"] >= 0
    [send] = [
        s for s in named(spans, "dialog.send") if s.attributes["messaging.message.id"] == "st-1"
    ]
    assert send.parent_id == reader.span_id
    assert_one_trace_per_attempt([*of_message(spans, "st-1"), send], page, attempts=1)

    [view] = named(spans, "flask-view")
    [sync_send_span] = [
        s for s in named(spans, "dialog.send") if s.attributes["messaging.message.id"] == "sy-1"
    ]
    assert sync_send_span.parent_id == view.span_id

    browser_trace, browser_span = 0x11111111111111111111111111111111, 0x2222222222222222
    gw = [s for s in spans if s.attributes.get("dialog.msg_id") == "gw-1"]
    gw_send = [
        s for s in named(spans, "dialog.send") if s.attributes["messaging.message.id"] == "gw-1"
    ]
    assert {s.trace_id for s in gw + gw_send} == {browser_trace}
    assert gw_send[0].parent_id == browser_span
    [gw_stream] = named(gw, "dialog.stream")
    assert gw_stream.parent_id == browser_span


async def wait_for_reply(client: DialogClient, session_id: str) -> None:
    with anyio.fail_after(30):
        # The state is read from Redis, written by the worker: nothing here to wait on.
        while not (await client.state(session_id) or {}).get("history"):  # noqa: ASYNC110
            await anyio.sleep(0.02)


# ---------------------------------------------------------------------------------------------
# a real worker process, a real OTLP receiver


@pytest.fixture
def receiver() -> AsyncIterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def otlp_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms of a span's end
        "OTEL_SERVICE_NAME": "worker-under-test",
        "DIALOG_ENGINE": "trace_engines:make",
        **FAST_RETRY,
    }


def received_for(receiver: OtlpReceiver, msg_id: str, what: str, count: int = 1) -> list[Seen]:
    def enough() -> list[Seen] | None:
        mine = of_message(receiver.snapshot(), msg_id)
        return mine if len(named(mine, what)) >= count else None

    spans: list[Seen] = wait_until(enough, 30, what=f"{count} {what} of {msg_id} over OTLP")
    return spans


@pytest.mark.fault
async def test_a_worker_process_exports_one_connected_trace_over_otlp(
    client: DialogClient, workers: WorkerPool, receiver: OtlpReceiver
) -> None:
    workers.start(1, **otlp_env(receiver))
    with in_memory_tracing() as traced:
        with traced.tracer.start_as_current_span("producer"):
            reply = await client.ask("tr-otlp", "fail-once over otlp", timeout=30)
        client_spans = traced.seen()
    assert reply.text == "attempt=2"
    spans = received_for(receiver, reply.msg_id, "dialog.commit")
    await anyio.sleep(0.3)  # anything a later batch carries
    spans = of_message(receiver.snapshot(), reply.msg_id)
    [producer] = named(client_spans, "producer")
    [send] = named(client_spans, "dialog.send")
    assert_one_trace_per_attempt([*spans, send], producer, attempts=2)
    # The engine only calls model_call: each call's span is its own, with what it used.
    calls = named(spans, "chat test-model")
    assert [c.attributes["gen_ai.usage.output_tokens"] for c in calls] == [5, 5]
    assert all(c.attributes["dialog.turn_wait_ms"] >= 0 for c in calls)


@pytest.mark.fault
async def test_kill_9_mid_step_leaves_one_connected_trace_with_one_step_per_attempt(
    client: DialogClient, workers: WorkerPool, receiver: OtlpReceiver
) -> None:
    """The killed attempt's own dialog.step never reaches the collector (its process died
    before ending it). The next attempt stands in for it, under its id, so what the killed
    step had exported already (its model call) is no orphan, and links to it."""
    env = {**otlp_env(receiver), "DIALOG_LOCK_TTL_MS": "1000"}
    [first] = workers.start(1, **env)
    with in_memory_tracing() as traced:
        with traced.tracer.start_as_current_span("producer"):
            await client.send("tr-kill", "sleep-first 60", msg_id="kill-1")
        client_spans = traced.seen()
    [producer] = named(client_spans, "producer")
    [send] = named(client_spans, "dialog.send")

    def in_trace() -> list[Seen]:
        return [s for s in receiver.snapshot() if s.trace_id == producer.trace_id]

    # Attempt 1 is in its step once its model call (made before the sleep) is exported.
    wait_until(lambda: named(in_trace(), "chat test-model"), 30, what="attempt 1's model call")
    first.kill()
    workers.start(1, **env)
    wait_until(lambda: named(in_trace(), "dialog.commit"), 30, what="the commit over OTLP")
    await anyio.sleep(0.3)  # anything a later batch carries
    steps = assert_one_trace_per_attempt([*in_trace(), send], producer, attempts=2)
    assert steps[0].attributes["dialog.outcome"] == "lost" and steps[0].status == "ERROR"
    assert steps[1].status == "UNSET"


async def test_a_page_passes_its_trace_to_the_stream_in_the_query_and_the_gateway_continues_it(
    client: DialogClient, env: dict[str, str]
) -> None:
    """An EventSource cannot set headers: the page gives its traceparent as ``?traceparent=``
    and the answer's dialog.stream span joins the page's trace, as the POST's send does (one
    trace per browser message). A header, when there is one, is the parent instead."""
    from dialog_worker.gateway.app import create_app

    settings = fast_settings(env)
    page = "00-33333333333333333333333333333333-4444444444444444-01"
    other = "00-55555555555555555555555555555555-6666666666666666-01"
    with in_memory_tracing() as traced:
        worker = Worker(settings, TraceEngine())
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            app = create_app(settings, None, client=client)
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://gw.test"
                ) as http,
            ):
                posted = await http.post(
                    "/sessions/tr-q/messages",
                    json={"text": "hi", "msg_id": "q-1"},
                    headers={"traceparent": page},
                )
                assert posted.status_code == 202
                await wait_for_reply(client, "tr-q")
                for query, headers in (
                    ({"traceparent": page}, {}),
                    ({"traceparent": page}, {"traceparent": other}),
                ):
                    streamed = await http.get(
                        "/sessions/tr-q/messages/q-1/stream", params=query, headers=headers
                    )
                    assert "event: end" in streamed.text
            worker.stop()
        spans = traced.seen()
    streams = [s for s in named(spans, "dialog.stream") if s.attributes["dialog.msg_id"] == "q-1"]
    assert [(s.trace_id, s.parent_id) for s in streams] == [
        (0x33333333333333333333333333333333, 0x4444444444444444),
        (0x55555555555555555555555555555555, 0x6666666666666666),
    ]
    [send] = [
        s for s in named(spans, "dialog.send") if s.attributes["messaging.message.id"] == "q-1"
    ]
    assert send.trace_id == streams[0].trace_id
