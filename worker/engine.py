"""The dialog engine: state and message in, new state and reply out.

The worker may run a step again for the same message after a crash or a lost lock, so a step
should depend only on its inputs and never change them. The user's guide is docs/engine.md.

Two kinds of engine exist. The built-in `RuleEngine` reads an ELIZA-style rule file (the
format is documented in `config/rules.toml`). A deployment can replace it with its own object
through `DIALOG_ENGINE=package.module:attr`; `load_engine` checks that object once at start,
`startup_engine` / `shutdown_engine` run its optional hooks, and `run_step` runs every step
(``async def`` on the event loop, plain ``def`` in a worker thread) and checks its result, so a
broken plugin fails loudly and in one place.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import os
import re
import sys
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import anyio
import anyio.to_thread
import structlog

from dialog_worker.errors import ConfigError, EngineHookError, PermanentError

StepResult = tuple[dict[str, Any], str]

INITIAL_STEP = "ROOT"
RULES_SETTING = "DIALOG_RULES_FILE"
ENGINE_SETTING = "DIALOG_ENGINE"
# Fields of the state the worker sets after every step; the engine's values are overwritten.
WORKER_OWNED = ("session_id", "history", "applied_seq", "version")

# An installed wheel carries config/rules.toml as dialog_worker/defaults/rules.toml (see
# pyproject.toml); a source checkout only has the original, so look for both.
_PACKAGED_RULES = Path(__file__).resolve().parent / "defaults" / "rules.toml"
_CHECKOUT_RULES = Path(__file__).resolve().parent.parent / "config" / "rules.toml"

log = structlog.get_logger("dialog_worker.engine")


class Engine(Protocol):
    """What drives a dialog: one ``step`` per message (docs/engine.md).

    ``step(state, message) -> (new_state, reply)`` may be ``async def`` (it runs on the event
    loop: never block in it) or a plain ``def`` (it runs in a worker thread). The state is
    ``{"session_id", "step", "memory", "history", "applied_seq", "version"}``; the engine owns
    ``step`` (a string) and ``memory`` (any JSON value). The message is ``{"session_id",
    "msg_id", "seq", "text", "entry_id", "enqueued_at", "attempt", "meta"}``.

    Optional, not part of the protocol's type: ``async def startup(self)`` before the first
    step (open HTTP clients, pools) and ``async def shutdown(self)`` after the last one.
    """

    def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> StepResult | Awaitable[StepResult]: ...


def initial_state(session_id: str) -> dict[str, Any]:
    """The state of a session that has never been seen."""
    return {
        "session_id": session_id,
        "step": INITIAL_STEP,
        "memory": {},
        "history": [],
        "applied_seq": 0,
        "version": 0,
    }


async def run_step(
    engine: Engine,
    state: dict[str, Any],
    message: dict[str, Any],
    *,
    limiter: anyio.CapacityLimiter | None = None,
) -> StepResult:
    """Run one step of any engine and check what it returns.

    An ``async def`` step is awaited on the event loop. A plain ``def`` step runs in a worker
    thread (``limiter`` bounds how many at once; size it to the worker's concurrency), so a
    slow or blocking step never stops the loop that renews the session's lease. A cancelled
    thread step is abandoned: the caller moves on at once, the thread finishes on its own.

    The inputs are deep-copied first so that a plugin which mutates its arguments cannot
    corrupt the caller's copy, which is what the worker retries from. A result of the wrong
    shape would fail again on every delivery, so it is a `PermanentError` (dead-letter now)
    rather than a retryable failure. Errors raised by the engine itself pass through: their
    class already says whether to retry.
    """
    if isinstance(engine, RuleEngine):
        # Our own engine never mutates its inputs (tested) and takes microseconds (compiled
        # patterns, bounded text), so it runs inline: a thread hop would cost it ~50x.
        result: object = engine.step(state, message)
    elif _is_async(engine.step):
        result = engine.step(copy.deepcopy(state), copy.deepcopy(message))  # awaited below
    else:
        result = await anyio.to_thread.run_sync(
            _copied_step, engine.step, state, message, limiter=limiter, abandon_on_cancel=True
        )
    if inspect.isawaitable(result):
        # An async step's coroutine, or a plain def that returned one (a wrapper): on the loop.
        result = await result
    return _checked(
        type(engine).__qualname__, result, validate_json=not isinstance(engine, RuleEngine)
    )


def _copied_step(
    step: Callable[[dict[str, Any], dict[str, Any]], object],
    state: dict[str, Any],
    message: dict[str, Any],
) -> object:
    """In the worker thread: the copies cost the loop nothing there."""
    return step(copy.deepcopy(state), copy.deepcopy(message))


def _is_async(step: object) -> bool:
    if inspect.iscoroutinefunction(step):
        return True
    call = getattr(step, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    return call is not None and inspect.iscoroutinefunction(call)


def _checked(engine_name: str, result: object, validate_json: bool) -> StepResult:
    where = f"engine {engine_name}.step returned"
    if not (isinstance(result, tuple) and len(result) == 2):
        raise PermanentError(f"{where} {_describe(result)}, expected (state, reply)")
    new_state, reply = cast(tuple[object, object], result)
    if not isinstance(new_state, dict):
        raise PermanentError(f"{where} state {_describe(new_state)}, expected a dict")
    if not isinstance(reply, str):
        raise PermanentError(f"{where} reply {_describe(reply)}, expected a string")
    if not isinstance(new_state.get("step"), str):
        raise PermanentError(
            f"{where} state whose step is {_describe(new_state.get('step'))}, expected a string"
        )
    if "memory" not in new_state:
        raise PermanentError(f"{where} state without memory (keep it, even if empty)")
    if validate_json:
        # What the worker stores must read back the same, from any language: no sets, bytes,
        # objects, NaN or infinities. The worker-owned fields are replaced after the step.
        owned = {k: v for k, v in new_state.items() if k not in WORKER_OWNED}
        try:
            json.dumps(owned, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise PermanentError(f"{where} state that is not JSON: {exc}") from None
    return cast(dict[str, Any], new_state), reply


async def startup_engine(engine: Engine) -> None:
    """Call the engine's optional ``startup()`` (async, or plain def in a thread) before
    the first step. A failure is an `EngineHookError`: the worker should not take messages
    it cannot serve."""
    try:
        await _call_hook(engine, "startup")
    except Exception as exc:
        raise EngineHookError(
            f"engine {type(engine).__qualname__}.startup() raised {_one_line(exc)}"
        ) from exc


async def shutdown_engine(engine: Engine) -> None:
    """Call the engine's optional ``shutdown()`` after the last step. A failure is logged
    with its traceback and swallowed: shutting down goes on."""
    try:
        await _call_hook(engine, "shutdown")
    except Exception:
        log.exception("engine_shutdown_failed", engine=type(engine).__qualname__)


async def _call_hook(engine: Engine, name: str) -> None:
    hook = getattr(engine, name, None)
    if hook is None:
        return
    if not callable(hook):
        raise TypeError(f"{name} is {_describe(hook)}, not a method")
    if _is_async(hook):
        await hook()
        return
    result = await anyio.to_thread.run_sync(hook)
    if inspect.isawaitable(result):
        await result


def load_engine(spec: str | None, rules_path: str | None = None) -> Engine:
    """Build the engine named by `DIALOG_ENGINE`, or the built-in rules when it is unset.

    ``module:attr`` names an engine object (anything with a ``step``) or a zero-argument
    factory that returns one (a class, or a function). Every failure becomes a
    `ConfigError` so that a typo in the setting stops the worker at start with one line,
    instead of dead-lettering every message later.
    """
    if spec is None or not spec.strip():
        return load_rules(rules_path)
    spec = spec.strip()
    found = _ENGINE_SPEC.fullmatch(spec)
    if found is None:
        raise ConfigError(ENGINE_SETTING, f"{spec!r} is not of the form package.module:attr")
    module_name, attr_path = found["module"], found["attr"]
    target: Any = _import_engine_module(module_name)
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ConfigError(
                ENGINE_SETTING, f"module {module_name!r} has no attribute {attr_path!r}"
            ) from exc
    if not isinstance(target, type) and callable(getattr(target, "step", None)):
        return cast(Engine, target)  # an engine object
    if not callable(target):
        raise ConfigError(
            ENGINE_SETTING,
            f"{spec!r} is {_describe(target)}: name an object with a step(state, message) "
            "method or a factory that takes no arguments",
        )
    needed = _required_parameters(target)
    if needed:
        raise ConfigError(
            ENGINE_SETTING,
            f"factory {spec!r} needs argument(s) {', '.join(needed)}; a factory must take none "
            "(read your own settings from the environment inside it)",
        )
    if inspect.iscoroutinefunction(target):
        raise ConfigError(
            ENGINE_SETTING,
            f"factory {spec!r} is async; make it a plain def and do async set-up in the "
            "engine's async startup()",
        )
    try:
        engine: object = target()
    except Exception as exc:  # the factory is foreign code; report whatever it raised
        raise ConfigError(ENGINE_SETTING, f"factory {spec!r} raised {_one_line(exc)}") from exc
    if not callable(getattr(engine, "step", None)):
        raise ConfigError(
            ENGINE_SETTING,
            f"factory {spec!r} returned {_describe(engine)} without a callable "
            "step(state, message)",
        )
    return cast(Engine, engine)


def _import_engine_module(module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                ENGINE_SETTING,
                f"cannot import module {module_name!r}: it is not on the Python path "
                f"(working directory {os.getcwd()}); install its package "
                "(pip install -e <project>) or add the folder that holds it to PYTHONPATH",
            ) from exc
        raise ConfigError(
            ENGINE_SETTING,
            f"module {module_name!r} imports {missing!r}, which is not installed "
            f"(install it into this Python: {sys.executable} -m pip install ...)",
        ) from exc
    except Exception as exc:  # any import-time failure of a plugin is a configuration problem
        raise ConfigError(
            ENGINE_SETTING, f"importing module {module_name!r} raised {_one_line(exc)}"
        ) from exc


def _required_parameters(factory: Callable[..., object]) -> list[str]:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: let the call decide
        return []
    return [
        name
        for name, p in signature.parameters.items()
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def load_rules(path: str | os.PathLike[str] | None = None) -> RuleEngine:
    """Read and validate a rule file; None (or "") means the default rules.

    Validation happens here, once, so that a bad rule file stops the worker at start rather
    than surfacing as a failed message in the middle of a conversation.
    """
    rules_path = _default_rules_path() if path is None or path == "" else Path(path)
    try:
        with rules_path.open("rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(
            RULES_SETTING, f"cannot read {rules_path}: {exc.strerror or exc}"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(RULES_SETTING, f"{rules_path}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(RULES_SETTING, f"{rules_path}: not UTF-8: {exc}") from exc
    try:
        return _build_engine(document, source=str(rules_path))
    except _RuleFileError as exc:
        raise ConfigError(RULES_SETTING, f"{rules_path}: {exc}") from None


class RuleEngine:
    """ELIZA-style engine: the first matching rule, by rank then file order, decides the turn.

    It owns only `step` and `memory`. Every other field of the state (history, applied_seq,
    version, session_id, and anything a newer worker adds) is copied through untouched,
    because the worker sets those itself after the step.
    """

    __slots__ = ("_fallback", "_rules", "source")

    def __init__(self, rules: Sequence[_Rule], fallback: _Replies, source: str) -> None:
        # sorted() is stable, so rules of equal rank keep their order in the file.
        self._rules = tuple(sorted(rules, key=lambda rule: -rule.rank))
        self._fallback = fallback
        self.source = source

    def __repr__(self) -> str:
        return f"RuleEngine(source={self.source!r}, rules={len(self._rules)})"

    @property
    def rule_names(self) -> tuple[str, ...]:
        """Rule names in the order they are tried, for logs and tests."""
        return tuple(rule.name for rule in self._rules)

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> StepResult:
        """Apply the first rule that fits; the inputs are never modified."""
        text = message.get("text")
        if not isinstance(text, str):
            raise PermanentError(f"message text must be a string, got {_describe(text)}")
        current = state.get("step", INITIAL_STEP)
        if not isinstance(current, str):
            raise PermanentError(f"state step must be a string, got {_describe(current)}")
        memory = state.get("memory") or {}
        if not isinstance(memory, dict):
            raise PermanentError(f"state memory must be a dict, got {_describe(memory)}")

        # Fresh containers for what a caller may change (memory holds only strings, history
        # turns are never edited in place), without the cost of a deep copy on the hot path.
        new_state = dict(state)
        if isinstance(state.get("history"), list):
            new_state["history"] = list(state["history"])
        new_memory: dict[str, Any] = dict(memory)
        for rule in self._rules:
            if rule.when_step is not None and current not in rule.when_step:
                continue
            match = rule.pattern.search(text)
            if match is None:
                continue
            # set_memory sees the memory as it was; the reply sees it after the update, so a
            # reply can greet with a name the same rule has just stored.
            for key, template in rule.set_memory:
                new_memory[key] = template.render(text, match, memory)
            reply = rule.replies.pick(message).render(text, match, new_memory)
            new_state["step"] = rule.next_step or current
            new_state["memory"] = new_memory
            return new_state, reply
        new_state["step"] = current
        new_state["memory"] = new_memory
        return new_state, self._fallback.pick(message).render(text, None, new_memory)


# ---------------------------------------------------------------------------------------------
# Templates: "{1}" or "{name}" (capture group), "{text}" (the whole message),
# "{memory.KEY}" or "{memory.KEY|fallback}", "{{" and "}}" for literal braces.
# Compiled once at load time so that every reference is checked before the first message.


@dataclass(frozen=True, slots=True)
class _Group:
    ref: int | str


@dataclass(frozen=True, slots=True)
class _Text:
    pass


@dataclass(frozen=True, slots=True)
class _Memory:
    key: str
    default: str


@dataclass(frozen=True, slots=True)
class _Scope:
    """What a template may name: the groups of its rule's pattern and the memory keys that
    some rule can set. Anything else could never have a value, so it is a load-time error."""

    group_count: int
    group_names: frozenset[str]
    memory_keys: frozenset[str]


@dataclass(frozen=True, slots=True)
class _Template:
    parts: tuple[str | _Group | _Text | _Memory, ...]

    def render(self, text: str, match: re.Match[str] | None, memory: Mapping[str, Any]) -> str:
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, _Text):
                out.append(text)
            elif isinstance(part, _Group):
                # A group that took no part in the match (e.g. "(x)?") renders as "".
                value = match.group(part.ref) if match is not None else None
                out.append(value or "")
            else:
                stored = memory.get(part.key)
                out.append(part.default if stored is None else str(stored))
        return "".join(out)


@dataclass(frozen=True, slots=True)
class _Replies:
    """One reply template, or reassembly alternatives taken in turn.

    The choice follows the message's `seq`, never a random draw: a re-run of the same
    message after a crash must give the same reply. `seq` is used rather than the length of
    `history` because the worker trims history, which would freeze the rotation.
    """

    templates: tuple[_Template, ...]

    def pick(self, message: Mapping[str, Any]) -> _Template:
        if len(self.templates) == 1:
            return self.templates[0]
        return self.templates[(_turn(message) - 1) % len(self.templates)]


@dataclass(frozen=True, slots=True)
class _Rule:
    name: str
    pattern: re.Pattern[str]
    rank: int
    when_step: frozenset[str] | None
    set_memory: tuple[tuple[str, _Template], ...]
    next_step: str | None
    replies: _Replies


def _turn(message: Mapping[str, Any]) -> int:
    seq = message.get("seq")
    if isinstance(seq, int) and not isinstance(seq, bool):
        return seq
    if isinstance(seq, str) and seq.isascii() and seq.isdigit():
        return int(seq)
    raise PermanentError(
        f"message seq must be a non-negative integer to choose a reply, got {_describe(seq)}"
    )


_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_MEMORY_REF = re.compile(r"memory\.([A-Za-z_][A-Za-z0-9_]*)(?:\|([^{}]*))?")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STEP_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
_ENGINE_SPEC = re.compile(
    r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
)


def _compile_template(source: str, scope: _Scope, where: str) -> _Template:
    parts: list[str | _Group | _Text | _Memory] = []
    literal: list[str] = []
    position = 0
    for token in _TEMPLATE_TOKEN.finditer(source):
        literal.append(source[position : token.start()])
        position = token.end()
        whole, name = token.group(0), token.group(1)
        if whole in ("{{", "}}"):
            literal.append(whole[0])
            continue
        if name is None:
            raise _RuleFileError(
                f"{where}: unmatched {whole!r} in {source!r} (write {whole * 2!r} for a brace)"
            )
        if literal:
            parts.append("".join(literal))
            literal = []
        parts.append(_compile_placeholder(name, scope, where))
    literal.append(source[position:])
    if "".join(literal):
        parts.append("".join(literal))
    return _Template(tuple(parts))


def _compile_placeholder(name: str, scope: _Scope, where: str) -> _Group | _Text | _Memory:
    if name == "text":
        return _Text()
    if name.isascii() and name.isdigit():
        number = int(name)
        if number > scope.group_count:
            raise _RuleFileError(
                f"{where}: {{{name}}} refers to group {number} but the pattern has "
                f"{scope.group_count} group(s)"
            )
        return _Group(number)
    memory_ref = _MEMORY_REF.fullmatch(name)
    if memory_ref is not None:
        key = memory_ref.group(1)
        if key not in scope.memory_keys:
            known = ", ".join(sorted(scope.memory_keys)) or "none"
            raise _RuleFileError(
                f"{where}: {{{name}}} names memory key {key!r}, which no rule sets "
                f"(set_memory keys: {known})"
            )
        return _Memory(key, memory_ref.group(2) or "")
    if name in scope.group_names:
        return _Group(name)
    raise _RuleFileError(
        f"{where}: unknown placeholder {{{name}}} (use {{N}} or {{group_name}} for a capture, "
        "{text}, or {memory.KEY})"
    )


# ---------------------------------------------------------------------------------------------
# Rule file parsing. Unknown keys are errors: a misspelt `when_stp` silently ignored would
# make a rule fire in every step.

_TOP_KEYS = frozenset({"rule", "default"})
_RULE_KEYS = frozenset(
    {"name", "pattern", "flags", "rank", "when_step", "set_memory", "next_step", "reply", "replies"}
)
_DEFAULT_KEYS = frozenset({"reply", "replies"})
_FLAGS = {
    "IGNORECASE": re.IGNORECASE,
    "ASCII": re.ASCII,
    "DOTALL": re.DOTALL,
    "MULTILINE": re.MULTILINE,
}


class _RuleFileError(Exception):
    """One problem in a rule file, worded for the operator; `load_rules` adds the path."""


class _Table:
    """Typed, checked access to one TOML table, with its location for error messages."""

    def __init__(self, raw: object, where: str, allowed: frozenset[str]) -> None:
        if not isinstance(raw, dict):
            raise _RuleFileError(f"{where} must be a table, got {_describe(raw)}")
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise _RuleFileError(
                f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})"
            )
        self.raw: dict[str, Any] = raw
        self.where = where

    def _fail(self, key: str, expected: str) -> _RuleFileError:
        return _RuleFileError(f"{self.where}: {key} must be {expected}")

    def string(self, key: str, *, required: bool = False) -> str | None:
        value = self.raw.get(key)
        if value is None:
            if required:
                raise _RuleFileError(f"{self.where}: missing required key {key!r}")
            return None
        if not isinstance(value, str):
            raise self._fail(key, f"a string, got {_describe(value)}")
        return value

    def integer(self, key: str, default: int) -> int:
        value = self.raw.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._fail(key, f"an integer, got {_describe(value)}")
        return value

    def strings(self, key: str, *, allow_empty: bool) -> list[str] | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self._fail(key, f"a list of strings, got {_describe(value)}")
        if not value and not allow_empty:
            raise self._fail(key, "a non-empty list")
        return value

    def string_table(self, key: str) -> dict[str, str]:
        value = self.raw.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self._fail(key, f"a table of strings, got {_describe(value)}")
        return value

    def step_name(self, key: str, value: str) -> str:
        if not _STEP_NAME.fullmatch(value):
            raise _RuleFileError(
                f"{self.where}: {key} {value!r} is not a step name "
                "(A-Z, 0-9 and _, starting with a letter)"
            )
        return value

    def reply_sources(self) -> list[tuple[str, str]]:
        """(field label, template source) for `reply` or `replies`, exactly one of them."""
        reply = self.string("reply")
        replies = self.strings("replies", allow_empty=False)
        if (reply is None) == (replies is None):
            raise _RuleFileError(f"{self.where}: needs exactly one of 'reply' or 'replies'")
        if reply is not None:
            return [("reply", reply)]
        assert replies is not None
        return [(f"replies[{index}]", source) for index, source in enumerate(replies)]


@dataclass(frozen=True, slots=True)
class _ParsedRule:
    """A rule whose structure is checked but whose templates are not compiled yet: templates
    may name memory keys set by rules further down the file."""

    table: _Table
    name: str
    pattern: re.Pattern[str]
    rank: int
    when_step: list[str] | None
    set_memory: dict[str, str]
    next_step: str | None
    replies: list[tuple[str, str]]


def _build_engine(document: dict[str, Any], source: str) -> RuleEngine:
    top = _Table(document, "top level", _TOP_KEYS)
    raw_rules = document.get("rule", [])
    if not isinstance(raw_rules, list):
        raise _RuleFileError(
            f"'rule' must be an array of tables ([[rule]]), got {_describe(raw_rules)}"
        )
    parsed = [_parse_rule(index, raw) for index, raw in enumerate(raw_rules, start=1)]
    seen: set[str] = set()
    for rule in parsed:
        if rule.name in seen:
            raise _RuleFileError(f"{rule.table.where}: duplicate rule name {rule.name!r}")
        seen.add(rule.name)

    if "default" not in top.raw:
        raise _RuleFileError("missing [default] table (the reply when no rule matches)")
    default = _Table(top.raw["default"], "[default]", _DEFAULT_KEYS)

    known_steps = {INITIAL_STEP} | {rule.next_step for rule in parsed if rule.next_step}
    memory_keys = frozenset(key for rule in parsed for key in rule.set_memory)
    rules = [_compile_rule(rule, known_steps, memory_keys) for rule in parsed]
    no_groups = _Scope(0, frozenset(), memory_keys)
    fallback = _Replies(
        tuple(
            _compile_template(text, no_groups, f"[default] {label}")
            for label, text in default.reply_sources()
        )
    )
    return RuleEngine(rules, fallback, source)


def _parse_rule(index: int, raw: object) -> _ParsedRule:
    name = raw.get("name") if isinstance(raw, dict) else None
    where = f"rule #{index} {name!r}" if isinstance(name, str) else f"rule #{index}"
    table = _Table(raw, where, _RULE_KEYS)
    name = table.string("name", required=True)
    assert name is not None
    if not name.strip():
        raise _RuleFileError(f"{where}: name must not be empty")
    pattern_source = table.string("pattern", required=True)
    assert pattern_source is not None
    flags = 0
    for flag in table.strings("flags", allow_empty=True) or []:
        if flag not in _FLAGS:
            raise _RuleFileError(
                f"{where}: unknown flag {flag!r} (allowed: {', '.join(sorted(_FLAGS))})"
            )
        flags |= _FLAGS[flag]
    try:
        pattern = re.compile(pattern_source, flags)
    except re.error as exc:
        raise _RuleFileError(f"{where}: bad pattern {pattern_source!r}: {exc}") from None
    if "text" in pattern.groupindex:
        raise _RuleFileError(f"{where}: a group may not be named 'text' ({{text}} is reserved)")
    when_step = table.strings("when_step", allow_empty=False)
    for step in when_step or []:
        table.step_name("when_step", step)
    next_step = table.string("next_step")
    if next_step is not None:
        table.step_name("next_step", next_step)
    set_memory = table.string_table("set_memory")
    for key in set_memory:
        if not _IDENTIFIER.fullmatch(key):
            raise _RuleFileError(f"{where}: set_memory key {key!r} is not an identifier")
    return _ParsedRule(
        table=table,
        name=name,
        pattern=pattern,
        rank=table.integer("rank", 0),
        when_step=when_step,
        set_memory=set_memory,
        next_step=next_step,
        replies=table.reply_sources(),
    )


def _compile_rule(rule: _ParsedRule, known_steps: set[str], memory_keys: frozenset[str]) -> _Rule:
    where = rule.table.where
    for step in rule.when_step or []:
        if step not in known_steps:
            raise _RuleFileError(
                f"{where}: when_step names {step!r}, which no rule's next_step leads to "
                f"(known steps: {', '.join(sorted(known_steps))})"
            )
    scope = _Scope(rule.pattern.groups, frozenset(rule.pattern.groupindex), memory_keys)
    return _Rule(
        name=rule.name,
        pattern=rule.pattern,
        rank=rule.rank,
        when_step=frozenset(rule.when_step) if rule.when_step is not None else None,
        set_memory=tuple(
            (key, _compile_template(source, scope, f"{where} set_memory.{key}"))
            for key, source in rule.set_memory.items()
        ),
        next_step=rule.next_step,
        replies=_Replies(
            tuple(
                _compile_template(source, scope, f"{where} {label}")
                for label, source in rule.replies
            )
        ),
    )


def _default_rules_path() -> Path:
    for candidate in (_PACKAGED_RULES, _CHECKOUT_RULES):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        RULES_SETTING,
        f"no rule file given and no default found (looked for {_PACKAGED_RULES} "
        f"and {_CHECKOUT_RULES})",
    )


def _describe(value: object) -> str:
    """A short, one-line description of an unexpected value for an error message."""
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{type(value).__name__} {shown}"


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
