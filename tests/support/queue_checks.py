"""What a drained v2 deployment looks like in Redis, shard by shard, for the fault and
integration tests: nothing left in any inbound stream, nothing pending in any group (intake
acks in the same script, so nothing should ever be), no session in any ready set, no lock, no
session with a sequenced message it has not applied (state field `s` > `a`), and every idle
session's state carrying its idle TTL (a state without one would never expire).

Plain test support code: it reads the key names from the client's topology
(dialog_worker/store/keys.py) and nothing else of the product."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis.exceptions
from redis_server import wait_until_async

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.store.keys import Keys


async def _scan(r: Any, pattern: str) -> list[str]:
    return [key async for key in r.scan_iter(match=pattern, count=1000)]


async def leftovers(client: DialogClient) -> dict[str, int]:
    """Counts over every shard of the client's deployment (all zero when drained; `dlq` is
    reported but is the caller's business)."""
    r = client.redis
    found = dict.fromkeys(
        ("stream", "pending", "ready", "locks", "outstanding", "no_ttl", "dlq"), 0
    )
    for k in client.topology.shards:
        found["stream"] += await r.xlen(k.stream)
        try:
            found["pending"] += (await r.xpending(k.stream, k.group))["pending"]
        except redis.exceptions.ResponseError:  # no stream or group yet: nothing pending
            pass
        found["ready"] += await r.zcard(k.ready)
        found["dlq"] += await r.xlen(k.dlq)
        # The escaped session id sits between braces: "{*}:lock" cannot match a dedupe key
        # unless a msg_id itself contains "}:lock" (no test uses such an id).
        found["locks"] += len(await _scan(r, f"{k.session_prefix}{{*}}:lock"))
        for state in await _scan(r, f"{k.session_prefix}{{*}}:state"):
            if await r.type(state) != "hash":  # a corrupt key some test wrote on purpose
                continue
            applied, last = await r.hmget(state, "a", "s")
            if int(last or 0) > int(applied or 0):
                found["outstanding"] += 1
            elif await r.ttl(state) < 0:
                found["no_ttl"] += 1
    return found


async def assert_drained(
    client: DialogClient, timeout_s: float = 30, dlq: int | None = 0
) -> dict[str, int]:
    """Poll until everything but the DLQ is empty (and the DLQ holds `dlq` entries, unless
    None); fail with the last counts at the deadline."""
    last: dict[str, int] = {}

    async def drained() -> bool:
        nonlocal last
        last = await leftovers(client)
        rest = {k: v for k, v in last.items() if k != "dlq"}
        return not any(rest.values()) and (dlq is None or last["dlq"] == dlq)

    try:
        await wait_until_async(
            drained, timeout_s, "streams, pending lists, ready sets, locks and sessions to drain"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last}") from None
    return last


async def lock_holders(client: DialogClient) -> dict[str, str]:
    """Session lock key -> the consumer name its token starts with (tokens are
    "<consumer>:<nonce>:<call>:<n>", dialog_worker/daemon/worker.py)."""
    holders = {}
    for k in client.topology.shards:
        for key in await _scan(client.redis, f"{k.session_prefix}{{*}}:lock"):
            token = await client.redis.get(key)
            if token is not None:
                holders[key] = token.split(":", 1)[0]
    return holders


async def wait_consumers_idle(r: Any, shards: Iterable[Keys], threshold_ms: int) -> None:
    """Until every consumer of every shard's group has been idle for `threshold_ms` (stopped
    workers: what `reshard` waits to see, dialog_worker.ops.reshard.idle_threshold_ms)."""
    shards = list(shards)

    async def idle() -> bool:
        for keys in shards:
            try:
                consumers = await r.xinfo_consumers(keys.stream, keys.group)
            except redis.exceptions.ResponseError:  # no stream or group
                continue
            if any(int(c["idle"]) < threshold_ms for c in consumers):
                return False
        return True

    await wait_until_async(idle, 10 + threshold_ms / 1000, "consumers idle", interval_s=0.05)
