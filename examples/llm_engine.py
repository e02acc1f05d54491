"""A dialog engine that answers with an OpenAI-compatible chat completions API.

Run it (the folder of this file on PYTHONPATH, so DIALOG_ENGINE can import it):

    PYTHONPATH=examples DIALOG_ENGINE=llm_engine:LLMEngine \\
    LLM_BASE_URL=https://api.openai.com/v1 LLM_API_KEY=sk-... LLM_MODEL=gpt-4o-mini \\
    dialog-worker run

What it shows (docs/engine.md explains each):
- ``startup()`` opens one HTTP client for the worker's life (connection pooling, a timeout on
  every call), ``shutdown()`` closes it;
- ``async def step`` awaits the API on the event loop without blocking it;
- the answer is streamed (``stream: true``, server-sent events) and each piece is passed to
  ``dialog_worker.emit`` as it arrives, so readers watch it being written; the committed
  reply is the whole text (a server that answers with plain JSON works too);
- the conversation so far (the state's ``history``) is sent as context;
- failures are sorted by what a retry can do: a 429 or 5xx, a timeout or a dropped connection
  is a ``TransientError`` (a 429's Retry-After is honoured), any other 4xx a
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

from dialog_worker import PermanentError, TransientError, emit

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
    ) -> None:
        self.base_url = base_url or os.environ.get("LLM_BASE_URL", "https://api.openai.com/v1")
        self.api_key = api_key if api_key is not None else os.environ.get("LLM_API_KEY", "")
        self.model = model or os.environ.get("LLM_MODEL", "gpt-4o-mini")
        self.timeout_s = timeout_s or float(os.environ.get("LLM_TIMEOUT_S", "20"))
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
        body = {
            "model": self.model,
            "messages": conversation(state, message["text"]),
            "temperature": 0,
            "user": state["session_id"],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            async with self._http.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code == 429 or response.status_code >= 500:
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
                    reply, tokens = await read_stream(response)
                else:  # a server that does not stream: one JSON answer
                    await response.aread()
                    reply, tokens = parse_completion(response)
        except httpx.TimeoutException as exc:
            raise TransientError(f"LLM API did not answer within {self.timeout_s:g} s") from exc
        except httpx.TransportError as exc:
            # Also a connection dropped mid-answer: the retry streams the answer anew.
            raise TransientError(f"LLM API unreachable: {exc!r}") from exc
        memory = state["memory"] if isinstance(state["memory"], dict) else {}
        memory = {
            **memory,
            "turns": int(memory.get("turns", 0)) + 1,
            "tokens": int(memory.get("tokens", 0)) + tokens,
        }
        return {**state, "step": "CHATTING", "memory": memory}, reply


def conversation(state: dict[str, Any], text: str) -> list[dict[str, str]]:
    """The system prompt, the last HISTORY_TURNS turns, then the new message."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for turn in state.get("history", [])[-HISTORY_TURNS:]:
        messages.append({"role": "user", "content": turn["user"]})
        messages.append({"role": "assistant", "content": turn["bot"]})
    messages.append({"role": "user", "content": text})
    return messages


async def read_stream(response: httpx.Response) -> tuple[str, int]:
    """Server-sent chunks (``data: {...}`` lines, then ``data: [DONE]``): each piece of text
    is emitted as it comes; returns the whole text and the tokens used."""
    pieces: list[str] = []
    tokens = 0
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
            usage = chunk.get("usage") or {}
            tokens = int(usage.get("total_tokens", tokens))
        except (ValueError, AttributeError, TypeError) as exc:
            raise TransientError(f"LLM API sent an unreadable chunk: {data[:200]}") from exc
        if isinstance(piece, str) and piece:
            emit(piece)
            pieces.append(piece)
    reply = "".join(pieces)
    if not reply.strip():
        raise TransientError("LLM API answered with an empty reply")
    return reply, tokens


def parse_completion(response: httpx.Response) -> tuple[str, int]:
    """The reply text and the tokens used. An answer without a reply is an upstream hiccup:
    worth another try."""
    try:
        data = response.json()
        reply = data["choices"][0]["message"]["content"]
        tokens = int((data.get("usage") or {}).get("total_tokens", 0))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise TransientError(f"LLM API answered without a reply: {response.text[:200]}") from exc
    if not isinstance(reply, str) or not reply.strip():
        raise TransientError("LLM API answered with an empty reply")
    return reply, tokens


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
