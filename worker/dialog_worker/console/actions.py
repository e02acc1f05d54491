"""Operator actions that need no script of their own: they go through the dead-letter tools
(dialog_worker/ops/dead_letters.py), one listed letter at a time, so an action touches exactly the
letters the operator saw on the page and nothing that arrived since.

Each returns counts for the page and the audit stream: `done` (redriven or purged),
`skipped` (the tool refused it: not UTF-8, another deployment's stream, ...), `missing`
(gone since the page was rendered: redriven or purged by someone else) and `refused` (a
letter of another session, for a session's redrive). One that fails part way (Redis goes
away after some letters were done) raises `ActionFailed` with the counts so far, which the
audit stream records as the action's outcome."""

from __future__ import annotations

import dataclasses
import json
import time
import weakref
from collections.abc import Sequence
from typing import Any

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.console.reads import letter_fields, original_order, parse_handle
from dialog_worker.errors import ValidationError
from dialog_worker.ops import dead_letters as dlq
from dialog_worker.store.codec import check_meta, check_text
from dialog_worker.store.keys import Keys
from dialog_worker.store.scripts import Script, source


@dataclasses.dataclass(slots=True)
class Outcome:
    done: int = 0
    skipped: int = 0
    missing: int = 0
    refused: int = 0
    handles_done: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ActionFailed(Exception):
    """An action stopped part way by an error (Redis unreachable, a command refused):
    ``outcome`` counts what was done before it (each letter done is done for good)."""

    def __init__(self, outcome: Outcome, error: BaseException) -> None:
        super().__init__(str(error) or type(error).__name__)
        self.outcome = outcome


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
    With `session_id`, a listed letter of another session is refused; when that session is
    held, the letters go back in front of its waiting messages and it is released
    (`redrive_held`)."""
    outcome = Outcome()
    try:
        await _redrive(client, handles, session_id, outcome)
    except ValidationError:
        raise
    except Exception as exc:
        raise ActionFailed(outcome, exc) from exc
    return outcome


async def _redrive(
    client: DialogClient, handles: Sequence[str], session_id: str | None, outcome: Outcome
) -> None:
    listed = await _load(client, handles, outcome, session_id)
    listed.sort(key=lambda item: original_order({"id": item.entry_id, "seq": _seq(item.fields)}))
    if session_id is not None and listed:
        if await redrive_held(client, session_id, listed, outcome):
            return
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


async def purge(client: DialogClient, handles: Sequence[str]) -> Outcome:
    outcome = Outcome()
    try:
        await _purge(client, handles, outcome)
    except ValidationError:
        raise
    except Exception as exc:
        raise ActionFailed(outcome, exc) from exc
    return outcome


async def _purge(client: DialogClient, handles: Sequence[str], outcome: Outcome) -> None:
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


def _seq(fields: dict[str, str]) -> int | None:
    raw = fields.get("seq")
    return int(raw) if raw is not None and raw.isascii() and raw.isdigit() else None


# ---------------------------------------------------------------------------------------------
# hold / release (lua/hold-3.lua)

_HOLD_SCRIPTS: weakref.WeakKeyDictionary[DialogClient, Script] = weakref.WeakKeyDictionary()


def _hold_script(client: DialogClient) -> Script:
    script = _HOLD_SCRIPTS.get(client)
    if script is None:
        script = _HOLD_SCRIPTS[client] = Script(client.redis, source("hold"))
    return script


async def _hold_call(client: DialogClient, session_id: str, args: list[Any]) -> list[str]:
    keys = client.keys_for(session_id)
    result = await _hold_script(client)(
        keys=[keys.ready, keys.session_prefix, keys.dlq], args=[args[0], session_id, *args[1:]]
    )
    return [v.decode() if isinstance(v, bytes) else str(v) for v in result]


async def hold(client: DialogClient, session_id: str, who: str) -> Outcome:
    """Hold a session: its next messages wait (sequenced) until a release or a redrive."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    note = f"held by {who} at {when} UTC"
    await _hold_call(client, session_id, ["hold", note, client.settings.state_ttl_s])
    return Outcome(done=1)


async def release(client: DialogClient, session_id: str) -> Outcome:
    """Release a held session: its waiting messages go on in order. Not held: skipped."""
    result = await _hold_call(client, session_id, ["release"])
    return Outcome(done=1) if result[0] == "released" else Outcome(skipped=1)


async def redrive_held(
    client: DialogClient, session_id: str, listed: Sequence[_Listed], outcome: Outcome
) -> bool:
    """Put the listed letters of a held session back in front of its waiting messages, in
    the order given, and release it, in one script call. False (nothing done) when the
    session is not held: the caller re-sends them as new messages instead. A letter that
    cannot be re-sent as it is counts as skipped and stays."""
    args: list[Any] = ["redrive", client.settings.dedupe_ttl_s, 0]
    sent: list[_Listed] = []
    skipped = 0
    for item in listed:
        entry = await client.entries.one(item.keys.dlq, item.entry_id)
        if entry is None:
            outcome.missing += 1
            continue
        try:
            send = dlq.resend_fields(
                client, item.keys, dlq.handle_of(client, item.keys, entry.id), entry
            )
            sid, text, msg_id = send["session_id"], send["text"], send["msg_id"]
            meta: dict[str, str] = send["meta"]
            check_text(text, client.settings.max_message_bytes)
            for name, value in meta.items():
                check_meta(name, value)
        except ValidationError:
            skipped += 1
            continue
        flat = ["session_id", sid, "text", text, "msg_id", msg_id]
        for name, value in meta.items():
            flat += [name, value]
        args += [entry.id, msg_id, json.dumps(flat, ensure_ascii=False)]
        sent.append(item)
    if not sent:
        # Nothing can go back (gone or refused): the session stays as it is, held or not.
        outcome.skipped += skipped
        return True
    args[2] = len(sent)
    result = await _hold_call(client, session_id, args)
    if result[0] == "not_held":
        return False
    outcome.skipped += skipped
    if result[0] == "busy":
        outcome.skipped += len(sent)
        return True
    inserted, gone, dups = (int(v) for v in result[1:4])
    outcome.done += inserted + dups
    outcome.missing += gone
    if not gone:
        outcome.handles_done += [item.handle for item in sent]
    return True


async def cancel(client: DialogClient, session_id: str, msg_id: str) -> Outcome:
    """Cancel one message by its msg_id (DialogClient.cancel): done when it was waiting or
    running, skipped when it had already ended or is not there (the mark is kept anyway: a
    message with that msg_id arriving later ends cancelled)."""
    result = await client.cancel(session_id, msg_id)
    return Outcome(done=1) if result.status == "cancelled" else Outcome(skipped=1)
