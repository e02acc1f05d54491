"""Least-privilege ACL users (config/redis-acl.conf) and TLS, against real redis-server processes.

ACL: the template is rendered with the command documented in docs/deploy.md, loaded with
--aclfile, and the whole pipeline runs as the restricted users: producer sends, a worker process
applies and dead-letters, the operator's commands inspect, redrive and purge. Redis' ACL LOG
must stay empty throughout, so no role lacks a command its code (or its Lua scripts) runs.

TLS: the test makes a CA, a server certificate for DNS:localhost only (no IP SAN) and an
unrelated CA. rediss://localhost with the right CA works (a real worker applies messages);
the wrong CA, no CA, or rediss://127.0.0.1 (name not in the certificate) are refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import worker_env
from redis_server import RedisServer, free_port, wait_until
from worker_procs import WorkerPool

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings, load_settings
from dialog_worker.store.connection import connect
from dialog_worker.store.keys import Keys, Topology

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ACL_TEMPLATE = REPO / "config" / "redis-acl.conf"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
ROLES = ("worker", "producer", "operator", "keda", "replies", "app")
RENDERED_PATH = "/etc/redis/users.acl"  # where the documented command writes the ACL file


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dialog_worker", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def settings_for(url: str, **extra: str) -> Settings:
    return load_settings(environ={"REDIS_URL": url, **extra})


# ---------------------------------------------------------------------------------------------
# ACL: render the template exactly as documented, start redis-server --aclfile


def render_command() -> str:
    """The shell command docs/deploy.md gives for rendering the ACL file; the template's header
    must carry the same command."""
    blocks = re.findall(r"```sh\n(.*?)```", DEPLOY_DOC.read_text(), flags=re.S)
    [command] = [b for b in blocks if "grep '^user ' config/redis-acl.conf" in b]
    header = "\n".join(
        line.removeprefix("#   ")
        for line in ACL_TEMPLATE.read_text().splitlines()
        if line.startswith("#   ")
    )
    render_lines = [line for line in command.splitlines() if line.strip()]
    assert all(line in header for line in render_lines), "template header and docs differ"
    return command


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class AuthRedisServer(RedisServer):
    """The ACL file turns the default user off, so an unauthenticated PING answers NOAUTH:
    that still means the server is up."""

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"redis-server exited: {log}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False


@dataclass
class AclRedis:
    server: AuthRedisServer
    passwords: dict[str, str]
    acl_text: str
    admin: redis.Redis

    @property
    def port(self) -> int:
        return self.server.port

    def url(self, role: str) -> str:
        return f"redis://{role}:{self.passwords[role]}@127.0.0.1:{self.port}/0"

    def acl_log(self) -> list[dict[str, Any]]:
        rows = self.admin.execute_command("ACL", "LOG")
        return [dict(r) for r in rows]  # redis-py parses each entry into a dict


@pytest.fixture(scope="module")
def acl(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("acl")
    passwords = {role: secrets.token_hex(16) for role in ROLES}
    out = tmp / "users.acl"
    rendered = subprocess.run(
        ["bash", "-c", render_command().replace(RENDERED_PATH, str(out))],
        cwd=REPO,
        env={
            "PATH": "/usr/bin:/bin",
            **{f"REDIS_{role.upper()}_PASSWORD": pw for role, pw in passwords.items()},
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert rendered.returncode == 0, rendered.stderr
    acl_text = out.read_text()
    # A test-only administrator (not part of the template) to read ACL LOG and reset data.
    admin_pw = secrets.token_hex(16)
    with out.open("a") as f:
        f.write(f"user test-admin on #{sha256(admin_pw)} ~* &* +@all\n")
    server = AuthRedisServer(tmp / "redis", extra=("--aclfile", str(out))).start()
    admin = redis.Redis(
        host="127.0.0.1",
        port=server.port,
        username="test-admin",
        password=admin_pw,
        decode_responses=True,
    )
    try:
        yield AclRedis(server, passwords, acl_text, admin)
    finally:
        admin.close()
        server.stop()


def test_rendered_acl_file_holds_only_password_hashes(acl: AclRedis) -> None:
    users = {line.split()[1]: line for line in acl.acl_text.splitlines()}
    assert sorted(users) == sorted(["default", *ROLES])
    assert users["default"].split()[2] == "off"
    for role, pw in acl.passwords.items():
        assert pw not in acl.acl_text
        assert f" on #{sha256(pw)} " in users[role]
    assert "PASSWORD_SHA256" not in acl.acl_text
    assert acl.admin.execute_command("ACL", "WHOAMI") == "test-admin"


def test_unrendered_template_cannot_start_a_server(tmp_path: Path) -> None:
    """The placeholders are not valid password hashes: the template as committed is refused."""
    raw = tmp_path / "raw.acl"
    lines = ACL_TEMPLATE.read_text().splitlines()
    raw.write_text("".join(f"{line}\n" for line in lines if line.startswith("user ")))
    server = shutil.which("redis-server") or "redis-server"
    result = subprocess.run(
        [server, "--port", str(free_port()), "--bind", "127.0.0.1", "--aclfile", str(raw)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert "ACL" in result.stdout + result.stderr


def test_nobody_connects_without_a_named_user(acl: AclRedis) -> None:
    with socket.create_connection(("127.0.0.1", acl.port), timeout=5) as s:
        s.sendall(b"PING\r\nAUTH default anything\r\nGET dialog\r\n")
        replies = b""
        while replies.count(b"\r\n") < 3:
            replies += s.recv(4096)
    ping, auth, get = replies.decode().splitlines()
    assert ping.startswith("-NOAUTH") and get.startswith("-NOAUTH")
    assert auth.startswith("-WRONGPASS")


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name} ", f"{name}{{"))
    )


LAYOUTS = {"plain": {}, "sharded": {"DIALOG_SHARDS": "3"}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_pipeline_runs_as_the_restricted_users(
    acl: AclRedis, tmp_path: Path, layout: str
) -> None:
    """send (producer) -> run (worker) -> stats, state, session, dlq list/show/redrive/purge,
    verify (operator), and not one command denied, in both key layouts. The messages drive
    every Lua script and every direct command of the worker under its ACL: intake (a burst of
    sessions, later entries held and handed off by the commits, refused entries, a duplicate
    msg_id), commit, release ("boom" fails every time; "fatal" dead-letters), renew (a step
    longer than a third of the lock TTL), resume (retries after their backoff), XAUTOCLAIM
    (the reclaimer's intake), delconsumer (an idle consumer owning nothing), the sampler."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    sessions = [f"acl-{i}" for i in range(20)]
    texts = ["nama saya Budi", "pesan 2", "pesan 3", "pesan 4", "pesan 5"]
    layout_env = LAYOUTS[layout]
    producer = settings_for(acl.url("producer"), **layout_env)
    operator = settings_for(acl.url("operator"), **layout_env)
    topology = Topology.from_settings(producer)
    keys = topology.shards[0]

    async def produce() -> None:
        async with DialogClient(settings=producer) as c:
            for sid in sessions:
                for text in texts:
                    await c.send(sid, text)
            await c.send("acl-poison", "fatal: the engine refuses this one")
            await c.send("acl-poison", "nama saya Ani")
            await c.send("acl-boom", "boom: fails on every attempt")
            await c.send("acl-slow", "sleep 0.8 then the usual rules")
            # The same msg_id twice: the second is answered as a duplicate.
            await c.send("acl-dup", "nama saya Budi", msg_id="once")
            await c.send("acl-dup", "nama saya Budi", msg_id="once")
            # An entry that names no session (a producer's raw XADD can write anything).
            await c.redis.xadd(keys.stream, {"text": "no session here", "seq": "1"})

    asyncio.run(produce())  # before any worker: the worker user creates the group from 0
    as_operator = redis.Redis.from_url(acl.url("operator"), decode_responses=True)

    def applied(sid: str) -> int:
        state_key = topology.for_session(sid).session(sid).state
        return int(as_operator.hget(state_key, "a") or 0)

    def dead_letters() -> int:
        return sum(int(as_operator.xlen(k.dlq)) for k in topology.shards)

    def all_applied(poison: int, boom: int) -> bool:
        rest = tuple(applied(s) for s in ("acl-poison", "acl-boom", "acl-slow", "acl-dup"))
        return all(applied(s) == len(texts) for s in sessions) and rest == (poison, boom, 1, 1)

    pool = WorkerPool(
        worker_env(
            acl.url("worker"),
            **layout_env,
            DIALOG_ENGINE="fault_engine:make",
            DIALOG_LOCK_TTL_MS="600",
            DIALOG_BACKOFF_BASE_MS="10",
            DIALOG_BACKOFF_MAX_MS="50",
            DIALOG_RECLAIM_INTERVAL_MS="200",
            DIALOG_CONSUMER_IDLE_DELETE_S="1",
            DIALOG_METRICS_SAMPLE_INTERVAL_S="0.1",
        ),
        tmp_path,
    )
    w2 = None
    try:
        [w] = pool.start(1, metrics=True)
        wait_until(lambda: all_applied(2, 1), 30, what="every message applied or dead-lettered")
        # A consumer that left long ago and owns nothing is deleted (delconsumer-1.lua).
        acl.admin.xgroup_createconsumer(keys.stream, keys.group, "gone-replica")
        wait_until(
            lambda: (
                "gone-replica"
                not in [c["name"] for c in as_operator.xinfo_consumers(keys.stream, keys.group)]
            ),
            30,
            what="the idle consumer deleted",
        )

        async def states() -> dict[str, Any]:
            async with DialogClient(settings=operator) as c:
                return {sid: await c.state(sid) for sid in [*sessions, "acl-poison"]}

        got = asyncio.run(states())
        for sid in sessions:
            assert got[sid]["applied_seq"] == len(texts)
            assert [t["user"] for t in got[sid]["history"]] == texts
            assert got[sid]["memory"]["userName"] == "Budi"
        poison = got["acl-poison"]["history"]
        assert poison[0]["bot"] == producer.fallback_reply
        assert poison[1]["bot"] == "Halo Ani, ada yang bisa dibantu?"
        metrics = w.metrics_text()
        assert metric(metrics, "dialog_lease_renewals_total") > 0  # renew-2.lua ran
        assert metric(metrics, "dialog_retries_total") > 0  # release-2.lua ran
        assert metric(metrics, "dialog_handoffs_total") > 0  # commit-5.lua handed off
        duplicates = [line for line in metrics.splitlines() if 'outcome="duplicate"' in line]
        assert duplicates and float(duplicates[0].rsplit(" ", 1)[1]) == 1.0

        op_env = worker_env(acl.url("operator"), **layout_env)
        stats = cli(op_env, "stats")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["dlq_length"] == 3
        listed = cli(op_env, "dlq", "list")
        assert listed.returncode == 0, listed.stderr
        dead = {d.get("session_id"): d for d in map(json.loads, listed.stdout.splitlines())}
        assert dead["acl-poison"]["error_kind"] == "permanent"
        assert dead["acl-boom"]["error_kind"] == "exhausted"
        assert dead[None]["error_kind"] == "malformed"  # the entry without a session
        shown = cli(op_env, "dlq", "show", dead["acl-poison"]["id"])
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["text"].startswith("fatal")
        session = cli(op_env, "session", "acl-poison")
        assert session.returncode == 0, session.stderr
        assert len(json.loads(session.stdout)["dead_letters"]) == 1
        state = cli(op_env, "state", "acl-0")
        assert state.returncode == 0 and json.loads(state.stdout)["applied_seq"] == len(texts)

        # Redrive with no worker running, so the count is exact: a worker would dead-letter
        # the re-sent messages again while redrive is still reading the dead-letter stream.
        assert w.terminate() == 0
        redriven = cli(op_env, "dlq", "redrive")
        assert redriven.returncode == 0, redriven.stderr
        # The two with a session are re-sent; the one without a session cannot be and stays.
        assert json.loads(redriven.stdout) == {"redriven": 2, "skipped": 1}
        assert dead_letters() == 1
        # A new worker applies them as new turns of their sessions: they fail again.
        [w2] = pool.start(1, metrics=True)
        wait_until(
            lambda: all_applied(3, 2) and dead_letters() == 3,
            30,
            what="the redriven messages dead-lettered again",
        )
        released = cli(op_env, "session", "acl-1", "--release-lock", "--yes")
        assert released.returncode == 0, released.stderr
        verified = cli(op_env, "verify", "--sessions", "3", "--burst", "3", "--timeout", "60")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        # One by one with --id (purging everything at once asks for confirmation).
        left = cli(op_env, "dlq", "list")
        for entry_id in [json.loads(line)["id"] for line in left.stdout.splitlines()]:
            purged = cli(op_env, "dlq", "purge", "--id", entry_id)
            assert purged.returncode == 0, purged.stderr
            assert json.loads(purged.stdout) == {"purged": 1}
        assert dead_letters() == 0

        assert acl.acl_log() == [], "a role was denied a command it needs"
        assert w2.terminate() == 0
    finally:
        pool.stop_all()
        as_operator.close()
    logs = w.log_text() + (w2.log_text() if w2 is not None else "")
    assert acl.passwords["worker"] not in logs


def session_keys(layout: str) -> dict[str, str]:
    """One session's keys and its shard's ready set and streams, in the given layout."""
    settings = Settings(**({"shards": 3} if layout == "sharded" else {}))
    keys = Topology.from_settings(settings).for_session("sess")
    sk = keys.session("sess")
    return {
        "state": sk.state,
        "lock": sk.lock,
        "dedupe": sk.dedupe("m1"),
        "dedupe_brace": sk.dedupe("m}"),  # ends in "}" like a sharded stream name
        "ready": keys.ready,
        "stream": keys.stream,
        "replies": keys.replies,
        "dlq": keys.dlq,
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_producer_can_append_to_the_inbound_stream_and_touch_nothing_else(
    acl: AclRedis, layout: str
) -> None:
    """Real commands on a real connection as `producer`: XADD to its session's inbound stream
    works; every command on a session key, the ready set, the reply and dead-letter streams
    is refused, including XADD to a key that is not a stream of the deployment."""
    acl.admin.flushall()
    k = session_keys(layout)
    acl.admin.hset(k["state"], mapping={"a": "1", "s": "1", "v": "1", "d": "{}"})
    acl.admin.set(k["lock"], "token", px=60_000)
    acl.admin.set(k["dedupe"], "1", ex=600)
    acl.admin.zadd(k["ready"], {"sess": 1})
    before = {key: acl.admin.dump(key) for key in (k["state"], k["lock"], k["dedupe"], k["ready"])}
    r = redis.Redis.from_url(acl.url("producer"), decode_responses=True)
    try:
        assert r.xadd(k["stream"], {"session_id": "sess", "text": "hello"})
        refused = []
        for name in ("state", "lock", "dedupe", "ready"):
            key = k[name]
            for command in (
                ("GET", key),
                ("SET", key, "x"),
                ("HINCRBY", key, "s", "1"),
                ("HGET", key, "d"),
                ("EXPIRE", key, "1"),
                ("PERSIST", key),
                ("DEL", key),
                ("ZADD", key, "1", "x"),
                ("XADD", key, "*", "f", "v"),
            ):
                try:
                    r.execute_command(*command)
                except redis.exceptions.NoPermissionError:
                    refused.append(command[0])
                else:
                    pytest.fail(f"producer ran {command} on its {name} key")
        for command in (
            ("XADD", k["dedupe_brace"], "*", "f", "v"),  # would make a session key a stream
            ("XADD", k["replies"], "*", "f", "v"),
            ("XADD", k["dlq"], "*", "f", "v"),
            ("XRANGE", k["stream"], "-", "+"),
            ("XREADGROUP", "GROUP", "g", "c", "STREAMS", k["stream"], ">"),
            ("EVALSHA", "0" * 40, "1", k["state"]),
            ("SCRIPT", "LOAD", "return 1"),
            ("SET", "dialog:shards", "9"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command(*command)
        assert r.get("dialog:shards") is None  # what the client reads: allowed
    finally:
        r.close()
    assert len(refused) == 4 * 9
    # Nothing changed, and no stream appeared where a session key could be.
    assert {key: acl.admin.dump(key) for key in before} == before
    assert acl.admin.exists(k["dedupe_brace"]) == 0


def test_operator_can_reshard_there_and_back_with_nothing_denied(acl: AclRedis) -> None:
    """reshard as `operator`, 1 -> 2 -> 1 shards: every key moved with its selectors (DUMP,
    RESTORE, DEL, the dead-letter script, SET dialog:shards), ACL LOG empty."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    plain = Keys.from_settings(Settings())
    acl.admin.xgroup_create(plain.stream, plain.group, id="0", mkstream=True)
    for sid in ("r1", "r{2}", "r3"):
        sk = plain.session(sid)
        acl.admin.hset(sk.state, mapping={"a": "2", "s": "2", "v": "2", "d": "{}"})
        acl.admin.expire(sk.state, 600)
        acl.admin.set(sk.dedupe("m1"), "1", ex=600)
        acl.admin.xadd(plain.dlq, {"session_id": sid, "text": "t", "error": "e"})
    env = worker_env(acl.url("operator"))
    there = cli(env, "reshard", "--to", "2", "--yes")
    assert there.returncode == 0, there.stderr
    assert json.loads(there.stdout)["sessions"] == 3
    back = cli({**env, "DIALOG_SHARDS": "2"}, "reshard", "--to", "1", "--yes")
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout)["dead_letters"] == 3
    assert acl.admin.get("dialog:shards") == "1"
    assert acl.admin.ttl(plain.session("r{2}").dedupe("m1")) > 0
    assert acl.acl_log() == [], "the operator was denied a command reshard needs"


def test_operator_can_reset_and_delete_a_session_with_nothing_denied(acl: AclRedis) -> None:
    """session reset|delete as `operator` (the erase script, its dead letters, the audit
    event, --purge-replies): done, ACL LOG empty."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    plain = Keys.from_settings(Settings())
    sk = plain.session("gone")
    acl.admin.hset(sk.state, mapping={"a": "1", "s": "2", "v": "2", "d": "{}", "q2": "x"})
    acl.admin.set(sk.lock, "tok")
    # Its step counts in flight for its tenant (T), and it also waits in the tenant's queue:
    # reset stops the count, delete takes it out of the queue.
    acl.admin.hset(sk.state, "T", "acme")
    acl.admin.zadd(plain.tenant_busy("acme"), {"gone": 9e12})
    acl.admin.zadd(plain.tenants_active, {"acme": 1})
    acl.admin.zadd(plain.tenant_queue("acme"), {"gone": 1})
    acl.admin.xadd(plain.dlq, {"session_id": "gone", "text": "t", "error": "e"})
    acl.admin.xadd(plain.replies, {"session_id": "gone", "reply": "r"})
    env = worker_env(acl.url("operator"))
    reset = cli(env, "session", "reset", "gone", "--yes")
    assert reset.returncode == 0, reset.stderr
    done = cli(env, "session", "delete", "gone", "--yes", "--purge-replies")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["dead_letters"], out["reply_events"]) == (1, 1)
    assert not acl.admin.exists(sk.state)
    assert acl.admin.zscore(plain.tenant_busy("acme"), "gone") is None
    assert acl.admin.zscore(plain.tenant_queue("acme"), "gone") is None
    assert acl.acl_log() == [], "the operator was denied a command reset or delete needs"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tenants_limits_and_usage_run_as_the_restricted_users(
    acl: AclRedis, tmp_path: Path, layout: str
) -> None:
    """`tenants set` and `limits set` as `operator`; then a worker (`worker`) runs two
    tenants' sessions through the tenants' queues (more sessions of a tenant capped at one slot
    than it may run, a tenant with a guaranteed minimum) with model calls on a limited key,
    a daily budget, a 429 (the key paused for every worker) and attempts that fail after their
    call (wasted usage); `tenants`, `limits`, `limits pause` (`operator`) and the usage
    (`app`) read what it wrote. Every command is allowed: ACL LOG stays empty."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    layout_env = LAYOUTS[layout]
    op_env = worker_env(acl.url("operator"), **layout_env)
    for args in (
        ("tenants", "set", "acme", "--weight", "2", "--max", "1"),
        ("tenants", "set", "beta", "--min", "1", "--daily-tokens", "100000"),
        ("limits", "set", "k", "--rpm", "60000", "--max-in-flight", "4"),
    ):
        done = cli(op_env, *args)
        assert done.returncode == 0, done.stderr
    topology = Topology.from_settings(settings_for(acl.url("operator"), **layout_env))
    for shard in topology.shards:  # every shard's copy, which its scripts read
        assert acl.admin.hget(shard.tenant_settings, "acme") == "2.0 0 1"
        assert acl.admin.zscore(shard.tenants_guaranteed, "beta") == 1
    texts = {"acme": ["plain"] * 4, "beta": ["fail-once", "limit", "plain"]}
    sessions = {f"{t}-{i}": t for t, kinds in texts.items() for i in range(len(kinds))}

    async def produce() -> None:
        async with DialogClient(settings=settings_for(acl.url("producer"), **layout_env)) as c:
            for tenant, kinds in texts.items():
                for i, kind in enumerate(kinds):
                    await c.send(f"{tenant}-{i}", f"{kind} {i}", meta={"tenant": tenant})

    asyncio.run(produce())  # before the worker: one intake reads them all, more than fit
    as_operator = redis.Redis.from_url(acl.url("operator"), decode_responses=True)

    def all_applied() -> bool:
        return all(
            as_operator.hget(topology.for_session(s).session(s).state, "a") == "1" for s in sessions
        )

    pool = WorkerPool(
        worker_env(
            acl.url("worker"),
            **layout_env,
            DIALOG_ENGINE="usage_engines:UsageEngine",
            DIALOG_CONCURRENCY="2",
            DIALOG_MODEL_LIMITS=json.dumps({"k": {"rpm": 60_000}}),
            DIALOG_TENANT_DAILY_TOKENS="100000",
            DIALOG_BACKOFF_BASE_MS="10",
            DIALOG_BACKOFF_MAX_MS="50",
        ),
        tmp_path,
    )
    try:
        pool.start(1)
        # A denied command inside a script (redis.pcall) may leave a session waiting for its
        # next look a minute later: stop at the first denial.
        wait_until(lambda: all_applied() or acl.acl_log() != [], 60, what="every message applied")
    finally:
        pool.stop_all()
        as_operator.close()

    async def usage() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with DialogClient(settings=settings_for(acl.url("app"), **layout_env)) as c:
            return (
                await c.tenant_usage("acme"),
                await c.tenant_usage("beta"),
                await c.usage("beta-0"),
            )

    acme, beta, failed_once = asyncio.run(usage())
    assert (acme["calls"], acme["input_tokens"], acme["output_tokens"]) == (4, 40, 20)
    assert beta["calls"] == 3 and beta["wasted"]["calls"] >= 1
    assert failed_once["calls"] == 1 and failed_once["wasted"]["calls"] == 1

    listed = cli(op_env, "tenants")
    assert listed.returncode == 0, listed.stderr
    rows = {r["tenant"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert (rows["acme"]["max"], rows["acme"]["in_flight"], rows["acme"]["waiting"]) == (1, 0, 0)
    assert rows["beta"]["used_today"] >= 45  # 3 calls committed, 1 wasted, 15 tokens each
    paused = cli(op_env, "limits", "pause", "k", "--for", "60", "--reason", "provider incident")
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["paused_until"] is not None
    limits = cli(op_env, "limits")
    assert limits.returncode == 0, limits.stderr
    [k] = [r for r in map(json.loads, limits.stdout.splitlines()) if r["key"] == "k"]
    assert (k["source"], k["max_in_flight"]) == ("runtime", 4)
    assert k["pause_reason"].endswith(": provider incident")
    resumed = cli(op_env, "limits", "resume", "k", "--reason", "provider is back")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["paused_until"] is None
    assert acl.acl_log() == [], "a role was denied a command tenants, limits or usage need"


def test_app_lists_resumes_and_cancels_a_parked_session_with_nothing_denied(
    acl: AclRedis,
) -> None:
    """DialogClient.pending, resume (twice) and cancel of a message waiting for a person, as
    `app`: the resume is applied once, nothing is denied (ACL LOG empty), and the app wrote
    neither the state hash nor the message's journal."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    sk = Keys.from_settings(Settings()).session("p1")
    acl.admin.hset(sk.state, mapping={"a": "0", "s": "1", "v": "1", "d": "{}", "w": "m1"})
    record = {"id": "m1:1:1", "n": 1, "msg_id": "m1", "seq": 1, "entry_id": "1-1",
              "payload": '{"ok": "?"}', "at": 1, "timeout_at": 0}  # fmt: skip
    acl.admin.set(sk.awaiting, json.dumps(record))
    acl.admin.hset(sk.journal("m1"), mapping={"o:tool": "1", "b": "7"})

    async def use() -> tuple[list[Any], list[str]]:
        async with DialogClient(settings=settings_for(acl.url("app"))) as c:
            waiting = [p.payload for p in await c.pending("p1")]
            first = await c.resume("p1", "m1:1:1", {"yes": True})
            second = await c.resume("p1", "m1:1:1", False)
            await c.cancel("p1", "m9")
            return waiting, [first.status, second.status]

    assert asyncio.run(use()) == ([{"ok": "?"}], ["resumed", "already_resumed"])
    assert acl.acl_log() == [], "the app was denied a command pending, resume or cancel needs"
    assert acl.admin.hget(sk.state, "w") == "m1"  # the state is the workers' to change
    assert acl.admin.hgetall(sk.journal("m1")) == {"o:tool": "1", "b": "7"}


def test_operator_reads_a_sessions_letters_and_timers_for_the_console_with_nothing_denied(
    acl: AclRedis,
) -> None:
    """The console's session page and its dead-letter list filtered by session, as
    `operator`: the letter index (ZRANGE ... BYSCORE, ZCARD), the stream for older letters and
    the timers hash (HSCAN) are all readable; ACL LOG empty."""
    from dialog_worker.console import reads

    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    plain = Keys.from_settings(Settings())
    old = acl.admin.xadd(plain.dlq, {"session_id": "s1", "text": "old", "error_kind": "e"})
    new = acl.admin.xadd(plain.dlq, {"session_id": "s1", "text": "new", "error_kind": "e"})
    acl.admin.set(plain.letters_since, new)
    acl.admin.zadd(plain.session("s1").letters, {new: int(new.split("-")[0])})
    acl.admin.hset(plain.session("s1").timers, "t:odd", "not msgpack")

    async def read() -> tuple[list[str], list[str]]:
        async with DialogClient(settings=settings_for(acl.url("operator"))) as c:
            flt = reads.LetterFilter(session_id="s1")
            page = await reads.letters_page(c, flt, None, 50, reads.Redactor(frozenset()))
            t = await reads.timeline(c, "s1", reads.Redactor(frozenset()))
            return [r["id"] for r in page.rows], [tm["name"] for tm in t["timers"]]

    assert asyncio.run(read()) == ([old, new], ["odd"])
    assert acl.acl_log() == [], "the operator was denied a command the console needs"


def test_worker_user_gets_noperm_outside_its_job(acl: AclRedis) -> None:
    acl.admin.execute_command("ACL", "LOG", "RESET")
    r = redis.Redis.from_url(acl.url("worker"), decode_responses=True)
    try:
        assert r.ping()
        assert r.xlen("dialog") >= 0  # its own keys work
        for command in [
            ("FLUSHALL",),
            ("FLUSHDB",),
            ("CONFIG", "GET", "maxmemory-policy"),
            ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"),
            ("KEYS", "*"),
            ("EVAL", "return 1", "0"),
            ("GET", "other:key"),
            ("SET", "other:key", "x"),
            ("XADD", "other-stream", "*", "f", "v"),
            ("SCRIPT", "FLUSH"),
            ("SUBSCRIBE", "dialog"),
        ]:
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command(*command)
    finally:
        r.close()
    # Each refusal is in Redis' ACL LOG (so the empty log of the pipeline test means something).
    denied = {(e["username"], e["object"]) for e in acl.acl_log()}
    assert {("worker", "flushall"), ("worker", "keys"), ("worker", "other:key")} <= denied


# Commands each role may or may not run, checked with ACL DRYRUN (nothing is executed).
# Plain-layout names; `sharded_names` maps them to shard 1 of 3.
S = "dialog:{dialog}:s:{sess}"  # a session's key prefix
READY = "dialog:{dialog}:ready"
PREFIX = "dialog:{dialog}:s:"  # the session key prefix the scripts are given
MOVED = "dialog:{dialog}:reshard"  # reshard's progress set of a shard
SHA = "0" * 40
FORBIDDEN_TO_ALL = [
    "FLUSHALL",
    "FLUSHDB",
    "KEYS *",
    "CONFIG GET *",
    "CONFIG SET appendonly no",
    "EVAL return 0",
    "SCRIPT FLUSH",
    "SCRIPT KILL",
    "FUNCTION FLUSH",
    "DEBUG SLEEP 0",
    "SHUTDOWN",
    "ACL LIST",
    "ACL SETUSER x on",
    "MONITOR",
    "MODULE LIST",
    "REPLICAOF NO ONE",
    "SAVE",
    "BGREWRITEAOF",
    "SWAPDB 0 1",
    "CLIENT KILL 127.0.0.1:1",
    "CLIENT LIST",
    "SUBSCRIBE ch",
    "PUBLISH ch x",
    "GET other:key",
    "DEL other:key",
]
ALLOWED_TO_ALL = [
    "PING",
    "HELLO 2",
    "COMMAND",  # redis-py's cluster client reads the command table
    "CLUSTER SLOTS",  # and the slot map
    "CLUSTER SHARDS",
    "READONLY",
    "CLIENT SETNAME dialog",
]
MATRIX: dict[str, list[tuple[str, bool]]] = {
    "worker": [
        (f"EVALSHA {SHA} 5 dialog {READY} {PREFIX} dialog-dlq dialog-replies", True),
        (f"EVALSHA {SHA} 5 dialog {READY} {PREFIX} dialog-replies dialog-dlq", True),
        (f"EVALSHA {SHA} 3 dialog {READY} {PREFIX}", True),
        (f"EVALSHA {SHA} 2 {READY} {PREFIX}", True),
        ("XREADGROUP GROUP dialog-workers c COUNT 1 STREAMS dialog >", True),
        ("XAUTOCLAIM dialog dialog-workers c 1000 0-0", True),
        ("XREAD COUNT 1 BLOCK 1000 STREAMS dialog 0-0", True),
        ("XGROUP CREATE dialog dialog-workers 0 MKSTREAM", True),
        ("XGROUP DELCONSUMER dialog dialog-workers c", True),
        ("XGROUP DESTROY dialog dialog-workers", False),
        ("XGROUP SETID dialog dialog-workers $", False),
        ("XTRIM dialog MAXLEN 0", False),
        (f"ZADD {READY} 1 x", True),
        (f"ZRANGEBYSCORE {READY} -inf 1 LIMIT 0 1", True),
        (f"SET {S}:lock t PX 5000 NX", True),
        (f"PTTL {S}:lock", True),
        (f"PERSIST {S}:state", True),
        (f"HSET {S}:state a 1", True),
        (f"TYPE {READY}", True),
        ("SET dialog:shards 1 NX", True),
        ("XADD dialog-dlq * f v", True),
        ("XADD dialog-other * f v", False),
        ("SET other:lock t", False),
    ],
    "producer": [
        ("XADD dialog * session_id s text t", True),
        ("GET dialog:shards", True),
        ("XINFO GROUPS dialog", True),  # the client's once-per-stream "anyone reading?"
        ("XINFO CONSUMERS dialog dialog-workers", False),
        ("XINFO STREAM dialog", False),  # its first and last entries
        ("SET dialog:shards 2", False),
        ("XRANGE dialog - +", False),
        ("XREADGROUP GROUP dialog-workers c STREAMS dialog >", False),
        ("XLEN dialog", False),
        (f"GET {S}:lock", False),
        (f"SET {S}:lock t", False),
        (f"DEL {S}:state", False),
        (f"HGET {S}:state d", False),
        (f"HSET {S}:state a 9", False),
        (f"HINCRBY {S}:state s 1", False),
        (f"EXPIRE {S}:state 1", False),
        (f"GET {S}:msg:m1", False),
        (f"SET {S}:msg:m1 1", False),
        (f"XADD {S}:msg:m}} * f v", False),
        (f"XADD {S}:state * f v", False),
        (f"EVALSHA {SHA} 1 dialog", False),
        ("SCRIPT LOAD return", False),
        ("XADD dialog-dlq * f v", False),
        ("XADD dialog-replies * f v", False),
        (f"ZADD {READY} 1 x", False),
        (f"ZRANGE {READY} 0 -1", False),
    ],
    "operator": [
        ("XRANGE dialog-dlq - +", True),
        ("XREVRANGE dialog-replies + - COUNT 1", True),
        ("XINFO GROUPS dialog", True),
        ("XINFO CONSUMERS dialog dialog-workers", True),
        (f"HGETALL {S}:state", True),
        (f"ZSCORE {READY} sess", True),
        ("XADD dialog * session_id s text t", True),  # redrive, verify
        ("XDEL dialog-dlq 1-1", True),
        ("DEL dialog-dlq", True),
        (f"DEL {S}:lock", True),
        ("SCAN 0 MATCH dialog:* COUNT 10", True),  # reshard
        (f"DUMP {S}:state", True),
        (f"RESTORE {S}:state 0 x", True),
        (f"DEL {S}:state", True),
        (f"DEL {READY}", True),
        (f"SISMEMBER {MOVED} x", True),  # reshard: WATCH, SISMEMBER, MULTI XADD SADD EXEC
        (f"SADD {MOVED} x", True),
        (f"WATCH {MOVED}", True),
        ("MULTI", True),
        ("EXEC", True),
        (f"EVALSHA {SHA} 2 dialog-dlq {MOVED}", False),  # reshard runs no script
        ("SCRIPT LOAD return", True),  # session reset|delete load the erase script
        ("SET dialog:shards 2", True),
        ("XDEL dialog 1-1", False),
        # session reset|delete: the erase script on one session's keys and its shard's ready
        # set (so these writes are the operator's too; it could RESTORE them already).
        (f"EVALSHA {SHA} 2 {READY} {PREFIX}", True),
        (f"HSET {S}:state a 9", True),
        (f"ZREM {READY} x", True),
        (f"ZADD {READY} 1 x", True),
        ("XDEL dialog-replies 1-1", True),  # delete --purge-replies
        (f"EVALSHA {SHA} 2 dialog {READY}", False),
        (f"SET {S}:lock t", False),
        ("XACK dialog dialog-workers 1-1", False),
        ("XREADGROUP GROUP dialog-workers c STREAMS dialog >", False),
        ("XADD dialog-replies * f v", False),
        (f"EVALSHA {SHA} 3 dialog {READY} {PREFIX}", False),
    ],
    "replies": [
        ("XGROUP CREATE dialog-replies out $ MKSTREAM", True),
        ("XREADGROUP GROUP out c COUNT 1 STREAMS dialog-replies >", True),
        ("XACK dialog-replies out 1-1", True),
        ("XAUTOCLAIM dialog-replies out c 1000 0-0", True),
        ("XREAD COUNT 1 STREAMS dialog-replies 0", True),
        ("XREVRANGE dialog-replies + - COUNT 1", True),
        ("XINFO GROUPS dialog-replies", True),
        ("XPENDING dialog-replies out", True),
        ("XADD dialog-replies * f v", False),
        ("XDEL dialog-replies 1-1", False),
        ("XTRIM dialog-replies MAXLEN 0", False),
        ("XGROUP DESTROY dialog-replies out", False),
        ("DEL dialog-replies", False),
        ("XREAD COUNT 1 STREAMS dialog 0", False),
        ("XREADGROUP GROUP dialog-workers c STREAMS dialog >", False),
        ("XADD dialog * f v", False),
        (f"HGET {S}:state d", False),
        (f"EVALSHA {SHA} 1 dialog-replies", False),
    ],
    # The producer's rights, the reply reader's, and what streaming an answer and cancelling
    # need (see config/redis-acl.conf), nothing more.
    "app": [
        ("XADD dialog * session_id s text t", True),
        ("GET dialog:shards", True),
        ("XINFO GROUPS dialog", True),
        ("XINFO STREAM dialog", False),
        ("XREAD COUNT 1 STREAMS dialog-replies 0", True),
        ("XREVRANGE dialog-replies + - COUNT 1", True),
        ("XREADGROUP GROUP out c COUNT 1 STREAMS dialog-replies >", True),
        ("XACK dialog-replies out 1-1", True),
        ("XADD dialog-replies * f v", False),
        ("XADD dialog-dlq * f v", False),
        ("XRANGE dialog - +", False),
        ("XREAD COUNT 1 STREAMS dialog 0", False),
        # stream / ask_stream: the partial stream, the state's applied seq and history (the end
        # of an answer whose partial text expired), the msg_id's seq
        (f"XRANGE {S}:partial:m1 - + COUNT 64", True),
        (f"XREAD COUNT 64 BLOCK 100 STREAMS {S}:partial:m1 0-0", True),
        (f"HMGET {S}:state a s d", True),
        (f"HGET {S}:state d", True),
        (f"GET {S}:msg:m1", True),
        (f"XADD {S}:partial:m1 * a 1 p 0 k d t forged", False),
        (f"DEL {S}:partial:m1", False),
        (f"HGETALL {S}:state", False),
        (f"HSET {S}:state a 9", False),
        (f"DEL {S}:state", False),
        (f"GET {S}:lock", False),
        (f"SET {S}:lock t", False),
        (f"SET {S}:msg:m1 1", False),
        # cancel: lua/cancel-1.lua (declared: the session key prefix), loaded again after a
        # NOSCRIPT; inside it TYPE, HMGET, HGET, GET, EXISTS, TIME and SET of the cancel mark
        (f"EVALSHA {SHA} 1 {PREFIX}", True),
        ("SCRIPT LOAD return", True),
        (f"TYPE {S}:state", True),
        (f"SET {S}:cancel:m1 1 EX 86400", True),
        (f"EXISTS {S}:cancel:m1", True),
        (f"DEL {S}:cancel:m1", False),
        (f"EVALSHA {SHA} 1 dialog", False),
        (f"EVALSHA {SHA} 3 dialog {READY} {PREFIX}", False),
        (f"EVALSHA {SHA} 2 {S}:lock {S}:partial:m1", False),  # emit-2.lua: the worker's
        # resume / pending: lua/resolve-2.lua (declared: the ready set and the session key
        # prefix) and what it calls on the await key, the interrupts, the ready set, the ages
        # and the kick stream; never the state hash nor a step journal.
        (f"EVALSHA {SHA} 2 {READY} {PREFIX}", True),
        (f"GET {S}:await", True),
        (f"DEL {S}:await", True),
        (f"HSET {S}:interrupts m1:1:1 x", True),
        (f"ZADD {READY} 1 x", True),  # asks the workers to look at a session, nothing more
        (f"LPUSH {READY}:kick 1", True),
        (f"XADD {READY}:kick * k 1", False),
        (f"HSET {S}:journal:m1 o:tool x", False),
        (f"HDEL {S}:state w", False),
        (f"ZREM {READY} x", False),
        (f"ZRANGE {READY} 0 -1", False),
    ],
    "keda": [
        ("XINFO GROUPS dialog", True),
        ("XPENDING dialog dialog-workers", True),
        ("XLEN dialog", True),
        ("XRANGE dialog - +", False),
        ("XADD dialog * f v", False),
        ("XLEN dialog-dlq", False),
        (f"HGET {S}:state d", False),
        (f"XLEN {S}:msg:m}}", False),
    ],
}


def sharded_names() -> dict[str, str]:
    """Plain key name -> the same key of shard 1 of 3 in the sharded layout."""
    plain = Keys.from_settings(Settings())
    sharded = Topology.from_settings(Settings(shards=3)).shards[1]
    names = {getattr(plain, f): getattr(sharded, f) for f in ("stream", "replies", "dlq", "ready")}
    names[PREFIX] = sharded.session_prefix
    names[S] = sharded.session("sess").state.removesuffix(":state")
    names[MOVED] = f"{sharded.prefix}:{{{sharded.tag}}}:reshard"
    return names


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("role", ROLES)
def test_each_role_has_exactly_its_rights(acl: AclRedis, role: str, layout: str) -> None:
    names = sharded_names() if layout == "sharded" else {}
    cases = [(c, False) for c in FORBIDDEN_TO_ALL] + [(c, True) for c in ALLOWED_TO_ALL]
    cases += MATRIX[role]
    wrong = []
    for command, allowed in cases:
        args = [names.get(a, a) for a in command.split()]
        args = [a.replace(S, names[S]) if names and a.startswith(S) else a for a in args]
        args = [a.replace(READY, names[READY]) if names and a == READY else a for a in args]
        if args[0] == "EVAL":
            args = ["EVAL", "return 1", "0"]
        answer = acl.admin.execute_command("ACL", "DRYRUN", role, *args)
        if (answer == "OK") != allowed:
            wrong.append((command, "should be allowed" if allowed else "should be denied", answer))
    assert wrong == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reply_readers_run_as_the_replies_user(acl: AclRedis, layout: str) -> None:
    """DialogClient.replies through a consumer group (create, read, ack, take over what a
    dead reader left) and as a tail, on every shard's reply stream, with nothing denied."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    settings = settings_for(acl.url("replies"), **LAYOUTS[layout])
    streams = [k.replies for k in Topology.from_settings(settings).shards]

    async def read_all() -> tuple[list[str], list[str], list[str]]:
        async with DialogClient(settings=settings) as c:
            async with c.replies(group="out", consumer="dead"):
                pass  # the group exists (at "$") before the events
            ids = [
                acl.admin.xadd(stream, {"session_id": f"s{i}", "msg_id": f"m{i}", "reply": "r"})
                for i, stream in enumerate(streams * 2)
            ]
            # "dead" reads everything and never acknowledges; "heir" takes it over.
            dead = [r.id async for r in c.replies(group="out", consumer="dead", follow=False)]
            heir = []
            async for rep in c.replies(group="out", consumer="heir", claim_idle_ms=1):
                heir.append(rep.id)
                await c.ack(rep)
                if len(heir) == len(ids):
                    break
            tail = [r.id async for r in c.replies(start="0", follow=False)]
            return sorted(ids), sorted(dead), sorted(heir) + sorted(tail)

    ids, dead, rest = asyncio.run(read_all())
    assert dead == ids
    assert rest == ids + ids
    assert all(acl.admin.xpending(s, "out")["pending"] == 0 for s in streams)
    assert acl.acl_log() == [], "the replies user was denied a command it needs"


def test_wrong_password_never_reaches_logs_metrics_or_errors(acl: AclRedis, tmp_path: Path) -> None:
    """Refused credentials cannot heal by retrying: `run` stops with one line, exit 2
    (tests/fault/test_redis_prod.py has the other errors of that kind)."""
    secret = f"wrong-{secrets.token_hex(8)}"
    url = f"redis://worker:{secret}@127.0.0.1:{acl.port}/0"
    refused = cli(worker_env(url, DIALOG_LOG_LEVEL="debug"), "run")
    assert refused.returncode == 2, refused.stderr
    assert "refused the credentials" in refused.stderr
    assert "redis://worker:***@127.0.0.1" in refused.stderr  # the URL is named, redacted
    assert secret not in refused.stderr + refused.stdout
    failed = cli(worker_env(url), "stats")
    assert failed.returncode == 1
    assert "invalid username-password pair" in failed.stderr
    assert secret not in failed.stderr + failed.stdout


# ---------------------------------------------------------------------------------------------
# TLS


def openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


EC_KEY = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"


def make_ca(d: Path, name: str) -> Path:
    openssl(
        d,
        *f"req -x509 {EC_KEY} -keyout {name}.key -out {name}.crt -days 2".split(),
        *"-addext basicConstraints=critical,CA:TRUE".split(),
        *"-addext keyUsage=critical,keyCertSign,cRLSign".split(),
        *("-subj", f"/CN=dialog-worker test {name}"),
    )
    return d / f"{name}.crt"


def make_server_cert(d: Path, ca: str) -> tuple[Path, Path]:
    """A certificate for DNS:localhost only: no IP address SAN, so 127.0.0.1 does not match."""
    (d / "server.ext").write_text(
        "subjectAltName=DNS:localhost\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
    )
    openssl(d, *f"req -new {EC_KEY} -keyout server.key -out server.csr -subj /CN=localhost".split())
    openssl(
        d,
        *f"x509 -req -in server.csr -CA {ca}.crt -CAkey {ca}.key -CAcreateserial".split(),
        *"-out server.crt -days 2 -extfile server.ext".split(),
    )
    return d / "server.crt", d / "server.key"


class TlsRedisServer(RedisServer):
    """TLS only: --port 0 turns the plain port off (it follows the base class's --port)."""

    def __init__(self, workdir: Path, cert: Path, key: Path, ca: Path) -> None:
        port = free_port()
        super().__init__(
            workdir,
            port=port,
            extra=(
                *("--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"),
                *("--tls-cert-file", str(cert), "--tls-key-file", str(key)),
                *("--tls-ca-cert-file", str(ca)),
            ),
        )
        self.ca = ca

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"redis-server exited (built without TLS?): {log}")
        context = ssl.create_default_context(cafile=str(self.ca))
        try:
            with (
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw,
                context.wrap_socket(raw, server_hostname="localhost") as s,
            ):
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False


@dataclass
class Tls:
    server: TlsRedisServer
    ca: Path
    other_ca: Path

    @property
    def port(self) -> int:
        return self.server.port


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificates (apt-get install openssl)")
    d = tmp_path_factory.mktemp("tls")
    ca = make_ca(d, "ca")
    other_ca = make_ca(d, "other-ca")
    cert, key = make_server_cert(d, "ca")
    server = TlsRedisServer(d / "redis", cert, key, ca).start()
    try:
        yield Tls(server, ca, other_ca)
    finally:
        server.stop()


def test_rediss_always_verifies_certificate_and_hostname(tls: Tls) -> None:
    """Set explicitly, whatever the installed redis-py's defaults (before 6.0 redis-py did not
    check the hostname)."""
    client = connect(settings_for(f"rediss://localhost:{tls.port}/0"), 1)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["ssl_cert_reqs"] == "required"
    assert kwargs["ssl_check_hostname"] is True
    assert issubclass(client.connection_pool.connection_class, redis.asyncio.SSLConnection)
    asyncio.run(client.aclose())


def test_tls_worker_and_client_with_the_right_ca(tls: Tls, tmp_path: Path) -> None:
    url = f"rediss://localhost:{tls.port}/0"
    settings = settings_for(url, DIALOG_REDIS_CA_PATH=str(tls.ca))
    pool = WorkerPool(worker_env(url, DIALOG_REDIS_CA_PATH=str(tls.ca)), tmp_path)
    texts = ["nama saya Budi", "saya ada kendala billing"]

    async def send_and_wait() -> dict[str, Any]:
        async with DialogClient(settings=settings) as c:
            session = f"tls-{secrets.token_hex(4)}"
            for text in texts:
                await c.send(session, text)
            deadline = time.monotonic() + 20
            while True:
                state = await c.state(session)
                if state is not None and state["applied_seq"] == len(texts):
                    return state
                assert time.monotonic() < deadline, f"not applied over TLS: {state}"
                await asyncio.sleep(0.05)

    try:
        [w] = pool.start(1, metrics=True)
        state = asyncio.run(send_and_wait())
        assert state["step"] == "COMPLETED" and state["memory"]["userName"] == "Budi"
        assert w.terminate() == 0
    finally:
        pool.stop_all()


@pytest.mark.parametrize(
    ("host", "ca", "why"),
    [
        ("localhost", "other", "CERTIFICATE_VERIFY_FAILED"),  # signed by a CA we do not trust
        ("localhost", "none", "CERTIFICATE_VERIFY_FAILED"),  # system store: not a public CA
        ("127.0.0.1", "right", "mismatch"),  # the certificate names localhost only
    ],
)
def test_tls_refuses_wrong_ca_and_wrong_hostname(tls: Tls, host: str, ca: str, why: str) -> None:
    extra = {"right": {"DIALOG_REDIS_CA_PATH": str(tls.ca)}, "none": {}}.get(
        ca, {"DIALOG_REDIS_CA_PATH": str(tls.other_ca)}
    )
    settings = settings_for(f"rediss://{host}:{tls.port}/0", **extra)

    async def send() -> None:
        async with DialogClient(settings=settings) as c:
            await c.send("tls-refused", "nama saya Budi")

    with pytest.raises(redis.exceptions.ConnectionError) as refused:
        asyncio.run(send())
    assert why in str(refused.value)


def test_plain_redis_url_gets_nothing_from_a_tls_port(tls: Tls) -> None:
    settings = settings_for(f"redis://localhost:{tls.port}/0")

    async def send() -> None:
        async with DialogClient(settings=settings) as c:
            await c.send("tls-plain", "nama saya Budi")

    with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        asyncio.run(send())


def test_tls_failure_never_logs_the_password(tls: Tls, tmp_path: Path) -> None:
    secret = f"tls-{secrets.token_hex(8)}"
    url = f"rediss://worker:{secret}@localhost:{tls.port}/0"
    env = worker_env(url, DIALOG_REDIS_CA_PATH=str(tls.other_ca), DIALOG_LOG_LEVEL="debug")
    pool = WorkerPool(env, tmp_path)
    try:
        [w] = pool.start(1, metrics=True)
        wait_until(lambda: "redis_unavailable" in w.log_text(), 20, what="redis_unavailable")
        metrics = w.metrics_text()
        assert w.terminate() == 0
    finally:
        pool.stop_all()
    log = w.log_text()
    assert secret not in log and secret not in metrics
    assert "rediss://worker:***@localhost" in log  # the URL is logged, redacted
    failed = cli(env, "stats")
    assert failed.returncode == 1
    assert "CERTIFICATE_VERIFY_FAILED" in failed.stderr
    assert secret not in failed.stderr + failed.stdout


def test_missing_ca_file_is_a_configuration_error(tls: Tls, tmp_path: Path) -> None:
    env = worker_env(
        f"rediss://localhost:{tls.port}/0", DIALOG_REDIS_CA_PATH=str(tmp_path / "no-such-ca.pem")
    )
    for args in (["stats"], ["run"]):
        result = cli(env, *args)
        assert result.returncode == 2
        assert "DIALOG_REDIS_CA_PATH" in result.stderr and "file not found" in result.stderr


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_app_user_streams_answers_and_cancels_with_nothing_denied(
    acl: AclRedis, tmp_path: Path, layout: str
) -> None:
    """DialogClient.ask_stream, stream (from a cursor, and after the end) and cancel (of a
    running message, of a finished one, of one not sent yet) as the app user, against a
    streaming worker running as the worker user, in both key layouts: not one command denied.
    What the app may do besides is pinned by test_each_role_has_exactly_its_rights."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    layout_env = LAYOUTS[layout]
    app = settings_for(acl.url("app"), **layout_env)
    pool = WorkerPool(
        worker_env(acl.url("worker"), **layout_env, DIALOG_ENGINE="stream_engines:AsyncWords"),
        tmp_path,
    )
    reply = "".join(f"w{i} " for i in range(30))

    async def as_app() -> dict[str, Any]:
        got: dict[str, Any] = {}
        async with DialogClient(settings=app) as c:
            events = [e async for e in c.ask_stream("acl-st", "30 5", msg_id="m1", timeout=30)]
            got["ask_stream"] = events
            resumed = [e async for e in c.stream("acl-st", "m1", after=events[1].cursor)]
            got["resumed"] = resumed
            # A NOSCRIPT after a Redis restart loads the cancel script again (SCRIPT LOAD).
            acl.admin.script_flush()
            got["early"] = await c.cancel("acl-st", "later")
            stopped: list[Any] = []
            async for event in c.ask_stream("acl-st", "400 20", msg_id="m2", timeout=30):
                stopped.append(event)
                if len(stopped) == 2:
                    got["cancel"] = await c.cancel("acl-st", "m2")
            got["stopped"] = stopped
            got["finished"] = await c.cancel("acl-st", "m2")
            # An interrupting message while a step runs: the worker's intake marks the running
            # one cancelled and moves the shard's cancel count on (INCR, as the worker user).
            cut: list[Any] = []
            async for event in c.ask_stream("acl-st", "400 20", msg_id="m3", timeout=30):
                cut.append(event)
                if len(cut) == 2:
                    await c.send("acl-st", "1 1", msg_id="m4", multitask="interrupt")
            got["cut"] = cut
        return got

    try:
        pool.start(1)
        got = asyncio.run(as_app())
    finally:
        pool.stop_all()
    events = got["ask_stream"]
    assert (events[-1].kind, events[-1].outcome, events[-1].text) == ("end", "applied", reply)
    assert "".join(e.text for e in events[:-1]) == reply
    assert [e.kind for e in got["resumed"]] == [e.kind for e in events[2:]]
    assert got["early"].status == "pending"
    assert got["cancel"].status == "cancelled"
    assert got["stopped"][-1].outcome == "cancelled"
    assert (got["finished"].status, got["finished"].outcome) == ("finished", "cancelled")
    assert got["cut"][-1].outcome == "cancelled"
    assert acl.acl_log() == [], "the app user was denied a command it needs"
