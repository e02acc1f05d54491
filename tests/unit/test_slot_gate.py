"""The slot gate of a shard: a freed slot goes to a waiting resumer before a waiting reader,
and a waiter cancelled while (or just after) being handed a slot loses none."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from dialog_worker.daemon.slots import TURN_AFTER_S, SlotGate, take_turns

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def reader_then_resumer_waiting(gate: SlotGate) -> AsyncIterator[list[str]]:
    """A plain waiter ("reader") then a priority one ("resumer") wait on ``gate``; yields the
    order in which they got their slots, and leaves once both have one."""
    order: list[str] = []

    async def take(name: str, priority: bool) -> None:
        await gate.acquire(priority=priority)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "reader", False)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(take, "resumer", True)
        await anyio.wait_all_tasks_blocked()
        yield order


async def test_a_freed_slot_goes_to_the_priority_waiter_before_an_earlier_plain_one() -> None:
    gate = SlotGate(1)
    gate.acquire_nowait()
    async with reader_then_resumer_waiting(gate) as order:
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


async def test_a_slow_session_gives_its_slot_to_a_waiting_reader_and_queues_behind() -> None:
    gate = SlotGate(1)
    gate.acquire_nowait()  # the session's slot
    order: list[str] = []

    async def reader() -> None:
        await gate.acquire()
        order.append("reader")
        await anyio.sleep(0.01)
        gate.release()

    async def session() -> None:
        await take_turns(gate, TURN_AFTER_S)
        order.append("session")
        gate.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        assert gate.contended
        tg.start_soon(session)
    assert order == ["reader", "session"]
    assert gate.free == 1 and not gate.contended


@pytest.mark.parametrize(("took_s", "stopping"), [(TURN_AFTER_S / 2, False), (TURN_AFTER_S, True)])
async def test_a_fast_step_or_a_stopping_worker_keeps_the_slot(
    took_s: float, stopping: bool
) -> None:
    gate = SlotGate(1)
    gate.acquire_nowait()
    order: list[str] = []

    async def reader() -> None:
        await gate.acquire()
        order.append("reader")
        gate.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        await take_turns(gate, took_s, stopping=stopping)
        order.append("session")
        gate.release()
    assert order == ["session", "reader"]


async def test_no_turn_without_anyone_waiting() -> None:
    gate = SlotGate(2)
    gate.acquire_nowait()
    assert not gate.contended
    with anyio.fail_after(1):
        await take_turns(gate, 10.0)
    assert gate.free == 1


async def test_slots_given_back_together_go_to_the_waiters_first_then_become_free() -> None:
    """An intake call gives back at once the slots it did not fill: the waiting resumer and
    reader get one each (the resumer first), the rest are free."""
    gate = SlotGate(4)
    assert gate.take(10) == 4
    async with reader_then_resumer_waiting(gate) as order:
        gate.release(1)
        await anyio.wait_all_tasks_blocked()
        assert order == ["resumer"]
        gate.release(3)
    assert order == ["resumer", "reader"]
    assert gate.free == 2
    assert gate.take(1) == 1 and gate.take(5) == 1 and gate.take(1) == 0
