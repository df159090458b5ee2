"""``workflow``: synthetic DAG-workflow tool tasks with exact values (DSC-Gate's L1 level).

A task is a small DAG of stages run in a fixed (topological) order within a
horizon of H tool calls (DSC-Gate uses H = 6, 9, 12; METHODS.md §5). The last
stage is the goal; a stage is *required* when the last stage depends on it,
directly or transitively, and *optional* otherwise. Under a tabular policy
every quantity is exact (``train.envs.workflow_model``): V and Q of every
state, the success probability of any tree node, recoverability, and the
first irrecoverable step of a trajectory (the ground truth for BEL, §2.1).

Tools (fixed vocabulary, no arguments; the probabilities are per stage)
  ``fast``     working stage: succeeds with ``p_fast`` and moves to the next stage;
               on failure the stage becomes *broken* (``fast_failure="broken"``) or
               the workflow crashes and the episode ends (``"crash"``).
  ``careful``  working stage: succeeds with ``p_careful`` and moves on; on failure
               nothing changes (a step is spent).
  ``repair``   broken stage: succeeds with ``p_repair`` (the stage works again);
               on failure it stays broken.
  ``skip``     any stage: always moves to the next stage without running this one.
               Skipping a required stage silently *corrupts* the run: nothing is
               said until the final check fails. Skipping an optional stage is safe.
  Valid tools: ``fast, careful, skip`` on a working stage, ``repair, skip`` on a
  broken one. ``deterministic=True`` (env option or task flag): a tool succeeds
  iff its probability is >= 0.5.

State (``State``): ``(stage, t, broken, corrupt, crashed)``; the agent sees
``(stage, t, broken)`` (``ObsKey``), never ``corrupt``. Every step, malformed
ones included, uses one of the H steps.

Episode end and reward (``reward_parts = {"reward", "malformed"}``, ``reward``
0.0 until the step that ends the episode):
  * the last stage is done or skipped: reward 1 unless a required stage was
    skipped ("Final check failed"), then 0;
  * a ``fast`` crash: reward 0;
  * the H-th step passes without finishing: reward 0.
A state is *dead* (irrecoverable) when success has probability 0 under every
policy: crashed, corrupt, or too few steps left for the remaining stages.

Action format (``model.valid_actions(state)`` lists the valid strings)::

    <tool_call>{"name": "careful", "arguments": {}}</tool_call>

Observation formats. ``reset`` returns the prompt: the stage list with each
stage's needs, the rules, the tools, and the first state line. With the task option
``mark_optional`` (``generate_tasks(..., mark_optional=True)``, ``--task-param
mark_optional=true``) every mention of an optional stage reads ``(needs: X; optional)``,
so the one decision whose value the needs lists alone do not show locally (skipping an
optional stage is always safe and saves a step) is visible in the state line; the
dynamics are unchanged (docs/METHODS.md W1-W3). Each step returns::

    <tool_response>fast on 'parse': failure. The stage is broken.
    Stage 2/5: parse (needs: fetch). Status: broken. Steps left: 6. Valid tools: repair, skip.
    </tool_response>

(no line break before the closing tag in the real text). The first line is
``{tool} on '{stage}': success.`` or ``failure.`` plus a detail; the second is
the state line (``model.state_text``; it is what ``action_probs`` callables
see), or at the end one of ``Workflow complete. Reward 1.``, ``Final check
failed: a required stage was skipped. Reward 0.``, ``The workflow crashed.
Reward 0.``, ``Out of steps. Reward 0.``. A malformed action (bad JSON,
unknown tool, a tool not valid here, arguments, an ``<answer>``) gets
``<tool_response>error: {why}. The step was wasted.\n{state line}</tool_response>``
and costs a step; it never raises. A step after the end returns
``error: the episode is over`` with ``done=True`` and reward 0.

Randomness: tool outcomes come from a counter-based SplitMix64 stream keyed by
the task's ``rng_seed``; ``(key, counter)`` is in the snapshot, so
restore-then-step is byte-identical. To draw independent outcomes for sibling
branches (Monte Carlo from one node), call ``reseed(k)`` after ``restore``.

Snapshot: canonical JSON (sorted keys, no spaces) of the compact task spec,
the state, the deterministic flag and the RNG position; ``restore`` needs no
replay and works on a fresh instance.

Task mix (``generate_tasks(n, seed, horizons=(6, 9, 12))``): task i has horizon
``horizons[i % len]``; ``ceil(H/3)+1 .. H//2+1`` stages (H=6: 3-4, 9: 4-5,
12: 5-7); stage 0 and the last stage required, 0-2 optional stages; each
required stage needs the previous required one (plus, 30%, one more earlier
required stage); p_fast ~ U(0.6, 0.95), p_careful ~ U(0.3, p_fast - 0.05),
p_repair ~ U(0.4, 0.9), rounded to 0.01; ``fast`` crashes (instead of
breaking) on 25% of stages. The task's ``horizon`` (config) is the step limit;
the generator sets ``Task.max_steps`` to it.

Exact quantities, e.g.::

    model = env.model                      # or WorkflowModel.from_config(task.config)
    policy = TabularPolicy(model)          # uniform; policy.update(state, "fast", 0.5)
    values = policy.values()               # or lm_policy_values(model, action_probs)
    values.v(state), values.q(state, action_text), values.q_values(state)
    values.path_value(action_texts, observation_texts)   # a tree node's success prob.
    values.tree_values(node_ids, parent_ids, action_texts, observation_texts)
    values.v(WorkflowEnv.snapshot_state(snapshot_bytes))
    model.optimal_values().v(state)        # V*; model.recoverable(state) <=> V* > 0
    model.first_irrecoverable_step(model.path_states(action_texts, observation_texts))
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from typing import Any, ClassVar

from train.envs.base import Environment, StepResult, Task, error_response
from train.envs.preamble import system_preamble
from train.envs.workflow_model import (
    ACTION_TEXTS,
    TOOLS,
    ActionProbs,
    ObsKey,
    OptimalValues,
    PolicyValues,
    StageSpec,
    State,
    Tool,
    Transition,
    WorkflowModel,
    WorkflowSpec,
    action_text,
    lm_policy_values,
)
from train.envs.workflow_policy import TabularPolicy, policy_values

DEFAULT_HORIZONS: tuple[int, ...] = (6, 9, 12)
STAGE_NAMES = ("fetch", "parse", "clean", "validate", "transform", "join", "index", "test",
               "audit", "package", "notify", "deploy", "backup", "report")
SNAPSHOT_VERSION = 1

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix(*parts: int) -> int:
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK))
    return h


def _uniform(key: int, counter: int) -> float:
    """The counter-th draw of stream ``key``, uniform in [0, 1) with 53 bits."""
    return (_mix(key, counter) >> 11) / float(1 << 53)


def _parts(reward: float, malformed: bool) -> dict[str, float]:
    return {"reward": reward, "malformed": 1.0 if malformed else 0.0}


TOOL_DESCRIPTIONS: dict[str, str] = {
    "fast": "Run the current stage quickly; on failure the stage breaks (or the workflow "
            "crashes).",
    "careful": "Run the current stage carefully; on failure nothing changes.",
    "repair": "Fix a broken stage.",
    "skip": "Move on without running the current stage.",
}


class WorkflowEnv(Environment):
    """The ``workflow`` tool world (rules and formats in the module docstring).

    ``deterministic`` overrides the task's flag when not None.
    """

    name = "workflow"
    exact_values: ClassVar[bool] = True  # every task is a WorkflowModel
    tabular_policy: ClassVar[bool] = True
    task_group_key: ClassVar[str | None] = "horizon"
    # ``policy init``: ~205 tokens per episode but one action token per step (3% of the
    # tokens carry a loss). The expert's choices depend on tool probabilities the prompt
    # does not show, and on which stages are optional (always skipped), which takes the
    # whole DAG to see; imitating its mistakes too left the tiny model unsure even of
    # "broken -> repair" (54-90%). Noise injection (a random valid action) with the loss
    # on the expert's own actions only fixed that (99%); sampled success then moves
    # between ~27% and ~45% from check to check after ~500 steps (measured with seed 0).
    tiny_sft: ClassVar[dict[str, Any]] = {
        "train_tasks": 12_000, "p_error": 0.2, "train_on_mistakes": False, "max_steps": 2500,
        "max_new_tokens": 16, "noise": "random_valid"}

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]] | None:
        """The four tools, without arguments, in the OpenAI function format."""
        return [{"type": "function", "function": {
            "name": tool, "description": TOOL_DESCRIPTIONS[tool],
            "parameters": {"type": "object", "properties": {}}}} for tool in TOOLS]

    def __init__(self, deterministic: bool | None = None, system_prompt_chars: int = 0) -> None:
        self.deterministic_override = deterministic
        # a long shared system prompt ahead of the task (train.envs.preamble; 0 = none)
        self._preamble = system_preamble(
            self.name, [{"name": t, "arguments": {}} for t in TOOLS], system_prompt_chars)
        self._model: WorkflowModel | None = None
        self._state = State(0, 0)
        self._task_id = ""
        self._key = 0
        self._counter = 0

    # ----- accessors --------------------------------------------------------------------

    @property
    def model(self) -> WorkflowModel:
        if self._model is None:
            raise RuntimeError("no task: call reset() or restore() first")
        return self._model

    @property
    def state(self) -> State:
        return self._state

    @property
    def done(self) -> bool:
        return self._model is None or self._model.is_terminal(self._state)

    def valid_actions(self, state: State | None = None) -> list[str]:
        """Valid action strings of ``state`` (default: the current state)."""
        return self.model.valid_actions(self._state if state is None else state)

    def reseed(self, key: int) -> None:
        """Switch to an independent outcome stream derived from the current one and ``key``
        (e.g. the branch index), so sibling rollouts from one snapshot differ."""
        self._key = _mix(self._key, self._counter, key)
        self._counter = 0

    # ----- Environment ------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        spec = WorkflowSpec.from_config(task.config)
        self._model = WorkflowModel(spec, self.deterministic_override)
        self._task_id = task.task_id
        self._state = self._model.initial_state()
        self._key = _mix(spec.rng_seed)
        self._counter = 0
        return self._preamble + self._model.prompt()

    def step(self, action_text: str) -> StepResult:
        if self._model is None:
            return StepResult(error_response("no task: call reset() first"), True,
                              _parts(0.0, True))
        model, s = self._model, self._state
        if model.is_terminal(s):
            return StepResult(error_response("the episode is over"), True, _parts(0.0, True))
        if not isinstance(action_text, str):
            action_text = ""  # hostile caller: treat as malformed
        tool, error = model.classify(s, action_text)
        success = False
        if tool is None:
            s2 = model.wasted(s)
        else:
            p, on_success, on_failure = model.outcomes(s, tool)
            success = _uniform(self._key, self._counter) < p
            self._counter += 1
            s2 = on_success if success else on_failure
        self._state = s2
        done = model.is_terminal(s2)
        observation = model.render_step(s, tool, error, success, s2)
        return StepResult(observation, done, _parts(model.reward(s2) if done else 0.0,
                                                    tool is None))

    def snapshot(self) -> bytes:
        model = self.model
        payload = {
            "v": SNAPSHOT_VERSION, "task": self._task_id, "spec": model.spec.to_compact(),
            "det": int(model.deterministic), "s": [int(x) for x in self._state],
            "rng": [self._key, self._counter],
        }
        return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()

    def restore(self, state: bytes) -> None:
        try:
            payload = json.loads(state)
            if payload["v"] != SNAPSHOT_VERSION:
                raise ValueError(f"snapshot version {payload['v']} != {SNAPSHOT_VERSION}")
            det = bool(payload["det"])
            stage, t, broken, corrupt, crashed = payload["s"]
            key, counter = payload["rng"]
            restored = State(int(stage), int(t), bool(broken), bool(corrupt), bool(crashed))
            spec = WorkflowSpec.from_compact(payload["spec"])
            task_id = str(payload["task"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a workflow snapshot: {exc!r}") from exc
        model = self._model
        if model is None or model.spec.to_compact() != spec.to_compact() \
                or model.deterministic != det:
            model = WorkflowModel(spec, det)  # else keep the model and its cached values
        if not (0 <= restored.stage <= model.n_stages and 0 <= restored.t <= model.horizon):
            raise ValueError(f"snapshot state {restored} outside the task")
        self._model, self._state = model, restored
        self._task_id = task_id
        self._key, self._counter = int(key) & _MASK, int(counter)

    @staticmethod
    def snapshot_state(snapshot: bytes) -> State:
        """The ``State`` inside a snapshot (to look up exact values of a stored node)."""
        stage, t, broken, corrupt, crashed = json.loads(snapshot)["s"]
        return State(int(stage), int(t), bool(broken), bool(corrupt), bool(crashed))

    def expert_action(self) -> str:
        """The action with the highest Q under an optimal policy (full-state knowledge;
        ties go to the first tool in ``fast, careful, repair, skip`` order)."""
        if self._model is None:
            return ACTION_TEXTS["careful"]
        return self._model.optimal_values().best_action(self._state)

    @classmethod
    def generate_tasks(cls, n: int, seed: int, horizons: Sequence[int] = DEFAULT_HORIZONS,
                       deterministic: bool = False, mark_optional: bool = False,
                       **mix: Any) -> list[Task]:
        """``n`` tasks; horizons cycle through ``horizons`` (the mix is in the module doc;
        one integer is one horizon). ``mark_optional`` marks the optional stages in the
        prompt and state lines (module docstring); the tasks are otherwise the same."""
        if mix:
            raise TypeError(f"unknown task-mix options {sorted(mix)}")
        if isinstance(horizons, int):
            horizons = (horizons,)
        if not isinstance(horizons, Sequence) or any(
                isinstance(h, bool) or not isinstance(h, int) for h in horizons):
            raise ValueError(f"horizons must be integers, got {horizons!r}")
        if not horizons or any(h < 2 for h in horizons):
            raise ValueError(f"horizons must be >= 2, got {list(horizons)}")
        if not isinstance(mark_optional, bool):
            raise ValueError(f"mark_optional must be true or false, got {mark_optional!r}")
        return [cls._generate_task(seed, i, horizons[i % len(horizons)], deterministic,
                                   mark_optional) for i in range(n)]

    @staticmethod
    def _generate_task(seed: int, index: int, horizon: int, deterministic: bool,
                       mark_optional: bool = False) -> Task:
        rng = random.Random(_mix(seed, index))
        n = rng.randint(math.ceil(horizon / 3) + 1, horizon // 2 + 1)
        n = min(n, len(STAGE_NAMES))
        n_optional = rng.randint(0, min(2, n - 2))
        optional = set(rng.sample(range(1, n - 1), n_optional))
        required = [i for i in range(n) if i not in optional]
        names = rng.sample(STAGE_NAMES, n)
        stages = []
        for i in range(n):
            if i == 0:
                needs: tuple[int, ...] = ()
            elif i in optional:
                needs = (rng.randrange(i),)
            else:
                earlier = [j for j in required if j < i]
                extra = [j for j in earlier[:-1] if rng.random() < 0.3][:1]
                needs = tuple(sorted({earlier[-1], *extra}))
            p_fast = round(rng.uniform(0.6, 0.95), 2)
            stages.append(StageSpec(
                name=names[i], needs=needs, p_fast=p_fast,
                p_careful=round(rng.uniform(0.3, p_fast - 0.05), 2),
                p_repair=round(rng.uniform(0.4, 0.9), 2),
                fast_failure="crash" if rng.random() < 0.25 else "broken"))
        spec = WorkflowSpec(stages=tuple(stages), horizon=horizon,
                            rng_seed=_mix(seed, index, 1) >> 1, deterministic=deterministic,
                            mark_optional=mark_optional)
        model = WorkflowModel(spec)
        return Task(task_id=f"workflow-{seed}-{index}", env="workflow", prompt=model.prompt(),
                    answer=None, max_steps=horizon, config=spec.to_config())


__all__ = [
    "ACTION_TEXTS", "DEFAULT_HORIZONS", "TOOLS", "ActionProbs", "ObsKey", "OptimalValues",
    "PolicyValues", "StageSpec", "State", "TabularPolicy", "Tool", "Transition",
    "WorkflowEnv", "WorkflowModel", "WorkflowSpec", "action_text", "lm_policy_values",
    "policy_values",
]
