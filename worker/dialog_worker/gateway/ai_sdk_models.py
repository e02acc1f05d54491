"""The bodies of the AI SDK door's routes (gateway/ai_sdk.py) as pydantic models, for the OpenAPI
document (gateway/openapi.py). The handlers keep their own checks (and their 400 texts): these
models only say what the checks accept."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class UIMessage(BaseModel):
    id: str = Field(description="the message's id: a user message's is its msg_id")
    role: Literal["user", "assistant", "system"]
    parts: list[dict[str, Any]] = Field(description="the AI SDK's message parts (text, tool...)")


class ChatIn(BaseModel):
    """What `DefaultChatTransport` posts."""

    id: str = Field(description="the chat id: the session id")
    messages: list[UIMessage] | None = Field(None, description="the conversation; the last counts")
    message: UIMessage | None = Field(None, description="only the last message, instead")
    trigger: str | None = Field(None, description="submit-message or regenerate-message")
    messageId: str | None = None
    multitask: Literal["enqueue", "reject", "interrupt", "coalesce", "merge"] | None = None


class StopIn(BaseModel):
    messageId: str | None = Field(
        None, description="the user or assistant message to stop; none: the one in progress"
    )


class Stopped(BaseModel):
    session_id: str
    msg_id: str | None
    status: str = Field(description="cancelled, finished, pending, or none (nothing to stop)")
