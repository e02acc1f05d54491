"""The tools of the agent examples (openai_agents_bot.py, pydantic_ai_bot.py,
langgraph_bot.py): a tiny shop with orders, support tickets and refunds, the same for the
three frameworks.

Tickets and refunds are side effects: each one appends a line to a ledger file
(``SHOP_LEDGER``, default ``shop-ledger.txt``), where a real shop would call its ticketing or
payment API. The adapters run each tool call once per message, whatever kills or re-runs the
step, so each ticket or refund is one line.
"""

from __future__ import annotations

import os
import threading

ORDERS = {"A-17": ("headphones", 80), "B-2": ("cable", 9)}
INSTRUCTIONS = (
    "You are the support assistant of a small shop. Use the tools to look orders up, open "
    "support tickets and refund orders. Answer briefly."
)

_LOCK = threading.Lock()


def _ledger(line: str) -> None:
    with _LOCK, open(os.environ.get("SHOP_LEDGER", "shop-ledger.txt"), "a", encoding="utf-8") as f:
        f.write(line + "\n")


def lookup_order(order_id: str) -> str:
    """What the order holds and what was paid."""
    item = ORDERS.get(order_id)
    return f"order {order_id}: {item[0]}, {item[1]} EUR" if item else f"no order {order_id}"


def open_ticket(order_id: str) -> str:
    """Open a support ticket about the order (a side effect: one line in the ledger)."""
    _ledger(f"ticket {order_id}")
    return f"ticket T-{order_id} opened"


def refund(order_id: str) -> str:
    """Refund the order (a side effect: one line in the ledger). The agents ask a person to
    approve each refund first."""
    item = ORDERS.get(order_id)
    if item is None:
        return f"no order {order_id}"
    _ledger(f"refund {order_id} {item[1]}")
    return f"refunded {item[1]} EUR for {order_id}"


def settings() -> tuple[str, str, str]:
    """The model's endpoint, key and name: ``LLM_BASE_URL`` (default the shipped fake provider,
    ``python -m dialog_worker.bench.fake_provider``, on port 8400), ``LLM_API_KEY``,
    ``LLM_MODEL``."""
    return (
        os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8400/v1"),
        os.environ.get("LLM_API_KEY", "fake"),
        os.environ.get("LLM_MODEL", "fake-1"),
    )
