"""reasoning-gym's procedural task sets as a tool world: the question, a ``calc`` tool, and
the data set's own grader.

Tested with reasoning-gym 0.1.25 (106 data sets; the default arithmetic ones are generated
procedurally, with no download).

Mapping
  * **Task**: ``config = {"dataset": name, "seed": int, "size": int, "index": int,
    "dataset_config": {...}}``: the entry is
    ``reasoning_gym.create_dataset(name, seed=seed, size=size, **dataset_config)[index]``,
    rebuilt by ``reset`` and ``restore`` from the config alone (the size recorded is the
    one generation used, so a data set whose entries depended on it would still rebuild
    exactly). ``Task.answer`` is the entry's oracle ``answer``.
  * **Observation**: the first one is the entry's ``question`` plus two lines on the tool
    and the answer format (``Task.prompt``); a ``calc`` call answers
    ``<tool_response>VALUE</tool_response>``.
  * **Action**: the ``calc`` tool of ``train.envs.calc`` (same name and schema, one string
    argument ``expr``), evaluated by its whitelist evaluator ``evaluate`` over Python's AST
    with exact rationals (never ``eval``); its value is written by ``format_number``
    (``391``, ``-3.5``, ``10/3``). ``<answer>X</answer>`` ends the episode. A malformed
    action, another tool, bad arguments or an expression the calculator refuses get
    ``<tool_response>error: ...</tool_response>`` and use up the step (never an exception).
  * **Reward**: on the answer, ``dataset.score_answer(X, entry)``, the data set's own
    grader, clamped to [0, 1] (0.0 where it raises, is not finite, or ``X`` is over
    ``MAX_ANSWER_CHARS``). It can be partial: reasoning-gym's default grader gives
    ``len(gold) / len(X)`` when the gold answer is a substring of ``X``. ``Task.max_steps``
    steps without an answer end the episode with 0.0. ``reward_parts`` also holds
    ``tool_calls``, ``tool_errors`` and ``truncated`` (``train.envs.base.episode_parts``).
  * **Snapshots**: native: canonical JSON of the whole state (the task, the counters, the
    last observation); ``restore`` rebuilds the entry from the task's config, no replay.
    Reset and step are deterministic, so no ``reseed`` is needed.

The scripted expert calls ``calc`` on the entry's ``metadata["expression"]`` where the data
set records one and the calculator takes it (``basic_arithmetic``, ``chain_sum``,
``products``), then answers the oracle answer.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

try:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS as REASONING_GYM_DATASETS
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the reasoning-gym adapter needs reasoning-gym: pip install "
                      "'rollout-trees[reasoning-gym]'") from exc

from train.envs.base import OneToolEnv, Task, error_response, load_snapshot, tool_response
from train.envs.calc import (
    TOOL_SCHEMA,
    CalcError,
    answer_text,
    call_text,
    evaluate,
    format_number,
)

SNAPSHOT_FORMAT = "reasoning-gym/1"
DEFAULT_DATASETS = ("basic_arithmetic", "chain_sum", "products", "leg_counting")
"""Arithmetic data sets where a calculator helps (leg counting: multiply and add)."""
DEFAULT_MAX_STEPS = 4
MAX_ANSWER_CHARS = 1000
"""Longer answers score 0 without reaching a grader (some parse with sympy)."""
_SEED_RANGE = 2**31


@lru_cache(maxsize=128)
def _dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    return reasoning_gym.create_dataset(name, seed=seed, size=size,
                                        **json.loads(config_json))


def dataset_and_entry(task: Task) -> tuple[Any, dict[str, Any]]:
    """The data set and entry of a task, rebuilt from its config; ``ValueError`` naming
    what is wrong."""
    c = task.config
    name, seed, size, index = c.get("dataset"), c.get("seed"), c.get("size"), c.get("index")
    config = c.get("dataset_config", {})
    ints = (seed, size, index)
    if not isinstance(name, str) or any(isinstance(v, bool) or not isinstance(v, int)
                                        for v in ints) or not isinstance(config, dict):
        raise ValueError(f"task {task.task_id!r} needs config 'dataset' (str), 'seed', 'size', "
                         "'index' (integers) and 'dataset_config' (an object)")
    assert isinstance(seed, int) and isinstance(size, int) and isinstance(index, int)
    if not 0 <= index < size:
        raise ValueError(f"task {task.task_id!r}: index {index} is outside size {size}")
    try:
        ds = _dataset(name, seed, size, json.dumps(config, sort_keys=True))
    except Exception as exc:  # an unknown name, a config the data set rejects
        raise ValueError(f"task {task.task_id!r}: reasoning-gym data set {name!r}: "
                         f"{type(exc).__name__}: {exc}") from None
    return ds, ds[index]


@dataclass
class _State:
    task: Task
    steps: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    last_observation: str = ""
    done: bool = False
    reward: float = 0.0
    truncated: bool = False


_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "steps": int, "tool_calls": int, "tool_errors": int, "last_observation": str,
    "done": bool, "reward": float, "truncated": bool}


class ReasoningGymEnv(OneToolEnv[_State]):
    """reasoning-gym entries answered with a ``calc`` tool (module docstring)."""

    name: ClassVar[str] = "reasoning-gym"
    tool: ClassVar[dict[str, Any]] = TOOL_SCHEMA
    snapshot_format: ClassVar[str] = SNAPSHOT_FORMAT
    tiny_sft: ClassVar[dict[str, Any]] = {
        "init_from": "calc", "train_tasks": 8_000, "eval_tasks": 100, "test_tasks": 200,
        "eval_every": 100}
    """``rtrees policy init``'s recipe: warm-started from the committed calc policy (the
    same ``calc`` tool and action format), on fewer expert episodes and smaller held-out
    checks than the default, so a few minutes on 2 cores train it."""

    def __init__(self) -> None:
        self._state: _State | None = None
        self._ds: Any = None
        self._entry: dict[str, Any] = {}

    # -- episode -----------------------------------------------------------

    def reset(self, task: Task) -> str:
        self._ds, self._entry = dataset_and_entry(task)
        self._state = _State(task=task)
        return task.prompt

    def _act(self, s: _State, action_text: str) -> tuple[str, bool]:
        observation, is_error = super()._act(s, action_text)
        s.last_observation = observation
        return observation, is_error

    def _grade(self, s: _State, answer: str) -> float:
        if len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        try:
            score = float(self._ds.score_answer(answer, self._entry))
        except Exception:  # a grader failing on odd text is that answer's 0, not a crash
            return 0.0
        return min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0

    def _run_tool(self, s: _State, arguments: dict[str, Any]) -> tuple[str, bool]:
        try:
            return tool_response(format_number(evaluate(arguments["expr"]))), False
        except CalcError as exc:
            return error_response(str(exc)), True

    # -- snapshot ----------------------------------------------------------

    def restore(self, state: bytes) -> None:
        """Replace the whole state; ``ValueError`` if ``state`` is not a snapshot of this
        environment or its task's entry does not rebuild."""
        try:
            data = load_snapshot(state, SNAPSHOT_FORMAT)
            restored = _State(task=Task(**data.pop("task")), **data)
            for name, kind in _STATE_TYPES.items():
                if not isinstance(getattr(restored, name), kind):
                    raise ValueError(f"{name!r} must be {kind}")
            if not isinstance(restored.task.config, dict):
                raise ValueError("malformed task")
            ds, entry = dataset_and_entry(restored.task)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not a {self.name} snapshot: {type(exc).__name__}: "
                             f"{exc}") from None
        self._ds, self._entry, self._state = ds, entry, restored

    # -- expert ------------------------------------------------------------

    def expert_action(self) -> str:
        """One ``calc`` call on the entry's recorded expression (when it has one the
        calculator takes, and a step is left for the answer), then the oracle answer."""
        s = self._require()
        if s.done:
            raise RuntimeError("ReasoningGymEnv.expert_action: the episode is over")
        expr = self._entry.get("metadata", {}).get("expression")
        if isinstance(expr, str) and s.tool_calls == 0 and s.steps + 1 < s.task.max_steps:
            try:
                evaluate(expr)
                return call_text(expr)
            except CalcError:
                pass
        return answer_text(str(self._entry["answer"]))

    # -- tasks -------------------------------------------------------------

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        """``n`` tasks drawn from ``random.Random(seed)``: each picks a data set from
        ``datasets`` (default ``DEFAULT_DATASETS``; any name of
        ``reasoning_gym.factory.DATASETS``) and takes that data set's next entry.

        Each data set's reasoning-gym seed is drawn from ``seed`` first (reasoning-gym
        seeds entry ``i`` with ``seed + i``, so consecutive seeds would share entries).
        Options: ``datasets``; ``max_steps`` (default 4); ``dataset_config``
        (``{name: {option: value}}``, passed to ``create_dataset``). ``generate_tasks(k,
        s)`` is a prefix of ``generate_tasks(n, s)``.
        """
        options: dict[str, Any] = {"datasets": DEFAULT_DATASETS,
                                   "max_steps": DEFAULT_MAX_STEPS, "dataset_config": {}}
        unknown = sorted(set(mix) - set(options))
        if unknown:
            raise ValueError(f"unknown {cls.name} task option(s) {unknown}; choose from "
                             f"{sorted(options)}")
        options.update(mix)
        raw = options["datasets"]
        names = [raw] if isinstance(raw, str) else list(raw)
        known = set(REASONING_GYM_DATASETS)
        if not names or any(not isinstance(d, str) or d not in known for d in names):
            raise ValueError(f"datasets must name reasoning-gym data sets, got {raw!r}")
        max_steps, configs = options["max_steps"], options["dataset_config"]
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not (
                1 <= max_steps <= 1000):
            raise ValueError(f"max_steps must be an integer in 1..1000, got {max_steps!r}")
        if not isinstance(configs, dict) or any(not isinstance(v, dict)
                                                for v in configs.values()):
            raise ValueError("dataset_config must map data set names to option objects")
        rng = random.Random(seed)
        ds_seeds = {d: rng.randrange(_SEED_RANGE) for d in dict.fromkeys(names)}
        taken = dict.fromkeys(names, 0)
        tasks: list[Task] = []
        for i in range(n):
            name = rng.choice(names)
            index = taken[name]
            taken[name] += 1
            config = {"dataset": name, "seed": ds_seeds[name], "size": index + 1,
                      "index": index, "dataset_config": configs.get(name, {})}
            probe = Task(task_id=f"{name}-{index}", env=cls.name, prompt="", config=config)
            _, entry = dataset_and_entry(probe)
            prompt = (f"{str(entry['question']).strip()}\n\nYou may call the calc tool to "
                      f"evaluate arithmetic, e.g. {call_text('2*(3+4)')}. Give the final "
                      "answer as <answer>...</answer>.")
            digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
            tasks.append(Task(task_id=f"rg-{name}-{seed}-{i}-{digest[:8]}", env=cls.name,
                              prompt=prompt, answer=str(entry["answer"]),
                              max_steps=max_steps, config=config))
        return tasks


__all__ = ["DEFAULT_DATASETS", "MAX_ANSWER_CHARS", "ReasoningGymEnv", "dataset_and_entry"]
