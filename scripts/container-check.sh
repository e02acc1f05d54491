#!/usr/bin/env bash
# Build the container image and run it for real, with podman instead of a Docker engine.
#
#   bash scripts/container-check.sh        # as root, on Debian 12; .ci/run runs it after pytest
#
# What it checks and how: scripts/container_check_host.py (docs/deploy.md, "Building and
# running the image without Docker"). Here only what must be shell: the hard time limit on the
# whole run (`timeout` sends SIGTERM, on which the Python side cleans up and reports; SIGKILL
# 60 s later). The last line is "containers: N passed, M failed"; exit 0 only when nothing
# failed.
#
# Environment: CONTAINER_CHECK_TIMEOUT_S (the hard limit, default 600),
# CONTAINER_CHECK_DEBIAN_MIRROR (a mirror URL or sources file for mmdebstrap; default: the
# host's Debian sources).
set -uo pipefail

export CONTAINER_CHECK_TIMEOUT_S=${CONTAINER_CHECK_TIMEOUT_S:-600}
HERE=$(cd "$(dirname "$0")" && pwd)
OUTPUT=$(mktemp)
trap 'rm -f "$OUTPUT"' EXIT
timeout --kill-after=60 "$CONTAINER_CHECK_TIMEOUT_S" \
    python3 -u "$HERE/container_check_host.py" | tee "$OUTPUT"
status=$?
if ! tail -n 1 "$OUTPUT" | grep -q '^containers: [0-9]* passed, [0-9]* failed$'; then
    # Killed, or Python could not run at all: no summary was printed.
    echo "  FAIL the check itself exited $status without a summary"
    echo "containers: 0 passed, 1 failed"
    [ "$status" -ne 0 ] || status=1
fi
exit "$status"
