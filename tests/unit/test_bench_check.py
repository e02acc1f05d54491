"""The bench's correctness check goes by msg_id and send order, never by the seq a send
returned (workers assign seq at intake in contract v2)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

from dialog_worker.bench.check import _session
from dialog_worker.bench.workload import Sent


class Reader:
    def __init__(self, order: list[str], sid: str = "s") -> None:
        self.order = {sid: order}
        self.count = Counter((sid, m) for m in order)
        self.dead_lettered: set[tuple[str, str]] = set()


def state(msg_ids: list[str]) -> dict[str, Any]:
    history = [{"seq": i + 1, "msg_id": m, "user": "", "bot": ""} for i, m in enumerate(msg_ids)]
    return {"history": history, "version": len(msg_ids), "applied_seq": len(msg_ids)}


TARGET = SimpleNamespace(system="ours", settings=SimpleNamespace(history_limit=50))
# What a v2 send returns carries no seq: the check must not need one.
SENT = [Sent("s", 0, m, "t", 0.0, 0) for m in ("a", "b", "c")]


def test_in_order_replies_and_history_pass_whatever_seq_the_send_returned() -> None:
    found = _session(TARGET, "s", list(SENT), Reader(["a", "b", "c"]), state(["a", "b", "c"]), True)
    assert +found == Counter()


def test_a_reply_or_turn_out_of_send_order_is_counted() -> None:
    late_reply = _session(
        TARGET, "s", list(SENT), Reader(["a", "c", "b"]), state(["a", "b", "c"]), True
    )
    assert late_reply["out_of_order"] == 1
    late_turn = _session(
        TARGET, "s", list(SENT), Reader(["a", "b", "c"]), state(["b", "a", "c"]), True
    )
    assert late_turn["out_of_order"] == 1


def test_missing_and_extra_replies_and_lost_messages_are_counted() -> None:
    reader = Reader(["a", "a", "c"])
    found = _session(TARGET, "s", list(SENT), reader, state(["a", "c"]), True)
    assert (found["missing_replies"], found["extra_replies"], found["lost"]) == (1, 1, 1)
    assert found["not_applied"] == 1
