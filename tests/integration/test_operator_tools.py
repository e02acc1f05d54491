"""Operator tools on producer bytes and on sharded dead letters.

- Bytes that are not UTF-8, in the inbound stream and in a dead letter: `stats`, `session`,
  `dlq list` and `dlq show` exit 0 and show them escaped; the metrics sampler's view of the
  queue reads them too.
- A dead letter whose field names repeat (a malformed entry keeps every field): `dlq show`
  lists every pair, redrive leaves it for a human, reshard moves it byte for byte.
- Dead-letter handles with 2 shards: each acts on exactly one letter; an entry id held by both
  shards' dead-letter streams is refused in one line (exit 2).
- `dlq redrive/purge --id` of a missing letter exit 1; `dlq purge --session` and
  `--older-than`.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import anyio
import pytest
import redis.asyncio
from redis_server import wait_until_async as poll
from worker_procs import run_cli

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import load_settings
from dialog_worker.store.keys import Topology
from dialog_worker.store.queue_view import queue_stats

pytestmark = pytest.mark.integration


cli = run_cli  # tests/support/worker_procs.py


async def acli(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: cli(env, *args, **extra))


async def xadd_raw(r: Any, stream: str, *pairs: bytes | str, entry_id: str = "*") -> str:
    """XADD with the pairs as given: repeated names and any bytes."""
    got = await r.execute_command("XADD", stream, entry_id, *pairs)
    return got.decode() if isinstance(got, bytes) else str(got)


LETTER = (
    b"error", b"text is not valid UTF-8", b"error_kind", b"malformed",
    b"source_stream", b"dialog", b"attempts", b"0",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# bytes that are not UTF-8


async def test_bytes_that_are_not_utf8_are_shown_escaped_by_stats_session_and_dlq(
    env: dict[str, str], client: DialogClient
):
    r = client.raw
    await xadd_raw(r, "dialog", b"session_id", b"s1", b"text", b"caf\xe9 \xff")
    letter = await xadd_raw(
        r, "dialog-dlq", b"session_id", b"s1", b"text", b"\xff\xfe", b"note\xff", b"x", *LETTER
    )
    stats = await acli(env, "stats")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["stream_length"] == 1
    # The sampler's view of the queue is the same code on the worker's decoding client.
    sampled = await queue_stats(client.redis, client.keys)
    assert sampled["stream_length"] == 1 and sampled["dlq_length"] == 1
    session = await acli(env, "session", "s1")
    assert session.returncode == 0, session.stderr
    assert [d["id"] for d in json.loads(session.stdout)["dead_letters"]] == [letter]
    listed = await acli(env, "dlq", "list")
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["id"] for line in listed.stdout.splitlines()] == [letter]
    shown = await acli(env, "dlq", "show", letter)
    assert shown.returncode == 0, shown.stderr
    fields = json.loads(shown.stdout)
    assert fields["text"] == "\\xff\\xfe"
    assert fields["note\\xff"] == "x"


async def test_session_shows_a_waiting_message_whose_bytes_are_not_utf8(
    env: dict[str, str], client: DialogClient, workers, tmp_path
):
    flag = tmp_path / "hold"
    flag.touch()
    workers.start(1, DIALOG_ENGINE="fault_engine:make", FAULT_FLAG_FILE=str(flag))
    await client.send("s1", "hold the session")
    sk = client.keys.session("s1")

    async def held() -> bool:
        return bool(await client.redis.get(sk.lock))

    await poll(held, 20, "the worker to hold s1")
    await xadd_raw(client.raw, "dialog", b"session_id", b"s1", b"text", b"\xff", b"msg_id", b"m2")

    async def sequenced() -> bool:
        return await client.redis.hget(sk.state, "s") == "2"

    await poll(sequenced, 20, "the second message to be sequenced")
    view = await acli(env, "session", "s1")
    assert view.returncode == 0, view.stderr
    shown = json.loads(view.stdout)
    assert shown["last_seq"] == 2
    # Both messages are read from the session's own keys, where intake moved them (the
    # running one stays there until its commit).
    assert [(w["seq"], w["present"]) for w in shown["waiting"]] == [(1, True), (2, True)]
    assert shown["waiting"][1]["msg_id"] == "m2"
    assert await client.raw.xlen("dialog") == 0
    flag.unlink()


async def test_stats_counts_unread_entries_a_producer_trimmed(
    env: dict[str, str], client: DialogClient, workers
):
    """What a producer's XTRIM (or XADD MAXLEN) removed before any worker read it is lost,
    and `stats` says how many."""
    workers.start(1)
    await client.ask("t0", "halo", timeout=30)  # intake has run: it knows the stream
    workers.stop_all()
    for _ in range(3):
        await xadd_raw(client.raw, "dialog", b"session_id", b"t1", b"text", b"lost")
    await client.raw.xtrim("dialog", maxlen=0)
    workers.start(1)
    await client.ask("t2", "halo", timeout=30)

    async def counted() -> bool:
        stats = await acli(env, "stats")
        return stats.returncode == 0 and json.loads(stats.stdout)["trimmed"] == 3

    await poll(counted, 20, "stats to count 3 trimmed entries")
    assert (await client.state("t1")) is None


# ---------------------------------------------------------------------------------------------
# repeated field names


async def test_a_dead_letter_with_repeated_field_names_is_shown_whole_and_not_redriven(
    env: dict[str, str], client: DialogClient
):
    pairs = (b"session_id", b"s1", b"text", b"one", b"text", b"two", *LETTER)
    letter = await xadd_raw(client.raw, "dialog-dlq", *pairs)
    shown = await acli(env, "dlq", "show", letter)
    assert shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    assert body["text"] == "one"
    assert body["all_fields"][:3] == [["session_id", "s1"], ["text", "one"], ["text", "two"]]
    redriven = await acli(env, "dlq", "redrive")
    assert json.loads(redriven.stdout) == {"redriven": 0, "skipped": 1}
    assert "more than once" in redriven.stderr
    assert await client.redis.xlen("dialog-dlq") == 1
    assert await client.redis.xlen("dialog") == 0


async def test_reshard_moves_a_dead_letter_byte_for_byte_with_repeated_names(
    env: dict[str, str],
):
    from dialog_worker.ops.reshard import reshard
    from dialog_worker.store.stream_entries import StreamReader

    old = load_settings(environ=env)
    new = old.replace(shards=2)
    r = redis.asyncio.Redis.from_url(old.redis_url)
    try:
        pairs = [b"session_id", b"s1", b"text", b"\xff\xfe", b"text", b"two", b"k", b"v", *LETTER]
        await xadd_raw(r, "dialog-dlq", *pairs)
        await reshard(r, old, new, force=True)
        target = Topology.from_settings(new).for_session("s1").dlq
        reader = StreamReader(redis.asyncio.Redis.from_url(old.redis_url))
        moved = await reader.range(target)
        assert [list(e.flat()) for e in moved] == [pairs]
        await reader.redis.aclose()
    finally:
        await r.aclose()


# ---------------------------------------------------------------------------------------------
# handles across shards

SAME_ID = "1700000000000-0"


@pytest.fixture
def sharded_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "DIALOG_SHARDS": "2"}


async def _two_letters_with_one_id(sharded_env: dict[str, str]) -> tuple[Topology, Any]:
    settings = load_settings(environ=sharded_env)
    topology = Topology.from_settings(settings)
    r = redis.asyncio.Redis.from_url(settings.redis_url)
    await r.set(f"{settings.prefix}:shards", "2")
    for keys in topology.shards:
        sid = next(f"u{i}" for i in range(100) if topology.for_session(f"u{i}") == keys)
        await xadd_raw(
            r,
            keys.dlq,
            *(b"session_id", sid.encode(), b"text", b"halo", b"error_kind", b"exhausted"),
            *(b"source_stream", keys.stream.encode()),
            entry_id=SAME_ID,
        )
    return topology, r


async def test_sharded_dead_letters_have_unique_handles_and_a_shared_id_is_refused(
    sharded_env: dict[str, str],
):
    topology, r = await _two_letters_with_one_id(sharded_env)
    try:
        listed = await acli(sharded_env, "dlq", "list")
        assert listed.returncode == 0, listed.stderr
        handles = [json.loads(line)["id"] for line in listed.stdout.splitlines()]
        assert sorted(handles) == [f"0:{SAME_ID}", f"1:{SAME_ID}"]
        for action in (("show", SAME_ID), ("purge", "--id", SAME_ID), ("redrive", "--id", SAME_ID)):
            refused = await acli(sharded_env, "dlq", *action)
            assert refused.returncode == 2, (action, refused.stdout, refused.stderr)
            assert refused.stdout == ""
            [line] = refused.stderr.strip().splitlines()
            assert f"0:{SAME_ID}" in line and f"1:{SAME_ID}" in line
        assert [await r.xlen(k.dlq) for k in topology.shards] == [1, 1]
        shown = await acli(sharded_env, "dlq", "show", f"1:{SAME_ID}")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["shard"] == 1
        purged = await acli(sharded_env, "dlq", "purge", "--id", f"0:{SAME_ID}")
        assert json.loads(purged.stdout) == {"purged": 1}
        assert [await r.xlen(k.dlq) for k in topology.shards] == [0, 1]
        # Now only one shard holds the bare id: it names exactly that letter.
        redriven = await acli(sharded_env, "dlq", "redrive", "--id", SAME_ID)
        assert redriven.returncode == 0, redriven.stderr
        assert json.loads(redriven.stdout) == {"redriven": 1, "skipped": 0}
        assert [await r.xlen(k.dlq) for k in topology.shards] == [0, 0]
        resent = await r.xrange(topology.shards[1].stream)
        assert [f[b"msg_id"] for _, f in resent] == [f"redrive:1:{SAME_ID}".encode()]
    finally:
        await r.aclose()


# ---------------------------------------------------------------------------------------------
# missing ids, purge by session and by age


async def test_redrive_and_purge_of_a_missing_id_exit_1(env: dict[str, str]):
    for action in ("redrive", "purge"):
        missing = await acli(env, "dlq", action, "--id", SAME_ID)
        assert missing.returncode == 1, (action, missing.stderr)
        assert missing.stderr.strip() == f"dialog-worker: no dead letter {SAME_ID}"
    shown = await acli(env, "dlq", "show", SAME_ID)
    assert shown.returncode == 1


async def test_purge_by_session_and_by_age_deletes_only_those(
    env: dict[str, str], client: DialogClient
):
    r = client.raw
    old_ms = int(time.time() * 1000) - 3 * 3600 * 1000
    old_a = await xadd_raw(r, "dialog-dlq", b"session_id", b"a", *LETTER, entry_id=f"{old_ms}-0")
    old_b = await xadd_raw(r, "dialog-dlq", b"session_id", b"b", *LETTER, entry_id=f"{old_ms}-1")
    new_a = await xadd_raw(r, "dialog-dlq", b"session_id", b"a", *LETTER)
    new_b = await xadd_raw(r, "dialog-dlq", b"session_id", b"b", *LETTER)

    async def left() -> list[str]:
        return [i.decode() for i, _ in await r.xrange("dialog-dlq")]

    bad = await acli(env, "dlq", "purge", "--older-than", "soon")
    assert bad.returncode == 2 and "duration" in bad.stderr
    by_age = await acli(env, "dlq", "purge", "--older-than", "2h")
    assert json.loads(by_age.stdout) == {"purged": 2}, by_age.stderr
    assert await left() == [new_a, new_b]
    by_session = await acli(env, "dlq", "purge", "--session", "a")
    assert json.loads(by_session.stdout) == {"purged": 1}, by_session.stderr
    assert await left() == [new_b]
    assert old_a and old_b  # both gone with the age purge


# ---------------------------------------------------------------------------------------------
# the sampler's cost


async def test_queue_stats_is_a_handful_of_commands_whatever_the_backlog(client: DialogClient):
    """XINFO GROUPS reports no lag once an entry at the group's position was deleted (the
    worker deletes finished entries); the count must then not come from a scan."""
    r, k = client.redis, client.keys
    async with r.pipeline(transaction=False) as pipe:
        for i in range(5000):
            pipe.xadd(k.stream, {"session_id": f"s{i}", "text": "halo"})
        await pipe.execute()
    await r.xgroup_create(k.stream, k.group, id="0")
    [(_, read)] = await r.xreadgroup(k.group, "c", {k.stream: ">"}, count=10)
    await r.xack(k.stream, k.group, *[i for i, _ in read])
    await r.xdel(k.stream, read[-1][0])
    [group] = await r.xinfo_groups(k.stream)
    assert group["lag"] is None  # the case that used to be counted by a scan
    await r.config_resetstat()
    stats = await queue_stats(r, k)
    calls = {name: v["calls"] for name, v in (await r.info("commandstats")).items()}
    # 9 entries read and left in the stream by hand (a worker would have moved them out);
    # no session has a sequenced message waiting.
    assert (stats["stream_length"], stats["lag"], stats["waiting"]) == (4999, 4990, 0)
    assert calls.get("cmdstat_xrange", 0) <= 1, calls
    assert sum(calls.values()) <= 12, calls


# ---------------------------------------------------------------------------------------------
# malformed entries are logged


async def test_malformed_entries_are_logged_once_then_at_most_every_ten_seconds(
    client: DialogClient, workers
):
    """A refused entry gets a log line (not only a counter and a dead letter); a flood of them
    gets one line, not one each."""
    [worker] = workers.start(1)
    await client.ask("ok", "halo", timeout=30)  # the worker is reading
    for i in range(20):
        await xadd_raw(client.raw, "dialog", b"session_id", f"bad{i}".encode())  # no text

    async def lettered() -> bool:
        return await client.raw.xlen("dialog-dlq") == 20

    await poll(lettered, 20, "20 dead letters")
    lines = [
        json.loads(line)
        for line in worker.log_text().splitlines()
        if '"malformed_dead_lettered"' in line
    ]
    assert lines and len(lines) <= 2, lines
    assert lines[0]["count"] >= 1 and lines[0]["dlq"] == "dialog-dlq"


# ---------------------------------------------------------------------------------------------
# lag never above what the stream holds


async def test_stats_and_the_lag_gauge_never_report_more_unread_than_the_stream_holds(
    env: dict[str, str], client: DialogClient
):
    """After an AOF replay Redis 7.0 can report a group lag above the stream's length (the
    replayed reads do not advance the group's read counter). Made here directly: ten entries
    appended, eight trimmed away, the group's read counter left at 0: Redis says lag 10 for a
    stream of 2. `stats` and the dialog_group_lag gauge say 2."""
    from dialog_worker.daemon.worker import Worker
    from dialog_worker.engine.loading import load_engine

    for i in range(10):
        await xadd_raw(client.raw, "dialog", b"session_id", f"lag{i}".encode(), b"text", b"hi")
    await client.raw.xtrim("dialog", maxlen=2, approximate=False)
    await client.redis.execute_command(
        "XGROUP", "CREATE", "dialog", "dialog-workers", "0", "ENTRIESREAD", "0"
    )
    [group] = await client.redis.xinfo_groups("dialog")
    assert (group["lag"], await client.redis.xlen("dialog")) == (10, 2)  # Redis' own figure
    stats = await acli(env, "stats")
    assert stats.returncode == 0, stats.stderr
    shown = json.loads(stats.stdout)
    assert (shown["lag"], shown["stream_length"]) == (2, 2)
    worker = Worker(load_settings(environ=env), load_engine(None))
    try:
        await worker.sampler.sample_once()
        gauge = worker.metrics.registry.get_sample_value("dialog_group_lag", {"shard": "0"})
    finally:
        await worker.raw.aclose()
        await worker.redis.aclose()
    assert gauge == 2
