"""Environments with one deliberate defect each, for ``tests/test_env_check.py``.

Importable as ``env_check_envs`` (pytest puts ``tests/`` on ``sys.path``), so the check
resolves them by ``env_check_envs:ClassName`` specs, as a user's ``module:Class``.
"""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any, ClassVar

from train.envs.base import Environment, StepResult, Task, parse_action, tool_response
from train.envs.tools import function_tool_env

_CALLS = itertools.count()
"""Process-wide step counter: what makes ``NoisyEnv`` non-deterministic."""


class CounterEnv(Environment):
    """A deterministic native env: ``count`` counts steps, an answer ends the episode with
    reward 1 when it is the task's answer; the ``add`` tool adds ``n`` to a total."""

    name: ClassVar[str] = "counter"

    def __init__(self) -> None:
        self.task: Task | None = None
        self.steps = 0
        self.total = 0
        self.done = False

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]] | None:
        return [{"type": "function", "function": {
            "name": "add", "description": "Add n to the total.",
            "parameters": {"type": "object", "properties": {
                "n": {"type": "integer"}, "mode": {"type": "string", "enum": ["up", "down"]}},
                "required": ["n"], "additionalProperties": False}}}]

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        return [Task(f"counter-{seed}-{i}", cls.name, f"Task {i}: add things.", str(i),
                     max_steps=6) for i in range(n)]

    def reset(self, task: Task) -> str:
        self.task, self.steps, self.total, self.done = task, 0, 0, False
        return task.prompt

    def observe(self, text: str) -> str:
        """The observation of a tool step (``NoisyEnv`` adds noise here)."""
        return text

    def reward_parts(self, reward: float) -> dict[str, float]:
        """The reward parts of a step."""
        return {"reward": reward}

    def step(self, action_text: str) -> StepResult:
        assert self.task is not None
        if self.done:
            return StepResult("over", True, self.reward_parts(0.0))
        self.steps += 1
        action = parse_action(action_text)
        reward = 0.0
        if action.kind == "answer":
            self.done = True
            reward = float(action.answer == self.task.answer)
            observation = ""
        elif action.kind == "tool_call" and isinstance((action.arguments or {}).get("n"), int):
            self.total += int((action.arguments or {})["n"])
            observation = tool_response(str(self.total))
        else:
            observation = tool_response("error: bad call")
        if self.steps >= self.task.max_steps:
            self.done = True
        return StepResult(self.observe(observation), self.done, self.reward_parts(reward))

    def snapshot(self) -> bytes:
        assert self.task is not None
        return json.dumps({"task": self.task.task_id, "prompt": self.task.prompt,
                           "answer": self.task.answer, "steps": self.steps,
                           "total": self.total, "done": self.done}).encode()

    def restore(self, state: bytes) -> None:
        data = json.loads(state)
        self.task = Task(data["task"], self.name, data["prompt"], data["answer"], max_steps=6)
        self.steps, self.total, self.done = data["steps"], data["total"], data["done"]


class NoisyEnv(CounterEnv):
    """Not deterministic: the observation of every tool step after the third carries a
    process-wide call count, which no restore brings back."""

    def observe(self, text: str) -> str:
        return text if self.steps <= 3 else f"{text} #{next(_CALLS)}"


class RaisingEnv(CounterEnv):
    """Raises for a malformed action instead of answering it."""

    def step(self, action_text: str) -> StepResult:
        if parse_action(action_text).kind == "malformed":
            raise KeyError("no tool_call block")
        return super().step(action_text)


class StrSnapshotEnv(CounterEnv):
    """``snapshot()`` returns a str, not bytes."""

    def snapshot(self) -> bytes:
        return super().snapshot().decode()  # type: ignore[return-value]


class BadSchemaEnv(CounterEnv):
    """A tool whose parameters are not valid JSON Schema (``"type": "integr"``)."""

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]] | None:
        return [{"type": "function", "function": {
            "name": "add", "description": "Add n.",
            "parameters": {"type": "object", "properties": {"n": {"type": "integr"}}}}}]


class MainThreadEnv(CounterEnv):
    """Like a library that installs signal handlers: refuses to be built off the main
    thread."""

    def __init__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal only works in main thread of the main interpreter")
        super().__init__()


class BrokenInitEnv(CounterEnv):
    """Its constructor raises."""

    def __init__(self) -> None:
        raise OSError("cannot reach the sandbox")


def upper(text: str) -> str:
    """Upper-case a string."""
    return text.upper()


def repeat(text: str, times: int = 2) -> str:
    """Repeat a string."""
    return text * max(0, min(times, 5))


def _reward(answer: str, task: Task) -> float:
    return float(answer == task.answer)


StrTools = function_tool_env(
    "strtools", tools=[upper, repeat], reward=_reward,
    tasks=[{"prompt": "Upper-case 'abc'.", "answer": "ABC"},
           {"prompt": "Repeat 'ab' 3 times.", "answer": "ababab"}])
