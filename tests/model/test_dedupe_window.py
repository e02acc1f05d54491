"""A dedupe window longer than the state TTL (DIALOG_DEDUPE_TTL_S > DIALOG_STATE_TTL_S, e.g.
sessions forgotten after an hour of silence, msg_ids remembered for a day): a dedupe key
outlives its session's state, and seqs start again at 1. Found by the model check
(test_model.py): a copy of an old message was taken for the new message with the same seq, and
answered with that message's msg_id and reply. It must get its own duplicate event: its own
msg_id, the original seq, and no reply text (the original's turn is gone with the state)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis_server import RedisServer

from dialog_worker.config import Settings
from dialog_worker.store.codec import MAX_EXTRA_FIELDS
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Code, source

pytestmark = pytest.mark.integration

KEYS = Keys.from_settings(Settings())
STATE_TTL_S, DEDUPE_TTL_S = 60, 3600


class Calls:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._intake = r.register_script(source("intake"))
        self._commit = r.register_script(source("commit"))
        self.n = 0

    def intake(self) -> list[Any]:
        k = KEYS
        self.n += 1
        return self._intake(  # type: ignore[no-any-return]
            keys=[k.stream, k.ready, k.session_prefix, k.dlq, k.replies],
            args=[k.group, "c1", 100, f"t{self.n}", 5000, DEDUPE_TTL_S, 65536,
                  MAX_EXTRA_FIELDS, 0, "test", 0, "x"],
        )  # fmt: skip

    def apply(self, job: list[Any], msg_id: bytes) -> None:
        """Commit the job as the pipeline would: one history turn with its msg_id."""
        k = KEYS
        seq, version = int(job[2]), int(job[6])
        history = json.loads(job[5])["history"] if job[5] else []
        doc = {
            "history": [*history, {"seq": seq, "msg_id": msg_id.decode(), "bot": "r" + str(seq)}]
        }
        [result] = self._commit(
            keys=[k.stream, k.ready, k.session_prefix, k.replies, k.dlq],
            args=[5000, STATE_TTL_S, 0, 1, job[1], job[0], seq, version, json.dumps(doc),
                  msg_id, "r" + str(seq), "applied", job[3], "", "", "", "", "", ""],
        )  # fmt: skip
        assert int(result[0]) == Code.COMMITTED


@pytest.fixture
def calls(redis_server: RedisServer) -> Iterator[Calls]:
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.xgroup_create(KEYS.stream, KEYS.group, id="0", mkstream=True)
    yield Calls(r)
    r.close()


def send(calls: Calls, text: str, msg_id: str | None = None) -> bytes:
    fields = {"session_id": "s", "text": text} | ({"msg_id": msg_id} if msg_id else {})
    return calls.r.xadd(KEYS.stream, fields)  # type: ignore[arg-type]


def forget_state(calls: Calls) -> None:
    """The idle state's TTL ran out; the dedupe key (a longer window) is still there."""
    assert calls.r.ttl(KEYS.session("s").state) > 0
    calls.r.delete(KEYS.session("s").state)
    assert calls.r.exists(KEYS.session("s").dedupe("old"))


def duplicate_events(calls: Calls) -> list[dict[bytes, bytes]]:
    return [f for _, f in calls.r.xrange(KEYS.replies) if f[b"outcome"] == b"duplicate"]


def test_a_copy_from_before_the_state_expired_is_not_taken_for_the_new_first_message(calls):
    send(calls, "first life", msg_id="old")
    [job] = calls.intake()[2]
    calls.apply(job, b"old")
    forget_state(calls)
    send(calls, "second life")  # seq 1 again
    [new_job] = calls.intake()[2]
    copy = send(calls, "first life", msg_id="old")
    calls.intake()
    [event] = duplicate_events(calls)  # answered at once, not left waiting for the new seq 1
    assert (event[b"entry_id"], event[b"msg_id"], event[b"seq"], event[b"reply"]) == (
        copy, b"old", b"1", b""
    )  # fmt: skip
    calls.apply(new_job, new_job[3])
    assert len(duplicate_events(calls)) == 1
    assert calls.r.xlen(KEYS.stream) == 0


def test_a_copy_from_before_the_state_expired_does_not_get_another_messages_reply(calls):
    send(calls, "first life", msg_id="old")
    [job] = calls.intake()[2]
    calls.apply(job, b"old")
    forget_state(calls)
    send(calls, "second life", msg_id="new")
    [new_job] = calls.intake()[2]
    calls.apply(new_job, b"new")  # seq 1 of the new life, reply "r1"
    copy = send(calls, "first life", msg_id="old")
    calls.intake()
    [event] = duplicate_events(calls)
    assert (event[b"entry_id"], event[b"msg_id"], event[b"seq"], event[b"reply"]) == (
        copy, b"old", b"1", b""
    )  # fmt: skip


def test_a_copy_of_an_outstanding_message_still_waits_for_its_commit(calls):
    send(calls, "m", msg_id="a")
    copy_in_same_read = send(calls, "m", msg_id="a")
    [job] = calls.intake()[2]
    copy_later = send(calls, "m", msg_id="a")
    calls.intake()
    assert duplicate_events(calls) == []  # both wait
    calls.apply(job, b"a")
    events = duplicate_events(calls)
    assert [(e[b"entry_id"], e[b"reply"]) for e in events] == [
        (copy_in_same_read, b"r1"),
        (copy_later, b"r1"),
    ]
