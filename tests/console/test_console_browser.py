"""The console in a real browser: Debian's headless Chromium driven by Selenium through
chromedriver, against a real `dialog-worker console` process, a real redis-server and real
workers. Skipped, with the reason, where /usr/bin/chromium or chromedriver is missing.

With CONSOLE_SCREENSHOTS=<folder> set, the pages are saved there as PNG files (docs/console.md
shows the ones in docs/); a plain run, CI's included, writes nothing."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from console_support import OPERATOR, VIEWER, console_env
from redis_server import free_port, wait_until, wait_until_async
from worker_procs import REPO_DIR, WorkerPool

from dialog_worker.client.dialog_client import DialogClient

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
        reason="browser tests need Debian's chromium and chromium-driver (apt-get install "
        "chromium chromium-driver)",
    ),
]

SHOTS = os.environ.get("CONSOLE_SCREENSHOTS")


class Console:
    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logdir / "console.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dialog_worker", "console", "--port", str(self.port)],
                env=console_env(env),
                cwd=REPO_DIR,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_until(self._healthy, 30, what="the console's /healthz")

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def console(env: dict[str, str], tmp_path: Path) -> Iterator[Console]:
    c = Console(env, tmp_path)
    yield c
    c.stop()


Browser = Any  # selenium's WebDriver (untyped enough that Any reads better)


@pytest.fixture
def browser() -> Iterator[Callable[[tuple[str, str]], Browser]]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opened: list[Browser] = []

    def open_as(user: tuple[str, str]) -> Browser:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--disable-gpu",
            "--window-size=1280,900",
        ):
            options.add_argument(arg)
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        opened.append(driver)
        token = base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode()
        # Basic auth on every request of the page, the overview's polling included.
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd(
            "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}}
        )
        driver.set_page_load_timeout(30)
        return driver

    yield open_as
    for driver in opened:
        driver.quit()


def shot(driver: Browser, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SHOTS) / f"console-{name}.png"))


def text_of(driver: Browser, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def wait_for(driver: Browser, predicate: Callable[[Browser], Any], timeout_s: float = 20) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(predicate)
    except TimeoutException:
        body = text_of(driver, "body")
        raise AssertionError(f"timed out at {driver.current_url}, showing:\n{body}") from None


async def test_an_operator_finds_a_session_redrives_its_dead_letter_and_sees_it_audited(
    console: Console,
    browser: Callable[[tuple[str, str]], Browser],
    client: DialogClient,
    workers: WorkerPool,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    flag = tmp_path / "flag"
    flag.write_text("on")
    workers.start(
        1, DIALOG_ENGINE="fault_engine:make", DIALOG_MAX_ATTEMPTS="1", FAULT_FLAG_FILE=str(flag)
    )
    for i in range(3):
        await client.ask(f"user-{i}", "halo", timeout=30)
    op = browser(OPERATOR)
    op.get(console.url + "/")
    assert text_of(op, '[data-stat="dlq_length"]') == "0"
    # The overview updates itself: a dead letter appears without a reload.
    await client.send("user-1", "flaky order 42")
    wait_for(op, lambda d: text_of(d, '[data-stat="dlq_length"]') == "1")
    assert "w1" in text_of(op, "#workers")
    shot(op, "overview")

    box = op.find_element(By.ID, "find-id")
    box.send_keys("user-1")
    op.find_element(By.ID, "find-go").click()
    wait_for(op, lambda d: "user-1" in text_of(d, "#session-id"))
    letters = op.find_elements(By.CSS_SELECTOR, "#session-letters tr[data-handle]")
    assert len(letters) == 1 and "flaky" in text_of(op, "#session-letters")
    assert '"history"' in text_of(op, "#state-json")
    shot(op, "session")

    flag.unlink()  # the cause is fixed
    op.find_element(By.ID, "redrive-reason").send_keys("flaky upstream is back")
    op.find_element(By.ID, "redrive-go").click()
    wait_for(op, lambda d: "1 of 1 listed letters done" in text_of(d, "#outcome"))

    async def redriven() -> bool:
        state = await client.state("user-1")
        history = (state or {}).get("history", [])
        return any(str(t.get("msg_id", "")).startswith("redrive:") for t in history)

    await wait_until_async(redriven, 30, what="the redriven message applied")
    op.get(console.url + "/session?id=user-1")
    assert "No dead letters" in text_of(op, "#session-letters")

    op.get(console.url + "/audit")
    audit = text_of(op, "#audit")
    assert "redrive_session" in audit and "flaky upstream is back" in audit and "olga" in audit
    assert "requested" in audit and "done" in audit
    shot(op, "audit")


async def test_a_viewer_sees_no_actions_and_a_forged_post_is_refused(
    console: Console,
    browser: Callable[[tuple[str, str]], Browser],
    client: DialogClient,
) -> None:
    from selenium.webdriver.common.by import By

    keys = client.keys_for("<b>ana</b>")
    await client.redis.xadd(
        keys.dlq,
        {
            "session_id": "<b>ana</b>",
            "seq": "1",
            "msg_id": "m1",
            "text": "<script>document.title='pwned'</script>",
            "error_kind": "engine_error",
            "error": "<img src=x onerror=\"document.title='pwned'\">",
            "source_stream": keys.stream,
        },
    )
    viewer = browser(VIEWER)
    viewer.get(console.url + "/letters")
    rows = viewer.find_elements(By.CSS_SELECTOR, "#letters tr[data-handle]")
    assert len(rows) == 1
    assert "<b>ana</b>" in text_of(viewer, "#letters")  # shown as text, not as markup
    assert viewer.find_elements(By.CSS_SELECTOR, "button[type=submit][name=action]") == []
    assert "pwned" not in viewer.title
    shot(viewer, "letters-viewer")
    viewer.find_element(By.LINK_TEXT, "<b>ana</b>").click()
    wait_for(viewer, lambda d: "<b>ana</b>" in text_of(d, "#session-id"))
    assert viewer.find_elements(By.ID, "redrive-go") == []
    handle = viewer.find_element(By.CSS_SELECTOR, "#session-letters tr[data-handle]")
    # The buttons are missing, and the server refuses the action itself.
    status = viewer.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const body = new URLSearchParams({session_id: "<b>ana</b>", handle: arguments[0],
            count: "1", reason: "forged", form_token: "1." + "0".repeat(64)});
        fetch("/session/redrive", {method: "POST", body}).then(r => done(r.status));
        """,
        handle.get_attribute("data-handle"),
    )
    assert status == 403
    assert await client.redis.xlen(keys.dlq) == 1
    viewer.get(console.url + "/audit")
    assert "No actions yet" in text_of(viewer, "#audit")
    assert "pwned" not in viewer.title


async def test_an_operator_holds_a_session_sees_its_messages_wait_and_releases_it(
    console: Console,
    browser: Callable[[tuple[str, str]], Browser],
    client: DialogClient,
    workers: WorkerPool,
) -> None:
    from selenium.webdriver.common.by import By

    workers.start(1)
    await client.ask("hana", "halo", timeout=30)
    op = browser(OPERATOR)
    op.get(console.url + "/session?id=hana")
    op.find_element(By.ID, "hold-reason").send_keys("checking her complaint")
    op.find_element(By.ID, "hold-go").click()
    wait_for(op, lambda d: "Done" in text_of(d, "#outcome"))

    for text in ("satu", "dua"):
        await client.send("hana", text)

    def two_waiting(d: Browser) -> bool:
        d.get(console.url + "/session?id=hana")
        return len(d.find_elements(By.CSS_SELECTOR, "#waiting .cancel-go")) == 2

    wait_for(op, two_waiting, timeout_s=15)
    assert "held by olga" in text_of(op, "#held")
    assert text_of(op, "#applied-seq") == "1"  # they wait
    shot(op, "session-held")

    op.find_element(By.ID, "hold-reason").send_keys("complaint checked")
    op.find_element(By.ID, "hold-go").click()
    wait_for(op, lambda d: "Done" in text_of(d, "#outcome"))

    def applied(d: Browser) -> bool:
        d.get(console.url + "/session?id=hana")
        return text_of(d, "#applied-seq") == "3" and not d.find_elements(By.ID, "held")

    wait_for(op, applied, timeout_s=15)
    history = (await client.state("hana") or {}).get("history", [])
    assert [t["user"] for t in history] == ["halo", "satu", "dua"]
    op.get(console.url + "/audit")
    audit = text_of(op, "#audit")
    assert "hold_session" in audit and "release_session" in audit
