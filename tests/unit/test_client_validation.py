"""DialogClient refuses bad ids and texts before it touches Redis.

The client points at a port where nothing listens: an input that got past validation would
raise a redis ConnectionError, so a ValidationError proves no connection was attempted. One
test swaps in fakeredis to show nothing is written either. No Lua runs here.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.exceptions
from fakeredis.aioredis import FakeRedis

from dialog_worker.client import dialog_client as client_module
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.errors import ConfigError, ValidationError

DEAD_URL = "redis://127.0.0.1:1/0"
# The limit is on the whole entry: field names and values. Sending ("s1", "m1", text) costs
# 24 bytes besides the text.
TEXT_MAX = 16
MAX = TEXT_MAX + len("session_ids1textmsg_idm1")


@pytest.fixture(autouse=True)
def clean_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads os.environ and config/worker.toml: start from neither."""
    for name in list(os.environ):
        if name.startswith("DIALOG_") or name == "REDIS_URL":
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


@pytest_asyncio.fixture
async def dead_client() -> AsyncIterator[DialogClient]:
    async with DialogClient(DEAD_URL, max_message_bytes=MAX) as c:
        yield c


BAD_SESSION_IDS = [
    pytest.param("", id="empty"),
    pytest.param("x" * 257, id="257-bytes"),
    pytest.param("é" * 129, id="258-bytes-in-129-chars"),
    pytest.param("a\nb", id="newline"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("a\x1bb", id="escape"),
    pytest.param("a\x7fb", id="del"),
    pytest.param("\ud800", id="lone-surrogate"),
    pytest.param(None, id="none"),
    pytest.param(123, id="int"),
    pytest.param(b"s1", id="bytes"),
]

BAD_MSG_IDS = [
    pytest.param("", id="empty"),
    pytest.param("m" * 257, id="257-bytes"),
    pytest.param("m\r", id="carriage-return"),
    pytest.param("m\x00", id="nul"),
    pytest.param("\udfff", id="lone-surrogate"),
    pytest.param(42, id="int"),
]

BAD_TEXTS = [
    pytest.param("", id="empty"),
    pytest.param("   \n\t", id="whitespace-only"),
    pytest.param("x" * (TEXT_MAX + 1), id="one-byte-over"),
    pytest.param("ñ" * 9, id="18-bytes-in-9-chars"),
    pytest.param("bad \ud800 surrogate", id="lone-surrogate"),
    pytest.param(None, id="none"),
    pytest.param(b"hello", id="bytes"),
]


# ---------------------------------------------------------------------------------------------
# The harness: a valid call does try to connect


async def test_valid_send_does_reach_for_redis(dead_client: DialogClient) -> None:
    with pytest.raises(redis.exceptions.ConnectionError):
        await dead_client.send("s1", "hello", msg_id="m1")


async def test_valid_state_does_reach_for_redis(dead_client: DialogClient) -> None:
    with pytest.raises(redis.exceptions.ConnectionError):
        await dead_client.state("s1")


# ---------------------------------------------------------------------------------------------
# Refused before any connection


@pytest.mark.parametrize("session_id", BAD_SESSION_IDS)
async def test_send_refuses_bad_session_id_before_connecting(
    dead_client: DialogClient, session_id: Any
) -> None:
    with pytest.raises(ValidationError, match="session_id"):
        await dead_client.send(session_id, "hello", msg_id="m1")


@pytest.mark.parametrize("session_id", BAD_SESSION_IDS)
async def test_state_refuses_bad_session_id_before_connecting(
    dead_client: DialogClient, session_id: Any
) -> None:
    with pytest.raises(ValidationError, match="session_id"):
        await dead_client.state(session_id)


@pytest.mark.parametrize("msg_id", BAD_MSG_IDS)
async def test_send_refuses_bad_msg_id_before_connecting(
    dead_client: DialogClient, msg_id: Any
) -> None:
    with pytest.raises(ValidationError, match="msg_id"):
        await dead_client.send("s1", "hello", msg_id=msg_id)


@pytest.mark.parametrize("text", BAD_TEXTS)
async def test_send_refuses_bad_text_before_connecting(
    dead_client: DialogClient, text: Any
) -> None:
    with pytest.raises(ValidationError, match="text"):
        await dead_client.send("s1", text, msg_id="m1")


async def test_validation_error_is_a_value_error(dead_client: DialogClient) -> None:
    with pytest.raises(ValueError):
        await dead_client.send("", "hello")


# ---------------------------------------------------------------------------------------------
# Limits are inclusive and counted in UTF-8 bytes: these pass validation (and then hit the port)


@pytest.mark.parametrize(
    ("session_id", "msg_id", "text"),
    [
        pytest.param("x" * 256, "m1", "hello", id="256-byte-session-id"),
        pytest.param("é" * 128, "m1", "hello", id="256-byte-unicode-session-id"),
        pytest.param("s1", "m" * 256, "hello", id="256-byte-msg-id"),
        pytest.param("s1", "m1", "x" * TEXT_MAX, id="text-of-exactly-max-bytes"),
        pytest.param("s1", "m1", "ñ" * (TEXT_MAX // 2), id="unicode-text-of-exactly-max-bytes"),
        pytest.param("a}b{", "{m}", "hello", id="braces"),
        pytest.param("sesi-ñ-日本", "m1", "nama saya Budi", id="unicode"),
        pytest.param("s1", None, "hello", id="generated-msg-id"),
    ],
)
async def test_inputs_at_the_limits_pass_validation(
    session_id: str, msg_id: str | None, text: str
) -> None:
    # The entry limit is the exact size of a ("s1", "m1", text) entry, or roomy for long ids
    # (a generated msg_id is 32 characters, and part of the entry).
    ids_at_limit = msg_id is None or len(session_id) + len(msg_id) > 4
    limit = 4096 if ids_at_limit else MAX
    async with DialogClient(DEAD_URL, max_message_bytes=limit) as c:
        with pytest.raises(redis.exceptions.ConnectionError):
            await c.send(session_id, text, msg_id=msg_id)


# ---------------------------------------------------------------------------------------------
# Nothing written: the same refusals against an in-memory Redis


async def test_refused_sends_write_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRedis(decode_responses=True)
    monkeypatch.setattr(client_module, "connect", lambda settings, max_connections: fake)
    async with DialogClient(DEAD_URL, max_message_bytes=MAX) as c:
        assert c.redis is fake
        calls: list[tuple[Any, Any, Any]] = [
            *((p.values[0], "hello", "m1") for p in BAD_SESSION_IDS),
            *(("s1", "hello", p.values[0]) for p in BAD_MSG_IDS),
            *(("s1", p.values[0], "m1") for p in BAD_TEXTS),
        ]
        for session_id, text, msg_id in calls:
            with pytest.raises(ValidationError):
                await c.send(session_id, text, msg_id=msg_id)
        assert await fake.dbsize() == 0
        assert await fake.keys("*") == []


# ---------------------------------------------------------------------------------------------
# Settings: environment at construction, keyword arguments override


async def test_client_reads_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIALOG_STREAM", "other-inbox")
    monkeypatch.setenv("DIALOG_MAX_MESSAGE_BYTES", "5")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:2/0")
    async with DialogClient() as c:
        assert c.keys.stream == "other-inbox"
        assert c.settings.max_message_bytes == 5
        assert c.settings.redis_url == "redis://127.0.0.1:2/0"
        with pytest.raises(ValidationError, match="text"):
            await c.send("s1", "123456", msg_id="m1")


async def test_keyword_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIALOG_MAX_MESSAGE_BYTES", "5")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:2/0")
    async with DialogClient(DEAD_URL, max_message_bytes=MAX, stream="kw-inbox") as c:
        assert c.settings.redis_url == DEAD_URL
        assert c.settings.max_message_bytes == MAX
        assert c.keys.stream == "kw-inbox"


async def test_url_defaults_to_the_contract_default() -> None:
    async with DialogClient() as c:
        assert c.settings.redis_url == "redis://localhost:6379/0"


def test_invalid_keyword_override_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="max-message-bytes"):
        DialogClient(DEAD_URL, max_message_bytes=0)
    with pytest.raises(ConfigError, match="redis-url"):
        DialogClient("http://user:s3cret@h")


async def test_keyword_override_applies_on_top_of_given_settings() -> None:
    settings = load_settings(environ={})
    async with DialogClient(DEAD_URL, settings=settings, max_message_bytes=MAX) as c:
        assert c.settings.redis_url == DEAD_URL
        assert c.settings.max_message_bytes == MAX
        with pytest.raises(ValidationError, match="text"):
            await c.send("s1", "x" * (MAX + 1), msg_id="m1")


def test_invalid_keyword_override_on_given_settings_raises_config_error() -> None:
    settings = load_settings(environ={})
    with pytest.raises(ConfigError):
        DialogClient(DEAD_URL, settings=settings, max_message_bytes=0)


# ---------------------------------------------------------------------------------------------
# Extra fields: 32 meta fields pass (a multitask field is not one of them), 33 are refused


@pytest.mark.parametrize("multitask", [None, "reject"])
async def test_32_meta_fields_pass_and_33_are_refused(multitask: str | None) -> None:
    from dialog_worker.store.codec import MAX_EXTRA_FIELDS

    assert MAX_EXTRA_FIELDS == 32
    async with DialogClient(DEAD_URL) as c:
        at_limit = {f"f{i}": "v" for i in range(MAX_EXTRA_FIELDS)}
        with pytest.raises(redis.exceptions.ConnectionError):
            await c.send("s1", "hello", msg_id="m1", meta=at_limit, multitask=multitask)
        over = {**at_limit, "one_more": "v"}
        with pytest.raises(ValidationError, match="at most 32 meta fields"):
            await c.send("s1", "hello", msg_id="m1", meta=over, multitask=multitask)


# ---------------------------------------------------------------------------------------------
# Tenant and priority: the fields intake reads, refused here where intake would ignore them


async def test_tenant_and_priority_are_sent_as_the_fields_intake_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeRedis(decode_responses=True)
    monkeypatch.setattr(client_module, "connect", lambda settings, max_connections: fake)
    async with DialogClient(DEAD_URL) as c:
        await c.send("s1", "hello", msg_id="m1", tenant="acme", priority=9)
        await c.send("s1", "hello", msg_id="m2", tenant="é" * 32, priority=0)  # 64 bytes
        await c.send("s1", "hello", msg_id="m3")
        sent = [fields for _, fields in await fake.xrange(c.keys.stream)]
    assert [(f.get("tenant"), f.get("priority")) for f in sent] == [
        ("acme", "9"),
        ("é" * 32, "0"),
        (None, None),
    ]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"tenant": ""}, "tenant"),
        ({"tenant": "a b"}, "tenant"),
        ({"tenant": "a\x00"}, "tenant"),
        ({"tenant": "x" * 65}, "tenant"),
        ({"tenant": "é" * 33}, "tenant"),  # 66 bytes
        ({"tenant": 7}, "tenant"),
        ({"priority": 10}, "priority"),
        ({"priority": -1}, "priority"),
        ({"priority": True}, "priority"),
        ({"priority": "5"}, "priority"),
        ({"priority": 5.0}, "priority"),
        ({"tenant": "acme", "meta": {"tenant": "other"}}, "twice"),
    ],
)
async def test_a_tenant_or_priority_intake_would_ignore_is_refused_before_sending(
    dead_client: DialogClient, given: dict[str, Any], says: str
) -> None:
    calls = [dead_client.send] + ([dead_client.ask] if "meta" not in given else [])
    for call in calls:
        with pytest.raises(ValidationError, match=says):
            await call("s1", "hello", msg_id="m1", **given)
    with pytest.raises(ValidationError, match=says):
        [e async for e in dead_client.ask_stream("s1", "hello", msg_id="m1", **given)]
