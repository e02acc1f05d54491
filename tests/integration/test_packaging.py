"""The installed wheel carries the Lua scripts and the default rules, and works on its own."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel and install it into a fresh venv. Its dependencies are borrowed from the
    running interpreter through a .pth file (no network needed); the project itself is not:
    a .pth entry adds a folder, it does not run the editable install's own .pth hook."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp), str(REPO)],
        check=True,
        timeout=300,
    )
    [wheel] = tmp.glob("dialog_worker-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    [site] = venv.glob("lib/python3*/site-packages")
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "borrowed_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    return wheel


def test_wheel_contains_every_lua_script_and_the_default_rules(installed: Path) -> None:
    names = zipfile.ZipFile(installed).namelist()
    for script in (REPO / "lua").glob("*.lua"):
        assert f"worker/lua/{script.name}" in names
    assert "worker/default_rules.toml" in names


def test_installed_console_script_sends_and_reads_state(installed: Path, env) -> None:
    venv_bin = installed.parent / "venv" / "bin"
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    # Run from a folder without lua/ or config/, so only the installed copies can be used.
    where = subprocess.run(
        [
            str(venv_bin / "python"),
            "-c",
            "import worker.scripts as s, worker.engine as e; print(s.lua_dir()); e.load_rules();"
            " [s.source(f.name) for f in __import__('dataclasses').fields(s.Scripts)]",
        ],
        cwd=installed.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "site-packages" in where.stdout
    sent = subprocess.run(
        [str(venv_bin / "dialog-worker"), "send", "pkg", "nama saya Budi"],
        cwd=installed.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(sent.stdout)["session_id"] == "pkg"
