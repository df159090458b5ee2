"""ELPO Fig. 3 study (``rtrees study elpo-fig3``): ranking quality by tree construction, the data.

METHODS.md section 2.4 (E10-E11). At equal ``n_total`` on the same tasks, each
*construction* is a (sampler, credit) pair: the sampler builds the trees, the credit
scores every child of every branching node, and the audit compares that ordering with
a reference (``analysis.constructions``):

===============  =======================  =================================================
construction     sampler                  credit
===============  =======================  =================================================
ELPO             ``bel`` (BEL, E1-E2)     ``elpo`` (A_hier, E3-E7)
ELPO w/o BEL     ``random`` (Tree-GRPO)   ``elpo``
AEPO stand-in    ``entropy``              ``tree_grpo`` (G9-G11)
Tree-GRPO        ``random``               ``tree_grpo``
GRPO             ``group``                ``grpo`` (G1)
===============  =======================  =================================================

**The AEPO stand-in** [R]: AEPO's rollout is ARPO-style entropy-gated branching after
tool feedback, which ``train.sampling.entropy`` implements (its consecutive-branch
penalty read as "a position branches at most once"); AEPO's entropy-balanced advantage
has no estimator in ``train.credit``, so its trees are scored by the tree-structured
group advantage ``tree_grpo``. What stands in is therefore "entropy-branch trees +
Tree-GRPO credit", not AEPO's own advantage shaping.

Data, per environment (``envs``), each in its own store ``out/store-<env>``:

1. tasks (``workflow``: ``workflow_study.make_tasks``; ``calc``: ``CalcEnv.generate_tasks``)
   and one tree per task and sampler, ``n_total`` rollouts each
   (``train.sampling.collect.collect``, run id ``fig3-<env>-<sampler>``). The policy:
   on workflow the ``tabular`` backend holding each task's old policy mu
   (``workflow_study.base_policy``: logits beta * Q* + noise), so every value is exact;
   on calc the tiny LM policy (``calc_policy``);
2. credit ``elpo``, ``tree_grpo`` and ``grpo`` for every tree
   (``train.credit.store_io.compute_credits``; default params);
3. Mean@k references of every child of every branching node
   (``train.sampling.references.collect_references`` with the same policy);
4. workflow only: the exact value of every such child, V_mu(s) of the full state s in
   the child's snapshot (``WorkflowEnv.snapshot_state``; the reward for a leaf child),
   to ``exact-workflow.parquet`` (tree_id, node_id, exact).

``study.json`` records the constructions, the stores, run ids and settings.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollout_store import Store, connect
from train.coerce import check_bounds, check_types
from train.envs.base import Task
from train.envs.workflow import DEFAULT_HORIZONS, WorkflowEnv
from train.envs.workflow_model import PolicyValues
from train.envs.workflow_policy import TabularPolicy
from train.studies import STUDY_MAXIMA
from train.studies.workflow_study import (
    base_policy,
    make_study_dir,
    make_tasks,
    task_model,
    write_study,
)

# name -> (sampler, credit method); the order of the report's tables.
CONSTRUCTIONS: dict[str, tuple[str, str]] = {
    "ELPO": ("bel", "elpo"),
    "ELPO w/o BEL": ("random", "elpo"),
    "AEPO stand-in": ("entropy", "tree_grpo"),
    "Tree-GRPO": ("random", "tree_grpo"),
    "GRPO": ("group", "grpo"),
}
AEPO_STAND_IN = ("entropy-branch trees (train.sampling.entropy: ARPO/AEPO-style branching "
                 "where the entropy after tool feedback rises above the root's) scored by "
                 "tree_grpo credit; AEPO's own entropy-balanced advantage is not implemented")


@dataclass(frozen=True)
class ConstructionConfig:
    """Settings of the ELPO Fig. 3 study (``rtrees study elpo-fig3``)."""

    envs: tuple[str, ...] = ("workflow", "calc")
    """Environments: ``workflow`` (exact references) and/or ``calc`` (tiny LM policy)."""
    n_tasks: int = 48
    """Workflow tasks (the paper: 200 questions)."""
    calc_tasks: int = 16
    """Calc tasks (the tiny policy is slow on 2 cores)."""
    n_total: int = 16
    """Rollouts per tree, every construction (ELPO's N_total)."""
    k: int = 32
    """Rollouts behind each Mean@k reference."""
    seed: int = 0
    horizons: tuple[int, ...] = DEFAULT_HORIZONS
    mu_beta: float = 3.0
    """Workflow mu's logits = mu_beta * Q* + mu_noise * N(0, 1)."""
    mu_noise: float = 0.5
    calc_policy: str = "tiny"
    """Policy spec on calc (``train.policies.load_policy``)."""
    max_new_tokens: int = 64
    """Token cap of one agent step on calc."""
    n_boot: int = 1000
    """Task bootstrap resamples of the report."""

    def __post_init__(self) -> None:
        check_types(self)  # train.coerce: field types, finite floats (issue 21)
        check_bounds(self, {"n_boot": 1, "max_new_tokens": 1}, STUDY_MAXIMA)
        unknown = sorted(set(self.envs) - {"workflow", "calc"})
        if unknown or not self.envs:
            raise ValueError(f"envs must be workflow and/or calc, got {list(self.envs)}")
        if min(self.n_tasks, self.calc_tasks, self.n_total, self.k) < 1:
            raise ValueError("n_tasks, calc_tasks, n_total and k must be >= 1")
        if self.n_total < 4:
            raise ValueError(f"n_total must be >= 4 for a tree to branch, got {self.n_total}")


def workflow_policy(tasks: list[Task], config: ConstructionConfig
                    ) -> tuple[Any, dict[str, TabularPolicy]]:
    """The ``tabular`` backend holding every task's mu, and mu by task id."""
    from train.policies.tabular import TabularBackend

    mus = {}
    for i, task in enumerate(tasks):
        model = task_model(task)
        mus[task.task_id] = base_policy(model, np.random.default_rng([config.seed, i, 14]),
                                        config.mu_beta, config.mu_noise)
    return TabularBackend(list(mus.values())), mus


def exact_children(store: Store, mus: dict[str, TabularPolicy]) -> pa.Table:
    """(tree_id, node_id, exact): V_mu of the state after each child of a branching node
    (the reward of a leaf child), from the child's stored snapshot."""
    from train.sampling.continuation import load_starts

    con = connect(store)
    kids = con.sql("""
        WITH branching AS (SELECT tree_id, parent_id FROM nodes WHERE parent_id IS NOT NULL
                           GROUP BY tree_id, parent_id HAVING count(*) >= 2)
        SELECT n.tree_id, n.node_id, t.env_config, t.task_id
        FROM nodes n JOIN branching b ON n.tree_id = b.tree_id AND n.parent_id = b.parent_id
        JOIN trees t ON t.tree_id = n.tree_id
        ORDER BY n.tree_id, n.node_id""").to_arrow_table()
    starts = load_starts(con, kids)
    tables: dict[str, PolicyValues] = {}
    values = []
    for start, task_id in zip(starts, kids.column("task_id").to_pylist(), strict=True):
        if start.state is None:  # a leaf child: its reward is its value
            values.append(float(start.leaf_reward or 0.0))
            continue
        if task_id not in tables:
            tables[task_id] = mus[task_id].values()
        values.append(float(tables[task_id].v(WorkflowEnv.snapshot_state(start.state))))
    return pa.table({"tree_id": kids.column("tree_id"), "node_id": kids.column("node_id"),
                     "exact": pa.array(values, pa.float64())})


def _env_tasks(env: str, config: ConstructionConfig) -> list[Task]:
    """The study's tasks on ``env``: on an env with exact values (workflow) ``n_tasks`` at
    ``horizons`` (``workflow_study.make_tasks``), else ``calc_tasks`` of its default mix."""
    if _exact(env):
        return make_tasks(config.n_tasks, config.seed, config.horizons)
    from train.envs import env_class

    return env_class(env).generate_tasks(config.calc_tasks, config.seed)


def _exact(env: str) -> bool:
    """Whether ``env``'s class declares exact values (``Environment.exact_values``): the
    tabular mu as the policy and the exact value of every child."""
    from train.envs import env_class

    return env_class(env).exact_values


def run_construction_study(out_dir: str | Path, config: ConstructionConfig | None = None,
                           progress: bool = False) -> Path:
    """Collect, credit, reference (and on workflow the exact values) into ``out_dir``
    (module docstring); return the path of ``study.json``. Reruns reuse every stored
    tree, credit and reference."""
    from train.credit.store_io import compute_credits
    from train.policies import load_policy
    from train.sampling.collect import collect
    from train.sampling.references import ReferenceConfig, collect_references

    config = config or ConstructionConfig()
    out = make_study_dir(out_dir)
    started = time.perf_counter()
    envs: dict[str, dict[str, Any]] = {}
    samplers = sorted({s for s, _ in CONSTRUCTIONS.values()})
    methods = sorted({m for _, m in CONSTRUCTIONS.values()})
    for env in config.envs:
        t0 = time.perf_counter()
        tasks = _env_tasks(env, config)
        store_dir = out / f"store-{env}"
        store = Store(store_dir, create=not store_dir.exists())
        mus: dict[str, TabularPolicy] = {}
        exact_values = _exact(env)
        if exact_values:
            policy, mus = workflow_policy(tasks, config)
            params: dict[str, Any] = {}
        else:
            policy = load_policy(config.calc_policy, env)
            params = {"max_new_tokens": config.max_new_tokens}
        runs = {}
        for sampler in samplers:
            run_id = f"fig3-{env}-{sampler}"
            collect(store, env, policy, sampler, tasks, config.n_total, config.seed, run_id,
                    sampler_params=params, progress=progress)
            runs[sampler] = run_id
        for method in methods:
            compute_credits(store, method, progress=progress)
        refs = collect_references(store, ReferenceConfig(
            k=config.k, seed=config.seed, max_new_tokens=config.max_new_tokens),
            policy=policy, progress=progress)
        doc: dict[str, Any] = {
            "store": store_dir.name, "runs": runs, "n_tasks": len(tasks),
            "reference_policy": str(policy.policy_version),
            "references": {"children": refs.children, "sampled": refs.sampled,
                           "rollouts": refs.rollouts}}
        if exact_values:
            exact = exact_children(store, mus)
            pq.write_table(exact, out / f"exact-{env}.parquet")
            doc["exact"] = f"exact-{env}.parquet"
        doc["seconds"] = time.perf_counter() - t0
        envs[env] = doc
    return write_study(out / "study.json", {
        "study": "elpo-fig3", "config": asdict(config),
        "constructions": {k: list(v) for k, v in CONSTRUCTIONS.items()},
        "aepo_stand_in": AEPO_STAND_IN, "envs": envs,
        "seconds": time.perf_counter() - started})


__all__ = ["AEPO_STAND_IN", "CONSTRUCTIONS", "ConstructionConfig", "exact_children",
           "run_construction_study", "workflow_policy"]
