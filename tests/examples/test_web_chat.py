"""examples/web_chat.py served by uvicorn in its own process, over HTTP, with real workers."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from examples_path import EXAMPLES, with_examples
from redis_server import free_port, wait_until

pytestmark = pytest.mark.integration


# How long the server waits for a reply before its 504 (ASK_TIMEOUT_S): generous, so a
# machine under load answers every post in time; the 504 itself is tested with a server that
# waits 1.5 s for a message no worker can take.
PATIENT_S = 30.0


@contextlib.contextmanager
def serve_web_chat(env: dict[str, str], ask_timeout_s: float) -> Iterator[str]:
    port = free_port()
    server = ["uvicorn", "web_chat:app", "--app-dir", str(EXAMPLES), "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *server, "--port", str(port), "--log-level", "warning"],
        env=with_examples({**env, "ASK_TIMEOUT_S": str(ask_timeout_s)}),
        cwd=Path(__file__).resolve().parents[2],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 20, what="the web chat server")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def web_chat(env: dict[str, str]) -> Iterator[str]:
    with serve_web_chat(env, PATIENT_S) as url:
        yield url


async def test_chat_endpoint_answers_each_post_with_the_bots_reply(workers, web_chat: str):
    workers.start(1, DIALOG_ENGINE="fault_engine:make")
    async with httpx.AsyncClient(base_url=web_chat, timeout=2 * PATIENT_S) as http:
        first = await http.post("/chat", json={"session_id": "w1", "text": "nama saya Budi"})
        assert first.status_code == 200, first.text
        assert first.json()["reply"] == "Halo Budi, ada yang bisa dibantu?"
        assert (first.json()["outcome"], first.json()["seq"]) == ("applied", 1)
        second = await http.post(
            "/chat", json={"session_id": "w1", "text": "saya ada kendala billing"}
        )
        assert second.json()["reply"] == (
            'Mencatat keluhan Anda: "saya ada kendala billing". Tim kami akan meninjau.'
        )

        # Fifty users at once, each gets their own answer.
        answers = await asyncio.gather(
            *(
                http.post("/chat", json={"session_id": f"u{i}", "text": f"nama saya N{i}"})
                for i in range(50)
            )
        )
        assert [a.json()["reply"] for a in answers] == [
            f"Halo N{i}, ada yang bisa dibantu?" for i in range(50)
        ]

        refused = await http.post("/chat", json={"session_id": "w2", "text": "fatal: no"})
        assert refused.status_code == 200
        assert refused.json()["outcome"] == "dead_lettered"


async def test_a_post_without_a_reply_in_time_gets_504_and_its_msg_id_posted_again_the_answer(
    workers, env: dict[str, str]
):
    """No worker runs while the first post waits (1.5 s): its 504 carries the msg_id. Posted
    again with it once a worker runs, it gets that message's answer (applied once), however
    many 504s a loaded machine gives on the way."""
    post = {"session_id": "w3", "text": "nama saya Ani"}
    with serve_web_chat(env, 1.5) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            slow = await http.post("/chat", json=post)
            assert slow.status_code == 504, slow.text
            msg_id = slow.json()["msg_id"]
            workers.start(1)
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                again = await http.post("/chat", json={**post, "msg_id": msg_id})
                if again.status_code != 504 or asyncio.get_running_loop().time() > deadline:
                    break
    assert again.status_code == 200, again.text
    # Its own answer: the message's reply and seq, `duplicate` since the msg_id was sent before.
    assert again.json() == {
        "reply": "Halo Ani, ada yang bisa dibantu?",
        "outcome": "duplicate",
        "seq": 1,
        "msg_id": msg_id,
    }


async def test_a_post_whose_send_timed_out_gets_503_with_the_msg_id_to_post_again(
    workers, web_chat: str, env: dict[str, str]
):
    from redis.asyncio import Redis

    workers.start(1)
    async with httpx.AsyncClient(base_url=web_chat, timeout=30) as http:
        warm = await http.post("/chat", json={"session_id": "p1", "text": "nama saya Budi"})
        assert warm.status_code == 200, warm.text
        admin = Redis.from_url(env["REDIS_URL"])
        try:
            # Longer than the client's 5 s socket timeout: the append's outcome is unknown.
            await admin.execute_command("CLIENT", "PAUSE", 6500, "WRITE")
        finally:
            await admin.aclose()
        lost = await http.post("/chat", json={"session_id": "p1", "text": "kendala billing"})
        assert lost.status_code == 503, lost.text
        msg_id = lost.json()["msg_id"]
        # The workers come back from the pause too: a 504 (no reply in time yet) is posted
        # again with the same msg_id, as the client of this endpoint would.
        for _ in range(10):
            again = await http.post(
                "/chat", json={"session_id": "p1", "text": "kendala billing", "msg_id": msg_id}
            )
            if again.status_code != 504:
                break
        assert again.status_code == 200, again.text
        assert again.json()["msg_id"] == msg_id
        assert again.json()["outcome"] in ("applied", "duplicate")


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"not json", 400),
        (b"[1, 2]", 400),
        (b'{"session_id": "x"}', 400),
        (b'{"session_id": "x", "text": "   "}', 400),
        (b'{"session_id": "x", "text": "halo", "msg_id": 5}', 400),
    ],
)
def test_chat_endpoint_refuses_bad_requests_with_400(web_chat: str, body: bytes, status: int):
    answer = httpx.post(f"{web_chat}/chat", content=body, timeout=10)
    assert answer.status_code == status
    assert "error" in answer.json()
