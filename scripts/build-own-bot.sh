#!/usr/bin/env bash
# Build your own bot's image without a Docker engine, and keep it as a file.
#
#   bash scripts/build-own-bot.sh DIR ARCHIVE [TAG]     # as root, on Debian 12
#   bash scripts/build-own-bot.sh examples/own_bot /var/tmp/mybot.tar mybot:0.1.0
#
# DIR holds your bot's Dockerfile (FROM the dialog-worker image, as examples/own_bot/'s); the
# dialog-worker image is built from this checkout first. The bot's image is checked (it names
# DIALOG_ENGINE, which imports in it, and runs as the image's user) and saved as ARCHIVE, a
# docker archive tagged TAG (default mybot:latest): `podman load -i ARCHIVE` or
# `docker load -i ARCHIVE` on the machine that runs it. Podman, as scripts/container-check.sh
# sets it up (docs/deploy.md, "Building and running the image without Docker"): what it
# installs, and nothing else it built is kept. The last line is "containers: N passed, M
# failed"; exit 0 only when nothing failed, 2 when the arguments cannot work.
set -uo pipefail

export CONTAINER_CHECK_TIMEOUT_S=${CONTAINER_CHECK_TIMEOUT_S:-600}
HERE=$(cd "$(dirname "$0")" && pwd)
timeout --kill-after=60 "$CONTAINER_CHECK_TIMEOUT_S" \
    python3 -u "$HERE/container_check_host.py" build-own-bot "$@"
