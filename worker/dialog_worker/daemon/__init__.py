"""The worker process (`dialog-worker run`): its loops, the life of one message, the partial
writer, what a failed step leads to, the metrics and health server, the process pool.
"""
