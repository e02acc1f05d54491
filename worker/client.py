"""The producer side: ``DialogClient.send`` and ``DialogClient.state``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from worker.codec import check_id, check_text
from worker.config import Settings, load_settings
from worker.keys import Keys, Topology
from worker.redis_conn import connect, prepare
from worker.scripts import Scripts


@dataclasses.dataclass(frozen=True, slots=True)
class SendResult:
    session_id: str
    msg_id: str
    seq: int
    duplicate: bool

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
        self._scripts = Scripts.register(self.redis)
        self._prepared = False

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

    async def send(self, session_id: str, text: str, msg_id: str | None = None) -> SendResult:
        """Enqueue one message. Raises ``ValidationError`` before touching Redis if the
        session id, message id or text is refused. A ``msg_id`` seen inside the dedupe window
        enqueues nothing and returns the original seq with ``duplicate=True``."""
        check_id("session_id", session_id)
        msg_id = check_id("msg_id", msg_id) if msg_id is not None else uuid.uuid4().hex
        check_text(text, self.settings.max_message_bytes)
        keys = self.keys_for(session_id)
        sk = keys.session(session_id)
        with self._cluster_errors("send"):
            await self._prepare()
            raw = await self._scripts.send(
                keys=[sk.state, sk.dedupe(msg_id), keys.stream],
                args=[
                    session_id,
                    msg_id,
                    text,
                    self.settings.dedupe_ttl_s,
                    self.settings.state_ttl_s,
                ],
            )
        return SendResult(session_id, msg_id, int(raw[0]), bool(int(raw[1])))

    async def state(self, session_id: str) -> dict[str, Any] | None:
        check_id("session_id", session_id)
        with self._cluster_errors("state"):
            await self._prepare()
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
        if not self._prepared:
            await prepare(self.redis)
            self._prepared = True

    def keys_for(self, session_id: str) -> Keys:
        """The shard a session belongs to (the only one in the plain layout)."""
        return self.topology.for_session(session_id)
