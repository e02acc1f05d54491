"""Mutation check: every guarantee has a test that fails without it.

Each mutation of tests/mutation/mutations.toml replaces one exact piece of text in one file
(Lua or Python) by a deliberately wrong one. The check copies the repository to a temporary
directory, applies the mutations there one at a time and runs the tests each one names. A
mutation is *killed* when a named test fails; it *survives* when they all pass, and then the
check fails: some claim is no longer checked by any test.

    .venv/bin/python tests/mutation/run.py                 # all of them (what .ci/run runs)
    .venv/bin/python tests/mutation/run.py --only ID ...   # some of them
    .venv/bin/python tests/mutation/run.py --changed-since origin/main  # what a change touched
    .venv/bin/python tests/mutation/run.py --list          # ids, files, claims

Mutations run in parallel, `--jobs N` at a time (default: 1.5 per CPU), each job on its
own copy of the repository with its own temporary folder; `--jobs 1` runs them one by one.
`--changed-since REF` keeps only the mutations whose file or named test files differ from
REF (from its merge base with HEAD, plus uncommitted and new files): quick on a branch; the
full list is what CI runs.

The copy is what runs: pytest starts in it with PYTHONPATH pointing at it (ahead of the
editable install, which points at the checkout), and the worker processes the integration
tests spawn take their PYTHONPATH and working directory from the copy's tests/support, so they
import the mutated package and read the mutated lua/ too. The first mutation of the list
breaks every worker process at start; it is killed only if that holds. No bytecode is written
(PYTHONDONTWRITEBYTECODE), so a mutated and a restored file can never share a stale .pyc; the
copy's Python files are compiled once, when it is made, into .pyc files checked against their
source's hash (not its mtime): the files a mutation leaves alone load from them, the mutated one
is compiled from its text.

Only behaviour tests may kill a mutation: a mutation naming the list's own consistency check,
the docs' reference check or the linters and type checkers (NOT_BEHAVIOUR) is an error.

A run whose tests time out counts as killed (a mutation that makes a test hang is detected),
and is reported as such. A mutation whose text is not found exactly once, or whose tests are
not collected, is an error: the list has drifted from the code, and the check fails too.
Last line: "mutation: N killed, M survived" (plus errors when any).
"""

from __future__ import annotations

import argparse
import compileall
import dataclasses
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIST = Path(__file__).resolve().parent / "mutations.toml"
# A mutation's tests get this long; a run past it counts as killed (reported as a timeout).
TIMEOUT_S = 240
# Tests that fail on a mutation without checking any behaviour: the list's own consistency
# check (any edit of a mutated line fails it, right or wrong), the docs' reference check, and
# the linters and type checkers. A mutation counts as killed only by a test of the behaviour
# it breaks, so naming one of these (or a folder holding one) is an error of the list.
NOT_BEHAVIOUR = {
    "tests/unit/test_mutation_list.py": "the mutation list's own consistency check",
    "tests/unit/test_docs_reference.py": "the docs' consistency check",
    "tests/unit/test_static_checks.py": "the linters and type checkers",
}


@dataclasses.dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    claims: tuple[str, ...]
    why: str


@dataclasses.dataclass
class Outcome:
    mutation: Mutation
    status: str  # killed | survived | error
    seconds: float
    detail: str
    output: str = ""


def load(path: Path = LIST) -> list[Mutation]:
    with path.open("rb") as f:
        doc = tomllib.load(f)
    return [
        Mutation(
            id=m["id"],
            file=m["file"],
            find=m["find"],
            replace=m["replace"],
            tests=tuple(m["tests"]),
            claims=tuple(m.get("claims", ())),
            why=m.get("why", ""),
        )
        for m in doc["mutation"]
    ]


def problems(mutations: list[Mutation], root: Path = REPO) -> list[str]:
    """What is wrong with the list itself, against the files under `root`."""
    found = []
    seen: set[str] = set()
    for m in mutations:
        if m.id in seen:
            found.append(f"{m.id}: id used twice")
        seen.add(m.id)
        target = root / m.file
        if not target.is_file():
            found.append(f"{m.id}: no file {m.file}")
            continue
        n = target.read_text(encoding="utf-8").count(m.find)
        if n != 1:
            found.append(f"{m.id}: the text to replace occurs {n} times in {m.file}, not once")
        if m.find == m.replace:
            found.append(f"{m.id}: the replacement changes nothing")
        if not m.tests:
            found.append(f"{m.id}: names no test")
        for test in m.tests:
            path, _, name = test.partition("::")
            norm = Path(path).as_posix().rstrip("/")
            for refused, what in NOT_BEHAVIOUR.items():
                if refused == norm or refused.startswith(norm + "/"):
                    found.append(
                        f"{m.id}: names {path}, which runs {what}: only a behaviour test "
                        "may kill a mutation"
                    )
            if not (root / path).is_file():
                found.append(f"{m.id}: no test file {path}")
            elif name:
                func = name.split("[", 1)[0]
                if not re.search(rf"def {re.escape(func)}\b", (root / path).read_text("utf-8")):
                    found.append(f"{m.id}: no test {func} in {path}")
    return found


def copy_repo(dest: Path) -> None:
    """The checkout's files as they are now (tracked, plus new ones not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if not src.is_file():  # deleted in the work tree but still tracked
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def compile_copy(copy: Path) -> None:
    """Bytecode for the copy's Python files, valid only while each file's text is what was
    compiled (checked-hash .pyc): every pytest run and worker process of the check would
    otherwise compile the whole package from source (about 1 s of each)."""
    mode = compileall.py_compile.PycInvalidationMode.CHECKED_HASH
    for folder in ("worker", "tests", "examples"):
        if (copy / folder).is_dir():
            compileall.compile_dir(copy / folder, quiet=2, invalidation_mode=mode, workers=1)


def import_folder(copy: Path) -> Path:
    """The folder in which `dialog_worker` is the copy's package (worker/dialog_worker)."""
    return copy / "worker"


def environment(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIALOG_")}
    env.pop("REDIS_URL", None)
    env["PYTHONPATH"] = os.pathsep.join([str(import_folder(copy)), str(copy)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # A mutation needs one failing example, not the smallest: the model test skips shrinking
    # (which took minutes per killed mutation).
    env["MODEL_NO_SHRINK"] = "1"
    # A temporary folder per copy: pytest's numbered folders (and anything the tests make
    # with tempfile) of two jobs never meet, and none cleans up another's.
    tmp = copy.parent / f"{copy.name}-tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    return env


def check_isolation(copy: Path) -> None:
    """The copy, not the checkout, is what `import dialog_worker` finds there."""
    out = subprocess.run(
        [sys.executable, "-c", "import dialog_worker.store.scripts as s; print(s.lua_dir())"],
        cwd=copy,
        env=environment(copy),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if Path(out).resolve() != (copy / "lua").resolve():
        raise SystemExit(f"mutation: the copy imports lua/ from {out}, not from {copy}")


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:300]
    tail = output.strip().splitlines()[-1:] or [""]
    return tail[0][:300]


def uses_hypothesis(m: Mutation, copy: Path) -> bool:
    """Whether a test the mutation names (or a folder it names) uses Hypothesis. The others
    run without its pytest plugin, whose import is most of pytest's start-up (about 1 s of
    each run, measured: 2.6 s -> 1.5 s for a file of unit tests)."""
    for test in m.tests:
        path = copy / test.split("::", 1)[0]
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            try:
                if "hypothesis" in file.read_text(encoding="utf-8"):
                    return True
            except OSError:
                return True  # not there: pytest reports it; keep the usual plugins
    return False


def first_skip(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("SKIPPED "):
            return line[:300]
    return "(no reason shown)"


def run_one(m: Mutation, copy: Path, timeout_s: float) -> Outcome:
    target = copy / m.file
    original = target.read_text(encoding="utf-8")
    if original.count(m.find) != 1:
        return Outcome(m, "error", 0.0, "text to replace not found exactly once")
    target.write_text(original.replace(m.find, m.replace), encoding="utf-8")
    started = time.monotonic()
    try:
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        if not uses_hypothesis(m, copy):
            command += ["-p", "no:hypothesispytest"]
        proc = subprocess.Popen(
            [*command, *m.tests],
            cwd=copy,
            env=environment(copy),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its redis-servers and workers go with it on a timeout
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome(
                m, "killed", time.monotonic() - started, f"timeout after {timeout_s:g} s"
            )
        finally:
            try:  # anything the tests left running in their session
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        target.write_text(original, encoding="utf-8")
    seconds = time.monotonic() - started
    if proc.returncode == 0:
        if re.search(r"\d+ skipped", output) and not re.search(r"\d+ passed", output):
            # Not a pass: the tests could not run here (redis-sentinel or Chromium missing,
            # which CI installs). Still not killed, so the check fails and says why.
            why = "every named test was skipped: " + first_skip(output)
            return Outcome(m, "survived", seconds, why, output)
        return Outcome(m, "survived", seconds, "every named test passed", output)
    if proc.returncode in (4, 5) or "during collection" in output:
        # Usage error, nothing collected, or the mutated code does not even import: the list
        # has drifted from the code, which is not a test failing.
        return Outcome(m, "error", seconds, first_failure(output), output)
    return Outcome(m, "killed", seconds, first_failure(output), output)


def default_jobs() -> int:
    """Half again as many jobs as CPUs this process may run on (3 on 2 CPUs): most named
    tests wait on worker processes, Redis and deadlines rather than compute. Measured on 2
    CPUs with every 8th mutation of the list (41): one job per CPU kept the machine 42% busy
    and took 176 s; 3 jobs 60% busy, 114 s; 4 jobs 68%, 102 s, with each test slower."""
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return cpus + cpus // 2


def changed_files(ref: str) -> set[str]:
    """Files that differ between `ref` (its merge base with HEAD) and the work tree, plus new
    files not ignored."""

    def git(*args: str) -> list[str]:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
        return [line for line in out.splitlines() if line]

    base = git("merge-base", ref, "HEAD")[0]
    return set(git("diff", "--name-only", base)) | set(
        git("ls-files", "--others", "--exclude-standard")
    )


def touched_by(m: Mutation, changed: set[str]) -> bool:
    """The mutated file or one of its named test files changed."""
    return m.file in changed or any(t.partition("::")[0] in changed for t in m.tests)


def run_all(mutations: list[Mutation], jobs: int, timeout_s: float, show: bool) -> list[Outcome]:
    """Each job has its own copy of the repository and takes the next mutation when its last
    one is done; results are printed as they come, the list comes back in the list's order."""
    todo: queue.Queue[tuple[int, Mutation]] = queue.Queue()
    for i, m in enumerate(mutations):
        todo.put((i, m))
    results: dict[int, Outcome] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="dialog-mutation-") as tmp:
        copies = [Path(tmp) / f"repo{j + 1}" for j in range(jobs)]
        for copy in copies:
            copy_repo(copy)
            compile_copy(copy)
            check_isolation(copy)
        print(
            f"mutation: {len(mutations)} mutations, {jobs} at a time, each job on its own copy"
            f" in {tmp}",
            flush=True,
        )

        def work(copy: Path) -> None:
            while True:
                try:
                    i, m = todo.get_nowait()
                except queue.Empty:
                    return
                outcome = run_one(m, copy, timeout_s)
                with lock:
                    results[i] = outcome
                    print(
                        f"[{len(results)}/{len(mutations)}] {outcome.status:8} {m.id}"
                        f" ({outcome.seconds:.1f} s)  {outcome.detail}",
                        flush=True,
                    )
                    if show:
                        print("\n".join(outcome.output.splitlines()[-40:]), flush=True)

        threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in copies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return [results[i] for i in range(len(mutations))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per mutation")
    parser.add_argument(
        "--show", action="store_true", help="print the end of each run's pytest output"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help="mutations run at once, each on its own copy (default: 1.5 per CPU)",
    )
    parser.add_argument(
        "--changed-since",
        metavar="REF",
        help="only mutations whose file or named test files differ from REF (merge base)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    mutations = load()
    if args.list:
        for m in mutations:
            print(f"{m.id:48} {m.file:28} {','.join(m.claims)}")
        return 0
    if args.only:
        unknown = set(args.only) - {m.id for m in mutations}
        if unknown:
            parser.error(f"unknown mutation ids: {sorted(unknown)}")
        mutations = [m for m in mutations if m.id in args.only]
    if args.changed_since:
        changed = changed_files(args.changed_since)
        mutations = [m for m in mutations if touched_by(m, changed)]
        print(f"mutation: {len(mutations)} mutations touch what changed since {args.changed_since}")
        if not mutations:
            print("mutation: 0 killed, 0 survived; 0 s")
            return 0
    wrong = problems(mutations)
    if wrong:
        print("\n".join(wrong), file=sys.stderr)
        print(f"mutation: the list is out of step with the code ({len(wrong)} problems)")
        return 1

    started = time.monotonic()
    outcomes = run_all(mutations, min(args.jobs, len(mutations)), args.timeout, args.show)
    killed = [o for o in outcomes if o.status == "killed"]
    survived = [o for o in outcomes if o.status == "survived"]
    errors = [o for o in outcomes if o.status == "error"]
    timeouts = [o for o in killed if o.detail.startswith("timeout")]
    for o in survived:
        print(f"SURVIVED {o.mutation.id}: {o.mutation.file}: {o.mutation.why}")
    for o in errors:
        print(f"ERROR {o.mutation.id}: {o.detail}")
    summary = f"mutation: {len(killed)} killed, {len(survived)} survived"
    if timeouts:
        summary += (
            f" ({len(timeouts)} of the killed by timeout: {[o.mutation.id for o in timeouts]})"
        )
    if errors:
        summary += f", {len(errors)} errors"
    print(f"{summary}; {time.monotonic() - started:.0f} s")
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
