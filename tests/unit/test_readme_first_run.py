"""The README offers a quick first run (unit and script tests and a real worker, a minute or
so), and its table of skipped checks names every test that skips when redis-sentinel or
Chromium is missing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_offers_a_quick_first_run_of_unit_script_and_real_worker_tests() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "\n.venv/bin/python -m pytest -m quick\n" in readme
    assert '"quick:' in (ROOT / "pyproject.toml").read_text()  # a registered marker
    quick = _quick_paths()
    assert "tests/unit/" in quick and "tests/integration/test_readme.py" in quick  # a worker
    assert all((ROOT / path).exists() for path in quick)
    assert not any(path.startswith(("tests/chaos", "tests/fault")) for path in quick)


def _quick_paths() -> tuple[str, ...]:
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    [value] = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "QUICK"
    ]
    paths = ast.literal_eval(value)
    assert isinstance(paths, tuple)
    return paths


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


def test_every_file_of_tests_skipped_without_chromium_is_listed_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "chromium chromium-driver" in line)
    skipping = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if path != Path(__file__).resolve()
        and re.search(
            r"skip[\s\S]{0,200}chromium|chromium[\s\S]{0,300}skip", path.read_text(), re.I
        )
    }
    assert skipping and all(f"`{path}`" in row for path in skipping), skipping
