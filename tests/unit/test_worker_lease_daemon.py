"""The worker's side of its lease (dialog_worker/daemon/sessions.py): one lease call per shard
whatever the number of sessions held, tokens that carry its number, and every result held
under a number that lapsed given up at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import redis.exceptions

from dialog_worker.config import Settings
from dialog_worker.daemon.pipeline import HELD_LOCK_TTL_FACTOR, Job
from dialog_worker.daemon.sessions import Sessions, holder_of
from dialog_worker.metrics import Metrics
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.anyio


class FakeScripts:
    """lease-2.lua's answers, scripted; renew-2.lua's calls, counted."""

    def __init__(self, answers: list[list[int]]) -> None:
        self.answers = answers
        self.leases: list[list[Any]] = []
        self.renewals: list[list[Any]] = []

    async def lease(self, keys: list[str], args: list[Any]) -> list[int]:
        self.leases.append(args)
        return self.answers.pop(0)

    async def renew(self, keys: list[str], args: list[Any]) -> list[int]:
        self.renewals.append(args)
        return [1] * ((len(args) - 1) // 2)


class FakeRaw:
    def __init__(self) -> None:
        self.zadds: list[tuple[str, dict[str, float], bool]] = []

    async def zadd(self, key: str, mapping: dict[str, float], xx: bool = False) -> int:
        self.zadds.append((key, mapping, xx))
        return 0


def make(answers: list[list[int]]) -> tuple[Sessions, FakeScripts, Keys]:
    settings = Settings(consumer="w1")
    scripts = FakeScripts(answers)
    pipeline: Any = SimpleNamespace(leases={})
    raw: Any = FakeRaw()
    sessions = Sessions(settings, raw, scripts, Metrics(), pipeline, anyio.Event())  # type: ignore[arg-type]
    return sessions, scripts, Keys.from_settings(settings)


def job(keys: Keys, sid: str, token: str) -> Job:
    return Job(keys, sid, token, 1, "1-0", {}, b"", 0, 1, "", "")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_one_lease_call_per_shard_covers_every_session_held():
    sessions, scripts, keys = make([[7, 0, 0], [7, 0, 0]])
    await sessions.ensure_lease(keys)
    base = sessions.token_base(keys.shard)
    assert base.startswith("w1:L7.") and holder_of(base + ":1") == 7
    assert sessions.lock_ttl_ms(keys.shard) == Settings().lock_ttl_ms * HELD_LOCK_TTL_FACTOR
    for i in range(500):
        held = job(keys, f"s{i}", f"{base}:{i}")
        held.renewed_at -= 10  # steps running for 10 s, twice the lock TTL
        sessions.leases[held.token] = held
    await sessions.renew_leases_once()
    assert scripts.leases == [[0, 5000, 1000], [7, 5000, 1000]]
    assert scripts.renewals == []  # no step renewed on its own
    assert not any(j.lost for j in sessions.leases.values())


async def test_a_lapsed_lease_gives_up_every_result_held_under_it_and_takes_a_new_number():
    sessions, _, keys = make([[7, 0, 0], [8, 1, 1]])
    await sessions.ensure_lease(keys)
    base = sessions.token_base(keys.shard)
    held = job(keys, "s", f"{base}:1")
    held.scope = anyio.CancelScope()
    sessions.leases[held.token] = held
    await sessions.renew_leases_once()
    assert held.lost and held.scope.cancel_called
    assert holder_of(sessions.token_base(keys.shard) + ":1") == 8


async def test_a_step_that_held_its_lock_a_third_of_its_long_ttl_is_renewed_alone():
    sessions, scripts, keys = make([[7, 0, 0], [7, 0, 0]])
    await sessions.ensure_lease(keys)
    base = sessions.token_base(keys.shard)
    old, new = job(keys, "old", f"{base}:1"), job(keys, "new", f"{base}:2")
    old.renewed_at -= 5 * HELD_LOCK_TTL_FACTOR / 3 + 1  # held a third of its TTL (s)
    sessions.leases.update({old.token: old, new.token: new})
    await sessions.renew_leases_once()
    assert scripts.renewals == [[5000 * HELD_LOCK_TTL_FACTOR, old.token, "old"]]


async def test_a_worker_that_stops_marks_its_leases_lapsed_long_ago():
    sessions, _, keys = make([[7, 0, 0]])
    await sessions.ensure_lease(keys)
    await sessions.leave()
    assert sessions.raw.zadds == [(keys.workers, {"7": 0}, True)]  # type: ignore[attr-defined]


async def test_a_call_whose_reply_stays_lost_gives_the_number_up(monkeypatch):
    """A lock-handing call whose reply is lost is sent again, the same call each time; once
    Redis has not answered for IN_DOUBT_S the worker gives its number up (its results under
    it too), so its sessions come back when the number lapses; the next lease call takes a
    new number."""
    monkeypatch.setattr("dialog_worker.daemon.sessions.IN_DOUBT_S", 0.2)
    sessions, scripts, keys = make([[7, 0, 0], [8, 0, 0]])
    await sessions.ensure_lease(keys)
    held = job(keys, "s", f"{sessions.token_base(keys.shard)}:1")
    held.scope = anyio.CancelScope()
    sessions.leases[held.token] = held
    sent: list[str] = []

    async def lost() -> None:
        sent.append("intake")
        raise redis.exceptions.ConnectionError("the reply was lost")

    with pytest.raises(redis.exceptions.ConnectionError):
        await sessions.in_doubt(keys.shard, lost)
    assert len(sent) >= 3  # sent again while within the bound
    assert held.lost and held.scope.cancel_called
    assert sessions.worker_numbers[keys.shard] == 0
    await sessions.renew_leases_once()
    assert scripts.leases[-1][0] == 0  # asks for a new number
    assert holder_of(sessions.token_base(keys.shard) + ":1") == 8


async def test_a_call_answered_on_a_later_try_keeps_the_number():
    sessions, _, keys = make([[7, 0, 0]])
    await sessions.ensure_lease(keys)
    tries: list[int] = []

    async def answers_second() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise redis.exceptions.TimeoutError("timed out")
        return "jobs"

    assert await sessions.in_doubt(keys.shard, answers_second) == "jobs"
    assert len(tries) == 2 and sessions.worker_numbers[keys.shard] == 7
