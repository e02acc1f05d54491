"""The built-in engine: ELIZA-style rules read from a TOML file (the format is documented in
`config/rules.toml`). It is what runs when `DIALOG_ENGINE` is unset; an engine of your own
needs nothing from this module (see `dialog_worker.engine.protocol` and docs/engine.md).

`load_rules` reads and checks a rule file once at start; `RuleEngine.step` then applies the
first matching rule to each message, without I/O and without modifying its inputs.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dialog_worker.engine.protocol import INITIAL_STEP, InlineEngine, describe
from dialog_worker.errors import ConfigError, PermanentError

RULES_SETTING = "DIALOG_RULES_FILE"

# An installed wheel carries config/rules.toml as dialog_worker/defaults/rules.toml (see
# pyproject.toml); a source checkout only has the original, so look for both.
_PACKAGED_RULES = Path(__file__).resolve().parent.parent / "defaults" / "rules.toml"
_CHECKOUT_RULES = Path(__file__).resolve().parents[3] / "config" / "rules.toml"


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


class RuleEngine(InlineEngine):
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

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Apply the first rule that fits; the inputs are never modified."""
        text = message.get("text")
        if not isinstance(text, str):
            raise PermanentError(f"message text must be a string, got {describe(text)}")
        current = state.get("step", INITIAL_STEP)
        if not isinstance(current, str):
            raise PermanentError(f"state step must be a string, got {describe(current)}")
        memory = state.get("memory") or {}
        if not isinstance(memory, dict):
            raise PermanentError(f"state memory must be a dict, got {describe(memory)}")

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
        f"message seq must be a non-negative integer to choose a reply, got {describe(seq)}"
    )


_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_MEMORY_REF = re.compile(r"memory\.([A-Za-z_][A-Za-z0-9_]*)(?:\|([^{}]*))?")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STEP_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


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
            raise _RuleFileError(f"{where} must be a table, got {describe(raw)}")
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
            raise self._fail(key, f"a string, got {describe(value)}")
        return value

    def integer(self, key: str, default: int) -> int:
        value = self.raw.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._fail(key, f"an integer, got {describe(value)}")
        return value

    def strings(self, key: str, *, allow_empty: bool) -> list[str] | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self._fail(key, f"a list of strings, got {describe(value)}")
        if not value and not allow_empty:
            raise self._fail(key, "a non-empty list")
        return value

    def string_table(self, key: str) -> dict[str, str]:
        value = self.raw.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self._fail(key, f"a table of strings, got {describe(value)}")
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
            f"'rule' must be an array of tables ([[rule]]), got {describe(raw_rules)}"
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
