"""The permission table of docs/permissions.md, checked cell by cell against the shipped ACL file.

The table has one row per command (every command a role is granted, and the dangerous or
destructive ones no role should have) and one column per role. A cell lists the key families
the role may run the command on (their codes, from the legend table of the same page), `yes`
or `no` for a command that takes no key, `-` for none. The shipped config/redis-acl.conf is
rendered as docs/deploy.md says and loaded into a real redis-server (the `acl` fixture of
test_security.py); `ACL DRYRUN` then answers every cell both ways: for each role x command x
family, on sample keys of the plain and of the sharded layout, allowed exactly where the
table says so. A role widened or narrowed fails here until the table changes with it; a
command added to the table needs its arguments in COMMANDS below.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_security import ROLES, AclRedis, acl  # noqa: F401  (acl: the module's fixture)

from dialog_worker.config import Settings
from dialog_worker.store.keys import Keys, Topology, audit_key, limits_index, shards_key

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "permissions.md"
SHA = "0" * 40

# How each command of the table is called: "{k}" is the key (a command whose template has
# none takes no key). Arguments only need to be well-formed for ACL DRYRUN, which runs nothing.
COMMANDS: dict[str, str] = {
    # streams
    "XADD": "XADD {k} * f v",
    "XRANGE": "XRANGE {k} - +",
    "XREVRANGE": "XREVRANGE {k} + -",
    "XREAD": "XREAD COUNT 1 STREAMS {k} 0",
    "XLEN": "XLEN {k}",
    "XDEL": "XDEL {k} 1-1",
    "XTRIM": "XTRIM {k} MAXLEN 0",
    "XACK": "XACK {k} g 1-1",
    "XREADGROUP": "XREADGROUP GROUP g c COUNT 1 STREAMS {k} >",
    "XAUTOCLAIM": "XAUTOCLAIM {k} g c 1000 0-0",
    "XCLAIM": "XCLAIM {k} g c 1000 1-1",
    "XPENDING": "XPENDING {k} g",
    "XGROUP CREATE": "XGROUP CREATE {k} g $ MKSTREAM",
    "XGROUP DELCONSUMER": "XGROUP DELCONSUMER {k} g c",
    "XGROUP DESTROY": "XGROUP DESTROY {k} g",
    "XGROUP SETID": "XGROUP SETID {k} g $",
    "XINFO GROUPS": "XINFO GROUPS {k}",
    "XINFO CONSUMERS": "XINFO CONSUMERS {k} g",
    "XINFO STREAM": "XINFO STREAM {k}",
    # sorted sets and sets
    "ZADD": "ZADD {k} 1 m",
    "ZREM": "ZREM {k} m",
    "ZRANGE": "ZRANGE {k} 0 0",
    "ZRANGEBYSCORE": "ZRANGEBYSCORE {k} 0 1",
    "ZREVRANGE": "ZREVRANGE {k} 0 0",
    "ZRANGEBYLEX": "ZRANGEBYLEX {k} - +",
    "ZREMRANGEBYSCORE": "ZREMRANGEBYSCORE {k} 0 1",
    "ZREMRANGEBYRANK": "ZREMRANGEBYRANK {k} 0 0",
    "ZCARD": "ZCARD {k}",
    "ZSCORE": "ZSCORE {k} m",
    "ZCOUNT": "ZCOUNT {k} 0 +inf",
    "ZPOPMIN": "ZPOPMIN {k}",
    "ZRANK": "ZRANK {k} m",
    "SADD": "SADD {k} m",
    "SISMEMBER": "SISMEMBER {k} m",
    "SMEMBERS": "SMEMBERS {k}",
    # lists (the kick list)
    "LPUSH": "LPUSH {k} 1",
    "LTRIM": "LTRIM {k} 0 0",
    "BLPOP": "BLPOP {k} 1",
    # hashes
    "HGET": "HGET {k} f",
    "HMGET": "HMGET {k} f",
    "HGETALL": "HGETALL {k}",
    "HKEYS": "HKEYS {k}",
    "HLEN": "HLEN {k}",
    "HEXISTS": "HEXISTS {k} f",
    "HSCAN": "HSCAN {k} 0",
    "HSET": "HSET {k} f v",
    "HSETNX": "HSETNX {k} f v",
    "HDEL": "HDEL {k} f",
    "HINCRBY": "HINCRBY {k} f 1",
    # strings and any key
    "GET": "GET {k}",
    "MGET": "MGET {k}",
    "SET": "SET {k} v",
    "INCR": "INCR {k}",
    "DEL": "DEL {k}",
    "UNLINK": "UNLINK {k}",
    "EXISTS": "EXISTS {k}",
    "TYPE": "TYPE {k}",
    "PTTL": "PTTL {k}",
    "PEXPIRE": "PEXPIRE {k} 1000",
    "EXPIRE": "EXPIRE {k} 1",
    "PERSIST": "PERSIST {k}",
    "RENAME": "RENAME {k} {k}",
    "DUMP": "DUMP {k}",
    "RESTORE": "RESTORE {k} 0 x",
    "WATCH": "WATCH {k}",
    # scripts
    "EVALSHA": f"EVALSHA {SHA} 1 {{k}}",
    "EVAL": "EVAL script 1 {k}",
    "SCRIPT LOAD": "SCRIPT LOAD return",
    "SCRIPT FLUSH": "SCRIPT FLUSH",
    "SCRIPT KILL": "SCRIPT KILL",
    # no key
    "PING": "PING",
    "TIME": "TIME",
    "INFO": "INFO",
    "SCAN": "SCAN 0",
    "MULTI": "MULTI",
    "EXEC": "EXEC",
    "DISCARD": "DISCARD",
    "UNWATCH": "UNWATCH",
    "CLUSTER SLOTS": "CLUSTER SLOTS",
    "CLUSTER SHARDS": "CLUSTER SHARDS",
    "KEYS": "KEYS *",
    "FLUSHALL": "FLUSHALL",
    "FLUSHDB": "FLUSHDB",
    "CONFIG GET": "CONFIG GET *",
    "SHUTDOWN": "SHUTDOWN",
    "PUBLISH": "PUBLISH dialog x",
}


# msg_ids that make a session's key end as a shard key does (see families()).
ALIASES = ("x}:s:cancels", "x}:s:cancel-notes", "x}:ready:tset", "x}:ready:tmin")


def families() -> dict[str, list[str]]:
    """Key family code -> sample keys of that family, in the plain and in the sharded layout
    (shard 1 of 3). A family is allowed only if every sample is, refused only if none is."""
    plain = Keys.from_settings(Settings())
    shard = Topology.from_settings(Settings(shards=3)).shards[1]
    both = (plain, shard)
    s = [k.session("u1") for k in both]
    day = "20250101"
    limit = plain.limit("openai:gpt-4.1")
    budget = plain.budget("acme", day)
    return {
        "in": [k.stream for k in both],
        "sp": [k.session_prefix for k in both],
        "st": [x.state for x in s],
        # Keys named by msg_ids that end like the shard keys written with patterns matched
        # by length (the cancel count, the tenants' shard copies): those patterns match none.
        "msg": [x.dedupe(m) for x in s for m in ("m1", "m}", *ALIASES)],
        "lock": [x.lock for x in s],
        "cnl": [x.cancel_mark("m1") for x in s],
        "part": [x.partial("m1") for x in s],
        "jrn": [x.journal(m) for x in s for m in ("m1", *ALIASES)],
        "awt": [x.awaiting for x in s],
        "intr": [x.interrupts for x in s],
        "stm": [x.timers for x in s],
        "ids": [x.ids for x in s],
        "let": [x.letters for x in s],
        "cnc": [k.cancels for k in both],
        "cnn": [k.cancel_notes for k in both],
        "rdy": [k.ready for k in both],
        "inb": [k.inbound for k in both],
        "age": [k.ages for k in both],
        "tmr": [k.timers for k in both],
        "fnd": [k.msg_sessions(9) for k in both],
        "seen": [k.sessions_seen(9) for k in both],
        "lsn": [k.letters_since for k in both],
        "rcp": [f"{k.ready}:receipt:t1" for k in both],
        "wait": [k.waiter for k in both] + [k.wake for k in both],
        "kick": [k.kick for k in both],
        "runq": [k.tenant_queue(t) for k in both for t in ("acme", "t}")],
        "busy": [k.tenant_busy(t) for k in both for t in ("acme", "t}")],
        "act": [k.tenants_active for k in both],
        "vt": [k.tenants_vt for k in both],
        "tset": [k.tenant_settings for k in both],
        "tmin": [k.tenants_guaranteed for k in both],
        "use": [k.usage(day) for k in both],
        "rep": [k.replies for k in both],
        "dlq": [k.dlq for k in both],
        "aud": [audit_key(Settings())],
        "shd": [shards_key(Settings())],
        "rsh": [k.reshard_moved for k in both],
        "ten": [plain.tenants],
        "lim": [limit.config],
        "lsl": [limit.in_flight, limit.reserved],
        "lix": [limits_index(plain.prefix)],
        "bud": [budget.meter, budget.leases],
    }


def doc_tables() -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """(legend: code -> family, table: command -> role -> cell) from docs/permissions.md."""
    rows: list[list[str]] = []
    tables: list[list[list[str]]] = []
    for line in [*DOC.read_text(encoding="utf-8").splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    legend_rows = next(t for t in tables if t[0][:2] == ["code", "key family"])
    grid = next(t for t in tables if t[0][0] == "command")
    legend = {r[0]: r[1] for r in legend_rows[1:]}
    header = grid[0][1:]
    table = {r[0]: dict(zip(header, r[1:], strict=True)) for r in grid[1:]}
    return legend, table


def allowed_families(cell: str) -> set[str]:
    return set() if cell in ("-", "no") else set(cell.split())


def test_the_table_names_every_role_family_and_command_once() -> None:
    legend, table = doc_tables()
    assert set(legend) == set(families())
    assert set(next(iter(table.values()))) == set(ROLES)
    assert set(table) == set(COMMANDS)
    for command, cells in table.items():
        keyless = "{k}" not in COMMANDS[command]
        for role, cell in cells.items():
            if keyless:
                assert cell in ("yes", "no"), (command, role, cell)
            else:
                assert cell == "-" or allowed_families(cell) <= set(legend), (command, role, cell)


def test_every_cell_of_the_table_is_what_redis_answers(acl: AclRedis) -> None:  # noqa: F811
    _, table = doc_tables()
    fams = families()
    wrong: list[str] = []
    actual_rows: dict[str, dict[str, str]] = {}

    def allowed(role: str, template: str, key: str | None) -> bool:
        args = template.format(k=key).split() if key is not None else template.split()
        if args[0] == "EVAL":
            args[1] = "return 1"
        return acl.admin.execute_command("ACL", "DRYRUN", role, *args) == "OK"

    for command, template in COMMANDS.items():
        for role in ROLES:
            cell = table[command][role]
            if "{k}" not in template:
                actual = "yes" if allowed(role, template, None) else "no"
            else:
                granted = []
                for code, keys in fams.items():
                    answers = {key: allowed(role, template, key) for key in keys}
                    if len(set(answers.values())) > 1:
                        wrong.append(f"{command} / {role} / {code}: split {answers}")
                    if all(answers.values()):
                        granted.append(code)
                actual = " ".join(granted) or "-"
                if (
                    cell != "-"
                    and allowed_families(cell)
                    and cell.split() != [c for c in fams if c in allowed_families(cell)]
                ):
                    wrong.append(f"{command} / {role}: list the families in legend order")
            if (allowed_families(cell), cell in ("yes",)) != (
                allowed_families(actual),
                actual == "yes",
            ):
                wrong.append(f"{command} / {role}: the table says {cell!r}, Redis {actual!r}")
            actual_rows.setdefault(command, {})[role] = actual
    if wrong:
        fixed = "\n".join(
            f"| `{c}` | " + " | ".join(actual_rows[c][r] for r in ROLES) + " |"
            for c in COMMANDS
            if actual_rows[c] != table[c]
        )
        pytest.fail("\n".join(wrong) + "\n\nRows as Redis answers them:\n" + fixed)
