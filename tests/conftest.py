from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))

from redis_server import RedisServer  # noqa: E402
from worker_procs import WorkerPool  # noqa: E402

from dialog_worker.client.dialog_client import DialogClient  # noqa: E402
from dialog_worker.config import Settings, load_settings  # noqa: E402

# The README's first run, `pytest -m quick`: the unit tests, the Lua scripts against a real
# redis-server, and real workers answering the README's own commands (its quickstart, the
# embedded redis-server of `dialog-worker run`). A few minutes, where the whole suite takes
# twenty; CI runs the whole suite.
QUICK = (
    "tests/unit/",
    "tests/integration/test_scripts.py",
    "tests/integration/test_journal_scripts.py",
    "tests/integration/test_limit_scripts.py",
    "tests/integration/test_readme.py",
    "tests/integration/test_embedded.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One shared server for integration tests; each test starts from an empty database."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def worker_env(url: str, **extra: str) -> dict[str, str]:
    # OTEL_*: a developer's own tracing setup must not turn tracing on in the suite's workers.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIALOG_", "OTEL_"))}
    env.update(
        {
            "REDIS_URL": url,
            # The suite's helpers and the checkout (bench/), then whatever the suite was given:
            # the mutation check points PYTHONPATH at its copy of the package.
            "PYTHONPATH": os.pathsep.join(
                p
                for p in (str(SUPPORT), str(SUPPORT.parent.parent), os.environ.get("PYTHONPATH"))
                if p
            ),
            "DIALOG_LOG_LEVEL": "warning",
            "DIALOG_METRICS_PORT": "0",
            "DIALOG_SHUTDOWN_GRACE_S": "10",
        }
    )
    env.update(extra)
    return env


@pytest.fixture
def env(redis_server: RedisServer) -> dict[str, str]:
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    return worker_env(redis_server.url)


@pytest.fixture
def workers(env: dict[str, str], tmp_path: Path) -> Iterator[WorkerPool]:
    pool = WorkerPool(env, tmp_path)
    yield pool
    pool.stop_all()


@pytest_asyncio.fixture
async def client(env: dict[str, str]) -> AsyncIterator[DialogClient]:
    settings = load_settings(environ=env)
    async with DialogClient(settings=settings, max_connections=200) as c:
        yield c


# The console's tests (tests/console): its settings with one operator and one viewer, and the
# app served in-process over httpx against the suite's real redis-server.


@pytest.fixture
def console_settings(env: dict[str, str]) -> Settings:
    from console_support import console_env

    return load_settings(environ=console_env(env))


@pytest_asyncio.fixture
async def http(
    console_settings: Settings, client: DialogClient
) -> AsyncIterator[httpx.AsyncClient]:
    from dialog_worker.console.app import create_app

    app = create_app(console_settings, client)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console.test") as c:
        yield c
