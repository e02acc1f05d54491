"""`dialog-worker bench`, the load generator (user-facing description: command.py).

command        the CLI arguments; for each system: start, warm up, run the phases, clean up
target         one system under test: settings and namespace, workers, producer
spawn          worker processes (ours or a comparison worker from bench/), readiness, stop
workload       what is sent (bursts, fixed rate) and the producer that sends it
run            one measured run: snapshots, send, drain, result
measure        the instruments: snapshots of every counter, the reply reader
cost           re-queues, Redis commands and round trips, CPU, per message
check          correctness: lost, duplicated, out of order, replies, not applied
report         progress, the human summary, the latency plot
counting       the command-counting shim (`python -m dialog_worker.bench _count MODULE ...`)
machine        machine facts, per-process CPU and RSS
redis_server   `--redis embedded`: a redis-server of the bench's own
stats          percentiles and inversions
"""

# The CLI takes `add_parser` and `bench_command` from command.py itself: importing them here
# imported the fake provider with the package, so `python -m
# dialog_worker.bench.fake_provider` ran a module already imported (runpy's RuntimeWarning).
from dialog_worker.bench.stats import inversions, percentile, summarize

__all__ = ["inversions", "percentile", "summarize"]
