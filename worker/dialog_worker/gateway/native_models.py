"""The bodies and answers of the gateway's own routes (gateway/native.py) as pydantic models, for
the OpenAPI document (gateway/openapi.py); the other answers are the client's own result types
(`CancelResult`, `ResumeResult`). The handlers keep their checks (and their 400 texts): these
models only say what the checks accept."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from dialog_worker.client.interrupts import PendingInterrupt


class MessageIn(BaseModel):
    text: str = Field(description="the user's message (not blank)")
    msg_id: str | None = Field(None, description="a new random one when absent; reuse it to retry")
    meta: dict[str, str] | None = Field(None, description="extra text fields for the engine")
    multitask: Literal["enqueue", "reject", "interrupt", "coalesce", "merge"] | None = None
    expires_at: float | None = Field(None, description="unix seconds: ends expired if later")
    deliver_at: float | None = Field(None, description="unix seconds, at most 366 days ahead")


class Sent(BaseModel):
    session_id: str
    msg_id: str
    entry_id: str
    stream: str = Field(description="the path of the answer's stream")


class ResumeIn(BaseModel):
    value: Any = Field(description="any JSON, at most 64 KiB: what interrupt() returns")


class Pending(BaseModel):
    session_id: str
    pending: list[PendingInterrupt]


class Health(BaseModel):
    ok: bool
