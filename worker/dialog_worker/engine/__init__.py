"""What an engine author uses: the protocol a dialog engine follows, the built-in rules, and
what a step may call (`emit`, `cancelled`, `schedule`); docs/engine.md.

For an engine's own tests: `initial_state`, `run_step` (one step, checked as the worker
checks it), `startup_engine` / `shutdown_engine` (its hooks) and `recording` (what a step
asked of the timers).
"""

from dialog_worker.engine.protocol import (
    Engine,
    initial_state,
    run_step,
    shutdown_engine,
    startup_engine,
)
from dialog_worker.engine.timers import recording

__all__ = ["Engine", "initial_state", "recording", "run_step", "shutdown_engine", "startup_engine"]
