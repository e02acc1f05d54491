"""examples/own_bot/: the bot package the "your own bot" recipe installs into the image
(scripts/container-check.sh builds and runs it). Here: its engine on its own, and the recipe
in docs/deploy.md is the Dockerfile that is built."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dialog_worker.engine import emit as emit_module
from dialog_worker.engine.protocol import initial_state, run_step

OWN_BOT = Path(__file__).resolve().parents[2] / "examples" / "own_bot"
sys.path.insert(0, str(OWN_BOT))

from mybot.worker import Bot  # noqa: E402


class Pieces:
    def __init__(self) -> None:
        self.text: list[str] = []

    def add(self, text: str) -> None:
        self.text.append(text)


async def test_the_bot_counts_turns_and_writes_its_answer_word_by_word() -> None:
    state = initial_state("s1")
    message = {"session_id": "s1", "msg_id": "m1", "seq": 1, "text": "halo", "meta": {}}
    pieces = Pieces()
    token = emit_module.bind(pieces)  # type: ignore[arg-type]
    try:
        state, reply = await run_step(Bot(), state, message)
    finally:
        emit_module.unbind(token)
    assert reply == "mybot heard: halo (turn 1)"
    assert "".join(pieces.text) == reply and len(pieces.text) == 5
    state, reply = await run_step(Bot(), state, {**message, "msg_id": "m2", "seq": 2})
    assert reply == "mybot heard: halo (turn 2)" and state["memory"] == {"turns": 2}


def test_the_recipe_in_the_deploy_guide_is_the_dockerfile_that_is_built() -> None:
    """docs/deploy.md shows examples/own_bot/Dockerfile's instructions as they are."""
    guide = (OWN_BOT.parents[1] / "docs" / "deploy.md").read_text(encoding="utf-8")
    [shown] = re.findall(r"```dockerfile\n(.*?)```", guide, flags=re.S)
    built = (OWN_BOT / "Dockerfile").read_text(encoding="utf-8")

    def instructions(text: str) -> list[str]:
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        return " ".join(lines).replace("\\", " ").split()

    assert instructions(shown) == instructions(built)
