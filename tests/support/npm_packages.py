"""npm packages for the suite's tests that drive real JavaScript clients (the AI SDK, a JWT
library, the useChat example page, the LangGraph JS SDK) and build the TypeScript client:
`npm_ci(folder)` installs a folder's package-lock.json with `npm ci` once per test session, so
a fresh checkout running the README's test command gets them. Skips (naming the reason) where
`node` or `npm` is missing."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

# A cold `npm ci` of the suite's folders takes seconds from the npm cache, a minute or two
# from the registry.
NPM_CI_TIMEOUT_S = 600

_installed: set[Path] = set()
_lock = threading.Lock()


def node_or_skip() -> str:
    """The path of `node`; skips the test when node or npm is not installed."""
    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        pytest.skip("node or npm is not installed (Debian: apt-get install nodejs npm)")
    return node


def npm_ci(folder: Path) -> Path:
    """Installs ``folder``'s locked dependencies (``npm ci``) the first time a test of this
    session asks, and returns the folder. Skips when node or npm is missing; fails, with npm's
    output, when the install fails."""
    node_or_skip()
    folder = folder.resolve()
    with _lock:
        if folder not in _installed:
            done = subprocess.run(
                ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=folder,
                capture_output=True,
                text=True,
                timeout=NPM_CI_TIMEOUT_S,
            )
            if done.returncode != 0:
                raise RuntimeError(f"npm ci in {folder} failed:\n{done.stdout}\n{done.stderr}")
            _installed.add(folder)
    return folder
