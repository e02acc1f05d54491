"""examples/use_chat (React, the AI SDK's useChat and DefaultChatTransport, bundled with
esbuild from the pinned lockfile) in headless Chromium, against its backend and a real worker:
send, stream, stop, a question approved, a reload mid-answer that resumes, a second message
under each double-texting policy, and another session's chat refused to the page's token."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from examples_path import with_examples
from npm_packages import npm_ci
from redis_server import free_port, wait_until
from worker_procs import WorkerPool

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "use_chat"
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER_PATH", "/usr/bin/chromedriver")
SIGNING_KEY = "u" * 40
# How long a browser waits for what the page shows (an answer of 30 words takes 2.4 s).
SHOWN_WITHIN_S = 30
T = TypeVar("T")


@pytest.fixture(scope="module")
def bundle() -> Path:
    """The page, built as its README says (npm ci, npm run build), once for these tests."""
    npm_ci(EXAMPLE)
    built = subprocess.run(
        ["npm", "run", "build"], cwd=EXAMPLE, capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return EXAMPLE / "dist" / "app.js"


@pytest.fixture
def page(bundle: Path, env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """The example's backend on a port of its own; its URL."""
    port = free_port()
    with (tmp_path / "use_chat.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE / "server.py")],
            env={**env, "USE_CHAT_PORT": str(port), "DIALOG_HTTP_SIGNING_KEY": SIGNING_KEY},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url, proc), 20, what="the use_chat example")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _up(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, "the example exited"
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium from the distribution, driven by Selenium."""
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
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def assistant(workers: WorkerPool, env: dict[str, str]) -> None:
    """The example engine: types "You said: ..." one word every 80 ms; "refund N" asks first."""
    workers.start(1, **with_examples(env), DIALOG_ENGINE="web_chat_stream:Assistant")


ANSWERS = """return [...document.querySelectorAll('[data-testid=answer]')].map((a) => ({
  text: a.querySelector('[data-testid=text]').textContent,
  outcome: a.dataset.outcome,
  tools: [...a.querySelectorAll('[data-testid=tool]')].map((t) => t.textContent),
  question: a.querySelector('[data-testid=question]')?.dataset.state ?? null,
}));"""


def answers(browser: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = browser.execute_script(ANSWERS)
    return found


def ended(browser: Any, i: int, outcome: str) -> dict[str, Any] | None:
    """The i-th answer once it ended so (None before: also while the page reloads)."""
    shown = answers(browser)
    return shown[i] if len(shown) > i and shown[i]["outcome"] == outcome else None


def started(browser: Any, i: int) -> bool:
    """Whether the i-th answer shows a few words."""
    shown = answers(browser)
    return len(shown) > i and len(shown[i]["text"]) > 12


def until(check: Callable[[], T | None], what: str) -> T:
    """Polls the page (nothing to wait on but what it shows) until ``check`` gives a value."""
    deadline = time.monotonic() + SHOWN_WITHIN_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"the page never showed {what}")


def say(browser: Any, text: str, policy: str | None = None) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    if policy is not None:
        Select(browser.find_element(By.CSS_SELECTOR, "[data-testid=policy]")).select_by_value(
            policy
        )
    box = browser.find_element(By.CSS_SELECTOR, "[data-testid=input]")
    box.send_keys(text)
    browser.find_element(By.CSS_SELECTOR, "[data-testid=send]").click()


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def opened(browser: Any, url: str) -> None:
    browser.get(url)
    until(lambda: browser.find_elements("css selector", "[data-testid=input]"), "the chat")


def test_the_page_sends_streams_stops_approves_and_resumes_after_a_reload(
    page: str, browser: Any, assistant: None
):
    opened(browser, page)
    say(browser, words(10, "a"))
    grown = set()

    def answered() -> bool:
        shown = answers(browser)
        if shown:
            grown.add(shown[-1]["text"])
        return bool(shown) and shown[-1]["outcome"] == "applied"

    until(answered, "the first answer")
    assert answers(browser)[-1]["text"] == f"You said: {words(10, 'a')}"
    assert len(grown) > 3  # it was shown as it was written

    say(browser, words(40, "b"))
    until(lambda: started(browser, 1), "a start")
    browser.find_element("css selector", "[data-testid=stop]").click()
    stopped = until(lambda: ended(browser, 1, "cancelled"), "the stopped answer")
    assert 0 < len(stopped["text"]) < len(f"You said: {words(40, 'b')}")
    assert browser.find_element("css selector", "[data-testid=outcome]").text.strip() == "(stopped)"

    say(browser, "refund 20")
    until(lambda: ended(browser, 2, "awaiting"), "the question")
    assert answers(browser)[2]["question"] == "approval-requested"
    browser.find_element("css selector", "[data-testid=approve]").click()
    refunded = until(lambda: ended(browser, 2, "applied"), "the answer after the approval")
    assert refunded["text"].startswith("Done: refund R-")
    assert refunded["tools"] == ["refund: done"]

    say(browser, words(40, "c"))
    until(lambda: started(browser, 3), "a start")
    browser.refresh()  # mid-answer
    resumed = until(lambda: ended(browser, 3, "applied"), "the answer resumed after the reload")
    assert resumed["text"] == f"You said: {words(40, 'c')}"
    assert len(answers(browser)) == 4  # the conversation came back, the answer once


@pytest.mark.parametrize(
    ("policy", "first", "second"),
    [
        ("reject", "applied", "rejected"),
        ("interrupt", "cancelled", "applied"),
        ("enqueue", "applied", "applied"),
    ],
)
def test_a_second_message_while_the_first_is_answered_follows_the_policy(
    page: str, browser: Any, assistant: None, policy: str, first: str, second: str
):
    opened(browser, page)
    say(browser, words(30, "x"))
    until(lambda: started(browser, 0), "a start")
    say(browser, "second message", policy)
    ended = until(
        lambda: (
            [a["outcome"] for a in answers(browser)]
            if len(answers(browser)) == 2 and all(a["outcome"] for a in answers(browser))
            else None
        ),
        "both answers ended",
    )
    assert ended == [first, second]


def test_the_pages_token_opens_no_other_chat(page: str, browser: Any):
    opened(browser, page)
    statuses = browser.execute_async_script(
        """const done = arguments[arguments.length - 1];
        (async () => {
          const {token} = await (await fetch('/session-token', {method: 'POST'})).json();
          const auth = {Authorization: 'Bearer ' + token, 'Content-Type': 'application/json'};
          const body = JSON.stringify({id: 'someone-else', messages: [
            {id: 'm1', role: 'user', parts: [{type: 'text', text: 'hi'}]}]});
          const posted = await fetch('/ai-sdk/chat', {method: 'POST', headers: auth, body});
          const resumed = await fetch('/ai-sdk/chat/someone-else/stream', {headers: auth});
          const stopped = await fetch(
            '/ai-sdk/chat/someone-else/stop', {method: 'POST', headers: auth});
          return [posted.status, resumed.status, stopped.status];
        })().then(done, (e) => done(String(e)));"""
    )
    assert statuses == [403, 403, 403]
