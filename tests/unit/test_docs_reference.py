"""The reference docs follow the code: every setting of dialog_worker/config.py is in
docs/configuration.md with its real default, every command and flag of the real CLI parser is
in docs/cli.md, the README's test command is the one .ci/run runs, and every relative link of
the README and docs/ reaches a file and a heading that exist."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path

from dialog_worker.cli import _parser
from dialog_worker.config import _PARSERS, Settings, env_name

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
CONFIG_DOC = DOCS / "configuration.md"
CLI_DOC = DOCS / "cli.md"

# Written on another branch at the same time; drop once it is in the tree.


def setting_rows() -> dict[str, str]:
    """Documented env name -> its default cell, from the tables of docs/configuration.md."""
    rows: dict[str, str] = {}
    for line in CONFIG_DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `((?:DIALOG_|REDIS_)[A-Z0-9_]+)` \| ([^|]*) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is documented twice"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_every_setting_is_documented_and_nothing_else() -> None:
    documented = set(setting_rows())
    real = {env_name(field) for field in _PARSERS}
    assert real - documented == set(), "settings missing from docs/configuration.md"
    assert documented - real == set(), "docs/configuration.md documents settings that do not exist"


def test_documented_defaults_are_the_real_ones() -> None:
    """A default written as one literal (`64`, `<stream>-workers`) must be what the code uses;
    one written in words ("the stream name") must be a default the code derives (empty)."""
    defaults = Settings()
    fields = {env_name(f.name): f for f in dataclasses.fields(Settings)}
    for env, cell in setting_rows().items():
        field = fields[env].name
        literal = re.fullmatch(r"`([^`]*)`", cell)
        value = literal.group(1).replace("<stream>", defaults.stream) if literal else None
        if value is None or "<" in value:
            assert fields[env].default == "", f"{env}: documented as {cell!r}, not derived"
            continue
        assert _PARSERS[field](env, value) == getattr(defaults, field), f"{env}: documented {cell}"


def test_docs_name_only_real_settings() -> None:
    real = {env_name(field) for field in _PARSERS} | {"DIALOG_CONFIG"}
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        for name in re.findall(r"\bDIALOG_[A-Z0-9_]+", path.read_text(encoding="utf-8")):
            if name.endswith("_"):  # a prefix: "without `DIALOG_`", "`DIALOG_BACKOFF_*`"
                assert any(r.startswith(name) for r in real), f"{path.name}: {name}"
            else:
                assert name in real, f"{path.name} names {name}, which is not a setting"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cli_sections() -> dict[str, str]:
    """docs/cli.md's text under each `### <command>` heading."""
    doc = CLI_DOC.read_text(encoding="utf-8")
    parts = re.split(r"^(#{2,3} .+)$", doc, flags=re.M)
    pairs = zip(parts[1::2], parts[2::2], strict=True)
    return {h[4:].strip(): body for h, body in pairs if h.startswith("### ")}


def test_every_command_and_flag_is_in_the_cli_reference() -> None:
    """Each command has its section, which names each of its actions and flags."""
    sections = _cli_sections()
    missing = []
    for name, sub in _subparsers(_parser()).items():
        if name not in sections:
            missing.append(f"section ### {name}")
            continue
        text = sections[name]
        parsers = {name: sub} | {f"{name} {a}": p for a, p in _subparsers(sub).items()}
        for label, parser in parsers.items():
            if " " in label and not re.search(rf"\b{label.split()[1]}\b", text):
                missing.append(label)
            for action in parser._actions:
                for flag in action.option_strings:
                    if flag.startswith("--") and flag != "--help":
                        if not re.search(rf"(?<![\w-]){flag}(?![\w-])", text):
                            missing.append(f"{label} {flag}")
    assert not missing, f"docs/cli.md does not mention: {missing}"


def test_cli_reference_examples_parse_with_the_real_parser() -> None:
    doc = CLI_DOC.read_text(encoding="utf-8")
    examples = doc.split("## Examples", 1)[1]
    [block] = re.findall(r"```sh\n(.*?)```", examples, re.S)
    parser = _parser()
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) >= 10
    for line in lines:
        argv = shlex.split(line)
        while "=" in argv[0]:  # leading VAR=value assignments
            argv.pop(0)
        assert argv[0] == "dialog-worker", line
        parser.parse_args(argv[1:])  # exits 2 (failing the test) on a usage error


def test_readme_test_command_is_the_one_ci_runs() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    [command] = [line for line in ci.splitlines() if line.startswith("python3 -m venv .venv")]
    readme_lines = README.read_text(encoding="utf-8").splitlines()
    assert command in readme_lines


def _anchor(heading: str) -> str:
    """GitHub's heading id: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_relative_links_reach_existing_files_and_headings() -> None:
    broken = []
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken
