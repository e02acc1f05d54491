"""docs/engine.md's code runs as written: greeter.py and test_greeter.py saved as the guide
says pass under plain pytest, and its other engines load."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def saved_as(name: str) -> str:
    """The block whose first line says which file it is (`# greeter.py`)."""
    [block] = [b for b in python_blocks() if b.startswith(f"# {name}")]
    return block


def test_the_guides_engine_test_passes_as_written(tmp_path: Path) -> None:
    (tmp_path / "greeter.py").write_text(saved_as("greeter.py"), encoding="utf-8")
    (tmp_path / "test_greeter.py").write_text(saved_as("test_greeter.py"), encoding="utf-8")
    # As the guide says: from that folder, with none of this repository's pytest settings.
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_greeter.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "2 passed" in ran.stdout, ran.stdout


def test_the_guides_nudger_test_passes_as_written(tmp_path: Path) -> None:
    (tmp_path / "nudger.py").write_text(saved_as("nudger.py"), encoding="utf-8")
    (tmp_path / "test_nudger.py").write_text(saved_as("test_nudger.py"), encoding="utf-8")
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_nudger.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 passed" in ran.stdout, ran.stdout


# The agent frameworks' examples need their extras; without one, its block is left out.
FRAMEWORKS = ("agents", "pydantic_ai", "langgraph", "langchain_core", "langchain_openai")


def test_the_guides_other_engines_load() -> None:
    namespace: dict[str, Any] = {"__name__": "engine_doc"}
    blocks = [b for b in python_blocks() if not b.startswith("# test_")]
    assert len(blocks) >= 2
    for block in blocks:
        try:
            exec(compile(block, str(DOC), "exec"), namespace)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in FRAMEWORKS:
                raise
    assert callable(namespace["Assistant"].startup)
    assert callable(namespace["Greeter"]().step)
    if "engine" in namespace:  # an agent framework's engine (its extra is installed)
        assert callable(namespace["engine"].step)


def test_engine_md_documents_the_exported_engine_protocol() -> None:
    import dialog_worker

    doc = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()
    assert "from dialog_worker import Engine" in doc
    assert "engine: Engine = " in doc
    assert "Engine" in dialog_worker.__all__ and hasattr(dialog_worker.Engine, "step")
