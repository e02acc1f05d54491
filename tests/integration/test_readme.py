"""The README's quickstart prints what the README says it prints, on a Redis that already holds
other conversations and when run a second time."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import anyio
import pytest
from worker_procs import WorkerPool

from dialog_worker import DialogClient

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def quickstart_and_output() -> tuple[str, str]:
    text = README.read_text(encoding="utf-8")
    code = re.search(r"```python\n(import asyncio\n.*?)```", text, flags=re.S)
    shown = re.search(r"It prints[^\n]*:\n\n```\n(.*?)```", text, flags=re.S)
    assert code and shown
    return code[1], shown[1]


async def test_the_quickstart_prints_what_the_readme_shows_on_a_redis_in_use(
    client: DialogClient, workers: WorkerPool, env: dict[str, str], tmp_path: Path
) -> None:
    workers.start(1)
    await client.ask("user-42", "nama saya Ani", timeout=20)  # someone else's conversation
    code, shown = quickstart_and_output()
    (tmp_path / "quickstart.py").write_text(code, encoding="utf-8")
    for _ in range(2):
        with anyio.fail_after(60):
            ran = await anyio.run_process(
                [sys.executable, "quickstart.py"], cwd=tmp_path, env=env, check=False
            )
        assert ran.returncode == 0, ran.stderr.decode()
        assert ran.stdout.decode() == shown
