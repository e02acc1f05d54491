"""One place that turns settings into a redis-py asyncio client."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from worker.config import Settings


def connect(settings: Settings, max_connections: int) -> Redis:
    """A client whose pool waits for a free connection instead of raising "Too many
    connections" when hundreds of coroutines call at once (redis-py #2517).

    Automatic retries are off: redis-py would re-send a script whose reply was lost, and a
    re-sent XADD is a second message. Every caller here decides itself what a failure means.
    """
    kwargs: dict[str, object] = {}
    if settings.redis_ca_path and settings.redis_url.startswith("rediss://"):
        kwargs["ssl_ca_certs"] = settings.redis_ca_path
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=max_connections,
        timeout=30,
        decode_responses=True,
        socket_timeout=5,
        socket_connect_timeout=5,
        retry=Retry(NoBackoff(), 0),
        **kwargs,
    )
    return Redis(connection_pool=pool)
