"""A real Redis Cluster (3 masters, 3 replicas) the suite starts itself on free ports, so tests
can kill a master, watch a replica take over and bring the old master back as a replica.

Plain test support code: no product imports. Every wait polls against a deadline and, when
the deadline passes, raises `ClusterTimeout` with the tail of the relevant node logs.

Settings worth knowing (all overridable through the constructor):

- `cluster-node-timeout` defaults to 1000 ms: a killed master is flagged FAIL after about one
  second and a replica is promoted roughly one to three seconds after the kill.
- `cluster-replica-validity-factor 0`: a replica is always allowed to fail over, however long
  ago it last heard from its master. Redis's default (10) makes a replica whose link has been
  down for more than ~10 x node-timeout refuse to stand, which with a 1 s node timeout can
  leave a test cluster without a master after a slow machine hiccup or a resync. For a test
  harness deterministic failover matters more than refusing a possibly stale replica; what
  asynchronous replication can lose on failover is the same either way.
- `cluster-allow-reads-when-down no` (the default, set explicitly): a node refuses reads while
  the cluster is down, so a test never reads stale data from a partitioned node.
- `cluster-require-full-coverage yes` (Redis's default): while a master's slots are
  uncovered the whole cluster reports `cluster_state:fail`, which is what `wait_for_failover`
  waits out.
- `appendonly yes`, `appendfsync everysec`, `save ""`, `maxmemory-policy noeviction`.

`kill` is a plain kill -9: whatever its replicas had not received is gone with the master.
`kill_once_replicated` first lets them catch up, for tests of what survives a failover when
Redis itself loses nothing.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis

HASH_SLOTS = 16384
BUS_PORT_OFFSET = 10000
HOST = "127.0.0.1"

T = TypeVar("T")


class ClusterTimeout(TimeoutError):
    """A cluster wait passed its deadline. The message carries the tail of the node logs."""


# --------------------------------------------------------------------------- key slots


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return table


_CRC16_TABLE = _crc16_table()


def crc16(data: bytes) -> int:
    """CRC16-XMODEM (poly 0x1021, init 0), the checksum Redis Cluster hashes keys with."""
    crc = 0
    for b in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16_TABLE[((crc >> 8) ^ b) & 0xFF]
    return crc


def hash_tag(key: bytes) -> bytes:
    """The part of `key` Redis Cluster hashes: the text between the first `{` and the next
    `}` when that text is non-empty, otherwise the whole key."""
    start = key.find(b"{")
    if start != -1:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def slot(key: str | bytes) -> int:
    """The Redis Cluster hash slot of `key` (a str is encoded as UTF-8, like redis-py does)."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return crc16(hash_tag(data)) % HASH_SLOTS


# --------------------------------------------------------------------------- ports


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_cluster_ports(count: int, exclude: Iterable[int] = ()) -> list[int]:
    """`count` distinct ports on 127.0.0.1 where both the port and its cluster bus port
    (port + 10000) bind right now. Ports are drawn below the kernel's ephemeral range (and
    below 55535) where possible, so outgoing connections cannot grab them between this check
    and the server's start; if that window is too small, any port below 55535 is accepted."""
    taken = set(exclude)
    chosen: list[int] = []
    top = min(_ephemeral_low(), 65536) - BUS_PORT_OFFSET  # bus port stays below ephemeral range
    top = min(top, 65535 - BUS_PORT_OFFSET)
    rng = random.Random()
    for _ in range(2000):
        if len(chosen) == count:
            return chosen
        if top > 10000:
            port = rng.randrange(10000, top)
        else:  # tiny non-ephemeral window: ask the kernel, keep what leaves room for the bus
            with socket.socket() as s:
                s.bind((HOST, 0))
                port = int(s.getsockname()[1])
            if port + BUS_PORT_OFFSET > 65535:
                continue
        bus = port + BUS_PORT_OFFSET
        if {port, bus} & taken or port in {c + BUS_PORT_OFFSET for c in chosen}:
            continue
        if _bindable(port) and _bindable(bus):
            chosen.append(port)
            taken.update({port, bus})
    raise RuntimeError(f"could not find {count} free port pairs (port and port+10000)")


# --------------------------------------------------------------------------- waits


def _deadline_wait(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    logs: Callable[[], str],
    interval_s: float = 0.05,
) -> T:
    """Poll `predicate` until truthy. Redis/socket errors count as "not yet". On timeout raise
    ClusterTimeout naming `what`, the last error seen and the log tails from `logs()`."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (redis.RedisError, OSError) as exc:
            last_error = exc
        if time.monotonic() > deadline:
            err = f" (last error: {last_error!r})" if last_error else ""
            raise ClusterTimeout(f"timed out after {timeout_s}s waiting for {what}{err}\n{logs()}")
        time.sleep(interval_s)


# --------------------------------------------------------------------------- nodes


@dataclass
class NodeEntry:
    """One line of `CLUSTER NODES`."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    link_state: str
    slots: list[tuple[int, int]]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})


def parse_cluster_nodes(text: str) -> list[NodeEntry]:
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        addr = parts[1].split("@", 1)[0]  # "ip:port@cport[,hostname]"
        port = int(addr.rsplit(":", 1)[1]) if ":" in addr else 0
        slots: list[tuple[int, int]] = []
        for item in parts[8:]:
            if item.startswith("["):  # migrating/importing marker, not ownership
                continue
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        entries.append(
            NodeEntry(
                node_id=parts[0],
                port=port,
                flags=frozenset(parts[2].split(",")),
                master_id=None if parts[3] == "-" else parts[3],
                link_state=parts[7],
                slots=slots,
            )
        )
    return entries


def _parse_info(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


@dataclass(eq=False)
class ClusterNode:
    """One redis-server process of the cluster. Port and directory stay fixed across
    restarts, so a restarted node finds its nodes.conf and AOF again."""

    index: int
    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    node_id: str | None = None
    _client: redis.Redis | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> redis.Redis:
        """A plain (non-cluster) client for this node: short timeouts, str replies."""
        if self._client is None:
            self._client = redis.Redis(
                host=HOST,
                port=self.port,
                decode_responses=True,
                socket_timeout=1.0,
                socket_connect_timeout=0.5,
            )
        return self._client

    def drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def role(self) -> str | None:
        """Live `ROLE` of the node: "master", "slave", or None when it does not answer."""
        if not self.running:
            return None
        try:
            return str(self.client().execute_command("ROLE")[0])
        except (redis.RedisError, OSError):
            return None

    def cluster_info(self) -> dict[str, str]:
        return _parse_info(self.client().execute_command("CLUSTER", "INFO"))

    def cluster_nodes(self) -> list[NodeEntry]:
        return parse_cluster_nodes(self.client().execute_command("CLUSTER", "NODES"))

    def replication_info(self) -> dict[str, Any]:
        return dict(self.client().info("replication"))

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


# --------------------------------------------------------------------------- the cluster


class RedisCluster:
    """Six redis-server processes (3 masters, 3 replicas) joined by `redis-cli --cluster
    create`. Use as a context manager or call `start()` / `stop()`."""

    def __init__(
        self,
        workdir: Path,
        *,
        masters: int = 3,
        replicas_per_master: int = 1,
        node_timeout_ms: int = 1000,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        replica_validity_factor: int = 0,
        extra: tuple[str, ...] = (),
        start_timeout_s: float = 60.0,
    ) -> None:
        server = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if server is None or cli is None:
            raise RuntimeError(
                "redis-server/redis-cli not installed (apt-get install redis-server)"
            )
        self.server_binary = server
        self.cli_binary = cli
        self.workdir = Path(workdir)
        self.n_masters = masters
        self.replicas_per_master = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.replica_validity_factor = replica_validity_factor
        self.extra = extra
        self.start_timeout_s = start_timeout_s
        self.nodes: list[ClusterNode] = []
        self._first_master_port: int | None = None
        # port -> (node id, replica ports, slot ranges) of every node last seen as a master
        self._master_snapshots: dict[int, tuple[str, list[int], list[tuple[int, int]]]] = {}
        self.start_seconds: float | None = None
        self.last_failover_seconds: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RedisCluster:
        began = time.monotonic()
        total = self.n_masters * (1 + self.replicas_per_master)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            ports = free_cluster_ports(total)
            for i, port in enumerate(ports):
                node_dir = self.workdir / f"node-{i}"
                if node_dir.exists():  # a fresh cluster needs empty nodes.conf / AOF
                    shutil.rmtree(node_dir)
                node_dir.mkdir(parents=True)
                self.nodes.append(ClusterNode(index=i, port=port, dir=node_dir))
            for node in self.nodes:
                self._spawn_with_port_retry(node)
            self._create()
            self.wait_healthy(self.start_timeout_s)
            for node in self.nodes:
                node.node_id = node.client().execute_command("CLUSTER", "MYID")
            masters = self.masters()
            self._first_master_port = masters[0].port
            self._snapshot_masters()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate every node and reap it. Idempotent.

        SIGTERM is re-sent every 0.5 s: Redis refuses a shutdown while it writes its initial
        AOF after a full sync ("Writing initial AOF, can't exit.") and does not retry by
        itself. Whatever still runs after `timeout_s` gets SIGKILL."""
        for node in self.nodes:
            node.drop_client()
        deadline = time.monotonic() + timeout_s
        procs = [n.proc for n in self.nodes if n.proc is not None]
        while True:
            alive = [p for p in procs if p.poll() is None]
            if not alive or time.monotonic() > deadline:
                break
            for proc in alive:
                proc.terminate()
            resend_at = min(deadline, time.monotonic() + 0.5)
            while time.monotonic() < resend_at and any(p.poll() is None for p in alive):
                time.sleep(0.02)
        for node in self.nodes:
            if node.proc is None:
                continue
            if node.proc.poll() is None:
                node.proc.kill()
            node.proc.wait(10)
            node.proc = None

    def _args(self, node: ClusterNode) -> list[str]:
        return [
            self.server_binary,
            "--port",
            str(node.port),
            "--bind",
            HOST,
            "--dir",
            str(node.dir),
            "--logfile",
            str(node.log_path),
            "--daemonize",
            "no",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(node.dir / "nodes.conf"),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--cluster-replica-validity-factor",
            str(self.replica_validity_factor),
            "--cluster-allow-reads-when-down",
            "no",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            # a replica's full sync starts at once instead of after Redis's default 5 s wait
            "--repl-diskless-sync-delay",
            "0",
            *self.extra,
        ]

    def _spawn(self, node: ClusterNode, timeout_s: float = 15.0) -> None:
        node.drop_client()
        node.proc = subprocess.Popen(
            self._args(node), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        def answers() -> bool:
            if node.proc is not None and node.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server on port {node.port} exited with {node.proc.returncode}:\n"
                    f"{node.log_tail()}"
                )
            return bool(node.client().ping())

        _deadline_wait(
            answers, timeout_s, f"redis-server on port {node.port}", lambda: self._logs([node])
        )

    def _spawn_with_port_retry(self, node: ClusterNode, attempts: int = 3) -> None:
        """Start a node of a cluster not yet created; if its port was taken meanwhile, pick
        another pair of ports and try again."""
        for attempt in range(attempts):
            try:
                self._spawn(node)
                return
            except RuntimeError:
                if attempt == attempts - 1 or "in use" not in node.log_tail().lower():
                    raise
                node.proc = None
                others = [n.port for n in self.nodes if n is not node]
                others += [p + BUS_PORT_OFFSET for p in others]
                node.port = free_cluster_ports(1, exclude=others)[0]

    def _create(self) -> None:
        cmd = [
            self.cli_binary,
            "--cluster",
            "create",
            *(n.addr for n in self.nodes),
            "--cluster-replicas",
            str(self.replicas_per_master),
            "--cluster-yes",
        ]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.start_timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterTimeout(
                f"redis-cli --cluster create did not finish in {self.start_timeout_s}s\n"
                f"{exc.stdout!s}\n{self._logs(self.nodes)}"
            ) from exc
        if done.returncode != 0 or "[ERR]" in done.stdout:
            raise RuntimeError(
                f"redis-cli --cluster create failed ({done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-2000:]}\n{self._logs(self.nodes)}"
            )

    # ------------------------------------------------------------------ health

    def _logs(self, nodes: Iterable[ClusterNode], lines: int = 25) -> str:
        parts = []
        for n in nodes:
            state = "running" if n.running else "down"
            parts.append(
                f"--- node {n.index} port {n.port} ({state}) {n.log_path}\n{n.log_tail(lines)}"
            )
        return "\n".join(parts)

    def _node_healthy(self, node: ClusterNode, expected_nodes: int | None) -> bool:
        info = node.cluster_info()
        if info.get("cluster_state") != "ok":
            return False
        if info.get("cluster_slots_assigned") != str(HASH_SLOTS):
            return False
        if info.get("cluster_slots_ok") != str(HASH_SLOTS):
            return False
        if expected_nodes is not None and info.get("cluster_known_nodes") != str(expected_nodes):
            return False
        repl = node.replication_info()
        if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
            return False
        return self._settled(node)

    def _settled(self, node: ClusterNode) -> bool:
        """No AOF rewrite running or scheduled (a replica rewrites its AOF after each full
        sync, and a SIGTERM during that rewrite is refused)."""
        if not self.appendonly:
            return True
        info = node.client().info("persistence")
        return not int(info.get("aof_rewrite_in_progress", 0)) and not int(
            info.get("aof_rewrite_scheduled", 0)
        )

    def _views_agree(self, nodes: list[ClusterNode]) -> bool:
        """Every node in `nodes` has the same `CLUSTER NODES` topology (each node's role, its
        master and its slots), knows every node of the harness, and flags none of the running
        nodes as failing. Right after a change, gossip can leave one node still listing a
        replica as a slot-less master; this waits that out."""
        running_ports = {n.port for n in self.nodes if n.running}
        views = set()
        for node in nodes:
            entries = node.cluster_nodes()
            port_of = {e.node_id: e.port for e in entries}
            if len(entries) != len(self.nodes):
                return False
            topology = []
            for e in entries:
                if e.port in running_ports and e.failed:
                    return False
                master_port = port_of.get(e.master_id) if e.master_id else None
                if not e.is_master and master_port is None:
                    return False
                role = "master" if e.is_master else "slave"
                topology.append((e.port, role, master_port, tuple(e.slots)))
            views.add(tuple(sorted(topology, key=lambda t: t[0])))
        return len(views) == 1

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Wait until every running node reports `cluster_state:ok` with all 16384 slots
        assigned and ok, knows every node, every replica's link to its master is up, and all
        nodes agree on who owns which slot."""
        running = [n for n in self.nodes if n.running]

        def healthy() -> bool:
            return all(self._node_healthy(n, len(self.nodes)) for n in running) and (
                self._views_agree(running)
            )

        _deadline_wait(
            healthy, timeout_s, "cluster_state:ok on every node", lambda: self._logs(running)
        )

    # ------------------------------------------------------------------ topology

    def _view(self) -> list[NodeEntry]:
        """`CLUSTER NODES` as seen by the first running node that answers."""
        last: BaseException | None = None
        for node in self.nodes:
            if not node.running:
                continue
            try:
                return node.cluster_nodes()
            except (redis.RedisError, OSError) as exc:
                last = exc
        raise RuntimeError(f"no cluster node answers CLUSTER NODES (last error: {last!r})")

    def _by_port(self, port: int) -> ClusterNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise KeyError(f"no cluster node on port {port}")

    def _live_entries(self, want_master: bool) -> list[ClusterNode]:
        out = []
        for e in self._view():
            if e.is_master != want_master or e.failed:
                continue
            if want_master and not e.slots:
                continue
            node = self._by_port(e.port)
            if node.running:
                out.append(node)
        return sorted(out, key=lambda n: n.port)

    def masters(self) -> list[ClusterNode]:
        """Running nodes that the live `CLUSTER NODES` lists as masters owning slots."""
        result = self._live_entries(want_master=True)
        self._snapshot_masters()
        return result

    def replicas(self) -> list[ClusterNode]:
        """Running nodes that the live `CLUSTER NODES` lists as replicas."""
        return self._live_entries(want_master=False)

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        entries = self._view()
        mid = master.node_id or next((e.node_id for e in entries if e.port == master.port), None)
        return sorted(
            (self._by_port(e.port) for e in entries if e.master_id == mid and not e.is_master),
            key=lambda n: n.port,
        )

    def _snapshot_masters(self) -> None:
        entries = self._view()
        for e in entries:
            if e.is_master and e.slots and not e.failed:
                replica_ports = [r.port for r in entries if r.master_id == e.node_id]
                self._master_snapshots[e.port] = (e.node_id, replica_ports, list(e.slots))

    def slots_of(self, node: ClusterNode) -> list[tuple[int, int]]:
        for e in self._view():
            if e.port == node.port:
                return list(e.slots)
        return []

    def node_for_slot(self, slot_: int) -> ClusterNode:
        """The master that the live `CLUSTER NODES` says serves `slot_`."""
        if not 0 <= slot_ < HASH_SLOTS:
            raise ValueError(f"slot {slot_} out of range")
        for e in self._view():
            if e.is_master and not e.failed and any(lo <= slot_ <= hi for lo, hi in e.slots):
                return self._by_port(e.port)
        raise LookupError(f"no live master serves slot {slot_}")

    @property
    def url(self) -> str:
        """redis:// URL of the first master at start (of a live master if that one is down)."""
        if self._first_master_port is None:
            raise RuntimeError("cluster not started")
        first = self._by_port(self._first_master_port)
        if first.running:
            return first.url
        for node in self.masters():
            return node.url
        return first.url

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node, for `redis.cluster.ClusterNode` startup lists."""
        return [(HOST, n.port) for n in self.nodes]

    @staticmethod
    def slot(key: str | bytes) -> int:
        return slot(key)

    def keys_per_master(self) -> dict[int, int]:
        """{master port: DBSIZE} for every live master."""
        return {m.port: int(m.client().dbsize()) for m in self.masters()}

    # ------------------------------------------------------------------ faults

    def kill(self, node: ClusterNode) -> None:
        """kill -9: no shutdown, no final fsync. Remembers the node's replicas first (if it
        is a master) so `wait_for_failover` knows which nodes may take over."""
        try:
            self._snapshot_masters()
        except RuntimeError:
            pass
        node.drop_client()
        if node.proc is not None:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(10)
            node.proc = None

    def kill_once_replicated(self, node: ClusterNode, timeout_s: float = 10.0) -> int:
        """kill -9 of a master once its replicas hold every write it acknowledged: writes on
        it are paused (`CLIENT PAUSE WRITE`: clients' writes wait, replication goes on), its
        replicas' processed offsets are awaited up to its own, then it is killed. A write
        still waiting never ran, so its caller gets an error, not a reply. What a failover
        then keeps is all the master acknowledged; what asynchronous replication loses on top
        is left out. Returns the master's replication offset at the kill."""
        client = node.client()
        client.execute_command("CLIENT", "PAUSE", int(timeout_s * 1000) + 60_000, "WRITE")
        offset = int(client.info("replication")["master_repl_offset"])
        replicas = self.replicas_of(node)

        def caught_up() -> bool:
            return all(
                int(r.replication_info().get("slave_repl_offset", -1)) >= offset for r in replicas
            )

        _deadline_wait(
            caught_up,
            timeout_s,
            f"the replicas of port {node.port} at its offset {offset}",
            lambda: self._logs([node, *replicas]),
        )
        self.kill(node)
        return offset

    def restart(self, node: ClusterNode, timeout_s: float = 15.0) -> None:
        """Start `node` again (killing it first if it runs) on the same port and directory;
        it rejoins with its nodes.conf. Returns once it answers PING; `wait_rejoined_as_replica`
        waits for it to be part of a healthy cluster again."""
        if node.running:
            self.kill(node)
        self._spawn(node, timeout_s)

    def pause(self, node: ClusterNode) -> None:
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGSTOP)

    def resume(self, node: ClusterNode) -> None:
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGCONT)

    def wait_for_failover(self, old_master_port: int, timeout: float = 15.0) -> ClusterNode:
        """Poll until a former replica of the master on `old_master_port` is a master owning
        slots and every surviving node reports `cluster_state:ok` (all slots served). Returns
        the promoted node; the elapsed time is in `last_failover_seconds`."""
        began = time.monotonic()
        snap = self._master_snapshots.get(old_master_port)
        if snap is None:
            raise RuntimeError(f"port {old_master_port} was never seen as a master")
        _old_id, replica_ports, _slots = snap
        if not replica_ports:
            raise RuntimeError(f"master on port {old_master_port} had no replica to fail over")
        candidates = [self._by_port(p) for p in replica_ports]
        survivors = [n for n in self.nodes if n.running and n.port != old_master_port]

        def promoted() -> ClusterNode | None:
            winner = None
            for c in candidates:
                if not c.running or c.role != "master":
                    continue
                mine = [e for e in c.cluster_nodes() if "myself" in e.flags]
                if mine and mine[0].slots:
                    winner = c
            if winner is None or not self._views_agree(survivors):
                return None
            for n in survivors:
                info = n.cluster_info()
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(
                    HASH_SLOTS
                ):
                    return None
            return winner

        relevant = [self._by_port(old_master_port), *candidates]
        winner = _deadline_wait(
            promoted,
            timeout,
            f"a replica of port {old_master_port} ({replica_ports}) to take over",
            lambda: (
                self._logs(relevant)
                + "\n"
                + self._logs([n for n in survivors if n not in relevant], 8)
            ),
        )
        self.last_failover_seconds = time.monotonic() - began
        self._snapshot_masters()
        return winner

    def wait_rejoined_as_replica(self, node: ClusterNode, timeout: float = 20.0) -> ClusterNode:
        """Poll until `node` is a replica whose link to its master is up and the whole cluster
        is healthy again. Returns its master."""

        def rejoined() -> ClusterNode | None:
            repl = node.replication_info()
            if repl.get("role") != "slave" or repl.get("master_link_status") != "up":
                return None
            running = [n for n in self.nodes if n.running]
            if not all(self._node_healthy(n, len(self.nodes)) for n in running):
                return None
            if not self._views_agree(running):
                return None
            return self._by_port(int(repl["master_port"]))

        master = _deadline_wait(
            rejoined,
            timeout,
            f"node on port {node.port} to rejoin as a replica",
            lambda: self._logs(self.nodes),
        )
        self._snapshot_masters()
        return master
