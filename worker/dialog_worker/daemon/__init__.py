"""The worker process (`dialog-worker run`): its loops (worker.py composes them), the life of
one message (pipeline.py), the partial writer, what a failed step leads to, the metrics and
health server, the process pool (supervisor.py)."""
