#!/bin/sh
# Install dialog-worker from a built wheel into a fresh virtual environment, then check that the
# installed copy is complete (Lua scripts and default rules inside the package, console script
# runs). The container image (Dockerfile, runtime stage) and tests/integration/test_deploy.py
# both install through this script, so what the test runs is what the image ships.
#
#   scripts/install-wheel.sh VENV_DIR WHEEL_OR_DIR
#
#   WHEEL_OR_DIR  a dialog_worker-*.whl file, or a wheelhouse folder holding exactly one
#                 dialog_worker-*.whl (and, usually, the wheels of its dependencies, as written
#                 by `pip wheel --wheel-dir DIR .`). A folder is also passed to pip as
#                 --find-links, so dependencies are taken from it first.
#
# Environment:
#   PYTHON        interpreter that creates the venv (default: python3)
#   EXTRAS        extras to install with it, comma-separated (default: none). The image uses
#                 "http": `dialog-worker serve` (the gateway) and `dialog-worker console`.
#   PIP_*         read by pip itself. PIP_NO_INDEX=1 installs offline, from the wheelhouse
#                 only (the image does this); without it missing dependencies come from the
#                 package index.
#
# Exit status: 0 installed and checked; 2 usage; anything else: the failing step's status.
set -eu

if [ "$#" -ne 2 ]; then
    echo "usage: $0 VENV_DIR WHEEL_OR_DIR" >&2
    exit 2
fi
venv=$1
source=$2
python=${PYTHON:-python3}
extras=${EXTRAS:-}
case "$extras" in
    *[!a-z0-9,_-]*) echo "install-wheel: EXTRAS must be names separated by commas" >&2; exit 2 ;;
esac

if [ -d "$source" ]; then
    set -- "$source"/dialog_worker-*.whl
    if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then
        echo "install-wheel: expected exactly one dialog_worker-*.whl in $source" >&2
        exit 2
    fi
    wheel=$1
    find_links="--find-links=$source"
elif [ -f "$source" ]; then
    case "$source" in
        *.whl) ;;
        *) echo "install-wheel: $source is not a wheel" >&2; exit 2 ;;
    esac
    wheel=$source
    find_links="--find-links=$(dirname "$source")"
else
    echo "install-wheel: no such file or folder: $source" >&2
    exit 2
fi

"$python" -m venv "$venv"
# The wheel is installed by its path, never by name: an index can never substitute another
# distribution called dialog-worker.
spec=$wheel
[ -z "$extras" ] || spec="$wheel[$extras]"
"$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --quiet \
    "$find_links" "$spec"

# The installed package must carry every Lua script and the default rules: an installed
# worker has no lua/ or config/ folder next to it. Run outside any source checkout so only the
# installed copy can be found.
cd /
"$venv/bin/python" - <<'PY'
import dataclasses
import sys
from pathlib import Path

import dialog_worker.engine.rules
import dialog_worker.store.scripts as scripts

lua = scripts.lua_dir()
if Path(sys.prefix).resolve() not in lua.resolve().parents:
    sys.exit(f"install-wheel: Lua scripts found outside the venv: {lua}")
for field in dataclasses.fields(scripts.Scripts):
    scripts.source(field.name)  # raises unless exactly one lua/<name>-N.lua is installed
dialog_worker.engine.rules.load_rules()
print(f"install-wheel: dialog-worker installed in {sys.prefix}; Lua scripts in {lua}")
PY
"$venv/bin/dialog-worker" --help >/dev/null
# With the http extra, the gateway and the console must import (their dependencies installed).
case ",$extras," in
    *,http,*) "$venv/bin/python" -c "import dialog_worker.gateway.app, dialog_worker.console.app" ;;
esac
