"""docs/engine.md's code runs as written: its engines load and its example tests pass."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


async def test_the_engine_guide_examples_run_and_their_tests_pass() -> None:
    namespace: dict[str, Any] = {"__name__": "engine_doc"}
    blocks = python_blocks()
    assert len(blocks) >= 3
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert len(tests) == 2
    for test in tests:
        assert inspect.iscoroutinefunction(test)
        await test()
    assert callable(namespace["Assistant"].startup)
