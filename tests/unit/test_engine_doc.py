"""docs/engine.md documents the `Engine` protocol a type checker can check an engine against,
and the name it shows is the one the package exports."""

from __future__ import annotations

from pathlib import Path

import dialog_worker

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def test_engine_md_documents_the_exported_engine_protocol() -> None:
    doc = DOC.read_text()
    assert "from dialog_worker import Engine" in doc
    assert "engine: Engine = " in doc
    assert "Engine" in dialog_worker.__all__ and hasattr(dialog_worker.Engine, "step")
