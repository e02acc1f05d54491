"""The AI SDK front door (/ai-sdk/chat) driven by the AI SDK's own client code (npm `ai`:
DefaultChatTransport sends and reconnects as useChat does, readUIMessageStream builds the
message), against `dialog-worker serve` and real workers; and its refusals of hostile input."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import redis
from examples_path import with_examples
from gateway_proc import GatewayProc
from npm_packages import node_or_skip, npm_ci
from worker_procs import WorkerPool

from dialog_worker.client import session_tokens
from dialog_worker.client.sync import SyncDialogClient
from dialog_worker.config import load_settings

pytestmark = pytest.mark.integration

CLIENTS = Path(__file__).resolve().parents[1] / "support" / "node_clients"
SERVER_TOKEN = "ai-sdk-server-token"
KEY = "j" * 40
REPLY = "".join(f"w{i} " for i in range(40))


@pytest.fixture(scope="module")
def node_clients() -> Path:
    npm_ci(CLIENTS)
    return CLIENTS


@pytest.fixture
def gateway(env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProc]:
    proc = GatewayProc(
        {**env, "DIALOG_HTTP_TOKEN": SERVER_TOKEN, "DIALOG_HTTP_SIGNING_KEY": KEY}, tmp_path
    )
    yield proc
    proc.stop()


def node(clients: Path, spec: dict[str, Any], timeout_s: float = 60) -> dict[str, Any]:
    """Runs the AI SDK client script once; its one JSON line."""
    result = subprocess.run(
        [node_or_skip(), str(clients / "ai_sdk_chat.mjs"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def user(msg_id: str, text: str) -> dict[str, Any]:
    return {"id": msg_id, "role": "user", "parts": [{"type": "text", "text": text}]}


def send(clients: Path, gateway: GatewayProc, chat: str, *messages: dict[str, Any], **extra: Any):
    token = extra.pop("token", SERVER_TOKEN)
    timeout_s = extra.pop("timeout_s", 60)
    spec = {"mode": "send", "base": gateway.url, "token": token, "chat": chat, **extra}
    return node(clients, {**spec, "messages": list(messages)}, timeout_s)


def text_of(message: dict[str, Any]) -> str:
    return "".join(p["text"] for p in message["parts"] if p["type"] == "text")


def applied_turns(env: dict[str, str], session: str) -> list[str]:
    with SyncDialogClient(settings=load_settings(environ=env)) as client:
        state = client.state(session)
    return [t["msg_id"] for t in state["history"]] if state else []


def test_the_transport_sends_and_read_ui_message_stream_builds_the_answer(
    node_clients: Path, gateway: GatewayProc, workers: WorkerPool, env: dict[str, str]
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    # An answer of 0.2 s: a stream that never ends (a message sent under another id) fails soon.
    got = send(node_clients, gateway, "ai-1", user("m1", "40 5"), timeout_s=20)
    assert got["errors"] == []
    types = [c["type"] for c in got["chunks"]]
    assert types[:3] == ["start", "start-step", "text-start"]
    assert types[-3:] == ["text-end", "finish-step", "finish"]
    assert set(types[3:-3]) == {"text-delta"}
    assert got["chunks"][0]["messageId"] == "reply-m1"
    assert got["chunks"][-1]["messageMetadata"] == {"outcome": "applied"}
    message = got["message"]
    assert (message["id"], message["role"], text_of(message)) == ("reply-m1", "assistant", REPLY)
    assert message["metadata"] == {"session_id": "ai-1", "msg_id": "m1", "outcome": "applied"}
    assert len(got["texts"]) > 5  # it grew piece by piece
    # A retried POST (the same user message id) is the same message: answered once.
    again = send(node_clients, gateway, "ai-1", user("m1", "40 5"), timeout_s=20)
    assert text_of(again["message"]) == REPLY
    assert applied_turns(env, "ai-1") == ["m1"]


def test_the_ui_message_stream_header_and_the_whole_conversation_in_the_body(
    gateway: GatewayProc, workers: WorkerPool
):
    """DefaultChatTransport posts every message of the chat; the last one is the message."""
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    history = [user(f"old-{i}", "x " * 2000) for i in range(30)]  # ~120 KB of earlier turns
    body = {"id": "ai-h", "messages": [*history, user("h1", "3 1")], "trigger": "submit-message"}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        with http.stream(
            "POST", "/ai-sdk/chat", json=body, headers={"Authorization": f"Bearer {SERVER_TOKEN}"}
        ) as response:
            assert response.status_code == 200
            assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["type"] == "finish"


def test_a_reload_mid_answer_resumes_with_a_replay_and_204_once_it_ended(
    node_clients: Path, gateway: GatewayProc, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    first = send(node_clients, gateway, "ai-r", user("r1", "60 25"), stopAfterChunks=8)
    assert len(first["chunks"]) == 8  # the page was reloaded here
    spec = {"mode": "resume", "base": gateway.url, "token": SERVER_TOKEN, "chat": "ai-r"}
    resumed = node(node_clients, spec)
    assert resumed["chunks"][0] == {
        "type": "start",
        "messageId": "reply-r1",
        "messageMetadata": {"session_id": "ai-r", "msg_id": "r1"},
    }
    assert text_of(resumed["message"]) == "".join(f"w{i} " for i in range(60))
    # A replay from the start (the client rebuilds the message), not the rest only.
    assert next(t for t in resumed["texts"] if t).startswith("w0 w1 ")
    assert node(node_clients, spec) == {"none": True}  # nothing in progress: 204


def test_stop_ends_the_answer_cancelled_with_the_text_so_far(
    node_clients: Path, gateway: GatewayProc, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    auth = {"Authorization": f"Bearer {SERVER_TOKEN}"}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        assert http.post("/ai-sdk/chat/ai-s/stop", headers=auth).json()["status"] == "none"
        body = {"id": "ai-s", "messages": [user("s1", "200 20")]}
        with http.stream("POST", "/ai-sdk/chat", json=body, headers=auth) as response:
            chunks = []
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 6:
                    stopped = http.post("/ai-sdk/chat/ai-s/stop", headers=auth)
                    assert stopped.status_code == 200, stopped.text
                    assert stopped.json()["status"] == "cancelled"
        named = http.post("/ai-sdk/chat/ai-s/stop", json={"messageId": "reply-s1"}, headers=auth)
    assert named.json()["status"] == "finished"
    types = [c["type"] for c in chunks]
    assert types[-3:] == ["finish-step", "abort", "finish"]
    assert chunks[-1]["messageMetadata"] == {"outcome": "cancelled"}
    shown = "".join(c["delta"] for c in chunks if c["type"] == "text-delta")
    assert 0 < len(shown) < len(" ".join(f"w{i}" for i in range(200)))


def test_a_new_attempt_that_writes_the_same_text_again_is_not_shown_twice(
    node_clients: Path, gateway: GatewayProc, workers: WorkerPool
):
    """The first attempt streams a wrong start and fails: the client gets a reset part and the
    second attempt's text; once a second attempt repeats what is shown, nothing is doubled."""
    workers.start(1, DIALOG_ENGINE="stream_engines:FailsFirstAttempt")
    got = send(node_clients, gateway, "ai-f", user("f1", "8 5"))
    answer = "".join(f"w{i} " for i in range(8))
    message = got["message"]
    parts = [p["type"] for p in message["parts"]]
    assert "data-reset" in parts
    after_reset = message["parts"][parts.index("data-reset") + 1 :]
    assert "".join(p["text"] for p in after_reset if p["type"] == "text") == answer
    assert any(t.startswith("WRONG") for t in got["texts"])  # it was shown, then replaced


def test_a_reload_after_a_new_attempt_replays_only_that_attempt(
    node_clients: Path, gateway: GatewayProc, workers: WorkerPool
):
    """Reloaded while the second attempt writes: the replay is that attempt's answer alone,
    with no trace of the failed one."""
    workers.start(1, DIALOG_ENGINE="stream_engines:FailsFirstAttempt")
    auth = {"Authorization": f"Bearer {SERVER_TOKEN}"}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        body = {"id": "ai-fr", "messages": [user("fr1", "40 40")]}
        with http.stream("POST", "/ai-sdk/chat", json=body, headers=auth) as response:
            for line in response.iter_lines():
                if '"data-reset"' in line:
                    break  # the second attempt is writing: the page is reloaded now
        spec = {"mode": "resume", "base": gateway.url, "token": SERVER_TOKEN, "chat": "ai-fr"}
        resumed = node(node_clients, spec)
    assert not any("WRONG" in t for t in resumed["texts"])
    assert "data-reset" not in [p["type"] for p in resumed["message"]["parts"]]
    assert text_of(resumed["message"]) == "".join(f"w{i} " for i in range(40))


def test_typed_events_and_a_question_answered_with_the_approval_part(
    node_clients: Path, gateway: GatewayProc, workers: WorkerPool, env: dict[str, str], tmp_path
):
    """The example's Assistant: tool progress as data parts, its question as a tool call
    waiting for approval (the stream ends there), the person's approval sent back as useChat
    sends it, then the rest of the answer in the same message; the refund is sent once."""
    ledger = tmp_path / "refunds.jsonl"
    workers.start(
        1,
        **with_examples(env),
        DIALOG_ENGINE="web_chat_stream:Assistant",
        WEB_CHAT_REFUNDS_FILE=str(ledger),
    )
    asked = send(node_clients, gateway, "ai-q", user("q1", "refund 20"))
    message = asked["message"]
    tool = next(p for p in message["parts"] if p["type"] == "dynamic-tool")
    assert tool["toolName"] == "interrupt" and tool["state"] == "approval-requested"
    assert tool["input"] == {"question": "Send a refund of 20?"}
    assert message["metadata"]["outcome"] == "awaiting"
    assert {"type": "data-tool", "data": {"name": "refund", "status": "waiting for approval"}} in [
        {k: p[k] for k in ("type", "data")} for p in message["parts"] if p["type"] == "data-tool"
    ]
    # What useChat does on addToolApprovalResponse({id, approved: true}), then sends.
    tool["state"] = "approval-responded"
    tool["approval"] = {"id": tool["approval"]["id"], "approved": True}
    rest = send(
        node_clients, gateway, "ai-q", user("q1", "refund 20"), message, messageId=message["id"]
    )
    statuses = [p["data"]["status"] for p in rest["message"]["parts"] if p["type"] == "data-tool"]
    # The same message goes on; the repeated "waiting for approval" is not shown twice.
    assert statuses == ["waiting for approval", "running", "done"]
    assert rest["message"]["parts"][len(message["parts"])]["type"] == "step-start"
    assert [p["state"] for p in rest["message"]["parts"] if p["type"] == "dynamic-tool"] == [
        "output-available"
    ]
    assert text_of(rest["message"]).startswith("Done: refund R-q1")
    outputs = [c for c in rest["chunks"] if c["type"] == "tool-output-available"]
    assert outputs == [
        {"type": "tool-output-available", "toolCallId": tool["toolCallId"], "output": True}
    ]
    # Sent again (a retry of the same answer): applied once, the refund once.
    again = send(
        node_clients, gateway, "ai-q", user("q1", "refund 20"), message, messageId=message["id"]
    )
    assert text_of(again["message"]).startswith("Done: refund R-q1")
    assert len(ledger.read_text().splitlines()) == 1


@pytest.mark.parametrize(
    ("policy", "first", "second"),
    [
        ("reject", "applied", "rejected"),
        ("interrupt", "cancelled", "applied"),
        ("enqueue", "applied", "applied"),
    ],
)
def test_a_second_message_while_the_first_answers_follows_the_multitask_policy(
    gateway: GatewayProc, workers: WorkerPool, policy: str, first: str, second: str
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    auth = {"Authorization": f"Bearer {SERVER_TOKEN}"}
    session = f"ai-p-{policy}"

    def outcome_of(response: httpx.Response) -> str:
        finish = [json.loads(line[6:]) for line in response.iter_lines() if '"finish"' in line]
        return str(finish[-1]["messageMetadata"]["outcome"])

    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        body = {"id": session, "messages": [user("p1", "40 25")]}
        with http.stream("POST", "/ai-sdk/chat", json=body, headers=auth) as running:
            lines = running.iter_lines()
            while '"text-delta"' not in next(lines):  # it is answering
                pass
            body2 = {"id": session, "messages": [user("p2", "3 1")], "multitask": policy}
            with http.stream("POST", "/ai-sdk/chat", json=body2, headers=auth) as later:
                rest = httpx.Response(200, content="\n".join(lines).encode())
                assert (outcome_of(rest), outcome_of(later)) == (first, second)


def jose_token(clients: Path, sub: str, scope: str, ttl: str = "5m") -> str:
    spec = {"mode": "mint", "key": KEY, "sub": sub, "scope": scope, "ttl": ttl}
    return str(node(clients, spec)["token"])


def test_a_token_minted_by_node_jose_opens_its_own_chat_only(
    node_clients: Path, gateway: GatewayProc, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    token = jose_token(node_clients, "ai-j", "send stream cancel")
    got = send(node_clients, gateway, "ai-j", user("j1", "3 1"), token=token)
    assert text_of(got["message"]) == "w0 w1 w2 "
    other = send(node_clients, gateway, "ai-k", user("k1", "3 1"), token=token)
    assert "another session" in other["refused"]
    resume = node(
        node_clients, {"mode": "resume", "base": gateway.url, "token": token, "chat": "ai-j"}
    )
    assert resume == {"none": True}


def unsigned(claims: dict[str, Any]) -> str:
    return jwt.api_jws.PyJWS().encode(json.dumps(claims).encode(), key=None, algorithm="none")


@pytest.mark.parametrize(
    ("mint", "status", "says"),
    [
        (
            lambda: unsigned({"sub": "ai-x", "scope": "send", "exp": int(time.time()) + 600}),
            401,
            "HS256",
        ),
        (lambda: session_tokens.mint(KEY, "ai-x", 60, now=time.time() - 120), 401, "expired"),
        (lambda: session_tokens.mint(KEY, "ai-other", 60), 403, "another session"),
        (lambda: session_tokens.mint(KEY, "ai-x", 60, actions=["stream"]), 403, "does not allow"),
    ],
    ids=["alg-none", "expired", "another-session", "another-action"],
)
def test_hostile_tokens_are_refused_on_every_route(
    gateway: GatewayProc, mint: Callable[[], str], status: int, says: str
):
    token = mint()
    auth = {"Authorization": f"Bearer {token}"}
    body = {"id": "ai-x", "messages": [user("x1", "hi")]}
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        posted = http.post("/ai-sdk/chat", json=body, headers=auth)
        assert (posted.status_code, says in posted.json()["error"]) == (status, True), posted.text
        if status == 401:  # the routes of the session in the path
            for method, path in (("GET", "stream"), ("POST", "stop")):
                answer = http.request(method, f"/ai-sdk/chat/ai-x/{path}", headers=auth)
                assert answer.status_code == 401, (path, answer.text)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": [user("a", "hi")]}, "session_id"),
        ({"id": "ai-m", "messages": []}, "messages"),
        ({"id": "ai-m", "messages": "hi"}, "messages"),
        ({"id": "ai-m", "messages": [["not", "a", "message"]]}, "user or assistant"),
        ({"id": "ai-m", "messages": [{"id": "a", "role": "system", "parts": []}]}, "user or"),
        ({"id": "ai-m", "messages": [{"id": "a", "role": "user", "parts": "hi"}]}, "parts"),
        (
            {"id": "ai-m", "messages": [{"id": "a", "role": "user", "parts": [{"type": "file"}]}]},
            "no text",
        ),
        (
            {
                "id": "ai-m",
                "messages": [{"role": "user", "parts": [{"type": "text", "text": "x"}]}],
            },
            "msg_id",
        ),
        ({"id": "ai-m", "messages": [user(" ", "hi")]}, "msg_id"),
        ({"id": "ai-m", "messages": [user("a", "hi")], "multitask": "bogus"}, "multitask"),
        (
            {"id": "ai-m", "messages": [{"id": "reply-a", "role": "assistant", "parts": []}]},
            "answered question",
        ),
        ({"id": "x" * 300, "messages": [user("a", "hi")]}, "session_id"),
    ],
)
def test_malformed_ui_messages_are_a_400_that_says_why(
    gateway: GatewayProc, body: dict[str, Any], says: str
):
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        response = http.post(
            "/ai-sdk/chat", json=body, headers={"Authorization": f"Bearer {SERVER_TOKEN}"}
        )
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]


def test_a_body_past_a_mebibyte_is_a_413_and_nothing_is_sent(
    gateway: GatewayProc, env: dict[str, str]
):
    body = {"id": "ai-big", "messages": [user("a", "x" * 1_100_000)]}
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        response = http.post(
            "/ai-sdk/chat", json=body, headers={"Authorization": f"Bearer {SERVER_TOKEN}"}
        )
    assert response.status_code == 413
    with redis.Redis.from_url(env["REDIS_URL"]) as r:
        assert r.xlen(load_settings(environ=env).stream) == 0
