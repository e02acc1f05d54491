"""What a reader of a streamed answer shows after its events (the tests' model of a UI)."""

from __future__ import annotations

from dialog_worker import StreamEvent


def shown(events: list[StreamEvent]) -> str:
    """What a UI shows after these events, honouring reset, resync and end."""
    text = ""
    for event in events:
        if event.kind == "delta":
            text += event.text
        elif event.kind == "reset":
            text = ""
        elif event.kind in ("resync", "end"):
            text = event.text
    return text


def streamed(events: list[StreamEvent]) -> str:
    """The text built from the partial events only (no end)."""
    return shown([e for e in events if e.kind != "end"])
