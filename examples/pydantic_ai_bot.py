"""A Pydantic AI agent as a dialog engine (docs/engine.md, "Agent frameworks").

    pip install 'dialog-worker[pydantic-ai]'
    python -m dialog_worker.bench.fake_provider --port 8400 &      # or a real provider
    PYTHONPATH=examples DIALOG_ENGINE=pydantic_ai_bot:engine dialog-worker run &
    dialog-worker ask u1 "please lookup_order A-17"
    dialog-worker ask u1 "refund A-17"          # outcome "awaiting": a person approves refunds
    dialog-worker resume u1 INTERRUPT_ID true   # the refund is made, once

The agent is plain Pydantic AI code; the last line makes it an engine. ``LLM_BASE_URL``,
``LLM_API_KEY`` and ``LLM_MODEL`` choose the model (default: the fake provider).
"""

from __future__ import annotations

import shop
from openai import AsyncOpenAI
from pydantic_ai import Agent, Tool
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from dialog_worker.adapters import from_pydantic_ai

base_url, api_key, model_name = shop.settings()
# max_retries=0: a 429 reaches the worker at once, which pauses the limit key for everyone.
client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)

agent = Agent(
    OpenAIChatModel(model_name, provider=OpenAIProvider(openai_client=client)),
    instructions=shop.INSTRUCTIONS,
    tools=[
        Tool(shop.lookup_order),
        Tool(shop.open_ticket),
        Tool(shop.refund, requires_approval=True),
    ],
)

engine = from_pydantic_ai(agent, limit_key=f"llm:{model_name}")
