"""One place that turns settings into a redis-py asyncio client."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import hiredis
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, NodesManager, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.driver_info import DriverInfo

from dialog_worker.config import (
    SENTINEL_SCHEME,
    Settings,
    cluster_startup_nodes,
    parse_sentinel_url,
)
from dialog_worker.errors import ConfigError
from dialog_worker.store.keys import shards_key

# What every connection tells the server in CLIENT SETINFO, built once: redis-py otherwise looks
# its own version up in the installed package's metadata for each new connection (about 2 ms of
# CPU each, this machine: a client opening its pool of 64 spent 0.15 s on it).
DRIVER_INFO = DriverInfo()


def connect(
    settings: Settings,
    max_connections: int,
    bounded_callers: bool = False,
    decode_responses: bool = True,
) -> Redis:
    """A client for `max_connections` concurrent callers.

    ``decode_responses=False`` gives bytes, for reading streams whose values anyone may have
    written: the reader decodes each value itself instead of failing a whole batch on one
    invalid byte.

    By default its pool waits for a free connection instead of raising "Too many
    connections" when more coroutines than that call at once (redis-py #2517): what a client
    library facing arbitrary callers needs. The worker knows the exact bound of its callers
    (message slots plus its loops) and passes `bounded_callers=True` for the plain pool:
    the blocking pool's condition-variable hand-off cost about 15% of the worker's CPU per
    message (0.73-0.80 vs 0.64-0.65 ms, 10,000 messages, one worker, this machine).

    Automatic retries are off: redis-py would re-send a script whose reply was lost, and a
    re-sent XADD is a second message. Every caller here decides itself what a failure means.
    """
    kwargs: dict[str, object] = {}
    if settings.redis_url.startswith("rediss://"):
        # Verify the server certificate and its hostname, whatever the installed redis-py's
        # defaults are (before 6.0 it did not check the hostname). Without a CA path the
        # system trust store is used.
        kwargs["ssl_cert_reqs"] = "required"
        kwargs["ssl_check_hostname"] = True
        if settings.redis_ca_path:
            kwargs["ssl_ca_certs"] = settings.redis_ca_path
    if settings.redis_url.startswith(SENTINEL_SCHEME):
        if settings.redis_mode == "cluster":
            raise ConfigError("REDIS_URL", "redis+sentinel:// names Sentinels, not a Cluster")
        return _connect_sentinel(settings, max_connections, decode_responses)
    if settings.redis_mode == "cluster":
        return _connect_cluster(settings, max_connections, decode_responses, kwargs)
    options: dict[str, Any] = {
        "max_connections": max_connections,
        "decode_responses": decode_responses,
        "socket_timeout": 5,
        "socket_connect_timeout": 5,
        "retry": Retry(NoBackoff(), 0),
        "driver_info": DRIVER_INFO,
        **kwargs,
    }
    # What ConnectionPool.from_url does (the URL's options win), with the connection class
    # for the URL's scheme swapped for one that packs with hiredis.
    url_options = parse_url(settings.redis_url)
    url_options["connection_class"] = PACKED_CLASSES[
        url_options.get("connection_class", Connection)
    ]
    options.update(url_options)
    pool = (
        ConnectionPool(**options)
        if bounded_callers
        else BlockingConnectionPool(timeout=30, **options)
    )
    return Redis(connection_pool=pool)


class HiredisPacking(AbstractConnection):
    """Packs each command with hiredis' C packer into one bytes object. redis.asyncio packs in
    Python (its sync client already uses hiredis): about 8 ms against 0.9 ms for one group
    commit or streamed-answer call of 6,500 arguments, this machine. Same bytes on the wire
    and the same DataError for an argument redis-py refuses (None, bool). Strings are UTF-8,
    redis-py's default encoding; a connection configured with another packs with redis-py.
    The Cluster client keeps redis-py's packer: it takes no connection class."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        encoder = self.encoder
        self._pack_utf8 = encoder.encoding == "utf-8" and encoder.encoding_errors == "strict"

    def pack_command(self, *args: Any) -> list[bytes]:
        if not self._pack_utf8:
            return super().pack_command(*args)
        # A command name of several words ("XINFO STREAM") goes out as separate arguments.
        head = args[0]
        if isinstance(head, str):
            if " " in head:
                args = (*head.encode().split(), *args[1:])
        elif b" " in head:
            args = (*head.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            # A type hiredis refuses: redis-py's encoder decides (its DataError for None or
            # a bool), and a bytearray goes as bytes.
            # (hiredis' stub types its argument as a tuple of one item.)
            encoded: Any = tuple(_as_bytes(value) for value in map(self.encoder.encode, args))
            return [hiredis.pack_command(encoded)]


def _as_bytes(value: bytes | bytearray | memoryview) -> bytes | memoryview:
    return bytes(value) if isinstance(value, bytearray) else value


class PackedConnection(HiredisPacking, Connection):
    pass


class PackedSSLConnection(HiredisPacking, SSLConnection):
    pass


class PackedUnixConnection(HiredisPacking, UnixDomainSocketConnection):
    pass


class PackedSentinelConnection(HiredisPacking, SentinelManagedConnection):
    pass


# redis-py's class for each URL scheme -> the same class packing with hiredis.
PACKED_CLASSES: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: PackedConnection,
    SSLConnection: PackedSSLConnection,
    UnixDomainSocketConnection: PackedUnixConnection,
}


# Per node; connections are opened lazily, so this is a ceiling, not a cost. The cluster
# client raises instead of waiting when it is reached, so it sits well above any caller's
# concurrency.
CLUSTER_MAX_CONNECTIONS_PER_NODE = 1000
# Retries of one command on a Cluster (see _connect_cluster).
CLUSTER_RETRIES = 8


def _connect_cluster(
    settings: Settings, max_connections: int, decode_responses: bool, kwargs: dict[str, object]
) -> Redis:
    """redis-py's RedisCluster: it follows MOVED/ASK and, on connection errors, refreshes the
    slot map and retries, which is how a worker rides through a master failover. Those
    retries can re-send a script whose reply was lost; every script here is safe to run
    twice (send dedupes on msg_id; acquire is re-entrant for the same token; a second commit,
    retry, dead-letter or promote finds its work done and changes nothing). It offers the same
    command API for everything the worker uses, hence the cast."""
    first, nodes = cluster_startup_nodes(settings.redis_url)
    cluster = RedisCluster.from_url(
        first,
        # Every node REDIS_URL names (comma-separated): a client that starts, or has to learn
        # the slots again, while the first one is down asks the others.
        startup_nodes=[ClusterNode(host, port) for host, port in nodes[1:]],
        decode_responses=decode_responses,
        # Stated here, not left to redis-py's defaults (which changed between releases): a
        # command meeting a dead node or a slot without a master is retried up to
        # CLUSTER_RETRIES times, the slot map refreshed in between, with a jittered backoff
        # from 50 ms doubling to 1 s: about 5 s in all, enough to ride through a promotion
        # with cluster-node-timeout up to 2 s, then the error reaches the caller.
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), CLUSTER_RETRIES),
        max_connections=max(max_connections, CLUSTER_MAX_CONNECTIONS_PER_NODE),
        socket_timeout=5,
        socket_connect_timeout=5,
        driver_info=DRIVER_INFO,
        **kwargs,
    )
    _observe_refreshes(cluster)
    return cast(Redis, cluster)


# Called with the number of masters after each refresh of a Cluster client's slot map (the
# worker counts them in dialog_redis_topology_refreshes_total and logs them).
TOPOLOGY_LISTENERS: list[Callable[[int, int], None]] = []
_log = logging.getLogger("dialog_worker.redis")


class _ObservedNodesManager(NodesManager):
    """redis-py's NodesManager that says when it learnt the slot map (its instances have no
    __dict__, so the client's own manager is given this class: same slots, one method)."""

    __slots__ = ()

    async def initialize(self, *args: Any, **kwargs: Any) -> None:
        await super().initialize(*args, **kwargs)
        masters = len({nodes[0].name for nodes in self.slots_cache.values() if nodes})
        _log.info(
            "Redis Cluster topology refreshed: %d masters, %d nodes", masters, len(self.nodes_cache)
        )
        for listener in TOPOLOGY_LISTENERS:
            listener(masters, len(self.nodes_cache))


def _observe_refreshes(cluster: RedisCluster) -> None:
    """A log line (and the listeners) each time the client learns the slot map anew: at
    start, and after a failover or a MOVED answer made it ask again."""
    cluster.nodes_manager.__class__ = _ObservedNodesManager


def _connect_sentinel(settings: Settings, max_connections: int, decode_responses: bool) -> Redis:
    """redis-py's Sentinel support: every new connection asks the Sentinels where the master
    is, so after a failover the connections that broke are replaced by connections to the
    promoted replica. Its pool raises instead of waiting when `max_connections` are in use (no
    blocking variant), hence the margin for clients with unbounded callers."""
    url = parse_sentinel_url(settings.redis_url)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": 1,
        "socket_connect_timeout": 1,
        "driver_info": DRIVER_INFO,
    }
    if url.sentinel_password is not None:
        sentinel_kwargs["password"] = url.sentinel_password
        sentinel_kwargs["username"] = url.sentinel_username
    # Called through Any: redis-py before 8.2 leaves Sentinel's constructor untyped.
    manager = cast(Any, Sentinel)(url.sentinels, sentinel_kwargs=sentinel_kwargs)
    master: Redis = manager.master_for(
        url.master,
        redis_class=Redis,
        max_connections=max_connections * 4,
        decode_responses=decode_responses,
        db=url.db,
        username=url.username,
        password=url.password,
        socket_timeout=5,
        socket_connect_timeout=5,
        retry=Retry(NoBackoff(), 0),
        connection_class=PackedSentinelConnection,
        driver_info=DRIVER_INFO,
    )
    return master


async def prepare(redis: Redis) -> None:
    """Learn the cluster's slot map before the first burst of commands. redis-py's cluster
    client initialises lazily on the first command; with hundreds of coroutines issuing their
    first command at once, connections were torn down mid-handshake (AttributeError on a
    closed writer, redis-py 8.1, reproduced with 200 concurrent first calls). A no-op for a
    standalone client."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()


async def check_topology(redis: Redis, settings: Settings, record: bool) -> None:
    """The deployment's shard count lives in Redis (keys.shards_key). A worker records it when
    none is (`record`); any process configured otherwise refuses with one line, having written
    nothing (a mismatch would send sessions to the wrong streams)."""
    key = shards_key(settings)
    if record:
        await redis.set(key, settings.shards, nx=True)
    stored = await redis.get(key)
    if stored is None:
        return
    value = stored.decode() if isinstance(stored, bytes) else str(stored)
    if value.startswith("resharding"):  # dialog_worker.ops.reshard.in_progress_marker
        raise ConfigError(
            "DIALOG_SHARDS",
            f"a reshard is in progress (Redis key {key!r} says {value!r}); nothing may run "
            "until `dialog-worker reshard --to N --yes` has been run to its end",
        )
    if value != str(settings.shards):
        raise ConfigError(
            "DIALOG_SHARDS",
            f"this deployment has {value} shard(s) (recorded in Redis key {key!r}), "
            f"configured {settings.shards}; use `dialog-worker reshard --to N` to change it",
        )
