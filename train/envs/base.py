"""The environment interface and the text protocol shared by every tool world.

Protocol (the one Qwen/Hermes-style chat models emit):

* a tool call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* the environment answers ``<tool_response>...</tool_response>``;
* the final answer is ``<answer>...</answer>``.

An environment implements ``reset(task) -> observation``,
``step(action_text) -> StepResult``, ``snapshot() -> bytes`` and
``restore(bytes)``. Restore-then-step is deterministic: the same snapshot and
the same action give byte-identical observations and reward parts. A malformed
action gets a deterministic error observation, never an exception; a per-task
step limit ends the episode with reward 0.

``reward_parts`` always holds ``"reward"`` (the scalar outcome, set on the
step that ends the episode, 0.0 before) plus any environment-specific parts.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Task:
    """One task instance: the prompt, the gold answer, and a JSON-able config."""

    task_id: str
    env: str
    prompt: str
    answer: str | None = None
    max_steps: int = 8
    config: dict[str, Any] = field(default_factory=dict)


class StepResult(NamedTuple):
    observation: str
    done: bool
    reward_parts: dict[str, float]


ActionKind = Literal["tool_call", "answer", "malformed"]


@dataclass(frozen=True)
class ParsedAction:
    """An action text split into what the environment acts on."""

    kind: ActionKind
    name: str | None = None
    arguments: dict[str, Any] | None = None
    answer: str | None = None
    error: str | None = None


def parse_action(text: str) -> ParsedAction:
    """Parse one step's text: the first ``<tool_call>`` or ``<answer>`` block wins.

    Anything else (no block, bad JSON, a call without a string ``name`` or
    with non-object ``arguments``) is ``malformed`` with an ``error`` message.
    """
    call = TOOL_CALL_RE.search(text)
    answer = ANSWER_RE.search(text)
    if call and (not answer or call.start() < answer.start()):
        try:
            payload = json.loads(call.group(1))
        except json.JSONDecodeError as exc:
            return ParsedAction("malformed", error=f"tool call is not valid JSON: {exc.msg}")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ParsedAction("malformed", error='tool call needs a string "name"')
        args = payload.get("arguments", {})
        if not isinstance(args, dict):
            return ParsedAction("malformed", error='"arguments" must be a JSON object')
        return ParsedAction("tool_call", name=payload["name"], arguments=args)
    if answer:
        return ParsedAction("answer", answer=answer.group(1).strip())
    return ParsedAction("malformed", error="expected <tool_call>{...}</tool_call> or "
                                           "<answer>...</answer>")


def tool_response(content: str) -> str:
    return f"<tool_response>{content}</tool_response>"


def error_response(message: str) -> str:
    return tool_response(f"error: {message}")


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


def check_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """Check ``arguments`` against a JSON-schema object (types, required, enum, extras).

    Covers the subset tool schemas use: ``properties`` with ``type`` (and
    ``enum``, ``items.type``), ``required`` and ``additionalProperties: false``.
    Returns an error message, or None when the arguments conform.
    """
    props: dict[str, Any] = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in arguments:
            return f"missing required argument {key!r}"
    for key, value in arguments.items():
        if key not in props:
            if schema.get("additionalProperties", True) is False:
                return f"unknown argument {key!r}"
            continue
        spec = props[key]
        expected = spec.get("type")
        if expected is not None:
            types = _JSON_TYPES[expected]
            ok = isinstance(value, types) and not (
                expected in ("integer", "number") and isinstance(value, bool))
            if not ok:
                return f"argument {key!r} must be of type {expected}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}"
        item_type = spec.get("items", {}).get("type")
        if item_type and isinstance(value, list) and not all(
                isinstance(v, _JSON_TYPES[item_type]) for v in value):
            return f"argument {key!r} must be a list of {item_type}"
    return None


class Environment(ABC):
    """A tool world with exact snapshot and restore (see the module docstring)."""

    name: ClassVar[str]

    @abstractmethod
    def reset(self, task: Task) -> str:
        """Start an episode of ``task``; returns the first observation (the prompt)."""

    @abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply one action; never raises for a malformed or hostile action."""

    @abstractmethod
    def snapshot(self) -> bytes:
        """The whole episode state, compact, enough to ``restore`` without replay by the caller."""

    @abstractmethod
    def restore(self, state: bytes) -> None:
        """Return to a state from ``snapshot`` (possibly taken by another instance)."""

    @abstractmethod
    def expert_action(self) -> str:
        """The scripted expert's next action text in the current state."""

    @classmethod
    @abstractmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        """``n`` tasks from a seeded generator (the same seed gives the same tasks)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most worlds hold no resources
        """Release resources (subprocesses); the default holds none."""
