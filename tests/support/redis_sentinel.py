"""A Sentinel deployment on 127.0.0.1 for failover tests: one master, one replica, three
`redis-sentinel` processes (quorum 2) watching the master as "mymaster", on free ports."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import redis
from redis_server import RedisServer, free_port, wait_until

MASTER_NAME = "mymaster"


class SentinelSet:
    def __init__(self, workdir: Path, down_after_ms: int = 1000) -> None:
        binary = shutil.which("redis-sentinel")
        if binary is None:
            raise RuntimeError("redis-sentinel is not installed (apt-get install redis-sentinel)")
        self.binary = binary
        self.workdir = workdir
        self.down_after_ms = down_after_ms
        self.master = RedisServer(
            workdir / "master", appendonly=True, extra=("--repl-diskless-sync-delay", "0")
        )
        self.replica: RedisServer | None = None
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}/0"

    def start(self) -> SentinelSet:
        self.master.start()
        self.replica = RedisServer(
            self.workdir / "replica",
            appendonly=True,
            extra=("--replicaof", "127.0.0.1", str(self.master.port)),
        ).start()
        # The replica has its first full copy (a diskless sync waits repl-diskless-sync-delay).
        replica = redis.Redis(port=self.replica.port, decode_responses=True)
        wait_until(
            lambda: replica.info("replication").get("master_link_status") == "up",
            20,
            what="the replica in sync",
        )
        replica.close()
        for i, port in enumerate(self.sentinel_ports):
            d = self.workdir / f"sentinel{i}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER_NAME} 10000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [self.binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        # Every Sentinel knows the replica and the two other Sentinels.
        for port in self.sentinel_ports:
            s = redis.Redis(port=port, decode_responses=True)
            wait_until(
                lambda s=s: (
                    len(s.sentinel_slaves(MASTER_NAME)) == 1
                    and len(s.sentinel_sentinels(MASTER_NAME)) == 2
                ),
                20,
                what=f"sentinel {port} sees the replica and its peers",
            )
            s.close()
        return self

    def master_port(self) -> int:
        """Where the Sentinels say the master is now."""
        s = redis.Redis(port=self.sentinel_ports[0], decode_responses=True)
        try:
            return int(s.sentinel_get_master_addr_by_name(MASTER_NAME)[1])
        finally:
            s.close()

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.send_signal(signal.SIGTERM)
        for proc in self.sentinels:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for server in (self.master, self.replica):
            if server is not None:
                server.stop()
