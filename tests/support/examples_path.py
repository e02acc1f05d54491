"""Importing this puts examples/ on sys.path, so a test imports an example by its module name;
`with_examples` does the same for a worker or other process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))


def with_examples(env: dict[str, str]) -> dict[str, str]:
    """A worker or process environment that can import the examples by module name."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), env.get("PYTHONPATH", "")])}
