"""One inbound stream (a shard) as one worker sees it: its keys, its slots, and the worker's
part in the pool's waiter role for it."""

from __future__ import annotations

import dataclasses
import time

import anyio

from dialog_worker.daemon.slots import SlotGate
from dialog_worker.store.keys import Keys


@dataclasses.dataclass(eq=False)
class Shard:
    """One inbound stream and what reads it: its own share of the slots, so a reader blocked
    on an idle shard never holds the capacity another shard's messages need."""

    keys: Keys
    slots: SlotGate
    group_ready: bool = False
    # This process is the shard's waiter until then (monotonic s; 0: not the waiter).
    lease_until: float = 0.0
    # When this process last asked whether the waiter role is free (monotonic s).
    lease_checked_at: float = 0.0
    # Another worker held the waiter role when this process last asked: it counts as alive
    # until then (monotonic s; 0: none seen).
    waiter_seen_until: float = 0.0
    # Whether tenants' settings were found for the shard, and when that was asked (monotonic s;
    # Reader.tenants_in_use).
    tenants_configured: bool = False
    tenants_checked_at: float = float("-inf")
    # Set when the read with an intake call behind it (Reader.read_ahead) has returned.
    read_ahead_done: anyio.Event | None = None

    @property
    def reading_ahead(self) -> bool:
        return self.read_ahead_done is not None and not self.read_ahead_done.is_set()

    def does_upkeep(self) -> bool:
        """Whether this process runs the shard's shared upkeep (due timers, the reclaim
        check), which one worker of the pool suffices for: every worker that has not seen
        another one hold the waiter role lately. That is the waiter; the last holder, busy
        since it handed the role on while nobody took it; everyone once the waiter died (a
        sighting counts for two leases, and the role is free after one). An idle pool of any
        size pays for one worker's upkeep."""
        return time.monotonic() >= self.waiter_seen_until

    @property
    def label(self) -> str:
        return str(self.keys.shard)
