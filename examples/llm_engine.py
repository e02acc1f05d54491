"""A dialog engine that answers with an OpenAI-compatible chat completions API.

Run it (the folder of this file on PYTHONPATH, so DIALOG_ENGINE can import it):

    PYTHONPATH=examples DIALOG_ENGINE=llm_engine:LLMEngine \\
    LLM_BASE_URL=https://api.openai.com/v1 LLM_API_KEY=sk-... LLM_MODEL=gpt-4o-mini \\
    DIALOG_MODEL_LIMITS='{"llm:gpt-4o-mini": {"rpm": 500, "tpm": 200000}}' \\
    dialog-worker run

What it shows (docs/engine.md explains each):
- ``startup()`` opens one HTTP client for the worker's life (connection pooling, a timeout on
  every call), ``shutdown()`` closes it;
- ``async def step`` awaits the API on the event loop without blocking it;
- each call goes through ``dialog_worker.model_call`` on the limit key ``llm:<model>``
  (``LLM_LIMIT_KEY``), with an estimate of its tokens (the prompt's, plus ``LLM_MAX_TOKENS``
  for the answer): the key's rpm/tpm are shared by every worker, and the call reports what it
  used from the stream's last chunk (``usage``), which the worker commits with the reply;
- the answer is streamed (``stream: true``, server-sent events) and each piece is passed to
  ``dialog_worker.emit`` as it arrives, so readers watch it being written; the committed
  reply is the whole text (a server that answers with plain JSON works too);
- the conversation so far (the state's ``history``) is sent as context;
- failures are sorted by what a retry can do: a 429 is ``RateLimited`` (the key is paused for
  every worker for its Retry-After, and the message waits for it without spending an
  attempt), a 5xx, a timeout or a dropped connection a ``TransientError``, any other 4xx a
  ``PermanentError`` (dead-lettered at once);
- ``memory`` holds any JSON: here the turn count and the tokens used.

A model's answer is not a pure function of its input: if a worker dies after the call but
before its commit, the message is stepped again and may get a different answer. Only the
committed one is stored and sent as the reply; ``temperature`` 0 keeps re-runs close.
"""

from __future__ import annotations

import email.utils
import json
import math
import os
import time
from typing import Any

import httpx

from dialog_worker import PermanentError, RateLimited, TransientError, emit, model_call

SYSTEM_PROMPT = (
    "You are the customer support assistant of an Indonesian internet provider. "
    "Answer briefly, in the language the customer writes in."
)
# How many earlier turns go with each request: enough for context, bounded in cost.
HISTORY_TURNS = 10


class LLMEngine:
    """Settings come from the environment (``LLM_BASE_URL``, ``LLM_API_KEY``, ``LLM_MODEL``,
    ``LLM_TIMEOUT_S``) unless given; DIALOG_ENGINE calls the class with no arguments."""

    # What a user reads when their message cannot be answered (dead-lettered): in the bot's
    # language, unless the operator sets DIALOG_FALLBACK_REPLY.
    fallback_reply = "Sorry, I could not answer that. Please try again later."

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        model: str | None = None,
        timeout_s: float | None = None,
        limit_key: str | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.base_url = base_url or os.environ.get("LLM_BASE_URL", "https://api.openai.com/v1")
        self.api_key = api_key if api_key is not None else os.environ.get("LLM_API_KEY", "")
        self.model = model or os.environ.get("LLM_MODEL", "gpt-4o-mini")
        self.timeout_s = timeout_s or float(os.environ.get("LLM_TIMEOUT_S", "20"))
        self.limit_key = limit_key or os.environ.get("LLM_LIMIT_KEY", f"llm:{self.model}")
        self.max_tokens = max_tokens or int(os.environ.get("LLM_MAX_TOKENS", "512"))
        self._http: httpx.AsyncClient | None = None

    async def startup(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(self.timeout_s),
        )

    async def shutdown(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        if self._http is None:
            raise RuntimeError("LLMEngine.startup() was not called")
        messages = conversation(state, message["text"])
        body = {
            "model": self.model,
            "messages": messages,
            "temperature": 0,
            "user": state["session_id"],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        # The key's turn first (shared by the fleet); then the call, which reports its usage.
        async with model_call(self.limit_key, tokens=estimate(messages, self.max_tokens)) as call:
            reply, used = await self._call(body)
            call.usage(used["prompt_tokens"], used["completion_tokens"], model=self.model)
        tokens = used["prompt_tokens"] + used["completion_tokens"]
        memory = state["memory"] if isinstance(state["memory"], dict) else {}
        memory = {
            **memory,
            "turns": int(memory.get("turns", 0)) + 1,
            "tokens": int(memory.get("tokens", 0)) + tokens,
        }
        return {**state, "step": "CHATTING", "memory": memory}, reply

    async def _call(self, body: dict[str, Any]) -> tuple[str, dict[str, int]]:
        """One chat completion: its text and usage (prompt_tokens, completion_tokens)."""
        assert self._http is not None
        try:
            async with self._http.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code == 429:
                    # The provider's quota: the worker pauses the key for everyone until then.
                    raise RateLimited(
                        self.limit_key,
                        retry_after_s(response.headers.get("retry-after")),
                        f"LLM API returned {response.status_code}",
                    )
                if response.status_code >= 500:
                    raise TransientError(
                        f"LLM API returned {response.status_code}",
                        retry_after=retry_after_s(response.headers.get("retry-after")),
                    )
                if response.status_code >= 400:
                    # The same request will be refused again (bad key, content policy).
                    await response.aread()
                    raise PermanentError(
                        f"LLM API refused: {response.status_code} {response.text[:200]}"
                    )
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    return await read_stream(response)
                await response.aread()  # a server that does not stream: one JSON answer
                return parse_completion(response)
        except httpx.TimeoutException as exc:
            raise TransientError(f"LLM API did not answer within {self.timeout_s:g} s") from exc
        except httpx.TransportError as exc:
            # Also a connection dropped mid-answer: the retry streams the answer anew.
            raise TransientError(f"LLM API unreachable: {exc!r}") from exc


def estimate(messages: list[dict[str, str]], max_tokens: int) -> int:
    """A call's tokens before it is made: about 4 bytes of text a token, plus the longest
    answer allowed. Too low slows the next calls down once the call reports its usage; too
    high holds back tokens until then."""
    size = sum(len(m["content"].encode("utf-8")) for m in messages)
    return size // 4 + 1 + max_tokens


def conversation(state: dict[str, Any], text: str) -> list[dict[str, str]]:
    """The system prompt, the last HISTORY_TURNS turns, then the new message."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for turn in state.get("history", [])[-HISTORY_TURNS:]:
        messages.append({"role": "user", "content": turn["user"]})
        messages.append({"role": "assistant", "content": turn["bot"]})
    messages.append({"role": "user", "content": text})
    return messages


async def read_stream(response: httpx.Response) -> tuple[str, dict[str, int]]:
    """Server-sent chunks (``data: {...}`` lines, then ``data: [DONE]``): each piece of text
    is emitted as it comes; returns the whole text and the usage of the last chunk."""
    pieces: list[str] = []
    used = {"prompt_tokens": 0, "completion_tokens": 0}
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
            choices = chunk.get("choices") or []
            piece = (choices[0].get("delta") or {}).get("content") if choices else None
            used = usage_of(chunk.get("usage"), used)
        except (ValueError, AttributeError, TypeError) as exc:
            raise TransientError(f"LLM API sent an unreadable chunk: {data[:200]}") from exc
        if isinstance(piece, str) and piece:
            emit(piece)
            pieces.append(piece)
    reply = "".join(pieces)
    if not reply.strip():
        raise TransientError("LLM API answered with an empty reply")
    return reply, used


def usage_of(usage: Any, default: dict[str, int]) -> dict[str, int]:
    """A chunk's usage as prompt and completion tokens (a server that gives only
    total_tokens: all of it counted as completion)."""
    if not isinstance(usage, dict):
        return default
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    if not prompt and not completion:
        completion = int(usage.get("total_tokens") or 0)
    return {"prompt_tokens": max(0, prompt), "completion_tokens": max(0, completion)}


def parse_completion(response: httpx.Response) -> tuple[str, dict[str, int]]:
    """The reply text and the usage. An answer without a reply is an upstream hiccup: worth
    another try."""
    try:
        data = response.json()
        reply = data["choices"][0]["message"]["content"]
        used = usage_of(data.get("usage"), {"prompt_tokens": 0, "completion_tokens": 0})
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise TransientError(f"LLM API answered without a reply: {response.text[:200]}") from exc
    if not isinstance(reply, str) or not reply.strip():
        raise TransientError("LLM API answered with an empty reply")
    return reply, used


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header in seconds ("2") or as an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None
