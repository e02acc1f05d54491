"""The application's side: ``DialogClient.send`` (one plain XADD) and ``DialogClient.state``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from worker.codec import MAX_EXTRA_FIELDS, RESERVED_FIELDS, check_id, check_meta, check_text
from worker.config import Settings, load_settings
from worker.errors import ValidationError
from worker.keys import Keys, Topology
from worker.redis_conn import check_topology, connect, prepare


@dataclasses.dataclass(frozen=True, slots=True)
class SendResult:
    session_id: str
    msg_id: str  # the given one, or the entry id when none was given
    entry_id: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DialogClient:
    """Sends messages and reads session state.

    Reads the same settings as the worker from the environment when constructed; keyword
    arguments override them (``DialogClient(url, stream="other")``). Safe to share between
    hundreds of coroutines: the pool blocks for a free connection instead of failing.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: Settings | None = None,
        max_connections: int = 64,
        **overrides: Any,
    ) -> None:
        if settings is None:
            settings = load_settings({"redis_url": url, **overrides})
        elif url or overrides:
            settings = settings.replace(**({"redis_url": url} if url else {}), **overrides)
        self.settings = settings
        self.topology = Topology.from_settings(settings)
        # The first (in the plain layout, the only) shard's names, for callers that do not
        # shard; anything per session goes through `keys_for`.
        self.keys: Keys = self.topology.shards[0]
        self.redis: Redis = connect(settings, max_connections)
        self._prepared = False
        self._checked = False

    async def __aenter__(self) -> DialogClient:
        await self._prepare()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def send(
        self,
        session_id: str,
        text: str,
        msg_id: str | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> SendResult:
        """Enqueue one message: one plain XADD to the session's stream (its shard's in a
        sharded deployment), what any producer in any language does. Raises
        ``ValidationError`` before touching Redis if the session id, message id, text or
        extra fields are refused. A ``msg_id`` already seen inside the dedupe window is
        answered by the workers with a ``duplicate`` reply event."""
        check_id("session_id", session_id)
        if msg_id is not None:
            check_id("msg_id", msg_id)
        check_text(text, self.settings.max_message_bytes)
        fields: dict[str, str] = {"session_id": session_id, "text": text}
        if msg_id is not None:
            fields["msg_id"] = msg_id
        for name, value in (meta or {}).items():
            if name in RESERVED_FIELDS:
                raise ValidationError(f"meta field {name!r} is reserved")
            fields[name] = check_meta(name, value)
        if len(fields) - 2 - (msg_id is not None) > MAX_EXTRA_FIELDS:
            raise ValidationError(f"at most {MAX_EXTRA_FIELDS} meta fields are allowed")
        size = sum(len(k.encode()) + len(v.encode()) for k, v in fields.items())
        if size > self.settings.max_message_bytes:
            raise ValidationError(
                f"text and fields are {size} bytes in all; at most "
                f"{self.settings.max_message_bytes} are allowed (DIALOG_MAX_MESSAGE_BYTES)"
            )
        with self._cluster_errors("send"):
            await self._ready()
            entry_id = await self.redis.xadd(self.keys_for(session_id).stream, fields)  # type: ignore[arg-type]
        entry = str(entry_id)
        return SendResult(session_id, msg_id if msg_id is not None else entry, entry)

    async def state(self, session_id: str) -> dict[str, Any] | None:
        check_id("session_id", session_id)
        with self._cluster_errors("state"):
            await self._ready()
            doc = await self.redis.hget(self.keys_for(session_id).session(session_id).state, "d")
        return None if doc is None else json.loads(doc)

    @contextlib.contextmanager
    def _cluster_errors(self, operation: str) -> Iterator[None]:
        """During a failover redis-py's cluster client raises RedisClusterException (not a
        RedisError) while no node it knows answers, and, in 8.1, sometimes an AttributeError
        from a connection torn down mid-write. Both mean "not done, try again": callers get
        the one error type that says so (a send is retried with the same msg_id)."""
        try:
            yield
        except (RedisClusterException, AttributeError) as exc:
            if self.settings.redis_mode != "cluster":
                raise
            raise RedisConnectionError(f"cluster unavailable during {operation}: {exc}") from exc

    async def _prepare(self) -> None:
        """Learn the cluster's slot map (no-op standalone), then, before the first command
        that needs it, check the deployment's shard count (a client configured otherwise
        would send sessions to the wrong streams)."""
        if not self._prepared:
            await prepare(self.redis)
            self._prepared = True

    async def _ready(self) -> None:
        await self._prepare()
        if not self._checked:
            await check_topology(self.redis, self.settings, record=False)
            self._checked = True

    def keys_for(self, session_id: str) -> Keys:
        """The shard a session belongs to (the only one in the plain layout)."""
        return self.topology.for_session(session_id)
