"""Localization study: BEL localizations of failed trajectories, with the exact first
irrecoverable step, archived in a store (the report: ``analysis.localization``).

METHODS.md section 2.1 (ELPO's BEL). On ``workflow`` tasks
the first irrecoverable step t_crit of a failed trajectory is known exactly
(``WorkflowModel.first_irrecoverable_step``: the first step after which success
has probability 0 under every policy). For each task, mode (deterministic /
stochastic tool outcomes) and number X of suffix samples per probe:

1. BEL runs as the real sampler (``train.sampling.bel.BelSampler`` with the
   ``tabular`` backend holding the task's policy mu): ``n_initial`` explore
   rollouts, tau* = the failed one with the largest entropy gap (E1), then the
   binary search with X suffixes per probe (``x_min = x_max = X``: the study
   variable replaces E2's entropy-adaptive count) and no probe cap (``b_max=None``;
   ``max_probes`` sets ELPO's B_max = 3 reading). The budget is n_initial +
   ceil(log2 H) * X (enough for the whole search; leftovers become BEL's fill
   rollouts);
2. consistency: the explore phase of a localization is seeded by (task, failure
   index) only and the probes by (X, repeat), so ``repeats`` localizations of the
   same failed trajectory differ only in their suffix samples (``TreeBuilder``'s
   ``phase_seeds``: the probe and fill phases get the probe seed);
3. the exact t_crit of tau* comes from the env snapshots of its path
   (``WorkflowEnv.snapshot_state``); every BEL tree is archived in ``out_dir/store``
   with ``trees.critical_node_id`` = BEL's localized node, the exact node, X, mode,
   repeat in ``meta["study"]`` (snapshots kept for the root and tau*'s path only, so
   the ground truth can be recomputed from the store);
4. accuracy (localized == exact), signed error, probes, suffix rollouts and steps,
   and the repeat agreement are computed from the store by DuckDB SQL
   (``analysis.localization.localization_summary``).

``implementation="local"`` runs ``bel_search`` instead: a small, self-contained
binary search of lines 4-9 of the section 2.1 pseudocode on trajectories sampled
by ``workflow_study.sample_from`` (the continuation primitive of
``train.sampling.base``: every suffix restores the anchor's snapshot and reseeds);
kept as a fast reference with a fixed X per probe and no budget, and for probing a
given trajectory by hand. It archives only the failed trajectory as a chain; the
consistency metrics over the repeats are defined in ``analysis.localization``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from rollout_store import Node, Store, Tree
from train.envs.base import Task
from train.envs.workflow import DEFAULT_HORIZONS, WorkflowEnv
from train.envs.workflow_model import State, WorkflowModel
from train.envs.workflow_policy import TabularPolicy
from train.policies.tabular import TabularBackend
from train.sampling.bel import EXPLORE_PHASE, FILL_PHASE, PROBE_PHASE, BelConfig, BelSampler
from train.studies.workflow_study import (
    base_policy,
    config_hash,
    make_study_dir,
    make_tasks,
    sample_from,
    stream_key,
    task_model,
    write_study,
)

Implementation = Literal["sampler", "local"]


@dataclass(frozen=True)
class LocalizationConfig:
    """The localization audit's settings (defaults: about half a minute on one core)."""

    n_tasks: int = 12
    """Workflow tasks per mode."""
    seed: int = 0
    horizons: tuple[int, ...] = DEFAULT_HORIZONS
    deterministic_modes: tuple[bool, ...] = (True, False)
    """Tool-outcome modes to run: True = deterministic, False = stochastic."""
    x_values: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Suffix samples per probe (X) to sweep."""
    failures_per_task: int = 2
    """Failed trajectories localized per task (one explore seed each)."""
    repeats: int = 4
    """Independent localizations of each failed trajectory (consistency)."""
    max_probes: int | None = None
    """Probe cap (ELPO's B_max = 3); None searches until L == R."""
    n_initial: int = 8
    """Explore rollouts before the search (BEL's N0; sampler implementation)."""
    max_attempts: int = 20
    """Explore seeds (sampler) or full rollouts (local) tried per task to find failures."""
    implementation: Implementation = "sampler"
    """``sampler``: ``train.sampling.bel.BelSampler``; ``local``: ``bel_search``."""
    mu_beta: float = 3.0
    """mu's logits = mu_beta * Q* + mu_noise * N(0, 1) (``workflow_study.base_policy``)."""
    mu_noise: float = 0.5

    def __post_init__(self) -> None:
        if not self.x_values or min(self.x_values) < 1:
            raise ValueError(f"x_values must be >= 1, got {self.x_values}")
        if self.repeats < 1 or self.failures_per_task < 1 or self.n_tasks < 1:
            raise ValueError("n_tasks, failures_per_task and repeats must be >= 1")
        if self.max_probes is not None and self.max_probes < 1:
            raise ValueError(f"max_probes must be >= 1 or None, got {self.max_probes}")
        if self.implementation not in ("sampler", "local"):
            raise ValueError(f"implementation must be 'sampler' or 'local', "
                             f"got {self.implementation!r}")

    @property
    def run_id(self) -> str:
        """``localization-{seed}-{hash of the config}``: reruns of one config reuse their
        trees; other configs get their own."""
        return f"localization-{self.seed}-{config_hash(self)}"


@dataclass(frozen=True)
class BELResult:
    """One localization: the localized step L (1-based), probes made, suffix rollouts
    and their tool steps, and the probed anchors with their outcome (any success)."""

    t_crit: int
    probes: int
    suffix_rollouts: int
    suffix_steps: int
    anchors: tuple[tuple[int, bool], ...]


def bel_search(env: WorkflowEnv, snapshots: Sequence[bytes], policy: TabularPolicy, x: int,
               key: tuple[object, ...], max_probes: int | None = None) -> BELResult:
    """Binary-search error localization of one failed trajectory (METHODS 2.1, lines 4-9).

    ``snapshots[m]`` is the env state after step m (``[0]``: the start), K =
    len(snapshots) - 1 steps. Invariant: the prefix up to L - 1 was shown recoverable
    (a suffix from it succeeded) and the prefix up to R is presumed irrecoverable (the
    trajectory failed). Returns t_crit = L.
    """
    k_steps = len(snapshots) - 1
    if k_steps < 1:
        raise ValueError("a trajectory needs at least one step")
    lo, hi = 1, k_steps
    probes = rollouts = steps = 0
    anchors = []
    while lo < hi and (max_probes is None or probes < max_probes):
        m = (lo + hi) // 2
        success = False
        for j in range(x):
            suffix = sample_from(env, snapshots[m], policy, stream_key(*key, m, j))
            rollouts += 1
            steps += suffix.steps
            success = success or suffix.reward >= 1.0
        probes += 1
        anchors.append((m, success))
        if success:
            lo = m + 1
        else:
            hi = m
    return BELResult(lo, probes, rollouts, steps, tuple(anchors))


# ----------------------------------------------------------------- with the real sampler
def _path_states(tree: Tree, leaf: int) -> tuple[list[State], list[int]]:
    """Full states s_0 .. s_K along the path to ``leaf`` (from the node snapshots) and the
    node ids of steps 1 .. K."""
    path = tree.path_to(leaf)
    states = [WorkflowEnv.snapshot_state(tree.snapshots[n.snapshot_id])
              for n in path if n.snapshot_id is not None]
    if len(states) != len(path):
        raise ValueError(f"tree {tree.tree_id}: a node on the localized path has no snapshot")
    return states, [n.node_id for n in path[1:]]


def _slim(tree: Tree, keep: set[int]) -> None:
    """Drop the snapshots of every node outside ``keep`` (the archive stays small)."""
    kept = {}
    for node in tree.nodes:
        if node.node_id in keep and node.snapshot_id is not None:
            kept[node.snapshot_id] = tree.snapshots[node.snapshot_id]
        else:
            node.snapshot_id = None
    tree.snapshots = kept


def _bel_tree(env: WorkflowEnv, backend: TabularBackend, task: Task, model: WorkflowModel,
              config: LocalizationConfig, x: int, rep: int, explore_seed: int, n_total: int,
              tree_id: str) -> Tree | None:
    """One BEL localization (None when the explore rollouts had no failure), with the
    exact t_crit of its trajectory in ``meta["study"]``."""
    sampler = BelSampler(BelConfig(b_max=config.max_probes, x_min=x, x_max=x,
                                   n_initial=config.n_initial))
    probe_seed = int(stream_key(config.seed, "probe", explore_seed, x, rep))
    tree = sampler.sample_tree(env, backend, task, n_total, seed=explore_seed, tree_id=tree_id,
                               run_id=config.run_id,
                               phase_seeds={PROBE_PHASE: probe_seed, FILL_PHASE: probe_seed})
    assert tree.meta is not None
    info = tree.meta["bel"]
    if "t_crit" not in info:
        return None
    states, step_ids = _path_states(tree, int(info["trajectory_leaf"]))
    truth = model.first_irrecoverable_step(states)
    assert truth is not None and truth >= 1  # a failed end state is irrecoverable
    tree.meta["study"] = {
        "x": x, "repeat": rep, "true_critical_step": truth,
        "localized_step": int(info["t_crit"]), "true_critical_node_id": step_ids[truth - 1],
        "probes": len(info["probes"]), "n_steps": int(info["k"]),
        "suffix_steps": sum(1 for n in tree.nodes if n.phase == PROBE_PHASE),
        "explore_seed": explore_seed, "probe_seed": probe_seed}
    _slim(tree, {0, *step_ids})
    return tree


def _sampler_trees(env: WorkflowEnv, task: Task, model: WorkflowModel, mu: TabularPolicy,
                   det: bool, config: LocalizationConfig, start_index: int
                   ) -> tuple[list[Tree], int]:
    """Every localization of one task's failures (X x repeats each) as BEL trees."""
    backend = TabularBackend([mu])
    n_probes = math.ceil(math.log2(max(model.horizon, 2)))
    if config.max_probes is not None:
        n_probes = min(n_probes, config.max_probes)
    trees: list[Tree] = []
    found = 0
    for attempt in range(config.max_attempts):
        if found == config.failures_per_task:
            break
        explore_seed = int(stream_key(config.seed, "explore", task.task_id, attempt))
        trajectory = start_index + found
        batch = []
        for x in config.x_values:
            for rep in range(config.repeats):
                tree = _bel_tree(env, backend, task, model, config, x, rep, explore_seed,
                                 config.n_initial + n_probes * x,
                                 f"{config.run_id}/{'det' if det else 'sto'}/t{trajectory}"
                                 f"/x{x}/r{rep}")
                if tree is None:  # this explore seed found no failure: try the next one
                    break
                assert tree.meta is not None
                tree.meta["study"].update({"deterministic": det, "trajectory": trajectory})
                batch.append(tree)
            if tree is None:
                break
        else:
            trees.extend(batch)
            found += 1
    return trees, found


# ----------------------------------------------------------------- with bel_search
def _local_trees(env: WorkflowEnv, task: Task, model: WorkflowModel, mu: TabularPolicy,
                 det: bool, config: LocalizationConfig, start_index: int
                 ) -> tuple[list[Tree], int]:
    """The same study with ``bel_search`` on failed rollouts of mu (chains archived)."""
    prompt = env.reset(task)
    start = env.snapshot()
    trees: list[Tree] = []
    found = 0
    for attempt in range(config.max_attempts * config.failures_per_task):
        if found == config.failures_per_task:
            break
        traj = sample_from(env, start, mu, stream_key(config.seed, "fail", task.task_id,
                                                      attempt), snapshots=True)
        if traj.reward >= 1.0:
            continue
        truth = model.first_irrecoverable_step(traj.states)
        assert truth is not None and truth >= 1  # a failed end state is irrecoverable
        trajectory = start_index + found
        found += 1
        for x in config.x_values:
            for rep in range(config.repeats):
                result = bel_search(env, traj.snapshots, mu, x,
                                    (config.seed, "bel", det, trajectory, x, rep),
                                    config.max_probes)
                nodes = [Node(0, None, kind="prompt", observation_text=prompt)]
                for k, (action, obs) in enumerate(zip(traj.actions, traj.observations,
                                                      strict=True)):
                    last = k == traj.steps - 1
                    nodes.append(Node(k + 1, k, kind="decision", phase=EXPLORE_PHASE,
                                      action_text=action, observation_text=obs,
                                      terminal=last, reward=traj.reward if last else None,
                                      reward_parts={"reward": traj.reward} if last else {},
                                      tool_calls=1))
                trees.append(Tree(
                    tree_id=f"{config.run_id}/{'det' if det else 'sto'}/t{trajectory}/x{x}"
                            f"/r{rep}", nodes=nodes, run_id=config.run_id,
                    task_id=task.task_id, env="workflow", sampler="bel-local",
                    env_config=task.config, policy_version="mu",
                    budget=1 + result.suffix_rollouts,
                    rollouts_by_phase={EXPLORE_PHASE: 1, PROBE_PHASE: result.suffix_rollouts},
                    critical_node_id=result.t_crit,
                    meta={"study": {
                        "deterministic": det, "x": x, "repeat": rep, "trajectory": trajectory,
                        "true_critical_step": truth, "localized_step": result.t_crit,
                        "true_critical_node_id": truth, "probes": result.probes,
                        "suffix_steps": result.suffix_steps, "n_steps": traj.steps,
                        "anchors": [list(a) for a in result.anchors]}}))
    return trees, found


BEL_IMPLEMENTATION: dict[Implementation, str] = {
    "sampler": "`train.sampling.bel.BelSampler` (the project's BEL sampler, tabular backend) "
               "with x_min = x_max = X and the explore phase shared by the repeats of one "
               "failed trajectory.",
    "local": "`train.studies.localization.bel_search`, a self-contained binary search of "
             "METHODS 2.1 lines 4-9 (fixed X per probe, no N_total budget) on failed "
             "rollouts of mu.",
}


def run_localization_study(out_dir: str | Path, config: LocalizationConfig | None = None
                           ) -> Path:
    """Run the localizations into ``out_dir/store`` and write ``study.json`` (the report:
    ``analysis.localization.localization_results``); return the path of ``study.json``."""
    config = config or LocalizationConfig()
    out = make_study_dir(out_dir)
    start = time.perf_counter()
    store_path = out / "store"
    store = Store(store_path, create=not store_path.exists())
    env = WorkflowEnv()
    trees: list[Tree] = []
    n_failed: dict[str, int] = {}
    make = _sampler_trees if config.implementation == "sampler" else _local_trees
    for det in config.deterministic_modes:
        count = 0
        for i, task in enumerate(make_tasks(config.n_tasks, config.seed, config.horizons,
                                            det)):
            model = task_model(task)
            if not model.recoverable(model.initial_state()):
                continue  # unsolvable task: nothing to localize
            mu = base_policy(model, np.random.default_rng([config.seed, i, 4]),
                             config.mu_beta, config.mu_noise)
            new, found = make(env, task, model, mu, det, config, count)
            trees.extend(new)
            count += found
        n_failed["deterministic" if det else "stochastic"] = count
    if trees:
        store.append_trees(trees, key=config.run_id)  # idempotent: a rerun skips it
    return write_study(out / "study.json", {
        "study": "localization", "config": asdict(config), "run_id": config.run_id,
        "store": store_path.name, "bel_implementation": BEL_IMPLEMENTATION[config.implementation],
        "n_failed_trajectories": n_failed, "seconds": time.perf_counter() - start})


__all__ = ["BELResult", "LocalizationConfig", "bel_search", "run_localization_study"]
