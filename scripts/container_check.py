"""The Python half of scripts/container-check.sh: runs inside containers of the built image.

It relies only on the public surfaces (CONTRACT.md): `DialogClient().send/state`, the state
JSON, the default stream names and `DIALOG_ENGINE`. Three roles:

- `engine`: the engine the burst's worker containers run (`DIALOG_ENGINE=container_check:engine`,
  this file mounted on PYTHONPATH). Each step sleeps CHECK_STEP_DELAY_S (default 0.2 s) and
  echoes the text, so a session's ten messages take at least two seconds and the SIGTERM the
  script sends mid-burst finds the worker with steps in hand.
- `burst`: N sessions x M messages ("m0", "m1", ...): each session sends its messages one after
  another, awaiting each send, all sessions at once; then waits until every session's
  `applied_seq` is M. Prints {"sent": {session: [msg_id, ...]}} on stdout, progress on stderr.
- `verify`: reads that JSON on stdin once every worker has stopped, so nothing can change any
  more, and checks exactly-once and order: each session's state holds M history entries with
  the sent texts and msg_ids in send order and `applied_seq` M; the reply stream holds exactly
  one applied reply per message, in order; nothing was dead-lettered; nothing is left pending.
  Prints one JSON line; exit 1 on any problem.

Runs with the image's own interpreter (`podman run --entrypoint python IMAGE
/opt/dialog-check/container_check.py burst ...`); REDIS_URL comes from the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

# Default names (CONTRACT section 2: every name derives from the stream `dialog`).
STREAM = "dialog"
GROUP = "dialog-workers"
REPLY_STREAM = "dialog-replies"
DLQ_STREAM = "dialog-dlq"

STEP_DELAY_S = float(os.environ.get("CHECK_STEP_DELAY_S", "0.2"))


class SlowEcho:
    """Echoes the text after a pause; owns `step` and nothing else of the state."""

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        await asyncio.sleep(STEP_DELAY_S)
        return {**state, "step": "ECHO"}, f"echo {message['text']}"


def engine() -> SlowEcho:
    """Zero-argument factory for DIALOG_ENGINE=container_check:engine."""
    return SlowEcho()


def texts(messages: int) -> list[str]:
    return [f"m{i}" for i in range(messages)]


def progress(**fields: Any) -> None:
    print(json.dumps(fields), file=sys.stderr, flush=True)


async def burst(sessions: int, messages: int, prefix: str, timeout_s: float) -> int:
    from dialog_worker.client.dialog_client import DialogClient

    ids = [f"{prefix}-{i:03d}" for i in range(sessions)]
    sent: dict[str, list[str]] = {}
    async with DialogClient() as client:

        async def one_session(session_id: str) -> None:
            sent[session_id] = []
            for text in texts(messages):
                result = await client.send(session_id, text)
                sent[session_id].append(result.msg_id)

        started = time.monotonic()
        await asyncio.gather(*(one_session(s) for s in ids))
        progress(
            event="sent", messages=sessions * messages, seconds=round(time.monotonic() - started, 2)
        )

        deadline = started + timeout_s
        while True:
            states = await asyncio.gather(*(client.state(s) for s in ids))
            applied = sum(int((st or {}).get("applied_seq", 0)) for st in states)
            if applied >= sessions * messages:
                break
            if time.monotonic() > deadline:
                progress(event="timeout", applied=applied, expected=sessions * messages)
                return 1
            await asyncio.sleep(0.2)
        progress(event="applied", messages=applied, seconds=round(time.monotonic() - started, 2))
    print(json.dumps({"sent": sent}), flush=True)
    return 0


def text_of(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def verify(sent: dict[str, list[str]], messages: int) -> int:
    import redis.asyncio as aioredis

    from dialog_worker.client.dialog_client import DialogClient

    problems: list[str] = []
    expected_texts = texts(messages)
    applied_total = 0
    async with DialogClient() as client:
        for session_id, msg_ids in sent.items():
            state = await client.state(session_id)
            if state is None:
                problems.append(f"{session_id}: no state")
                continue
            history = state.get("history", [])
            applied_total += int(state.get("applied_seq", 0))
            if state.get("applied_seq") != messages:
                problems.append(
                    f"{session_id}: applied_seq {state.get('applied_seq')} != {messages}"
                )
            if [h.get("user") for h in history] != expected_texts:
                problems.append(f"{session_id}: history texts {[h.get('user') for h in history]}")
            if [h.get("msg_id") for h in history] != msg_ids:
                problems.append(f"{session_id}: history msg_ids differ from the sent ones")
            if [h.get("bot") for h in history] != [f"echo {t}" for t in expected_texts]:
                problems.append(f"{session_id}: history replies {[h.get('bot') for h in history]}")

    r = aioredis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        replies: dict[str, list[dict[str, str]]] = {}
        other_outcomes: list[str] = []
        start = "-"
        while True:
            page = await r.xrange(REPLY_STREAM, min=start, max="+", count=1000) or []
            for _entry_id, raw in page:
                fields = {text_of(k): text_of(v) for k, v in (raw or {}).items()}
                outcome = fields.get("outcome", "applied")  # v1 events carry no outcome
                if outcome != "applied":
                    other_outcomes.append(f"{fields.get('session_id')}:{outcome}")
                    continue
                replies.setdefault(fields.get("session_id", "?"), []).append(fields)
            if len(page) < 1000:
                break
            start = "(" + text_of(page[-1][0])
        reply_total = sum(len(v) for v in replies.values())
        for session_id, msg_ids in sent.items():
            got = replies.get(session_id, [])
            if [f.get("msg_id") for f in got] != msg_ids:
                problems.append(
                    f"{session_id}: {len(got)} applied replies, not one per message in order"
                )
            elif [f.get("reply") for f in got] != [f"echo {t}" for t in expected_texts]:
                problems.append(f"{session_id}: reply texts {[f.get('reply') for f in got]}")
        strangers = sorted(set(replies) - set(sent))
        if strangers:
            problems.append(f"replies for sessions nobody sent to: {strangers[:5]}")
        if other_outcomes:
            problems.append(f"non-applied reply events: {other_outcomes[:10]}")
        dead_letters = await r.xlen(DLQ_STREAM) if await r.exists(DLQ_STREAM) else 0
        if dead_letters:
            problems.append(f"{dead_letters} dead letters")
        pending = 0
        if await r.exists(STREAM):
            summary = await r.xpending(STREAM, GROUP)
            pending = int(summary["pending"])
        if pending:
            problems.append(f"{pending} entries still pending in {STREAM}/{GROUP}")
    finally:
        await r.aclose()

    expected = len(sent) * messages
    print(
        json.dumps(
            {
                "sessions": len(sent),
                "expected": expected,
                "applied": applied_total,
                "replies": reply_total,
                "dead_letters": dead_letters,
                "pending": pending,
                "problems": problems[:20],
                "problem_count": len(problems),
            }
        ),
        flush=True,
    )
    return 1 if problems or applied_total != expected else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("burst", help="send the burst and wait until it is applied")
    b.add_argument("--sessions", type=int, default=50)
    b.add_argument("--messages", type=int, default=10)
    b.add_argument("--prefix", default="burst")
    b.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the burst")
    v = sub.add_parser("verify", help="check exactly-once and order (JSON from `burst` on stdin)")
    v.add_argument("--messages", type=int, default=10)
    args = parser.parse_args()
    if args.command == "burst":
        return asyncio.run(burst(args.sessions, args.messages, args.prefix, args.timeout))
    sent = json.load(sys.stdin)["sent"]
    return asyncio.run(verify(sent, args.messages))


if __name__ == "__main__":
    sys.exit(main())
