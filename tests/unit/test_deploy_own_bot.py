"""docs/deploy.md's recipe for a bot of your own: built on the image, installed into the
image's own environment, run again as the image's non-root user, with DIALOG_ENGINE set; and
its command to build that image without Docker and keep it as an archive (what it accepts;
scripts/container-check.sh runs the build, the save and a load back for real)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import pytest

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


def _host_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "container_check_host", ROOT / "scripts" / "container_check_host.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deploy_md_builds_an_own_bot_without_docker_and_keeps_it_as_an_archive() -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    command = re.search(r"^bash scripts/build-own-bot\.sh (\S+) (\S+)", doc, re.M)
    assert command is not None
    assert f"podman load -i {command[2]}" in doc and f"docker load -i {command[2]}" in doc
    wrapper = (ROOT / "scripts" / "build-own-bot.sh").read_text()
    assert 'container_check_host.py" build-own-bot "$@"' in wrapper
    assert os.access(ROOT / "scripts" / "build-own-bot.sh", os.X_OK)


def test_build_own_bot_takes_a_folder_an_archive_and_a_tag(tmp_path: Path) -> None:
    host = _host_script()
    bot = ROOT / "examples" / "own_bot"
    archive = tmp_path / "mybot.tar"
    assert host.build_own_bot_args([str(bot), str(archive)]) == (bot, archive, "mybot:latest")
    assert host.build_own_bot_args([str(bot), str(archive), "acme/bot:1.2"])[2] == "acme/bot:1.2"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "expected the bot's folder"),
        (["tests"], "expected the bot's folder"),
        (["tests", "{tmp}/bot.tar"], "has no Dockerfile"),
        (["examples/own_bot", "{tmp}/no/such/bot.tar"], "is not a folder"),
        (["examples/own_bot", "examples/own_bot/bot.tar"], "inside"),
        (["examples/own_bot", "{tmp}/bot.tar", "My Bot"], "not an image name"),
    ],
)
def test_build_own_bot_refuses_arguments_that_cannot_work_before_installing_anything(
    tmp_path: Path, args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    host = _host_script()
    with pytest.raises(SystemExit) as stopped:
        host.build_own_bot_args([str(ROOT / a.format(tmp=tmp_path)) for a in args])
    assert stopped.value.code == 2
    first, usage = capsys.readouterr().err.splitlines()
    assert first.startswith("build-own-bot: ") and says in first
    assert usage.startswith("usage: scripts/build-own-bot.sh")
