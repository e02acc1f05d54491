#!/usr/bin/env bash
# Build the container image and run it for real, with podman instead of a Docker engine.
#
#   bash scripts/container-check.sh        # as root, on Debian 12; .ci/run runs it after pytest
#
# Steps (docs/deploy.md, "Building and running the image without Docker", says why each is
# shaped so):
#   1. install podman, buildah, runc, mmdebstrap, redis-server, curl (apt) and podman-compose
#      1.6.0 (PyPI, into a venv under ~/.cache) when missing;
#   2. build two local base images with mmdebstrap from the Debian mirror the host's apt uses
#      (no registry is reachable): python3 + venv + pip, and redis-server for compose;
#   3. build the project image from the Dockerfile (PYTHON_IMAGE=the local base);
#   4. check it: uid 10001, HEALTHCHECK kept, /healthz 200 at once, /readyz 503 until a
#      redis-server on loopback answers and 200 after, `podman healthcheck run` healthy;
#   5. a burst of 500 messages over 50 sessions through three worker containers, SIGTERM
#      (`podman stop`) to one of them mid-burst: it exits 0 within the shutdown grace, every
#      message is applied exactly once and in order (scripts/container_check.py);
#   6. `podman-compose up` of docker-compose.yml (redis and worker, with an override: local
#      images, host network, loopback ports), a send, a state, `down -v`.
# Everything runs in a private podman store under a temporary folder with host networking
# only: no bridge or CNI network is ever created, containers talk to 127.0.0.1 only. On every
# exit path the containers, pods, volumes, images, the redis-server and the folder are removed.
# The last line is "containers: N passed, M failed"; exit 0 only when nothing failed.
#
# Environment: CONTAINER_CHECK_TIMEOUT_S (hard limit for the whole run, default 600),
# CONTAINER_CHECK_DEBIAN_MIRROR (a mirror URL or sources file for mmdebstrap; default: the
# host's Debian sources).
set -euo pipefail

TIMEOUT_S=${CONTAINER_CHECK_TIMEOUT_S:-600}
if [ -z "${CONTAINER_CHECK_UNDER_TIMEOUT:-}" ]; then
    # The whole run is bounded: on expiry `timeout` sends SIGTERM to this script and to what it
    # runs in the foreground; the trap below then cleans up (60 s more before SIGKILL).
    export CONTAINER_CHECK_UNDER_TIMEOUT=1
    exec timeout --kill-after=60 "$TIMEOUT_S" bash "$0" "$@"
fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
# Messages and the summary go to fd 3, the script's own stdout: a trap can run while a step's
# output is redirected to its log (bash runs it inside the redirected command).
exec 3>&1
STARTED=$(date +%s.%N)
RUN_ID=$$
PC_VERSION=1.6.0
PC_VENV=${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/dialog-worker/podman-compose-$PC_VERSION
BURST_SESSIONS=50
BURST_MESSAGES=10
WORKER_GRACE_S=10     # DIALOG_SHUTDOWN_GRACE_S of the burst's workers
STOP_OVERHEAD_S=3     # what `podman stop` itself may add to the worker's own exit time

WORK=""
REDIS_PID=""
COMPOSE_UP=""
BG_PIDS=()
PASSED=()
FAILED=()
NOTES=()
IMAGE=localhost/dialog-worker:check-$RUN_ID
BASE_IMAGE=localhost/dialog-worker-base:check-$RUN_ID
REDIS_IMAGE=localhost/dialog-worker-redis:check-$RUN_ID
PROJECT=dialog-worker-check

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
say() { printf '[container-check %6ss] %s\n' "$(elapsed "$STARTED")" "$*" >&3; }
pass() { PASSED+=("$1${2:+: $2}"); say "PASS  $1${2:+: $2}"; }
note() { NOTES+=("$1"); say "      $1"; }

# A failed check ends the run (later steps build on earlier ones): the EXIT trap cleans up and
# prints the summary.
fail() {
    FAILED+=("$1${2:+: $2}")
    say "FAIL  $1${2:+: $2}"
    exit 1
}

# Show the end of a step's log (on failure).
show_log() {
    local file=$1
    if [ -s "$file" ]; then
        {
            echo "----- last lines of $(basename "$file") -----"
            tail -n "${2:-40}" "$file"
            echo "-----"
        } >&3
    fi
}

# run_step NAME CMD...: run with output to logs/NAME.log; on failure print its tail and fail.
run_step() {
    local name=$1
    shift
    if ! "$@" >"$WORK/logs/$name.log" 2>&1; then
        show_log "$WORK/logs/$name.log"
        fail "$name" "command failed: $*"
    fi
}

# wait_until SECONDS CMD...: poll CMD every 0.2 s until it succeeds; non-zero at the deadline.
wait_until() {
    local deadline
    deadline=$(awk -v n="$(date +%s.%N)" -v l="$1" 'BEGIN { printf "%.3f", n + l }')
    shift
    until "$@" >/dev/null 2>&1; do
        if awk -v d="$deadline" -v n="$(date +%s.%N)" 'BEGIN { exit !(n > d) }'; then
            return 1
        fi
        sleep 0.2
    done
}

http_code() {
    curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1" 2>/dev/null || true
}
http_is() { [ "$(http_code "$2")" = "$1" ]; }

free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

interfaces() { ip -o link show | awk -F': ' '{ print $2 }' | sed 's/@.*//' | sort; }

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    set +e
    if [ -n "$WORK" ]; then
        say "cleaning up"
        for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
        if [ -n "$COMPOSE_UP" ]; then
            timeout 90 "$PC_VENV/bin/podman-compose" -p "$PROJECT" -f "$REPO/docker-compose.yml" \
                -f "$WORK/compose.override.yml" down -v -t 5 >>"$WORK/logs/cleanup.log" 2>&1
        fi
        # The store is private to this run: everything in it is ours.
        {
            timeout 90 podman rm --all --force --time 2
            timeout 30 podman pod rm --all --force
            timeout 30 podman volume rm --all --force
            timeout 90 podman rmi --all --force
        } >>"$WORK/logs/cleanup.log" 2>&1
        if [ -n "$REDIS_PID" ] && kill -0 "$REDIS_PID" 2>/dev/null; then
            kill "$REDIS_PID"
            for _ in $(seq 50); do kill -0 "$REDIS_PID" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$REDIS_PID" 2>/dev/null
        fi
        # Mounts an interrupted build or container may have left inside the folder.
        awk -v w="$WORK" '$2 == w || index($2, w "/") == 1 { print $2 }' /proc/mounts | sort -r |
            while read -r m; do umount -l "$m"; done
        rm -rf "$WORK"
        # Host network only: no interface (a bridge, a veth) may have appeared during the run.
        if [ -n "${INTERFACES_BEFORE:-}" ]; then
            new=$(comm -13 <(echo "$INTERFACES_BEFORE") <(interfaces) | tr '\n' ' ')
            if [ -n "${new// /}" ]; then
                FAILED+=("host network only: new network interfaces appeared: $new")
            fi
        fi
    fi
    {
        echo
        say "total $(elapsed "$STARTED") s"
        for n in "${NOTES[@]}"; do echo "  note: $n"; done
        for p in "${PASSED[@]}"; do echo "  PASS $p"; done
        for f in "${FAILED[@]}"; do echo "  FAIL $f"; done
        if [ ${#FAILED[@]} -eq 0 ] && [ "$status" -ne 0 ]; then
            FAILED+=("interrupted (exit $status)")
            echo "  FAIL interrupted (exit $status)"
        fi
        echo "containers: ${#PASSED[@]} passed, ${#FAILED[@]} failed"
    } >&3
    [ ${#FAILED[@]} -eq 0 ] && exit 0
    exit 1
}
trap cleanup EXIT
trap 'fail "overall" "stopped by a signal (the hard limit is ${TIMEOUT_S} s)"' INT TERM

# --------------------------------------------------------------------------------------------
# 1. What it needs

[ "$(id -u)" = 0 ] || fail "prerequisites" "must run as root (rootful podman, mmdebstrap in root mode)"
command -v apt-get >/dev/null || fail "prerequisites" "needs a Debian host with apt-get (Debian 12 tested)"
# shellcheck source=/dev/null
. /etc/os-release
CODENAME=${VERSION_CODENAME:-bookworm}

missing=()
for pair in podman:podman buildah:buildah runc:runc mmdebstrap:mmdebstrap \
    redis-server:redis-server redis-cli:redis-tools curl:curl; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
WORK=$(mktemp -d /var/tmp/dialog-container-check.XXXXXX)
mkdir -p "$WORK/logs"
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]} (apt-get)"
    # Wait for apt's lock rather than fail: other people may be installing on this machine.
    run_step apt-update apt-get -o DPkg::Lock::Timeout=180 update -qq
    run_step apt-install env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=180 \
        install -y -qq --no-install-recommends "${missing[@]}"
fi
# Debian's podman-compose (1.0.3) cannot run this compose file with an override; 1.6.0 can.
if ! "$PC_VENV/bin/podman-compose" --version 2>/dev/null | grep -q "podman-compose version $PC_VERSION"; then
    say "installing podman-compose==$PC_VERSION into $PC_VENV"
    rm -rf "$PC_VENV"
    run_step podman-compose-venv python3 -m venv "$PC_VENV"
    run_step podman-compose-install "$PC_VENV/bin/pip" install -q --disable-pip-version-check \
        "podman-compose==$PC_VERSION"
fi
pass "install" "$(podman --version), $(buildah --version | cut -d' ' -f1-3), runc $(runc --version | awk 'NR==1 { print $3 }'), mmdebstrap $(mmdebstrap --version | awk '{ print $2 }'), podman-compose $PC_VERSION"

# Podman configured for these machines, for this run only (CONTAINERS_* point at files in the
# run's folder; /etc/containers is not touched):
# - runc, not crun: crun 1.8 rejects the kernel's hybrid cgroup layout; cgroupfs: no systemd.
# - default ulimits no higher than the machine's hard limits (podman's defaults exceed them).
# - host network by default, and CNI configuration in the run's folder, so that podman never
#   writes or uses a bridge network: a bridge's private-range addresses must never see traffic.
# - a private store: everything this run builds or starts is removed with the folder.
# - no unqualified registry: a short image name can never turn into a pull.
NOFILE=$(ulimit -Hn)
NPROC=$(ulimit -Hu)
[ "$NPROC" = unlimited ] || [ "$NPROC" -gt 32768 ] && NPROC=32768
mkdir -p "$WORK/storage" "$WORK/run" "$WORK/tmp" "$WORK/cni" "$WORK/volumes"
cat >"$WORK/containers.conf" <<EOF
[containers]
netns = "host"
default_ulimits = ["nofile=$NOFILE:$NOFILE", "nproc=$NPROC:$NPROC"]
[network]
network_config_dir = "$WORK/cni"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$WORK/tmp/events.log"
tmp_dir = "$WORK/tmp"
volume_path = "$WORK/volumes"
EOF
cat >"$WORK/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$WORK/storage"
runroot = "$WORK/run"
EOF
cat >"$WORK/registries.conf" <<EOF
unqualified-search-registries = []
short-name-mode = "enforcing"
EOF
export CONTAINERS_CONF=$WORK/containers.conf
export CONTAINERS_STORAGE_CONF=$WORK/storage.conf
export CONTAINERS_REGISTRIES_CONF=$WORK/registries.conf
export BUILDAH_FORMAT=docker   # the OCI format has no HEALTHCHECK: buildah would drop it
INTERFACES_BEFORE=$(interfaces)

run_step podman-info podman info
grep -q 'name: runc' "$WORK/logs/podman-info.log" || fail "podman" "runtime is not runc"
grep -q "graphRoot: $WORK/storage" "$WORK/logs/podman-info.log" || fail "podman" "private store not in use"

# --------------------------------------------------------------------------------------------
# 2. Local base images (mmdebstrap from the host's Debian mirror, then `podman import`)

if [ -n "${CONTAINER_CHECK_DEBIAN_MIRROR:-}" ]; then
    MIRROR=$CONTAINER_CHECK_DEBIAN_MIRROR
elif [ -s /etc/apt/sources.list.d/debian.sources ]; then
    MIRROR=/etc/apt/sources.list.d/debian.sources   # deb822; mmdebstrap takes the file as is
else
    MIRROR=$(awk -v s="$CODENAME" '$1 == "deb" && $0 ~ " " s " " { for (i = 2; i <= NF; i++)
        if ($i ~ "://") { print $i; exit } }' /etc/apt/sources.list 2>/dev/null || true)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

# The host may reach the package index through a TLS-intercepting proxy whose CA it trusts
# (local certificates in /usr/local/share/ca-certificates): the builder stage's pip needs the
# same trust. These are public certificates, copied into the local base only.
ca_hooks=()
local_cas=(/usr/local/share/ca-certificates/*.crt)
if [ -e "${local_cas[0]}" ]; then
    # shellcheck disable=SC2016  # "$1" is the chroot, expanded by mmdebstrap's hook shell
    ca_hooks=(--customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"'
        --customize-hook="copy-in ${local_cas[*]} /usr/local/share/ca-certificates/"
        --customize-hook='chroot "$1" update-ca-certificates >/dev/null')
fi
debstrap() {  # debstrap PACKAGES [extra mmdebstrap options...]: a minbase rootfs tar on stdout
    local packages=$1
    shift
    TMPDIR=$WORK/tmp mmdebstrap --quiet --variant=minbase \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$@" "$CODENAME" - "$MIRROR"
}
build_python_base() {
    # What the Dockerfile expects of python:3.11-slim: `python` with pip (builder stage), venv
    # (install-wheel.sh), groupadd/useradd, CA certificates.
    debstrap python3,python3-venv,python3-pip,python-is-python3,ca-certificates "${ca_hooks[@]}" |
        podman import --change 'CMD ["python3"]' - "$BASE_IMAGE"
}
build_redis_base() {
    # Stands in for redis:7 in docker-compose.yml: redis-server and redis-cli, WORKDIR /data.
    # shellcheck disable=SC2016  # "$1" is the chroot, expanded by mmdebstrap's hook shell
    debstrap redis-server --customize-hook='mkdir -p "$1/data" && chroot "$1" chown redis:redis /data' |
        podman import --change 'WORKDIR /data' --change 'USER redis' \
            --change 'CMD ["redis-server"]' - "$REDIS_IMAGE"
}
t0=$(date +%s.%N)
run_step base-python build_python_base
BASE_PY_S=$(elapsed "$t0")
t0=$(date +%s.%N)
run_step base-redis build_redis_base
BASE_REDIS_S=$(elapsed "$t0")
size_mb() { podman image inspect --format '{{.Size}}' "$1" | awk '{ printf "%.0f", $1 / 1e6 }'; }
pass "base images" "python base $(size_mb "$BASE_IMAGE") MB in ${BASE_PY_S} s, redis $(size_mb "$REDIS_IMAGE") MB in ${BASE_REDIS_S} s (mmdebstrap $CODENAME from $MIRROR)"

# --------------------------------------------------------------------------------------------
# 3. The project image, from the Dockerfile as it is (only the base is a build argument)

t0=$(date +%s.%N)
run_step image-build podman build --format docker --network host \
    --build-arg "PYTHON_IMAGE=$BASE_IMAGE" --tag "$IMAGE" "$REPO"
IMAGE_S=$(elapsed "$t0")
IMAGE_MB=$(size_mb "$IMAGE")
pass "image build" "$IMAGE $IMAGE_MB MB in ${IMAGE_S} s"

# --------------------------------------------------------------------------------------------
# 4. What the image declares, then one worker before and after Redis answers

user=$(podman image inspect --format '{{.Config.User}}' "$IMAGE")
health=$(podman image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE")
stopsignal=$(podman image inspect --format '{{.Config.StopSignal}}' "$IMAGE")
[ "$user" = "10001:10001" ] || fail "image config" "USER is '$user', expected 10001:10001"
case "$health" in *'/healthz'*) ;; *) fail "image config" "no HEALTHCHECK in the image ($health)" ;; esac
[ "$stopsignal" = SIGTERM ] || fail "image config" "STOPSIGNAL is '$stopsignal'"
uid=$(podman run --rm --network host --entrypoint id "$IMAGE" -u 2>>"$WORK/logs/podman.log")
[ "$uid" = 10001 ] || fail "image config" "runs as uid $uid"
pass "image config" "USER 10001:10001 (id -u in a container: $uid), HEALTHCHECK on /healthz, STOPSIGNAL SIGTERM"

read -r REDIS_PORT P1 P2 P3 COMPOSE_REDIS_PORT COMPOSE_METRICS_PORT <<<"$(free_ports 6)"
REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0
CHECK_PY=/opt/dialog-check/container_check.py
worker_args=(--network host
    -v "$REPO/scripts/container_check.py:$CHECK_PY:ro"
    -e "REDIS_URL=$REDIS_URL" -e DIALOG_METRICS_HOST=127.0.0.1
    -e "DIALOG_SHUTDOWN_GRACE_S=$WORKER_GRACE_S"
    -e DIALOG_ENGINE=container_check:engine -e PYTHONPATH=/opt/dialog-check)
start_worker() {  # start_worker N PORT
    podman run -d --name "check-w$1" "${worker_args[@]}" -e "DIALOG_METRICS_PORT=$2" \
        -e "DIALOG_CONSUMER=check-w$1" "$IMAGE" >/dev/null 2>>"$WORK/logs/podman.log"
}

# Nothing listens on REDIS_PORT yet.
t0=$(date +%s.%N)
start_worker 1 "$P1" || fail "health before Redis" "podman run failed"
wait_until 30 http_is 200 "http://127.0.0.1:$P1/healthz" ||
    { podman logs check-w1 2>&1 | tail -20; fail "health before Redis" "/healthz not 200 within 30 s"; }
HEALTHZ_S=$(elapsed "$t0")
ready_before=$(http_code "http://127.0.0.1:$P1/readyz")
[ "$ready_before" = 503 ] || fail "health before Redis" "/readyz $ready_before while Redis is down, expected 503"
status1=$(podman inspect --format '{{.State.Status}}' check-w1)
[ "$status1" = running ] || fail "health before Redis" "container $status1"
podman healthcheck run check-w1 >/dev/null || fail "health before Redis" "podman healthcheck run: unhealthy"
uid1=$(podman exec check-w1 awk '/^Uid:/ { print $2 }' /proc/1/status)
[ "$uid1" = 10001 ] || fail "health before Redis" "the worker process runs as uid $uid1"
pass "health before Redis" "/healthz 200 ${HEALTHZ_S} s after podman run, /readyz 503, HEALTHCHECK healthy, worker uid $uid1"

redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --logfile "$WORK/logs/redis.log" >/dev/null 2>&1 &
REDIS_PID=$!
wait_until 15 redis-cli -p "$REDIS_PORT" ping || fail "readiness" "redis-server did not start"
t0=$(date +%s.%N)
wait_until 30 http_is 200 "http://127.0.0.1:$P1/readyz" ||
    { podman logs check-w1 2>&1 | tail -20; fail "readiness" "/readyz not 200 within 30 s of Redis answering"; }
pass "readiness" "/readyz 200 $(elapsed "$t0") s after redis-server on 127.0.0.1:$REDIS_PORT answered"

# --------------------------------------------------------------------------------------------
# 5. Burst through three worker containers, SIGTERM to one of them mid-burst

for n in 2 3; do
    port_var=P$n
    start_worker "$n" "${!port_var}" || fail "burst" "podman run failed"
done
for p in "$P2" "$P3"; do
    wait_until 30 http_is 200 "http://127.0.0.1:$p/readyz" || fail "burst" "worker on :$p not ready"
done
TOTAL=$((BURST_SESSIONS * BURST_MESSAGES))
t0=$(date +%s.%N)
timeout 240 podman run --rm --name check-burst --network host -e "REDIS_URL=$REDIS_URL" \
    -v "$REPO/scripts/container_check.py:$CHECK_PY:ro" --entrypoint python "$IMAGE" "$CHECK_PY" \
    burst --sessions "$BURST_SESSIONS" --messages "$BURST_MESSAGES" --prefix "burst-$RUN_ID" \
    --timeout 150 >"$WORK/sent.json" 2>"$WORK/logs/burst.log" &
BURST_PID=$!
BG_PIDS+=("$BURST_PID")
replies() { redis-cli -p "$REDIS_PORT" xlen dialog-replies 2>/dev/null || echo 0; }
mid_burst() { [ "$(replies)" -ge $((TOTAL / 5)) ] || ! kill -0 "$BURST_PID" 2>/dev/null; }
wait_until 60 mid_burst || fail "burst" "fewer than $((TOTAL / 5)) replies after 60 s"
at_stop=$(replies)
# Evidence that the worker had work in hand (informational: metric names may change).
w2_metrics=$(curl -s --max-time 2 "http://127.0.0.1:$P2/metrics" || true)
w2_in_flight=$(awk '$1 == "dialog_in_flight" { printf "%d", $2 }' <<<"$w2_metrics")
w2_applied=$(awk '$1 == "dialog_messages_total{outcome=\"applied\"}" { printf "%d", $2 }' <<<"$w2_metrics")
kill -0 "$BURST_PID" 2>/dev/null || { show_log "$WORK/logs/burst.log"; fail "burst" "the sender stopped early"; }
[ "$at_stop" -lt "$TOTAL" ] || fail "SIGTERM mid-burst" "the burst was over ($at_stop replies) before the SIGTERM"
t1=$(date +%s.%N)
timeout 60 podman stop --time $((WORKER_GRACE_S + 20)) check-w2 >/dev/null 2>>"$WORK/logs/podman.log" ||
    fail "SIGTERM mid-burst" "podman stop failed"
STOP_S=$(elapsed "$t1")
code=$(podman inspect --format '{{.State.ExitCode}}' check-w2)
after_stop=$(replies)
[ "$code" = 0 ] || { podman logs check-w2 2>&1 | tail -20; fail "SIGTERM mid-burst" "exit code $code"; }
awk -v s="$STOP_S" -v g="$WORKER_GRACE_S" -v o="$STOP_OVERHEAD_S" 'BEGIN { exit !(s <= g + o) }' ||
    fail "SIGTERM mid-burst" "took $STOP_S s, grace is $WORKER_GRACE_S s"
pass "SIGTERM mid-burst" "podman stop of worker 2 at $at_stop/$TOTAL replies (it had applied ${w2_applied:-?}, ${w2_in_flight:-?} in flight; $after_stop replies when it had exited): exit 0 in ${STOP_S} s (grace ${WORKER_GRACE_S} s)"

wait "$BURST_PID" || { show_log "$WORK/logs/burst.log"; fail "burst" "not every message was applied (see burst.log)"; }
BURST_S=$(elapsed "$t0")
for n in 1 3; do
    timeout 60 podman stop --time $((WORKER_GRACE_S + 20)) "check-w$n" >/dev/null 2>>"$WORK/logs/podman.log" ||
        fail "burst" "podman stop check-w$n failed"
    code=$(podman inspect --format '{{.State.ExitCode}}' "check-w$n")
    [ "$code" = 0 ] || fail "burst" "worker $n exited $code"
done
if ! podman run --rm -i --name check-verify --network host -e "REDIS_URL=$REDIS_URL" \
    -v "$REPO/scripts/container_check.py:$CHECK_PY:ro" --entrypoint python "$IMAGE" "$CHECK_PY" \
    verify --messages "$BURST_MESSAGES" <"$WORK/sent.json" >"$WORK/logs/verify.log" 2>&1; then
    show_log "$WORK/logs/verify.log"
    fail "burst exactly once, in order" "verification failed"
fi
summary=$(tail -n 1 "$WORK/logs/verify.log")
pass "burst exactly once, in order" "$TOTAL messages over $BURST_SESSIONS sessions, 3 workers, applied in ${BURST_S} s; $summary"

# --------------------------------------------------------------------------------------------
# 6. docker-compose.yml through podman-compose: redis and worker, a send, a state, down -v

# The override keeps the project's file as it is and changes only what these machines need:
# local images (never pulled or built), host network for every service, Redis on a free
# loopback port (the compose command plus --port/--bind, and its healthcheck on that port), the
# worker's metrics on a free loopback port.
"$PC_VENV/bin/python" - "$REPO/docker-compose.yml" "$WORK/compose.override.yml" <<PY
import json, sys, yaml
compose = yaml.safe_load(open(sys.argv[1]))
redis_cmd = [str(c) for c in compose["services"]["redis"]["command"]]
redis_cmd += ["--port", "$COMPOSE_REDIS_PORT", "--bind", "127.0.0.1"]
j = json.dumps
lines = [
    "# Written by scripts/container-check.sh: local images, host network, loopback ports.",
    "services:",
    "  redis:",
    f"    image: {j('$REDIS_IMAGE')}",
    "    pull_policy: never",
    "    network_mode: host",
    f"    command: !override {j(redis_cmd)}",
    "    healthcheck:",
    f"      test: !override {j(['CMD', 'redis-cli', '-p', '$COMPOSE_REDIS_PORT', 'ping'])}",
    "  worker:",
    f"    image: {j('$IMAGE')}",
    "    pull_policy: never",
    "    network_mode: host",
    "    environment:",
    f"      REDIS_URL: {j('redis://127.0.0.1:$COMPOSE_REDIS_PORT/0')}",
    "      DIALOG_METRICS_HOST: 127.0.0.1",
    f"      DIALOG_METRICS_PORT: {j('$COMPOSE_METRICS_PORT')}",
]
# Services this check does not start get host networking too, so that no service of the
# project could ever land on a bridge, even if someone runs up without naming services.
for name in compose["services"]:
    if name not in ("redis", "worker"):
        lines += [f"  {name}:", "    network_mode: host"]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
PY
pc() { "$PC_VENV/bin/podman-compose" -p "$PROJECT" -f "$REPO/docker-compose.yml" -f "$WORK/compose.override.yml" "$@"; }

# Guard: what `up` would run, without running it. Every container on the host network, and
# no network created.
pc --verbose --dry-run up -d --no-build redis worker >"$WORK/logs/compose-dry-run.log" 2>&1 ||
    { show_log "$WORK/logs/compose-dry-run.log"; fail "compose" "dry run failed"; }
creates=$(grep -c 'podman create ' "$WORK/logs/compose-dry-run.log" || true)
[ "$creates" = 2 ] || { show_log "$WORK/logs/compose-dry-run.log"; fail "compose" "dry run creates $creates containers, expected 2"; }
if grep 'podman create \|podman run ' "$WORK/logs/compose-dry-run.log" | grep -v -q -- '--network=host' ||
    grep -q 'network create\|--network=bridge' "$WORK/logs/compose-dry-run.log"; then
    show_log "$WORK/logs/compose-dry-run.log"
    fail "compose" "the override would not keep every container on the host network"
fi

COMPOSE_UP=1
run_step compose-up pc up -d --no-build redis worker
wait_until 60 http_is 200 "http://127.0.0.1:$COMPOSE_METRICS_PORT/readyz" ||
    { pc logs worker 2>&1 | tail -20; fail "compose" "worker not ready within 60 s"; }
ctr() { podman ps -a --filter "label=io.podman.compose.project=$PROJECT" \
    --filter "label=io.podman.compose.service=$1" --format '{{.Names}}' | head -n 1; }
REDIS_CTR=$(ctr redis)
WORKER_CTR=$(ctr worker)
podman healthcheck run "$REDIS_CTR" >/dev/null || fail "compose" "redis healthcheck unhealthy"
podman healthcheck run "$WORKER_CTR" >/dev/null || fail "compose" "worker healthcheck unhealthy"
session=compose-$RUN_ID
sent=$(timeout 60 "$PC_VENV/bin/podman-compose" -p "$PROJECT" -f "$REPO/docker-compose.yml" \
    -f "$WORK/compose.override.yml" exec -T worker dialog-worker send "$session" "nama saya Budi" 2>"$WORK/logs/compose-send.log") ||
    { show_log "$WORK/logs/compose-send.log"; fail "compose" "dialog-worker send failed"; }
echo "$sent" | python3 -c 'import json, sys; d = json.loads(sys.stdin.readline()); assert d["session_id"] == sys.argv[1]' "$session" ||
    fail "compose" "send printed $sent"
state_applied() {
    timeout 30 "$PC_VENV/bin/podman-compose" -p "$PROJECT" -f "$REPO/docker-compose.yml" \
        -f "$WORK/compose.override.yml" exec -T worker dialog-worker state "$session" >"$WORK/state.json" 2>/dev/null &&
        python3 - "$WORK/state.json" <<'PY'
import json, sys
state = json.load(open(sys.argv[1]))
assert state["applied_seq"] == 1, state
assert state["memory"].get("userName") == "Budi", state
assert state["history"][0]["user"] == "nama saya Budi", state
assert state["history"][0]["bot"] == "Halo Budi, ada yang bisa dibantu?", state
PY
}
wait_until 60 state_applied || fail "compose" "state after send: $(cat "$WORK/state.json" 2>/dev/null)"
# The project's Redis command survived the override (only --port/--bind were added).
aof=$(redis-cli -p "$COMPOSE_REDIS_PORT" config get appendonly | tail -n 1)
policy=$(redis-cli -p "$COMPOSE_REDIS_PORT" config get maxmemory-policy | tail -n 1)
[ "$aof $policy" = "yes noeviction" ] || fail "compose" "redis runs with appendonly=$aof maxmemory-policy=$policy"
t1=$(date +%s.%N)
run_step compose-stop pc stop worker
code=$(podman inspect --format '{{.State.ExitCode}}' "$WORKER_CTR")
[ "$code" = 0 ] || fail "compose" "worker exited $code on stop"
COMPOSE_STOP_S=$(elapsed "$t1")
run_step compose-down pc down -v
COMPOSE_UP=""
left=$(podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}')
left+=$(podman volume ls --format '{{.Name}}' | grep "^${PROJECT}_" || true)
left+=$(podman pod ls --format '{{.Name}}' | grep "$PROJECT" || true)
[ -z "$left" ] || fail "compose" "left after down -v: $left"
pass "compose" "podman-compose up redis worker: ready, both HEALTHCHECKs healthy, Redis AOF + noeviction; send + state (\"Halo Budi, ...\"); worker stop exit 0 in ${COMPOSE_STOP_S} s; down -v left nothing"

note "image $IMAGE_MB MB; python base built in ${BASE_PY_S} s, redis base in ${BASE_REDIS_S} s, image in ${IMAGE_S} s"
