"""`python -m dialog_worker.bench _count MODULE [ARGS...]`: run MODULE under the counting shim."""

import sys

from dialog_worker.bench.counting import EXIT_USAGE, count_main

if len(sys.argv) > 1 and sys.argv[1] == "_count":
    raise SystemExit(count_main(sys.argv[2:]))
print("usage: python -m dialog_worker.bench _count MODULE [ARGS...]", file=sys.stderr)
raise SystemExit(EXIT_USAGE)
