"""The slot gate of a shard: a freed slot goes to a waiting resumer before a waiting reader,
and a waiter cancelled while (or just after) being handed a slot loses none."""

from __future__ import annotations

import anyio
import pytest

from dialog_worker.daemon import SlotGate

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_freed_slot_goes_to_the_priority_waiter_before_an_earlier_plain_one() -> None:
    gate = SlotGate(1)
    gate.acquire_nowait()
    order: list[str] = []

    async def take(name: str, priority: bool) -> None:
        await gate.acquire(priority=priority)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "reader", False)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(take, "resumer", True)
        await anyio.wait_all_tasks_blocked()
        gate.release()
        await anyio.wait_all_tasks_blocked()
        assert order == ["resumer"]
        gate.release()
    assert order == ["resumer", "reader"]
    assert gate.free == 0


async def test_a_cancelled_waiter_leaves_no_slot_behind() -> None:
    gate = SlotGate(1)
    gate.acquire_nowait()
    with anyio.move_on_after(0.05):
        await gate.acquire(priority=True)
    gate.release()
    assert gate.free == 1
    gate.acquire_nowait()
    with pytest.raises(anyio.WouldBlock):
        gate.acquire_nowait()
