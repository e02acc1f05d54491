"""The worker's connections pack commands with hiredis: the same bytes and errors as redis-py's
own packer, for every kind of connection connect() makes."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from dialog_worker.config import Settings
from dialog_worker.store.connection import (
    DRIVER_INFO,
    HiredisPacking,
    PackedConnection,
    PackedSentinelConnection,
    PackedSSLConnection,
    PackedUnixConnection,
    connect,
)

ARGUMENTS: list[tuple[Any, ...]] = [
    ("EVALSHA", "a" * 40, 2, "k1", b"k2", -7, 1.5, 0.1, 1e20, 2**70, "é ü", "", b""),
    ("XINFO STREAM", "in"),  # a command name of two words goes out as two arguments
    (b"CONFIG GET", b"maxmemory-policy"),
    ("SET", memoryview(b"key"), bytearray(b"value")),
    ("SET", "big", "x" * 100_000),  # above redis-py's buffer cut-off
    ("EVALSHA", "f" * 40, 0, *(str(i) * 5 for i in range(7000))),
]


@pytest.mark.parametrize("args", ARGUMENTS, ids=range(len(ARGUMENTS)))
def test_hiredis_packing_writes_the_bytes_redis_py_writes(args: tuple[Any, ...]) -> None:
    packed = PackedConnection().pack_command(*args)
    assert len(packed) == 1
    assert packed[0] == b"".join(bytes(chunk) for chunk in Connection().pack_command(*args))


@pytest.mark.parametrize("bad", [None, True, object()])
def test_hiredis_packing_refuses_what_redis_py_refuses(bad: object) -> None:
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", bad)  # type: ignore[arg-type]
    with pytest.raises(DataError):
        PackedConnection().pack_command("SET", "k", bad)


def test_another_encoding_packs_with_redis_py() -> None:
    conn = PackedConnection(encoding="latin-1")
    assert conn.pack_command("SET", "k", "é") == Connection(encoding="latin-1").pack_command(
        "SET", "k", "é"
    )


@pytest.mark.parametrize(
    ("url", "cls"),
    [
        ("redis://h:6379/0", PackedConnection),
        ("rediss://h:6380/0", PackedSSLConnection),
        ("unix:///tmp/redis.sock", PackedUnixConnection),
        ("redis+sentinel://s1:26379/mymaster", PackedSentinelConnection),
    ],
)
@pytest.mark.parametrize("bounded", [True, False])
def test_connect_packs_with_hiredis_for_every_scheme(
    url: str, cls: type[HiredisPacking], bounded: bool
) -> None:
    redis = connect(Settings(redis_url=url), max_connections=4, bounded_callers=bounded)
    assert redis.connection_pool.connection_class is cls
    kwargs = redis.connection_pool.connection_kwargs
    if url.startswith("rediss://"):
        assert kwargs["ssl_cert_reqs"] == "required"
        assert kwargs["ssl_check_hostname"] is True
    if url.startswith("redis://"):
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("h", 6379, 0)


@pytest.mark.parametrize(
    "url",
    ["redis://h:6379/0", "rediss://h:6379/0", "unix:///tmp/r.sock", "redis+sentinel://s1:26379/m"],
)
def test_new_connections_do_not_look_up_the_library_version(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py reads its version from the installed package's metadata (about 2 ms) for every
    connection unless it is given one DriverInfo: a pool that grows under load paid that per
    connection. The server still learns the version (CLIENT SETINFO)."""
    import redis.utils

    looked_up: list[str] = []
    real = redis.utils.get_lib_version
    monkeypatch.setattr(redis.utils, "get_lib_version", lambda: looked_up.append("v") or real())
    pool = connect(Settings(redis_url=url), max_connections=4).connection_pool
    made = [pool.make_connection() for _ in range(3)]
    assert looked_up == []
    assert all(c.driver_info is DRIVER_INFO for c in made)
    assert DRIVER_INFO.lib_version == real()


def test_cluster_nodes_share_the_driver_info() -> None:
    cluster = connect(Settings(redis_url="redis://h:7000/0", redis_mode="cluster"), 4)
    assert cluster.nodes_manager.connection_kwargs["driver_info"] is DRIVER_INFO  # type: ignore[attr-defined]
