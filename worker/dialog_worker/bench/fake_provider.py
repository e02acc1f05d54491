"""A fake model provider: a real HTTP server with an OpenAI-compatible chat completions API
that enforces requests and tokens per minute, for the tests, the benchmark and the examples.

    python -m dialog_worker.bench.fake_provider --port 8400 --rpm 60 --tpm 100000

``POST /v1/chat/completions`` answers like OpenAI: with ``"stream": true`` server-sent events
(the role, the text in pieces, a last chunk with ``usage`` when ``stream_options.include_usage``
is set, then ``[DONE]``), else one JSON object with ``usage``. Its answer has ``max_tokens``
tokens (default ``--output-tokens``), one word each; a prompt counts one token per 4 bytes of
its messages' text (at least 1). Limits are per model, as providers meter them: a token bucket
of ``--rpm`` requests and one of ``--tpm`` tokens (prompt plus ``max_tokens``, charged when the
request arrives), each holding a minute's worth and refilling continuously. A request over
either is answered 429 with ``Retry-After`` (whole seconds until it would pass) and counted.

Operators of a test or a benchmark: ``GET /stats`` (counts per model and the log of every
request: arrival time, model, status, tokens, how many messages its conversation holds),
``POST /admin/throttle`` ``{"model": m, "for_s": N}`` (answer 429 with ``Retry-After`` for N
s: an incident at the provider; with ``"retry_after": "0"`` every 429 of the incident carries
that header text instead, as a provider that says ``0``, a negative number, a past date or
something unreadable does), ``POST /admin/outage`` ``{"model": m, "for_s": N, "status":
503}`` (answer that status for N s, using nothing: the provider is down), ``POST
/admin/limits`` ``{"rpm": R, "tpm": T}`` and ``POST /admin/reset``.

Tool calls, for agents (the OpenAI Agents SDK, Pydantic AI, LangGraph): a request that offers
``tools`` and whose last message is the user's answers with a call of every offered tool whose
name the user's text contains as a word, in the order they appear, each with a fresh id
(``call_`` and 24 hex digits, as OpenAI's are random) and arguments read from the text: a
``name=value`` pair for a parameter, else the words after the tool's name, one per required
parameter, in order (numbers and booleans as the schema's type says). The request after the
tools ran (its last message a ``tool`` result) is answered with text that starts with that
result, so an agent's final answer shows what its tool returned. A stream a client leaves
before its end (a cancelled run) is counted in ``/stats`` as ``aborted``.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Most requests the log keeps (a benchmark of minutes stays far below).
MAX_LOG = 200_000


class Bucket:
    """A token bucket holding up to ``per_minute`` that refills continuously (0: no limit)."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute)
        self.at = now

    def _refill(self, now: float) -> None:
        if self.per_minute:
            rate = self.per_minute / 60.0
            self.level = min(float(self.per_minute), self.level + (now - self.at) * rate)
        self.at = now

    def wait_s(self, amount: int, now: float) -> float:
        """Seconds until ``amount`` fits (0: now)."""
        self._refill(now)
        if not self.per_minute:
            return 0.0
        needed = min(amount, self.per_minute) - self.level
        return 0.0 if needed <= 0 else needed / (self.per_minute / 60.0)

    def take(self, amount: int) -> None:
        if self.per_minute:
            self.level -= amount


class Provider:
    """The provider's state: limits per model, counts and the request log (thread-safe)."""

    def __init__(
        self,
        rpm: int = 0,
        tpm: int = 0,
        output_tokens: int = 20,
        latency_ms: int = 50,
        chunks: int = 5,
    ) -> None:
        self.rpm, self.tpm = rpm, tpm
        self.output_tokens = output_tokens
        self.latency_ms = latency_ms
        self.chunks = chunks
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.buckets: dict[str, tuple[Bucket, Bucket]] = {}
            self.throttled_until: dict[str, float] = {}
            self.throttle_header: dict[str, str] = {}
            self.outage: dict[str, tuple[float, int]] = {}  # model -> (until, status)
            self.log: list[dict[str, Any]] = []
            self.counts: dict[str, dict[str, int]] = {}
            self.aborted = 0  # streams the client left before their end

    def set_limits(self, rpm: int, tpm: int) -> None:
        with self.lock:
            self.rpm, self.tpm = rpm, tpm
            self.buckets = {}

    def throttle(self, model: str, for_s: float, retry_after: str | None = None) -> None:
        """Answer ``model``'s calls 429 for ``for_s`` seconds, with ``Retry-After`` the seconds
        left, or ``retry_after`` as it is given."""
        with self.lock:
            self.throttled_until[model] = time.time() + for_s
            if retry_after is None:
                self.throttle_header.pop(model, None)
            else:
                self.throttle_header[model] = retry_after

    def fail(self, model: str, for_s: float, status: int = 503) -> None:
        """Answer ``model``'s calls with ``status`` for ``for_s`` seconds (an outage)."""
        with self.lock:
            self.outage[model] = (time.time() + for_s, status)

    def down(self, model: str) -> int | None:
        """The status of an outage in course (the call is logged with it), or None."""
        now = time.time()
        with self.lock:
            until, status = self.outage.get(model, (0.0, 0))
            if until <= now:
                return None
            if len(self.log) < MAX_LOG:
                self.log.append({"t": now, "model": model, "tokens": 0, "status": status})
            return status

    def retry_after(self, model: str, wait_s: float) -> str:
        """The Retry-After header of a 429 that asks to wait ``wait_s``."""
        with self.lock:
            if self.throttled_until.get(model, 0.0) > time.time() and model in self.throttle_header:
                return self.throttle_header[model]
        return str(max(1, math.ceil(wait_s)))

    def admit(self, model: str, tokens: int, messages: int = 0) -> float | None:
        """None: admitted (and charged); else the Retry-After to answer (seconds).
        ``messages``: how many the request's conversation holds (logged)."""
        now = time.time()
        with self.lock:
            counts = self.counts.setdefault(
                model, {"calls": 0, "rate_limited": 0, "prompt_tokens": 0, "completion_tokens": 0}
            )
            entry = {"t": now, "model": model, "tokens": tokens, "messages": messages}
            if len(self.log) < MAX_LOG:
                self.log.append(entry)
            until = self.throttled_until.get(model, 0.0)
            if until > now:
                wait = until - now
            else:
                requests, token_bucket = self.buckets.setdefault(
                    model, (Bucket(self.rpm, now), Bucket(self.tpm, now))
                )
                wait = max(requests.wait_s(1, now), token_bucket.wait_s(tokens, now))
                if wait <= 0:
                    requests.take(1)
                    token_bucket.take(tokens)
            if wait > 0:
                counts["rate_limited"] += 1
                entry["status"] = 429
                return wait
            counts["calls"] += 1
            entry["status"] = 200
            return None

    def used(self, model: str, prompt: int, completion: int) -> None:
        with self.lock:
            counts = self.counts[model]
            counts["prompt_tokens"] += prompt
            counts["completion_tokens"] += completion

    def stream_aborted(self) -> None:
        with self.lock:
            self.aborted += 1

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "rpm": self.rpm,
                "tpm": self.tpm,
                "aborted": self.aborted,
                "models": {m: dict(c) for m, c in self.counts.items()},
                "log": list(self.log),
            }


def prompt_tokens(body: dict[str, Any]) -> int:
    size = 0
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            size += len(message["content"].encode("utf-8"))
    return max(1, math.ceil(size / 4))


# Tool calls (see the module's docstring): the longest text read for a tool's arguments, and the
# most calls one answer makes.
MAX_TOOL_TEXT = 2000
MAX_TOOL_CALLS = 8


def tool_calls(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool calls answering ``body``: none unless it offers tools and its last message is
    the user's; then one per offered tool named (as a word) in the user's text."""
    messages = body.get("messages") or []
    tools = body.get("tools")
    if not isinstance(tools, list) or not messages or not isinstance(messages[-1], dict):
        return []
    last = messages[-1]
    if last.get("role") != "user":
        return []
    text = _text(last.get("content"))[:MAX_TOOL_TEXT]
    words = text.split()
    found: list[tuple[int, dict[str, Any]]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            if function["name"] in words:
                found.append((words.index(function["name"]), function))
    calls = []
    for at, function in sorted(found, key=lambda f: f[0])[:MAX_TOOL_CALLS]:
        arguments = tool_arguments(function.get("parameters"), words, at)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": function["name"], "arguments": json.dumps(arguments)},
            }
        )
    return calls


def tool_arguments(schema: Any, words: list[str], at: int) -> dict[str, Any]:
    """Arguments for a tool named at ``words[at]``: ``name=value`` pairs anywhere in the text,
    else the words after the name, one per required parameter in order."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return {}
    required = schema.get("required")
    names = [n for n in properties if not isinstance(required, list) or n in required]
    pairs = dict(w.split("=", 1) for w in words if "=" in w)
    following = iter(w for w in words[at + 1 :] if "=" not in w)
    arguments: dict[str, Any] = {}
    for name in names:
        raw = pairs.get(name)
        if raw is None:
            raw = next(following, "1")
        spec = properties[name] if isinstance(properties[name], dict) else {}
        arguments[name] = _typed(raw.strip(".,!?"), spec.get("type"))
    return arguments


def _typed(raw: str, kind: Any) -> Any:
    try:
        if kind == "integer":
            return int(raw)
        if kind == "number":
            return float(raw)
    except ValueError:
        return 1
    if kind == "boolean":
        return raw.lower() not in ("false", "no", "0")
    return raw


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def answer_words(n: int, last: str) -> list[str]:
    words = [f"w{i}" for i in range(max(1, n))]
    words[0] = f"({last[:40]})" if last else words[0]
    return words


def serve(provider: Provider, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A server for ``provider`` (call ``serve_forever`` on it, in a thread or not)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path == "/stats":
                self._json(200, provider.stats())
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                self._json(400, {"error": {"message": "body is not JSON"}})
                return
            if not isinstance(body, dict):
                self._json(400, {"error": {"message": "body is not an object"}})
            elif self.path == "/v1/chat/completions":
                self._completion(body)
            elif self.path == "/admin/throttle":
                header = body.get("retry_after")
                provider.throttle(
                    str(body.get("model", "")),
                    float(body.get("for_s", 1)),
                    None if header is None else str(header),
                )
                self._json(200, {"ok": True})
            elif self.path == "/admin/outage":
                provider.fail(
                    str(body.get("model", "")),
                    float(body.get("for_s", 1)),
                    int(body.get("status", 503)),
                )
                self._json(200, {"ok": True})
            elif self.path == "/admin/limits":
                provider.set_limits(int(body.get("rpm", 0)), int(body.get("tpm", 0)))
                self._json(200, {"ok": True})
            elif self.path == "/admin/reset":
                provider.reset()
                self._json(200, {"ok": True})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def _completion(self, body: dict[str, Any]) -> None:
            model = str(body.get("model") or "model")
            status = provider.down(model)
            if status is not None:
                self._json(status, {"error": {"message": "provider down", "type": "outage"}})
                return
            prompt = prompt_tokens(body)
            completion = body.get("max_tokens")
            if not isinstance(completion, int) or completion < 1:
                completion = provider.output_tokens
            conversation = body.get("messages")
            size = len(conversation) if isinstance(conversation, list) else 0
            wait = provider.admit(model, prompt + completion, size)
            if wait is not None:
                self._json(
                    429,
                    {"error": {"message": "rate limit reached", "type": "rate_limit"}},
                    {"Retry-After": provider.retry_after(model, wait)},
                )
                return
            messages = body.get("messages") or [{}]
            last = _text(messages[-1].get("content")) if isinstance(messages[-1], dict) else ""
            calls = tool_calls(body)
            if calls:
                self._tool_calls(model, body, calls, prompt)
                return
            words = answer_words(completion, last)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": len(words),
                "total_tokens": prompt + len(words),
            }
            provider.used(model, prompt, len(words))
            if body.get("stream"):
                options = body.get("stream_options") or {}
                self._stream(model, words, usage if options.get("include_usage") else None)
                return
            time.sleep(provider.latency_ms / 1000)
            self._json(
                200,
                {
                    "id": "fake",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": " ".join(words)},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                },
            )

        def _tool_calls(
            self, model: str, body: dict[str, Any], calls: list[dict[str, Any]], prompt: int
        ) -> None:
            """An answer that calls tools (no text), streamed or not."""
            completion = sum(1 + len(c["function"]["arguments"]) // 4 for c in calls)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            provider.used(model, prompt, completion)
            if body.get("stream"):
                options = body.get("stream_options") or {}
                deltas = [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]
                self._events(
                    model, deltas, "tool_calls", usage if options.get("include_usage") else None
                )
                return
            time.sleep(provider.latency_ms / 1000)
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            self._json(
                200,
                {
                    "id": "fake",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                    "usage": usage,
                },
            )

        def _stream(self, model: str, words: list[str], usage: dict[str, int] | None) -> None:
            deltas = [{"content": piece} for piece in _pieces(words, provider.chunks)]
            self._events(model, deltas, "stop", usage)

        def _events(
            self,
            model: str,
            deltas: list[dict[str, Any]],
            finish_reason: str,
            usage: dict[str, int] | None,
        ) -> None:
            """Server-sent chunks: the role, ``deltas`` spread over the latency, the finish
            reason, the usage (if asked for), then ``[DONE]``."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            delay = provider.latency_ms / 1000 / max(1, len(deltas))

            def send(chunk: dict[str, Any] | str) -> None:
                data = chunk if isinstance(chunk, str) else json.dumps(chunk)
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()

            base = {"id": "fake", "object": "chat.completion.chunk", "model": model}
            try:
                send({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                for delta in deltas:
                    time.sleep(delay)
                    send({**base, "choices": [{"index": 0, "delta": delta}]})
                end = {"index": 0, "delta": {}, "finish_reason": finish_reason}
                send({**base, "choices": [end]})
                if usage is not None:
                    send({**base, "choices": [], "usage": usage})
                send("[DONE]")
            except OSError:  # the client went away (a cancelled run): stop writing
                provider.stream_aborted()

        def _json(self, status: int, doc: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = _Server((host, port), Handler)
    server.daemon_threads = True
    return server


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: a burst of more connections than that waits for a
    # SYN retry (1 s), and calls made at once would reach the provider a second apart.
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that closed its kept-alive connection is no error worth a traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def _pieces(words: list[str], n: int) -> Iterator[str]:
    size = max(1, math.ceil(len(words) / max(1, n)))
    for i in range(0, len(words), size):
        yield ("" if i == 0 else " ") + " ".join(words[i : i + size])


class Running:
    """A provider served in a thread of this process: ``with Running(rpm=60) as p: p.url``."""

    def __init__(self, **options: Any) -> None:
        self.provider = Provider(**options)
        self.server = serve(self.provider)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Running:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dialog_worker.bench.fake_provider")
    p.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8400, help="port (default 8400; 0: any)")
    p.add_argument("--rpm", type=int, default=0, help="requests per minute per model (0: none)")
    p.add_argument("--tpm", type=int, default=0, help="tokens per minute per model (0: none)")
    p.add_argument("--output-tokens", type=int, default=20, help="answer length without max_tokens")
    p.add_argument("--latency-ms", type=int, default=50, help="time to answer (ms)")
    args = p.parse_args(argv)
    provider = Provider(args.rpm, args.tpm, args.output_tokens, args.latency_ms)
    server = serve(provider, args.host, args.port)
    # Ctrl-C and SIGTERM (a supervisor, a container's stop) end it cleanly, also when it was
    # started as a script's background job, which inherits SIGINT ignored.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, _interrupt)
    print(json.dumps({"url": f"http://{args.host}:{server.server_address[1]}"}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
