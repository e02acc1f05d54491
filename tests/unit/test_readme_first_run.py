"""The README offers a quick first run without the chaos tests, and its table of skipped checks
names every test that skips when redis-sentinel is missing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_offers_a_quick_subset_without_chaos() -> None:
    readme = (ROOT / "README.md").read_text()
    assert 'pytest -m "not chaos"' in readme


def test_every_test_skipped_without_sentinel_is_listed_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "`redis-sentinel` is not installed" in line)
    skipped: set[str] = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        if "redis-sentinel is not installed" not in text and "sentinel_or_skip(" not in text:
            continue
        for name in re.findall(r"^(?:async )?def (test_\w*sentinel\w*)\(", text, re.M):
            skipped.add(f"{path.relative_to(ROOT)}::{name}")
    assert skipped and all(f"`{t}`" in row for t in skipped), skipped
