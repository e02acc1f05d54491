"""Every Redis key name, built in one place.

Plain layout (standalone Redis, one shard: the contract's names): the stream is ``dialog``
and every per-session key carries the session id inside a Redis Cluster hash tag,
``dialog:s:{<id>}:state``.

Sharded layout (``DIALOG_REDIS_MODE=cluster`` or ``DIALOG_SHARDS`` > 1): shard ``i`` has its
own hash tag ``T_i`` and every key of the shard carries it first: the inbound stream
``dialog:{T_i}``, its reply and dead-letter streams, its delayed set, and the keys of every
session that hashes to it (``dialog:{T_i}:s:{<id>}:state``; the second brace pair is not a
hash tag, it only delimits the id). So each script touches one slot. The tags are chosen so
that shard ``i`` lands in the ``i``-th equal range of the 16384 slots, which ``redis-cli
--cluster create`` assigns to different masters.

In both layouts the id is escaped (``%`` ``{`` ``}`` percent-encoded: injective, and no brace
is left inside), and the key's role follows the closing brace, so no two sessions' keys can
collide (``a:lock`` vs ``a``, ``a}b`` vs ``a``, msg ids ending in ``:state``).
"""

from __future__ import annotations

import dataclasses
import zlib
from functools import cache

from worker.config import Settings

SLOTS = 16384
_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})


def escape_tag(session_id: str) -> str:
    return session_id.translate(_ESCAPES)


def crc16(data: bytes) -> int:
    """CRC16-XMODEM, as Redis Cluster uses for key slots."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key: str) -> int:
    raw = key.encode("utf-8")
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return crc16(raw) % SLOTS


@cache
def shard_tag(shard: int, shards: int) -> str:
    """The first tag ``<shard>.<k>`` whose slot falls in the shard's equal range of slots."""
    low, high = shard * SLOTS // shards, (shard + 1) * SLOTS // shards
    k = 0
    while not low <= crc16(f"{shard}.{k}".encode()) % SLOTS < high:
        k += 1
    return f"{shard}.{k}"


def shard_of(session_id: str, shards: int) -> int:
    """Stable across processes and versions: CRC32 of the UTF-8 id."""
    return zlib.crc32(session_id.encode("utf-8")) % shards if shards > 1 else 0


@dataclasses.dataclass(frozen=True, slots=True)
class SessionKeys:
    state: str  # hash: d (state JSON), v (version), a (applied_seq), s (last seq), ia_* attempts
    lock: str  # string: holder token, PX lease
    parked: str  # hash: seq -> delayed id of a message waiting for its predecessor
    dedupe_prefix: str  # + msg_id: string holding the seq assigned to that msg_id

    def dedupe(self, msg_id: str) -> str:
        return self.dedupe_prefix + msg_id


@dataclasses.dataclass(frozen=True, slots=True)
class Keys:
    """Names for one shard of one deployment."""

    stream: str
    group: str
    replies: str
    dlq: str
    delayed: str  # zset: delayed id -> due time (ms, Redis clock)
    delayed_data: str  # hash: delayed id -> message fields (JSON array of name, value pairs)
    prefix: str
    shard: int = 0
    tag: str = ""  # "" in the plain layout

    @classmethod
    def from_settings(cls, settings: Settings, shard: int = 0) -> Keys:
        p = settings.prefix
        if not sharded(settings):
            return cls(
                stream=settings.stream,
                group=settings.group,
                replies=settings.reply_stream,
                dlq=settings.dlq_stream,
                delayed=f"{p}:delayed",
                delayed_data=f"{p}:delayed:data",
                prefix=p,
            )
        tag = shard_tag(shard, settings.shards)
        return cls(
            stream=f"{settings.stream}:{{{tag}}}",
            group=settings.group,
            replies=f"{settings.reply_stream}:{{{tag}}}",
            dlq=f"{settings.dlq_stream}:{{{tag}}}",
            delayed=f"{p}:{{{tag}}}:delayed",
            delayed_data=f"{p}:{{{tag}}}:delayed:data",
            prefix=p,
            shard=shard,
            tag=tag,
        )

    def session(self, session_id: str) -> SessionKeys:
        tag = f":{{{self.tag}}}" if self.tag else ""
        base = f"{self.prefix}{tag}:s:{{{escape_tag(session_id)}}}"
        return SessionKeys(
            state=f"{base}:state",
            lock=f"{base}:lock",
            parked=f"{base}:parked",
            dedupe_prefix=f"{base}:msg:",
        )


def sharded(settings: Settings) -> bool:
    return settings.redis_mode == "cluster" or settings.shards > 1


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """All shards of a deployment, and which one a session belongs to."""

    shards: tuple[Keys, ...]

    @classmethod
    def from_settings(cls, settings: Settings) -> Topology:
        return cls(tuple(Keys.from_settings(settings, i) for i in range(settings.shards)))

    def for_session(self, session_id: str) -> Keys:
        return self.shards[shard_of(session_id, len(self.shards))]

    def shard(self, index: int) -> Keys:
        if not 0 <= index < len(self.shards):
            raise IndexError(f"shard {index} does not exist (0..{len(self.shards) - 1})")
        return self.shards[index]
