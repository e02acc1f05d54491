"""The application's side: `DialogClient` and `SyncDialogClient`, and the readers behind them
(reply events, streamed answers, a session's turns), erasure and browser tokens."""

from dialog_worker.client.dialog_client import CancelResult, DialogClient, SendResult
from dialog_worker.client.sync import SyncDialogClient

__all__ = ["CancelResult", "DialogClient", "SendResult", "SyncDialogClient"]
