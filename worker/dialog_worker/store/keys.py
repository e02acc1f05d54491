"""Every Redis key name, built in one place.

Each shard of a deployment has one hash tag, and every key of the shard carries it, so every
script touches one Redis Cluster slot:

- Plain layout (standalone Redis, one shard): the inbound stream is the contract's plain name
  (``dialog``) and the tag is that name, so ``dialog:{dialog}:ready`` and the session keys
  ``dialog:{dialog}:s:{<id>}:state`` hash like the stream itself.
- Sharded layout (``DIALOG_REDIS_MODE=cluster`` or ``DIALOG_SHARDS`` > 1): shard ``i`` has its
  own tag ``T_i``: the stream ``dialog:{T_i}``, its reply and dead-letter streams, its ready
  set and the keys of every session that hashes to it. The tags are chosen so that shard ``i``
  lands in the ``i``-th equal range of the 16384 slots, which ``redis-cli --cluster create``
  assigns to different masters.

Session keys are ``<session prefix>{<escaped id>}:<role>``; the scripts derive them from the
prefix the same way (lua/_common.lua). The id is escaped (``%`` ``{`` ``}`` percent-encoded:
injective, and no brace is left inside), so the brace pair after the tag delimits the id and
no two sessions' keys can collide (``a:lock`` vs ``a``, msg ids ending in ``:state``).

Per session: ``state`` (hash: ``d`` state JSON, ``v`` version, ``a`` applied seq, ``s`` last
assigned seq, ``q<seq>`` each sequenced, unapplied message itself: its entry id and fields,
moved there from the stream at intake (codec.unpack_custody reads it), ``n``/``f``/``e``
attempts of the next message, ``g`` when a gap was first seen), ``lock`` (holder token, PX
lease), ``msg:<msg_id>`` (dedupe: the seq given to an explicit msg_id),
``partial:<msg_id>`` (a streamed reply's partial text, dialog_worker/daemon/partial_writer.py) and
``cancel:<msg_id>`` (a cancel mark, kept DIALOG_DEDUPE_TTL_S), ``timers`` (the session's timers)
and ``ids`` (the msg_ids the keys above are named by), ``journal:<msg_id>`` (a message's step
journal), ``await`` (the interrupt the session is parked on) and ``interrupts`` (how each
ended). The state hash also holds ``xc``/``xs``: messages below that seq end cancelled /
superseded in their turn, and ``w`` (the parked message's msg_id) while it waits for a
person.
"""

from __future__ import annotations

import dataclasses
import zlib
from functools import cache

from dialog_worker.config import Settings

SLOTS = 16384
# A session held under a worker lease sits in the ready set at this place plus the worker's
# number (HELD_BASE in lua/_common.lua): past any clock, looked at when that lease lapses.
HELD_PLACE_MS = 10**13
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
    state: str
    lock: str
    dedupe_prefix: str

    def cancel_mark(self, msg_id: str) -> str:
        """A message's cancel mark (lua/cancel-1.lua; cancel_key in lua/_common.lua)."""
        return self.state.removesuffix(":state") + ":cancel:" + msg_id

    def dedupe(self, msg_id: str) -> str:
        return self.dedupe_prefix + msg_id

    @property
    def timers(self) -> str:
        """The session's timers (a hash: ``t:<name>`` -> payload, ``c`` how many a user's
        message cancels; lua/_common.lua, set_timer)."""
        return self.state.removesuffix(":state") + ":timers"

    @property
    def ids(self) -> str:
        """The msg_ids of the session's messages, each until when keys named by it may
        exist (a sorted set; index_msg_id in lua/_common.lua): what delete removes."""
        return self.state.removesuffix(":state") + ":ids"

    @property
    def letters(self) -> str:
        """A sorted set: the session's dead letters (entry id -> its ms), newest 1,000, written
        with each letter and cleaned when it is redriven or purged (LETTERS_KEPT in
        lua/_common.lua); the console's session page reads them through it."""
        return self.state.removesuffix(":state") + ":letters"

    def partial(self, msg_id: str) -> str:
        """The stream of a message's partial reply (dialog_worker/daemon/partial_writer.py)."""
        return self.state.removesuffix(":state") + ":partial:" + msg_id

    def journal(self, msg_id: str) -> str:
        """A hash: the step journal of one message (``o:<name>`` results of ``once``, ``b``
        bytes used, ``w`` attempts that ended awaiting; journal_key in lua/_common.lua),
        deleted by its commit."""
        return self.state.removesuffix(":state") + ":journal:" + msg_id

    def life(self, msg_id: str) -> str:
        """A hash: what one message lived through, one field per attempt (JSON: start, end,
        outcome, waits, model calls, journaled calls), for the console's message page
        (dialog_worker/daemon/message_life.py); kept DIALOG_DEDUPE_TTL_S, deleted with the
        session."""
        return self.state.removesuffix(":state") + ":life:" + msg_id

    @property
    def interrupts(self) -> str:
        """A hash: the ids of the session's interrupts that ended -> how, as JSON (``{"value":
        ...}`` resumed, ``{"timeout": true}``, ``{"ended": "cancelled"}``), kept a day
        (interrupt_ended in lua/_common.lua); the run after a resume reads its value there."""
        return self.state.removesuffix(":state") + ":interrupts"

    @property
    def awaiting(self) -> str:
        """A string: the interrupt the session is parked on (JSON: id, n, msg_id, seq, entry_id,
        payload, at, timeout_at), while it waits for a person (await_key in lua/_common.lua)."""
        return self.state.removesuffix(":state") + ":await"


@dataclasses.dataclass(frozen=True, slots=True)
class Keys:
    """Names for one shard of one deployment."""

    stream: str
    group: str
    replies: str
    dlq: str
    ready: str  # zset: session id -> ms when to look at it (see lua/resume-3.lua)
    session_prefix: str  # "<prefix>:{<tag>}:s:", declared to scripts that derive session keys
    prefix: str
    shard: int = 0
    tag: str = ""

    @classmethod
    def from_settings(cls, settings: Settings, shard: int = 0) -> Keys:
        p = settings.prefix
        if not sharded(settings):
            tag = stream_tag(settings.stream)
            return cls(
                stream=settings.stream,
                group=settings.group,
                replies=settings.reply_stream,
                dlq=settings.dlq_stream,
                ready=f"{p}:{{{tag}}}:ready",
                session_prefix=f"{p}:{{{tag}}}:s:",
                prefix=p,
                tag=tag,
            )
        tag = shard_tag(shard, settings.shards)
        return cls(
            stream=f"{settings.stream}:{{{tag}}}",
            group=settings.group,
            replies=f"{settings.reply_stream}:{{{tag}}}",
            dlq=f"{settings.dlq_stream}:{{{tag}}}",
            ready=f"{p}:{{{tag}}}:ready",
            session_prefix=f"{p}:{{{tag}}}:s:",
            prefix=p,
            shard=shard,
            tag=tag,
        )

    @property
    def inbound(self) -> str:
        """The inbound stream's bookkeeping (a hash, lua/intake-5.lua): ``trimmed`` counts
        unread entries something other than a worker removed; ``ahead`` holds the stream's
        last id while it is far ahead of the clock; ``added``/``length`` are intake's own
        baseline. Derived from the ready set's name in the scripts (inbound_key)."""
        return f"{self.ready}:inbound"

    def msg_sessions(self, quarter: int) -> str:
        """A hash: msg_id (or, without one, entry id) -> the session it was last sequenced
        for, of the messages sequenced in one quarter of DIALOG_DEDUPE_TTL_S (quarter = ms //
        (ttl * 250)), kept five quarters (find_quarter in lua/_common.lua); how the console
        finds a message by its msg_id without a scan."""
        return f"{self.ready}:msgs:{quarter}"

    def sessions_seen(self, bucket: int) -> str:
        """A sorted set (score 0, so ordered by id): the sessions that received a message in
        one bucket of DIALOG_DEDUPE_TTL_S (bucket = ms // (ttl * 1000)), kept two buckets long
        (lua/intake-5.lua); the console's search by session id prefix reads it."""
        return f"{self.ready}:sessions:{bucket}"

    @property
    def letters_since(self) -> str:
        """A string: the first dead letter written into a session's letter index
        (SessionKeys.letters); letters older than it are not indexed."""
        return f"{self.ready}:letters-since"

    @property
    def ages(self) -> str:
        """A sorted set: each session with messages outstanding -> when its next message was
        appended (ms). Its first member is the oldest outstanding message (O(log n)), which
        the inbound stream no longer shows: it holds only unread entries. Derived from the
        ready set's name in the scripts (ages_key)."""
        return f"{self.ready}:ages"

    @property
    def timers(self) -> str:
        """A sorted set: every timer of the shard's sessions ("<session_id>\\n<name>") -> when
        it is due (ms); the payloads are in each session's ``timers`` hash (lua/_common.lua,
        set_timer). Derived from the ready set's name in the scripts (timers_key)."""
        return f"{self.ready}:timers"

    @property
    def cancels(self) -> str:
        """A counter: how many cancel marks were set for messages that may be running (the
        workers' cancel watch reads the marks only when it moved; note_cancel in
        lua/_common.lua)."""
        return f"{self.session_prefix}cancels"

    @property
    def cancel_notes(self) -> str:
        """A stream of at most about 64 entries: one per cancel mark counted in `cancels`, for
        a cancel watch that blocks until one comes (note_cancel in lua/_common.lua)."""
        return f"{self.session_prefix}cancel-notes"

    # The tenants' share of the shard's slots (lua/_common.lua, "Tenants"): the names the
    # scripts derive from the ready set's (runq_key, busy_key, active_key, vt_key, tset_key,
    # tmin_key).
    def tenant_queue(self, tenant: str) -> str:
        """A sorted set: the tenant's sessions waiting for a slot -> their place."""
        return f"{self.ready}:runq:{tenant}"

    def tenant_busy(self, tenant: str) -> str:
        """A sorted set: the tenant's sessions in flight -> when their lease ends (ms)."""
        return f"{self.ready}:busy:{tenant}"

    @property
    def tenants_active(self) -> str:
        """A sorted set: tenants with sessions waiting -> virtual time (the fair order)."""
        return f"{self.ready}:active"

    @property
    def tenants_vt(self) -> str:
        """A hash: tenant -> virtual time; field "\\n": the shard's virtual clock."""
        return f"{self.ready}:vt"

    @property
    def tenants_named(self) -> str:
        """A string with a TTL: present while entries of the shard named a tenant lately (a
        ``tenant`` field other than the default): tenants are then in use (lua/intake-5.lua)."""
        return f"{self.ready}:named"

    @property
    def tenant_settings(self) -> str:
        """A hash: tenant -> "weight min max", the shard's copy of the tenants' settings."""
        return f"{self.ready}:tset"

    @property
    def tenants_guaranteed(self) -> str:
        """A sorted set: tenants with a guaranteed minimum -> that minimum."""
        return f"{self.ready}:tmin"

    @property
    def waiter(self) -> str:
        """Which worker waits for new entries of this shard's stream (a string holding its
        consumer name, with a lease TTL): one blocked reader per shard, not one per worker."""
        return f"{self.ready}:waiter"

    def presence(self, consumer: str) -> str:
        """A string that exists while the worker ``consumer`` runs: set again and again with a
        short TTL, deleted when it stops (dialog_worker/daemon/presence.py). The console tells
        a consumer whose worker is gone from a live one by it."""
        return f"{self.ready}:worker:{consumer}"

    @property
    def wake(self) -> str:
        """A stream of at most one entry: the waiter appends one when it hands its role on,
        and exactly one of the other readers, blocked on it in a consumer group, wakes."""
        return f"{self.ready}:wake"

    @property
    def kick(self) -> str:
        """A list of at most one element: a resume of a parked session (lua/resolve-2.lua) or an
        interrupt's timeout pushes one, and an idle worker's resumer, blocked on it (BLPOP)
        while the ready set is empty, looks at the ready set at once."""
        return f"{self.ready}:kick"

    @property
    def workers(self) -> str:
        """A sorted set: worker leases, each worker's number on the shard -> when its lease
        ends (ms); `<workers>:n` hands the numbers out (lua/lease-2.lua)."""
        return f"{self.ready}:workers"

    @property
    def reshard_moved(self) -> str:
        """The dead letters `reshard` re-added to this shard (lua/reshard-letter-2.lua); a set,
        deleted when the reshard completes."""
        return f"{self.prefix}:{{{self.tag}}}:reshard"

    def usage(self, day: str) -> str:
        """A hash: the shard's committed and wasted model usage of one UTC day (``yyyymmdd``),
        fields ``<tenant>:in|out|cost|calls`` (committed, written by lua/commit-5.lua with the
        replies) and ``<tenant>:win|wout|wcost|wcalls`` (attempts that did not commit); kept
        USAGE_KEEP_DAYS. Derived from the ready set's name in the commit script."""
        return f"{self.ready}:usage:{day}"

    @property
    def tenants(self) -> str:
        """A hash for the whole deployment (not per shard): tenant -> its settings as JSON
        (dialog_worker/store/tenants.py)."""
        return f"{self.prefix}:tenants"

    def limit(self, key: str) -> LimitKeys:
        """The keys of one model-provider limit key, for the whole deployment."""
        return limit_keys(self.prefix, key)

    def budget(self, tenant: str, day: str) -> BudgetKeys:
        """A tenant's token budget meter of one UTC day, for the whole deployment."""
        return budget_keys(self.prefix, tenant, day)

    def session(self, session_id: str) -> SessionKeys:
        base = f"{self.session_prefix}{{{escape_tag(session_id)}}}"
        return SessionKeys(state=f"{base}:state", lock=f"{base}:lock", dedupe_prefix=f"{base}:msg:")


# How long the per-day usage counters are kept (days).
USAGE_KEEP_DAYS = 40


@dataclasses.dataclass(frozen=True, slots=True)
class LimitKeys:
    """A limit key's Redis keys, all under one hash tag (the escaped limit key), so its
    scripts touch one Cluster slot: ``config`` (a hash: the limits set at runtime, the rate
    state, the pause, reservations; lua/acquire-3.lua), ``in_flight`` (a sorted set: call id
    -> when its slot is given back if never settled) and ``reserved`` (a sorted set: call id ->
    the time its reserved turn starts)."""

    config: str
    in_flight: str
    reserved: str


def limit_keys(prefix: str, key: str) -> LimitKeys:
    base = f"{prefix}:limit:{{{escape_tag(key)}}}"
    return LimitKeys(config=base, in_flight=f"{base}:in_flight", reserved=f"{base}:reserved")


def limits_index(prefix: str) -> str:
    """A set of the limit keys set at runtime (`dialog-worker limits set` / pause): what
    `dialog-worker limits` lists besides the settings' own."""
    return f"{prefix}:limits"


@dataclasses.dataclass(frozen=True, slots=True)
class BudgetKeys:
    """A tenant's budget meter of one day (lua/reserve-2.lua, lua/spend-2.lua): ``meter`` (a
    hash: ``spent`` tokens, ``reserved`` tokens of calls in flight, ``r:<call id>`` each one's
    reservation) and ``leases`` (a sorted set: call id -> when its reservation lapses)."""

    meter: str
    leases: str


def budget_keys(prefix: str, tenant: str, day: str) -> BudgetKeys:
    base = f"{prefix}:budget:{{{escape_tag(tenant)}}}:{day}"
    return BudgetKeys(meter=base, leases=f"{base}:leases")


def stream_tag(stream: str) -> str:
    """What Redis hashes of a key named `stream`: its own hash tag if it has one, else all of
    it. Keys tagged with this share the stream's slot."""
    start = stream.find("{")
    if start >= 0:
        end = stream.find("}", start + 1)
        if end > start + 1:
            return stream[start + 1 : end]
    return stream


def shards_key(settings: Settings) -> str:
    """Where the deployment's shard count is recorded (a plain string key)."""
    return f"{settings.prefix}:shards"


def audit_key(settings: Settings) -> str:
    """The console's audit stream: one per deployment, beside the inbound stream's name."""
    return f"{settings.stream}-audit"


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
