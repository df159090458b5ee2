"""The pieces ``train.envs.check.check_env`` is made of: the actions a check sends to an
environment (``Actor``: the expert's, random tool calls from the declared schemas, answers,
``MALFORMED_ACTIONS``), one step checked (``checked_step``: the exception or the malformed
result named with the action), two outcomes of one action compared (``diverging_field``),
the rules ``generate_tasks`` must keep (``validate_tasks``), and the failure (``CheckFailed``,
``guard``) and timing helpers the checks share.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from train.envs.base import Environment, StepResult, Task

MALFORMED_ACTIONS: tuple[str, ...] = (
    "",
    "I should call a tool now.",
    "<tool_call>{not json</tool_call>",
    "<tool_call>[1, 2, 3]</tool_call>",
    '<tool_call>{"name": 7}</tool_call>',
    '<tool_call>{"name": "x", "arguments": [1]}</tool_call>',
    "<tool_call>" + "[" * 300 + "</tool_call>",
    "<answer>never closed",
    "</tool_response>\x00\x1b[31m<tool_response>",
    "caf\u00e9 \u2603 " * 4000,
)
"""Malformed or hostile action texts: an env answers each with an observation, never an
exception."""
_STRINGS = ("", "a", "hello world", "42", "2 + 3", "x" * 40, "caf\u00e9 \u2603")


class CheckFailed(Exception):
    """A check's failure, its one-line message."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:400] if text else ""


def raised_message(what: str, exc: BaseException) -> str:
    return f"{what} raised {type(exc).__name__}: {first_line(exc)}"


@contextmanager
def guard(what: str) -> Iterator[None]:
    """Turn an exception of the env into ``CheckFailed`` naming ``what`` and the exception."""
    try:
        yield
    except CheckFailed:
        raise
    except Exception as exc:
        raise CheckFailed(raised_message(what, exc)) from None


def quote_action(action: str) -> str:
    return repr(action if len(action) <= 40 else action[:40] + "...")


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def to_ms(seconds: float) -> float:
    return seconds * 1000.0


def fmt_ms(ms: float) -> str:
    return f"{ms:.2g} ms" if ms < 0.1 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def random_arguments(parameters: Any, rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Random arguments that fit a tool's JSON-Schema ``parameters`` (required ones always,
    optional ones half the time; enums, ``const`` and the JSON types)."""
    if not isinstance(parameters, dict):
        return {}
    props = parameters.get("properties")
    if not isinstance(props, dict):
        return {}
    required = parameters.get("required")
    required = set(required) if isinstance(required, list) else set()
    return {key: random_value(spec, rng, depth + 1) for key, spec in props.items()
            if key in required or rng.random() < 0.5}


def random_value(spec: Any, rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value of the schema ``spec``'s type (a string when it names none)."""
    if not isinstance(spec, dict):
        return rng.choice(_STRINGS)
    if isinstance(spec.get("enum"), list) and spec["enum"]:
        return rng.choice(spec["enum"])
    if "const" in spec:
        return spec["const"]
    kind = spec.get("type")
    if isinstance(kind, list):
        kind = rng.choice(kind) if kind else None
    low, high = spec.get("minimum", -5), spec.get("maximum", 100)
    if not isinstance(low, int | float) or not isinstance(high, int | float) or low > high:
        low, high = -5, 100
    if kind == "integer":
        return rng.randint(math.ceil(low), math.floor(high)) if math.ceil(low) <= high \
            else int(low)
    if kind == "number":
        return round(rng.uniform(low, high), 3)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        if depth > 3:
            return []
        return [random_value(spec.get("items"), rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "object":
        return random_arguments(spec, rng, depth) if depth <= 3 else {}
    return rng.choice(_STRINGS)


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call in the text protocol."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@dataclass
class Actor:
    """Actions for a check: the expert's with probability ``p_expert``, else random ones
    (tool calls from ``schemas``, sometimes with a wrong argument or an unknown tool name;
    answers; malformed text)."""

    rng: random.Random
    schemas: list[dict[str, Any]]
    task: Task
    p_expert: float = 0.0

    def next_action(self, env: Environment) -> str:
        """The next action text in ``env``'s current state."""
        rng = self.rng
        if self.p_expert > 0 and rng.random() < self.p_expert:
            with guard("expert_action()"):
                action = env.expert_action()
            if not isinstance(action, str):
                raise CheckFailed(f"expert_action() returned {type(action).__name__}, not str")
            return action
        roll = rng.random()
        if roll < 0.15:
            gold = self.task.answer if self.task.answer is not None and rng.random() < 0.5 \
                else rng.choice(_STRINGS)
            return f"<answer>{gold}</answer>"
        if roll < 0.35 or not self.schemas:
            return rng.choice(MALFORMED_ACTIONS)
        entry = rng.choice(self.schemas)
        fn = entry.get("function") if isinstance(entry, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        name = str(fn.get("name", "tool"))
        arguments = random_arguments(fn.get("parameters"), rng)
        if rng.random() < 0.05:
            name = "no_such_tool"
        elif rng.random() < 0.1:
            arguments["unexpected"] = [1, {"a": None}]
        return call_text(name, arguments)


def checked_step(env: Environment, action: str, times: list[float] | None = None
                 ) -> StepResult:
    """``env.step(action)``, checked: ``CheckFailed`` naming the exception (or the malformed
    result) and the action."""
    start = time.perf_counter()
    with guard(f"step({quote_action(action)})"):
        result = env.step(action)
    if times is not None:
        times.append(time.perf_counter() - start)
    problem = _result_problem(result)
    if problem:
        raise CheckFailed(f"step({quote_action(action)}) returned {problem}")
    return StepResult(*result)


def _result_problem(result: Any) -> str | None:
    if not isinstance(result, tuple) or len(result) != 3:
        return f"{type(result).__name__}, not a StepResult (observation, done, reward_parts)"
    observation, done, parts = result
    if not isinstance(observation, str):
        return f"an observation of type {type(observation).__name__}, not str"
    if not isinstance(done, bool | int):
        return f"done of type {type(done).__name__}, not bool"
    if not isinstance(parts, dict) or "reward" not in parts:
        return 'reward_parts without "reward"'
    for key, value in parts.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(
                value, int | float):
            return f"reward part {key!r} = {value!r}, not a str -> float"
    return None


def diverging_field(recorded: StepResult, again: StepResult) -> str | None:
    """The first field (observation, done, reward_parts) in which two outcomes of one
    action differ, or None when they are identical (rewards compared by ``repr``, so NaN
    equals NaN and 0.0 differs from -0.0)."""
    if recorded.observation != again.observation:
        return "observation"
    if bool(recorded.done) != bool(again.done):
        return "done"

    def key(parts: dict[str, float]) -> list[tuple[str, str]]:
        return sorted((k, repr(float(v))) for k, v in parts.items())

    if key(recorded.reward_parts) != key(again.reward_parts):
        return "reward_parts"
    return None


def validate_tasks(tasks: Any, again: Any, n: int, seed: int) -> str | None:
    """Why the tasks of ``generate_tasks(n, seed)`` (called twice) are not valid, or None."""
    call = f"generate_tasks({n}, {seed})"
    if not isinstance(tasks, list) or len(tasks) != n:
        got = f"{len(tasks)} items" if isinstance(tasks, list) else type(tasks).__name__
        return f"{call} returned {got}, not a list of {n} tasks"
    seen: set[str] = set()
    for i, task in enumerate(tasks):
        if not isinstance(task, Task):
            return f"{call}[{i}] is a {type(task).__name__}, not a Task"
        if not isinstance(task.task_id, str) or not task.task_id or task.task_id in seen:
            return f"{call}[{i}]: task_id {task.task_id!r} is empty, not a string or repeated"
        seen.add(task.task_id)
        if not isinstance(task.prompt, str):
            return f"{call}[{i}]: prompt is not a string"
        if isinstance(task.max_steps, bool) or not isinstance(task.max_steps, int) \
                or task.max_steps < 1:
            return f"{call}[{i}]: max_steps {task.max_steps!r} is not a positive integer"
        try:  # replay snapshots and the store record tasks as strict JSON
            json.dumps(asdict(task), allow_nan=False)
        except (TypeError, ValueError) as exc:
            return f"{call}[{i}] ({task.task_id}) is not JSON-able: {first_line(exc)}"
    if again != tasks:
        first = next((i for i, (a, b) in enumerate(zip(tasks, again, strict=False)) if a != b),
                     0)
        return f"{call} is not deterministic: task {first} differs between two calls"
    return None


__all__ = ["MALFORMED_ACTIONS", "Actor", "CheckFailed", "call_text", "checked_step",
           "diverging_field", "first_line", "fmt_ms", "guard", "percentile", "quote_action",
           "raised_message", "random_arguments", "random_value", "to_ms", "validate_tasks"]
