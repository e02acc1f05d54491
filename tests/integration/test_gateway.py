"""The HTTP gateway (`dialog-worker serve`) as a real process in front of real workers:
routes, server-sent events, resumption, auth and refusals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from gateway_proc import SSE, GatewayProc, SSEParser
from redis_server import wait_for
from worker_procs import WorkerPool

from dialog_worker.config import load_settings

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPLY = "".join(f"w{i} " for i in range(40))


@pytest.fixture
def gateway(env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProc]:
    proc = GatewayProc({**env, "DIALOG_HTTP_TOKEN": TOKEN}, tmp_path)
    yield proc
    proc.stop()


async def read_sse(
    http: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None, stop_after: int = 0
) -> tuple[httpx.Response, SSEParser]:
    parser = SSEParser()
    async with http.stream("GET", url, headers={**AUTH, **(headers or {})}) as response:
        if response.status_code != 200:
            await response.aread()
            return response, parser
        async for line in response.aiter_lines():
            event = parser.line(line)
            if event is None:
                continue
            if event.kind == "end" or (stop_after and len(parser.events) >= stop_after):
                break
    return response, parser


def shown(events: list[SSE]) -> str:
    text = ""
    for e in events:
        if e.kind == "delta":
            text += e.data["text"]
        elif e.kind == "reset":
            text = ""
        else:
            text = e.data["text"]
    return text


async def test_post_then_stream_the_answer_as_server_sent_events(
    gateway: GatewayProc, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        posted = await http.post("/sessions/web-1/messages", json={"text": "40 5"}, headers=AUTH)
        assert posted.status_code == 202, posted.text
        body = posted.json()
        assert body["stream"] == f"/sessions/web-1/messages/{body['msg_id']}/stream"
        response, sse = await read_sse(http, body["stream"])
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert sse.retry is not None
    kinds = [e.kind for e in sse.events]
    assert kinds[-1] == "end" and set(kinds[:-1]) == {"delta"}
    assert shown(sse.events) == REPLY
    assert "".join(e.data["text"] for e in sse.events[:-1]) == REPLY
    assert all(e.id == e.data["cursor"] for e in sse.events)
    assert sse.events[-1].data["outcome"] == "applied"


async def test_an_answer_that_starts_after_the_first_second_still_streams(
    gateway: GatewayProc, workers: WorkerPool
):
    """The stream opens when nothing came within its first second (a busy worker, or none
    yet), instead of answering 503 as if Redis were away."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        posted = await http.post("/sessions/web-late/messages", json={"text": "20 5"}, headers=AUTH)
        started = asyncio.get_running_loop().call_later(
            2.0, lambda: workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
        )
        try:
            response, sse = await read_sse(http, posted.json()["stream"])
        finally:
            started.cancel()
    assert response.status_code == 200
    assert sse.events[-1].kind == "end"
    assert shown(sse.events) == "".join(f"w{i} " for i in range(20))


async def test_last_event_id_or_after_resumes_and_the_end_cursor_gets_204(
    gateway: GatewayProc, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        posted = (
            await http.post("/sessions/web-2/messages", json={"text": "40 10"}, headers=AUTH)
        ).json()
        url = posted["stream"]
        _, first = await read_sse(http, url, stop_after=2)  # the connection drops
        cursor = first.events[-1].id
        assert cursor is not None
        _, rest = await read_sse(http, url, headers={"Last-Event-ID": cursor})
        assert shown(first.events + rest.events[:-1]) == REPLY
        assert rest.events[-1].data["text"] == REPLY
        _, again = await read_sse(http, f"{url}?after={cursor}")
        assert [e.id for e in again.events] == [e.id for e in rest.events]
        end_id = rest.events[-1].id
        assert end_id is not None
        done, _ = await read_sse(http, url, headers={"Last-Event-ID": end_id})
        assert done.status_code == 204
        late, sse = await read_sse(http, url)
        assert late.status_code == 200 and sse.events[-1].data["text"] == REPLY


async def test_a_retried_answer_resets_with_an_event_that_carries_no_id(
    gateway: GatewayProc, workers: WorkerPool
):
    """The first attempt streams a wrong start and fails; the reader is told to start over
    by a `reset` event, which has no cursor: it carries no `id:` line (else the browser would
    send that id back on its next reconnect and be refused), and the browser's last id stays
    the last piece's, from which a reconnect resumes."""
    workers.start(1, DIALOG_ENGINE="stream_engines:FailsFirstAttempt")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        posted = await http.post("/sessions/web-r/messages", json={"text": "8 5"}, headers=AUTH)
        url = posted.json()["stream"]
        parser = SSEParser()
        lines: list[str] = []
        async with http.stream("GET", url, headers=AUTH) as response:
            async for line in response.aiter_lines():
                lines.append(line)
                event = parser.line(line)
                if event is not None and event.kind == "end":
                    break
        kinds = [e.kind for e in parser.events]
        assert "reset" in kinds and kinds[-1] == "end", kinds
        reset = kinds.index("reset")
        assert parser.events[reset].id is None
        head = lines[lines.index("event: reset") - 1]
        assert not head.startswith("id:"), head  # no id line of any value
        assert all(e.id == e.data["cursor"] for e in parser.events if e.kind != "reset")
        answer = "".join(f"w{i} " for i in range(8))
        assert shown(parser.events) == answer
        last_id = next(e.id for e in reversed(parser.events[:-1]) if e.id is not None)
        _, again = await read_sse(http, url, headers={"Last-Event-ID": last_id})
        assert again.events and again.events[-1].kind == "end"
        assert again.events[-1].data["text"] == answer


async def test_cancel_route_stops_the_answer_which_ends_cancelled_with_what_was_shown(
    gateway: GatewayProc, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        posted = (
            await http.post("/sessions/web-c/messages", json={"text": "200 20"}, headers=AUTH)
        ).json()
        url, msg_id = posted["stream"], posted["msg_id"]
        _, first = await read_sse(http, url, stop_after=2)
        cancel = f"/sessions/web-c/messages/{msg_id}/cancel"
        assert (await http.post(cancel)).status_code == 401
        stopped = await http.post(cancel, headers=AUTH)
        assert stopped.status_code == 200, stopped.text
        assert stopped.json() == {
            "session_id": "web-c",
            "msg_id": msg_id,
            "status": "cancelled",
            "seq": 1,
            "outcome": None,
        }
        _, rest = await read_sse(http, url, headers={"Last-Event-ID": first.events[-1].id or ""})
        end = rest.events[-1]
        assert (end.kind, end.data["outcome"]) == ("end", "cancelled")
        # The end keeps the text shown so far (every delta, once), not an empty reply.
        assert end.data["text"] == shown(first.events + rest.events[:-1])
        assert 0 < len(end.data["text"]) < len("".join(f"w{i} " for i in range(200)))
        again = await http.post(cancel, headers=AUTH)  # idempotent: it says how it ended
        assert again.status_code == 200
        assert (again.json()["status"], again.json()["outcome"]) == ("finished", "cancelled")
        early = await http.post("/sessions/web-c/messages/not-sent-yet/cancel", headers=AUTH)
        assert early.json()["status"] == "pending"
        bad = await http.post("/sessions/web-c/messages/%20%20/cancel", headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]


def rejected_event(env: dict[str, str], msg_id: str) -> bool:
    replies = load_settings(environ=env).reply_stream
    with redis.Redis.from_url(env["REDIS_URL"]) as r:
        return any(
            f.get(b"msg_id") == msg_id.encode() and f.get(b"outcome") == b"rejected"
            for _, f in r.xrevrange(replies, count=50)
        )


async def test_post_takes_multitask_expires_at_and_deliver_at_as_send_does(
    env: dict[str, str], gateway: GatewayProc, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        # Expired before its turn: it ends `expired` without a step.
        old = await http.post(
            "/sessions/web-x/messages", json={"text": "5 5", "expires_at": 1}, headers=AUTH
        )
        assert old.status_code == 202, old.text
        _, sse = await read_sse(http, old.json()["stream"])
        assert sse.events[-1].data["outcome"] == "expired"
        # A second message while the first runs, with reject: it ends `rejected`.
        running = await http.post("/sessions/web-r/messages", json={"text": "40 20"}, headers=AUTH)
        await read_sse(http, running.json()["stream"], stop_after=1)  # it is running
        refused = await http.post(
            "/sessions/web-r/messages",
            json={"text": "5 5", "multitask": "reject"},
            headers=AUTH,
        )
        assert refused.status_code == 202, refused.text
        # The rejection is written before the stream is asked for (the gateway read it with
        # nobody waiting): what a browser that opens the stream a moment later meets.
        await wait_for(lambda: rejected_event(env, refused.json()["msg_id"]))
        async with asyncio.timeout(20):  # a stream that never ends fails here, not in 10 min
            _, sse = await read_sse(http, refused.json()["stream"])
        assert sse.events[-1].data["outcome"] == "rejected"
        # Its msg_id is free again: sent once the session is idle, it is applied.
        _, rest = await read_sse(http, running.json()["stream"])
        assert rest.events[-1].data["outcome"] == "applied"
        again = await http.post(
            "/sessions/web-r/messages",
            json={"text": "5 5", "msg_id": refused.json()["msg_id"]},
            headers=AUTH,
        )
        async with asyncio.timeout(20):
            _, sse = await read_sse(http, again.json()["stream"])
        assert sse.events[-1].data["outcome"] == "applied"
        # Delivered later: not answered before its time.
        due = time.time() + 1.5
        later = await http.post(
            "/sessions/web-d/messages", json={"text": "5 5", "deliver_at": due}, headers=AUTH
        )
        assert later.status_code == 202, later.text
        _, sse = await read_sse(http, later.json()["stream"])
        assert sse.events[-1].data["outcome"] == "applied"
        assert time.time() >= due


async def test_a_gateway_started_after_a_rejection_ends_its_stream_rejected_at_once(
    env: dict[str, str], gateway: GatewayProc, workers: WorkerPool, tmp_path: Path
):
    """Behind a load balancer the GET of a stream may reach another gateway than the POST,
    one that never read the rejection's reply event (started after it): it learns the
    rejection from the end intake wrote, and the stream ends `rejected` at once, not after
    its 10 minutes."""
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        running = await http.post("/sessions/web-r2/messages", json={"text": "40 20"}, headers=AUTH)
        await read_sse(http, running.json()["stream"], stop_after=1)  # it is running
        refused = await http.post(
            "/sessions/web-r2/messages", json={"text": "5 5", "multitask": "reject"}, headers=AUTH
        )
        await wait_for(lambda: rejected_event(env, refused.json()["msg_id"]))
    (tmp_path / "later").mkdir()
    later = GatewayProc({**env, "DIALOG_HTTP_TOKEN": TOKEN}, tmp_path / "later")
    try:
        async with httpx.AsyncClient(base_url=later.url, timeout=30) as http:
            async with asyncio.timeout(20):
                _, sse = await read_sse(http, refused.json()["stream"])
    finally:
        later.stop()
    assert [(e.kind, e.data["outcome"], e.data["text"]) for e in sse.events] == [
        ("end", "rejected", "")
    ]


async def test_every_request_needs_the_token(gateway: GatewayProc):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        assert (await http.post("/sessions/a/messages", json={"text": "x"})).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (
            await http.post("/sessions/a/messages", json={"text": "x"}, headers=wrong)
        ).status_code == 401
        assert (await http.get("/sessions/a/messages/m/stream")).status_code == 401
        ok = await http.post(f"/sessions/a/messages?access_token={TOKEN}", json={"text": "x"})
        assert ok.status_code == 202


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/sessions/{a}b/messages", {"text": "braces are fine"}, 202),
        ("/sessions/sesi-ü-日本/messages", {"text": "unicode is fine"}, 202),
        ("/sessions/" + "x" * 300 + "/messages", {"text": "too long an id"}, 400),
        ("/sessions/%20%20/messages", {"text": "blank id"}, 400),
        ("/sessions/a/messages", {"text": ""}, 400),
        ("/sessions/a/messages", {"text": 5}, 400),
        ("/sessions/a/messages", {"text": "x", "msg_id": 5}, 400),
        ("/sessions/a/messages", {"text": "x", "meta": {"k": 1}}, 400),
        ("/sessions/a/messages", ["not", "an", "object"], 400),
        ("/sessions/a/messages", {"text": "x", "multitask": "bogus"}, 400),
        ("/sessions/a/messages", {"text": "x", "multitask": 1}, 400),
        ("/sessions/a/messages", {"text": "x", "expires_at": "soon"}, 400),
        ("/sessions/a/messages", {"text": "x", "expires_at": True}, 400),
        ("/sessions/a/messages", {"text": "x", "deliver_at": "later"}, 400),
        ("/sessions/a/messages", {"text": "x", "deliver_at": 1e13}, 400),
    ],
)
async def test_bad_input_is_a_clear_4xx(gateway: GatewayProc, path: str, body, status: int):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        response = await http.post(path, json=body, headers=AUTH)
    assert response.status_code == status, response.text
    if status >= 400:
        assert response.json()["error"]


async def test_a_body_that_is_not_json_or_too_large_is_refused(gateway: GatewayProc):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        bad = await http.post("/sessions/a/messages", content=b"\xff{", headers=AUTH)
        assert bad.status_code == 400
        huge = await http.post(
            "/sessions/a/messages", content=b'{"text": "' + b"x" * 200_000 + b'"}', headers=AUTH
        )
        assert huge.status_code == 413


async def test_a_chunked_body_without_content_length_is_held_to_the_same_limit(
    gateway: GatewayProc,
):
    """A body sent in chunks declares no Content-Length: it is counted as it arrives and
    refused (413) once past the limit, not read whole; one within the limit is taken."""
    settings = load_settings(environ={})
    limit = settings.max_message_bytes + 16_384  # the gateway's body limit (BODY_SLACK_BYTES)

    def chunks(body: bytes):
        async def gen():
            for i in range(0, len(body), 4096):
                yield body[i : i + 4096]

        return gen()

    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        fits = b'{"text": "' + b"x" * 1000 + b'"}'
        ok = await http.post("/sessions/a/messages", content=chunks(fits), headers=AUTH)
        assert ok.status_code == 202, ok.text
        huge = b'{"text": "hi", "meta": {"pad": "' + b"x" * (limit + 1) + b'"}}'
        refused = await http.post("/sessions/a/messages", content=chunks(huge), headers=AUTH)
        assert refused.request.headers.get("content-length") is None
        assert refused.request.headers["transfer-encoding"] == "chunked"
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"] == f"the body must be at most {limit} bytes"


async def test_a_bad_cursor_is_a_400(gateway: GatewayProc):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for cursor in ("nonsense", "other:1:2", "m:1:" + "9" * 40):
            response = await http.get(
                "/sessions/a/messages/m/stream", headers={**AUTH, "Last-Event-ID": cursor}
            )
            assert response.status_code == 400, cursor
            assert "cursor" in response.json()["error"]


async def test_session_events_replay_kept_turns_then_follow_new_ones_and_resume(
    gateway: GatewayProc, workers: WorkerPool
):
    workers.start(1)  # the built-in rules
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for text in ("nama saya Budi", "internet mati"):
            sent = await http.post("/sessions/ev-1/messages", json={"text": text}, headers=AUTH)
            assert sent.status_code == 202
            await read_sse(http, sent.json()["stream"])  # until it is answered

        async def on_event(events: list[SSE]) -> bool:
            if len(events) == 2:  # the kept turns; now a new one lands
                await http.post("/sessions/ev-1/messages", json={"text": "ketiga"}, headers=AUTH)
            return len(events) == 3

        turns = await read_events(http, "/sessions/ev-1/events", on_event)
        assert [(t.kind, t.data["seq"], t.data["user"]) for t in turns] == [
            ("turn", 1, "nama saya Budi"),
            ("turn", 2, "internet mati"),
            ("turn", 3, "ketiga"),
        ]
        assert turns[0].id is None and turns[1].id and turns[2].id
        assert turns[1].data["bot"].startswith("Mencatat keluhan Anda")
        assert turns[2].data["outcome"] == "applied"
        # Resumed from the second turn's cursor: the third, and nothing before it.
        await http.post("/sessions/ev-1/messages", json={"text": "keempat"}, headers=AUTH)
        again = await read_events(
            http, "/sessions/ev-1/events", lambda e: len(e) == 2, {"Last-Event-ID": turns[1].id}
        )
        assert [t.data["seq"] for t in again] == [3, 4]


async def read_events(
    http: httpx.AsyncClient,
    url: str,
    done,
    headers: dict[str, str] | None = None,
    timeout_s: float = 20,
) -> list[SSE]:
    """The events of an /events stream until ``done(events)`` (a function or a coroutine
    function) says so, within ``timeout_s``."""
    parser = SSEParser()

    async def read() -> list[SSE]:
        async with http.stream("GET", url, headers={**AUTH, **(headers or {})}) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["x-accel-buffering"] == "no"
            async for line in response.aiter_lines():
                if parser.line(line) is None:
                    continue
                verdict = done(parser.events)
                if asyncio.iscoroutine(verdict):
                    verdict = await verdict
                if verdict:
                    break
        return parser.events

    return await asyncio.wait_for(read(), timeout_s)


async def test_session_events_refuse_a_cursor_they_cannot_read(gateway: GatewayProc):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for cursor in ("x:1:2", "1-2", "1-2:x", "9" * 40):
            bad = await http.get(f"/sessions/a/events?after={cursor}", headers=AUTH)
            assert bad.status_code == 400, cursor
            assert "cursor" in bad.json()["error"]
        assert (await http.get("/sessions/a/events")).status_code == 401


async def test_session_events_miss_no_turn_of_a_burst_larger_than_the_history(
    gateway: GatewayProc, workers: WorkerPool, env: dict[str, str]
):
    """40 messages applied at once with a history of 5 turns: an open stream gets every one of
    them, in order (the reply stream has them all), and so does a reader that comes back
    from a cursor taken before the burst."""
    workers.start(1, DIALOG_HISTORY_LIMIT="5")
    r = redis.Redis.from_url(env["REDIS_URL"])
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for text in ("satu", "dua"):
            sent = await http.post("/sessions/ev-b/messages", json={"text": text}, headers=AUTH)
            await read_sse(http, sent.json()["stream"])

        def on_event(events: list[SSE]) -> bool:
            if len(events) == 2:
                for i in range(40):
                    r.xadd("dialog", {"session_id": "ev-b", "text": f"burst {i}"})
            return bool(events[-1].data.get("seq") == 42)

        live = await read_events(http, "/sessions/ev-b/events", on_event)
        assert [e.kind for e in live] == ["turn"] * 42
        assert [e.data["seq"] for e in live] == list(range(1, 43))
        rest = await read_events(  # every one is there already: at once
            http,
            "/sessions/ev-b/events",
            lambda e: len(e) >= 40,
            {"Last-Event-ID": live[1].id},
            timeout_s=10,
        )
    assert [e.data["seq"] for e in rest] == list(range(3, 43))
    assert [e.data["user"] for e in rest[-5:]] == [f"burst {i}" for i in range(35, 40)]
    assert rest[0].data["user"] is None  # its turn left the history; its reply did not


async def test_session_events_follow_a_session_deleted_and_started_again(
    gateway: GatewayProc, workers: WorkerPool, env: dict[str, str]
):
    """After a delete the seq starts again at 1: an open stream, and a reader resuming with an
    earlier cursor, are told the session restarted and get its new turns."""
    workers.start(1)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for text in ("nama saya Budi", "internet mati"):
            sent = await http.post("/sessions/ev-d/messages", json={"text": text}, headers=AUTH)
            await read_sse(http, sent.json()["stream"])
        before = await read_events(http, "/sessions/ev-d/events", lambda e: len(e) == 2)

        async def on_event(events: list[SSE]) -> bool:
            if len(events) == 2:
                from dialog_worker.client.dialog_client import DialogClient

                async with DialogClient(env["REDIS_URL"]) as client:
                    await client.delete("ev-d")
                await http.post(
                    "/sessions/ev-d/messages", json={"text": "nama saya Sari"}, headers=AUTH
                )
            return any(e.kind == "turn" and e.data["user"] == "nama saya Sari" for e in events)

        live = await read_events(http, "/sessions/ev-d/events", on_event)
        assert [(e.kind, e.data.get("seq")) for e in live[2:]] == [("resync", None), ("turn", 1)]
        assert live[2].data == {"reason": "restart", "turns": []}
        assert live[3].data["bot"] == "Halo Sari, ada yang bisa dibantu?"
        resumed = await read_events(
            http, "/sessions/ev-d/events", lambda e: len(e) == 2, {"Last-Event-ID": before[-1].id}
        )
        assert [(e.kind, e.data.get("seq")) for e in resumed] == [("resync", None), ("turn", 1)]


async def test_a_session_id_that_is_not_utf8_is_refused_not_merged(gateway: GatewayProc):
    """%FF and %FE both decode to U+FFFD: answering them would give two users one session."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for path in (
            "/sessions/%FF/messages",
            "/sessions/ab%FE/messages",
            "/sessions/%C3/messages",
        ):
            response = await http.post(path, json={"text": "x"}, headers=AUTH)
            assert response.status_code == 400, (path, response.text)
            assert "UTF-8" in response.json()["error"]
        for path in (
            "/sessions/%FF/events",
            "/sessions/%FF/messages/m/stream",
            "/sessions/a/messages/%FF/stream",
            "/sessions/%FE/messages/m/cancel",
        ):
            method = "POST" if path.endswith("cancel") else "GET"
            response = await http.request(method, path, headers=AUTH)
            assert response.status_code == 400, (path, response.text)
        # A real U+FFFD, sent encoded as UTF-8, is an ordinary character.
        fine = await http.post("/sessions/a%EF%BF%BDb/messages", json={"text": "x"}, headers=AUTH)
        assert fine.status_code == 202, fine.text


async def test_deeply_nested_json_is_a_400_like_any_malformed_body(gateway: GatewayProc):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        for body in (b"[" * 30_000, b'{"text": ' + b"[" * 30_000):
            response = await http.post("/sessions/a/messages", content=body, headers=AUTH)
            assert response.status_code == 400, response.text
            assert response.json() == {"error": "the body must be JSON"}


async def test_session_events_resync_a_reader_whose_cursor_fell_behind_the_reply_stream(
    gateway: GatewayProc, workers: WorkerPool, env: dict[str, str]
):
    """Events after the reader's cursor were trimmed from the reply stream: it gets a resync
    with the turns the session keeps, never a silent hole, then the new turns."""
    workers.start(1)
    r = redis.Redis.from_url(env["REDIS_URL"])
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        sent = await http.post(
            "/sessions/ev-g/messages", json={"text": "nama saya Budi"}, headers=AUTH
        )
        await read_sse(http, sent.json()["stream"])
        first = await read_events(http, "/sessions/ev-g/events", lambda e: len(e) == 1)
        sent = await http.post("/sessions/ev-g/messages", json={"text": "kedua"}, headers=AUTH)
        await read_sse(http, sent.json()["stream"])
        r.xtrim("dialog-replies", maxlen=0, approximate=False)  # MAXLEN, to a reader long away
        sent = await http.post("/sessions/ev-g/messages", json={"text": "ketiga"}, headers=AUTH)
        await read_sse(http, sent.json()["stream"])
        back = await read_events(
            http, "/sessions/ev-g/events", lambda e: len(e) == 1, {"Last-Event-ID": first[0].id}
        )
        assert back[0].kind == "resync" and back[0].data["reason"] == "gap"
        assert [t["seq"] for t in back[0].data["turns"]] == [1, 2, 3]

        # Resumed from the resync's cursor: nothing it showed again, then the next turn.
        await http.post("/sessions/ev-g/messages", json={"text": "empat"}, headers=AUTH)
        after = await read_events(
            http, "/sessions/ev-g/events", lambda e: len(e) == 1, {"Last-Event-ID": back[0].id}
        )
    assert [(e.kind, e.data["seq"]) for e in after] == [("turn", 4)]


async def test_a_page_finds_the_pending_prompt_after_a_reload_and_approves_it_once(
    gateway: GatewayProc, workers: WorkerPool, tmp_path: Path
):
    """The approval flow over HTTP: the stream shows the prompt (an ``awaiting`` event), a
    reloaded page finds it with GET /pending, a double click resumes it once, and the same
    stream, reconnected, gets the answer."""
    workers.start(
        1, DIALOG_ENGINE="journal_engines:Agent", JOURNAL_CALLS=str(tmp_path / "calls.txt")
    )
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        posted = await http.post(
            "/sessions/web-9/messages", json={"text": "refund 12", "msg_id": "m1"}, headers=AUTH
        )
        assert posted.status_code == 202, posted.text
        stream = posted.json()["stream"]
        _, sse = await read_sse(http, stream, stop_after=1)
        [prompt] = sse.events
        assert (prompt.kind, prompt.data["event_kind"]) == ("event", "awaiting")
        assert prompt.data["data"]["payload"] == {"approve": "refund 12", "quote": {"i": 0}}
        # The page is reloaded: the prompt is still there.
        pending = await http.get("/sessions/web-9/pending", headers=AUTH)
        assert pending.status_code == 200
        [waiting] = pending.json()["pending"]
        assert (waiting["interrupt_id"], waiting["msg_id"], waiting["seq"]) == ("m1:1:1", "m1", 1)
        resume = f"/sessions/web-9/interrupts/{waiting['interrupt_id']}/resume"
        bad = await http.post(resume, json={"approved": True}, headers=AUTH)
        assert bad.status_code == 400  # the body is {"value": ...}
        first = await http.post(resume, json={"value": True}, headers=AUTH)
        again = await http.post(resume, json={"value": False}, headers=AUTH)
        assert (first.status_code, first.json()["status"]) == (200, "resumed")
        assert (again.status_code, again.json()["status"]) == (200, "already_resumed")
        wrong = await http.post(
            "/sessions/web-9/interrupts/m1:1:7/resume", json={"value": True}, headers=AUTH
        )
        assert (wrong.status_code, wrong.json()["status"]) == (404, "unknown")
        _, rest = await read_sse(http, stream, headers={"Last-Event-ID": prompt.id or ""})
    assert [e.kind for e in rest.events][-1] == "end"
    assert rest.events[-1].data["text"] == "refunded"
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["m1 0", "m1 99"]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        after = await http.get("/sessions/web-9/pending", headers=AUTH)
    assert after.json() == {"session_id": "web-9", "pending": []}
