"""The dialog engine: the seed behaviour, purity, the rule-file format and plugin loading."""

from __future__ import annotations

import copy
import itertools
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from dialog_worker.engine import rules as rules_module
from dialog_worker.engine.loading import load_engine
from dialog_worker.engine.protocol import (
    MAX_BUBBLES,
    MAX_BUBBLES_BYTES,
    RichReply,
    bubbles_json,
    initial_state,
    run_step,
    shutdown_engine,
    startup_engine,
)
from dialog_worker.engine.rules import RuleEngine, load_rules
from dialog_worker.errors import ConfigError, EngineHookError, PermanentError

FALLBACK = "Maaf, saya tidak mengerti."


@pytest.fixture(scope="module")
def rules() -> RuleEngine:
    return load_rules()


def message(text: str, seq: int = 1) -> dict[str, Any]:
    return {"session_id": "s1", "msg_id": f"m{seq}", "seq": seq, "text": text}


def state_in(step: str, memory: dict[str, str] | None = None) -> dict[str, Any]:
    state = initial_state("s1")
    state["step"] = step
    state["memory"] = dict(memory or {})
    return state


def write_rules(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rules.toml"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


_plugin_numbers = itertools.count()


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """Write an importable module into tmp_path and return its (unique) name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"engine_plugin_{next(_plugin_numbers)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        return name

    return write


# --- the seed behaviour ------------------------------------------------------------------------


def test_seed_conversation_stores_name_then_records_complaint(rules: RuleEngine) -> None:
    state = initial_state("s1")

    state, reply = rules.step(state, message("nama saya Budi", 1))
    assert reply == "Halo Budi, ada yang bisa dibantu?"
    assert state["step"] == "AWAITING_QUERY"
    assert state["memory"] == {"userName": "Budi"}

    state, reply = rules.step(state, message("saya ada kendala billing", 2))
    assert reply == 'Mencatat keluhan Anda: "saya ada kendala billing". Tim kami akan meninjau.'
    assert state["step"] == "COMPLETED"
    assert state["memory"] == {"userName": "Budi"}


def test_unknown_text_in_root_gets_fallback_and_keeps_step(rules: RuleEngine) -> None:
    state, reply = rules.step(initial_state("s1"), message("halo"))
    assert reply == FALLBACK
    assert state["step"] == "ROOT"
    assert state["memory"] == {}


def test_completed_session_without_name_gets_fallback_and_keeps_memory(
    rules: RuleEngine,
) -> None:
    state, reply = rules.step(state_in("COMPLETED", {"userName": "Budi"}), message("terima kasih"))
    assert reply == FALLBACK
    assert state["step"] == "COMPLETED"
    assert state["memory"] == {"userName": "Budi"}


@pytest.mark.parametrize("step", ["ROOT", "AWAITING_QUERY", "COMPLETED"])
def test_name_rule_wins_in_every_step(rules: RuleEngine, step: str) -> None:
    state, reply = rules.step(state_in(step, {"userName": "Ani"}), message("nama saya Budi"))
    assert reply == "Halo Budi, ada yang bisa dibantu?"
    assert state["step"] == "AWAITING_QUERY"
    assert state["memory"] == {"userName": "Budi"}


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("Halo, nama saya Budi", "Budi"),
        ("NAMA SAYA budi", "budi"),
        ("nama saya  Budi ", " Budi "),
        ("nama saya ", ""),
        ("nama saya Budi, nama saya Ani", "Budi, nama saya Ani"),
    ],
)
def test_name_is_searched_anywhere_and_captured_verbatim(
    rules: RuleEngine, text: str, name: str
) -> None:
    state, reply = rules.step(initial_state("s1"), message(text))
    assert state["memory"] == {"userName": name}
    assert reply == f"Halo {name}, ada yang bisa dibantu?"


@pytest.mark.parametrize("terminator", ["\n", "\r", "\r\n", "\u2028", "\u2029"])
def test_name_capture_stops_at_javascript_line_terminators(
    rules: RuleEngine, terminator: str
) -> None:
    state, _ = rules.step(initial_state("s1"), message(f"nama saya Budi{terminator}lagi"))
    assert state["memory"] == {"userName": "Budi"}


def test_case_folding_is_ascii_only_like_the_javascript_seed(rules: RuleEngine) -> None:
    # Python's Unicode IGNORECASE would accept U+017F (long s) for "s"; JavaScript's /i does not.
    state, reply = rules.step(initial_state("s1"), message("nama \u017faya Budi"))
    assert reply == FALLBACK
    assert state["memory"] == {}


def test_complaint_keeps_the_whole_text_verbatim(rules: RuleEngine) -> None:
    text = '  tagihan "ganda"\nbulan ini {1} '
    state, reply = rules.step(state_in("AWAITING_QUERY"), message(text))
    assert reply == f'Mencatat keluhan Anda: "{text}". Tim kami akan meninjau.'
    assert state["step"] == "COMPLETED"


def test_initial_state_has_the_contract_shape() -> None:
    assert initial_state("abc") == {
        "session_id": "abc",
        "step": "ROOT",
        "memory": {},
        "history": [],
        "applied_seq": 0,
        "version": 0,
    }


# --- purity ------------------------------------------------------------------------------------


def test_step_does_not_mutate_its_inputs(rules: RuleEngine) -> None:
    state = state_in("ROOT", {"other": "x"})
    state["history"] = [{"seq": 1, "msg_id": "m1", "user": "hai", "bot": FALLBACK}]
    msg = message("nama saya Budi", 2)
    state_before, message_before = copy.deepcopy(state), copy.deepcopy(msg)

    new_state, _ = rules.step(state, msg)

    assert state == state_before
    assert msg == message_before
    new_state["memory"]["userName"] = "changed"
    new_state["history"].append({"seq": 99})
    assert state == state_before


def test_worker_owned_fields_are_copied_through_untouched(rules: RuleEngine) -> None:
    state = state_in("AWAITING_QUERY")
    history = [{"seq": 7, "msg_id": "m7", "user": "nama saya Budi", "bot": "Halo Budi"}]
    state.update(history=history, applied_seq=7, version=12, extra={"kept": True})

    new_state, _ = rules.step(state, message("kendala", 8))

    assert new_state["session_id"] == "s1"
    assert new_state["history"] == history
    assert new_state["applied_seq"] == 7
    assert new_state["version"] == 12
    assert new_state["extra"] == {"kept": True}


def test_same_inputs_give_the_same_outputs(rules: RuleEngine) -> None:
    state, msg = state_in("AWAITING_QUERY"), message("kendala billing", 3)
    assert rules.step(state, msg) == rules.step(state, msg)


def test_message_without_text_is_a_permanent_error(rules: RuleEngine) -> None:
    with pytest.raises(PermanentError, match="text"):
        rules.step(initial_state("s1"), {"session_id": "s1", "msg_id": "m1", "seq": 1})


# --- richer rule files -------------------------------------------------------------------------

RICH_RULES = """
    [[rule]]
    name = "low_rank_hello"
    pattern = 'halo'
    reply = "low"

    [[rule]]
    name = "high_rank_hello"
    rank = 5
    pattern = 'halo'
    reply = "high {memory.userName|teman}"

    [[rule]]
    name = "introduce"
    pattern = 'nama saya (?P<name>\\w+)'
    set_memory = { userName = "{name}" }
    reply = "Hai {memory.userName}"

    [[rule]]
    name = "first_of_equals"
    rank = 1
    pattern = 'sama'
    reply = "first"

    [[rule]]
    name = "second_of_equals"
    rank = 1
    pattern = 'sama'
    reply = "second"

    [[rule]]
    name = "remember"
    pattern = '(?i)aku (\\w+)( sekali)?'
    set_memory = { mood = "{1}{2}" }
    next_step = "LISTENING"
    reply = "Kenapa kamu {memory.mood}? {{tanya}}"

    [[rule]]
    name = "only_when_listening"
    when_step = ["LISTENING"]
    pattern = 'karena (.*)'
    reply = "Apakah {1} alasan sebenarnya? ({memory.mood})"

    [default]
    replies = ["Lanjutkan.", "Ceritakan lebih banyak.", "Hmm ({text})."]
"""


@pytest.fixture
def rich(tmp_path: Path) -> RuleEngine:
    return load_rules(write_rules(tmp_path, RICH_RULES))


def test_higher_rank_is_tried_first_regardless_of_file_order(rich: RuleEngine) -> None:
    _, reply = rich.step(initial_state("s1"), message("halo"))
    assert reply == "high teman"
    state, reply = rich.step(initial_state("s1"), message("nama saya Budi"))
    assert reply == "Hai Budi", "a reply sees the memory its own rule has just set"
    _, reply = rich.step(state, message("halo"))
    assert reply == "high Budi"


def test_equal_ranks_keep_file_order(rich: RuleEngine) -> None:
    _, reply = rich.step(initial_state("s1"), message("sama saja"))
    assert reply == "first"
    assert rich.rule_names.index("first_of_equals") < rich.rule_names.index("second_of_equals")


def test_when_step_limits_a_rule_to_its_steps(rich: RuleEngine) -> None:
    _, reply = rich.step(initial_state("s1"), message("karena hujan", 1))
    assert reply == "Lanjutkan."

    state, reply = rich.step(initial_state("s1"), message("Aku sedih sekali", 1))
    assert (state["step"], state["memory"], reply) == (
        "LISTENING",
        {"mood": "sedih sekali"},
        "Kenapa kamu sedih sekali? {tanya}",
    )
    state, reply = rich.step(state, message("karena hujan", 2))
    assert reply == "Apakah hujan alasan sebenarnya? (sedih sekali)"
    assert state["step"] == "LISTENING"


def test_unmatched_optional_group_renders_empty(rich: RuleEngine) -> None:
    state, _ = rich.step(initial_state("s1"), message("aku senang"))
    assert state["memory"] == {"mood": "senang"}


def test_reply_alternatives_rotate_by_seq_deterministically(rich: RuleEngine) -> None:
    replies = [rich.step(initial_state("s1"), message("x", seq))[1] for seq in range(1, 5)]
    assert replies == ["Lanjutkan.", "Ceritakan lebih banyak.", "Hmm (x).", "Lanjutkan."]
    assert rich.step(initial_state("s1"), message("x", 2)) == rich.step(
        initial_state("s1"), message("x", 2)
    )


def test_reply_alternatives_need_a_seq(rich: RuleEngine) -> None:
    with pytest.raises(PermanentError, match="seq"):
        rich.step(initial_state("s1"), {"text": "x"})


# --- rule-file validation ----------------------------------------------------------------------

VALID_RULE = """
    [[rule]]
    name = "r"
    pattern = '(a)'
    reply = "ok"
"""
DEFAULT = """
    [default]
    reply = "?"
"""


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "(a"\nreply = "x"\n' + DEFAULT,
            "rule #1 'r': bad pattern",
            id="bad-regex",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "x"\nwhen_stp = ["ROOT"]\n' + DEFAULT,
            "unknown key 'when_stp'",
            id="unknown-rule-key",
        ),
        pytest.param(
            VALID_RULE + DEFAULT + 'extra = "x"\n', "unknown key 'extra'", id="unknown-default-key"
        ),
        pytest.param("rules = []\n" + DEFAULT, "unknown key 'rules'", id="unknown-top-key"),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "(a)"\nreply = "{2}"\n' + DEFAULT,
            "{2} refers to group 2 but the pattern has 1 group",
            id="group-ref-too-high",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "{who}"\n' + DEFAULT,
            "unknown placeholder {who}",
            id="unknown-named-group",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "x"\nnext_step = "awaiting"\n' + DEFAULT,
            "'awaiting'",
            id="bad-step-name",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "x"\nwhen_step = ["AWAITNG"]\n' + DEFAULT,
            "when_step names 'AWAITNG'",
            id="when-step-never-reached",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "{memory.nama}"\n' + DEFAULT,
            "memory key 'nama', which no rule sets",
            id="memory-key-never-set",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "x"\nrank = "1"\n' + DEFAULT,
            "rank must be an integer",
            id="rank-wrong-type",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "x"\nreplies = ["y"]\n' + DEFAULT,
            "exactly one of 'reply' or 'replies'",
            id="reply-and-replies",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\n' + DEFAULT,
            "exactly one of 'reply' or 'replies'",
            id="no-reply",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "x"\nflags = ["IGNORE"]\n' + DEFAULT,
            "unknown flag 'IGNORE'",
            id="unknown-flag",
        ),
        pytest.param(VALID_RULE + VALID_RULE + DEFAULT, "duplicate rule name 'r'", id="dup-name"),
        pytest.param(VALID_RULE, "missing [default]", id="no-default"),
        pytest.param(
            '[[rule]]\nname = "r"\nreply = "x"\n' + DEFAULT,
            "missing required key 'pattern'",
            id="no-pattern",
        ),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "x {"\n' + DEFAULT,
            "unmatched '{'",
            id="unmatched-brace",
        ),
        pytest.param('[default]\nreply = "{1}"\n', "[default] reply", id="group-in-default"),
        pytest.param('[default]\nreply = "x"\n[[rule]\n', "invalid TOML", id="toml-syntax"),
        pytest.param(
            '[[rule]]\nname = "r"\npattern = "a"\nreply = "x"\nset_memory = { "a b" = "x" }\n'
            + DEFAULT,
            "set_memory key 'a b'",
            id="bad-memory-key",
        ),
    ],
)
def test_invalid_rule_file_fails_at_load_naming_file_and_rule(
    tmp_path: Path, body: str, expected: str
) -> None:
    path = write_rules(tmp_path, body)
    with pytest.raises(ConfigError) as caught:
        load_rules(path)
    assert caught.value.setting == "DIALOG_RULES_FILE"
    assert str(path) in str(caught.value)
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


def test_missing_rule_file_fails_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as caught:
        load_rules(path)
    assert caught.value.setting == "DIALOG_RULES_FILE"
    assert f"cannot read {path}" in caught.value.problem


def test_packaged_default_rules_take_precedence_over_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged = write_rules(tmp_path, '[default]\nreply = "packaged"\n')
    monkeypatch.setattr(rules_module, "_PACKAGED_RULES", packaged)
    _, reply = load_rules().step(initial_state("s1"), message("x"))
    assert reply == "packaged"


def test_no_default_rule_file_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rules_module, "_PACKAGED_RULES", tmp_path / "a.toml")
    monkeypatch.setattr(rules_module, "_CHECKOUT_RULES", tmp_path / "b.toml")
    with pytest.raises(ConfigError, match="DIALOG_RULES_FILE: no rule file given"):
        load_rules()


# --- load_engine and run_step ------------------------------------------------------------------


@pytest.mark.parametrize("spec", [None, "", "  "])
def test_unset_engine_spec_means_builtin_rules(spec: str | None) -> None:
    assert isinstance(load_engine(spec), RuleEngine)


def test_engine_spec_can_name_a_rule_file(tmp_path: Path) -> None:
    path = write_rules(tmp_path, '[default]\nreply = "custom"\n')
    built = load_engine(None, str(path))
    assert isinstance(built, RuleEngine)
    assert built.step(initial_state("s1"), message("x"))[1] == "custom"


ASYNC_PLUGIN = """
    class EchoEngine:
        async def step(self, state, message):
            state["step"] = "ECHOED"
            state["memory"]["last"] = message["text"]
            return state, "echo: " + message["text"]

    def make_async_engine():
        return EchoEngine()
"""


async def test_async_engine_from_spec_is_awaited_by_run_step(
    plugin: Callable[[str], str],
) -> None:
    loaded = load_engine(f"{plugin(ASYNC_PLUGIN)}:make_async_engine")
    state = initial_state("s1")
    state_before = copy.deepcopy(state)

    new_state, reply = await run_step(loaded, state, message("hai"))

    assert reply == "echo: hai"
    assert new_state["step"] == "ECHOED"
    assert new_state["memory"] == {"last": "hai"}
    assert state == state_before, "run_step must shield the caller from a mutating engine"


async def test_run_step_runs_plain_engines(rules: RuleEngine) -> None:
    state, reply = await run_step(rules, initial_state("s1"), message("nama saya Budi"))
    assert reply == "Halo Budi, ada yang bisa dibantu?"
    assert state["memory"] == {"userName": "Budi"}


class _FixedEngine:
    def __init__(self, result: object) -> None:
        self.result = result

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> Any:
        return self.result


@pytest.mark.parametrize(
    "result",
    [
        pytest.param(None, id="none"),
        pytest.param("reply only", id="string"),
        pytest.param(({"step": "ROOT", "memory": {}},), id="one-tuple"),
        pytest.param([{"step": "ROOT", "memory": {}}, "r"], id="list"),
        pytest.param(({"step": "ROOT", "memory": {}}, 42), id="reply-a-number"),
        pytest.param(({"step": "ROOT", "memory": {}}, []), id="reply-no-bubbles"),
        pytest.param(({"step": "ROOT", "memory": {}}, [{"text": "a"}] * 11), id="11-bubbles"),
        pytest.param(({"step": "ROOT", "memory": {}}, ["a"]), id="bubble-not-dict"),
        pytest.param(({"step": "ROOT", "memory": {}}, {"txt": "a"}), id="bubble-unknown-key"),
        pytest.param(({"step": "ROOT", "memory": {}}, {"text": 1}), id="bubble-text-not-str"),
        pytest.param(({"step": "ROOT", "memory": {}}, {"data": {1, 2}}), id="data-a-set"),
        pytest.param(({"step": "ROOT", "memory": {}}, {"data": float("nan")}), id="data-nan"),
        pytest.param(("state", "r"), id="state-not-dict"),
        pytest.param(({"memory": {}}, "r"), id="no-step"),
        pytest.param(({"step": 1, "memory": {}}, "r"), id="step-not-str"),
        pytest.param(({"step": "ROOT"}, "r"), id="no-memory"),
        pytest.param(({"step": "ROOT", "memory": {1, 2}}, "r"), id="memory-a-set"),
        pytest.param(({"step": "ROOT", "memory": float("nan")}, "r"), id="memory-nan"),
        pytest.param(({"step": "ROOT", "memory": {}, "extra": object()}, "r"), id="extra-object"),
    ],
)
async def test_run_step_rejects_a_bad_result_shape_as_permanent(result: object) -> None:
    with pytest.raises(PermanentError, match=r"_FixedEngine\.step returned"):
        await run_step(_FixedEngine(result), initial_state("s1"), message("x"))


def _bubble_of_json_size(size: int) -> dict[str, Any]:
    """One bubble whose reply JSON ([{"text":"","data":"xx..."}]) is exactly `size` bytes."""
    overhead = len(bubbles_json([{"text": "", "data": ""}]).encode())
    return {"text": "", "data": "x" * (size - overhead)}


async def test_rich_replies_are_checked_and_kept_at_their_limits() -> None:
    state = {"step": "ROOT", "memory": {}}
    buttons = {"buttons": [{"title": "Ya", "payload": "yes"}]}
    _, one = await run_step(_FixedEngine((state, {"text": "Lanjut?", "data": buttons})),
                            initial_state("s1"), message("x"))  # fmt: skip
    assert one == RichReply("Lanjut?", ({"text": "Lanjut?", "data": buttons},))
    ten = [{"text": f"b{i}"} for i in range(MAX_BUBBLES)]
    _, many = await run_step(_FixedEngine((state, ten)), initial_state("s1"), message("x"))
    assert isinstance(many, RichReply) and len(many.bubbles) == MAX_BUBBLES
    assert many.text == "\n\n".join(f"b{i}" for i in range(MAX_BUBBLES))
    _, none = await run_step(_FixedEngine((state, None)), initial_state("s1"), message("x"))
    assert none == RichReply("", no_reply=True)
    assert none.event_fields() == ["no_reply", "1"]
    at_limit = _bubble_of_json_size(MAX_BUBBLES_BYTES)
    _, big = await run_step(_FixedEngine((state, at_limit)), initial_state("s1"), message("x"))
    assert isinstance(big, RichReply)
    assert len(big.event_fields()[1].encode()) == MAX_BUBBLES_BYTES
    past = _bubble_of_json_size(MAX_BUBBLES_BYTES + 1)
    with pytest.raises(PermanentError, match="at most 16384"):
        await run_step(_FixedEngine((state, past)), initial_state("s1"), message("x"))
    with pytest.raises(PermanentError, match="at most 10"):
        await run_step(_FixedEngine((state, [*ten, {"text": "x"}])), initial_state("s1"),
                       message("x"))  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("no_colon_here", "not of the form package.module:attr"),
        ("a:b:c", "not of the form"),
        (":factory", "not of the form"),
        ("module:", "not of the form"),
        ("no_such_module_for_engine_tests:make", "add the folder that holds it to PYTHONPATH"),
        ("no_such_package_for_engine_tests.engine:make", "install its package"),
    ],
)
def test_bad_engine_spec_is_a_config_error(spec: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_engine(spec)
    assert caught.value.setting == "DIALOG_ENGINE"
    assert expected in caught.value.problem


@pytest.mark.parametrize(
    ("source", "attr", "expected"),
    [
        ("def make():\n    return object()\n", "missing", "has no attribute 'missing'"),
        ("make = 42\n", "make", "name an object with a step(state, message) method"),
        ("def make():\n    raise RuntimeError('no licence')\n", "make", "RuntimeError: no licence"),
        ("class E:\n    step = 'x'\ndef make():\n    return E()\n", "make", "without a callable"),
        ("raise ImportError('broken dependency')\n", "make", "broken dependency"),
    ],
    ids=[
        "missing-attribute",
        "not-callable",
        "factory-raises",
        "step-not-callable",
        "import-fails",
    ],
)
def test_broken_engine_plugin_is_a_config_error(
    plugin: Callable[[str], str], source: str, attr: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_engine(f"{plugin(source)}:{attr}")
    assert caught.value.setting == "DIALOG_ENGINE"
    assert expected in caught.value.problem


def test_import_failure_inside_the_module_names_the_missing_dependency(
    plugin: Callable[[str], str],
) -> None:
    name = plugin("import no_such_dependency_for_engine_tests\n")
    with pytest.raises(ConfigError) as caught:
        load_engine(f"{name}:make")
    assert "imports 'no_such_dependency_for_engine_tests', which is not installed" in str(
        caught.value
    )
    assert "\n" not in str(caught.value)


ENGINE_OBJECTS = """
    class Counter:
        def step(self, state, message):
            return {**state, "step": "COUNTING"}, "ok"

    counter = Counter()

    def needs_args(url, key):
        return Counter()

    async def async_factory():
        return Counter()
"""


def test_spec_may_name_an_engine_object_or_a_class(plugin: Callable[[str], str]) -> None:
    name = plugin(ENGINE_OBJECTS)
    module = __import__(name)
    assert load_engine(f"{name}:counter") is module.counter
    assert type(load_engine(f"{name}:Counter")) is module.Counter


@pytest.mark.parametrize(
    ("attr", "expected"),
    [
        ("needs_args", "needs argument(s) url, key; a factory must take none"),
        ("async_factory", "is async; make it a plain def"),
    ],
)
def test_factory_that_cannot_be_called_plainly_is_a_config_error(
    plugin: Callable[[str], str], attr: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_engine(f"{plugin(ENGINE_OBJECTS)}:{attr}")
    assert expected in caught.value.problem


# --- how steps run -----------------------------------------------------------------------------


class _ThreadProbe:
    """A plain def step that blocks (as a synchronous HTTP call would)."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.sleep_s = sleep_s
        self.threads: list[int] = []
        self.running = 0
        self.most_running = 0
        self._lock = threading.Lock()

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        self.threads.append(threading.get_ident())
        time.sleep(self.sleep_s)
        with self._lock:
            self.running -= 1
        return {**state, "step": "DONE"}, "done"


async def test_plain_def_step_runs_in_a_thread_and_the_loop_keeps_running() -> None:
    probe = _ThreadProbe(sleep_s=0.3)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        _, reply = await run_step(probe, initial_state("s1"), message("x"))
        tg.cancel_scope.cancel()
    assert reply == "done"
    assert probe.threads[0] != threading.get_ident()
    assert ticks >= 10, "the event loop was blocked while the step ran"


async def test_thread_steps_are_bounded_by_the_limiter() -> None:
    probe = _ThreadProbe(sleep_s=0.05)
    limiter = anyio.CapacityLimiter(2)

    async def one(seq: int) -> None:
        await run_step(probe, initial_state("s1"), message("x", seq), limiter=limiter)

    async with anyio.create_task_group() as tg:
        for seq in range(1, 7):
            tg.start_soon(one, seq)
    assert probe.most_running == 2


async def test_async_step_runs_on_the_event_loop() -> None:
    seen: list[int] = []

    class OnLoop:
        async def step(
            self, state: dict[str, Any], message: dict[str, Any]
        ) -> tuple[dict[str, Any], str]:
            seen.append(threading.get_ident())
            return state, "ok"

    await run_step(OnLoop(), initial_state("s1"), message("x"))
    assert seen == [threading.get_ident()]


async def test_a_cancelled_thread_step_is_abandoned_at_once() -> None:
    probe = _ThreadProbe(sleep_s=1.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.1):
            await run_step(probe, initial_state("s1"), message("x"))
    assert time.monotonic() - started < 0.5


async def test_plain_def_step_is_shielded_from_its_own_mutations() -> None:
    class Mutator:
        def step(
            self, state: dict[str, Any], message: dict[str, Any]
        ) -> tuple[dict[str, Any], str]:
            state["memory"]["x"] = 1
            message["text"] = "changed"
            return state, "ok"

    state, msg = initial_state("s1"), message("x")
    new_state, _ = await run_step(Mutator(), state, msg)
    assert new_state["memory"] == {"x": 1}
    assert state["memory"] == {} and msg["text"] == "x"


@pytest.mark.parametrize(
    "memory",
    [
        pytest.param(7, id="int"),
        pytest.param({"profile": {"name": "Budi", "tags": ["vip", 2]}, "turns": 3}, id="nested"),
        pytest.param(["a", None, True, 1.5], id="list"),
        pytest.param(None, id="null"),
    ],
)
async def test_memory_may_be_any_json_value(memory: object) -> None:
    class Keeps:
        def step(
            self, state: dict[str, Any], message: dict[str, Any]
        ) -> tuple[dict[str, Any], str]:
            return {**state, "step": "KEPT", "memory": memory}, "ok"

    new_state, _ = await run_step(Keeps(), initial_state("s1"), message("x"))
    assert new_state["memory"] == memory


# --- lifecycle hooks ---------------------------------------------------------------------------


class _Hooked:
    def __init__(self, fail_startup: bool = False, fail_shutdown: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_startup = fail_startup
        self.fail_shutdown = fail_shutdown

    async def startup(self) -> None:
        self.calls.append("startup")
        if self.fail_startup:
            raise OSError("connection refused")

    def shutdown(self) -> None:  # a plain def hook runs in a thread
        self.calls.append(f"shutdown in thread: {threading.get_ident() != MAIN_THREAD}")
        if self.fail_shutdown:
            raise RuntimeError("already closed")

    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        return state, "ok"


MAIN_THREAD = threading.get_ident()


async def test_startup_and_shutdown_hooks_are_called_async_or_plain() -> None:
    engine = _Hooked()
    await startup_engine(engine)
    await shutdown_engine(engine)
    assert engine.calls == ["startup", "shutdown in thread: True"]


async def test_engines_without_hooks_need_none(rules: RuleEngine) -> None:
    await startup_engine(rules)
    await shutdown_engine(rules)


async def test_failed_startup_is_an_engine_hook_error_naming_the_engine() -> None:
    with pytest.raises(EngineHookError, match=r"_Hooked\.startup\(\) raised OSError"):
        await startup_engine(_Hooked(fail_startup=True))


async def test_failed_shutdown_is_logged_with_its_traceback_not_raised() -> None:
    with structlog.testing.capture_logs() as logs:
        await shutdown_engine(_Hooked(fail_shutdown=True))
    [entry] = logs
    assert entry["event"] == "engine_shutdown_failed"
    assert entry["exc_info"] is True


class _Polite:
    fallback_reply: object = "Sorry!"

    def step(self, state: dict[str, Any], message: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return state, ""


def test_an_engines_fallback_reply_is_used_unless_the_setting_was_changed() -> None:
    from dialog_worker.engine.protocol import fallback_reply

    assert fallback_reply(_Polite(), "default", "default") == "Sorry!"
    assert fallback_reply(_Polite(), "set by the operator", "default") == "set by the operator"
    assert fallback_reply(load_rules(), "default", "default") == "default"
    bad = _Polite()
    bad.fallback_reply = ""
    with pytest.raises(ConfigError, match="fallback_reply"):
        fallback_reply(bad, "default", "default")


class _Frugal(_Polite):
    budget_reply: object = "Out of tokens for today."


def test_an_engines_budget_reply_is_used_unless_the_setting_was_changed() -> None:
    from dialog_worker.engine.protocol import budget_reply

    assert budget_reply(_Frugal(), "default", "default") == "Out of tokens for today."
    assert budget_reply(_Frugal(), "set by the operator", "default") == "set by the operator"
    assert budget_reply(_Polite(), "default", "default") == "default"  # has none of its own
    bad = _Frugal()
    bad.budget_reply = 3
    with pytest.raises(ConfigError, match="budget_reply"):
        budget_reply(bad, "default", "default")
