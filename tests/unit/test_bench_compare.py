"""`bench --compare` outside a source checkout: one clear line, exit 2 (the wheel does not ship
the comparison workers of bench/)."""

from __future__ import annotations

import pytest

from dialog_worker import cli
from dialog_worker.bench import command


def test_compare_without_the_bench_folder_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(command, "source_root", lambda: None)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # never reached
    assert cli.main(["bench", "--compare", "ours,naive"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    [line] = err.splitlines()
    assert "--compare naive" in line and "bench/" in line and "source checkout" in line
