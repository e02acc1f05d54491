"""A shard's message slots: how many sessions a worker works at once, who gets a freed slot
first (the resumer, then the reader), and how sessions with slow steps take turns."""

from __future__ import annotations

import dataclasses
from collections import deque

import anyio
import anyio.lowlevel

# A session whose message took at least this long gives its slot up between messages when
# others wait for one (Sessions.take_turns).
TURN_AFTER_S = 0.02


class SlotGate:
    """A shard's free message slots, handed out with priority: a freed slot goes to a waiting
    resumer before a waiting reader.

    anyio's Semaphore hands a released slot straight to the task blocked in `acquire()`; with
    the reader always blocked there under a backlog, the resumer (crash recovery, retries,
    hand-backs, gap checks) would never get one until the backlog is gone. Here the resumer
    waits in the first queue, so a due session waits at most for the next slot to free up."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiting: tuple[deque[_SlotWaiter], deque[_SlotWaiter]] = (deque(), deque())

    @property
    def free(self) -> int:
        return self._free

    @property
    def resumer_waiting(self) -> bool:
        """The resumer waits for a slot: the next one freed is its (the ready set's due
        sessions have first call), not the queues' (a commit does not fill it)."""
        return bool(self._waiting[0])

    @property
    def contended(self) -> bool:
        """Every slot is taken and someone waits for one."""
        return self._free <= 0 and any(self._waiting)

    def acquire_nowait(self) -> None:
        if self._free <= 0:
            raise anyio.WouldBlock
        self._free -= 1

    def take(self, most: int) -> int:
        """Up to `most` free slots at once, without waiting: how many were taken."""
        taken = max(0, min(most, self._free))
        self._free -= taken
        return taken

    async def acquire(self, priority: bool = False) -> None:
        await anyio.lowlevel.checkpoint()
        if self._free > 0:
            self._free -= 1
            return
        waiter = _SlotWaiter()
        queue = self._waiting[0 if priority else 1]
        queue.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release()  # handed over just as we were cancelled: pass it on
            else:
                queue.remove(waiter)
            raise

    def release(self, n: int = 1) -> None:
        """Give back `n` slots: to waiters first (priority first), the rest become free. An
        intake call gives back the slots it did not fill at once (up to 63 by default)."""
        for queue in self._waiting:
            while n > 0 and queue:
                waiter = queue.popleft()
                waiter.granted = True
                waiter.event.set()
                n -= 1
        self._free += max(n, 0)


async def take_turns(slots: SlotGate, took_s: float, stopping: bool = False) -> None:
    """Between two messages of a session: if its last one took a while (a model call, not the
    rules) and a reader or resumer waits for a slot, give the slot to it and queue behind.
    Under a backlog of slow steps the sessions then take turns, instead of each holding a slot
    for its whole burst while the others wait; fast steps keep their slot (a turn costs an
    intake call). Not while the worker stops: the session goes on and hands back at once."""
    if took_s >= TURN_AFTER_S and slots.contended and not stopping:
        slots.release()
        await slots.acquire()


@dataclasses.dataclass(eq=False)
class _SlotWaiter:
    event: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    granted: bool = False
