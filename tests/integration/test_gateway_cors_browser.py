"""A page on another origin calls the gateway from a real browser (Debian's chromium): allowed
when its origin is in DIALOG_HTTP_CORS_ORIGINS, blocked by the browser otherwise; and such a page
resumes answers, through the gateway's own stream (Last-Event-ID) and useChat's resume route."""

from __future__ import annotations

import functools
import http.server
import json
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
from worker_procs import WorkerPool

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

# The page reads an answer as a fetch-based reader does (headers are allowed, unlike
# EventSource): useChat's resume route while the answer is written, then the gateway's own
# stream, dropped after three events and taken up again from the last one with Last-Event-ID.
RESUMING_PAGE = """<!doctype html><title>waiting</title><script>
const [gateway, token, session] = decodeURIComponent(location.hash.slice(1)).split("|");
const auth = {"Authorization": "Bearer " + token};
let step = "send";

// The events of a stream until `enough(events)` or its end; then the connection is dropped.
async function read(url, headers, enough) {
  const stop = new AbortController();
  const response = await fetch(url, {headers, signal: stop.signal});
  const events = [];
  if (response.status === 200) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    while (!enough(events)) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
        const event = {};
        for (const line of buffer.slice(0, cut).split("\\n")) {
          const colon = line.indexOf(":");
          if (colon > 0) event[line.slice(0, colon)] = line.slice(colon + 1).trimStart();
        }
        buffer = buffer.slice(cut + 2);
        if (event.data !== undefined) events.push(event);
      }
    }
  }
  stop.abort();
  return {status: response.status, events};
}

(async () => {
  const posted = await fetch(gateway + "/sessions/" + session + "/messages", {
    method: "POST",
    headers: {...auth, "Content-Type": "application/json"},
    body: JSON.stringify({text: "100 50"}),
  });
  const msgId = (await posted.json()).msg_id;
  // useChat's resume on load: 204 until the session has the message in hand.
  step = "useChat resume";
  let useChat = {status: 204, events: []};
  for (let i = 0; i < 100 && useChat.status === 204; i++) {
    useChat = await read(gateway + "/ai-sdk/chat/" + session + "/stream", auth,
                         (es) => es.some((e) => e.data.includes('"text-delta"')));
    if (useChat.status === 204) await new Promise((r) => setTimeout(r, 20));
  }
  const url = gateway + "/sessions/" + session + "/messages/" + msgId + "/stream";
  step = "stream";
  const first = await read(url, auth, (es) => es.filter((e) => e.id).length >= 3);
  const cursor = first.events.filter((e) => e.id)[2].id;
  step = "stream from Last-Event-ID";
  const rest = await read(url, {...auth, "Last-Event-ID": cursor},
                          (es) => es.some((e) => e.event === "end"));
  window.result = {
    useChat: {status: useChat.status, chunks: useChat.events.map((e) => e.data)},
    cursor,
    first: first.events,
    rest: {status: rest.status, events: rest.events},
  };
  document.title = "read";
})().catch((e) => { document.title = "blocked at " + step + ": " + e.name; });
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

    def __init__(self, folder: Path, page: str = PAGE) -> None:
        (folder / "index.html").write_text(page)
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


def test_a_page_on_another_origin_resumes_an_answer_from_its_last_event_id(
    env: dict[str, str], tmp_path: Path, workers: WorkerPool
):
    workers.start(1, DIALOG_ENGINE="stream_engines:AsyncWords")
    page = PageServer(tmp_path, RESUMING_PAGE)
    gateway = GatewayProc(
        {
            **env,
            "DIALOG_HTTP_TOKEN": "server-token-never-in-a-page",
            "DIALOG_HTTP_SIGNING_KEY": KEY,
            "DIALOG_HTTP_CORS_ORIGINS": page.origin,
        },
        tmp_path,
    )
    browser = _browser()
    try:
        token = session_tokens.mint(KEY, "cors-resume", 60)
        browser.get(f"{page.origin}/index.html#{gateway.url}|{token}|cors-resume")
        deadline = time.monotonic() + 60
        while browser.title == "waiting" and time.monotonic() < deadline:
            time.sleep(0.05)
        title = browser.title
        result = browser.execute_script("return window.result")
    finally:
        browser.quit()
        gateway.stop()
        page.close()
    assert title == "read", title
    # useChat's resume route answered the page with the answer being written.
    assert result["useChat"]["status"] == 200
    chunks = [json.loads(c) for c in result["useChat"]["chunks"] if c != "[DONE]"]
    assert chunks[0]["type"] == "start" and chunks[-1]["type"] == "text-delta"
    # The gateway's own stream, taken up after its third event: each piece once, to the end.
    assert result["rest"]["status"] == 200
    seen = [json.loads(e["data"]) for e in result["first"] if e.get("id")][:3]
    assert result["cursor"] == f"{seen[-1]['msg_id']}:{seen[-1]['attempt']}:{seen[-1]['pos']}"
    resumed = [json.loads(e["data"]) for e in result["rest"]["events"]]
    assert [e["pos"] for e in resumed] == list(range(seen[-1]["pos"] + 1, resumed[-1]["pos"] + 1))
    assert resumed[-1]["kind"] == "end"
    shown = "".join(e["text"] for e in seen + resumed[:-1] if e["kind"] == "delta")
    assert shown == resumed[-1]["text"] == "".join(f"w{i} " for i in range(100))
