"""Every Redis key name, built in one place.

Per-session keys carry the session id inside a Redis Cluster hash tag, escaped so that no id
can close the tag early or collide with another session: ``%`` ``{`` ``}`` are percent-encoded,
which is injective and leaves no brace inside the tag. The key's role follows the closing
brace, so ``a:lock`` and ``a`` cannot produce the same key either.
"""

from __future__ import annotations

import dataclasses

from worker.config import Settings

_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})


def escape_tag(session_id: str) -> str:
    return session_id.translate(_ESCAPES)


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
    """Names for one deployment (one stream, one key prefix)."""

    stream: str
    group: str
    replies: str
    dlq: str
    delayed: str  # zset: delayed id -> due time (ms, Redis clock)
    delayed_data: str  # hash: delayed id -> message fields (JSON array of name, value pairs)
    prefix: str

    @classmethod
    def from_settings(cls, settings: Settings) -> Keys:
        p = settings.prefix
        return cls(
            stream=settings.stream,
            group=settings.group,
            replies=settings.reply_stream,
            dlq=settings.dlq_stream,
            delayed=f"{p}:delayed",
            delayed_data=f"{p}:delayed:data",
            prefix=p,
        )

    def session(self, session_id: str) -> SessionKeys:
        base = f"{self.prefix}:s:{{{escape_tag(session_id)}}}"
        return SessionKeys(
            state=f"{base}:state",
            lock=f"{base}:lock",
            parked=f"{base}:parked",
            dedupe_prefix=f"{base}:msg:",
        )
