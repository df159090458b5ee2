"""An agent program built on an unmodified framework: smolagents' ``ToolCallingAgent`` with
its ``OpenAIServerModel`` pointed at the endpoint (``tests/test_agent_env.py``)."""

from __future__ import annotations

from typing import Any

from agent_programs import HTTP, TASKS, TOOLS, calc_tool

__all__ = ["TASKS", "TOOLS", "run"]

def run(task: Any, base_url: str, api_key: str) -> float:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression: integers, + - *.

        Args:
            expr: the expression, e.g. 3+4
        """
        return calc_tool(expr)

    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=api_key,
                              client_kwargs={"max_retries": 0, "http_client": HTTP})
    agent = ToolCallingAgent(tools=[calc], model=model, max_steps=2, verbosity_level=-1)
    out = agent.run(task.prompt)
    return float(str(out).strip() == task.answer)
