"""A worker that owns its process (`dialog-worker run`) moves what startup made out of the
garbage collector's way (gc.freeze): full collections then no longer walk the modules, the
settings and the engine, which took 20-25 ms about once a second at a steady rate. A worker
run inside another program leaves that program's collector alone."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.daemon import worker as daemon
from dialog_worker.daemon.worker import Worker
from dialog_worker.engine.loading import load_engine
from dialog_worker.ops.verify import send_bursts, wait_applied


async def _frozen_after_a_message(
    client: DialogClient, env: dict[str, str], session_id: str, **kwargs: Any
) -> int:
    settings = load_settings(environ={**env, "DIALOG_METRICS_PORT": "0"})
    worker = Worker(settings, load_engine(None), **kwargs)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        sent = await send_bursts(client, [session_id], ["nama saya Budi"])
        assert await wait_applied(client, sent, timeout_s=20)
        frozen = gc.get_freeze_count()
        worker.stop()
    return frozen


async def test_a_worker_that_owns_its_process_freezes_what_startup_made(
    client: DialogClient, env: dict[str, str]
) -> None:
    before = gc.get_freeze_count()
    try:
        assert await _frozen_after_a_message(client, env, "gc-embedded") == before
        assert await _frozen_after_a_message(client, env, "gc-own", freeze_startup=True) > before
    finally:
        gc.unfreeze()  # the test process's own collector, as it was


def test_dialog_worker_run_gives_its_worker_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[Any] = []
    monkeypatch.setattr(daemon.anyio, "run", lambda fn, **_: ran.append(fn))
    daemon.run_worker(load_settings(environ={}), load_engine(None))
    [run] = ran
    assert run.__self__.freeze_startup is True
