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

from worker.client import DialogClient
from worker.config import Settings, load_settings
from worker.keys import Keys, Topology
from worker.redis_conn import connect

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ACL_TEMPLATE = REPO / "config" / "redis-acl.conf"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
ROLES = ("worker", "producer", "operator", "keda", "replies")
RENDERED_PATH = "/etc/redis/users.acl"  # where the documented command writes the ACL file


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
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
    every Lua script under the worker's ACL: acquire/commit (with parking and hand-off), retry
    ("boom" fails every time), renew (a step longer than a third of the lock TTL), promote,
    deadletter (an entry without session), delconsumer (an idle consumer owning nothing)."""
    acl.admin.flushall()
    acl.admin.execute_command("ACL", "LOG", "RESET")
    sessions = [f"acl-{i}" for i in range(5)]
    texts = ["nama saya Budi", "pesan 2", "pesan 3", "pesan 4"]
    layout_env = LAYOUTS[layout]
    producer = settings_for(acl.url("producer"), **layout_env)
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
            # An entry that names no session (only a producer with raw XADD could write it).
            await c.redis.xadd(keys.stream, {"text": "no session here", "seq": "1"})

    asyncio.run(produce())  # before any worker: the worker user creates the group from 0
    as_producer = redis.Redis.from_url(acl.url("producer"), decode_responses=True)
    as_operator = redis.Redis.from_url(acl.url("operator"), decode_responses=True)

    def applied(sid: str) -> int:
        state_key = topology.for_session(sid).session(sid).state
        return int(as_producer.hget(state_key, "a") or 0)

    def dead_letters() -> int:
        return sum(int(as_operator.xlen(k.dlq)) for k in topology.shards)

    def all_applied(poison: int, boom: int) -> bool:
        rest = (applied("acl-poison"), applied("acl-boom"), applied("acl-slow"))
        return all(applied(s) == len(texts) for s in sessions) and rest == (poison, boom, 1)

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
        ),
        tmp_path,
    )
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
            async with DialogClient(settings=producer) as c:
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
        assert metric(metrics, "dialog_lease_renewals_total") > 0  # renew-3.lua ran
        assert metric(metrics, "dialog_retries_total") > 0  # retry-5.lua ran

        op_env = worker_env(acl.url("operator"), **layout_env)
        stats = cli(op_env, "stats")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["dlq_length"] == 3
        listed = cli(op_env, "dlq", "list")
        assert listed.returncode == 0, listed.stderr
        dead = {d.get("session_id"): d for d in map(json.loads, listed.stdout.splitlines())}
        assert dead["acl-poison"]["error_kind"] == "permanent"
        assert dead["acl-boom"]["error_kind"] == "exhausted"
        assert None in dead  # the entry without a session
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
        purged = cli(op_env, "dlq", "purge")
        assert purged.returncode == 0, purged.stderr
        assert json.loads(purged.stdout) == {"purged": 3}
        assert dead_letters() == 0

        assert acl.acl_log() == [], "a role was denied a command it needs"
        assert w2.terminate() == 0
    finally:
        pool.stop_all()
        as_producer.close()
        as_operator.close()
    assert acl.passwords["worker"] not in w.log_text() + w2.log_text()


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
S = "dialog:s:{sess}"
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
        (f"EVALSHA {SHA} 1 dialog", True),
        ("XREADGROUP GROUP dialog-workers c COUNT 1 STREAMS dialog >", True),
        ("XAUTOCLAIM dialog dialog-workers c 1000 0-0", True),
        ("XGROUP CREATE dialog dialog-workers 0 MKSTREAM", True),
        ("XGROUP DESTROY dialog dialog-workers", False),
        ("XGROUP SETID dialog dialog-workers $", False),
        ("XTRIM dialog MAXLEN 0", False),
        ("ZADD dialog:delayed 1 x", True),
        (f"SET {S}:lock t PX 5000", True),
        ("XADD dialog-dlq * f v", True),
        ("XADD dialog-other * f v", False),
    ],
    "producer": [
        (f"EVALSHA {SHA} 3 {S}:state {S}:msg:m1 dialog", True),
        (f"HGET {S}:state d", True),
        ("XADD dialog * f v", True),
        ("XRANGE dialog - +", False),
        ("XREADGROUP GROUP dialog-workers c STREAMS dialog >", False),
        (f"GET {S}:lock", False),
        (f"SET {S}:lock t", False),
        (f"DEL {S}:state", False),
        (f"HSET {S}:state a 9", False),
        (f"EVALSHA {SHA} 1 {S}:lock", False),
        ("XADD dialog-dlq * f v", False),
        ("XADD dialog-replies * f v", False),
        ("ZADD dialog:delayed 1 x", False),
    ],
    "operator": [
        ("XRANGE dialog-dlq - +", True),
        ("XREVRANGE dialog-replies + - COUNT 1", True),
        ("XINFO GROUPS dialog", True),
        (f"HGETALL {S}:state", True),
        ("HSCAN dialog:delayed:data 0", True),
        (f"EVALSHA {SHA} 3 {S}:state {S}:msg:m1 dialog", True),
        ("XDEL dialog-dlq 1-1", True),
        ("DEL dialog-dlq", True),
        (f"DEL {S}:lock", True),
        ("XDEL dialog 1-1", False),
        ("DEL dialog", False),
        (f"DEL {S}:state", False),
        (f"HSET {S}:state a 9", False),
        (f"SET {S}:lock t", False),
        ("XADD dialog-dlq * f v", False),
        ("XACK dialog dialog-workers 1-1", False),
        ("XREADGROUP GROUP dialog-workers c STREAMS dialog >", False),
        ("ZREM dialog:delayed x", False),
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
    "keda": [
        ("XINFO GROUPS dialog", True),
        ("XPENDING dialog dialog-workers", True),
        ("XLEN dialog", True),
        ("XRANGE dialog - +", False),
        ("XADD dialog * f v", False),
        ("XLEN dialog-dlq", False),
        (f"HGET {S}:state d", False),
    ],
}


def sharded_names() -> dict[str, str]:
    """Plain key name -> the same key of shard 1 of 3 in the sharded layout."""
    plain = Keys.from_settings(Settings())
    sharded = Topology.from_settings(Settings(shards=3)).shards[1]
    names = {
        getattr(plain, f): getattr(sharded, f)
        for f in ("stream", "replies", "dlq", "delayed", "delayed_data")
    }
    names[S] = sharded.session("sess").state.removesuffix(":state")
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
    secret = f"wrong-{secrets.token_hex(8)}"
    url = f"redis://worker:{secret}@127.0.0.1:{acl.port}/0"
    pool = WorkerPool(worker_env(url, DIALOG_LOG_LEVEL="debug"), tmp_path)
    try:
        [w] = pool.start(1, metrics=True)
        wait_until(lambda: "redis_unavailable" in w.log_text(), 20, what="redis_unavailable")
        metrics = w.metrics_text()
        readyz = w._get("/readyz")
        assert readyz is not None and readyz[0] == 503
        assert w.terminate() == 0
    finally:
        pool.stop_all()
    log = w.log_text()
    assert "AuthenticationError" in log
    assert secret not in log and secret not in metrics
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
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
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
