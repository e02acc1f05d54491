"""The engine of `dialog-worker bench --mode limits`: one call per message to the fake provider
(dialog_worker/bench/fake_provider.py) through a limit key, as an LLM bot makes it: its
estimate is the prompt's tokens plus ``max_tokens``, a 429 is `RateLimited` with the
provider's Retry-After, the usage comes from the answer. Configured by the environment the
bench gives its workers: BENCH_PROVIDER_URL, BENCH_LIMIT_KEY, BENCH_MODEL, BENCH_MAX_TOKENS."""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from typing import Any

import anyio.to_thread

from dialog_worker.engine.model_calls import model_call
from dialog_worker.errors import RateLimited, TransientError


class LimitsEngine:
    def __init__(self) -> None:
        self.url = os.environ.get("BENCH_PROVIDER_URL", "http://127.0.0.1:8400")
        self.key = os.environ.get("BENCH_LIMIT_KEY", "bench:model")
        self.model = os.environ.get("BENCH_MODEL", "model")
        self.max_tokens = int(os.environ.get("BENCH_MAX_TOKENS", "1600"))

    async def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[Any, str]:
        prompt = message["text"]
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
        }
        estimate = max(1, math.ceil(len(prompt.encode()) / 4)) + self.max_tokens
        async with model_call(self.key, tokens=estimate) as call:
            status, retry_after, doc = await anyio.to_thread.run_sync(self._post, body)
            if status == 429:
                raise RateLimited(self.key, retry_after)
            if status != 200:
                raise TransientError(f"provider answered {status}")
            usage = doc["usage"]
            call.usage(usage["prompt_tokens"], usage["completion_tokens"], model=self.model)
        turns = int(state["memory"].get("turns", 0)) if isinstance(state["memory"], dict) else 0
        return {**state, "step": "CHATTED", "memory": {"turns": turns + 1}}, "ok"

    def _post(self, body: dict[str, Any]) -> tuple[int, float | None, Any]:
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return int(answer.status), None, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            retry = exc.headers.get("Retry-After")
            return exc.code, float(retry) if retry else None, None
        except OSError as exc:
            raise TransientError(f"provider unreachable: {exc}") from exc
