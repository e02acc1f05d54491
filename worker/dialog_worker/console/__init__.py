"""`dialog-worker console`: a web console for operators (docs/console.md).

The subpackage holds the whole surface: the ASGI app (app.py), who may sign in and act
(auth.py), the audit stream (audit.py), what the pages read (reads.py) and what actions do
(actions.py), with its templates and static files. It talks to Redis through the client and
the read-only views, never through the daemon. It needs the `http` extra
(``pip install 'dialog-worker[http]'``: starlette, uvicorn, jinja2).
"""

from __future__ import annotations

import sys

from dialog_worker.config import Settings

MISSING_EXTRA = (
    "the console needs the http extra: pip install 'dialog-worker[http]' (starlette, uvicorn, "
    "jinja2)"
)


async def serve(settings: Settings) -> None:
    """Run the console until SIGINT or SIGTERM. Raises auth.NoUsers before listening when
    no user is configured."""
    import uvicorn

    from dialog_worker.console.app import create_app

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.console_host,
        port=settings.console_port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        server_header=False,
    )
    server = uvicorn.Server(config)
    print(
        f"dialog-worker: console on http://{settings.console_host}:{settings.console_port}/ "
        f"(stream {settings.stream})",
        file=sys.stderr,
        flush=True,
    )
    await server.serve()
