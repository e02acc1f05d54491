"""Operator actions that need no script of their own: they go through the dead-letter tools
(worker/dlq.py), one listed letter at a time, so an action touches exactly the letters the
operator saw on the page and nothing that arrived since.

Each returns counts for the page and the audit stream: `done` (redriven or purged),
`skipped` (the tool refused it: not UTF-8, another deployment's stream, ...), `missing`
(gone since the page was rendered: redriven or purged by someone else) and `refused` (a
letter of another session, for a session's redrive)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dialog_worker import dlq
from dialog_worker.client import DialogClient
from dialog_worker.console.reads import letter_fields, original_order, parse_handle
from dialog_worker.errors import ValidationError
from dialog_worker.keys import Keys


@dataclasses.dataclass(slots=True)
class Outcome:
    done: int = 0
    skipped: int = 0
    missing: int = 0
    refused: int = 0
    handles_done: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class _Listed:
    handle: str
    keys: Keys
    entry_id: str
    fields: dict[str, str]


async def _load(
    client: DialogClient, handles: Sequence[str], outcome: Outcome, session_id: str | None
) -> list[_Listed]:
    listed: list[_Listed] = []
    for raw in dict.fromkeys(handles):  # each once, in the order given
        keys, entry_id = parse_handle(client, raw)
        fields = await letter_fields(client, keys, entry_id)
        if fields is None:
            outcome.missing += 1
        elif session_id is not None and fields.get("session_id") != session_id:
            outcome.refused += 1
        else:
            listed.append(_Listed(raw, keys, entry_id, fields))
    return listed


async def redrive(
    client: DialogClient, handles: Sequence[str], session_id: str | None = None
) -> Outcome:
    """Re-send the listed letters one by one, each after the previous was accepted: for one
    session in the order its messages were sequenced (seq), otherwise oldest letter first.
    With `session_id`, a listed letter of another session is refused."""
    outcome = Outcome()
    listed = await _load(client, handles, outcome, session_id)
    listed.sort(key=lambda item: original_order({"id": item.entry_id, "seq": _seq(item.fields)}))
    for item in listed:
        try:
            result = await dlq.redrive([item.keys], client, None, None, item.entry_id)
        except (ValidationError, LookupError, RuntimeError):
            outcome.missing += 1
            continue
        if result.get("redriven"):
            outcome.done += 1
            outcome.handles_done.append(item.handle)
        else:
            outcome.skipped += 1
    return outcome


async def purge(client: DialogClient, handles: Sequence[str]) -> Outcome:
    outcome = Outcome()
    for item in await _load(client, handles, outcome, None):
        try:
            removed = await dlq.purge([item.keys], client, item.entry_id)
        except (ValidationError, LookupError, RuntimeError):
            removed = 0
        if removed:
            outcome.done += 1
            outcome.handles_done.append(item.handle)
        else:
            outcome.missing += 1
    return outcome


def _seq(fields: dict[str, str]) -> int | None:
    raw = fields.get("seq")
    return int(raw) if raw is not None and raw.isascii() and raw.isdigit() else None
