"""Which engine a worker runs: the one `DIALOG_ENGINE` names (``package.module:attr``), or the
built-in rules when it is unset. Every failure is a `ConfigError`, so that a typo stops the
worker at start with one line instead of dead-lettering every message later."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any, cast

from dialog_worker.engine.protocol import ENGINE_SETTING, Engine, _one_line, describe
from dialog_worker.engine.rules import load_rules
from dialog_worker.errors import ConfigError

_ENGINE_SPEC = re.compile(
    r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
)


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
            f"{spec!r} is {describe(target)}: name an object with a step(state, message) "
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
            f"factory {spec!r} returned {describe(engine)} without a callable step(state, message)",
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
