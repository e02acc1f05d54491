"""dialog-worker: lossless, per-session ordered processing of chatbot messages on Redis Streams.

For applications: `DialogClient` (send, ask, replies, ack, state) and `Reply`;
`SyncDialogClient` (send, ask, state) for code without an event loop. For engines:
the `Engine` protocol, `TransientError` and `PermanentError`, `emit` to stream a reply as it
is written, `cancelled()` for a plain step to notice that its message was cancelled, and
`schedule` / `cancel_timer` for messages to the step's own session later (docs/engine.md).
"""

from dialog_worker.cancellation import cancelled
from dialog_worker.client import CancelResult, DialogClient, SendResult
from dialog_worker.engine import Engine
from dialog_worker.errors import (
    PermanentError,
    ReplyStreamError,
    ReplyTimeout,
    TransientError,
    UncertainSendError,
)
from dialog_worker.partials import StreamEvent
from dialog_worker.replies import Reply
from dialog_worker.session_events import SessionEvent
from dialog_worker.streaming import emit
from dialog_worker.sync_client import SyncDialogClient
from dialog_worker.timers import cancel_timer, schedule
from dialog_worker.version import __version__

__all__ = [
    "CancelResult",
    "DialogClient",
    "Engine",
    "PermanentError",
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
    "schedule",
]
