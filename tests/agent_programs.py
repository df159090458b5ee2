"""Agent programs for the tests of ``agent:module:function`` environments and ``rtrees
serve``: each drives the endpoint with the official ``openai`` client, as a user's
program does. Importable as ``agent_programs`` (pytest puts ``tests/`` on ``sys.path``;
subprocesses get it on ``PYTHONPATH``)."""

from __future__ import annotations

import ast
import json
import operator
import random
import time
from typing import Any

from openai import DefaultHttpxClient, OpenAI

HTTP = DefaultHttpxClient()
"""One connection pool for every run: building a client's pool costs ~0.1 s (TLS setup)."""

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression: integers, + - *.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]
TASKS = [{"prompt": "Compute 3+4.", "answer": "7", "max_steps": 4},
         {"prompt": "Compute (12*3)-5.", "answer": "31", "max_steps": 4},
         {"prompt": "Compute 17+25.", "answer": "42", "max_steps": 4}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc_tool(expr: str) -> str:
    """A deterministic calculator (integers, + - *); errors are its answer."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError("only integers and + - *")
    try:
        return str(value(ast.parse(expr, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {type(exc).__name__}"


def _client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=HTTP)


def _loop(task: Any, client: OpenAI, tool: Any, model: str = "policy") -> float:
    messages: list[Any] = [{"role": "user", "content": task.prompt}]
    for _ in range(task.max_steps):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            text = message.content or ""
            answer = text.split("<answer>")[-1].split("</answer>")[0].strip()
            return float(answer == task.answer)
        for call in message.tool_calls:
            try:  # a function tool call (custom tool calls have no ``function``)
                expr = str(json.loads(getattr(call, "function").arguments).get("expr", ""))  # noqa: B009
            except (ValueError, AttributeError):
                expr = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": tool(expr)})
    return 0.0


def calc(task: Any, base_url: str, api_key: str) -> float:
    """Solve an arithmetic task with a calculator tool; reward 1 for the right answer."""
    return _loop(task, _client(base_url, api_key), calc_tool)


def noisy(task: Any, base_url: str, api_key: str) -> float:
    """``calc`` whose tool answers a random number: not deterministic given the task."""
    return _loop(task, _client(base_url, api_key),
                 lambda expr: str(random.random()))


def moody(task: Any, base_url: str, api_key: str) -> float:
    """``calc``, or a failure chosen by ``task.config["mode"]``: ``raise``, ``hang``
    (past its timeout), ``text`` (returns a non-number)."""
    mode = task.config.get("mode")
    client = _client(base_url, api_key)
    if mode is None:
        return _loop(task, client, calc_tool)
    client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": task.prompt}])
    if mode == "raise":
        raise KeyError("the tool server is down")
    if mode == "hang":
        time.sleep(30)
    return "seven"  # type: ignore[return-value]


moody.timeout_s = 2.0  # type: ignore[attr-defined]


def rewriter(task: Any, base_url: str, api_key: str) -> float:
    """Sends a second call whose history is not the first call's: refused by name."""
    client = _client(base_url, api_key)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"},
                                                        {"role": "user", "content": "c"}])
    return 1.0


def silent(task: Any, base_url: str, api_key: str) -> float:
    """Returns without calling the model."""
    return 1.0
