"""The HTTP gateway (`dialog-worker serve`, extra ``dialog-worker[http]``): send messages and
stream their answers to browsers over server-sent events. An ASGI app on the client, never on
the worker (docs/http.md)."""

from dialog_worker.gateway.app import create_app

__all__ = ["create_app"]
