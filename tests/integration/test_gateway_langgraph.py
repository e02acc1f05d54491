"""The LangGraph Agent Protocol subset (`/langgraph`) driven by the real Python `langgraph-sdk`,
unmodified, against a real gateway process and real workers: threads, runs (stream, wait,
create, join, cancel), interrupts answered with ``command.resume``, the double-texting
strategies, and what it refuses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from gateway_proc import GatewayProc
from langgraph_sdk import get_client
from langgraph_sdk.client import LangGraphClient
from redis_server import wait_until_async
from worker_procs import WorkerPool

from dialog_worker.client import session_tokens

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
SIGNING_KEY = "k" * 32
ENGINE = "chat_engines:Assistant"
ALL_MODES = ["values", "updates", "messages-tuple", "custom"]


@pytest.fixture
def gateway(env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProc]:
    proc = GatewayProc(
        {
            **env,
            "DIALOG_HTTP_TOKEN": TOKEN,
            "DIALOG_HTTP_SIGNING_KEY": SIGNING_KEY,
            "DIALOG_ENGINE": ENGINE,
        },
        tmp_path,
    )
    yield proc
    proc.stop()


@pytest_asyncio.fixture
async def lg(gateway: GatewayProc, workers: WorkerPool) -> AsyncIterator[LangGraphClient]:
    workers.start(1, DIALOG_ENGINE=ENGINE)
    client = get_client(url=f"{gateway.url}/langgraph", api_key=TOKEN, timeout=60)
    yield client
    await client.aclose()


def user(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text, **extra}]}


async def collect(parts: AsyncIterator[Any]) -> list[Any]:
    return [part async for part in parts]


def streamed_text(parts: list[Any]) -> str:
    return "".join(p.data[0]["content"] for p in parts if p.event == "messages")


async def assistant_id(lg: LangGraphClient) -> str:
    found = await lg.assistants.search()
    assert len(found) == 1
    return str(found[0]["assistant_id"])


async def test_a_run_streams_every_mode_and_the_thread_keeps_the_turn(lg: LangGraphClient):
    assistant = await assistant_id(lg)
    thread = await lg.threads.create()
    parts = await collect(
        lg.runs.stream(
            thread["thread_id"], assistant, input=user("words 30 5"), stream_mode=ALL_MODES
        )
    )
    events = [p.event for p in parts]
    assert events[0] == "metadata" and events[-1] == "end"
    run_id = parts[0].data["run_id"]
    assert parts[-1].data == {"run_id": run_id, "status": "success"}
    reply = "".join(f"w{i} " for i in range(30))
    assert streamed_text(parts) == reply
    first_values = next(p.data for p in parts if p.event == "values")
    assert first_values["messages"][-1] == {
        "type": "human",
        "content": "words 30 5",
        "id": run_id,
        "additional_kwargs": {},
        "response_metadata": {},
    }
    last_values = [p.data for p in parts if p.event == "values"][-1]
    assert [(m["type"], m["content"]) for m in last_values["messages"]] == [
        ("human", "words 30 5"),
        ("ai", reply),
    ]
    assert last_values["step"] == "WORDS"
    assert last_values["memory"] == {"last": "words 30 5"}  # the server token sees memory
    updates = [p.data for p in parts if p.event == "updates"]
    assert updates[-1]["engine"]["messages"][0]["content"] == reply
    # The chunks and the committed turn are one message: a client that shows both keeps one.
    chunk_ids = {p.data[0]["id"] for p in parts if p.event == "messages"}
    assert chunk_ids == {last_values["messages"][-1]["id"]}

    state = await lg.threads.get_state(thread["thread_id"])
    assert state["values"] == last_values
    assert state["next"] == [] and state["interrupts"] == [] and state["tasks"] == []
    history = await lg.threads.get_history(thread["thread_id"])
    assert [h["values"] for h in history] == [last_values]
    got = await lg.threads.get(thread["thread_id"])
    assert got["status"] == "idle" and got["values"] == last_values


async def test_wait_create_join_and_get_answer_with_the_threads_values(lg: LangGraphClient):
    assistant = await assistant_id(lg)
    thread_id = (await lg.threads.create())["thread_id"]
    values = await lg.runs.wait(thread_id, assistant, input=user("hello"))
    assert values["messages"][-1]["content"] == "echo hello"
    run = await lg.runs.create(thread_id, assistant, input=user("again"))
    assert run["status"] == "pending" and run["thread_id"] == thread_id
    joined = await lg.runs.join(thread_id, run["run_id"])
    assert [m["content"] for m in joined["messages"]] == [
        "hello",
        "echo hello",
        "again",
        "echo again",
    ]
    assert (await lg.runs.get(thread_id, run["run_id"]))["status"] == "success"


async def test_an_interrupt_ends_the_run_and_command_resume_goes_on(lg: LangGraphClient):
    assistant = await assistant_id(lg)
    thread_id = (await lg.threads.create())["thread_id"]
    parts = await collect(
        lg.runs.stream(thread_id, assistant, input=user("ask"), stream_mode=ALL_MODES)
    )
    run_id = parts[0].data["run_id"]
    assert streamed_text(parts) == "checking "
    custom = [p.data for p in parts if p.event == "custom"]
    assert custom == [{"kind": "tool", "data": {"name": "lookup", "state": "done"}}]
    interrupted = [p.data for p in parts if p.event == "values"][-1]
    (interrupt,) = interrupted["__interrupt__"]
    assert interrupt["value"] == {"question": "go on?"}
    assert [p.data for p in parts if p.event == "updates"][-1] == {"__interrupt__": [interrupt]}
    assert parts[-1].data == {"run_id": run_id, "status": "interrupted"}

    state = await lg.threads.get_state(thread_id)
    assert state["interrupts"] == [interrupt] and state["next"] == ["engine"]
    assert state["tasks"][0]["interrupts"] == [interrupt]
    thread = await lg.threads.get(thread_id)
    assert thread["status"] == "interrupted" and thread["interrupts"] == {run_id: [interrupt]}
    assert (await lg.runs.get(thread_id, run_id))["status"] == "interrupted"

    resumed = await collect(
        lg.runs.stream(
            thread_id,
            assistant,
            command={"resume": {"ok": True}},
            stream_mode=["values", "messages-tuple"],
        )
    )
    assert resumed[0].data["run_id"] == run_id  # the run is the waiting message's
    opening = next(p.data for p in resumed if p.event == "values")
    assert opening["messages"][-1]["content"] == "ask"  # its user message, not committed yet
    assert streamed_text(resumed) == "checking approved "
    final = [p.data for p in resumed if p.event == "values"][-1]
    assert final["messages"][-1]["content"] == 'approved {"ok": true}'
    assert "__interrupt__" not in final
    assert (await lg.threads.get(thread_id))["status"] == "idle"


async def test_cancel_stops_the_run_and_keeps_what_it_said(lg: LangGraphClient):
    assistant = await assistant_id(lg)
    thread_id = (await lg.threads.create())["thread_id"]
    run = await lg.runs.create(thread_id, assistant, input=user("words 400 50"))
    stream = lg.runs.join_stream(thread_id, run["run_id"], stream_mode="messages-tuple")
    async for part in stream:
        if part.event == "messages":
            break  # it is running
    await lg.runs.cancel(thread_id, run["run_id"], wait=True)
    assert (await lg.runs.get(thread_id, run["run_id"]))["status"] == "interrupted"
    last = (await lg.threads.get_state(thread_id))["values"]["messages"][-1]
    assert last["type"] == "ai" and last["response_metadata"] == {"outcome": "cancelled"}
    assert last["content"].startswith("w0 ") and len(last["content"]) < len("w0 ") * 400


async def test_join_stream_resumes_after_its_last_event_id(lg: LangGraphClient):
    assistant = await assistant_id(lg)
    thread_id = (await lg.threads.create())["thread_id"]
    run = await lg.runs.create(thread_id, assistant, input=user("words 60 20"))
    first: list[Any] = []
    async for part in lg.runs.join_stream(thread_id, run["run_id"], stream_mode="messages-tuple"):
        first.append(part)
        if len([p for p in first if p.event == "messages"]) == 5:
            break  # the connection drops
    rest = await collect(
        lg.runs.join_stream(
            thread_id,
            run["run_id"],
            stream_mode="messages-tuple",
            last_event_id=first[-1].id,
        )
    )
    assert rest[0].event != "metadata"  # resumed, not started again
    assert streamed_text(first + rest) == "".join(f"w{i} " for i in range(60))


async def test_multitask_strategies_map_onto_the_double_texting_policies(lg: LangGraphClient):
    assistant = await assistant_id(lg)
    thread_id = (await lg.threads.create())["thread_id"]
    slow = await lg.runs.create(thread_id, assistant, input=user("words 400 50"))
    await wait_until_async(
        lambda: _status(lg, thread_id, slow["run_id"], "running"), 20, "the slow run to start"
    )
    with pytest.raises(httpx.HTTPStatusError) as refused:
        await lg.runs.create(
            thread_id, assistant, input=user("not now"), multitask_strategy="reject"
        )
    assert refused.value.response.status_code == 409
    with pytest.raises(httpx.HTTPStatusError) as rollback:
        await lg.runs.create(
            thread_id, assistant, input=user("x"), multitask_strategy="rollback"
        )
    assert rollback.value.response.status_code == 400
    assert "rollback is not supported" in rollback.value.response.text
    queued = await lg.runs.create(
        thread_id, assistant, input=user("queued"), multitask_strategy="enqueue"
    )
    newest = await lg.runs.wait(
        thread_id, assistant, input=user("now"), multitask_strategy="interrupt"
    )
    assert (await lg.runs.get(thread_id, slow["run_id"]))["status"] == "interrupted"
    assert (await lg.runs.get(thread_id, queued["run_id"]))["status"] == "interrupted"
    assert newest["messages"][-1]["content"] == "echo now"


async def _status(lg: LangGraphClient, thread_id: str, run_id: str, want: str) -> bool:
    return bool((await lg.runs.get(thread_id, run_id))["status"] == want)


async def test_refuses_unknown_modes_forged_runs_other_sessions_and_bad_bodies(
    lg: LangGraphClient, gateway: GatewayProc
):
    assistant = await assistant_id(lg)
    thread_id = (await lg.threads.create())["thread_id"]
    with pytest.raises(httpx.HTTPStatusError) as mode:
        await collect(
            lg.runs.stream(thread_id, assistant, input=user("hi"), stream_mode="debug")
        )
    assert mode.value.response.status_code == 400
    for call in (
        lg.runs.get(thread_id, "forged-run"),
        lg.runs.join(thread_id, "forged-run"),
        lg.runs.cancel(thread_id, "forged-run"),
    ):
        with pytest.raises(httpx.HTTPStatusError) as forged:
            await call
        assert forged.value.response.status_code == 404
    token = session_tokens.mint(SIGNING_KEY, "someone-else", 60)
    other = get_client(url=f"{gateway.url}/langgraph", api_key=token)
    try:
        with pytest.raises(httpx.HTTPStatusError) as denied:
            await other.threads.get_state(thread_id)
        assert denied.value.response.status_code == 403
    finally:
        await other.aclose()
    async with httpx.AsyncClient(base_url=f"{gateway.url}/langgraph", timeout=30) as http:
        auth = {"x-api-key": TOKEN}
        for body in (
            b"not json",
            b"[" * 50_000,
            b'{"assistant_id": 5}',
            b'{"assistant_id": "%s", "input": {"messages": [{"role": "ai", "content": "x"}]}}'
            % assistant.encode(),
            b'{"assistant_id": "%s", "input": {"text": "x"}}' % assistant.encode(),
        ):
            answer = await http.post(
                f"/threads/{thread_id}/runs", content=body, headers=auth
            )
            assert answer.status_code == 400, answer.text
            assert "error" in answer.json()
        nobody = await http.get(f"/threads/{thread_id}/state")
        assert nobody.status_code == 401


async def test_a_session_token_works_on_its_own_thread_without_the_engine_memory(
    lg: LangGraphClient, gateway: GatewayProc
):
    assistant = await assistant_id(lg)
    token = session_tokens.mint(SIGNING_KEY, "own-thread", 600)
    page = get_client(url=f"{gateway.url}/langgraph", api_key=token, timeout=60)
    try:
        thread = await page.threads.create(thread_id="own-thread")
        values = await page.runs.wait(thread["thread_id"], assistant, input=user("hi"))
        assert values["messages"][-1]["content"] == "echo hi"
        assert "memory" not in values
        assert "memory" not in (await page.threads.get_state("own-thread"))["values"]
        assert (await lg.threads.get_state("own-thread"))["values"]["memory"] == {"last": "hi"}
        for call in (page.threads.create(), page.threads.delete("own-thread")):
            with pytest.raises(httpx.HTTPStatusError) as denied:
                await call
            assert denied.value.response.status_code == 403
    finally:
        await page.aclose()


async def test_a_stream_the_client_closes_cancels_its_run_when_asked(lg: LangGraphClient):
    assistant = await assistant_id(lg)
    thread_id = (await lg.threads.create())["thread_id"]
    stream = lg.runs.stream(
        thread_id,
        assistant,
        input=user("words 400 50"),
        stream_mode="messages-tuple",
        on_disconnect="cancel",
    )
    run_id = None
    async for part in stream:
        if part.event == "metadata":
            run_id = part.data["run_id"]
        if part.event == "messages":
            break
    await stream.aclose()  # type: ignore[attr-defined]
    assert run_id is not None
    await wait_until_async(
        lambda: _status(lg, thread_id, run_id, "interrupted"), 15, "the run to be cancelled"
    )
