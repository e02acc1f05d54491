"""The fake model provider as engine.md tells an engine author to use it: started with its
documented command (no warning on the way), called like OpenAI, throttled, its stats read."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_the_fake_provider_starts_from_its_command_answers_throttles_and_counts() -> None:
    command = ["dialog_worker.bench.fake_provider", "--port", "0", "--latency-ms", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        call = {"model": "m", "messages": [{"role": "user", "content": "halo"}], "max_tokens": 3}
        with httpx.Client(base_url=url, timeout=10) as http:
            answered = http.post("/v1/chat/completions", json=call)
            assert answered.status_code == 200
            assert answered.json()["usage"] == {
                "prompt_tokens": 1,
                "completion_tokens": 3,
                "total_tokens": 4,
            }
            assert http.post("/admin/throttle", json={"model": "m", "for_s": 30}).json() == {
                "ok": True
            }
            refused = http.post("/v1/chat/completions", json=call)
            assert refused.status_code == 429 and 29 <= int(refused.headers["Retry-After"]) <= 30
            stats = http.get("/stats").json()
        assert stats["models"]["m"] == {
            "calls": 1,
            "rate_limited": 1,
            "prompt_tokens": 1,
            "completion_tokens": 3,
        }
        assert [entry["status"] for entry in stats["log"]] == [200, 429]
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean exit
        _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert stderr == ""  # no RuntimeWarning about the module being imported twice
