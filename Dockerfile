# syntax=docker/dockerfile:1
# dialog-worker container image.
#
#   docker build -t dialog-worker:0.1.0 .
#   docker run --rm -e REDIS_URL=redis://redis:6379/0 -p 8000:8000 dialog-worker:0.1.0
#   docker run ... dialog-worker:0.1.0 serve      # the HTTP gateway (docs/http.md)
#   docker run ... dialog-worker:0.1.0 console    # the operators' console (docs/console.md)
#
# Stage 1 (builder) builds the project wheel and the wheels of all its dependencies, with the
# http extra (the gateway and the console: one image for every service of docs/deploy.md).
# Stage 2 (runtime) installs them offline into /opt/dialog-worker with
# scripts/install-wheel.sh, the same script tests/integration/test_deploy.py runs, and
# starts `dialog-worker run` as an unprivileged user. Your own bot is an image built FROM this
# one (examples/own_bot/Dockerfile).
#
# Without a Docker engine: scripts/container-check.sh builds this file with podman (the base
# passed as PYTHON_IMAGE, a local image built with mmdebstrap) and runs the result.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the wheel is built from (pyproject.toml: README.md is the long description,
# lua/ and config/rules.toml are force-included into the package).
COPY pyproject.toml README.md LICENSE ./
COPY worker ./worker
COPY lua ./lua
COPY config/rules.toml ./config/rules.toml
RUN python -m pip wheel --wheel-dir /wheels ".[http]"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="dialog-worker" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.description="Lossless, per-session ordered processing of chatbot dialog messages on Redis Streams"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/dialog-worker/bin:$PATH \
    DIALOG_METRICS_HOST=0.0.0.0 \
    DIALOG_METRICS_PORT=8000 \
    DIALOG_LOG_FORMAT=json
# A fixed numeric UID/GID, so Kubernetes can enforce runAsNonRoot against the image.
RUN groupadd --system --gid 10001 dialog \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/dialog --create-home \
       --shell /usr/sbin/nologin dialog
COPY scripts/install-wheel.sh /usr/local/bin/install-wheel.sh
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    PIP_NO_INDEX=1 EXTRAS=http /bin/sh /usr/local/bin/install-wheel.sh /opt/dialog-worker /wheels \
    && rm /usr/local/bin/install-wheel.sh
# An empty working directory: no config/worker.toml is picked up unless one is mounted here
# (or named by DIALOG_CONFIG); settings come from the environment.
WORKDIR /app
USER 10001:10001
EXPOSE 8000
# Liveness of the process (the same endpoint as the Kubernetes liveness probe). Readiness
# (Redis reachable, consumer group present) is /readyz.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DIALOG_METRICS_PORT', '8000'), timeout=4)"]
# The worker stops reading on SIGTERM, gives in-flight work DIALOG_SHUTDOWN_GRACE_S (25 s by
# default), hands back the rest and exits 0: give it longer than that to stop
# (`docker stop -t 35`, compose stop_grace_period, Kubernetes terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["dialog-worker"]
CMD ["run"]
