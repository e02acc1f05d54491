"""A support agent that looks orders up, asks a person before it refunds, and shows its
progress: the step journal (`once`), interrupts (`interrupt`) and typed events (`emit_event`)
of docs/engine.md, "Agents: tools, approvals and progress".

Run it in a worker:

    DIALOG_ENGINE=agent_engine:RefundAgent PYTHONPATH=examples dialog-worker run

then, from another shell:

    dialog-worker ask u1 "refund A-17"          # outcome "awaiting", with an interrupt_id
    dialog-worker pending u1                    # what u1 waits on (also after a restart)
    dialog-worker resume u1 INTERRUPT_ID true   # approve: the refund is made, once

The "tools" here are plain functions that count their calls (a real agent calls a model and
HTTP APIs); whatever kills or retries the step, each runs once per message.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import dialog_worker

# How often each tool really ran, per order (what a paid API would bill).
CALLS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()

ORDERS = {"A-17": {"item": "headphones", "paid": 80}, "B-2": {"item": "cable", "paid": 9}}
# Refunds above this need a person's approval.
APPROVAL_ABOVE = 20


def lookup_order(order_id: str) -> dict[str, Any]:
    """A tool: an order system's API (here, a dict)."""
    with _LOCK:
        CALLS[f"lookup {order_id}"] += 1
    return ORDERS.get(order_id, {})


def issue_refund(order_id: str, amount: int) -> dict[str, Any]:
    """A tool with a side effect: money leaves, so it must never run twice."""
    with _LOCK:
        CALLS[f"refund {order_id}"] += 1
    return {"refund_id": f"R-{order_id}", "amount": amount}


class RefundAgent:
    async def step(
        self, state: dict[str, Any], message: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        words = message["text"].split()
        new_state = {**state, "step": "AGENT"}
        if len(words) != 2 or words[0] != "refund":
            return new_state, "Say: refund ORDER-ID"
        order_id = words[1]
        dialog_worker.emit_event("tool", {"name": "lookup_order", "state": "running"})
        # Once per message: a re-run (a crash, a retry, the run after the approval) gets the
        # recorded result instead of calling the order system again.
        order = await dialog_worker.once(f"lookup:{order_id}", lookup_order, order_id)
        dialog_worker.emit_event("tool", {"name": "lookup_order", "state": "done"}, keep=True)
        if not order:
            return new_state, f"I cannot find order {order_id}."
        amount = order["paid"]
        if amount > APPROVAL_ABOVE:
            # The first run stops here (an "awaiting" reply event carries the payload); the run
            # after DialogClient.resume gets the person's answer from this call.
            try:
                approved = await dialog_worker.interrupt(
                    {"question": f"Refund {amount} EUR for the {order['item']}?",
                     "choices": [True, False]},
                    timeout_s=24 * 3600,
                )  # fmt: skip
            except dialog_worker.InterruptTimeout:
                return new_state, "Nobody approved the refund in time; it was not made."
            if approved is not True:
                return new_state, "The refund was declined."
        refund = await dialog_worker.once(f"refund:{order_id}", issue_refund, order_id, amount)
        return new_state, f"Refunded {refund['amount']} EUR ({refund['refund_id']})."
