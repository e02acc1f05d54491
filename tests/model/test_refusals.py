"""Refusals at intake that the model check (test_model.py) found wrong, pinned down one by one
on a real redis-server: the contract's 32 extra fields are counted as extra fields, and an
entry that names one valid session gets its dead_lettered event whatever else is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis_server import RedisServer

from dialog_worker.config import Settings
from dialog_worker.store.codec import MAX_EXTRA_FIELDS
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import source

pytestmark = pytest.mark.integration

KEYS = Keys.from_settings(Settings())


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.xgroup_create(KEYS.stream, KEYS.group, id="0", mkstream=True)
    yield client
    client.close()


def intake(r: redis.Redis) -> list[Any]:
    k = KEYS
    script = r.register_script(source("intake"))
    return script(  # type: ignore[no-any-return]
        keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
        args=[k.group, "c1", 100, "t1", 5000, 3600, 65536, MAX_EXTRA_FIELDS, 0, "test", 0, "x"],
    )


def xadd(r: redis.Redis, *pairs: str) -> str:
    return str(r.execute_command("XADD", KEYS.stream, "*", *pairs).decode())


def events(r: redis.Redis) -> list[dict[bytes, bytes]]:
    return [f for _, f in r.xrange(KEYS.replies)]


def extra(n: int) -> list[str]:
    return [x for i in range(n) for x in (f"f{i}", "v")]


def test_33_extra_fields_are_refused_without_a_msg_id_too(r: redis.Redis) -> None:
    # The limit is on extra fields; a missing msg_id does not leave room for one more.
    refused = xadd(r, "session_id", "s", "text", "hi", *extra(MAX_EXTRA_FIELDS + 1))
    accepted = xadd(r, "session_id", "t", "text", "hi", *extra(MAX_EXTRA_FIELDS))
    _, read, jobs, _, counts = intake(r)
    assert (read, [j[3].decode() for j in jobs]) == (2, [accepted])
    assert [int(c) for c in counts] == [0, 1, 0, 0, 0, 0, 0]
    [letter] = [f for _, f in r.xrange(KEYS.dlq)]
    assert letter[b"source_entry_id"].decode() == refused
    assert b"too many fields: 33" in letter[b"error"]


@pytest.mark.parametrize(
    ("pairs", "error"),
    [
        (["session_id", "s", "text", "hi", *extra(MAX_EXTRA_FIELDS + 1)], b"too many fields"),
        (["session_id", "s", "text", "a", "text", "b"], b"field text appears more than once"),
        (["session_id", "s", "text", "a", "msg_id", "m", "msg_id", "n"], b"field msg_id"),
        (["session_id", "s", "text", "x" * 70_000, *extra(40)], b"too many fields"),
    ],
)
def test_a_refused_entry_naming_one_valid_session_gets_its_dead_lettered_event(
    r: redis.Redis, pairs: list[str], error: bytes
) -> None:
    entry = xadd(r, *pairs)
    intake(r)
    [letter] = [f for _, f in r.xrange(KEYS.dlq)]
    assert error in letter[b"error"] and letter[b"error_kind"] == b"malformed"
    [event] = events(r)
    assert (event[b"session_id"], event[b"outcome"], event[b"seq"]) == (
        b"s",
        b"dead_lettered",
        b"0",
    )
    assert event[b"entry_id"].decode() == entry


def test_an_entry_naming_two_sessions_names_none(r: redis.Redis) -> None:
    xadd(r, "session_id", "s", "session_id", "t", "text", "hi")
    intake(r)
    [letter] = [f for _, f in r.xrange(KEYS.dlq)]
    assert b"session_id appears more than once" in letter[b"error"]
    assert events(r) == []
