"""ELPO Fig. 1 study (``rtrees study elpo-fig1``): recovery after fixing one step, the data.

ELPO's Fig. 1 (docs/METHODS.md section 8.1): for failed trajectories, fix one step and
resample the rest; the recovery rate when the fixed step is the first irrecoverable
step, the first error step, or a random error step (AIME25: 32.8% / 23.6% / 4.2%).

On ``workflow`` every term is exact [R; docs/METHODS.md section 8.1]:

* a *failed trajectory* is a complete episode of the old policy mu
  (``workflow_study.base_policy``) with reward 0; its full states s_0 .. s_K come
  from the environment (hidden flags included);
* the *first irrecoverable step* is t_irr = ``WorkflowModel.first_irrecoverable_step``:
  the smallest k whose state s_k has success probability 0 under every policy (BEL's
  ground truth t_crit);
* an *error step* is a step k (1-based, action a_k taken in s_{k-1}) whose action loses
  more than ``tau_err`` of the best achievable success probability:
  V*(v_{k-1}) - Q*(v_{k-1}, a_k) > tau_err, with V*, Q* the optimal values and v_{k-1}
  the state the agent sees (``error_state="visible"``, the default: the observable
  part of s_{k-1}, hidden flags off, ``workflow_study.visible_state``) or the full state
  (``error_state="full"``). On the full state no step after t_irr can be an error
  (every action there has Q* = 0), so "an error after the first irrecoverable step"
  cannot exist; on the visible state it can, as for an agent that cannot see the hidden
  corruption. The *first error step* is the smallest such k; a *random error step* is
  one of them drawn uniformly (seeded); the *matched error step* (the position-matched
  control) is one drawn uniformly from the error steps at or before t_irr, the window
  in which the first irrecoverable step itself lies and a fix can still succeed;
* to *fix* step k: restore the environment to s_{k-1} (the snapshot before step k),
  take the optimal action argmax_a Q*(s_{k-1}, a) (``OptimalValues.best_action``; it
  may equal a_k when the step failed by its tool outcome, not its choice), and continue
  with mu to the end of the episode with fresh tool outcomes. The trajectory
  *recovers* when that continuation succeeds. Per (trajectory, arm) we record the exact
  recovery probability Q_mu(s_{k-1}, a*) (mu's exact values; the action forced, then
  mu) and ``resamples`` sampled continuations through the environment
  (``workflow_study.sample_from``: ``Continuing.begin`` from the snapshot, reseeded).

A failed trajectory without an error step (it failed by tool outcomes alone) has no
first / random error arm, and one without an error at or before t_irr no matched arm;
the report counts them and stratifies recovery by the fixed step's position relative to
t_irr (before, at, after) and by horizon. A fourth arm, *random step* (one of
steps 1..K uniformly, error or not, so often after t_irr where no fix can help), reads
"random error step" the other way, as a step picked without localization.

On ``calc`` (tiny LM policy, no exact values) [R]: the failed trajectory is BEL's tau*
in one BEL tree per task (``train.sampling.bel``, N_total 16, stored in ``store-calc``);
the first irrecoverable step is BEL's localization t_crit; an error step is one whose
action contradicts the task's answer (``calc_error``); the fix is the scripted expert's
action (``CalcEnv.expert_action``) at the step's state, then the policy; recovery is
sampled only (``resamples`` continuations by ``train.sampling.references.run_references``).

Data: ``recovery.parquet`` (one row per environment, trajectory and arm), ``store-calc/``
and ``study.json``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from train.coerce import check_bounds, check_types
from train.envs import env_class
from train.envs.workflow import WorkflowEnv
from train.envs.workflow_model import State, WorkflowModel
from train.studies import STUDY_MAXIMA
from train.studies.workflow_study import (
    Log,
    base_policy,
    log_progress,
    make_study_dir,
    make_tasks,
    sample_from,
    stream_key,
    task_model,
    tool_name,
    visible_state,
    write_study,
)

FIG1_HORIZONS: tuple[int, ...] = (12, 18, 24)
"""Workflow horizons of the study: long enough that an error can come well before or
after the first irrecoverable step (issue 23)."""

ARMS = ("first_irrecoverable", "first_error", "random_error", "random_step", "matched_error")


def _visible(model: WorkflowModel, state: State) -> State:
    return visible_state(model.observe(state))


def _full(model: WorkflowModel, state: State) -> State:
    return state


ERROR_STATES: dict[str, Callable[[WorkflowModel, State], State]] = {
    "visible": _visible, "full": _full}
"""The state an error step is judged on (``RecoveryConfig.error_state``)."""


@dataclass(frozen=True)
class RecoveryConfig:
    """Settings of the ELPO Fig. 1 study (``rtrees study elpo-fig1``)."""

    n_tasks: int = 48
    """Workflow tasks (horizons cycle through ``horizons``)."""
    seed: int = 0
    horizons: tuple[int, ...] = FIG1_HORIZONS
    error_state: str = "visible"
    """Error steps judged on the state the agent sees (``visible``) or the full state
    (``full``, hidden flags included; ``ERROR_STATES``)."""
    failures_per_task: int = 4
    """Failed trajectories of mu per task."""
    max_attempts: int = 64
    """Trajectories sampled per task at most while looking for failures."""
    resamples: int = 16
    """Sampled continuations after each fix (beside the exact recovery probability)."""
    tau_err: float = 0.02
    """An error step loses more than this of the best success probability [R]."""
    mu_beta: float = 3.0
    """mu's logits = mu_beta * Q* + mu_noise * N(0, 1)."""
    mu_noise: float = 0.5
    n_boot: int = 2000
    """Task bootstrap resamples of the report."""
    envs: tuple[str, ...] = ("workflow", "calc")
    """``workflow`` (exact) and/or ``calc`` (BEL localization, the tiny LM policy)."""
    calc_tasks: int = 32
    """Calc tasks: one BEL tree each (``n_total`` 16); its tau* is the failed trajectory."""
    calc_policy: str = "tiny"
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        check_types(self)  # train.coerce: field types, finite floats (issue 21)
        check_bounds(self, {"n_boot": 1, "calc_tasks": 1, "max_new_tokens": 1}, STUDY_MAXIMA)
        if not self.envs or set(self.envs) - {"workflow", "calc"}:
            raise ValueError(f"envs must be workflow and/or calc, got {list(self.envs)}")
        for name in ("n_tasks", "failures_per_task", "max_attempts", "resamples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.error_state not in ERROR_STATES:
            raise ValueError(f"error_state must be one of {tuple(ERROR_STATES)}, got "
                             f"{self.error_state!r}")
        if self.tau_err < 0:
            raise ValueError(f"tau_err must be >= 0, got {self.tau_err}")


def run_recovery_study(out_dir: str | Path, config: RecoveryConfig | None = None,
                       log: Log | None = None) -> Path:
    """Sample failures, fix each arm's step, resample (module docstring); write
    ``recovery.parquet`` and ``study.json`` to ``out_dir``; return the path of
    ``study.json`` (the report: ``analysis.recovery.recovery_results``). Progress lines go
    to ``log``."""
    config = config or RecoveryConfig()
    out = make_study_dir(out_dir)
    started = time.perf_counter()
    rows: dict[str, list[Any]] = {}
    n_failed = n_sampled = 0
    # the exact arm on an env with exact values (workflow), the BEL-localized sampled arm
    # on the other (calc): RecoveryConfig admits those two
    exact_envs = [env for env in config.envs if env_class(env).exact_values]
    if exact_envs:
        n_failed, n_sampled = _workflow_rows(config, rows, log)
    sampled = len(exact_envs) < len(config.envs)
    n_calc = _calc_rows(config, rows, out, log) if sampled else 0
    schema = pa.schema([("env", pa.string()), ("task_id", pa.string()), ("horizon", pa.int64()),
                        ("trajectory", pa.string()), ("arm", pa.string()), ("step", pa.int64()),
                        ("n_steps", pa.int64()), ("n_errors", pa.int64()),
                        ("first_irrecoverable", pa.int64()), ("action", pa.string()),
                        ("fixed_action", pa.string()), ("changed", pa.bool_()),
                        ("exact_recovery", pa.float64()), ("successes", pa.int64()),
                        ("resamples", pa.int64())])
    table = pa.table({f.name: pa.array(rows.get(f.name, []), f.type) for f in schema},
                     schema=schema)
    path = out / "recovery.parquet"
    pq.write_table(table, path)
    return write_study(out / "study.json", {
        "study": "elpo-fig1", "config": asdict(config), "recovery_path": path.name,
        "n_failed_trajectories": n_failed + n_calc, "n_sampled_trajectories": n_sampled,
        "calc_store": "store-calc" if sampled else None, "exact_envs": exact_envs,
        "seconds": time.perf_counter() - started})


def _add(rows: dict[str, list[Any]], row: dict[str, Any]) -> None:
    for key, value in row.items():
        rows.setdefault(key, []).append(value)


def _workflow_rows(config: RecoveryConfig, rows: dict[str, list[Any]], log: Log | None = None
                   ) -> tuple[int, int]:
    """The workflow rows (module docstring); returns (failed, sampled) trajectory counts."""
    env = WorkflowEnv()
    judged = ERROR_STATES[config.error_state]
    n_failed = n_sampled = 0
    began = time.perf_counter()
    for i, task in enumerate(make_tasks(config.n_tasks, config.seed, config.horizons)):
        log_progress(log, "workflow tasks", i, config.n_tasks, began)
        model = task_model(task)
        if not model.recoverable(model.initial_state()):
            continue  # unsolvable: no step can be fixed
        mu = base_policy(model, np.random.default_rng([config.seed, i, 11]), config.mu_beta,
                         config.mu_noise)
        optimal, values = model.optimal_values(), mu.values()
        env.reset(task)
        start = env.snapshot()
        found = 0
        for attempt in range(config.max_attempts):
            if found == config.failures_per_task:
                break
            n_sampled += 1
            traj = sample_from(env, start, mu, stream_key(config.seed, "fig1", task.task_id,
                                                          attempt), snapshots=True)
            if traj.reward >= 1.0 or not traj.complete:
                continue
            t_irr = model.first_irrecoverable_step(traj.states)
            assert t_irr is not None and t_irr >= 1  # a failed end state is irrecoverable
            seen = [judged(model, s) for s in traj.states]
            errors = [k for k in range(1, traj.steps + 1)
                      if optimal.v(seen[k - 1])
                      - optimal.q(seen[k - 1], traj.actions[k - 1]) > config.tau_err]
            steps = _arm_steps(config, errors, t_irr, traj.steps, task.task_id, attempt)
            for arm in ARMS:
                k = steps[arm]
                row: dict[str, Any] = {
                    "env": "workflow", "task_id": task.task_id, "horizon": model.horizon,
                    "trajectory": f"{task.task_id}/{attempt}", "arm": arm, "step": k,
                    "n_steps": traj.steps, "n_errors": len(errors),
                    "first_irrecoverable": t_irr, "action": None, "fixed_action": None,
                    "changed": None, "exact_recovery": None, "successes": None,
                    "resamples": 0}
                if k is not None:
                    s = traj.states[k - 1]
                    best = optimal.best_action(s)
                    wins = sum(sample_from(env, traj.snapshots[k - 1], mu, stream_key(
                        config.seed, "fix", task.task_id, attempt, arm, r), best).reward >= 1.0
                        for r in range(config.resamples))
                    row.update(action=tool_name(traj.actions[k - 1]), fixed_action=tool_name(best),
                               changed=best != traj.actions[k - 1],
                               exact_recovery=float(values.q(s, best)), successes=int(wins),
                               resamples=config.resamples)
                _add(rows, row)
            found += 1
            n_failed += 1
    return n_failed, n_sampled


def _arm_steps(config: RecoveryConfig, errors: list[int], t_irr: int, n_steps: int,
               *key: Any) -> dict[str, int | None]:
    """The step each arm fixes (module docstring) for one failed trajectory: ``errors``
    its error steps, ``t_irr`` its first irrecoverable step, ``key`` its stream key parts
    (the random and random-step draws as before the matched arm existed; the matched
    arm draws from a stream of its own)."""
    pick = random.Random(stream_key(config.seed, "random-error", *key))
    window = [k for k in errors if k <= t_irr]
    matched = random.Random(stream_key(config.seed, "matched-error", *key))
    return {"first_irrecoverable": t_irr,
            "first_error": errors[0] if errors else None,
            "random_error": pick.choice(errors) if errors else None,
            "random_step": pick.randint(1, n_steps),
            "matched_error": matched.choice(window) if window else None}


def calc_error(action: str, observation: str, gold: str) -> bool:
    """[R] A calc step is an error when its action is an answer whose value is not the
    gold answer, or a tool call whose response is not the gold value (an error response,
    or a wrong / partial expression: the task is one expression, which the expert calls
    whole)."""
    from train.envs.base import tool_response
    from train.envs.calc import parse_number

    gold_value = parse_number(gold)
    if action.strip().startswith("<answer>"):
        inner = action.strip().removeprefix("<answer>").removesuffix("</answer>")
        return parse_number(inner) != gold_value
    if observation.startswith("<tool_response>"):
        body = observation.removeprefix("<tool_response>").removesuffix("</tool_response>")
        value = parse_number(body)
        return value is None or value != gold_value or observation != tool_response(body)
    return True


def _calc_rows(config: RecoveryConfig, rows: dict[str, list[Any]], out: Path,
               log: Log | None = None) -> int:
    """The calc rows: BEL trees of the tiny policy (``store-calc``); per tree with a
    localization, tau*'s steps; the arms' fixes are the scripted expert's action
    (``CalcEnv.expert_action``) at the step's state, then ``resamples`` continuations of
    the policy (``train.sampling.references.run_references``, the continuation
    primitive). First irrecoverable = BEL's t_crit; errors: ``calc_error``. No exact
    value. Returns the number of localized trajectories."""
    import json

    from rollout_store import Store, connect
    from train.envs import make_env
    from train.policies import load_policy
    from train.sampling.collect import collect
    from train.sampling.continuation import NodeStart, load_starts
    from train.sampling.references import ReferenceConfig, run_references

    policy = load_policy(config.calc_policy, "calc")
    tasks = env_class("calc").generate_tasks(config.calc_tasks, config.seed)
    gold = {t.task_id: str(t.answer) for t in tasks}
    store_dir = out / "store-calc"
    store = Store(store_dir, create=not store_dir.exists())
    if log is not None:
        log(f"calc: BEL trees of {len(tasks)} tasks, then each arm's resamples")
    collect(store, "calc", policy, "bel", tasks, 16, config.seed, "fig1-calc-bel",
            sampler_params={"max_new_tokens": config.max_new_tokens}, progress=False)
    con = connect(store)
    trees = con.sql("SELECT tree_id, task_id, env_config, meta FROM trees "
                    "WHERE run_id = 'fig1-calc-bel' ORDER BY tree_id").fetchall()
    env = make_env("calc")
    ref = ReferenceConfig(k=config.resamples, seed=config.seed,
                          max_new_tokens=config.max_new_tokens)
    n_found = 0
    for tree_id, task_id, env_config, meta_text in trees:
        bel = json.loads(meta_text or "{}").get("bel", {})
        if "t_crit" not in bel:
            continue
        leaf = int(bel["trajectory_leaf"])
        path = con.execute("""
            SELECT a.node_id, a.action_text, a.observation_text FROM nodes c JOIN nodes a
              ON a.tree_id = c.tree_id AND a.preorder <= c.preorder
             AND c.preorder < a.preorder + a.subtree_size
            WHERE c.tree_id = $t AND c.node_id = $n ORDER BY a.depth""",
                           {"t": tree_id, "n": leaf}).fetchall()
        steps = path[1:]  # step k = path[k]; its state before = path[k - 1]
        errors = [k for k in range(1, len(steps) + 1)
                  if calc_error(steps[k - 1][1] or "", steps[k - 1][2] or "", gold[task_id])]
        t_crit = int(bel["t_crit"])
        arm_steps = _arm_steps(config, errors, t_crit, len(steps), tree_id)
        befores = sorted({path[k - 1][0] for k in arm_steps.values() if k is not None})
        starts = {s.node_id: s for s in load_starts(con, pa.table({
            "tree_id": [tree_id] * len(befores), "node_id": befores,
            "env_config": [env_config] * len(befores)}))}
        fixed: dict[str, NodeStart] = {}
        for arm, k in arm_steps.items():
            if k is None:
                continue
            start = starts[path[k - 1][0]]
            run = start.begin(env, stream_key(config.seed, "fix", tree_id, arm))
            result = run.step(env.expert_action())
            fixed[arm] = NodeStart(tree_id, -1, tuple(run.turns), env.snapshot(), run.depth,
                                   start.max_steps, run.reward if result.done else None)
        names = list(fixed)
        wins = run_references(policy, lambda: make_env("calc"), [fixed[a] for a in names], ref)
        won = dict(zip(names, wins, strict=True))
        for arm, k in arm_steps.items():
            row: dict[str, Any] = {
                "env": "calc", "task_id": task_id, "horizon": None, "trajectory": tree_id,
                "arm": arm, "step": k, "n_steps": len(steps), "n_errors": len(errors),
                "first_irrecoverable": t_crit, "action": None, "fixed_action": None,
                "changed": None, "exact_recovery": None, "successes": None, "resamples": 0}
            if k is not None:
                row.update(action=(steps[k - 1][1] or "")[:80], fixed_action=fixed[arm]
                           .transcript[-2][1][:80], changed=fixed[arm].transcript[-2][1]
                           != steps[k - 1][1], successes=int(won[arm]),
                           resamples=config.resamples)
            _add(rows, row)
        n_found += 1
    env.close()
    return n_found


__all__ = ["ARMS", "ERROR_STATES", "FIG1_HORIZONS", "RecoveryConfig", "run_recovery_study"]
