"""The round-trip counting shim: runs inside the spawned worker processes
(`python -m dialog_worker.bench _count MODULE ...`) and inside the bench itself, and counts redis-py
commands and round trips without adding any Redis command. Also the server-side view
(INFO commandstats)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import sys
import threading
import time
from collections import Counter
from typing import Any

from redis.asyncio import Redis

EXIT_USAGE = 2
# Commands the bench issues for itself and that no worker ever counts (kept out of totals).
ADMIN_COMMANDS = {"info", "config", "client", "script", "hello", "ping", "select"}


class CommandCounter:
    """Counts redis-py commands (per name) and round trips (one per packed write) of this
    process by wrapping redis.asyncio's Connection methods. Installed once per process."""

    def __init__(self) -> None:
        self.round_trips = 0
        self.setup_round_trips = 0
        self.commands = 0
        self.by_name: Counter[str] = Counter()
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        from redis.asyncio.connection import AbstractConnection

        from dialog_worker.store.connection import HiredisPacking

        counter = self
        original_send = AbstractConnection.send_packed_command

        def counting(cls: type[AbstractConnection]) -> Any:
            original_pack = cls.__dict__["pack_command"]

            def pack_command(conn: Any, *args: Any) -> Any:
                # Counted once, by the class the connection's pack_command resolves to (a
                # subclass that falls back to its base's packer would count twice).
                if type(conn).pack_command is pack_command:
                    head = args[0] if args else b""
                    name = (head.decode() if isinstance(head, bytes) else str(head)).split(" ", 1)
                    counter.commands += 1
                    counter.by_name[name[0].lower()] += 1
                    conn._bench_last_command = name[0].lower()
                return original_pack(conn, *args)

            return pack_command

        async def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> Any:
            # Connection set-up (HELLO, CLIENT SETINFO, ...) is counted apart: it is paid
            # once per pooled connection, not per message.
            if getattr(conn, "_bench_last_command", "") in ADMIN_COMMANDS:
                counter.setup_round_trips += 1
            else:
                counter.round_trips += 1
            return await original_send(conn, command, check_health)

        # redis-py's packer and the worker's own (dialog_worker.store.connection).
        for cls in (AbstractConnection, HiredisPacking):
            setattr(cls, "pack_command", counting(cls))  # noqa: B010
        setattr(AbstractConnection, "send_packed_command", send_packed_command)  # noqa: B010
        self.installed = True

    def snapshot(self) -> dict[str, Any]:
        return {
            "round_trips": self.round_trips,
            "setup_round_trips": self.setup_round_trips,
            "commands": self.commands,
            "by_name": dict(self.by_name),
        }


COUNTER = CommandCounter()


def count_main(argv: list[str]) -> int:
    """`python -m dialog_worker.bench _count MODULE [ARGS...]`: run MODULE as __main__ with the
    counter installed, dumping counts to $BENCH_COUNTS_FILE every 0.2 s and at exit."""
    if not argv:
        print("usage: python -m dialog_worker.bench _count MODULE [ARGS...]", file=sys.stderr)
        return EXIT_USAGE
    COUNTER.install()
    path = os.environ.get("BENCH_COUNTS_FILE", "")

    def dump() -> None:
        if not path:
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(COUNTER.snapshot(), fh)
        os.replace(tmp, path)

    def loop() -> None:
        while True:
            with contextlib.suppress(Exception):
                dump()
            time.sleep(0.2)

    threading.Thread(target=loop, daemon=True).start()
    atexit.register(dump)
    module = argv[0]
    sys.argv = [module, *argv[1:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        dump()
        return int(exc.code) if isinstance(exc.code, int) else 0
    dump()
    return 0


async def command_calls(redis: Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
