"""Settings: one typed, frozen object built once at start.

Precedence is command-line flag > environment variable > config file (``config/worker.toml``
or the file named by ``DIALOG_CONFIG``) > built-in default. Every value is validated here, so a
bad one fails at start with one line that names the setting (the CLI exits 2), not minutes later
inside a loop.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import secrets
import socket
import sys
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis.connection

from dialog_worker.errors import ConfigError

DEFAULT_CONFIG_FILE = Path("config/worker.toml")
# An engine's own `fallback_reply` replaces it unless DIALOG_FALLBACK_REPLY is set.
DEFAULT_FALLBACK_REPLY = "Maaf, pesan Anda tidak dapat diproses. Silakan coba lagi nanti."
# What a message over its tenant's or session's token budget is answered; an engine's own
# `budget_reply` replaces it unless DIALOG_BUDGET_REPLY is set.
DEFAULT_BUDGET_REPLY = "Sorry, the daily usage limit has been reached. Please try again tomorrow."
# REDIS_URL=embedded: the redis-server `dialog-worker run` starts for this user alone, listening
# on a socket in its own folder and on no TCP port (a shared machine's 6379 may be anyone's).
EMBEDDED = "embedded"
# The longest socket path the system takes (sun_path: 108 bytes with its terminating zero).
MAX_SOCKET_PATH_BYTES = 107
# Names that default to the stream name plus a suffix unless set explicitly (contract v2 §2).
DERIVED_NAMES = {"group": "-workers", "reply_stream": "-replies", "dlq_stream": "-dlq"}


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    redis_url: str = "redis://localhost:6379/0"
    stream: str = "dialog"
    # "" means derived from the stream (see DERIVED_NAMES): two deployments with different
    # streams on one Redis then never share a group, replies or dead letters.
    group: str = ""
    reply_stream: str = ""
    dlq_stream: str = ""
    # Prefix of every per-session key and of the delayed set; defaults to the stream name so
    # two deployments with different streams on one Redis never share state.
    key_prefix: str = ""
    consumer: str = ""
    concurrency: int = 64
    lock_ttl_ms: int = 5000
    visibility_timeout_ms: int = 30000
    max_attempts: int = 5
    backoff_base_ms: int = 500
    backoff_max_ms: int = 30000
    state_ttl_s: int = 86400
    history_limit: int = 50
    dedupe_ttl_s: int = 86400
    max_message_bytes: int = 65536
    max_state_bytes: int = 1_048_576
    # Most bytes of results one message's step journal keeps (dialog_worker.once; journal-1.lua).
    journal_max_bytes: int = 1_048_576
    step_timeout_s: float = 60.0
    gap_timeout_s: float = 30.0
    reply_maxlen: int = 1_000_000
    fallback_reply: str = DEFAULT_FALLBACK_REPLY
    engine: str = ""
    rules_file: str = ""
    # Loopback: a laptop or a VM does not show its metrics to its network by default (the
    # container image sets 0.0.0.0, where a scraper reaches the container through its network).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 8000
    metrics_sample_interval_s: float = 5.0
    log_level: str = "info"
    log_format: str = "json"
    shutdown_grace_s: float = 25.0
    redis_mode: str = "standalone"
    # What a message does when its session already has one in progress (lua/intake-5.lua).
    multitask: str = "enqueue"
    # multitask=merge: a burst's messages within this window of each other reach one step,
    # which waits at most merge_max_ms from the first (lua/_common.lua, merge_parts).
    merge_window_ms: int = 2000
    merge_max_ms: int = 10000
    # Producer fields copied onto a message's reply events ("channel,chat_id"; docs/replies).
    echo_fields: str = ""
    # Which tenant a message belongs to when it has no tenant field: the first group of this
    # regular expression matched against its session id ("" or no match: the default tenant).
    tenant_pattern: str = ""
    # Model-provider limits per limit key (a JSON object, or a table in the config file):
    # {"openai:gpt-4.1": {"rpm": 500, "tpm": 200000, "max_in_flight": 32}}; `dialog-worker
    # limits set` overrides them at runtime for every worker (dialog_worker/store/limits.py).
    model_limits: str = ""
    # How long a step waits inside `model_call` for its key's turn; a longer wait hands the
    # message back to its turn until then (no attempt spent).
    model_call_max_wait_ms: int = 2000
    # The longest a provider's 429 pauses a limit key, whatever its Retry-After asks (an
    # operator's `limits pause` is not bound by it).
    max_provider_pause_s: float = 600.0
    # Tokens a tenant may use per day (UTC) unless `tenants set --daily-tokens` says otherwise,
    # and a session (0: no budget); over it a message ends budget_exceeded with this reply.
    tenant_daily_tokens: int = 0
    session_daily_tokens: int = 0
    budget_reply: str = DEFAULT_BUDGET_REPLY
    # A message whose turn comes this long after it was appended ends expired (0: never).
    message_ttl_s: float = 0.0
    # After a dead letter: "continue" with the session's next message, or "hold" the session
    # until an operator releases or redrives it (lua/commit-5.lua, lua/hold-3.lua).
    on_dead_letter: str = "continue"
    shards: int = 1
    read_block_ms: int = 1000
    promote_interval_ms: int = 100
    reclaim_interval_ms: int = 5000
    consumer_idle_delete_s: int = 3600
    redis_ca_path: str = ""
    allow_eviction: bool = False
    redis_check_interval_s: float = 60.0

    # `dialog-worker console` (docs/console.md): who may sign in, as "name:token,..." lists;
    # it refuses to start with neither.
    console_host: str = "127.0.0.1"
    console_port: int = 8090
    console_operators: str = ""
    console_viewers: str = ""
    console_redact_fields: str = ""
    console_audit_maxlen: int = 100_000

    # Streamed replies (dialog_worker/daemon/partial_writer.py) and the HTTP gateway
    # (dialog_worker/gateway/).
    partial_ttl_s: int = 600
    partial_maxlen: int = 1000
    partial_flush_ms: int = 40
    partial_flush_chars: int = 512
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    http_token: str = ""
    # Session-scoped tokens for browsers (dialog_worker/client/session_tokens.py), the origins
    # allowed to
    # call the gateway from a page of their own, and a hook for teams that have their users.
    http_signing_key: str = ""
    http_cors_origins: str = ""
    http_authorize: str = ""

    def __post_init__(self) -> None:
        for field, suffix in DERIVED_NAMES.items():
            if not getattr(self, field):
                object.__setattr__(self, field, f"{self.stream}{suffix}")

    @property
    def prefix(self) -> str:
        return self.key_prefix or self.stream

    @property
    def merge_spec(self) -> str:
        """The merged bursts' settings as the scripts take them (merge_spec in _common.lua)."""
        return f"{self.multitask},{self.merge_window_ms},{self.merge_max_ms}"

    @property
    def tenant_lua_pattern(self) -> str:
        """DIALOG_TENANT_PATTERN as the scripts match it ("" for none)."""
        return tenant_pattern_forms(self.tenant_pattern)[0] if self.tenant_pattern else ""

    def redacted_url(self) -> str:
        return redact_url(self.redis_url)

    def replace(self, **overrides: Any) -> Settings:
        """A copy with some values changed, validated like any other source."""
        values = {k: _PARSERS[k](k, v) for k, v in overrides.items() if _known(k)}
        if "stream" in values:
            # A name that was derived from the old stream follows the new one.
            for field, suffix in DERIVED_NAMES.items():
                if field not in values and getattr(self, field) == f"{self.stream}{suffix}":
                    values[field] = ""
        changed = dataclasses.replace(self, **values)
        _check_relations(changed)
        return changed


def _known(field: str) -> bool:
    if field not in _PARSERS:
        raise ConfigError(field, "unknown setting")
    return True


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs and errors: in the user-info part and
    in a ``password=`` query parameter (redis-py reads both)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<redacted: not a URL>" if "@" in url else url
    base, qmark, query = rest.partition("?")
    if "@" in base:
        creds, _, host = base.rpartition("@")
        user = creds.split(":", 1)[0]
        base = f"{user}:***@{host}" if ":" in creds else f"{user}@{host}"
    if qmark:
        params = [
            "password=***" if p.lower().startswith("password=") else p for p in query.split("&")
        ]
        query = "&".join(params)
    return f"{scheme}://{base}{qmark}{query}"


# ---------------------------------------------------------------------------------------------
# Parsing and validation


# What a number setting is written as: plain ASCII digits (a sign, and for a number with a
# fraction a point and an exponent). Python's int() and float() also take "1_000", other
# scripts' digits (Arabic-Indic, full-width) and "inf"; a setting, `limits set` and
# `tenants set` refuse them alike.
_WHOLE_TEXT = re.compile(r"[+-]?[0-9]{1,40}")
_DECIMAL_TEXT = re.compile(
    r"[+-]?([0-9]{1,40}(\.[0-9]{0,40})?|\.[0-9]{1,40})([eE][+-]?[0-9]{1,3})?"
)


def whole_number(raw: object, minimum: int, maximum: int | None = None) -> int:
    """A whole number as every setting takes it (an int, or its plain ASCII digits, spaces
    around allowed), within ``minimum``..``maximum``; else ValueError saying why, in one line
    (the settings' ConfigError and the CLI's usage errors both show it)."""
    written = str(raw).strip() if isinstance(raw, int | str) and not isinstance(raw, bool) else ""
    if not _WHOLE_TEXT.fullmatch(written):
        raise ValueError(f"expected a whole number, got {_shown(raw)}")
    value = int(written)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ValueError(f"must be {bound}, got {value}")
    return value


def decimal_number(raw: object, minimum: float, maximum: float | None = None) -> float:
    """A finite number as every setting takes it (an int or float, or plain ASCII decimal
    text), at least ``minimum`` (and at most ``maximum``); else ValueError saying why."""
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, str) and _DECIMAL_TEXT.fullmatch(raw.strip()):
        value = float(raw.strip())
    else:
        raise ValueError(f"expected a number, got {_shown(raw)}")
    if not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum:g}" if maximum is None else f"between {minimum:g} and {maximum:g}"
        raise ValueError(f"must be a finite number {bound}, got {_shown(raw)}")
    return value


def _shown(raw: object) -> str:
    text = repr(raw)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(minimum: int, maximum: int | None = None) -> Callable[[str, Any], int]:
    def parse(name: str, raw: Any) -> int:
        try:
            return whole_number(raw, minimum, maximum)
        except ValueError as exc:
            raise ConfigError(name, str(exc)) from None

    return parse


def _float(minimum: float, maximum: float | None = None) -> Callable[[str, Any], float]:
    def parse(name: str, raw: Any) -> float:
        try:
            return decimal_number(raw, minimum, maximum)
        except ValueError as exc:
            raise ConfigError(name, str(exc)) from None

    return parse


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def parse(name: str, raw: Any) -> str:
        value = str(raw).strip().lower()
        if value not in choices:
            raise ConfigError(name, f"must be one of {', '.join(choices)}, got {raw!r}")
        return value

    return parse


def _flag(name: str, raw: Any) -> bool:
    value = str(raw).strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no"):
        raise ConfigError(name, f"expected 1 or 0, got {raw!r}")
    return value in ("1", "true", "yes")


def _name(name: str, raw: Any) -> str:
    value = str(raw).strip()
    if not value or any(c.isspace() for c in value):
        raise ConfigError(name, f"must be a non-empty name without spaces, got {raw!r}")
    return value


def _text(name: str, raw: Any) -> str:
    return str(raw)


CONSOLE_TOKEN_MIN_CHARS = 16


def _credentials(name: str, raw: Any) -> str:
    """ "name:token,name:token": names without spaces, colons or commas; tokens of at least
    CONSOLE_TOKEN_MIN_CHARS characters. Messages name the entry, never repeat a token."""
    value = str(raw).strip()
    for position, item in enumerate((i.strip() for i in value.split(",") if i.strip()), 1):
        user, sep, token = item.partition(":")
        if not sep or not user or any(c.isspace() for c in user):
            raise ConfigError(name, f"entry {position} must be name:token (a name without spaces)")
        if len(token) < CONSOLE_TOKEN_MIN_CHARS or any(c.isspace() or c == "," for c in token):
            raise ConfigError(
                name,
                f"the token of {user!r} must be at least {CONSOLE_TOKEN_MIN_CHARS} characters "
                "without spaces",
            )
    return value


def _names(name: str, raw: Any) -> str:
    return ",".join(n.strip() for n in str(raw).split(",") if n.strip())


# Names a reply event gives its own meaning to, and fields the worker reads itself: never echoed.
NOT_ECHOED = frozenset(
    {
        "session_id",
        "msg_id",
        "seq",
        "outcome",
        "reply",
        "produced_at",
        "entry_id",
        "bubbles",
        "no_reply",
        "text",
        "multitask",
        "expires_at",
        "requeues",
        "attempts",
        "enqueued_at",
        "usage",
    }
)
MAX_ECHO_FIELDS = 16


def _echo_fields(name: str, raw: Any) -> str:
    """A comma list of producer field names, each at most once, none the worker's own."""
    names = [n.strip() for n in str(raw).split(",") if n.strip()]
    for field in names:
        if len(field.encode()) > 256 or any(c.isspace() or ord(c) < 32 for c in field):
            raise ConfigError(name, f"{field[:60]!r} is not a field name (no spaces)")
        if field in NOT_ECHOED:
            raise ConfigError(
                name, f"{field!r} is a field the worker uses itself; it cannot be echoed"
            )
    if len(set(names)) != len(names):
        raise ConfigError(name, "a field is listed twice")
    if len(names) > MAX_ECHO_FIELDS:
        raise ConfigError(name, f"at most {MAX_ECHO_FIELDS} fields, got {len(names)}")
    return ",".join(names)


def _tenant_pattern(name: str, raw: Any) -> str:
    """A regular expression of the supported kind (`tenant_pattern_forms`) with one group (it
    names the tenant), or ""."""
    value = str(raw)
    if not value:
        return ""
    try:
        tenant_pattern_forms(value)
    except ValueError as exc:
        raise ConfigError(name, str(exc)) from None
    return value


# DIALOG_TENANT_PATTERN is matched inside the Lua scripts (intake queues a session under its
# tenant) as well as in Python, so it is limited to what both match alike: a sequence of
# single-character atoms (a literal, an escaped punctuation mark, `.`, `\d \w \s \D \W \S`,
# a class `[...]` / `[^...]` of ASCII literals, ranges and those escapes), each optionally
# followed by `*`, `+`, `?`, `*?` or `+?`; one group `( ... )` of such atoms (not quantified);
# `^` first and `$` last. It applies to the session id's UTF-8 bytes: `.` and a negated class
# match one byte. tenant_pattern_forms gives its Lua pattern and an equivalent Python regular
# expression over bytes.
_PATTERN_SPECIAL = set("\\.^$*+?()[]{}|")
_LUA_ESCAPES = {"d": "%d", "D": "%D", "w": "[%w_]", "W": "[^%w_]", "s": "%s", "S": "%S"}
_LUA_CLASS_ESCAPES = {"d": "%d", "w": "%w_", "s": "%s"}
_PY_ESCAPES = {
    "d": "[0-9]",
    "D": "[^0-9]",
    "w": "[0-9A-Za-z_]",
    "W": "[^0-9A-Za-z_]",
    "s": "[ \\t\\n\\r\\f\\v]",
    "S": "[^ \\t\\n\\r\\f\\v]",
}
_PY_CLASS_ESCAPES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def _lua_literal(ch: str) -> str:
    return ch if ch.isalnum() else "%" + ch


def _py_literal(ch: str) -> str:
    return re.escape(ch)


@functools.lru_cache(maxsize=16)
def tenant_pattern_forms(pattern: str) -> tuple[str, bytes]:
    """The Lua pattern and the Python regular expression (over bytes) of a supported
    DIALOG_TENANT_PATTERN; raises ValueError saying what is not supported."""
    if not pattern.isascii() or any(ord(c) < 32 or ord(c) == 127 for c in pattern):
        raise ValueError("must be printable ASCII")
    lua: list[str] = []
    py: list[str] = []
    i, n, groups, in_group, atoms_in_group = 0, len(pattern), 0, False, 0
    if pattern.startswith("^"):
        lua.append("^")
        py.append("^")
        i = 1
    end_anchor = pattern.endswith("$") and not pattern.endswith("\\$")
    if end_anchor:
        n -= 1
    while i < n:
        ch = pattern[i]
        if ch == "(":
            if in_group or groups:
                raise ValueError("may have one group only, not nested")
            if pattern.startswith("(?", i):
                raise ValueError("supports a plain group ( ... ) only")
            in_group, groups, atoms_in_group = True, 1, 0
            lua.append("(")
            py.append("(")
            i += 1
            continue
        if ch == ")":
            if not in_group:
                raise ValueError("has a ) without its (")
            if not atoms_in_group:
                raise ValueError("has an empty group")
            in_group = False
            lua.append(")")
            py.append(")")
            i += 1
            if i < n and pattern[i] in "*+?{":
                raise ValueError("cannot repeat the group (repeat what is inside it)")
            continue
        # One atom.
        if ch == "\\":
            if i + 1 >= n:
                raise ValueError("ends with a lone backslash")
            esc = pattern[i + 1]
            if esc in _LUA_ESCAPES:
                lua_atom, py_atom = _LUA_ESCAPES[esc], _PY_ESCAPES[esc]
            elif not esc.isalnum():
                lua_atom, py_atom = _lua_literal(esc), _py_literal(esc)
            else:
                raise ValueError(f"does not support \\{esc} (\\d \\w \\s \\D \\W \\S only)")
            i += 2
        elif ch == "[":
            j = i + 1
            negate = j < n and pattern[j] == "^"
            if negate:
                j += 1
            lua_items: list[str] = []
            py_items: list[str] = []
            first = True
            while j < n and (pattern[j] != "]" or first):
                first = False
                c = pattern[j]
                if c == "\\":
                    if j + 1 >= n:
                        raise ValueError("ends inside a class")
                    e = pattern[j + 1]
                    if e in _LUA_CLASS_ESCAPES:
                        lua_items.append(_LUA_CLASS_ESCAPES[e])
                        py_items.append(_PY_CLASS_ESCAPES[e])
                    elif not e.isalnum():
                        lua_items.append("%" + e)
                        py_items.append(re.escape(e))
                    else:
                        raise ValueError(f"does not support \\{e} in a class")
                    j += 2
                elif j + 2 < n and pattern[j + 1] == "-" and pattern[j + 2] != "]":
                    lo, hi = c, pattern[j + 2]
                    if not (lo.isalnum() and hi.isalnum()) or lo > hi:
                        raise ValueError(f"has a range {lo}-{hi} that is not a-z, A-Z or 0-9 like")
                    lua_items.append(f"{lo}-{hi}")
                    py_items.append(f"{re.escape(lo)}-{re.escape(hi)}")
                    j += 3
                elif c == "[":
                    raise ValueError("does not support [ inside a class (escape it: \\[)")
                else:
                    lua_items.append(_lua_literal(c))
                    py_items.append(re.escape(c))
                    j += 1
            if j >= n or not lua_items:
                raise ValueError("has a class [ without its ] (or an empty one)")
            hat = "^" if negate else ""
            lua_atom = f"[{hat}{''.join(lua_items)}]"
            py_atom = f"[{hat}{''.join(py_items)}]"
            i = j + 1
        elif ch == ".":
            lua_atom, py_atom = ".", "[\\x00-\\xff]"
            i += 1
        elif ch in _PATTERN_SPECIAL:
            raise ValueError(
                f"does not support {ch!r} here (no alternation, counted repeats or anchors "
                "inside; escape a literal with a backslash)"
            )
        else:
            lua_atom, py_atom = _lua_literal(ch), _py_literal(ch)
            i += 1
        if in_group:
            atoms_in_group += 1
        # Its quantifier, if any.
        quant = ""
        if i < n and pattern[i] in "*+?":
            quant = pattern[i]
            i += 1
            if i < n and pattern[i] == "?":
                if quant == "?":
                    raise ValueError("does not support ?? (lazy optional)")
                quant += "?"
                i += 1
        if i < n and pattern[i] in "*+?{":
            raise ValueError("does not support this repeat (one of * + ? *? +? per atom)")
        lua_quant = {"": "", "*": "*", "+": "+", "?": "?", "*?": "-"}.get(quant)
        lua.append(lua_atom + lua_quant if lua_quant is not None else lua_atom + lua_atom + "-")
        py.append(py_atom + quant)
    if in_group:
        raise ValueError("has a ( without its )")
    if not groups:
        raise ValueError("needs a group, e.g. ^([^:]+): (its group names the tenant)")
    if end_anchor:
        lua.append("$")
        py.append("\\Z")
    return "".join(lua), "".join(py).encode("ascii")


# A limit key names a provider's quota (``openai:gpt-4.1``): shown by the CLI, used in metric
# labels and Redis key names, so it is short text without spaces or control characters.
MAX_LIMIT_KEY_BYTES = 200
LIMIT_FIELDS = ("rpm", "tpm", "max_in_flight")
# A limit above this is a typo (a billion tokens a minute), refused rather than obeyed.
MAX_LIMIT_VALUE = 10**12
# The largest daily token budget (of a tenant or a session): as large as a count kept in Redis.
MAX_TOKENS_A_DAY = 10**12


def limit_key_problem(key: object) -> str | None:
    """Why ``key`` cannot name a limit key, or None."""
    if not isinstance(key, str) or not key:
        return "a limit key is non-empty text"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_LIMIT_KEY_BYTES:
        return f"a limit key is at most {MAX_LIMIT_KEY_BYTES} bytes"
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in key):
        return "a limit key has no spaces or control characters"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "a limit key is UTF-8 text"
    return None


def limit_value(name: str, raw: object) -> int:
    """One of a limit key's rpm / tpm / max_in_flight: a whole number >= 0 (0: no limit)."""
    try:
        return whole_number(raw, 0, MAX_LIMIT_VALUE)
    except ValueError as exc:
        raise ConfigError(name, str(exc)) from None


def parse_model_limits(name: str, raw: Any) -> dict[str, dict[str, int]]:
    """``{"KEY": {"rpm": N, "tpm": N, "max_in_flight": N}, ...}`` from a JSON text or a table;
    a field left out is 0 (no limit)."""
    if isinstance(raw, str):
        if not raw.strip():
            return {}
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(name, f"is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(name, 'must be an object like {"openai:gpt-4.1": {"rpm": 500}}')
    limits: dict[str, dict[str, int]] = {}
    for key, spec in raw.items():
        problem = limit_key_problem(key)
        if problem:
            raise ConfigError(name, f"{str(key)[:60]!r}: {problem}")
        if not isinstance(spec, dict):
            raise ConfigError(name, f"{key!r}: expected an object of {', '.join(LIMIT_FIELDS)}")
        unknown = sorted(str(k) for k in spec if k not in LIMIT_FIELDS)
        if unknown:
            raise ConfigError(
                name, f"{key!r}: unknown field(s) {', '.join(unknown)} ({', '.join(LIMIT_FIELDS)})"
            )
        limits[key] = {f: limit_value(f"{name} {key} {f}", spec.get(f, 0)) for f in LIMIT_FIELDS}
    return limits


def _model_limits(name: str, raw: Any) -> str:
    """Kept as normalized JSON text (the settings are plain values)."""
    return json.dumps(parse_model_limits(name, raw), sort_keys=True) if raw else ""


def _signing_key(name: str, raw: Any) -> str:
    value = str(raw).strip()
    if value and len(value.encode()) < 32:
        # Never echoed: it is a secret.
        raise ConfigError(name, "must be at least 32 bytes (for example: openssl rand -hex 32)")
    return value


def _origins(name: str, raw: Any) -> str:
    """Comma-separated origins (``https://chat.example.com``), or ``*`` for any."""
    items = [o.strip() for o in str(raw).split(",") if o.strip()]
    for origin in items:
        if origin == "*":
            continue
        parts = urllib.parse.urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("",):
            raise ConfigError(
                name, f"{origin[:80]!r} is not an origin (scheme://host[:port], no path), or *"
            )
    return ",".join(items)


def _hook(name: str, raw: Any) -> str:
    value = str(raw).strip()
    if value and (value.count(":") != 1 or not all(value.split(":"))):
        raise ConfigError(name, f"must look like package.module:function, got {value[:80]!r}")
    return value


SENTINEL_SCHEME = "redis+sentinel://"


@dataclasses.dataclass(frozen=True, slots=True)
class SentinelUrl:
    """`redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]`
    `[?sentinel_username=U&sentinel_password=P]`: the Sentinels to ask, the master's name
    (Sentinel's `monitor` name), the database; USER:PASSWORD are for the master, the
    `sentinel_*` options for the Sentinels (when they require AUTH)."""

    sentinels: list[tuple[str, int]]
    master: str
    db: int
    username: str | None
    password: str | None
    sentinel_username: str | None
    sentinel_password: str | None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Raises ValueError with a message that never repeats the URL (it may hold a password)."""
    rest = url[len(SENTINEL_SCHEME) :]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        creds, _, netloc = netloc.rpartition("@")
        user, colon, secret = creds.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    sentinels = []
    for hostport in netloc.split(","):
        host, colon, port = hostport.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                "each Sentinel must be HOST:PORT (redis+sentinel://h1:26379,h2:26379/mymaster/0)"
            )
        sentinels.append((host.strip("[]"), int(port)))
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError(
            "name the master after the Sentinels: redis+sentinel://h1:26379/mymaster[/db]"
        )
    if len(parts) == 2 and not parts[1].isdigit():
        raise ValueError("the database after the master name must be a number")
    options = dict(urllib.parse.parse_qsl(query))
    unknown = set(options) - {"sentinel_username", "sentinel_password"}
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(sorted(unknown))} (sentinel_username, sentinel_password)"
        )
    return SentinelUrl(
        sentinels=sentinels,
        master=urllib.parse.unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
    )


def cluster_startup_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``redis://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/DB][?OPTIONS]``: the URL with its
    first node only (what redis-py parses) and every node, in order (a Cluster client starts
    from whichever answers). Raises ValueError naming what is wrong, never the URL."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    if "?" in netloc:  # no path: the options follow the hosts
        netloc, _, query = netloc.partition("?")
        tail, slash = "?" + query + (slash + tail if slash else ""), ""
    creds, at, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, colon, port = (
            item.rpartition(":") if "]" not in item.rpartition(":")[2] else ("", "", "")
        )
        host = host.strip("[]")
        if not item or not colon or not host:
            raise ValueError("each startup node must be HOST:PORT (a host is missing)")
        if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError("each startup node's port must be a number between 1 and 65535")
        nodes.append((host, int(port)))
    first = hosts.split(",")[0]
    return f"{scheme}{sep}{creds}{at}{first}{slash}{tail}", nodes


def embedded_redis_dir() -> Path:
    """REDIS_URL=embedded: the folder of the user's own redis-server (its data and socket)."""
    return Path.home() / ".local" / "share" / "dialog-worker" / EMBEDDED


def embedded_redis_url() -> str:
    """What REDIS_URL=embedded stands for: the socket of the user's own redis-server."""
    return f"unix://{embedded_redis_dir() / 'redis.sock'}"


def _url(name: str, raw: Any) -> str:
    value = str(raw).strip()
    if value == EMBEDDED:
        socket_path = str(embedded_redis_dir() / "redis.sock")
        if len(socket_path.encode()) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError(
                name,
                f"embedded: its socket path {socket_path} is longer than the "
                f"{MAX_SOCKET_PATH_BYTES} bytes a socket path may have (a shorter HOME works)",
            )
        return embedded_redis_url()
    if (
        value.startswith(("redis://", "rediss://"))
        and "," in value.partition("://")[2].split("/")[0]
    ):
        # Several startup nodes (a Cluster): each is checked, then the URL with the first.
        try:
            first, _ = cluster_startup_nodes(value)
        except ValueError as exc:
            raise ConfigError(name, str(exc)) from None
        _url(name, first)
        return value
    if value.startswith("redis+sentinel://"):
        try:
            parse_sentinel_url(value)
        except ValueError as exc:
            raise ConfigError(name, str(exc)) from None
        return value
    if not value.startswith(("redis://", "rediss://", "unix://")):
        # The value may hold a password: show only the scheme part, if there is one.
        scheme = value.split("://", 1)[0] if "://" in value else "no scheme"
        raise ConfigError(
            name,
            f"must start with redis://, rediss://, unix:// or redis+sentinel://, got {scheme!r}",
        )
    # Found now rather than as a traceback at the first connection. The messages never
    # repeat the value: a mistyped URL can hold a password where the port should be.
    try:
        urllib.parse.urlsplit(value).port  # noqa: B018 (parsing the port is the check)
    except ValueError:
        raise ConfigError(name, "the port must be a number between 0 and 65535") from None
    try:
        redis.connection.parse_url(value)  # type: ignore[no-untyped-call]  # redis-py: untyped
    except ValueError as exc:  # e.g. "Invalid value for 'socket_timeout' in connection URL."
        raise ConfigError(name, str(exc)) from None
    return value


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "redis_url": _url,
    "stream": _name,
    "group": _name,
    "reply_stream": _name,
    "dlq_stream": _name,
    "key_prefix": _text,
    "consumer": _text,
    "concurrency": _int(1, 10_000),
    "lock_ttl_ms": _int(100),
    "visibility_timeout_ms": _int(100),
    "max_attempts": _int(1, 1000),
    "backoff_base_ms": _int(1),
    "backoff_max_ms": _int(1),
    "state_ttl_s": _int(1),
    "history_limit": _int(0),
    "dedupe_ttl_s": _int(1),
    "max_message_bytes": _int(1, 512 * 1024 * 1024),
    "max_state_bytes": _int(1024, 512 * 1024 * 1024),
    "journal_max_bytes": _int(1024, 512 * 1024 * 1024),
    "step_timeout_s": _float(0.001),
    "gap_timeout_s": _float(0.0),
    "reply_maxlen": _int(0),
    "fallback_reply": _text,
    "engine": _text,
    "rules_file": _text,
    "metrics_host": _name,
    "metrics_port": _int(0, 65535),
    "metrics_sample_interval_s": _float(0.05),
    "log_level": _choice("debug", "info", "warning", "error"),
    "log_format": _choice("json", "console"),
    "shutdown_grace_s": _float(0.0),
    "redis_mode": _choice("standalone", "cluster"),
    "multitask": _choice("enqueue", "reject", "interrupt", "coalesce", "merge"),
    "merge_window_ms": _int(1, 3_600_000),
    "merge_max_ms": _int(1, 86_400_000),
    "echo_fields": _echo_fields,
    "tenant_pattern": _tenant_pattern,
    "message_ttl_s": _float(0.0),
    "model_limits": _model_limits,
    "model_call_max_wait_ms": _int(0, 60_000),
    "max_provider_pause_s": _float(1.0, 7 * 86400.0),
    "tenant_daily_tokens": _int(0, MAX_TOKENS_A_DAY),
    "session_daily_tokens": _int(0, MAX_TOKENS_A_DAY),
    "budget_reply": _text,
    "on_dead_letter": _choice("continue", "hold"),
    "shards": _int(1, 16384),
    # Below redis-py's 5 s socket timeout, or a blocked read times out (redis-py #2807).
    "read_block_ms": _int(1, 3999),
    "promote_interval_ms": _int(1),
    "reclaim_interval_ms": _int(10),
    "consumer_idle_delete_s": _int(1),
    "redis_ca_path": _text,
    "allow_eviction": _flag,
    "redis_check_interval_s": _float(1.0),
    "console_host": _name,
    "console_port": _int(0, 65535),
    "console_operators": _credentials,
    "console_viewers": _credentials,
    "console_redact_fields": _names,
    "console_audit_maxlen": _int(1),
    "partial_ttl_s": _int(1),
    "partial_maxlen": _int(10, 1_000_000),
    "partial_flush_ms": _int(0, 10_000),
    "partial_flush_chars": _int(1),
    "http_host": _name,
    "http_port": _int(0, 65535),
    "http_token": _text,
    "http_signing_key": _signing_key,
    "http_cors_origins": _origins,
    "http_authorize": _hook,
}

# Environment names that do not follow the DIALOG_<FIELD> pattern.
_ENV_NAMES = {"redis_url": "REDIS_URL", "redis_ca_path": "DIALOG_REDIS_CA_PATH"}


# DIALOG_* names read elsewhere that are not settings: the config file's path, what a
# supervisor tells its children, a test hook of `reshard`.
OTHER_ENV_NAMES = frozenset({"DIALOG_CONFIG", "DIALOG_SUPERVISOR_PID", "DIALOG_RESHARD_STOP_AFTER"})
_warned_env: set[str] = set()


def env_name(field: str) -> str:
    return _ENV_NAMES.get(field, f"DIALOG_{field.upper()}")


def unknown_env_names(env: Mapping[str, str]) -> list[str]:
    """One line for each ``DIALOG_*`` variable that names no setting (a typo would otherwise
    be ignored without a word, as the config file's unknown keys are not), with the closest
    valid name."""
    valid = {env_name(field) for field in _PARSERS} | OTHER_ENV_NAMES
    lines = []
    for name in sorted(env):
        if name.startswith("DIALOG_") and name not in valid:
            close = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else "see docs/configuration.md"
            lines.append(f"{name} is not a setting and is ignored; {hint}")
    return lines


def client_settings(
    url: str | None, settings: Settings | None, overrides: dict[str, Any]
) -> Settings:
    """What a client's constructor was given, as settings: `settings` (or those of the
    environment and config file when None) with `url` and keyword `overrides` on top."""
    if settings is None:
        return load_settings({"redis_url": url, **overrides})
    if url or overrides:
        return settings.replace(**({"redis_url": url} if url else {}), **overrides)
    return settings


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings; ``overrides`` are command-line values (None means "not given")."""
    env = os.environ if environ is None else environ
    raw: dict[str, tuple[str, Any]] = {}
    # Once per process (clients are built again and again); under a supervisor, which has
    # said it already, not again in each worker process.
    quiet = "DIALOG_SUPERVISOR_PID" in env
    for line in [] if quiet else unknown_env_names(env):
        if line not in _warned_env:
            _warned_env.add(line)
            print(f"dialog-worker: warning: {line}", file=sys.stderr)

    for field, value in _read_config_file(env).items():
        raw[field] = (f"{field} (config file)", value)
    for field in _PARSERS:
        if env_name(field) in env:
            raw[field] = (env_name(field), env[env_name(field)])
    for field, value in (overrides or {}).items():
        if value is not None:
            if field not in _PARSERS:
                raise ConfigError(field, "unknown setting")
            raw[field] = (f"--{field.replace('_', '-')}", value)

    values = {field: _PARSERS[field](label, value) for field, (label, value) in raw.items()}
    if not values.get("consumer"):
        values["consumer"] = default_consumer()
    settings = Settings(**values)
    _check_relations(settings)
    return settings


@functools.cache
def default_consumer() -> str:
    """Unique per process, and stable for its life. Containers on the host network share the
    host's name and often run the worker as pid 1: the random part keeps replicas apart."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def _read_config_file(env: Mapping[str, str]) -> dict[str, Any]:
    named = env.get("DIALOG_CONFIG")
    path = Path(named) if named else DEFAULT_CONFIG_FILE
    if not path.exists():
        if named:
            raise ConfigError("DIALOG_CONFIG", f"file not found: {path}")
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("DIALOG_CONFIG", f"cannot read {path}: {exc}") from None
    table = data.get("worker", data)
    if not isinstance(table, dict):
        raise ConfigError("DIALOG_CONFIG", f"{path}: [worker] must be a table")
    if table is not data and len(data) > 1:
        others = ", ".join(sorted(k for k in data if k != "worker"))
        raise ConfigError("DIALOG_CONFIG", f"{path}: settings outside [worker]: {others}")
    unknown = sorted(set(table) - set(_PARSERS))
    if unknown:
        raise ConfigError("DIALOG_CONFIG", f"{path}: unknown setting(s) {', '.join(unknown)}")
    return dict(table)


def _check_relations(s: Settings) -> None:
    several = "," in s.redis_url.partition("://")[2].split("/")[0]
    if several and s.redis_mode != "cluster" and s.redis_url.startswith(("redis://", "rediss://")):
        raise ConfigError(
            "REDIS_URL",
            "several startup nodes (HOST:PORT,HOST:PORT) are for a Cluster: set "
            "DIALOG_REDIS_MODE=cluster",
        )
    if s.redis_ca_path and s.redis_url.startswith("rediss://"):
        # Fail at start, not with a TLS error at every connection attempt.
        if not Path(s.redis_ca_path).is_file():
            raise ConfigError(env_name("redis_ca_path"), f"file not found: {s.redis_ca_path}")
    if s.merge_max_ms < s.merge_window_ms:
        raise ConfigError(env_name("merge_max_ms"), "must be >= DIALOG_MERGE_WINDOW_MS")
    if s.backoff_max_ms < s.backoff_base_ms:
        raise ConfigError(env_name("backoff_max_ms"), "must be >= DIALOG_BACKOFF_BASE_MS")
    if s.visibility_timeout_ms < s.lock_ttl_ms:
        # A reclaimer must never take an entry whose holder may still hold a live lease.
        raise ConfigError(env_name("visibility_timeout_ms"), "must be >= DIALOG_LOCK_TTL_MS")
    if s.read_block_ms >= 4000:
        # redis-py's socket timeout is 5 s: a longer BLOCK raises a timeout (redis-py #2807).
        raise ConfigError(env_name("read_block_ms"), "must be below 4000")
