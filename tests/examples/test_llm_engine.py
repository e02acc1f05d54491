"""examples/llm_engine.py against a local fake of an OpenAI-compatible API: on its own (no
Redis, as docs/engine.md shows for testing an engine), then in real workers through ask()."""

from __future__ import annotations

import collections
import email.utils
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from examples_path import with_examples
from http_stub import Answer, Chunks, HttpStub
from llm_engine import LLMEngine, retry_after_s

from dialog_worker import DialogClient, PermanentError, TransientError
from dialog_worker.engine.protocol import initial_state, run_step, shutdown_engine, startup_engine

pytestmark = pytest.mark.integration


class FakeLLM:
    """Answers "(<number of messages>) <last user text>". The first call about a text
    containing "rate" gets 429 + Retry-After: 1, "flaky" a 503, "slow" an answer too late for
    the engine's timeout; "refuse" always gets a 400."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def __call__(self, method: str, path: str, body: Any) -> Answer:
        assert (method, path) == ("POST", "/v1/chat/completions")
        last = body["messages"][-1]["content"]
        with self.lock:
            self.calls[last] += 1
            first = self.calls[last] == 1
        if "refuse" in last:
            return 400, {}, {"error": {"message": "content policy"}}
        if first and "rate" in last:
            return 429, {"Retry-After": "1"}, {"error": {"message": "rate limited"}}
        if first and "flaky" in last:
            return 503, {}, {"error": {"message": "overloaded"}}
        if first and "slow" in last:
            time.sleep(1.5)
        content = f"({len(body['messages'])}) {last}"
        if body.get("stream"):
            # As OpenAI streams: role first, the text in pieces, usage last, then [DONE].
            words = content.split(" ")
            pieces = [w if i == 0 else f" {w}" for i, w in enumerate(words)]
            chunks = [{"choices": [{"delta": {"role": "assistant"}}]}]
            chunks += [{"choices": [{"delta": {"content": p}}]} for p in pieces]
            chunks += [{"choices": [], "usage": {"total_tokens": 5}}]
            return 200, {}, Chunks([json.dumps(c) for c in chunks] + ["[DONE]"], 0.01)
        return (
            200,
            {},
            {"choices": [{"message": {"content": content}}], "usage": {"total_tokens": 5}},
        )


@pytest.fixture
def llm() -> Iterator[HttpStub]:
    with HttpStub(FakeLLM()) as stub:
        yield stub


def message(text: str, seq: int = 1) -> dict[str, Any]:
    return {"session_id": "s1", "msg_id": f"m{seq}", "seq": seq, "text": text, "meta": {}}


async def started(llm: HttpStub) -> LLMEngine:
    engine = LLMEngine(base_url=f"{llm.url}/v1", api_key="test-key", model="m", timeout_s=0.5)
    await startup_engine(engine)
    return engine


# --- the engine alone ------------------------------------------------------------------------


async def test_engine_sends_the_conversation_so_far_and_counts_turns(llm: HttpStub):
    engine = await started(llm)
    try:
        state, reply = await run_step(engine, initial_state("s1"), message("halo"))
        assert reply == "(2) halo"
        assert (state["step"], state["memory"]) == ("CHATTING", {"turns": 1, "tokens": 5})
        state["history"] = [{"seq": 1, "msg_id": "m1", "user": "halo", "bot": reply}]
        state, reply = await run_step(engine, state, message("apa kabar", 2))
    finally:
        await shutdown_engine(engine)
    assert reply == "(4) apa kabar"
    assert state["memory"] == {"turns": 2, "tokens": 10}
    sent = llm.requests[-1]
    assert sent["headers"]["Authorization"] == "Bearer test-key"
    assert [m["role"] for m in sent["body"]["messages"]] == ["system", "user", "assistant", "user"]
    assert sent["body"]["messages"][2]["content"] == "(2) halo"


@pytest.mark.parametrize(
    ("text", "error", "retry_after"),
    [
        ("rate limit me", "LLM API returned 429", 1.0),
        ("flaky please", "LLM API returned 503", None),
        ("slow one", "did not answer within 0.5 s", None),
    ],
)
async def test_failures_a_retry_can_fix_are_transient(
    llm: HttpStub, text: str, error: str, retry_after: float | None
):
    engine = await started(llm)
    try:
        with pytest.raises(TransientError, match=error) as caught:
            await run_step(engine, initial_state("s1"), message(text))
        assert caught.value.retry_after == retry_after
        _, reply = await run_step(engine, initial_state("s1"), message(text))
        assert reply == f"(2) {text}"
    finally:
        await shutdown_engine(engine)


async def test_a_refused_request_is_permanent(llm: HttpStub):
    engine = await started(llm)
    try:
        with pytest.raises(PermanentError, match="400"):
            await run_step(engine, initial_state("s1"), message("refuse this"))
    finally:
        await shutdown_engine(engine)


def test_retry_after_header_in_seconds_or_as_a_date():
    assert retry_after_s("2") == 2.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= (retry_after_s(later) or 0) <= 31
    assert retry_after_s(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0


# --- in real workers -------------------------------------------------------------------------


async def test_llm_engine_in_workers_rides_out_rate_limits_errors_and_timeouts(
    client: DialogClient, workers, env: dict[str, str], llm: HttpStub
):
    workers.start(
        1,
        **with_examples(env),
        DIALOG_ENGINE="llm_engine:LLMEngine",
        LLM_BASE_URL=f"{llm.url}/v1",
        LLM_TIMEOUT_S="0.5",
        DIALOG_BACKOFF_BASE_MS="50",
        DIALOG_BACKOFF_MAX_MS="200",
    )
    first = await client.ask("llm-1", "halo", timeout=30)
    assert (first.outcome, first.text) == ("applied", "(2) halo")
    second = await client.ask("llm-1", "apa kabar", timeout=30)
    assert second.text == "(4) apa kabar", "the first turn went along as context"

    started_at = time.monotonic()
    limited = await client.ask("llm-2", "rate limit me", timeout=30)
    assert (limited.outcome, limited.text) == ("applied", "(2) rate limit me")
    assert time.monotonic() - started_at >= 1.0, "Retry-After: 1 was honoured"
    for text in ("flaky please", "slow one"):
        rep = await client.ask("llm-3", text, timeout=30)
        assert (rep.outcome, rep.text[-len(text) :]) == ("applied", text)
    refused = await client.ask("llm-4", "refuse this", timeout=30)
    assert refused.outcome == "dead_lettered"
    state = await client.state("llm-1")
    assert state is not None and state["memory"] == {"turns": 2, "tokens": 10}


def test_its_fallback_reply_is_english_unless_the_operator_sets_one():
    from dialog_worker.config import DEFAULT_FALLBACK_REPLY
    from dialog_worker.engine.protocol import fallback_reply

    engine = LLMEngine(base_url="http://127.0.0.1:9", api_key="k")
    own = fallback_reply(engine, DEFAULT_FALLBACK_REPLY, DEFAULT_FALLBACK_REPLY)
    assert own == "Sorry, I could not answer that. Please try again later."
    assert fallback_reply(engine, "Oops.", DEFAULT_FALLBACK_REPLY) == "Oops."


async def test_llm_engine_streams_the_models_pieces_to_readers(
    client: DialogClient, workers, env: dict[str, str], llm: HttpStub
):
    workers.start(
        1,
        **with_examples(env),
        DIALOG_ENGINE="llm_engine:LLMEngine",
        LLM_BASE_URL=f"{llm.url}/v1",
    )
    text = "tell me about the billing problem of my internet subscription please"
    events = [e async for e in client.ask_stream("llm-5", text, timeout=30)]
    assert events[-1].kind == "end" and events[-1].text == f"(2) {text}"
    deltas = [e.text for e in events if e.kind == "delta"]
    assert len(deltas) >= 2, "the answer arrived in pieces, not at once"
    assert "".join(deltas) == events[-1].text
    assert all(b["stream"] is True for b in llm.bodies("/v1/chat/completions"))


async def test_a_server_that_does_not_stream_is_read_as_one_answer():
    def plain(method: str, path: str, body: Any) -> Answer:
        return 200, {}, {"choices": [{"message": {"content": "hi"}}], "usage": {}}

    with HttpStub(plain) as stub:
        engine = LLMEngine(base_url=f"{stub.url}/v1", api_key="k", model="m", timeout_s=2)
        await startup_engine(engine)
        try:
            _, reply = await run_step(engine, initial_state("s1"), message("halo"))
        finally:
            await shutdown_engine(engine)
    assert reply == "hi"
