"""Held-out evaluation through the rollout engine: one episode per task, all together (issue 22).

The one evaluation of the house (the trainer's held-out metrics and ``evaluations`` rows,
``heldout_rows``; ``rtrees policy init``'s success report, ``success_report``, which the
tiny policy's SFT receives as its held-out check): each task gets one episode from
``reset``, continued by the continuation primitive (``train.sampling.continuation.Continuing``)
under the one step limit, ``Task.max_steps`` (an episode cut there ends with reward 0),
and the one success rule, final reward >= ``success_threshold`` (the trainer passes its
sampler's, ``SamplerConfig.success_threshold``). Every episode is a program of
``train.sampling.engine``, so each decode step is one token of every live episode in
one continuously batched decoder, environment steps run in the engine's pool, and each
environment is closed when its episode ends. Episode i's row draws from the stream keyed by
``(seed, "eval", i, step)``, so an episode does not depend on the other tasks or on the
batch; ``greedy`` keeps the top token (``top_p`` 1e-9).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa

from rollout_store.schema import EVALUATIONS
from rollout_store.store import now_utc
from train.envs import Environment, Task, env_class, make_env
from train.policies.base import Policy, Rows, SampleConfig
from train.sampling.base import mix_seed
from train.sampling.continuation import Continuing
from train.sampling.engine import DEFAULT_MAX_ROWS, Decode, Engine, Request, Work

GREEDY_TOP_P = 1e-9
_MASK62 = (1 << 62) - 1


@dataclass(frozen=True)
class Episodes:
    """Per task: final reward (0 when cut by the step limit), success, steps taken."""

    rewards: list[float]
    successes: list[bool]
    steps: list[int]

    @property
    def success_rate(self) -> float:
        return sum(self.successes) / len(self.successes) if self.successes else float("nan")


def episode_program(env: Callable[[], Environment], task: Task, index: int, seed: int,
                    config: SampleConfig) -> Generator[Request, Any, tuple[float, int]]:
    """One episode of ``task`` from ``reset``: (final reward, steps)."""
    live: Environment = yield Work(env)
    try:
        prompt: str = yield Work(lambda: live.reset(task))
        run = Continuing(live, [("prompt", prompt)], 0, task.max_steps)
        while not run.over:
            seed_row = mix_seed(seed, "eval", index, run.steps) & _MASK62
            conts = yield Decode([Rows(tuple(run.turns), 1, seed_row)], config)
            yield Work(partial(run.step, conts[0][0].text), lag=live.tool_lag)
        return (run.reward if run.done else 0.0), run.steps
    finally:
        live.close()


def run_episodes(policy: Policy, env: str | Callable[[], Environment], tasks: Sequence[Task],
                 *, seed: int, max_new_tokens: int = 48, temperature: float = 1.0,
                 greedy: bool = False, success_threshold: float = 1.0,
                 max_rows: int = DEFAULT_MAX_ROWS) -> Episodes:
    """One episode per task through the engine (module docstring)."""
    factory = partial(make_env, env) if isinstance(env, str) else env
    config = SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=GREEDY_TOP_P if greedy else 1.0)
    engine = Engine(policy, max_rows=max_rows, max_programs=max(1, min(len(tasks), 256)))
    got: list[tuple[float, int]] = engine.run(
        [partial(episode_program, factory, task, i, seed, config)
         for i, task in enumerate(tasks)])
    rewards = [float(r) for r, _ in got]
    return Episodes(rewards, [r >= success_threshold for r in rewards], [s for _, s in got])


def heldout_rows(policy: Policy, env: str, tasks: Sequence[Task], *, seed: int, step: int,
                 run_id: str, max_new_tokens: int, success_threshold: float = 1.0
                 ) -> tuple[dict[str, float], pa.Table]:
    """The trainer's held-out evaluation: success on ``tasks``, sampled and greedy
    (``heldout_sampled``, ``heldout_greedy``; NaN without tasks), and the per-task outcomes
    as ``evaluations`` rows of ``run_id`` at metric ``step`` (V2 pairs arms by task). Each
    mode runs ``run_episodes`` with ``seed``, so task i draws the same stream in every run
    that evaluates with that seed."""
    metrics: dict[str, float] = {}
    parts = []
    now = now_utc()
    n = len(tasks)
    for mode, greedy in (("sampled", False), ("greedy", True)):
        ep = run_episodes(policy, env, tasks, seed=seed, max_new_tokens=max_new_tokens,
                          greedy=greedy, success_threshold=success_threshold)
        metrics[f"heldout_{mode}"] = ep.success_rate if n else float("nan")
        parts.append(pa.table({
            "run_id": pa.array([run_id] * n, pa.string()),
            "step": pa.array([step] * n, pa.int64()),
            "mode": pa.array([mode] * n, pa.string()),
            "task_index": pa.array(range(n), pa.int32()),
            "task_id": pa.array([t.task_id for t in tasks], pa.string()),
            "eval_seed": pa.array([seed] * n, pa.int64()),
            "reward": pa.array(ep.rewards, pa.float64()),
            "success": pa.array(ep.successes, pa.bool_()),
            "steps": pa.array(ep.steps, pa.int32()),
            "created_at": pa.array([now] * n, EVALUATIONS.field("created_at").type),
        }, schema=EVALUATIONS))
    return metrics, pa.concat_tables(parts)


ALL_TASKS = "all"
"""The one group of an env without a ``task_group_key``."""


def group_name(env: str) -> str:
    """What groups ``env``'s tasks in a report: its class's ``task_group_key`` (calc
    ``difficulty``, workflow ``horizon``, sgls ``kind``), else ``tasks``."""
    return env_class(env).task_group_key or "tasks"


def task_group(task: Task, key: str | None) -> int | str:
    """The reporting group of ``task``: its ``config[key]`` (an integer stays one, e.g. a
    difficulty or horizon; anything else as text, e.g. an sgls kind), or ``ALL_TASKS``
    when ``key`` is None."""
    if key is None:
        return ALL_TASKS
    value = task.config[key]
    return value if isinstance(value, int) and not isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class SuccessReport:
    """Sampled success on a task set: per group (difficulty / horizon) and overall."""

    per_group: dict[int | str, tuple[int, int]]  # group -> (successes, tasks)
    group_name: str

    @property
    def overall(self) -> float:
        wins = sum(s for s, _ in self.per_group.values())
        total = sum(n for _, n in self.per_group.values())
        return wins / total if total else 0.0

    def rate(self, group: int | str) -> float:
        wins, total = self.per_group[group]
        return wins / total if total else 0.0

    def lines(self) -> list[str]:
        out = [f"  {self.group_name} {g}: {self.rate(g):6.1%}  ({s}/{n})"
               for g, (s, n) in sorted(self.per_group.items())]
        total = sum(n for _, n in self.per_group.values())
        return [*out, f"  overall: {self.overall:6.1%}  ({total} tasks)"]

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group_name, "overall": self.overall,
                "per_group": {str(g): {"successes": s, "tasks": n, "rate": s / n if n else 0.0}
                              for g, (s, n) in sorted(self.per_group.items())}}


def rollout_rewards(policy: Policy, env_name: str, tasks: Sequence[Task], seed: int,
                    max_new_tokens: int = 48, temperature: float = 1.0) -> list[float]:
    """One sampled episode per task through the rollout engine (``run_episodes``: all
    episodes batched, the task's step limit, environments closed); returns each
    episode's final reward."""
    return run_episodes(policy, env_name, tasks, seed=seed, max_new_tokens=max_new_tokens,
                        temperature=temperature).rewards


def success_report(policy: Policy, env_name: str, tasks: Sequence[Task], seed: int,
                   max_new_tokens: int = 48) -> SuccessReport:
    """Sampled (temperature 1) success rate per group of the env's ``task_group_key``
    (difficulty / horizon / kind; one group where it has none): the held-out check
    ``rtrees policy init`` passes to ``tiny_train.train_sft``."""
    key = env_class(env_name).task_group_key
    episodes = run_episodes(policy, env_name, tasks, seed=seed, max_new_tokens=max_new_tokens)
    groups: dict[int | str, tuple[int, int]] = {}
    for task, success in zip(tasks, episodes.successes, strict=True):
        wins, total = groups.get(task_group(task, key), (0, 0))
        groups[task_group(task, key)] = (wins + success, total + 1)
    return SuccessReport(groups, group_name(env_name))


__all__ = ["ALL_TASKS", "GREEDY_TOP_P", "Episodes", "SuccessReport", "episode_program",
           "group_name", "heldout_rows", "rollout_rewards", "run_episodes", "success_report",
           "task_group"]
