"""A redis-server whose wall clock a test can step (tests/support/clockshift.c, built here
with the C compiler): `ClockShift.step(3600)` moves Redis' clock an hour forward at once, as an
NTP step or a VM resume does on a real host. Monotonic clocks are left alone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "clockshift.c"


def build(workdir: Path) -> Path | None:
    """The shim, compiled into `workdir`; None when there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = workdir / "clockshift.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return out


class ClockShift:
    def __init__(self, workdir: Path, library: Path) -> None:
        self.file = workdir / "clock-offset"
        self.file.write_text("+0\n")
        self.offset_s = 0
        self.library = library

    @property
    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": str(self.library), "CLOCKSHIFT_FILE": str(self.file)}

    def step(self, seconds: int) -> None:
        """Step the clock by `seconds` more (seen by Redis within 10 ms)."""
        self.offset_s += seconds
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(f"{self.offset_s:+d}\n")
        tmp.replace(self.file)  # never a half-written file
