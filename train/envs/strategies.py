"""Snapshot strategies: how an environment's states are saved and restored.

Every consumer (the samplers, Mean@k references, the reuse refresh, held-out evaluation,
scoring) calls ``env.snapshot()`` / ``env.restore(bytes)`` / ``env.reseed(key)``; what
those do is the environment class's ``snapshot_strategy``, applied once by ``make_env``
(``with_snapshots``) from the registry ``SNAPSHOT_STRATEGIES``:

* ``native``: the environment's own methods, unchanged;
* ``replay`` (``ReplayEnv``): a snapshot is canonical JSON
  ``{"strategy": "replay", "task": {...}, "log": [["step", action, digest] | ["reseed",
  key], ...]}``; ``restore`` resets the task and replays the log (or, when the live
  episode is a prefix of it, only the rest). Each replayed step's observation, ``done``
  and reward parts must hash to the recorded ``digest``: a replay that parts from the
  record is ``ReplayDivergenceError`` naming the first diverging step, never a silently
  different branch. Its cost is O(depth) steps (``ReplayEnv.stats``).
* ``fork``: registered by ``train.envs.fork`` where the platform can fork (``make_env``
  imports it for an environment that declares it).

The strategy is recorded in every snapshot it makes (the ``strategy`` key; a native
snapshot is the env's own bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from train.envs.base import Environment, SnapshotDivergence, StepResult, Task

REPLAY = "replay"


class ReplayDivergenceError(SnapshotDivergence):
    """A replayed action gave another outcome than when it was recorded (``where``:
    ``{"step": k}``, the first diverging step, 1-based)."""


def outcome_digest(result: StepResult) -> str:
    """16 hex digits of sha256 over a step's observation, ``done`` and reward parts."""
    body = json.dumps([result.observation, bool(result.done),
                       sorted((str(k), float(v)) for k, v in result.reward_parts.items())],
                      ensure_ascii=True, allow_nan=True, separators=(",", ":"))
    return hashlib.sha256(body.encode("ascii")).hexdigest()[:16]


@dataclass
class ReplayStats:
    """What replay cost so far: restores, steps replayed, restores that only stepped
    forward from the live episode (``forward``)."""

    restores: int = 0
    forward: int = 0
    replayed_steps: int = 0


class ReplayEnv(Environment):
    """``inner`` with snapshots by replay (module docstring). Everything else delegates."""

    snapshot_strategy = "replay"

    def __init__(self, inner: Environment) -> None:
        self.inner = inner
        self.spec = inner.spec
        self._task: Task | None = None
        self._log: list[list[Any]] = []
        self.stats = ReplayStats()

    @property  # the wrapped class's name, per instance
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def tool_lag(self) -> int:  # type: ignore[override]
        return self.inner.tool_lag

    def tool_schemas(self) -> list[dict[str, Any]] | None:  # type: ignore[override]
        return self.inner.tool_schemas()

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        raise TypeError("generate_tasks belongs to the wrapped environment's class")

    def reset(self, task: Task) -> str:
        self._task, self._log = task, []
        return self.inner.reset(task)

    def step(self, action_text: str) -> StepResult:
        result = self.inner.step(action_text)
        self._log.append(["step", action_text, outcome_digest(result)])
        return result

    def reseed(self, key: int) -> None:
        hook = getattr(self.inner, "reseed", None)
        if callable(hook):
            hook(key)
            self._log.append(["reseed", int(key)])

    def expert_action(self) -> str:
        return self.inner.expert_action()

    def close(self) -> None:
        self.inner.close()

    def snapshot(self) -> bytes:
        if self._task is None:
            raise RuntimeError(f"{self.name}: call reset() or restore() before snapshot()")
        return json.dumps({"strategy": REPLAY, "task": dataclasses.asdict(self._task),
                           "log": self._log}, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True, allow_nan=False).encode("ascii")

    def restore(self, state: bytes) -> None:
        task, log = parse_replay(state)
        self.stats.restores += 1
        start = 0
        if self._task == task and self._log == log[:len(self._log)]:
            start = len(self._log)  # the live episode is a prefix: step on from it
            self.stats.forward += 1
        else:
            self.inner.reset(task)
            self._task, self._log = task, []
        for i in range(start, len(log)):
            entry = log[i]
            if entry[0] == "reseed":
                self.reseed(entry[1])
                continue
            result = self.inner.step(entry[1])
            self.stats.replayed_steps += 1
            got = outcome_digest(result)
            if got != entry[2]:
                self._task, self._log = None, []
                at = sum(e[0] == "step" for e in log[:i + 1])
                raise ReplayDivergenceError(
                    f"{self.name}: replay diverged at step {at} of task {task.task_id!r} "
                    f"(the action {entry[1][:60]!r} gave another "
                    "observation or reward than when it was recorded): its reset and step are "
                    "not deterministic given the task", step=at)
            self._log.append(entry)


def parse_replay(state: bytes) -> tuple[Task, list[list[Any]]]:
    """The task and log of a replay snapshot; ``ValueError`` for anything else."""
    try:
        doc = json.loads(state)
    except (ValueError, RecursionError):
        raise ValueError("not a replay snapshot: not JSON") from None
    if not isinstance(doc, dict) or doc.get("strategy") != REPLAY:
        raise ValueError("not a replay snapshot")
    raw, log = doc.get("task"), doc.get("log")
    fields = {f.name for f in dataclasses.fields(Task)}
    if not isinstance(raw, dict) or set(raw) != fields or not isinstance(log, list):
        raise ValueError("not a replay snapshot: malformed task or log")
    for entry in log:
        ok = isinstance(entry, list) and (
            (len(entry) == 3 and entry[0] == "step" and isinstance(entry[1], str)
             and isinstance(entry[2], str))
            or (len(entry) == 2 and entry[0] == "reseed" and isinstance(entry[1], int)))
        if not ok:
            raise ValueError("not a replay snapshot: malformed log entry")
    return Task(**raw), log


SNAPSHOT_STRATEGIES: dict[str, Callable[[Environment], Environment]] = {
    "native": lambda env: env,
    REPLAY: ReplayEnv,
}
"""Strategy name -> wrapper of a freshly made environment (``train.envs.fork`` adds
``fork``)."""


def with_snapshots(env: Environment, strategy: str | None = None) -> Environment:
    """``env`` with snapshots through ``strategy`` (default: its class's)."""
    name = strategy or type(env).snapshot_strategy
    wrap = SNAPSHOT_STRATEGIES.get(name)
    if wrap is None:
        raise ValueError(f"{type(env).__name__}: unknown snapshot strategy {name!r}; "
                         f"choose from {', '.join(sorted(SNAPSHOT_STRATEGIES))}")
    return wrap(env)


__all__ = ["SNAPSHOT_STRATEGIES", "ReplayDivergenceError", "ReplayEnv", "ReplayStats",
           "outcome_digest", "parse_replay", "with_snapshots"]
