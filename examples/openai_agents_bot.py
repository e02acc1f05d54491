"""An OpenAI Agents SDK agent as a dialog engine (docs/engine.md, "Agent frameworks").

    pip install 'dialog-worker[openai-agents]'
    python -m dialog_worker.bench.fake_provider --port 8400 &      # or a real provider
    PYTHONPATH=examples DIALOG_ENGINE=openai_agents_bot:engine dialog-worker run &
    dialog-worker ask u1 "please lookup_order A-17"
    dialog-worker ask u1 "refund A-17"          # outcome "awaiting": a person approves refunds
    dialog-worker resume u1 INTERRUPT_ID true   # the refund is made, once

The agent is plain Agents SDK code; the last line makes it an engine. ``LLM_BASE_URL``,
``LLM_API_KEY`` and ``LLM_MODEL`` choose the model (default: the fake provider).
"""

from __future__ import annotations

import shop
from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from dialog_worker.adapters import from_openai_agent

set_tracing_disabled(True)  # the SDK's traces go to OpenAI's servers otherwise

base_url, api_key, model_name = shop.settings()
# max_retries=0: a 429 reaches the worker at once, which pauses the limit key for everyone.
client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)

agent = Agent(
    name="shop support",
    instructions=shop.INSTRUCTIONS,
    model=OpenAIChatCompletionsModel(model=model_name, openai_client=client),
    tools=[
        function_tool(shop.lookup_order),
        function_tool(shop.open_ticket),
        function_tool(shop.refund, needs_approval=True),
    ],
)

engine = from_openai_agent(agent, limit_key=f"llm:{model_name}")
