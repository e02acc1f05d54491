"""The dead-letter list filtered by session, over HTTP (the app in-process, Redis real): it
reads the session's index of letters, not the shard's stream, for every letter the index
covers, and still finds older letters by reading the stream, page by page."""

from __future__ import annotations

import html
import re
import time

import httpx
import pytest
from console_support import VIEWER, basic
from worker_procs import WorkerPool

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.console import reads

pytestmark = pytest.mark.integration

VIEW = basic(VIEWER)


async def letter(client: DialogClient, session_id: str, n: int, *, indexed: bool) -> str:
    """A dead letter; `indexed` ones are indexed as the scripts index them
    (lua/_common.lua index_letter)."""
    keys = client.keys_for(session_id)
    fields = {"session_id": session_id, "msg_id": f"m{n}", "seq": str(n), "text": f"t{n}"}
    fields["error_kind"] = "timeout" if n % 2 else "engine_error"
    entry_id = str(await client.redis.xadd(keys.dlq, fields))  # type: ignore[arg-type]
    if indexed:
        await client.redis.set(keys.letters_since, entry_id, nx=True)
        index = keys.session(session_id).letters
        await client.redis.zadd(index, {entry_id: int(entry_id.split("-")[0])})
    return f"{keys.shard}:{entry_id}"


def listed(page: str) -> tuple[list[str], str, int]:
    handles = re.findall(r'<tr data-handle="([^"]+)"', page)
    nxt = re.search(r'<a href="([^"]+)" id="next-page"', page)
    read = re.search(r"Read (\d+) letters for this page", page)
    assert read is not None
    return handles, html.unescape(nxt.group(1)) if nxt else "", int(read.group(1))


async def test_letters_of_a_session_come_from_its_index_and_older_ones_from_the_stream(
    http: httpx.AsyncClient, client: DialogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "LETTER_SCAN_PER_PAGE", 10)
    # Two letters written before the index existed, then letters of other sessions far past
    # the per-page bound, with the session's indexed letters among and after them.
    mine = [await letter(client, "bob", n, indexed=False) for n in (1, 2)]
    for n in range(30):
        await letter(client, "other", 100 + n, indexed=True)
        if n in (5, 25):
            mine.append(await letter(client, "bob", n + 3, indexed=True))
    mine.append(await letter(client, "bob", 40, indexed=True))

    handles, nxt, read = listed((await http.get("/letters?session=bob", headers=VIEW)).text)
    assert handles == mine and nxt == ""
    # The older part of the stream (up to the first indexed letter) and the three indexed
    # letters were read; the 30 letters of "other" were not.
    assert read <= 3 + 3

    seen: list[str] = []
    url = "/letters?session=bob&limit=2"
    while url:
        handles, url, _ = listed((await http.get(url, headers=VIEW)).text)
        assert 0 < len(handles) <= 2
        seen += handles
    assert seen == mine

    by_kind = (await http.get("/letters?session=bob&kind=engine_error", headers=VIEW)).text
    assert listed(by_kind)[0] == mine[1:]  # the even seqs
    data = (await http.get("/api/letters?session=bob&limit=3", headers=VIEW)).json()
    assert [r["handle"] for r in data["letters"]] == mine[:3] and data["next_after"] == mine[2]


async def test_a_full_index_leaves_its_trimmed_letters_to_the_stream(
    http: httpx.AsyncClient, client: DialogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "LETTERS_KEPT", 2)
    mine = [await letter(client, "bob", n, indexed=True) for n in (2, 4, 6)]
    # The index kept the newest two: the first letter is found by reading the stream.
    index = client.keys_for("bob").session("bob").letters
    await client.redis.zremrangebyrank(index, 0, 0)
    handles, _, _ = listed((await http.get("/letters?session=bob", headers=VIEW)).text)
    assert handles == mine


async def test_a_session_page_of_letters_keeps_the_age_filter(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    keys = client.keys_for("bob")
    hour_old = await client.redis.xadd(
        keys.dlq,
        {"session_id": "bob", "error_kind": "timeout", "seq": "1"},
        id=f"{int(time.time() * 1000) - 3_600_000}-0",
    )
    await client.redis.set(keys.letters_since, hour_old)
    await client.redis.zadd(keys.session("bob").letters, {hour_old: int(hour_old.split("-")[0])})
    fresh = await letter(client, "bob", 2, indexed=True)
    older = (await http.get("/letters?session=bob&older_than=30m", headers=VIEW)).text
    assert listed(older)[0] == [f"{keys.shard}:{hour_old}"]
    every = (await http.get("/letters?session=bob", headers=VIEW)).text
    assert listed(every)[0] == [f"{keys.shard}:{hour_old}", fresh]


async def test_the_session_page_shows_its_timers_escaped(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    from markupsafe import escape
    from redis_server import wait_until_async

    workers.start(1)
    sid = "<script>alert(1)</script>"
    due = time.time() + 3600
    await client.send(
        sid,
        "<img src=x onerror=alert(2)> wake up",
        msg_id="<b>nudge</b>",
        meta={"card_number": "4111111111111111", "channel": "<i>web</i>"},
        deliver_at=due,
    )
    timers = client.keys_for(sid).session(sid).timers
    await wait_until_async(lambda: client.redis.hexists(timers, "t:msg:<b>nudge</b>"), 20)
    # One timer written by hand, not in the scripts' format: listed, not breaking the page.
    await client.redis.hset(timers, "t:<u>odd</u>", "not msgpack")

    r = await http.get("/session", params={"id": sid}, headers=VIEW)
    assert r.status_code == 200
    page = r.text
    assert "<script>alert" not in page and "<img src=x" not in page and "<b>" not in page
    rows = re.findall(r'<tr data-timer="([^"]+)">(.*?)</tr>', page, re.S)
    assert [html.unescape(name) for name, _ in rows] == ["msg:<b>nudge</b>", "<u>odd</u>"]
    nudge, odd = rows[0][1], rows[1][1]
    assert str(escape("<img src=x onerror=alert(2)> wake up")) in nudge
    assert time.strftime("%Y-%m-%d %H:%M", time.gmtime(due)) in nudge
    assert str(escape("channel=<i>web</i>")) in nudge
    assert "4111111111111111" not in page and "card_number=[redacted]" in nudge
    assert "unreadable" in odd

    data = (await http.get("/api/session", params={"id": sid}, headers=VIEW)).json()
    assert [t["name"] for t in data["timers"]] == ["msg:<b>nudge</b>", "<u>odd</u>"]
    assert abs(data["timers"][0]["due_ms"] - due * 1000) <= 1 and data["timers_complete"]
