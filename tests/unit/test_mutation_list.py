"""The mutation check's list (tests/mutation/mutations.toml), the guarantee map
(docs/guarantees.md) and the code stay in step. Cheap, so it runs with the unit tests: a
change to lua/ or worker/ that moves a mutated line fails here, naming the mutation, rather
than as a confusing error of the mutation check in CI."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUARANTEES = REPO / "docs" / "guarantees.md"

_spec = importlib.util.spec_from_file_location("mutation_run", REPO / "tests/mutation/run.py")
assert _spec is not None and _spec.loader is not None
run = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run  # dataclasses look their module up there
_spec.loader.exec_module(run)

MUTATIONS = run.load()


def claims_on_the_page() -> dict[str, tuple[set[str], set[str]]]:
    """Claim id -> (tests, mutations) as docs/guarantees.md lists them."""
    found = {}
    for section in GUARANTEES.read_text(encoding="utf-8").split("\n### ")[1:]:
        claim = section.split(":", 1)[0]
        body, _, mutations = section.partition("\nMutations:")
        mutations = mutations.split("\n\n", 1)[0]
        tests = set(re.findall(r"`(tests/[^`]+::[^`]+)`", body))
        found[claim] = (tests, set(re.findall(r"`([a-z0-9-]+)`", mutations)))
    return found


def test_every_mutation_applies_to_the_code_and_names_existing_tests() -> None:
    assert run.problems(MUTATIONS) == []


def test_at_least_thirty_mutations_and_every_script_is_mutated() -> None:
    assert len(MUTATIONS) >= 30
    scripts = {p.relative_to(REPO).as_posix() for p in (REPO / "lua").glob("*.lua")}
    assert scripts - {m.file for m in MUTATIONS} == set()


def test_every_guarantee_has_tests_and_a_mutation() -> None:
    page = claims_on_the_page()
    assert {f"G{n}" for n in range(1, 10)} <= page.keys()
    for claim, (tests, mutations) in page.items():
        assert tests, f"{claim} names no test"
        if claim.startswith("G"):
            assert mutations, f"guarantee {claim} has no mutation that breaks it"


def test_the_page_lists_exactly_the_mutations_that_name_each_claim() -> None:
    page = claims_on_the_page()
    named: dict[str, set[str]] = {}
    for m in MUTATIONS:
        for claim in m.claims:
            assert claim in page, f"{m.id} names claim {claim}, which docs/guarantees.md lacks"
            named.setdefault(claim, set()).add(m.id)
    for claim, (_, listed) in page.items():
        assert listed == named.get(claim, set()), claim


def test_every_test_the_page_names_exists() -> None:
    for claim, (tests, _) in claims_on_the_page().items():
        for test in tests:
            path, name = test.split("::")
            source = (REPO / path).read_text(encoding="utf-8")
            assert re.search(rf"def {re.escape(name)}\b", source), f"{claim}: {test}"


def test_a_mutation_killed_only_by_a_consistency_check_or_a_linter_is_refused() -> None:
    """The mutation check counts a mutation as killed only by a behaviour test it names."""
    [m] = [m for m in MUTATIONS if m.id == "intake-size-limit-doubled"]
    for refused in (
        "tests/unit/test_mutation_list.py",
        "tests/unit/test_static_checks.py::test_ruff_lint_passes",
        "tests/unit/test_docs_reference.py",
    ):
        listed = dataclasses.replace(m, tests=(*m.tests, refused))
        [problem] = run.problems([listed])
        assert problem.startswith(f"{m.id}: names {refused.split('::')[0]}, which runs "), problem
        assert "only a behaviour test may kill a mutation" in problem
    assert run.problems([m]) == []


def test_the_claims_table_counts_what_each_section_lists() -> None:
    """The table at the top of docs/guarantees.md: one row per claim, its test and mutation
    counts those of the claim's section (kept by hand, so checked here)."""
    page = claims_on_the_page()
    text = GUARANTEES.read_text(encoding="utf-8")
    rows = re.findall(r"^\| \[([A-Za-z0-9-]+)\]\(#[^)]*\) \|[^|]*\| (\d+) \| (\d+) \|$", text, re.M)
    assert {claim for claim, _, _ in rows} == set(page)
    for claim, tests, mutations in rows:
        assert (int(tests), int(mutations)) == (len(page[claim][0]), len(page[claim][1])), claim
