"""dialog-worker: lossless, per-session ordered processing of chatbot messages on Redis Streams.

For applications: `DialogClient` (send, ask, replies, ack, state) and `Reply`;
`SyncDialogClient` (send, ask, state) for code without an event loop. For engines:
the `Engine` protocol, `TransientError` and `PermanentError`, `emit` to stream a reply as it
is written, `cancelled()` for a plain step to notice that its message was cancelled, and
`schedule` / `cancel_timer` for messages to the step's own session later, `model_call` and
`usage` for calls to a model (shared rate limits, usage metering, budgets), `RateLimited` for a
provider's 429 and `BudgetExceeded`; for agents, `once` (a step journal: a tool or model call
is made once per message, whatever re-runs the step), `interrupt` (wait for a person, then go
on: `DialogClient.pending` / `resume`) and `emit_event` (typed events beside the streamed
text) (docs/engine.md).
"""

from dialog_worker.client.dialog_client import CancelResult, DialogClient, SendResult
from dialog_worker.client.interrupts import PendingInterrupt, ResumeResult
from dialog_worker.client.partial_reader import StreamEvent
from dialog_worker.client.replies import Reply
from dialog_worker.client.session_events import SessionEvent
from dialog_worker.client.sync import SyncDialogClient
from dialog_worker.engine.cancellation import cancelled
from dialog_worker.engine.emit import emit, emit_event
from dialog_worker.engine.interrupts import Interrupted, interrupt
from dialog_worker.engine.journal import once
from dialog_worker.engine.model_calls import model_call, usage
from dialog_worker.engine.protocol import Engine
from dialog_worker.engine.timers import cancel_timer, schedule
from dialog_worker.errors import (
    BudgetExceeded,
    InterruptTimeout,
    JournalFull,
    PermanentError,
    RateLimited,
    ReplyStreamError,
    ReplyTimeout,
    TransientError,
    UncertainSendError,
    UnrecordableResult,
)
from dialog_worker.version import __version__

__all__ = [
    "BudgetExceeded",
    "CancelResult",
    "DialogClient",
    "Engine",
    "InterruptTimeout",
    "Interrupted",
    "JournalFull",
    "PendingInterrupt",
    "PermanentError",
    "RateLimited",
    "Reply",
    "ReplyStreamError",
    "ReplyTimeout",
    "ResumeResult",
    "SendResult",
    "SessionEvent",
    "StreamEvent",
    "SyncDialogClient",
    "TransientError",
    "UncertainSendError",
    "UnrecordableResult",
    "__version__",
    "cancel_timer",
    "cancelled",
    "emit",
    "emit_event",
    "interrupt",
    "model_call",
    "once",
    "schedule",
    "usage",
]
