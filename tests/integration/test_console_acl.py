"""The console's session actions as the shipped `operator` user (config/redis-acl.conf).

Hold, release, redrive of a held session (lua/hold-3.lua) and cancel (lua/cancel-1.lua) run
scripts; every command a script calls is checked against the user who called EVALSHA. These
run the console's own action functions (dialog_worker/console/actions.py, what its forms call) as
`operator` on a real redis-server loaded with the rendered ACL file, in both key layouts: each
action does what it says, and Redis' ACL LOG stays empty (not one command denied, not even
one a script ran through redis.pcall).
"""

from __future__ import annotations

import json

import pytest
from test_security import LAYOUTS, AclRedis, acl, settings_for  # noqa: F401  (acl: fixture)

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.console import actions
from dialog_worker.ops import dead_letters as dlq

pytestmark = pytest.mark.integration


def _put_waiting(acl: AclRedis, state: str, seq: int, entry_id: str, fields: list[str]) -> None:  # noqa: F811
    """A waiting message as intake keeps it in the state hash (pack_message, lua/_common.lua)."""
    acl.admin.execute_command(
        "EVAL",
        "redis.call('HSET', KEYS[1], 'q' .. ARGV[1],"
        " cmsgpack.pack(ARGV[2], cjson.decode(ARGV[3])))",
        1,
        state,
        seq,
        entry_id,
        json.dumps(fields),
    )


def _fresh_operator(acl: AclRedis, layout: str) -> Settings:  # noqa: F811
    """An empty Redis with an empty ACL log, and the operator user's settings in ``layout``."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    return settings_for(acl.url("operator"), **LAYOUTS[layout])


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_console_hold_release_redrive_and_cancel_as_the_operator_user(
    acl: AclRedis,  # noqa: F811
    layout: str,
) -> None:
    operator = _fresh_operator(acl, layout)
    sid = "held-one"
    async with DialogClient(settings=operator) as client:
        keys = client.keys_for(sid)
        sk = keys.session(sid)
        # A session with one applied message and one waiting (seq 2, msg_id m2), its shard's
        # ready set, ages, dead-letter stream and one dead letter of it.
        acl.admin.hset(
            sk.state, mapping={"a": "1", "s": "2", "v": "1", "d": json.dumps({"history": []})}
        )
        _put_waiting(acl, sk.state, 2, "1-2", ["session_id", sid, "text", "two", "msg_id", "m2"])
        acl.admin.set(sk.dedupe("m2"), "2")
        acl.admin.zadd(keys.ready, {"someone-else": 1})
        acl.admin.zadd(keys.ages, {"someone-else": 1})
        letter = acl.admin.xadd(
            keys.dlq, {"session_id": sid, "text": "zero", "msg_id": "m0", "error": "e"}
        )
        acl.admin.zadd(sk.letters, {letter: 1})

        assert (await actions.hold(client, sid, "ops")).done == 1
        assert acl.admin.hget(sk.state, "h").startswith("held by ops")
        assert (await actions.release(client, sid)).done == 1
        assert acl.admin.hget(sk.state, "h") is None
        assert acl.admin.zscore(keys.ready, sid) is not None  # its waiting message goes on
        assert (await actions.release(client, sid)).skipped == 1  # not held

        # Redrive of a held session: the letter goes back in front of the waiting message.
        await actions.hold(client, sid, "ops")
        handle = f"{keys.shard}:{letter}"  # the console's handle of a letter
        done = await actions.redrive(client, [handle], session_id=sid)
        assert (done.done, done.missing, done.skipped) == (1, 0, 0)
        assert acl.admin.hmget(sk.state, "s", "h") == ["3", None]
        assert acl.admin.get(sk.dedupe("m2")) == "3"
        resent = f"redrive:{dlq.handle_of(client, keys, letter)}"  # the msg_id it is given
        assert acl.admin.get(sk.dedupe(resent)) == "2"
        assert acl.admin.xlen(keys.dlq) == 0
        assert acl.admin.zcard(sk.letters) == 0

        # Cancel: of the waiting message (now seq 3), and of one not sent yet (indexed).
        assert (await actions.cancel(client, sid, "m2")).done == 1
        assert acl.admin.exists(sk.cancel_mark("m2"))
        assert (await actions.cancel(client, sid, "later")).skipped == 1
        assert acl.admin.exists(sk.cancel_mark("later"))
        assert acl.admin.zscore(sk.ids, "later") is not None
    assert acl.acl_log() == [], "the operator was denied a command a console action needs"


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_session_delete_as_the_operator_user_removes_its_msg_ids_from_the_consoles_find(
    acl: AclRedis,  # noqa: F811
    layout: str,
) -> None:
    operator = _fresh_operator(acl, layout)
    sid = "gone"
    async with DialogClient(settings=operator) as client:
        keys = client.keys_for(sid)
        sk = keys.session(sid)
        acl.admin.hset(sk.state, mapping={"a": "1", "s": "1", "v": "1", "d": "{}"})
        acl.admin.zadd(sk.ids, {"m1": 9e15})
        sec, usec = acl.admin.time()
        quarter = (int(sec) * 1000 + int(usec) // 1000) // (operator.dedupe_ttl_s * 250)
        found = keys.msg_sessions(quarter - 1)  # the quarter before this one is looked at too
        acl.admin.hset(found, mapping={"m1": sid, "m2": "someone-else"})
        await client.delete(sid)
        assert acl.admin.hgetall(found) == {"m2": "someone-else"}
    assert acl.acl_log() == [], "the operator was denied a command session delete needs"
