"""The agent framework adapters (dialog_worker.adapters) through their examples
(examples/openai_agents_bot.py, pydantic_ai_bot.py, langgraph_bot.py) in real workers, against
the shipped fake provider answering with tool calls, each test once per framework: a kill -9
after a tool call was recorded (the tool ran once), an approval after a restart (the tool ran
once, after the approval), a cancel mid-answer (the run stopped), two messages of one
conversation in a burst (in order, the second with the first as context), a provider's 429
(no attempt spent).

A framework that is not installed is skipped with the extra that brings it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from examples_path import with_examples
from redis_server import wait_for

from dialog_worker import DialogClient
from dialog_worker.adapters import from_langgraph, from_openai_agent, from_pydantic_ai
from dialog_worker.bench.fake_provider import Running
from dialog_worker.engine import initial_state, run_step

pytestmark = pytest.mark.integration

# framework -> (its import package, the extra that installs it, the example's module)
FRAMEWORKS = {
    "openai-agents": ("agents", "openai_agents_bot"),
    "pydantic-ai": ("pydantic_ai", "pydantic_ai_bot"),
    "langgraph": ("langgraph", "langgraph_bot"),
}
MODEL = "fake-1"


@pytest.fixture(params=list(FRAMEWORKS))
def bot(request: pytest.FixtureRequest) -> str:
    package, module = FRAMEWORKS[request.param]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs {package}: pip install 'dialog-worker[{request.param}]'")
    return module


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "ledger.txt"


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def provider() -> Iterator[Running]:
    with Running(latency_ms=50) as running:
        yield running


def bot_env(env: dict[str, str], bot: str, provider: Running, ledger: Path) -> dict[str, str]:
    return {
        **with_examples(env),
        "DIALOG_ENGINE": f"{bot}:engine",
        "LLM_BASE_URL": f"{provider.url}/v1",
        "LLM_MODEL": MODEL,
        "SHOP_LEDGER": str(ledger),
        "DIALOG_LOCK_TTL_MS": "1000",  # a killed worker's session is taken over soon
    }


def replies(url: str, sid: str) -> list[dict[str, str]]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [f for _, f in r.xrange("dialog-replies") if f["session_id"] == sid]


def applied(url: str, sid: str) -> list[dict[str, str]]:
    return [f for f in replies(url, sid) if f["outcome"] == "applied"]


def journaled_tools(url: str, sid: str, msg_id: str) -> list[bytes]:
    r = redis.Redis.from_url(url)
    key = f"dialog:{{dialog}}:s:{{{sid}}}:journal:{msg_id}"
    return [f for f in r.hkeys(key) if f.startswith(b"o:tool:")]


async def test_a_worker_killed_after_a_tool_call_was_recorded_does_not_run_it_again(
    bot: str,
    provider: Running,
    ledger: Path,
    workers: Any,
    client: DialogClient,
    env: dict[str, str],
) -> None:
    provider.provider.latency_ms = 3000  # each answer takes 3 s: time to kill after the tool
    extra = bot_env(env, bot, provider, ledger)
    workers.env = extra
    [first] = workers.start(1)
    await client.send("k1", "please open_ticket A-17", msg_id="m1")
    url = env["REDIS_URL"]
    await wait_for(lambda: lines(ledger), timeout_s=60)
    await wait_for(lambda: journaled_tools(url, "k1", "m1"), timeout_s=10)  # its result recorded
    first.kill()  # kill -9 while the model writes its answer after the tool ran
    assert not applied(url, "k1")
    workers.start(1)
    [reply] = await wait_for(lambda: applied(url, "k1"), timeout_s=60)
    assert reply["reply"].startswith("(ticket T-A-17 opened)")
    assert lines(ledger) == ["ticket A-17"]  # the tool ran once
    # The model was asked for the tool call once (the call with the shortest conversation):
    # the second worker got it from the journal, and asked only for the answer.
    log = provider.provider.stats()["log"]
    assert [e["messages"] for e in log].count(log[0]["messages"]) == 1


async def test_an_approval_after_a_restart_runs_the_tool_once_after_it(
    bot: str,
    provider: Running,
    ledger: Path,
    workers: Any,
    client: DialogClient,
    env: dict[str, str],
) -> None:
    workers.env = bot_env(env, bot, provider, ledger)
    workers.start(1)
    asked = await client.ask("a1", "please refund A-17", timeout=60)
    assert asked.outcome == "awaiting"
    if bot == "langgraph_bot":  # the graph's own interrupt() value
        assert asked.payload == {"question": "Refund order A-17?", "choices": [True, False]}
    else:
        assert asked.payload["kind"] == "tool_approval"
        assert (asked.payload["tool"], asked.payload["arguments"]) == (
            "refund",
            {"order_id": "A-17"},
        )
    for w in workers.procs:
        w.kill()  # the question waits in Redis, not in a worker
    assert lines(ledger) == []  # nothing refunded before the approval
    workers.start(1)
    [waiting] = await client.pending("a1")
    assert (await client.resume("a1", waiting.interrupt_id, True)).status == "resumed"
    url = env["REDIS_URL"]
    [reply] = await wait_for(lambda: applied(url, "a1"), timeout_s=60)
    assert reply["reply"].startswith("(refunded 80 EUR for A-17)")
    assert lines(ledger) == ["refund A-17 80"]  # once, after the approval


async def test_a_cancel_mid_answer_stops_the_agents_run(
    bot: str,
    provider: Running,
    ledger: Path,
    workers: Any,
    client: DialogClient,
    env: dict[str, str],
) -> None:
    provider.provider.latency_ms = 8000  # the answer streams for 8 s
    provider.provider.chunks = 20
    workers.env = bot_env(env, bot, provider, ledger)
    workers.start(1)
    await client.send("c1", "tell me a long story", msg_id="m1")
    shown = ""
    async for event in client.stream("c1", "m1", timeout=60):
        if event.kind == "delta":
            shown += event.text
            break  # the answer is being written: stop it
    assert shown.startswith("(tell me a long story)")
    await client.cancel("c1", "m1")
    url = env["REDIS_URL"]
    [ended] = await wait_for(lambda: replies(url, "c1"), timeout_s=30)
    assert ended["outcome"] == "cancelled"
    # The run stopped: it left the provider's stream before its end, and asked nothing more.
    await wait_for(lambda: provider.provider.stats()["aborted"] >= 1, timeout_s=15)
    assert len(provider.provider.stats()["log"]) == 1


async def test_two_messages_of_a_burst_are_answered_in_order_with_the_first_as_context(
    bot: str,
    provider: Running,
    ledger: Path,
    workers: Any,
    client: DialogClient,
    env: dict[str, str],
) -> None:
    workers.env = bot_env(env, bot, provider, ledger)
    workers.start(2)
    await client.send("b1", "first question", msg_id="m1")
    await client.send("b1", "second question", msg_id="m2")
    url = env["REDIS_URL"]
    done = await wait_for(lambda: len(applied(url, "b1")) == 2 and applied(url, "b1"), timeout_s=60)
    assert [(f["msg_id"], f["seq"]) for f in done] == [("m1", "1"), ("m2", "2")]
    assert done[0]["reply"].startswith("(first question)")
    assert done[1]["reply"].startswith("(second question)")
    # The second model call carried the first turn (its question and answer) before its own.
    first_call, second_call = provider.provider.stats()["log"]
    assert second_call["messages"] >= first_call["messages"] + 2
    state = await client.state("b1")
    assert state is not None
    assert [turn["user"] for turn in state["history"]] == ["first question", "second question"]


async def test_a_429_from_the_provider_spends_no_attempt(
    bot: str,
    provider: Running,
    ledger: Path,
    workers: Any,
    client: DialogClient,
    env: dict[str, str],
) -> None:
    workers.env = bot_env(env, bot, provider, ledger)
    # A spent attempt would dead-letter the message. Started (its /healthz answers) before
    # the provider refuses for 2 s (Retry-After).
    workers.start(1, metrics=True, DIALOG_MAX_ATTEMPTS="1")
    provider.provider.throttle(MODEL, 2.0)
    reply = await client.ask("r1", "hello there", timeout=60)
    assert (reply.outcome, reply.text.split()[0]) == ("applied", "(hello")
    statuses = [entry["status"] for entry in provider.provider.stats()["log"]]
    assert statuses[0] == 429 and statuses[-1] == 200
    usage = json.loads(applied(env["REDIS_URL"], "r1")[0]["usage"])
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0  # counted with the reply


async def test_a_langgraph_tool_node_cut_off_between_two_calls_does_not_repeat_the_first(
    provider: Running,
    ledger: Path,
    workers: Any,
    client: DialogClient,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    if importlib.util.find_spec("langgraph") is None:
        pytest.skip("needs langgraph: pip install 'dialog-worker[langgraph]'")
    hold = tmp_path / "hold"
    hold.touch()
    workers.env = {
        **bot_env(env, "unused", provider, ledger),
        "DIALOG_ENGINE": "adapter_engines:two_tools",
        "HOLD": str(hold),
    }
    [first] = workers.start(1)
    await client.send("t1", "please first A second B", msg_id="m1")
    url = env["REDIS_URL"]
    try:
        # Both tools ran; the first one's result is recorded, the second one is held: the
        # node, and so the graph's checkpoint after it, has not finished.
        await wait_for(lambda: len(lines(ledger)) == 2, timeout_s=60)
        await wait_for(lambda: journaled_tools(url, "t1", "m1"), timeout_s=10)
        first.kill()
    finally:
        hold.unlink()  # a worker left holding would delay its SIGTERM by its grace
    workers.start(1)
    [reply] = await wait_for(lambda: applied(url, "t1"), timeout_s=60)
    assert reply["reply"].startswith("(second B done)")
    # The first call came from the journal; the second, never recorded, ran again.
    assert sorted(lines(ledger)) == ["first A", "second B", "second B"]


# --- the conversation's bounds, without a worker (docs/engine.md: "Testing an engine") ---


@pytest.fixture(scope="module")
def local_provider() -> Iterator[Running]:
    """One fake provider for the examples imported into this process (they read
    LLM_BASE_URL when imported)."""
    before = os.environ.get("LLM_BASE_URL")
    with Running(latency_ms=0) as running:
        os.environ["LLM_BASE_URL"] = f"{running.url}/v1"
        try:
            yield running
        finally:
            # Later tests build workers' environments from this process's: a leftover
            # LLM_BASE_URL there collides with the one they pass (and names a stopped provider).
            if before is None:
                os.environ.pop("LLM_BASE_URL", None)
            else:
                os.environ["LLM_BASE_URL"] = before


def message(text: str, seq: int) -> dict[str, Any]:
    return {
        "session_id": "s1",
        "msg_id": f"m{seq}",
        "seq": seq,
        "text": text,
        "entry_id": "0-1",
        "enqueued_at": 0,
        "attempt": 1,
        "meta": {},
    }


def adapted(bot: str, **bounds: Any) -> Any:
    """The example's agent (or graph) adapted again with other bounds."""
    module = importlib.import_module(bot)
    if bot == "openai_agents_bot":
        return from_openai_agent(module.agent, **bounds)
    if bot == "pydantic_ai_bot":
        return from_pydantic_ai(module.agent, **bounds)
    return from_langgraph(module.graph, **bounds)


async def conversation(engine: Any, turns: int) -> dict[str, Any]:
    state = initial_state("s1")
    for seq in range(1, turns + 1):
        state, _reply = await run_step(engine, state, message(f"hello {seq}", seq))
    return state


async def test_the_conversation_kept_in_the_state_is_trimmed_to_its_turns_and_bytes(
    bot: str, local_provider: Running
) -> None:
    log = local_provider.provider.log
    trimmed = await conversation(adapted(bot, memory_turns=3, memory_bytes=None), 12)
    # The last model call saw the three turns kept (a question and an answer each) and its
    # own question, besides the instructions.
    assert log[-1]["messages"] <= 3 * 2 + 1 + 1
    kept = json.dumps(trimmed["memory"])
    untrimmed = await conversation(adapted(bot, memory_turns=None, memory_bytes=None), 12)
    assert log[-1]["messages"] >= 12 * 2 - 1
    everything = len(json.dumps(untrimmed["memory"]))
    assert len(kept) < everything / 2
    small = await conversation(adapted(bot, memory_turns=None, memory_bytes=1500), 12)
    assert log[-1]["messages"] < 12 * 2 - 1
    assert len(json.dumps(small["memory"])) < everything / 2
