"""Tool schemas, and environments made of plain Python functions (no subclassing).

``check_tool_schemas`` validates what ``Environment.tool_schemas()`` returns: a list of
``{"type": "function", "function": {"name", "description", "parameters"}}`` whose
``parameters`` is a valid JSON Schema object (checked against its meta-schema with the
``jsonschema`` package: a maintained implementation of every draft beats a hand-written
subset).

``function_tool_env`` is the "my tools, my tasks, my reward" case::

    def upper(text: str) -> str:
        "Upper-case a string."
        return text.upper()

    def reward(answer: str, task: Task) -> float:
        return float(answer == task.answer)

    StrTools = function_tool_env("strtools", tools=[upper], tasks="tasks.jsonl",
                                 reward=reward)

It returns an ``Environment`` class (register it with ``register_env`` or name it as
``mymodule:StrTools``). A tool's JSON schema comes from its signature (``str``, ``int``,
``float``, ``bool``, ``list``, ``dict`` annotations; parameters without a default are
required) unless ``tool(fn, parameters=...)`` gives one. The task file is JSONL, one task
per line: ``{"prompt": str, "answer": str | null, "config": {...}, "task_id": str,
"max_steps": int}`` (only ``prompt`` required). A step runs the called function with the
arguments the schema admits and answers its result (``str()``, or JSON for dicts and lists)
as a tool response; a function that raises answers ``error: Type: message`` (the tool's
outcome, not the environment's failure). An answer ends the episode with
``reward(answer, task)``, which must be a finite number. Snapshots replay the actions
(``snapshot_strategy = "replay"``), so the functions must be deterministic given the task.
"""

from __future__ import annotations

import inspect
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, get_type_hints

from train.envs.base import (
    Environment,
    StepResult,
    Task,
    check_arguments,
    clip_quoted,
    error_response,
    parse_action,
    tool_response,
)

MAX_TASK_FILE_BYTES = 64 << 20
"""The largest task file read (a task file is prompts, not a data set)."""
_JSON_TYPE_OF: dict[Any, str] = {str: "string", int: "integer", float: "number",
                                 bool: "boolean", list: "array", dict: "object"}


class ToolSchemaError(ValueError):
    """A tool schema that is not valid (one line naming the tool and the problem)."""


def check_tool_schemas(schemas: Any, env: str = "environment") -> list[dict[str, Any]]:
    """``schemas`` if it is a list of OpenAI function tools whose ``parameters`` are valid
    JSON Schema objects with unique names; ``ToolSchemaError`` naming the first problem."""
    from jsonschema import exceptions, validators

    if not isinstance(schemas, list):
        raise ToolSchemaError(f"{env}: tool_schemas() must return a list, got "
                              f"{type(schemas).__name__}")
    seen: set[str] = set()
    for i, entry in enumerate(schemas):
        where = f"{env}: tool_schemas()[{i}]"
        fn = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(
                fn, dict):
            raise ToolSchemaError(f'{where}: expected {{"type": "function", "function": '
                                  "{...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolSchemaError(f"{where}: the function needs a non-empty string name")
        if name in seen:
            raise ToolSchemaError(f"{where}: tool name {name!r} appears twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type") != "object":
            raise ToolSchemaError(f"{where} ({name}): parameters must be a JSON Schema "
                                  'object ({"type": "object", ...})')
        try:
            validators.validator_for(params).check_schema(params)
        except exceptions.SchemaError as exc:
            path = "/".join(str(p) for p in exc.path) or "(root)"
            raise ToolSchemaError(f"{where} ({name}): parameters are not valid JSON Schema "
                                  f"at {path}: {exc.message}") from None
    return schemas


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description, JSON-Schema parameters and function."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] = field(compare=False)

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": self.parameters}}


def tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
         parameters: dict[str, Any] | None = None) -> Tool:
    """``fn`` as a ``Tool``: its name, its docstring's first line and, unless given, a
    schema from its annotated signature (``ToolSchemaError`` for a parameter whose
    annotation has no JSON type)."""
    tool_name = name or fn.__name__
    doc = (description if description is not None
           else (inspect.getdoc(fn) or "").strip().splitlines()[:1])
    text = doc if isinstance(doc, str) else (doc[0] if doc else "")
    if parameters is None:
        hints = get_type_hints(fn)
        props: dict[str, Any] = {}
        required: list[str] = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            kind = _JSON_TYPE_OF.get(hints.get(p.name))
            if kind is None:
                raise ToolSchemaError(f"tool {tool_name!r}: parameter {p.name!r} needs an "
                                      "annotation of str, int, float, bool, list or dict "
                                      "(or pass parameters=)")
            props[p.name] = {"type": kind}
            if p.default is p.empty:
                required.append(p.name)
        parameters = {"type": "object", "properties": props, "required": required,
                      "additionalProperties": False}
    made = Tool(tool_name, text, parameters, fn)
    check_tool_schemas([made.schema()], f"tool {tool_name!r}")
    return made


def read_task_file(path: str | Path, env: str) -> list[Task]:
    """The tasks of a JSONL task file (module docstring); ``ValueError`` naming the line."""
    p = Path(path)
    try:
        if not p.is_file():
            raise ValueError(f"task file {str(p)!r} is not a regular file")
        if p.stat().st_size > MAX_TASK_FILE_BYTES:
            raise ValueError(f"task file {str(p)!r} is over {MAX_TASK_FILE_BYTES >> 20} MiB")
        lines = p.read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"task file {str(p)!r}: {exc}") from None
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p.name} line {number}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        tasks.append(_task_of(row, where, env, f"{p.stem}-{number}", seen))
    if not tasks:
        raise ValueError(f"task file {str(p)!r} holds no task")
    return tasks


def _task_of(row: Any, where: str, env: str, default_id: str, seen: set[str]) -> Task:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a task is a JSON object")
    unknown = set(row) - {"prompt", "answer", "config", "task_id", "max_steps"}
    if unknown:
        raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    prompt, answer = row.get("prompt"), row.get("answer")
    config, task_id = row.get("config", {}), row.get("task_id", default_id)
    max_steps = row.get("max_steps", 8)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: prompt must be a non-empty string")
    if answer is not None and not isinstance(answer, str):
        raise ValueError(f"{where}: answer must be a string or null")
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config must be an object")
    if not isinstance(task_id, str) or not task_id or task_id in seen:
        raise ValueError(f"{where}: task_id must be a unique non-empty string")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or not 1 <= max_steps \
            <= 1000:
        raise ValueError(f"{where}: max_steps must be an integer in 1..1000")
    seen.add(task_id)
    return Task(task_id, env, prompt, answer, max_steps, config)


class FunctionToolEnv(Environment):
    """The environment ``function_tool_env`` builds (module docstring); subclasses set
    ``TOOLS``, ``TASKS`` and ``REWARD``."""

    name: ClassVar[str] = "function-tools"
    snapshot_strategy = "replay"
    TOOLS: ClassVar[tuple[Tool, ...]] = ()
    TASKS: ClassVar[str | Path | tuple[Task, ...]] = ()
    REWARD: ClassVar[Callable[[str, Task], float] | None] = None
    EXPERT: ClassVar[Callable[[Task, list[tuple[str, str]]], str] | None] = None

    def __init__(self) -> None:
        self._task: Task | None = None
        self._steps = 0
        self._done = False
        self._history: list[tuple[str, str]] = []
        self._by_name = {t.name: t for t in self.TOOLS}

    def expert_action(self) -> str:
        """``expert(task, history)`` of ``function_tool_env``: the next action text given
        the (action, observation) pairs so far."""
        expert = type(self).EXPERT
        if expert is None:
            raise NotImplementedError(f"{self.name} has no scripted expert "
                                      "(function_tool_env(..., expert=...))")
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}: call reset() first")
        return expert(self._task, list(self._history))

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]] | None:
        return [t.schema() for t in cls.TOOLS]

    @classmethod
    def all_tasks(cls) -> list[Task]:
        source = cls.TASKS
        if isinstance(source, str | Path):
            return read_task_file(source, cls.name)
        return list(source)

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        """``n`` tasks: the task list in a seeded order, cycled when ``n`` exceeds it
        (a repeat's id gets ``#k``)."""
        if mix:
            raise ValueError(f"{cls.name}: tasks come from its task list; no option "
                             f"{sorted(mix)[0]!r}")
        tasks = cls.all_tasks()
        order = list(range(len(tasks)))
        random.Random(seed).shuffle(order)
        out: list[Task] = []
        for i in range(n):
            t = tasks[order[i % len(tasks)]]
            rep = i // len(tasks)
            out.append(t if rep == 0 else Task(f"{t.task_id}#{rep}", t.env, t.prompt,
                                               t.answer, t.max_steps, t.config))
        return out

    def reset(self, task: Task) -> str:
        self._task, self._steps, self._done, self._history = task, 0, False, []
        return task.prompt

    def step(self, action_text: str) -> StepResult:
        task = self._task
        if task is None:
            raise RuntimeError(f"{type(self).__name__}: call reset() or restore() first")
        if self._done:
            return StepResult(error_response("episode is over"), True, {"reward": 0.0})
        self._steps += 1
        action = parse_action(action_text)
        if action.kind == "answer":
            self._done = True
            return StepResult("", True, {"reward": self._reward(action.answer or "", task)})
        if action.kind == "malformed":
            observation = error_response(action.error or "malformed action")
        else:
            observation = self._call(action.name or "", action.arguments or {})
        self._history.append((action_text, observation))
        if self._steps >= task.max_steps:
            self._done = True
            return StepResult(observation, True, {"reward": 0.0, "truncated": 1.0})
        return StepResult(observation, False, {"reward": 0.0})

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        found = self._by_name.get(name)
        if found is None:
            return error_response(f"unknown tool {clip_quoted(name)}; the tools are "
                                  f"{', '.join(sorted(self._by_name))}")
        problem = check_arguments(arguments, found.parameters)
        if problem is not None:
            return error_response(problem)
        try:
            result = found.fn(**arguments)
        except Exception as exc:  # the tool's outcome, answered to the agent
            return error_response(f"{type(exc).__name__}: {exc}")
        text = json.dumps(result, default=str) if isinstance(result, dict | list) \
            else str(result)
        return tool_response(text)

    def _reward(self, answer: str, task: Task) -> float:
        reward = type(self).REWARD
        value = 0.0 if reward is None else reward(answer, task)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value):
            raise TypeError(f"{self.name}: reward() returned {value!r}, not a finite number")
        return float(value)


def tool_call(name: str, **arguments: Any) -> str:
    """The action text of a call of tool ``name`` (the shared protocol), e.g. for an
    expert: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def function_tool_env(name: str, tools: Sequence[Tool | Callable[..., Any]],
                      tasks: str | Path | Sequence[Task | dict[str, Any]],
                      reward: Callable[[str, Task], float], *,
                      expert: Callable[[Task, list[tuple[str, str]]], str] | None = None,
                      module: str | None = None) -> type[FunctionToolEnv]:
    """An ``Environment`` class of ``tools`` (functions or ``tool(...)``), ``tasks`` (a
    JSONL file, or tasks / task dicts) and ``reward(answer, task)``; ``expert(task,
    history)``, optional, is a scripted expert (the next action text given the
    (action, observation) pairs so far: ``rtrees policy init`` trains on it). ``module``
    (default: the caller's) is where the class says it lives, so ``module:ClassName``
    resolves."""
    made = tuple(t if isinstance(t, Tool) else tool(t) for t in tools)
    if not made:
        raise ToolSchemaError(f"{name}: an environment needs at least one tool")
    names = [t.name for t in made]
    if len(set(names)) != len(names):
        raise ToolSchemaError(f"{name}: two tools are named alike ({names})")
    task_source: str | Path | tuple[Task, ...]
    if isinstance(tasks, str | Path):
        task_source = tasks
    else:
        seen: set[str] = set()
        task_source = tuple(
            t if isinstance(t, Task) else _task_of(t, f"{name} task {i}", name, f"{name}-{i}",
                                                   seen)
            for i, t in enumerate(tasks))
    if module is None:
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        module = caller.f_globals.get("__name__", __name__) if caller else __name__
    cls_name = "".join(part.capitalize() for part in
                       name.replace("-", "_").replace(".", "_").split("_")) or "Env"
    return type(cls_name, (FunctionToolEnv,), {
        "name": name, "TOOLS": made, "TASKS": task_source, "REWARD": staticmethod(reward),
        "EXPERT": None if expert is None else staticmethod(expert),
        "__module__": module, "__qualname__": cls_name})


__all__ = ["FunctionToolEnv", "Tool", "ToolSchemaError", "check_tool_schemas",
           "function_tool_env", "read_task_file", "tool", "tool_call"]
