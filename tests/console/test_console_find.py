"""Finding a message by its msg_id in the console (one GET per shard of the index intake
keeps, never a scan), against a real redis-server and real workers."""

from __future__ import annotations

import httpx
import pytest
from console_support import VIEWER, basic
from redis_server import wait_until_async
from worker_procs import WorkerPool

from dialog_worker.client import DialogClient

pytestmark = pytest.mark.integration

VIEW = basic(VIEWER)


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
