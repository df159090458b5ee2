"""The one resolver of environment specs: built-in names, names registered in this process
(``register_env``), names installed by other packages (the ``rollout_trees.envs`` entry-point
group) and ``module:Class`` paths.

A *spec* is what a user passes as ``--env``, ``TrainConfig.env``, a study's ``env`` param
or a TOML ``env`` key, and what the store records in ``trees.env`` for every tree: every
later job (references, audit, refresh, reuse, scoring, ``env play``, workers, Ray actors)
rebuilds the environment from the stored spec with ``make_env``. So the spec must resolve
in any process:

* a built-in name (``BUILTIN``: ``calc``, ``python``, ``workflow``, ``sgls``);
* an entry-point name: a package declares, in its ``pyproject.toml``,
  ``[project.entry-points."rollout_trees.envs"] myenv = "mypkg.env:MyEnv"``; once installed,
  ``--env myenv`` works in every process;
* ``module:Class`` (``mypkg.env:MyEnv``): importable wherever the module is;
* ``agent:module:function``: an agent program that talks to an OpenAI-compatible endpoint,
  branched call by call (``train.envs.agent.program``);
* a name given to ``register_env(name, target)`` in this process (a notebook): workers
  started with ``fork`` inherit it; spawned ones and Ray actors do not, so prefer an entry
  point or ``module:Class`` there. A class registered by object whose module is importable
  records its ``module:Class`` path instead, which resolves anywhere.

Lookup order: registered in this process, built-in, entry point, then ``module:Class``. A
built-in name cannot be re-registered (the stored ``calc`` must always mean ``CalcEnv``).

Trust: resolving a stored ``module:Class`` spec imports an *installed* module (its top-level
code runs, as ``import`` does) and checks that the attribute is an ``Environment`` subclass
before anything is called; nothing stored in the store is executed, and a spec is a dotted
module path and a class name, nothing else (``SPEC_RE``).

Errors are ``EnvSpecError`` (a ``ValueError``) in one line naming the spec.
"""

from __future__ import annotations

import importlib
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from train.envs.base import Environment

BUILTIN: dict[str, str] = {
    "calc": "train.envs.calc:CalcEnv",
    "python": "train.envs.python_env:PythonEnv",
    "workflow": "train.envs.workflow:WorkflowEnv",
    "sgls": "train.envs.sgls:SglsEnv",
}
ENTRY_POINT_GROUP = "rollout_trees.envs"
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
"""A registered or entry-point name (no ``:``, so it never reads as a path)."""
SPEC_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
                     r":[A-Za-z_][A-Za-z0-9_]*")
"""A ``module:Class`` spec: a dotted module path and one class name."""

_REGISTERED: dict[str, str | type[Environment]] = {}


class EnvSpecError(ValueError):
    """An environment spec that does not resolve to an ``Environment`` (one line)."""


def register_env(name: str, target: str | type[Environment], *, replace: bool = False
                 ) -> None:
    """Make ``name`` resolve to ``target`` (a class, or a ``module:Class`` string) in this
    process. A class whose module is importable (not ``__main__``) is recorded by its path,
    so the name's trees rebuild in any process. ``replace=True`` rebinds a name this
    process registered before; built-in names are never rebound."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise EnvSpecError(f"environment name {name!r}: letters, digits, '_', '-', '.' "
                           "(at most 64, starting with a letter)")
    if name in BUILTIN:
        raise EnvSpecError(f"environment name {name!r} is built in; choose another name")
    if name in _REGISTERED and not replace:
        raise EnvSpecError(f"environment name {name!r} is already registered "
                           "(register_env(..., replace=True) rebinds it)")
    if isinstance(target, str):
        if not SPEC_RE.fullmatch(target):
            raise EnvSpecError(f"register_env({name!r}, {target!r}): a target is a class or "
                               "'module:Class'")
    else:
        _check_class(target, f"register_env({name!r}, ...)")
        target = _importable_path(target) or target  # a path resolves in workers too
    _REGISTERED[name] = target
    resolve_env.cache_clear()


def _importable_path(cls: type[Environment]) -> str | None:
    """``module:Name`` under which ``cls`` itself is importable (its module is not
    ``__main__`` and binds it to ``Name``), else None."""
    import sys

    module = sys.modules.get(cls.__module__)
    if module is None or cls.__module__ == "__main__":
        return None
    names = [cls.__qualname__, *sorted(k for k, v in vars(module).items() if v is cls)]
    for attr in names:
        path = f"{cls.__module__}:{attr}"
        if SPEC_RE.fullmatch(path) and getattr(module, attr, None) is cls:
            return path
    return None


def unregister_env(name: str) -> None:
    """Forget a name ``register_env`` bound (tests, notebooks)."""
    _REGISTERED.pop(name, None)
    resolve_env.cache_clear()


@lru_cache(maxsize=1)
def _entry_points() -> dict[str, str]:
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)
            if NAME_RE.fullmatch(ep.name)}


def env_names() -> list[str]:
    """Every name that resolves without a ``module:Class`` path: built-in, installed
    (entry points) and registered in this process, sorted."""
    return sorted({*BUILTIN, *_entry_points(), *_REGISTERED})


def _import_attr(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own code failing
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise EnvSpecError(f"environment {path!r}: module {module_name!r} does not import "
                           f"({type(exc).__name__}: {first})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise EnvSpecError(f"environment {path!r}: module {module_name!r} has no "
                           f"{attr!r}") from None


def _check_class(cls: Any, what: str) -> None:
    from train.envs.base import Environment

    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvSpecError(f"{what}: {cls!r} is not an Environment subclass "
                           "(train.envs.Environment)")


@lru_cache(maxsize=256)
def resolve_env(spec: str) -> type[Environment]:
    """The ``Environment`` class of ``spec`` (module docstring: order and trust)."""
    if not isinstance(spec, str) or not spec:
        raise EnvSpecError(f"environment spec {spec!r}: a name or 'module:Class'")
    if spec.startswith("agent:"):  # an agent program (train.envs.agent.program)
        if not SPEC_RE.fullmatch(spec[6:]):
            raise EnvSpecError(f"environment spec {spec!r}: an agent program is "
                               "'agent:module:function'")
        from train.envs.agent.program import agent_env_class

        try:
            return agent_env_class(spec)
        except ValueError as exc:
            raise EnvSpecError(str(exc)) from None
    target: str | type[Environment] | None = _REGISTERED.get(spec) or BUILTIN.get(spec)
    if target is None and NAME_RE.fullmatch(spec):
        target = _entry_points().get(spec)
        if target is None:
            raise EnvSpecError(f"unknown environment {spec!r}; choose from "
                               f"{', '.join(env_names())}, or give 'module:Class'")
    if target is None:
        if not SPEC_RE.fullmatch(spec):
            raise EnvSpecError(f"environment spec {spec!r}: a name or 'module:Class' "
                               "(a dotted module path, ':', a class name)")
        target = spec
    cls = _import_attr(target) if isinstance(target, str) else target
    _check_class(cls, f"environment {spec!r}")
    return cls


def canonical_spec(spec: str) -> str:
    """The spec to record for ``spec``: a name ``register_env`` bound to an importable
    class (or a path) records that ``module:Class`` path, which resolves in any process;
    every other spec records itself."""
    target = _REGISTERED.get(spec)
    return target if isinstance(target, str) else spec


def same_env(a: str, b: str) -> bool:
    """Whether two specs name one environment class (``calc`` and
    ``train.envs.calc:CalcEnv`` do); a spec that does not resolve equals only itself."""
    if a == b:
        return True
    try:
        return resolve_env(a) is resolve_env(b)
    except EnvSpecError:
        return False


def spec_of(env: Environment) -> str:
    """The spec an environment instance was made from (``make_env`` sets it), else its
    class's ``name``."""
    return getattr(env, "spec", None) or type(env).name


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "EnvSpecError", "canonical_spec", "env_names",
           "register_env", "resolve_env", "same_env", "spec_of", "unregister_env"]
