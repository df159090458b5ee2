"""Tool environments with exact snapshot and restore.

``make_env(name, **config)`` builds one by name; classes load lazily so that a
sandbox-less machine can still use the pure-Python worlds.
"""

from __future__ import annotations

import importlib
from typing import Any

from train.envs.base import Environment, ParsedAction, StepResult, Task, parse_action

ENVIRONMENTS: dict[str, str] = {
    "calc": "train.envs.calc:CalcEnv",
    "python": "train.envs.python_env:PythonEnv",
    "workflow": "train.envs.workflow:WorkflowEnv",
    "sgls": "train.envs.sgls:SglsEnv",
}


def env_class(name: str) -> type[Environment]:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose from {sorted(ENVIRONMENTS)}")
    module, cls = ENVIRONMENTS[name].split(":")
    found: type[Environment] = getattr(importlib.import_module(module), cls)
    return found


def make_env(name: str, **config: Any) -> Environment:
    """An environment instance by registry name (``calc``, ``python``, ``workflow``, ``sgls``)."""
    return env_class(name)(**config)


__all__ = ["ENVIRONMENTS", "Environment", "ParsedAction", "StepResult", "Task", "env_class",
           "make_env", "parse_action"]
