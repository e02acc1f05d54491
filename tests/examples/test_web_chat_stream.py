"""examples/web_chat_stream.py in a real browser (headless Chromium from the distribution,
driven by Selenium): the page sends, the answer grows, the connection is cut mid-answer on
the server's side, the browser reconnects by itself, and the text shown ends as the committed
reply, no piece twice."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from examples_path import with_examples
from redis_server import free_port, wait_for, wait_until
from tcp_proxy import TcpProxy
from worker_procs import WorkerPool, run_cli

from dialog_worker import DialogClient

pytestmark = pytest.mark.integration

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER_PATH", "/usr/bin/chromedriver")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "web_chat_stream.py"


def _browser(network_log: bool = False) -> Any:
    """Headless Chromium; with ``network_log`` it records the requests it sends (their headers
    included: `_requests`)."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip("Chromium missing: apt-get install chromium chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium missing: pip install -e '.[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    if network_log:
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


# The example runs with a server token and a signing key of its own: the page must never see
# the first, and the tokens it uses must be signed with the second.
SERVER_TOKEN = "server-token-for-servers-only-0123456789"
SIGNING_KEY = "k" * 40
# Everything the page does with its session, and nothing of another session.
PAGE_ACTIONS = ("send", "stream", "cancel", "events", "pending", "resume")


@pytest.fixture
def chat_page(env: dict[str, str], tmp_path: Path) -> Iterator[TcpProxy]:
    """The example on its own port, reached through a proxy the test can cut."""
    with _serve_example(env, tmp_path) as proxy:
        yield proxy


@contextlib.contextmanager
def _serve_example(env: dict[str, str], tmp_path: Path, **extra_env: str) -> Iterator[TcpProxy]:
    port = free_port()
    log = (tmp_path / "web_chat.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE)],
        env={
            **with_examples(env),
            "WEB_CHAT_PORT": str(port),
            "DIALOG_HTTP_TOKEN": SERVER_TOKEN,
            "DIALOG_HTTP_SIGNING_KEY": SIGNING_KEY,
            **extra_env,
        },
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    proxy = TcpProxy(port)
    try:
        wait_until(lambda: _up(port, proc), 20, what="web_chat_stream up")
        yield proxy
    finally:
        proxy.close()
        proc.terminate()
        proc.wait(10)
        log.close()


def _up(port: int, proc: subprocess.Popen[bytes]) -> bool:
    import urllib.request

    assert proc.poll() is None, "the example exited"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
            return True
    except OSError:
        return False


def test_the_page_streams_an_answer_across_a_dropped_connection_exactly_once(
    chat_page: TcpProxy, workers: WorkerPool
):
    browser = _browser()
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    reply = "".join(f"w{i} " for i in range(80))
    try:
        browser.get(f"http://127.0.0.1:{chat_page.port}/")
        box = browser.find_element("id", "text")
        box.send_keys("80 40")  # 80 words, one every 40 ms: about 3 s
        browser.find_element("id", "send").click()

        def bubble_text() -> str:
            return str(
                browser.execute_script(
                    "const b = document.querySelector('.bot .text'); return b ? b.textContent : '';"
                )
            )

        wait_until(lambda: len(bubble_text()) > 0, 20, what="the answer starts")
        grew_from = bubble_text()
        wait_until(lambda: len(bubble_text()) > len(grew_from), 10, what="the answer grows")
        assert bubble_text() != reply, "still mid-answer when the connection is cut"
        assert chat_page.drop_all() > 0
        wait_until(
            lambda: (
                browser.execute_script("return document.querySelector('.bot').dataset.state")
                == "done"
            ),
            30,
            what="the answer ends after the browser reconnected",
        )
        shown: list[str] = browser.execute_script("return document.querySelector('.bot').shown")
        drops = browser.execute_script("return document.querySelector('.bot').dataset.drops")
    finally:
        browser.quit()
    assert shown[-1] == reply
    assert int(drops or 0) >= 1, "the browser saw the connection drop"
    # Every text it ever showed was the start of the reply: no piece twice, none lost.
    assert all(reply.startswith(text) for text in shown), [
        t for t in shown if not reply.startswith(t)
    ]
    assert len(shown) >= 3, "the answer arrived in pieces"


def test_the_stop_button_ends_the_answer_cancelled_keeping_what_was_shown(
    chat_page: TcpProxy, workers: WorkerPool, env: dict[str, str]
):
    browser = _browser()
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    reply = "".join(f"w{i} " for i in range(300))

    def bot(expr: str) -> Any:
        return browser.execute_script(f"const b = document.querySelector('.bot'); return {expr};")

    try:
        browser.get(f"http://127.0.0.1:{chat_page.port}/")
        stop = browser.find_element("id", "stop")
        assert not stop.is_enabled(), "nothing to stop before a message is sent"
        browser.find_element("id", "text").send_keys("300 40")  # about 12 s of answer
        browser.find_element("id", "send").click()
        answer = "b ? b.querySelector('.text').textContent : ''"
        wait_until(lambda: len(bot(answer)) > 0, 20, what="the answer starts")
        assert stop.is_enabled()
        stop.click()
        wait_until(lambda: bot("b.dataset.state") == "done", 10, what="the answer ends")
        outcome, cancel, text = (
            bot("b.dataset.outcome"),
            bot("b.dataset.cancel"),
            bot("b.querySelector('.text').textContent"),
        )
        shown_before_end: list[str] = bot("b.shown.slice(0, -1)")
        stop_enabled = stop.is_enabled()
        marker = bot("getComputedStyle(b.querySelector('.text'), '::after').content")
    finally:
        browser.quit()
    assert (outcome, cancel) == ("cancelled", "cancelled")
    assert "stopped" in marker, marker  # the page shows it was stopped
    assert not stop_enabled
    # The page keeps the text it showed (the end's text is exactly what streamed), well short
    # of the full answer.
    assert text == shown_before_end[-1]
    assert 0 < len(text) < len(reply) and reply.startswith(text)
    state = _state(env, "cancelled")
    assert state is not None and state["bot"] == text


def _state(env: dict[str, str], flag: str) -> dict[str, Any] | None:
    """The history turn marked ``flag`` of the page's (only) session."""
    import redis

    r = redis.Redis.from_url(env["REDIS_URL"])
    for key in r.scan_iter("*"):
        if r.type(key) == b"hash" and r.hexists(key, "d"):
            doc = json.loads(r.hget(key, "d") or b"{}")
            for turn in doc.get("history", []) if isinstance(doc, dict) else []:
                if isinstance(turn, dict) and turn.get(flag) is True:
                    return turn
    return None


def test_chromium_is_driven_headless_in_time():
    """A guard for CI: the browser starts within a bounded time (or the test above skips)."""
    started = time.monotonic()
    browser = _browser()
    try:
        browser.get("data:text/html,<p id=x>ok</p>")
        assert browser.find_element("id", "x").text == "ok"
    finally:
        browser.quit()
    assert time.monotonic() - started < 60


async def test_the_five_minute_demo_engine_types_its_answer_word_by_word(
    chat_page: TcpProxy, workers: WorkerPool, env: dict[str, str]
):
    """docs/http.md's first steps, as written: the Assistant engine behind the example page
    answers any text but a refund as Typist does, word by word."""
    import httpx

    workers.start(1, **with_examples(env), DIALOG_ENGINE="web_chat_stream:Assistant")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{chat_page.port}", timeout=30) as http:
        page = await http.get("/")
        assert page.status_code == 200 and "EventSource" in page.text
        grant = (await http.post("/session-token")).json()
        auth = {"Authorization": f"Bearer {grant['token']}"}
        sent = await http.post(
            f"/sessions/{grant['session_id']}/messages", json={"text": "hello there"}, headers=auth
        )
        assert sent.status_code == 202
        kinds, deltas, end = [], "", None
        async with http.stream("GET", sent.json()["stream"], headers=auth) as response:
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    kinds.append(line[7:])
                elif line.startswith("data: ") and kinds[-1] == "delta":
                    deltas += json.loads(line[6:])["text"]
                elif line.startswith("data: ") and kinds[-1] == "end":
                    end = json.loads(line[6:])["text"]
                    break
    assert end == deltas == "You said: hello there"
    assert kinds.count("delta") >= 2


# ---------------------------------------------------------------------------------------------
# The page as a person uses it: its own session only, Stop, what the server starts, a reload.

TURNS_JS = """return [...document.querySelectorAll('.turn')].map((t) => {
  const u = t.querySelector('.user'), b = t.querySelector('.bot');
  return {user: u ? u.textContent : null, bot: b.querySelector('.text').textContent,
          state: b.dataset.state,
          outcome: b.dataset.outcome || null, msg_id: b.dataset.msgId,
          cancel: b.dataset.cancel || null, shown: b.shown, visible: b.offsetParent !== null};
});"""


def _turns(browser: Any) -> list[dict[str, Any]]:
    return list(browser.execute_script(TURNS_JS))


def _send(browser: Any, text: str) -> None:
    browser.find_element("id", "text").send_keys(text)
    browser.find_element("id", "send").click()


def _open_chat(browser: Any, chat_page: TcpProxy) -> str:
    """Loads the page; returns its session id once it holds a token and follows its events."""
    browser.get(f"http://127.0.0.1:{chat_page.port}/")
    wait_until(
        lambda: browser.execute_script(
            "return chat.feed && chat.feed.source.readyState === EventSource.OPEN"
        ),
        20,
        what="the page follows its session",
    )
    return str(browser.execute_script("return chat.session"))


async def test_the_page_gets_a_token_for_its_own_session_only_never_the_server_token(
    chat_page: TcpProxy,
):
    """What the example's server hands a browser opens that browser's session, for the page's
    actions, and nothing else; the gateway refuses everything without a token."""
    import httpx

    from dialog_worker.client import session_tokens

    base = f"http://127.0.0.1:{chat_page.port}"
    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as alice,
        httpx.AsyncClient(base_url=base, timeout=30) as bob,
    ):
        page = await alice.get("/")
        assert SERVER_TOKEN not in page.text and SIGNING_KEY not in page.text
        first = await alice.post("/session-token")
        assert first.headers["cache-control"] == "no-store"
        assert "httponly" in first.headers["set-cookie"].lower()
        grant = first.json()
        again = (await alice.post("/session-token")).json()  # same browser: same session
        other = (await bob.post("/session-token")).json()  # another browser: its own
        assert again["session_id"] == grant["session_id"] != other["session_id"]
        for given in (grant, other):
            assert SERVER_TOKEN not in json.dumps(given)
            checked = session_tokens.verify(SIGNING_KEY, given["token"])
            assert checked.session_id == given["session_id"]
            assert set(checked.actions) == set(PAGE_ACTIONS)

        def auth(token: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {token}"}

        mine, theirs = grant["session_id"], other["session_id"]
        body = {"text": "halo"}
        assert (await alice.post(f"/sessions/{theirs}/messages", json=body)).status_code == 401
        refused = await alice.post(
            f"/sessions/{theirs}/messages", json=body, headers=auth(grant["token"])
        )
        assert refused.status_code == 403
        sent = await alice.post(
            f"/sessions/{mine}/messages", json=body, headers=auth(grant["token"])
        )
        assert sent.status_code == 202
        # The server token still opens any session, for the application's own servers.
        served = await bob.post(f"/sessions/{mine}/messages", json=body, headers=auth(SERVER_TOKEN))
        assert served.status_code == 202


def test_stop_after_a_double_text_stops_the_answer_being_written_not_the_queued_one(
    chat_page: TcpProxy, workers: WorkerPool
):
    from dialog_worker.client import session_tokens

    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    browser = _browser()
    try:
        session = _open_chat(browser, chat_page)
        _send(browser, "200 40")  # about 8 s of answer
        _send(browser, "5 40")  # double text: waits for its turn
        wait_until(lambda: len(_turns(browser)) == 2, 10, what="both messages on the page")
        wait_until(
            lambda: (
                _turns(browser)[0]["state"] == "streaming"
                and browser.execute_script(
                    "return chat.answers.get(arguments[0]).feed !== null",
                    _turns(browser)[1]["msg_id"],
                )
            ),
            20,
            what="the first answer is being written and the second one was sent",
        )
        queued = _turns(browser)[1]
        assert queued["state"] == "waiting" and not queued["visible"], "no second typing mark"
        typing = browser.execute_script(
            "return [document.getElementById('status').textContent,"
            " getComputedStyle(document.querySelector('.bot .text'), '::after').content]"
        )
        stop = browser.find_element("id", "stop")
        assert stop.is_enabled()
        stop.click()
        wait_until(lambda: _turns(browser)[1]["state"] == "done", 20, what="the second answer")
        first, second = _turns(browser)
        trace: list[str] = browser.execute_script("return chat.trace")
        token = str(browser.execute_script("return chat.token"))
        storage = str(browser.execute_script("return JSON.stringify(localStorage)"))
        urls = str(
            browser.execute_script("return performance.getEntries().map((e) => e.name).join(' ')")
        )
        source = browser.page_source
        cookies = json.dumps(browser.get_cookies())
    finally:
        browser.quit()
    reply = "".join(f"w{i} " for i in range(200))
    assert typing[0] == "typing…" and "▍" in typing[1], typing  # while it was being written
    assert (first["outcome"], first["cancel"]) == ("cancelled", "cancelled")
    assert 0 < len(first["bot"]) < len(reply) and reply.startswith(first["bot"])
    assert (second["outcome"], second["bot"], second["cancel"]) == (
        "applied",
        "w0 w1 w2 w3 w4 ",
        None,
    )
    # Stop went to the first answer and disabled itself at once; it came back only for the
    # next answer, once the first had ended.
    clicked = trace.index(f"stop {first['msg_id']}")
    assert trace[clicked + 1] == "stop disabled", trace
    ended = trace.index(f"end {first['msg_id']} cancelled")
    assert "stop enabled" not in trace[clicked:ended], trace
    assert f"stop {second['msg_id']}" not in trace
    # The page holds a token for its own session only; the server token is nowhere in it.
    assert session_tokens.verify(SIGNING_KEY, token).session_id == session
    for seen in (source, storage, urls, cookies):
        assert SERVER_TOKEN not in seen and SIGNING_KEY not in seen


@pytest.mark.parametrize(
    ("policy", "texts", "ended", "marker"),
    [
        ("interrupt", ["200 40", "3 5"], ["cancelled", "applied"], "interrupted by your next"),
        ("coalesce", ["60 40", "3 5", "4 5"], ["applied", "superseded", "applied"], "replaced by"),
    ],
)
def test_an_answer_your_next_message_ended_says_so_instead_of_stopped(
    env: dict[str, str],
    tmp_path: Path,
    workers: WorkerPool,
    policy: str,
    texts: list[str],
    ended: list[str],
    marker: str,
):
    """Under DIALOG_MULTITASK=interrupt the next message cuts the answer being written short;
    under coalesce it takes the place of one not started. Neither was stopped by the person:
    the page says which it was, and nothing else is marked."""
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords", DIALOG_MULTITASK=policy)
    browser = _browser()
    try:
        with _serve_example(env, tmp_path) as page:
            _open_chat(browser, page)
            _send(browser, texts[0])
            wait_until(
                lambda: _turns(browser)[0]["state"] == "streaming", 20, what="the first answer"
            )
            for text in texts[1:]:
                _send(browser, text)
            wait_until(
                lambda: [t["state"] for t in _turns(browser)] == ["done"] * len(texts),
                30,
                what="every answer ends",
            )
            turns = _turns(browser)
            markers = browser.execute_script(
                "return [...document.querySelectorAll('.bot .text')].map("
                "(t) => getComputedStyle(t, '::after').content)"
            )
    finally:
        browser.quit()
    assert [t["outcome"] for t in turns] == ended
    early = [i for i, outcome in enumerate(ended) if outcome != "applied"]
    assert [i for i, m in enumerate(markers) if m not in ("none", "normal")] == early, markers
    assert all(marker in markers[i] and "stopped" not in markers[i] for i in early), markers


def test_messages_the_server_starts_appear_on_the_page(
    chat_page: TcpProxy, workers: WorkerPool, env: dict[str, str]
):
    """A timer's nudge (no user text: the engine sent it) and a message the application sent
    to be delivered later show up by themselves, through the session's events."""
    workers.start(1, DIALOG_ENGINE="timer_engines:Timers")
    browser = _browser()
    try:
        session = _open_chat(browser, chat_page)
        _send(browser, "remind 1 nudge are you still there?")
        wait_until(
            lambda: len(_turns(browser)) == 2,
            10,  # a second and a half
            what="the timer's message, a second after the answer",
        )
        later = run_cli(
            env, "send", session, "your order shipped", "--deliver-at", str(time.time() + 1)
        )
        assert later.returncode == 0, later.stderr
        wait_until(lambda: len(_turns(browser)) == 3, 10, what="the delivered message")
        turns = _turns(browser)
    finally:
        browser.quit()
    shown = [(t["user"], t["bot"], t["outcome"], t["visible"]) for t in turns]
    assert shown[:2] == [
        (
            "remind 1 nudge are you still there?",
            "ok remind 1 nudge are you still there?",
            "applied",
            True,
        ),
        (None, "fired nudge: are you still there?", "applied", True),
    ]
    # The engine answers a message that waited for its time as it does a timer's; one whose
    # time had come by the time it was sent (a slow machine), as any other message.
    later_id = turns[2]["msg_id"]
    answers = {f"fired msg:{later_id}: your order shipped", "ok your order shipped"}
    assert shown[2][0] == "your order shipped" and shown[2][1] in answers, shown[2]
    assert shown[2][2:] == ("applied", True)


def test_a_reload_mid_answer_shows_the_conversation_and_resumes_the_answer(
    chat_page: TcpProxy, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    reply = "".join(f"w{i} " for i in range(150))
    browser = _browser()
    try:
        session = _open_chat(browser, chat_page)
        _send(browser, "3 0")
        wait_until(lambda: _turns(browser)[0]["state"] == "done", 20, what="the first answer")
        _send(browser, "150 40")  # about 6 s of answer
        wait_until(
            lambda: len(_turns(browser)) == 2 and _turns(browser)[1]["bot"],
            20,
            what="the second answer is being written",
        )
        before = _turns(browser)[1]
        browser.refresh()
        assert _open_chat(browser, chat_page) == session
        wait_until(
            lambda: len(_turns(browser)) == 2 and _turns(browser)[0]["state"] == "done",
            20,
            what="the conversation after the reload",
        )
        resumed = _turns(browser)[1]
        wait_until(lambda: _turns(browser)[1]["state"] == "done", 30, what="the answer ends")
        turns = _turns(browser)
    finally:
        browser.quit()
    assert [(t["user"], t["bot"], t["outcome"]) for t in turns] == [
        ("3 0", "w0 w1 w2 ", "applied"),
        ("150 40", reply, "applied"),
    ]
    assert turns[1]["msg_id"] == before["msg_id"]
    assert resumed["user"] == "150 40" and resumed["state"] in ("waiting", "streaming")
    # After the reload the answer went on growing from the start, never a piece twice, and
    # was seen mid-answer (not only its end).
    shown = turns[1]["shown"]
    assert all(reply.startswith(text) for text in shown), shown
    assert any(0 < len(text) < len(reply) for text in shown), "resumed mid-answer"


def test_the_page_fits_a_narrow_phone_screen(chat_page: TcpProxy, workers: WorkerPool):
    workers.start(1, DIALOG_ENGINE="timer_engines:Timers")
    browser = _browser()
    try:
        browser.set_window_size(360, 740)
        _open_chat(browser, chat_page)
        _send(browser, "x" * 300)  # one long word: it must wrap, not widen the page
        wait_until(lambda: _turns(browser)[0]["state"] == "done", 20, what="the answer")
        layout = browser.execute_script(
            """const r = (id) => document.getElementById(id).getBoundingClientRect();
            const bubbles = [...document.querySelectorAll('.bubble')].map(
              (b) => b.getBoundingClientRect().right);
            return {width: window.innerWidth, height: window.innerHeight,
                    scroll: document.documentElement.scrollWidth,
                    text: r('text'), send: r('send'), stop: r('stop'), bubbles};"""
        )
    finally:
        browser.quit()
    width = layout["width"]
    assert width <= 400, layout
    assert layout["scroll"] <= width, "nothing wider than the screen"
    for control in ("text", "send", "stop"):
        box = layout[control]
        assert 0 <= box["left"] and box["right"] <= width and box["bottom"] <= layout["height"]
    assert layout["text"]["width"] > width / 3, "the input keeps most of the row"
    assert layout["bubbles"] and max(layout["bubbles"]) <= width


# ---------------------------------------------------------------------------------------------
# An agent's answer: tool progress, a question with Approve / Reject, the trace of a message.

BUBBLE_JS = """const b = document.querySelector('.bot');
return {text: b.querySelector('.text').textContent, state: b.dataset.state,
        outcome: b.dataset.outcome || null, msg_id: b.dataset.msgId, shown: b.shown,
        tools: [...b.querySelectorAll('.tool')].map((t) => t.textContent),
        prompts: [...b.querySelectorAll('.prompt')].map((p) => ({
          id: p.dataset.interruptId, question: p.querySelector('.question').textContent,
          enabled: [...p.querySelectorAll('button')].map((x) => !x.disabled),
          note: p.querySelector('.note').textContent, visible: p.offsetParent !== null})),
        user: [...document.querySelectorAll('.user')].map((u) => u.textContent),
        status: document.getElementById('status').textContent};"""


def _bubble(browser: Any) -> dict[str, Any]:
    """The (only) answer on the page: its text, state, tool lines and prompts."""
    return dict(browser.execute_script(BUBBLE_JS))


def _asking(browser: Any, question: str) -> bool:
    """Whether the page shows ``question`` once, visible, both buttons enabled, under the
    tool's status line."""
    if browser.execute_script("return document.querySelector('.bot') === null"):
        return False
    shown = _bubble(browser)
    return shown["tools"] == ["refund: waiting for approval"] and [
        (p["question"], p["enabled"], p["visible"]) for p in shown["prompts"]
    ] == [(question, [True, True], True)]


def _replies(env: dict[str, str], msg_id: str) -> list[str]:
    """The outcomes of the reply events of ``msg_id``, in order."""
    import redis

    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    return [f["outcome"] for _, f in r.xrange("dialog-replies") if f.get("msg_id") == msg_id]


def test_an_approval_prompt_survives_reloads_and_its_answer_completes_once(
    chat_page: TcpProxy, workers: WorkerPool, env: dict[str, str], tmp_path: Path
):
    """ "refund 20" to the example's Assistant: the tool's progress and the question show in
    the answer's bubble; reloaded (and reloaded again by a page that remembers nothing, as on
    another device) the page still asks; Approve resumes the step once, the answer streams in
    and completes once, and the refund is sent once."""
    ledger = tmp_path / "refunds.jsonl"
    workers.start(
        1,
        **with_examples(env),
        DIALOG_ENGINE="web_chat_stream:Assistant",
        WEB_CHAT_REFUNDS_FILE=str(ledger),
    )
    question = "Send a refund of 20?"
    browser = _browser()
    try:
        session = _open_chat(browser, chat_page)
        _send(browser, "refund 20")
        # Each of these shows within a second or two.
        wait_until(lambda: _asking(browser, question), 10, what="the question and the tool")
        asked = _bubble(browser)
        browser.refresh()
        assert _open_chat(browser, chat_page) == session
        wait_until(lambda: _asking(browser, question), 10, what="the question after a reload")
        reloaded = _bubble(browser)
        # A page that remembers none of its answers (another device, cleared storage) learns
        # of the question from the gateway (GET /pending).
        browser.execute_script("localStorage.clear()")
        browser.refresh()
        assert _open_chat(browser, chat_page) == session
        wait_until(lambda: _asking(browser, question), 10, what="the question, nothing kept")
        browser.find_element("css selector", ".prompt .approve").click()
        clicked = _bubble(browser)
        wait_until(lambda: _bubble(browser)["state"] == "done", 30, what="the answer")
        # The turn brings the message's text, which the page that kept nothing did not know.
        wait_until(lambda: _bubble(browser)["user"] == ["refund 20"], 20, what="the user's text")
        done = _bubble(browser)
        trace: list[str] = browser.execute_script("return chat.trace")
    finally:
        browser.quit()
    msg_id = asked["msg_id"]
    assert (asked["state"], asked["text"]) == ("awaiting", "")
    assert asked["status"] == "waiting for your answer"
    assert (reloaded["msg_id"], reloaded["state"], reloaded["user"]) == (
        msg_id,
        "awaiting",
        ["refund 20"],
    )
    [prompt] = clicked["prompts"]
    assert prompt["id"] == f"{msg_id}:1:1"  # <msg_id>:<seq>:<n>
    assert prompt["enabled"] == [False, False], "disabled at once by the click"
    [refund] = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert (refund["msg_id"], refund["amount"]) == (msg_id, 20)
    final = f"Done: refund {refund['refund_id']} of 20 is on its way."
    assert (done["msg_id"], done["text"], done["outcome"]) == (msg_id, final, "applied")
    assert done["tools"] == ["refund: done"]
    assert [(p["note"], p["enabled"]) for p in done["prompts"]] == [("Approved", [False, False])]
    # It streamed in after the approval (pieces, each the start of the answer), and ended once.
    assert all(final.startswith(text) for text in done["shown"]), done["shown"]
    assert any(0 < len(text) < len(final) for text in done["shown"]), done["shown"]
    assert trace.count(f"end {msg_id} applied") == 1
    assert trace.count(f"resume {prompt['id']} true") == 1
    assert _replies(env, msg_id) == ["awaiting", "applied"]


async def test_the_assistant_sends_no_refund_when_the_person_declines(
    workers: WorkerPool, client: DialogClient, env: dict[str, str], tmp_path: Path
):
    import redis

    ledger = tmp_path / "refunds.jsonl"
    workers.start(
        1,
        **with_examples(env),
        DIALOG_ENGINE="web_chat_stream:Assistant",
        WEB_CHAT_REFUNDS_FILE=str(ledger),
    )
    asked = await client.ask("declines", "refund 7", timeout=20)
    assert (asked.outcome, asked.payload) == ("awaiting", {"question": "Send a refund of 7?"})
    assert asked.interrupt_id is not None
    assert (await client.resume("declines", asked.interrupt_id, False)).status == "resumed"
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)

    def applied() -> list[str]:
        return [
            f["reply"]
            for _, f in r.xrange("dialog-replies")
            if f.get("msg_id") == asked.msg_id and f.get("outcome") == "applied"
        ]

    assert await wait_for(applied, 20) == ["Okay, no refund was sent."]
    assert not ledger.exists(), "no refund without an approval"


def _requests(browser: Any) -> list[dict[str, Any]]:
    """The requests the browser sent since the last call (its performance log)."""
    sent = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            sent.append(message["params"]["request"])
    return sent


def _of(requests: list[dict[str, Any]], method: str, path: str) -> list[dict[str, Any]]:
    """The requests of one method and URL path."""
    import urllib.parse

    return [
        r
        for r in requests
        if r["method"] == method and urllib.parse.urlsplit(r["url"]).path == path
    ]


TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


def test_the_page_sends_each_message_with_a_traceparent_the_gateway_continues(
    env: dict[str, str], tmp_path: Path
):
    """Each POST of a message carries a W3C traceparent header of a trace of its own; with
    tracing on (the OTel extra, an exporter named), the example's gateway continues it: the
    entry in the inbound stream carries the same trace id under the gateway's own span."""
    import urllib.parse

    import redis

    from dialog_worker import tracing

    traced = tracing.installed()
    with _serve_example(
        env, tmp_path, **({"OTEL_TRACES_EXPORTER": "console"} if traced else {})
    ) as page:
        browser = _browser(network_log=True)
        try:
            session = _open_chat(browser, page)
            for text in ("first", "second"):  # no worker: they stay in the inbound stream
                _send(browser, text)
            wait_until(
                lambda: (
                    browser.execute_script(
                        "return [...chat.answers.values()].filter((a) => a.feed).length"
                    )
                    == 2
                ),
                20,
                what="both messages sent",
            )
            requests = _requests(browser)
            posts = _of(requests, "POST", f"/sessions/{session}/messages")
            sent = {
                json.loads(p["postData"])["text"]: (json.loads(p["postData"])["msg_id"], p)
                for p in posts
            }
            streams = {
                text: _of(requests, "GET", f"/sessions/{session}/messages/{msg_id}/stream")
                for text, (msg_id, _) in sent.items()
            }
        finally:
            browser.quit()
    assert sorted(sent) == ["first", "second"]
    headers = {
        text: {k.lower(): v for k, v in p["headers"].items()} for text, (_, p) in sent.items()
    }
    parents = {text: TRACEPARENT.fullmatch(h.get("traceparent", "")) for text, h in headers.items()}
    assert all(parents.values()), headers
    trace_ids = {text: m.group(1) for text, m in parents.items() if m}
    assert trace_ids["first"] != trace_ids["second"], "a trace of its own for each message"
    assert all(t.strip("0") for t in trace_ids.values())
    # Its answer's stream (an EventSource: no headers) carries the same trace in its query.
    for text, gets in streams.items():
        assert gets, text
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(gets[0]["url"]).query)
        assert query["traceparent"] == [headers[text]["traceparent"]]
    r = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    entries = {f["msg_id"]: f for _, f in r.xrange("dialog")}
    for text, (msg_id, _) in sent.items():
        entry = entries[msg_id]
        if not traced:
            continue  # without the extra the gateway traces nothing: the header is all there is
        continued = TRACEPARENT.fullmatch(entry.get("traceparent", ""))
        assert continued is not None, entry
        assert continued.group(1) == trace_ids[text], (entry, headers[text])
        assert continued.group(2) != parents[text].group(2)  # the gateway's span, its child


def test_an_answer_that_waits_for_the_model_says_so_with_the_time_left(
    chat_page: TcpProxy, workers: WorkerPool, env: dict[str, str]
):
    """The model's limit key is paused for a minute: the page's status line says "waiting for
    the model (paused), about N s" instead of "typing…"; once the key is reopened the answer
    comes and the line no longer says so."""
    browser = _browser()
    workers.start(
        1,
        DIALOG_ENGINE="usage_engines:UsageEngine",
        DIALOG_MODEL_LIMITS=json.dumps({"k": {"rpm": 6000}}),
    )
    paused = run_cli(env, "limits", "pause", "k", "--for", "60", "--reason", "test")
    assert paused.returncode == 0, paused.stderr
    time.sleep(0.3)  # past the 100 ms in which workers see the pause

    def status() -> str:
        return str(browser.find_element("id", "status").text)

    def bot(expr: str) -> Any:
        return browser.execute_script(f"const b = document.querySelector('.bot'); return {expr};")

    try:
        browser.get(f"http://127.0.0.1:{chat_page.port}/")
        browser.find_element("id", "text").send_keys("hello")
        browser.find_element("id", "send").click()
        wait_until(lambda: "waiting for the model" in status(), 20, what="the wait is shown")
        line = status()
        waiting = bot("b.dataset.waiting")
        resumed = run_cli(env, "limits", "resume", "k", "--reason", "test")
        assert resumed.returncode == 0, resumed.stderr
        wait_until(lambda: bot("b.dataset.state") == "done", 20, what="the answer ends")
        text, after = bot("b.querySelector('.text').textContent"), status()
        still = bot("b.dataset.waiting")
    finally:
        browser.quit()
    assert re.fullmatch(r"waiting for the model \(paused\), about (\d+) s", line), line
    assert 40 <= int(re.findall(r"\d+", line)[0]) <= 60, line
    assert waiting == "paused"
    assert text == "ok hello" and "waiting" not in after and still is None
