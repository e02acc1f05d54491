"""The journal and interrupt scripts on a real redis-server, called as the worker and the
client call them: lua/journal-1.lua (a result recorded only by the lease holder of the
session's next message, bounded), lua/interrupt-3.lua (park the session, fenced),
lua/resolve-2.lua (a resume applied once), and what resume-3, fire-3 and commit-5 do with a
parked session."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from redis.asyncio import Redis

import dialog_worker
from dialog_worker.config import Settings
from dialog_worker.daemon.step_journal import AttemptJournal
from dialog_worker.engine import journal as step_journal
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, Scripts

pytestmark = pytest.mark.integration

TTL_MS = 60_000
K = Keys.from_settings(Settings())
JOURNAL_TTL_S = 3600  # the journal expiry the harness passes (the worker: DIALOG_STATE_TTL_S)
TWO_DAYS_MS = 2 * 86_400_000


class H:
    def __init__(self, r: Redis) -> None:
        self.r = r
        self.s = Scripts.register(r)
        self.calls = 0

    async def intake(self) -> list[Any]:
        self.calls += 1
        return await self.s.intake(
            keys=[K.stream, K.ready, K.session_prefix, K.dlq, K.replies],
            args=[
                K.group, "c1", 100, f"t{self.calls}", TTL_MS, 3600, 65536, 32, 0, "test", 0,
                "maaf",
            ],
        )  # fmt: skip

    async def resume(self) -> list[Any]:
        self.calls += 1
        rows, _ = await self.s.resume(
            keys=[K.stream, K.ready, K.session_prefix], args=[100, f"r{self.calls}", TTL_MS, 0]
        )
        return list(rows)

    async def journal(
        self, token: bytes | str, seq: int, name: str, value: str, max_bytes: int = 1000
    ) -> list[Any]:
        return await self.s.journal(
            keys=[K.session_prefix], args=[token, "s", seq, "m1", name, value, max_bytes, 3600]
        )

    async def interrupt(self, token: bytes | str, seq: int = 1, timeout_ms: int = 0) -> list[Any]:
        return await self.s.interrupt(
            keys=[K.ready, K.session_prefix, K.replies],
            args=[
                token, "s", seq, "m1", "1-1", "m1:1:1", 1, '{"q":"ok?"}', timeout_ms, 0, "",
                3600, '{"interrupt_id":"m1:1:1","payload":{"q":"ok?"}}', 1, 2, 100, 600,
            ],
        )  # fmt: skip

    async def resolve(self, iid: str, value: str = "true") -> list[Any]:
        got = await self.s.resolve(
            keys=[K.ready, K.session_prefix], args=["resume", "s", iid, value]
        )
        return [v.decode() if isinstance(v, bytes) else v for v in got]

    async def commit(self, job: list[Any], version: int = 0) -> list[Any]:
        token, seq = job[1], int(job[2])
        args = [TTL_MS, 3600, 0, 1, token, "s", seq, version, json.dumps({"seq": seq}), "m1"]
        args += ["reply", "applied", job[3], "", "", "", "", "", ""]  # no usage, not merged
        return await self.s.commit(
            keys=[K.stream, K.ready, K.session_prefix, K.replies, K.dlq], args=args
        )

    @property
    def journal_key(self) -> str:
        return K.session("s").journal("m1")


@pytest_asyncio.fixture
async def h(redis_server: Any) -> AsyncIterator[H]:
    r = Redis.from_url(redis_server.url)
    await r.flushall()
    await r.xgroup_create(K.stream, K.group, id="0", mkstream=True)
    yield H(r)
    await r.aclose()


async def first_job(h: H) -> list[Any]:
    await h.r.xadd(K.stream, {"session_id": "s", "text": "hi", "msg_id": "m1"})
    _, _, jobs, _, _ = await h.intake()
    [job] = jobs
    return list(job)


async def test_only_the_lease_holder_of_the_next_message_records_a_result(h: H) -> None:
    job = await first_job(h)
    token = job[1]
    assert await h.journal(token, 1, "tool:1", '{"a":1}') == [Code.JOURNALED, 13]
    # The same name again: the first result stays and is answered.
    assert await h.journal(token, 1, "tool:1", '{"a":2}') == [Code.JOURNAL_HAD, b'{"a":1}']
    # Another token (the lease went to someone else), or another seq: nothing is written.
    assert await h.journal("stale", 1, "tool:2", "2") == [Code.FENCED_TOKEN]
    assert await h.journal(token, 2, "tool:2", "2") == [Code.FENCED_VERSION]
    await h.r.delete(K.session("s").lock)  # the lease ran out: the holder is stale now
    await h.r.zadd(K.ready, {"s": 0})
    [again] = await h.resume()
    assert await h.journal(token, 1, "tool:2", "2") == [Code.FENCED_TOKEN]
    assert await h.journal(again[2], 1, "tool:2", "2") == [Code.JOURNALED, 20]
    assert await h.r.hgetall(h.journal_key) == {
        b"o:tool:1": b'{"a":1}',
        b"o:tool:2": b"2",
        b"b": b"20",
    }
    assert 0 < await h.r.ttl(h.journal_key) <= 3600


@pytest.mark.parametrize("timeout_ms", [0, TWO_DAYS_MS])
async def test_a_journal_expires_its_expiry_in_seconds_after_a_result_and_outlasts_a_wait(
    h: H, timeout_ms: int
) -> None:
    """A result sets the journal's expiry (seconds); a wait for a person then keeps it as long
    as the wait: with no expiry when the wait has no timeout, until a journal expiry after
    the timeout when it has one (here two days, longer than the expiry itself)."""
    job = await first_job(h)
    assert (await h.journal(job[1], 1, "quote", "1"))[0] == Code.JOURNALED
    assert JOURNAL_TTL_S - 60 <= await h.r.ttl(h.journal_key) <= JOURNAL_TTL_S
    assert (await h.interrupt(job[1], timeout_ms=timeout_ms))[0] == Code.PARKED
    ttl = await h.r.ttl(h.journal_key)
    if timeout_ms == 0:
        assert ttl == -1
    else:
        kept_s = JOURNAL_TTL_S + timeout_ms // 1000
        assert kept_s - 60 <= ttl <= kept_s


@dataclasses.dataclass
class AttemptJob:
    """What an attempt's journal needs of its message (the pipeline's Job)."""

    token: str
    seq: int
    keys: Keys = K
    session_id: str = "s"
    msg_id: str = "m1"

    @property
    def first_seq(self) -> int:
        return self.seq


async def test_two_once_calls_of_one_name_racing_in_a_step_both_return_the_first_result(
    h: H,
) -> None:
    """Both find nothing journaled and call their function; the one recorded second is told
    of the first result and returns it, as every later attempt will."""
    job = await first_job(h)
    attempt = AttemptJournal(h.r, h.s.journal, AttemptJob(job[1].decode(), 1), 1000, 3600)

    async def pick(n: int) -> dict[str, int]:
        await asyncio.sleep(0.02 * n)  # both have looked in the journal by now
        return {"n": n}

    bound = step_journal.bind(attempt)
    try:
        got = await asyncio.gather(
            dialog_worker.once("pick", pick, 1), dialog_worker.once("pick", pick, 2)
        )
    finally:
        step_journal.unbind(bound)
    assert got == [{"n": 1}, {"n": 1}]
    assert await h.r.hget(h.journal_key, "o:pick") == b'{"n":1}'


async def test_a_commit_deletes_the_journal_and_a_late_write_of_its_attempt_is_refused(
    h: H,
) -> None:
    job = await first_job(h)
    await h.journal(job[1], 1, "tool:1", "1")
    assert (await h.commit(job))[0][0] == Code.COMMITTED
    assert await h.r.exists(h.journal_key) == 0
    # The lock is released; a write of the finished attempt comes too late.
    assert await h.journal(job[1], 1, "tool:2", "2") == [Code.FENCED_TOKEN]
    assert await h.r.exists(h.journal_key) == 0


async def test_a_result_past_the_limit_is_refused_and_nothing_is_written(h: H) -> None:
    job = await first_job(h)
    assert await h.journal(job[1], 1, "a", "x" * 90, max_bytes=100) == [Code.JOURNALED, 91]
    assert await h.journal(job[1], 1, "b", "y" * 9, max_bytes=100) == [Code.JOURNAL_FULL, 91]
    assert sorted(await h.r.hkeys(h.journal_key)) == [b"b", b"o:a"]
    assert await h.journal(job[1], 1, "b", "y" * 8, max_bytes=100) == [Code.JOURNALED, 100]


async def test_an_interrupt_parks_the_session_and_a_resume_is_applied_once(h: H) -> None:
    job = await first_job(h)
    assert await h.interrupt("stale") == [Code.FENCED_TOKEN]
    assert await h.r.hget(K.session("s").state, "w") is None
    assert (await h.interrupt(job[1]))[0] == Code.PARKED
    [(_, event)] = await h.r.xrange(K.replies)
    assert (event[b"outcome"], event[b"interrupt_id"], event[b"payload"]) == (
        b"awaiting",
        b"m1:1:1",
        b'{"q":"ok?"}',
    )
    assert await h.r.exists(K.session("s").lock) == 0  # released
    # Readers of the answer get the prompt in the same step, at the attempt's next place.
    [(entry_id, prompt)] = await h.r.xrange(K.session("s").partial("m1"))
    assert entry_id == b"2-2" and prompt == {
        b"a": b"1", b"p": b"2", b"s": b"1", b"k": b"v", b"n": b"awaiting",
        b"t": b'{"interrupt_id":"m1:1:1","payload":{"q":"ok?"}}',
    }  # fmt: skip
    assert await h.r.zscore(K.ready, "s") is None and await h.r.zscore(K.ages, "s") is None
    assert await h.r.ttl(h.journal_key) == -1  # no timeout: the journal waits as long
    # Looked at (a message of the session arrived, a release...): it stays parked.
    await h.r.zadd(K.ready, {"s": 0})
    assert await h.resume() == []
    assert await h.r.zscore(K.ready, "s") is None
    assert await h.resolve("m1:1:2") == ["unknown"]
    assert await h.resolve("m1:1:1", '{"ok":1}') == ["resumed"]
    assert await h.resolve("m1:1:1", "false") == ["ended", '{"value":{"ok":1}}']  # once
    assert await h.r.hget(K.session("s").interrupts, "m1:1:1") == b'{"value":{"ok":1}}'
    assert await h.r.exists(K.session("s").awaiting) == 0
    assert await h.r.zscore(K.ages, "s") is not None
    [again] = await h.resume()
    assert (int(again[3]), int(again[8])) == (1, 2)  # the same message, its next attempt
    assert (await h.commit(again[1:]))[0][0] == Code.COMMITTED
    assert await h.r.exists(h.journal_key) == 0
    assert await h.r.hget(K.session("s").state, "w") is None


async def test_an_interrupts_timeout_is_fired_and_recorded_for_the_run_after_it(h: H) -> None:
    job = await first_job(h)
    code, timeout_at = await h.interrupt(job[1], timeout_ms=1)
    assert code == Code.PARKED and timeout_at > 0
    assert await h.r.zscore(K.timers, "s\n\x01await") == timeout_at
    await asyncio.sleep(0.01)  # past the timeout on the server's clock
    fired, _ = await h.s.fire(keys=[K.stream, K.ready, K.session_prefix], args=[100])
    assert int(fired) == 0  # nothing appended to the stream: the session is due instead
    assert await h.r.zscore(K.ready, "s") is not None
    assert await h.r.xlen(K.stream) == 0
    [again] = await h.resume()
    assert int(again[3]) == 1
    assert await h.r.hget(K.session("s").interrupts, "m1:1:1") == b'{"timeout":true}'
    assert await h.r.zscore(K.timers, "s\n\x01await") is None
    assert await h.resolve("m1:1:1") == ["ended", '{"timeout":true}']


async def test_an_interrupt_refuses_before_writing_when_a_shared_key_has_the_wrong_type(
    h: H,
) -> None:
    job = await first_job(h)
    await h.r.delete(K.replies)
    await h.r.set(K.replies, "not a stream")
    with pytest.raises(Exception, match="WRONGTYPE"):
        await h.interrupt(job[1])
    assert await h.r.hget(K.session("s").state, "w") is None
    assert await h.r.exists(K.session("s").lock) == 1


@pytest.mark.parametrize("action", ["reset", "delete"])
async def test_reset_and_delete_remove_the_journal_of_a_message_in_flight(
    h: H, action: str
) -> None:
    """Not parked: the journal is found through the session's msg_id index."""
    job = await first_job(h)
    assert (await h.journal(job[1], 1, "a", "1"))[0] == Code.JOURNALED
    await h.s.erase(keys=[K.ready, K.session_prefix], args=[action, "s", "{}", 3600])
    assert await h.r.exists(h.journal_key) == 0
    # Reset keeps the message: it runs again, with nothing journaled.
    assert (action == "reset") == (await h.r.hget(K.session("s").state, "q1") is not None)
