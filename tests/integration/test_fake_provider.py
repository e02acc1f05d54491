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


def as_a_background_job() -> None:
    """What `command &` in a script does to its child: SIGINT and SIGQUIT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


# Ctrl-C and a supervisor's SIGTERM both end it cleanly, even started as a background job of a
# script (CI once waited 10 s in vain for it to exit on SIGINT).
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_the_fake_provider_starts_from_its_command_answers_throttles_and_counts(
    stop: signal.Signals,
) -> None:
    command = ["dialog_worker.bench.fake_provider", "--port", "0", "--latency-ms", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_background_job,  # the child's signals, set before exec
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
        proc.send_signal(stop)
        _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert stderr == ""  # no RuntimeWarning about the module being imported twice
