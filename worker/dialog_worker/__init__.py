"""dialog-worker: lossless, per-session ordered processing of chatbot messages on Redis Streams.

For applications: `DialogClient` (send, ask, replies, ack, state) and `Reply`;
`SyncDialogClient` (send, ask, state) for code without an event loop. For engines:
the `Engine` protocol, `TransientError` and `PermanentError`, `emit` to stream a reply as it
is written, `cancelled()` for a plain step to notice that its message was cancelled, and
`schedule` / `cancel_timer` for messages to the step's own session later, `model_call` and
`usage` for calls to a model (shared rate limits, usage metering, budgets), `RateLimited` for a
provider's 429 and `BudgetExceeded` (docs/engine.md).
"""

from dialog_worker.client.dialog_client import CancelResult, DialogClient, SendResult
from dialog_worker.client.partial_reader import StreamEvent
from dialog_worker.client.replies import Reply
from dialog_worker.client.session_events import SessionEvent
from dialog_worker.client.sync import SyncDialogClient
from dialog_worker.engine.cancellation import cancelled
from dialog_worker.engine.emit import emit
from dialog_worker.engine.model_calls import model_call, usage
from dialog_worker.engine.protocol import Engine
from dialog_worker.engine.timers import cancel_timer, schedule
from dialog_worker.errors import (
    BudgetExceeded,
    PermanentError,
    RateLimited,
    ReplyStreamError,
    ReplyTimeout,
    TransientError,
    UncertainSendError,
)
from dialog_worker.version import __version__

__all__ = [
    "BudgetExceeded",
    "CancelResult",
    "DialogClient",
    "Engine",
    "PermanentError",
    "RateLimited",
    "Reply",
    "ReplyStreamError",
    "ReplyTimeout",
    "SendResult",
    "SessionEvent",
    "StreamEvent",
    "SyncDialogClient",
    "TransientError",
    "UncertainSendError",
    "__version__",
    "cancel_timer",
    "cancelled",
    "emit",
    "model_call",
    "schedule",
    "usage",
]
