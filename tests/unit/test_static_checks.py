"""The code style the project promises (STYLE.md) is checked, not hoped for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_worker_package_passes_mypy_strict() -> None:
    result = run("mypy")  # pyproject.toml: the package dialog_worker, strict
    assert result.returncode == 0, result.stdout + result.stderr


def test_examples_pass_mypy_strict() -> None:
    result = run("mypy", "--strict", "examples")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_lint_passes() -> None:
    result = run("ruff", "check", "worker", "tests", "examples")
    assert result.returncode == 0, result.stdout + result.stderr
