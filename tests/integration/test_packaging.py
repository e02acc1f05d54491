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
        assert f"dialog_worker/lua/{script.name}" in names
    assert "dialog_worker/defaults/rules.toml" in names
    assert "dialog_worker/py.typed" in names
    assert not [n for n in names if n.startswith("worker/")], (
        "the wheel installs dialog_worker only"
    )


QUICKSTART = """\
import asyncio

from dialog_worker import DialogClient


async def main() -> None:
    async with DialogClient() as client:
        reply = await client.ask("collide", "nama saya Budi", timeout=30)
        print(reply.outcome, reply.text)


asyncio.run(main())
"""


def test_a_project_with_its_own_worker_module_runs_the_quickstart_and_the_cli(
    installed: Path, env, workers, tmp_path: Path
) -> None:
    """The most common file names of a queue project, worker.py and worker/, beside the user's
    code (and on PYTHONPATH) shadow nothing of ours: the import package is dialog_worker."""
    venv_bin = installed.parent / "venv" / "bin"
    workers.start(1)
    module_project = tmp_path / "with_module"
    module_project.mkdir()
    (module_project / "worker.py").write_text(
        "raise ImportError('the user worker.py was imported')\n"
    )
    (module_project / "quickstart.py").write_text(QUICKSTART)
    package_project = tmp_path / "with_package"
    (package_project / "worker").mkdir(parents=True)
    (package_project / "worker" / "__init__.py").write_text(
        "raise ImportError('the user worker/')\n"
    )
    for project in (module_project, package_project):
        user_env = {
            **{k: v for k, v in env.items() if k != "PYTHONPATH"},
            "PYTHONPATH": str(project),
        }
        ran = subprocess.run(
            [str(venv_bin / "python"), str(module_project / "quickstart.py")],
            cwd=project,
            env=user_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.startswith("applied "), ran.stdout
        for cli in (
            [str(venv_bin / "dialog-worker")],
            [str(venv_bin / "python"), "-m", "dialog_worker"],
        ):
            state = subprocess.run(
                [*cli, "state", "collide"],
                cwd=project,
                env=user_env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert state.returncode == 0, state.stderr
            assert json.loads(state.stdout)["memory"] == {"userName": "Budi"}


def test_installed_console_script_sends_and_reads_state(installed: Path, env) -> None:
    venv_bin = installed.parent / "venv" / "bin"
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    # Run from a folder without lua/ or config/, so only the installed copies can be used.
    where = subprocess.run(
        [
            str(venv_bin / "python"),
            "-c",
            "import dialog_worker.store.scripts as s, dialog_worker.engine.rules as e;"
            " print(s.lua_dir()); e.load_rules();"
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
