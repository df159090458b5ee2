"""Tool environments with exact snapshot and restore.

``make_env(spec, **config)`` builds one from a spec: a built-in name (``calc``,
``python``, ``workflow``, ``sgls``), a name another package installs (entry-point group
``rollout_trees.envs``), a name given to ``register_env`` in this process, or a
``module:Class`` path (``train.envs.registry``: the one resolver). Classes load lazily so
that a sandbox-less machine can still use the pure-Python worlds. An environment whose
``snapshot_strategy`` is not ``native`` is wrapped so that ``snapshot``/``restore`` work
through replay or fork (``train.envs.strategies``).
"""

from __future__ import annotations

from typing import Any

from train.envs.base import Environment, ParsedAction, StepResult, Task, parse_action
from train.envs.registry import (
    BUILTIN,
    EnvSpecError,
    canonical_spec,
    env_names,
    register_env,
    resolve_env,
    spec_of,
    unregister_env,
)

ENVIRONMENTS = BUILTIN
"""The built-in environments, name -> ``module:Class`` (``env_names()`` lists every name
that resolves, installed and registered ones included)."""


def env_class(spec: str) -> type[Environment]:
    """The ``Environment`` class of ``spec`` (``EnvSpecError``, a ``ValueError``, in one line
    when it does not resolve)."""
    return resolve_env(spec)


def make_env(spec: str, **config: Any) -> Environment:
    """An environment instance of ``spec``, remembering the spec (``spec_of``: what the
    store records for its trees; ``canonical_spec``: a registered name's importable path),
    with snapshots through its ``snapshot_strategy``."""
    from train.envs.strategies import with_snapshots

    cls = resolve_env(spec)
    if cls.snapshot_strategy == "fork":  # built in its worker process, never in this one
        from train.envs.fork import make_fork_env

        return make_fork_env(canonical_spec(spec), cls, **config)
    env = cls(**config)
    env.spec = canonical_spec(spec)
    return with_snapshots(env)


__all__ = ["ENVIRONMENTS", "EnvSpecError", "Environment", "ParsedAction", "StepResult",
           "Task", "env_class", "env_names", "make_env", "parse_action", "register_env",
           "spec_of", "unregister_env"]
