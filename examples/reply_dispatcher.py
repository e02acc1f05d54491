"""Deliver every reply to a webhook: read the reply streams through the consumer group
"outbound", POST each reply as JSON, acknowledge it only after a 2xx answer.

    REDIS_URL=redis://replies:...@redis:6379/0 \\
    .venv/bin/python examples/reply_dispatcher.py https://chat.example.com/hooks/bot-replies

Run as many copies as you like: the group shares the replies out between them. The group is
created at the start of the reply streams, not at "now": replies written before the first copy
ever started are delivered too.

Each message gets one answer. A copy that dies leaves its unacknowledged replies to the others
once they are idle for --claim-idle-s, so a reply can arrive twice (at least once, never lost):
each POST carries an Idempotency-Key derived from (session_id, msg_id), the same for every
delivery of that message's answer, for the receiver to drop repeats. A message sent again with
the same msg_id gets a second event with outcome "duplicate" (the original's reply repeated);
it is acknowledged without a POST: the original event, earlier in the same stream, is the
answer.

A failed POST (connection error, timeout, 408, 429, 5xx) is retried with capped backoff
until it succeeds, which holds back the replies behind it: they stay in order, and nothing
is acknowledged that was not delivered. A 4xx that repeating cannot fix is logged and
acknowledged, so one refused reply does not stop the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import signal
import sys

import anyio
import httpx

from dialog_worker import DialogClient, Reply

log = logging.getLogger("reply_dispatcher")

RETRYABLE_STATUS = {408, 425, 429}


def idempotency_key(reply: Reply) -> str:
    """The same for every event that answers one (session_id, msg_id); header-safe (ids may
    hold any printable unicode)."""
    pair = json.dumps([reply.session_id, reply.msg_id], ensure_ascii=False)
    return hashlib.sha256(pair.encode("utf-8")).hexdigest()


async def deliver(http: httpx.AsyncClient, url: str, reply: Reply, max_backoff_s: float) -> bool:
    """POST until the webhook takes it; False if it refused it for good."""
    delay_s = 0.1
    while True:
        try:
            response = await http.post(
                url, json=reply.as_dict(), headers={"Idempotency-Key": idempotency_key(reply)}
            )
        except httpx.HTTPError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        else:
            if response.is_success:
                return True
            if response.status_code < 500 and response.status_code not in RETRYABLE_STATUS:
                log.error("webhook refused reply %s: %s", reply.id, response.status_code)
                return False
            problem = f"HTTP {response.status_code}"
        log.warning("reply %s not delivered (%s); retrying in %.1f s", reply.id, problem, delay_s)
        await anyio.sleep(delay_s * random.uniform(0.5, 1.0))
        delay_s = min(delay_s * 2, max_backoff_s)


async def dispatch(
    client: DialogClient,
    url: str,
    *,
    group: str = "outbound",
    consumer: str | None = None,
    claim_idle_s: float = 60,
    timeout_s: float = 10,
    max_backoff_s: float = 30,
) -> None:
    async with (
        httpx.AsyncClient(timeout=timeout_s) as http,
        # start="0": a group created now still gets every reply the streams hold.
        client.replies(
            group=group, consumer=consumer, start="0", claim_idle_ms=int(claim_idle_s * 1000)
        ) as replies,
    ):
        log.info("delivering replies to %s as %s/%s", url, group, replies.consumer)
        async for reply in replies:
            if reply.outcome == "duplicate":
                log.info("reply %s repeats the answer to %s; not posted", reply.id, reply.msg_id)
            else:
                await deliver(http, url, reply, max_backoff_s)
            await client.ack(reply)


async def run(args: argparse.Namespace) -> None:
    async with DialogClient() as client, anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()  # unacknowledged replies go to another copy
                    return

        tg.start_soon(stop_on_signal)
        await dispatch(
            client,
            args.url,
            group=args.group,
            consumer=args.consumer,
            claim_idle_s=args.claim_idle_s,
            timeout_s=args.timeout_s,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="webhook URL that receives each reply as a JSON POST")
    parser.add_argument("--group", default="outbound", help="consumer group (default outbound)")
    parser.add_argument("--consumer", help="this copy's name in the group (default hostname-pid)")
    parser.add_argument(
        "--claim-idle-s",
        type=float,
        default=60,
        help="take over replies another copy left unacknowledged this long (default 60)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=10, help="timeout of one POST (default 10)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    anyio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
