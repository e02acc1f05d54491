"""The supervisor's pure parts: restart backoff and the process count."""

from __future__ import annotations

import os

import pytest

from dialog_worker.cli import _parser
from dialog_worker.daemon.supervisor import RESTART_MAX_S, cpu_count, restart_delay_s


def test_restart_delay_doubles_from_half_a_second_and_is_capped() -> None:
    assert [restart_delay_s(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert restart_delay_s(50) == RESTART_MAX_S == 30.0
    assert restart_delay_s(10_000) == RESTART_MAX_S  # no overflow however long it fails


def test_processes_auto_is_the_usable_cpu_count_and_default_is_one() -> None:
    assert _parser().parse_args(["run", "--processes", "auto"]).processes == cpu_count()
    assert _parser().parse_args(["run"]).processes == 1
    assert 1 <= cpu_count() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("raw", ["0", "-2", "all"])
def test_processes_must_be_a_positive_count_or_auto(raw: str) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["run", "--processes", raw])
    assert exc.value.code == 2
