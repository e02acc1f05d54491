"""Agent frameworks as dialog engines: `from_openai_agent` (OpenAI Agents SDK),
`from_pydantic_ai` (Pydantic AI), `from_langgraph` (LangGraph); docs/engine.md, "Agent
frameworks". Each imports its framework when called (the extras ``openai-agents``,
``pydantic-ai``, ``langgraph``), never when this package is imported.
"""

from dialog_worker.adapters.langgraph import from_langgraph
from dialog_worker.adapters.openai_agents import from_openai_agent
from dialog_worker.adapters.pydantic_ai import from_pydantic_ai

__all__ = ["from_langgraph", "from_openai_agent", "from_pydantic_ai"]
