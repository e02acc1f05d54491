"""dialog-worker: lossless, per-session ordered processing of chatbot messages on Redis Streams.

For applications: `DialogClient` (send, ask, replies, ack, state) and `Reply`. For engines:
the `Engine` protocol, `TransientError` and `PermanentError` (docs/engine.md).
"""

# Set before the imports below: worker.pipeline reads it from here.
__version__ = "0.1.0"

from worker.client import DialogClient, SendResult
from worker.engine import Engine
from worker.errors import PermanentError, ReplyStreamError, ReplyTimeout, TransientError
from worker.replies import Reply

__all__ = [
    "DialogClient",
    "Engine",
    "PermanentError",
    "Reply",
    "ReplyStreamError",
    "ReplyTimeout",
    "SendResult",
    "TransientError",
    "__version__",
]
