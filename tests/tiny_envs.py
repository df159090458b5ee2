"""Small user environments for ``rtrees policy init --env module:Class`` tests
(``tests/test_policy_init_custom.py``).

Importable as ``tiny_envs`` (pytest puts ``tests/`` on ``sys.path``), so specs name them
as a user's ``module:Class``: ``tiny_envs:WordEnv`` has a scripted expert,
``tiny_envs:NoExpertEnv`` does not.
"""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

from train.envs.base import Environment, StepResult, Task, parse_action, tool_response

WORDS = ("apple", "river", "stone", "cloud", "lemon", "tiger", "piano", "mango")


class WordEnv(Environment):
    """Look up a hidden word, then answer it: ``<tool_call>{"name": "look", "arguments":
    {}}</tool_call>`` shows it, ``<answer>WORD</answer>`` ends the episode with reward 1
    when it is the word. Native snapshots; two steps for the expert."""

    name: ClassVar[str] = "word"

    def __init__(self) -> None:
        self.task: Task | None = None
        self.steps = 0
        self.looked = False
        self.done = False

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        rng = random.Random(seed)
        words = [rng.choice(WORDS) for _ in range(n)]
        return [Task(f"word-{seed}-{i}", cls.name,
                     f"Task {seed}-{i}: look up the word, then answer it.", word, max_steps=4)
                for i, word in enumerate(words)]

    def reset(self, task: Task) -> str:
        self.task, self.steps, self.looked, self.done = task, 0, False, False
        return task.prompt

    def step(self, action_text: str) -> StepResult:
        assert self.task is not None
        if self.done:
            return StepResult(tool_response("error: episode is over"), True, {"reward": 0.0})
        self.steps += 1
        action = parse_action(action_text)
        reward, observation = 0.0, ""
        if action.kind == "answer":
            self.done = True
            reward = float(action.answer == self.task.answer)
        elif action.kind == "tool_call" and action.name == "look":
            self.looked = True
            observation = tool_response(str(self.task.answer))
        else:
            observation = tool_response("error: call look, or answer")
        self.done = self.done or self.steps >= self.task.max_steps
        return StepResult(observation, self.done, {"reward": reward})

    def expert_action(self) -> str:
        assert self.task is not None
        if not self.looked:
            return '<tool_call>{"name": "look", "arguments": {}}</tool_call>'
        return f"<answer>{self.task.answer}</answer>"

    def snapshot(self) -> bytes:
        assert self.task is not None
        return json.dumps({"task": self.task.__dict__, "steps": self.steps,
                           "looked": self.looked, "done": self.done}).encode()

    def restore(self, state: bytes) -> None:
        data = json.loads(state)
        self.task = Task(**data["task"])
        self.steps, self.looked, self.done = data["steps"], data["looked"], data["done"]


class NoExpertEnv(WordEnv):
    """``WordEnv`` without a scripted expert (``Environment.expert_action``'s default)."""

    name: ClassVar[str] = "word-no-expert"
    expert_action = Environment.expert_action
