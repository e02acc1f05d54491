"""The console over HTTP (the app in-process, Redis and workers real): who may sign in, who
may act, CSRF, paging bounds, hostile ids and texts, and the actions with their audit."""

from __future__ import annotations

import html
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.exceptions
from console_support import OPERATOR, VIEWER, basic, console_env, form_token
from markupsafe import escape
from redis_server import wait_until_async
from worker_procs import WorkerPool

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings, load_settings
from dialog_worker.console.auth import Authenticator, NoUsers, Role, User
from dialog_worker.errors import ConfigError
from dialog_worker.store.keys import audit_key

pytestmark = pytest.mark.integration

OP = basic(OPERATOR)
VIEW = basic(VIEWER)
HOSTILE_IDS = [
    "<script>alert(1)</script>",
    "{brace}:state",
    'quote" onmouseover="x',
    "ünïcødé 💬 сессия",
    "a&b=c#frag/../x?y",
    "%7B%7D%25",
]


async def add_letter(
    client: DialogClient, session_id: str, n: int, kind: str = "engine_error", **extra: str
) -> str:
    """A dead letter as the worker writes one (the fields the tools read)."""
    keys = client.keys_for(session_id)
    fields = {
        "session_id": session_id,
        "text": f"message {n}",
        "msg_id": f"m{n}",
        "seq": str(n),
        "error_kind": kind,
        "error": f"failed {n}",
        "attempts": "1",
        "source_stream": keys.stream,
        **extra,
    }
    return str(await client.redis.xadd(keys.dlq, fields))  # type: ignore[arg-type]


def handles_on(page: str) -> list[str]:
    import re

    return re.findall(r'<tr data-handle="([^"]+)"', page)


# -- sign-in and roles ------------------------------------------------------------------------


def test_the_console_refuses_to_start_without_users(env: dict[str, str]) -> None:
    from dialog_worker.console.app import create_app

    with pytest.raises(NoUsers):
        create_app(load_settings(environ=env))
    done = subprocess.run(
        [sys.executable, "-m", "dialog_worker", "console", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "DIALOG_CONSOLE_OPERATORS" in done.stderr


def test_a_short_token_is_refused_without_being_repeated(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={**env, "DIALOG_CONSOLE_OPERATORS": "olga:short-secret"})
    assert "short-secret" not in str(caught.value) and "16" in str(caught.value)


async def test_every_page_needs_a_user(http: httpx.AsyncClient) -> None:
    for path in ("/", "/api/overview", "/session?id=a", "/letters", "/audit"):
        r = await http.get(path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"].startswith("Basic")
    wrong = basic((OPERATOR[0], VIEWER[1]))  # a real token under another user's name
    assert (await http.get("/", headers=wrong)).status_code == 401
    assert (await http.get("/", headers={"authorization": "Basic !!!"})).status_code == 401
    r = await http.get("/", headers={"authorization": f"Bearer {VIEWER[1]}"})
    assert r.status_code == 200 and "vic" in r.text


async def test_pages_forbid_framing_and_inline_scripts(http: httpx.AsyncClient) -> None:
    r = await http.get("/", headers=VIEW)
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert "<script>" not in r.text  # only <script src=...>


async def test_a_viewer_sees_no_action_and_the_server_refuses_one(
    http: httpx.AsyncClient, client: DialogClient, console_settings: Settings
) -> None:
    entry = await add_letter(client, "s1", 1)
    letters = await http.get("/letters", headers=VIEW)
    session = await http.get("/session?id=s1", headers=VIEW)
    for page in (letters.text, session.text):
        assert "0:" + entry in page  # listed...
        assert "form_token" not in page and '<button type="submit" name="action"' not in page
        assert 'id="redrive-go"' not in page
    # A forged POST with an operator's valid form token, sent with the viewer's credentials.
    op_page = await http.get("/letters", headers=OP)
    token = form_token(op_page.text)
    for path, form in (
        ("/letters/action", {"action": "purge", "handle": f"0:{entry}", "count": "1"}),
        ("/session/redrive", {"session_id": "s1", "handle": f"0:{entry}", "count": "1"}),
    ):
        r = await http.post(path, headers=VIEW, data={**form, "reason": "x", "form_token": token})
        assert r.status_code == 403, r.text
    # Even a form token minted for the viewer (the pages never give one) does not make an
    # action theirs: the role is checked by itself.
    own = Authenticator(console_settings).form_token(User(VIEWER[0], Role.VIEWER))
    r = await http.post(
        "/letters/action",
        headers=VIEW,
        data={
            "action": "purge",
            "handle": f"0:{entry}",
            "count": "1",
            "reason": "x",
            "form_token": own,
        },
    )
    assert r.status_code == 403 and "viewers cannot act" in r.text
    assert await client.redis.xlen(client.keys.dlq) == 1
    assert "No actions yet" in (await http.get("/audit", headers=OP)).text


async def test_an_action_without_a_valid_form_token_is_refused(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    entry = await add_letter(client, "s1", 1)
    good = form_token((await http.get("/letters", headers=OP)).text)
    form = {"action": "purge", "handle": f"0:{entry}", "count": "1", "reason": "cleanup"}
    issued, _, mac = good.partition(".")
    for token in ("", "garbage", f"{issued}.{'0' * len(mac)}", f"{int(issued) - 13 * 3600}.{mac}"):
        r = await http.post("/letters/action", headers=OP, data={**form, "form_token": token})
        assert r.status_code == 403, token
    # A valid token from another site's page is refused by its Origin.
    r = await http.post(
        "/letters/action",
        headers={**OP, "origin": "https://evil.example"},
        data={**form, "form_token": good},
    )
    assert r.status_code == 403
    assert await client.redis.xlen(client.keys.dlq) == 1
    r = await http.post(
        "/letters/action",
        headers={**OP, "origin": "http://console.test"},
        data={**form, "form_token": good},
    )
    assert r.status_code == 200 and "1 of 1 listed letters done" in r.text
    assert await client.redis.xlen(client.keys.dlq) == 0


# -- the dead-letter list ---------------------------------------------------------------------


async def test_letter_pages_are_bounded_and_cover_every_letter_once(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    for bad in ("0", "-1", "abc", "1e3", "٣"):
        assert (await http.get(f"/letters?limit={bad}", headers=VIEW)).status_code == 400, bad
    for bad in ("junk", "0:abc", "9:1-0", "{x}"):
        assert (await http.get(f"/letters?after={bad}", headers=VIEW)).status_code == 400, bad
    entries = [await add_letter(client, f"s{i % 3}", i) for i in range(205)]
    r = await http.get("/letters?limit=100000", headers=VIEW)
    assert len(handles_on(r.text)) == 200  # clamped to the largest page
    seen: list[str] = []
    url = "/letters?limit=7"
    while url:
        r = await http.get(url, headers=VIEW)
        assert r.status_code == 200
        page = handles_on(r.text)
        assert len(page) <= 7
        seen += page
        url = _next(r.text)
    assert seen == [f"0:{e}" for e in entries]


def _next(page: str) -> str:
    import re

    match = re.search(r'<a href="([^"]+)" id="next-page"', page)
    return html.unescape(match.group(1)) if match else ""


async def test_letters_filter_by_kind_session_and_age(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    hour_old = await client.redis.xadd(  # an explicit id an hour in the past
        client.keys.dlq,
        {"session_id": "bob", "error_kind": "timeout", "seq": "1"},
        id=f"{int(time.time() * 1000) - 3_600_000}-0",
    )
    old = await add_letter(client, "alice", 1, kind="engine_error")
    new = await add_letter(client, "bob", 2, kind="engine_error")
    by_kind = handles_on((await http.get("/letters?kind=engine_error", headers=VIEW)).text)
    assert by_kind == [f"0:{old}", f"0:{new}"]
    by_session = handles_on((await http.get("/letters?session=bob", headers=VIEW)).text)
    assert len(by_session) == 2 and f"0:{new}" in by_session
    older = handles_on((await http.get("/letters?older_than=30m", headers=VIEW)).text)
    assert older == [f"0:{hour_old}"]
    assert (await http.get("/letters?older_than=soon", headers=VIEW)).status_code == 400


async def test_a_bulk_action_acts_only_on_the_listed_letters_and_needs_a_reason(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    entries = [await add_letter(client, "s1", i) for i in range(3)]
    page = (await http.get("/letters?limit=2", headers=OP)).text
    listed = handles_on(page)
    assert listed == [f"0:{e}" for e in entries[:2]]
    token = form_token(page)
    base: dict[str, Any] = {"action": "purge", "handle": listed, "form_token": token}
    for form, why in (
        ({**base, "count": "2", "reason": "   "}, "a reason is required"),
        ({**base, "count": "3", "reason": "cleanup"}, "the page said 3"),
        ({**base, "action": "explode", "count": "2", "reason": "x"}, "redrive or purge"),
    ):
        r = await http.post("/letters/action", headers=OP, data=form)
        assert r.status_code == 400 and why in r.text
    assert await client.redis.xlen(client.keys.dlq) == 3
    # A letter added after the page was rendered is not touched.
    late = await add_letter(client, "s1", 9)
    r = await http.post(
        "/letters/action", headers=OP, data={**base, "count": "2", "reason": "test noise"}
    )
    assert r.status_code == 200 and "2 of 2 listed letters done" in r.text
    left = handles_on((await http.get("/letters", headers=OP)).text)
    assert left == [f"0:{entries[2]}", f"0:{late}"]
    audit = (await http.get("/audit", headers=VIEW)).text
    assert audit.count("purge_letters") == 2 and "test noise" in audit and "olga" in audit


@pytest.mark.parametrize("action", ["redrive", "purge"])
async def test_a_bulk_action_that_fails_part_way_records_what_it_did_as_its_outcome(
    http: httpx.AsyncClient,
    client: DialogClient,
    console_settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    action: str,
) -> None:
    """Redis fails on the third of four letters (the connection breaks): the first two are
    done for good. The audit stream gets the action's outcome after its `requested` entry,
    `failed`, with what was done (counts and handles) and the error; the operator is told."""
    from dialog_worker.ops import dead_letters

    for i in range(4):
        await add_letter(client, "s1", i)
    name = "resend" if action == "redrive" else "purge"
    real = getattr(dead_letters, name)
    calls = 0

    async def breaks_on_the_third(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return await real(*args, **kwargs)

    monkeypatch.setattr(dead_letters, name, breaks_on_the_third)
    page = (await http.get("/letters", headers=OP)).text
    listed = handles_on(page)
    form = {
        "action": action,
        "handle": listed,
        "count": "4",
        "reason": "clean up",
        "form_token": form_token(page),
    }
    r = await http.post("/letters/action", headers=OP, data=form)
    assert r.status_code == 503 and "2 of 4 listed done" in r.text, r.text
    assert await client.redis.xlen(client.keys.dlq) == 2
    rows = [f for _, f in await client.redis.xrange(audit_key(console_settings))]
    assert [(f["action"], f["outcome"]) for f in rows] == [
        (f"{action}_letters", "requested"),
        (f"{action}_letters", "failed"),
    ]
    requested_id = (await client.redis.xrange(audit_key(console_settings)))[0][0]
    assert rows[1]["ref"] == requested_id and rows[1]["who"] == OPERATOR[0]
    detail = json.loads(rows[1]["detail"])
    assert (detail["done"], detail["handles_done"]) == (2, listed[:2])
    assert "Connection closed by server" in detail["error"]
    audit = (await http.get("/audit", headers=VIEW)).text
    assert "failed" in audit


async def test_a_refused_action_is_audited_as_refused_with_its_reason_and_why(
    http: httpx.AsyncClient, client: DialogClient, console_settings: Settings
) -> None:
    """An action the tool refuses (here a handle that names no dead letter) is a 400 for
    the operator, and the audit keeps both entries: the request, and its outcome `refused`
    with the operator's reason, the error, and the request's id."""
    from dialog_worker.store.keys import audit_key

    await add_letter(client, "s1", 1)
    page = (await http.get("/letters", headers=OP)).text
    form = {
        "action": "redrive",
        "handle": "0:not-a-letter",
        "count": "1",
        "reason": "retry after the outage",
        "form_token": form_token(page),
    }
    r = await http.post("/letters/action", headers=OP, data=form)
    assert r.status_code == 400 and "not a dead-letter handle" in r.text
    rows = await client.redis.xrange(audit_key(console_settings))
    assert [f["outcome"] for _, f in rows] == ["requested", "refused"]
    (asked_id, asked), (_, refused) = rows
    for entry in (asked, refused):
        assert (entry["action"], entry["who"], entry["reason"]) == (
            "redrive_letters",
            "olga",
            "retry after the outage",
        )
    assert refused["ref"] == asked_id
    assert "not a dead-letter handle" in json.loads(refused["detail"])["error"]
    audit = (await http.get("/audit", headers=VIEW)).text
    assert "refused" in audit and "retry after the outage" in audit
    assert await client.redis.xlen(client.keys.dlq) == 1  # nothing done


async def test_audit_pages_show_every_entry_once_newest_first_across_page_boundaries(
    http: httpx.AsyncClient, client: DialogClient, console_settings: Settings
) -> None:
    """Older pages go on from the id the previous page ended at, exclusive: no entry is
    shown twice at a page boundary and none is skipped."""
    import re

    from dialog_worker.console.app import AUDIT_PAGE
    from dialog_worker.store.keys import audit_key

    key = audit_key(console_settings)
    written = [
        str(await client.redis.xadd(key, {"who": "olga", "action": f"a{i}", "outcome": "done"}))
        for i in range(2 * AUDIT_PAGE + 7)
    ]
    shown: list[str] = []
    pages = 0
    url: str | None = "/audit"
    while url is not None:
        page = (await http.get(html.unescape(url), headers=VIEW)).text
        pages += 1
        shown += re.findall(r'<tr data-id="([^"]+)"', page)
        more = re.search(r'<a href="(/audit\?before=[^"]+)">older', page)
        url = more.group(1) if more else None
        assert pages <= 4
    assert shown == written[::-1]
    assert pages == 3


# -- sessions ---------------------------------------------------------------------------------


async def test_hostile_ids_and_texts_are_shown_escaped(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1)
    for sid in HOSTILE_IDS:
        await client.ask(sid, "<img src=x onerror=alert(1)> halo", timeout=30)
        await add_letter(client, sid, 7, error="<b>bold</b><script>alert(2)</script>")
    letters = (await http.get("/letters", headers=VIEW)).text
    for sid in HOSTILE_IDS:
        r = await http.get("/session", params={"id": sid}, headers=VIEW)
        assert r.status_code == 200, sid
        page = r.text
        assert str(escape(sid)) in page
        assert "<script>alert" not in page and "<img src=x" not in page
        assert "&lt;img src=x onerror=alert(1)&gt; halo" in page  # the history shows it
        assert "&lt;script&gt;alert(2)" in page
        assert str(escape(sid)) in letters
    assert "<script>alert" not in letters
    # An id the client would refuse is a 400 with one escaped line, not a 500.
    for bad in ("   ", "x" * 5000, "a\x00b"):
        r = await http.get("/session", params={"id": bad}, headers=VIEW)
        assert r.status_code == 400, bad
    missing = await http.get("/session", params={"id": "nobody-here"}, headers=VIEW)
    assert missing.status_code == 404 and "No such session" in missing.text


async def test_configured_fields_are_redacted(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    workers.start(1)
    await client.ask("card", "halo", timeout=30)
    # A state key of the configured name, at any depth, as an engine might keep one.
    keys = client.keys_for("card")
    state = await client.state("card")
    assert state is not None
    state["memory"] = {**state.get("memory", {}), "card_number": "4111111111111111"}
    import json

    await client.redis.hset(keys.session("card").state, "d", json.dumps(state))
    await add_letter(client, "card", 5, card_number="5500000000000004")
    page = (await http.get("/session?id=card", headers=OP)).text
    assert "4111111111111111" not in page and "[redacted]" in page
    letters = (await http.get("/letters?session=card", headers=OP)).text
    assert "5500000000000004" not in letters


async def test_a_sessions_dead_letters_are_redriven_in_order_and_audited(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool, tmp_path: Path
) -> None:
    flag = tmp_path / "flag"
    flag.write_text("on")
    workers.start(
        1, DIALOG_ENGINE="fault_engine:make", DIALOG_MAX_ATTEMPTS="1", FAULT_FLAG_FILE=str(flag)
    )
    for text in ("flaky one", "flaky two", "flaky three"):
        await client.send("orders", text)
    other = await add_letter(client, "someone-else", 1)

    async def three_letters() -> bool:
        page = (await http.get("/session?id=orders", headers=OP)).text
        return len(handles_on(page)) == 3

    await wait_until_async(three_letters, 30, what="three dead letters")
    page = (await http.get("/session?id=orders", headers=OP)).text
    listed = handles_on(page)
    flag.unlink()
    r = await http.post(
        "/session/redrive",
        headers=OP,
        data={
            "session_id": "orders",
            # listed out of order, plus another session's letter: the server orders by seq
            # and leaves the other alone.
            "handle": [listed[2], listed[0], listed[1], f"0:{other}"],
            "count": "4",
            "reason": "engine fixed",
            "form_token": form_token(page),
        },
    )
    assert r.status_code == 200, r.text
    assert "3 of 4 listed letters done" in r.text and "1 belonged to another session" in r.text

    async def applied() -> list[str] | None:
        state = await client.state("orders")
        history = (state or {}).get("history", [])
        turns = [t["user"] for t in history if str(t.get("msg_id")).startswith("redrive:")]
        return turns if len(turns) == 3 else None

    turns = await wait_until_async(applied, 30, what="the redriven messages applied")
    assert turns == ["flaky one", "flaky two", "flaky three"]
    assert await client.redis.xlen(client.keys.dlq) == 1  # only the other session's
    audit = (await http.get("/audit", headers=VIEW)).text
    assert "redrive_session" in audit and "engine fixed" in audit
    assert "requested" in audit and "done" in audit and "session orders" in audit


async def test_overview_reports_the_queue(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    for i in range(4):
        await client.send(f"s{i}", "halo")
    await add_letter(client, "s1", 1)
    data = (await http.get("/api/overview", headers=VIEW)).json()
    figures = {h["key"]: h["value"] for h in data["headline"]}
    assert figures["stream_length"] == 4 and figures["dlq_length"] == 1
    assert data["workers"] == []
    workers.start(1)

    async def drained() -> dict[str, Any] | None:
        d = (await http.get("/api/overview", headers=VIEW)).json()
        figures = {h["key"]: h["value"] for h in d["headline"]}
        return d if figures["stream_length"] == 0 and d["workers"] else None

    data = await wait_until_async(drained, 30, what="the workers drained the stream")
    assert data["workers"][0]["name"] == "w1" and data["workers"][0]["idle_ms"] < 10_000
    page = (await http.get("/", headers=VIEW)).text
    assert 'data-stat="dlq_length">1<' in page and "w1" in page


async def test_the_overview_shows_which_worker_of_an_idle_pool_waits_for_messages(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    """An idle pool's workers are not handed entries, so their consumers' idle time grows
    while they live: the overview names the one that holds the shard's waiter role."""
    [w] = workers.start(1)
    await client.ask("idle", "halo", timeout=20)

    async def waiting() -> dict[str, Any] | None:
        d = (await http.get("/api/overview", headers=VIEW)).json()
        return d if any(x["waiting"] for x in d["workers"]) else None

    data = await wait_until_async(waiting, 20, what="an idle worker waiting for messages")
    assert [(x["name"], x["waiting"]) for x in data["workers"]] == [(w.name, True)]
    page = (await http.get("/", headers=VIEW)).text
    assert "waiting for messages" in page
    # Its consumer deleted as idle: it is still listed, as waiting.
    await client.redis.xgroup_delconsumer(client.keys.stream, client.keys.group, w.name)
    data = (await http.get("/api/overview", headers=VIEW)).json()
    assert [(x["name"], x["waiting"], x["idle_ms"]) for x in data["workers"]] == [
        (w.name, True, None)
    ]
    assert "waiting for messages" in (await http.get("/", headers=VIEW)).text


async def test_the_overview_shows_the_consumers_of_stopped_and_killed_workers_as_gone(
    http: httpx.AsyncClient, client: DialogClient, workers: WorkerPool
) -> None:
    """Redis keeps a consumer long after its worker stopped (DIALOG_CONSUMER_IDLE_DELETE_S):
    the overview says which consumers' workers are gone, at once after a clean stop, and once
    the presence of one killed (kill -9) has lapsed; the live worker is not marked."""
    from dialog_worker.daemon.presence import PRESENCE_TTL_MS

    live, stopped, killed = workers.start(3)

    async def listed() -> dict[str, Any] | None:
        for i in range(30):  # until each worker was handed a message (its consumer exists)
            await client.send(f"g{i}", "halo")
        d = (await http.get("/api/overview", headers=VIEW)).json()
        return d if {w["name"] for w in d["workers"]} >= {"w1", "w2", "w3"} else None

    data = await wait_until_async(listed, 30, what="three consumers")
    assert not any(w["gone"] for w in data["workers"])
    stopped.terminate()
    killed.kill()
    presence = client.keys.presence(killed.name)
    assert 0 < await client.redis.pttl(presence) <= PRESENCE_TTL_MS  # it lapses by itself
    await client.redis.delete(presence)  # as it would within PRESENCE_TTL_MS

    def gone(d: dict[str, Any]) -> dict[str, bool]:
        return {w["name"]: w["gone"] for w in d["workers"]}

    async def both_gone() -> dict[str, Any] | None:
        # The killed worker may have held the shard's waiter role: it reads as waiting until
        # that lease runs out too (3 s).
        d = (await http.get("/api/overview", headers=VIEW)).json()
        return d if gone(d).get(killed.name) else None

    data = await wait_until_async(both_gone, 20, what="the killed worker shown as gone")
    assert gone(data) == {live.name: False, stopped.name: True, killed.name: True}
    assert data["workers"][0]["name"] == live.name  # the gone ones come last
    page = (await http.get("/", headers=VIEW)).text
    assert page.count('class="gone"') == 2 and page.count("gone: stopped or died") == 2


async def test_the_session_page_reads_a_bounded_number_of_dead_letters(
    http: httpx.AsyncClient, client: DialogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dialog_worker.console import reads

    monkeypatch.setattr(reads, "SESSION_LETTER_SCAN", 5)
    mine = [await add_letter(client, "mine", 1)]
    for i in range(6):
        await add_letter(client, "other", i)
    mine.append(await add_letter(client, "mine", 2))
    page = (await http.get("/session?id=mine", headers=VIEW)).text
    # Only the newest five were read: the older letter of "mine" is not listed, and the page
    # says so and links to the full list.
    assert handles_on(page) == [f"0:{mine[1]}"]
    assert 'id="letters-bound"' in page and "/letters?session=mine" in page
    monkeypatch.setattr(reads, "SESSION_LETTER_SCAN", 100)
    page = (await http.get("/session?id=mine", headers=VIEW)).text
    assert handles_on(page) == [f"0:{e}" for e in mine] and 'id="letters-bound"' not in page


async def test_bytes_that_are_not_text_never_break_a_page(
    http: httpx.AsyncClient, client: DialogClient, console_settings: Settings
) -> None:
    from dialog_worker.store.keys import audit_key

    raw = client.raw
    keys = client.keys_for("bin")
    # A waiting message kept as packed bytes in the session's state hash, a dead letter and an
    # audit entry with bytes that are not UTF-8.
    await raw.hset(keys.session("bin").state, mapping={b"s": b"1", b"q1": b"\xaf\x92\xff\x00"})
    await raw.xadd(keys.dlq, {b"session_id": b"bin", b"text": b"\xff\xfe", b"seq": b"1"})
    await raw.xadd(audit_key(console_settings), {b"who": b"\xff", b"action": b"x"})
    session = await http.get("/session?id=bin", headers=VIEW)
    assert session.status_code == 200 and len(handles_on(session.text)) == 1
    assert "\\xff\\xfe" in session.text
    letters = await http.get("/letters", headers=VIEW)
    assert letters.status_code == 200 and "\\xff\\xfe" in letters.text
    audit = await http.get("/audit", headers=VIEW)
    assert audit.status_code == 200 and "\\xff" in audit.text


async def test_pages_over_two_shards_list_every_letter_once_in_order(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard is read a few letters at a time (the per-page bound made tiny), and a
    filter skips most: the pages still list every matching letter once, oldest first."""
    from dialog_worker.console import reads
    from dialog_worker.console.app import create_app

    monkeypatch.setattr(reads, "LETTER_SCAN_PER_PAGE", 3)
    settings = load_settings(environ={**console_env(env), "DIALOG_SHARDS": "2"})
    async with DialogClient(settings=settings) as sharded:
        expected = []
        for i in range(40):
            shard = sharded.topology.shards[i % 3 % 2]
            kind = "timeout" if i % 4 == 0 else "engine_error"
            entry = await sharded.redis.xadd(
                shard.dlq, {"session_id": f"s{i}", "error_kind": kind, "seq": "1"}
            )
            if kind == "timeout":
                expected.append(f"{shard.shard}:{entry}")
        app = create_app(settings, sharded)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c.test") as c:
            seen: list[str] = []
            url = "/letters?kind=timeout&limit=2"
            for _ in range(100):
                r = await c.get(url, headers=VIEW)
                assert r.status_code == 200
                seen += handles_on(r.text)
                url = _next(r.text)
                if not url:
                    break
    # Every matching letter once, oldest first. Two shards' streams can give entries appended
    # in the same millisecond the same id: such ties may come in either shard's order.
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))
    ids = [tuple(int(n) for n in h.split(":", 1)[1].split("-")) for h in seen]
    assert ids == sorted(ids)


async def test_the_back_link_after_an_action_stays_on_the_console(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    for back in ("//evil.example/x", "/\\evil.example", "https://evil.example", "javascript:x"):
        entry = await add_letter(client, "s1", 1)
        page = (await http.get("/letters", headers=OP)).text
        r = await http.post(
            "/letters/action",
            headers=OP,
            data={
                "action": "purge",
                "handle": f"0:{entry}",
                "count": "1",
                "reason": "r",
                "back": back,
                "form_token": form_token(page),
            },
        )
        assert r.status_code == 200 and 'id="back"' in r.text
        assert '<a href="/" id="back">' in r.text, back


async def test_the_json_endpoints_read_what_the_pages_show(
    http: httpx.AsyncClient, client: DialogClient
) -> None:
    sid = HOSTILE_IDS[0]
    entries = [await add_letter(client, sid, i) for i in range(3)]
    assert (await http.get("/api/session", params={"id": sid})).status_code == 401
    r = await http.get("/api/session", params={"id": sid}, headers=VIEW)
    assert r.status_code == 200
    data = r.json()
    assert data["session_id"] == sid
    assert [d["handle"] for d in data["dead_letters"]] == [f"0:{e}" for e in entries]
    first = (await http.get("/api/letters?limit=2", headers=VIEW)).json()
    assert [row["handle"] for row in first["letters"]] == [f"0:{e}" for e in entries[:2]]
    rest = await http.get("/api/letters", params={"after": first["next_after"]}, headers=VIEW)
    assert [row["handle"] for row in rest.json()["letters"]] == [f"0:{entries[2]}"]
    assert rest.json()["next_after"] is None
    bad = await http.get("/api/letters?limit=0", headers=VIEW)
    assert bad.status_code == 400 and "limit" in bad.json()["error"]
    missing = await http.get("/api/session?id=nobody", headers=VIEW)
    assert missing.status_code == 404 and missing.json()["found"] is False
