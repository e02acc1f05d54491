"""A page on another origin calls the gateway from a real browser (Debian's chromium): allowed
when its origin is in DIALOG_HTTP_CORS_ORIGINS, blocked by the browser otherwise."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_proc import GatewayProc
from redis_server import free_port

from dialog_worker.client import session_tokens

pytestmark = pytest.mark.integration

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER_PATH", "/usr/bin/chromedriver")
KEY = "c" * 40

PAGE = """<!doctype html><title>waiting</title><script>
const [gateway, token] = decodeURIComponent(location.hash.slice(1)).split("|");
fetch(gateway + "/sessions/cors-1/messages", {
  method: "POST",
  headers: {"Authorization": "Bearer " + token, "Content-Type": "application/json"},
  body: JSON.stringify({text: "halo"}),
}).then((r) => r.json().then((b) => {
  document.title = "status " + r.status + " " + (b.msg_id ? "sent" : "");
}))
  .catch((e) => { document.title = "blocked " + e.name; });
</script>"""


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


class PageServer:
    """The page, served from its own origin (another port of the loopback)."""

    def __init__(self, folder: Path) -> None:
        (folder / "index.html").write_text(PAGE)
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
        handler.log_message = lambda *a: None  # type: ignore[attr-defined]
        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pages(tmp_path: Path) -> Iterator[tuple[PageServer, PageServer]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    allowed, other = PageServer(tmp_path / "a"), PageServer(tmp_path / "b")
    yield allowed, other
    allowed.close()
    other.close()


def test_a_page_on_an_allowed_origin_posts_and_another_origin_is_blocked(
    env: dict[str, str], tmp_path: Path, pages: tuple[PageServer, PageServer]
):
    allowed, other = pages
    gateway = GatewayProc(
        {
            **env,
            "DIALOG_HTTP_TOKEN": "server-token-never-in-a-page",
            "DIALOG_HTTP_SIGNING_KEY": KEY,
            "DIALOG_HTTP_CORS_ORIGINS": allowed.origin,
        },
        tmp_path,
    )
    browser = _browser()
    try:
        token = session_tokens.mint(KEY, "cors-1", 60)
        titles = {}
        for name, page in (("allowed", allowed), ("other", other)):
            browser.get(f"{page.origin}/index.html#{gateway.url}|{token}")
            deadline = time.monotonic() + 20
            while browser.title == "waiting" and time.monotonic() < deadline:
                time.sleep(0.05)
            titles[name] = browser.title
    finally:
        browser.quit()
        gateway.stop()
    assert titles["allowed"] == "status 202 sent", titles
    assert titles["other"].startswith("blocked"), titles
