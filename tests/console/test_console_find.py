"""The console's indexes, against a real redis-server and real workers: a message found by
its msg_id (one GET per shard of the index intake keeps, never a scan), and each session's
dead letters read through the index the scripts keep with them (never the whole stream),
cleaned when a letter is redriven or purged."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from console_support import OPERATOR, VIEWER, basic, form_token
from redis_server import wait_until_async
from worker_procs import WorkerPool

from dialog_worker.client.dialog_client import DialogClient

pytestmark = pytest.mark.integration

VIEW = basic(VIEWER)
OP = basic(OPERATOR)


async def test_a_message_is_found_by_its_msg_id_and_leads_to_its_session(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1)
    await client.send("ida", "halo", msg_id="order-42")
    hostile = "<b>{x}</b>"
    await client.send("<i>jo</i>", "halo", msg_id=hostile)
    plain = await client.send("kai", "no msg_id given")  # the client generates one

    async def indexed() -> bool:
        return (await http.get("/api/message?msg_id=order-42", headers=VIEW)).status_code == 200

    await wait_until_async(indexed, 15, what="order-42 sequenced")
    r = await http.get("/message?msg_id=order-42", headers=VIEW)
    assert r.status_code == 303 and r.headers["location"] == "/session?id=ida"
    data = (await http.get("/api/message?msg_id=order-42", headers=VIEW)).json()
    assert data == {"msg_id": "order-42", "sessions": [{"session_id": "ida", "shard": 0}]}

    async def hostile_found() -> bool:
        r = await http.get("/api/message", params={"msg_id": hostile}, headers=VIEW)
        return r.status_code == 200

    await wait_until_async(hostile_found, 15, what="the hostile msg_id sequenced")
    r = await http.get("/api/message", params={"msg_id": hostile}, headers=VIEW)
    assert r.json()["sessions"] == [{"session_id": "<i>jo</i>", "shard": 0}]
    r = await http.get("/message", params={"msg_id": plain.msg_id}, headers=VIEW)
    assert r.status_code == 303 and r.headers["location"] == "/session?id=kai"

    r = await http.get("/message", params={"msg_id": "<script>nope</script>"}, headers=VIEW)
    assert r.status_code == 404
    assert "<script>nope" not in r.text and "&lt;script&gt;nope" in r.text
    assert (await http.get("/api/message?msg_id=", headers=VIEW)).status_code == 400


async def test_a_sessions_dead_letters_come_from_its_index_not_from_the_stream(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool, tmp_path: Path
) -> None:
    flag = tmp_path / "flag"
    flag.write_text("on")
    workers.start(
        1, DIALOG_ENGINE="fault_engine:make", DIALOG_MAX_ATTEMPTS="1", FAULT_FLAG_FILE=str(flag)
    )
    assert (await client.ask("mine", "flaky one", timeout=20)).outcome == "dead_lettered"
    # Refused at intake (no text) but names the session: indexed too.
    await client.redis.xadd(client.keys.stream, {"session_id": "mine", "msg_id": "no-text"})
    # Many newer letters of other sessions: the page must not read through them.
    for i in range(300):
        await client.redis.xadd(client.keys.dlq, {"session_id": f"other-{i}", "text": "x"})
    index = client.keys.session("mine").letters

    async def two_indexed() -> bool:
        return await client.redis.zcard(index) == 2

    await wait_until_async(two_indexed, 10, what="two letters indexed for the session")
    data = (await http.get("/api/session?id=mine", headers=VIEW)).json()
    assert data["letters_scanned"] == 0 and data["letters_complete"] is True
    kinds = sorted(d["error_kind"] for d in data["dead_letters"])
    assert len(kinds) == 2 and kinds[1] == "malformed", kinds

    flag.unlink()
    page = (await http.get("/session?id=mine", headers=OP)).text
    handles = [h.split('"')[0] for h in page.split('data-handle="')[1:]]
    assert len(handles) == 2
    r = await http.post(
        "/letters/action",
        headers=OP,
        data={
            "action": "purge",
            "handle": handles,
            "count": "2",
            "reason": "cleaning up",
            "form_token": form_token(page),
        },
    )
    assert r.status_code == 200, r.text
    assert await client.redis.zcard(index) == 0  # purged letters leave the index


async def test_sessions_are_listed_by_id_prefix_without_a_scan(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1)
    for sid in ("acme-1", "acme-2", "acme-<b>3</b>", "other-1"):
        await client.send(sid, "halo")

    async def listed() -> list[str] | None:
        r = await http.get("/api/sessions", params={"prefix": "acme-"}, headers=VIEW)
        ids = list(r.json()["sessions"])
        return ids if len(ids) == 3 else None

    ids = await wait_until_async(listed, 15, what="three acme sessions")
    assert ids == ["acme-1", "acme-2", "acme-<b>3</b>"]
    page = (await http.get("/sessions", params={"prefix": "acme-<"}, headers=VIEW)).text
    assert "acme-&lt;b&gt;3&lt;/b&gt;" in page and "acme-<b>" not in page
    assert "/session?id=acme-%3Cb%3E3%3C%2Fb%3E" in page
    r = await http.get("/api/sessions", params={"prefix": "zzz"}, headers=VIEW)
    assert r.json()["sessions"] == []
    assert (await http.get("/api/sessions?prefix=", headers=VIEW)).status_code == 400


async def test_reshard_moves_a_sessions_letter_index_with_its_letters(
    env: dict[str, str], client: DialogClient
) -> None:
    from worker_procs import run_cli

    from dialog_worker.config import load_settings
    from dialog_worker.store.keys import Topology

    sid = "moved-{1}"
    old = client.keys_for(sid)
    letter = str(
        await client.redis.xadd(old.dlq, {"session_id": sid, "text": "x", "error_kind": "gap"})
    )
    await client.redis.zadd(old.session(sid).letters, {letter: int(letter.split("-")[0])})
    done = run_cli(env, "reshard", "--to", "2", "--yes")
    assert done.returncode == 0, done.stderr
    new = Topology.from_settings(load_settings(environ={**env, "DIALOG_SHARDS": "2"}))
    keys = new.for_session(sid)
    index = await client.redis.zrange(keys.session(sid).letters, 0, -1)
    assert len(index) == 1 and index[0] != letter
    assert await client.redis.xrange(keys.dlq, index[0], index[0])
    assert await client.redis.exists(old.session(sid).letters) == 0
