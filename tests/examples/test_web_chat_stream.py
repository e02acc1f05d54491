"""examples/web_chat_stream.py in a real browser (headless Chromium from the distribution,
driven by Selenium): the page sends, the answer grows, the connection is cut mid-answer on
the server's side, the browser reconnects by itself, and the text shown ends as the committed
reply, no piece twice."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from examples_path import with_examples
from redis_server import free_port, wait_until
from tcp_proxy import TcpProxy
from worker_procs import WorkerPool

pytestmark = pytest.mark.integration

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER_PATH", "/usr/bin/chromedriver")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "web_chat_stream.py"


def _browser() -> Any:
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
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


@pytest.fixture
def chat_page(env: dict[str, str], tmp_path: Path) -> Iterator[TcpProxy]:
    """The example on its own port, reached through a proxy the test can cut."""
    port = free_port()
    log = (tmp_path / "web_chat.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE)],
        env={**with_examples(env), "WEB_CHAT_PORT": str(port)},
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
                    "const b = document.querySelector('.bot'); return b ? b.textContent : '';"
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
        wait_until(lambda: len(bot("b ? b.textContent : ''")) > 0, 20, what="the answer starts")
        assert stop.is_enabled()
        stop.click()
        wait_until(lambda: bot("b.dataset.state") == "done", 10, what="the answer ends")
        outcome, cancel, text = (
            bot("b.dataset.outcome"),
            bot("b.dataset.cancel"),
            bot("b.textContent"),
        )
        shown_before_end: list[str] = bot("b.shown.slice(0, -1)")
        stop_enabled = stop.is_enabled()
        marker = bot("getComputedStyle(b, '::after').content")
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
    """docs/http.md's first steps, as written: the Typist engine behind the example page."""
    import httpx

    workers.start(1, **with_examples(env), DIALOG_ENGINE="web_chat_stream:Typist")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{chat_page.port}", timeout=30) as http:
        page = await http.get("/")
        assert page.status_code == 200 and "EventSource" in page.text
        sent = await http.post("/sessions/demo/messages", json={"text": "hello there"})
        assert sent.status_code == 202
        kinds, deltas, end = [], "", None
        async with http.stream("GET", sent.json()["stream"]) as response:
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
