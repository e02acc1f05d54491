"""docs/deploy.md's recipe for a bot of your own: built on the image, installed into the
image's own environment, run again as the image's non-root user, with DIALOG_ENGINE set."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_own_bot_recipe_builds_on_the_image_and_keeps_its_user() -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    recipe = re.search(r"```dockerfile\n(.*?)```", doc, re.S)
    assert recipe is not None
    lines = [line for line in recipe.group(1).splitlines() if line and not line.startswith("#")]
    image_user = re.findall(r"^USER (\S+)", (ROOT / "Dockerfile").read_text(), re.M)[-1]
    venv = re.search(r"PATH=(/\S+)/bin:", (ROOT / "Dockerfile").read_text())
    assert venv is not None
    # Built FROM the image (its name a build argument, dialog-worker:local by default).
    assert lines[:2] == ["ARG BASE_IMAGE=dialog-worker:local", "FROM ${BASE_IMAGE}"], lines[:2]
    assert any(f"{venv.group(1)}/bin/pip install" in line for line in lines)
    assert [line for line in lines if line.startswith("USER ")][-1] == f"USER {image_user}"
    assert any(line.startswith("ENV DIALOG_ENGINE=") for line in lines)
