"""dialog_worker.ops.verify.check judges the integration and fault tests and `dialog-worker
verify`: it
must see every kind of violation, also in a session longer than DIALOG_HISTORY_LIMIT, whose
early turns are no longer in its state. On fakeredis: the state and the reply events are
written by hand, as the commits would write them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from fakeredis.aioredis import FakeRedis

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.ops.verify import Sent, check

LIMIT = 3
SENT = [Sent("long", seq, f"m{seq}", f"pesan {seq}") for seq in range(1, 8)]


@pytest_asyncio.fixture
async def client() -> AsyncIterator[DialogClient]:
    c = DialogClient("redis://127.0.0.1:1/0", history_limit=LIMIT)
    c.redis = FakeRedis(decode_responses=True)
    c._prepared = c._checked = True  # no server to ask for its topology
    yield c
    await c.redis.aclose()


async def commits(client: DialogClient, applied: list[int]) -> None:
    """What the workers leave when they applied these seqs, in this order."""
    for seq in applied:
        await client.redis.xadd(
            client.keys.replies,
            {"session_id": "long", "msg_id": f"m{seq}", "seq": str(seq), "outcome": "applied"},
        )
    history = [{"seq": s, "msg_id": f"m{s}", "user": "", "bot": ""} for s in applied][-LIMIT:]
    state = {"history": history, "applied_seq": applied[-1], "version": len(applied)}
    await client.redis.hset(client.keys.session("long").state, "d", json.dumps(state))


async def test_a_session_applied_in_order_passes(client):
    await commits(client, [1, 2, 3, 4, 5, 6, 7])
    assert await check(client, SENT) == []


async def test_a_reordering_before_the_kept_history_is_found(client):
    await commits(client, [2, 1, 3, 4, 5, 6, 7])  # the last three turns look right
    [problem] = await check(client, SENT)
    assert "long: applied out of order" in problem


@pytest.mark.parametrize(
    ("applied", "found"),
    [
        ([1, 2, 2, 3, 4, 5, 6, 7], "more than one reply"),
        ([1, 3, 4, 5, 6, 7], "without a reply"),
        ([1, 2, 3, 4, 5, 6], "applied_seq 6 != 7"),
    ],
)
async def test_an_early_message_applied_twice_or_never_is_found(client, applied, found):
    await commits(client, applied)
    assert any(found in p for p in await check(client, SENT)), await check(client, SENT)
