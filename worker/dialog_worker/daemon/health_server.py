"""The operations endpoint: ``/metrics`` (prometheus-client's own WSGI app), ``/healthz``
(the process is alive) and ``/readyz`` (200 only while ``ready()`` says so, 503 otherwise).

It runs in a thread of its own, as prometheus-client's ``start_http_server`` does, so a
scrape never waits for the event loop and a busy loop never fails a liveness probe. One
server serves a single worker (``dialog-worker run``) or, with ``run --processes N``, the
whole host (the supervisor, over every child's metrics).
"""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from dialog_worker.config import env_name
from dialog_worker.errors import ConfigError

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def make_app(registry: CollectorRegistry, ready: Callable[[], bool]) -> WSGIApp:
    metrics = make_wsgi_app(registry)

    def text(start_response: StartResponse, status: str, body: bytes) -> list[bytes]:
        start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if path == "/healthz":
            return text(start_response, "200 OK", b"ok\n")
        if path == "/readyz":
            if ready():
                return text(start_response, "200 OK", b"ready\n")
            return text(start_response, "503 Service Unavailable", b"not ready\n")
        return text(start_response, "404 Not Found", b"not found\n")

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds would flood the worker's log; nothing to say here."""


class HttpServer:
    """A bound server answering from its own thread until ``close``."""

    def __init__(self, server: ThreadingWSGIServer) -> None:
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve(
    host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool]
) -> HttpServer:
    """Bind now (a port in use fails here, as a ConfigError naming the setting) and serve."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(env_name("metrics_host"), f"cannot resolve {host!r}: {exc}") from None

    class Server(ThreadingWSGIServer):
        address_family = family[0][0]

    try:
        server = make_server(
            host, port, make_app(registry, ready), Server, handler_class=_QuietHandler
        )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                env_name("metrics_port"),
                f"{host}:{port} is already in use: give each process on a host its own port "
                "(0 disables the endpoint), or start one `run --processes N` per host",
            ) from None
        raise ConfigError(
            env_name("metrics_host"), f"cannot listen on {host}:{port}: {exc}"
        ) from None
    return HttpServer(server)
