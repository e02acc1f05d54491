"""`dialog-worker serve`: the gateway on uvicorn, refusing to run open to the network."""

from __future__ import annotations

import ipaddress
import socket

import uvicorn

from dialog_worker.config import Settings
from dialog_worker.errors import ConfigError
from dialog_worker.gateway.app import create_app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_auth(host: str, token: str, no_auth: bool, signing_key: str = "") -> str | None:
    """The server token to require ("" when only session tokens are accepted), or None (no
    auth) when that was asked for on a loopback address. Anything else open to the network
    stops the command (exit 2)."""
    if no_auth:
        if not is_loopback(host):
            raise ConfigError(
                "--no-auth", f"only on a loopback address (127.0.0.1, ::1), not {host!r}"
            )
        return None
    if not token and not signing_key:
        raise ConfigError(
            "DIALOG_HTTP_TOKEN",
            "not set (nor DIALOG_HTTP_SIGNING_KEY): every request must carry a token; set "
            "one, or listen on a loopback address with --no-auth",
        )
    return token


async def serve(settings: Settings, host: str, port: int, no_auth: bool) -> int:
    token = check_auth(host, settings.http_token, no_auth, settings.http_signing_key)
    _check_port(host, port)
    app = create_app(settings, token)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on", access_log=False
    )
    print(f"dialog-worker: serving on http://{host}:{port}", flush=True)
    await uvicorn.Server(config).serve()
    return 0


def _check_port(host: str, port: int) -> None:
    """A port in use is one clear line (exit 2), not uvicorn's traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                "DIALOG_HTTP_PORT", f"cannot listen on {host}:{port}: {exc}"
            ) from None
