"""The package's structure: no import circles (every import counts, also one inside a
function or under TYPE_CHECKING), and a user's type checker sees the package through the
README's editable install."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
PACKAGE = REPO / "worker" / "dialog_worker"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "lua" in path.relative_to(PACKAGE).parts[:1]:
            continue
        found[module_name(path)] = path
    return found


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``name`` imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # A name that is a module is that module; any other name, its module (`base`).
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # The longest importable prefix: `from dialog_worker.x import y` is x, unless y
            # is itself a module.
            parts = target.split(".")
            for end in range(len(parts), 0, -1):
                candidate = ".".join(parts[:end])
                if candidate in modules:
                    if candidate != name:
                        out.add(candidate)
                    break
    return out


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    names = set(modules)
    graph = {name: imports_of(name, path, names) for name, path in modules.items()}
    # The package's __init__ re-exports the public names: importing a name from
    # `dialog_worker` inside the package would make every module depend on all of them.
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, directly or not (each group sorted)."""

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {node: reachable(node) for node in graph}
    groups: list[list[str]] = []
    for node in sorted(graph):
        if node in reach[node] and not any(node in group for group in groups):
            groups.append(sorted(n for n in reach[node] if node in reach.get(n, set())))
    return groups


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 30  # the walk found the package
    assert "dialog_worker.client.dialog_client" in graph["dialog_worker.gateway.app"]
    assert circles(graph) == []


# Who may import whom (docs/architecture.md, "Package map"): a module imports only from its
# own floor or the floors below. A new module gets a floor here.
FLOORS: dict[str, tuple[str, ...]] = {
    "foundation": ("errors", "version", "config", "metrics", "log", "tracing"),
    "store": ("store",),
    "engine": ("engine",),
    "adapters": ("adapters",),
    "client": ("client",),
    "daemon": ("daemon",),
    "ops": ("ops",),
    "faces": ("", "__main__", "cli", "console", "gateway", "bench"),
}


def floor_of(module: str) -> int:
    short = module.removeprefix("dialog_worker").removeprefix(".")
    top = short.split(".")[0]
    for level, (_, names) in enumerate(FLOORS.items()):
        if short in names or top in names:
            return level
    raise AssertionError(f"{module} has no floor in FLOORS (tests/unit/test_package_structure.py)")


def test_nothing_imports_from_a_floor_above_its_own() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if floor_of(target) > floor_of(module)
    ]
    assert upward == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_inside_the_package_imports_from_its_init() -> None:
    """`from dialog_worker import X` inside the package ties the module to every public
    name's module; inside, import from the module that defines X."""
    graph = import_graph()
    importers = sorted(n for n, targets in graph.items() if "dialog_worker" in targets)
    assert importers == []


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the repository's files")
def test_a_user_file_is_type_checked_against_the_editable_install(tmp_path: Path) -> None:
    """The README installs with `pip install -e .`: the package must be a plain path entry a
    user's mypy follows (an import hook makes every type Any and says 'Cannot find
    implementation or library stub')."""
    user = tmp_path / "bot.py"
    user.write_text(
        textwrap.dedent(
            """
            from dialog_worker import DialogClient, Reply

            def outcome(reply: Reply) -> int:
                return reply.outcome  # a str: the type checker must see it

            client: DialogClient = DialogClient()
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--strict", str(user)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert "Cannot find implementation or library stub" not in out, out
    # The outcome's type reached the user's checker (a Literal of the outcomes, a str).
    assert "Incompatible return value type" in out and 'expected "int"' in out, out
