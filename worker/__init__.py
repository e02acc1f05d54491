"""dialog-worker: lossless, per-session ordered processing of chatbot messages on Redis Streams."""

from worker.errors import PermanentError, TransientError

__version__ = "0.1.0"

__all__ = ["PermanentError", "TransientError", "__version__"]
