"""Exact credit audit (``rtrees study credit-exact``): how close each estimator's credit is
to the exact advantage, by horizon, on the same trees (issue 23 item 3; docs/METHODS.md
section 8.5).

Per horizon H (``horizons``), in its own store ``out/store-H{H}``:

1. ``n_tasks`` workflow tasks of horizon H (``workflow_study.make_tasks``) and one tree
   per task with ``sampler`` and ``n_total`` rollouts (``train.sampling.collect``), the
   policy the ``tabular`` backend holding each task's mu (``workflow_study.base_policy``:
   logits ``mu_beta * Q* + mu_noise * N(0, 1)``), so every value below is exact;
2. every method of ``methods`` credits every tree (``train.credit.store_io
   .compute_credits``, default params): the node value ``credits.value`` is the method's
   credit of that node's action;
3. the exact advantage of every action node v with parent p, X1:
   ``A(v) = V_mu(s_v) - V_mu(s_p)``, where ``s_v`` is the state in v's snapshot (after
   its action and observation) and ``V_mu`` the exact value under mu
   (``PolicyValues.v``), a leaf's value its reward. Along a root-to-leaf path the
   advantages sum to ``R_leaf - V_mu(s_root)`` (tested). Written to
   ``exact-H{H}.parquet`` (tree_id, node_id, advantage).

The report (``analysis.exact_credit``) gives per (H, method) the mean over trees of the
cosine between the method's node credits and the exact advantages (X2) with task
bootstrap intervals, and the paired differences to ``grpo`` with verdicts.
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
from train.envs.workflow import WorkflowEnv
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

UNSCORED = ("grpo", "tree_grpo", "elpo", "caliper")
"""Estimators that need neither policy scores (trace, dsc, factor and sgcd read
``policy_scores`` of an LM policy, which a tabular policy has none of) nor reward parts
(slca reads sgls's HierR parts, which workflow does not give)."""


@dataclass(frozen=True)
class ExactCreditConfig:
    """Settings of the exact credit audit (``rtrees study credit-exact``)."""

    horizons: tuple[int, ...] = (6, 12, 18, 24)
    """Workflow horizons, one store each."""
    n_tasks: int = 32
    """Tasks (one tree each) per horizon."""
    n_total: int = 16
    """Rollouts per tree."""
    sampler: str = "bel"
    """The sampler of every tree (every method credits the same trees)."""
    methods: tuple[str, ...] = ("grpo", "tree_grpo", "elpo", "caliper")
    """Estimators audited; ``grpo`` is the baseline of the differences."""
    seed: int = 0
    mu_beta: float = 3.0
    """mu's logits = mu_beta * Q* + mu_noise * N(0, 1)."""
    mu_noise: float = 0.5
    n_boot: int = 1000
    """Task bootstrap resamples of the report."""
    delta: float = 0.05
    """Equivalence margin (V1) of a cosine difference [R]."""

    def __post_init__(self) -> None:
        check_types(self)  # train.coerce: field types, finite floats (issue 21)
        check_bounds(self, {"n_boot": 1, "n_tasks": 2, "n_total": 4}, STUDY_MAXIMA)
        if not self.horizons or any(h < 2 for h in self.horizons):
            raise ValueError(f"horizons must be integers >= 2, got {list(self.horizons)}")
        bad = sorted(set(self.methods) - set(UNSCORED))
        if bad or "grpo" not in self.methods:
            raise ValueError(f"methods must include grpo and be among {list(UNSCORED)} "
                             f"(no policy scores on a tabular policy), got "
                             f"{list(self.methods)}")
        if not self.delta > 0:
            raise ValueError(f"delta must be > 0, got {self.delta}")
        from train.sampling import SAMPLERS

        if self.sampler not in SAMPLERS:  # before any store directory is made
            raise ValueError(f"unknown sampler {self.sampler!r}; choose from "
                             f"{sorted(SAMPLERS)}")


def tabular_policy(tasks: list[Task], config: ExactCreditConfig
                   ) -> tuple[Any, dict[str, TabularPolicy]]:
    """The ``tabular`` backend holding every task's mu, and mu by task id."""
    from train.policies.tabular import TabularBackend

    mus = {}
    for i, task in enumerate(tasks):
        mus[task.task_id] = base_policy(task_model(task),
                                        np.random.default_rng([config.seed, i, 23]),
                                        config.mu_beta, config.mu_noise)
    return TabularBackend(list(mus.values())), mus


def exact_advantages(store: Store, mus: dict[str, TabularPolicy]) -> pa.Table:
    """(tree_id, node_id, advantage) of every non-root node (X1, module docstring)."""
    from train.sampling.continuation import load_starts

    con = connect(store)
    nodes = con.sql("""
        SELECT n.tree_id, n.node_id, n.parent_id, t.env_config, t.task_id
        FROM nodes n JOIN trees t USING (tree_id)
        ORDER BY n.tree_id, n.node_id""").to_arrow_table()
    starts = load_starts(con, nodes)
    tables: dict[str, PolicyValues] = {}
    value: dict[tuple[str, int], float] = {}
    for tid, nid, task_id, start in zip(nodes.column("tree_id").to_pylist(),
                                        nodes.column("node_id").to_pylist(),
                                        nodes.column("task_id").to_pylist(), starts,
                                        strict=True):
        if start.state is None:  # a leaf: its value is its reward
            value[(tid, nid)] = float(start.leaf_reward or 0.0)
            continue
        if task_id not in tables:
            tables[task_id] = mus[task_id].values()
        value[(tid, nid)] = float(tables[task_id].v(WorkflowEnv.snapshot_state(start.state)))
    rows = [(tid, nid, value[(tid, nid)] - value[(tid, pid)])
            for tid, nid, pid in zip(nodes.column("tree_id").to_pylist(),
                                     nodes.column("node_id").to_pylist(),
                                     nodes.column("parent_id").to_pylist(), strict=True)
            if pid is not None]
    return pa.table({"tree_id": pa.array([r[0] for r in rows], pa.string()),
                     "node_id": pa.array([r[1] for r in rows], pa.int64()),
                     "advantage": pa.array([r[2] for r in rows], pa.float64())})


def run_exact_credit_study(out_dir: str | Path, config: ExactCreditConfig | None = None,
                           progress: bool = False) -> Path:
    """Collect, credit and the exact advantages per horizon into ``out_dir`` (module
    docstring); return the path of ``study.json``. Reruns reuse every stored tree and
    credit."""
    from train.credit.store_io import compute_credits
    from train.sampling.collect import collect

    config = config or ExactCreditConfig()
    out = make_study_dir(out_dir)
    started = time.perf_counter()
    horizons: dict[str, dict[str, Any]] = {}
    for h in config.horizons:
        t0 = time.perf_counter()
        tasks = make_tasks(config.n_tasks, config.seed + 1000 * h, (h,))
        store_dir = out / f"store-H{h}"
        store = Store(store_dir, create=not store_dir.exists())
        policy, mus = tabular_policy(tasks, config)
        run_id = f"exact-H{h}-{config.sampler}"
        collect(store, "workflow", policy, config.sampler, tasks, config.n_total,
                config.seed, run_id, progress=progress)
        for method in config.methods:
            compute_credits(store, method, progress=progress)
        pq.write_table(exact_advantages(store, mus), out / f"exact-H{h}.parquet")
        horizons[str(h)] = {"store": store_dir.name, "run": run_id,
                            "exact": f"exact-H{h}.parquet", "n_tasks": len(tasks),
                            "seconds": time.perf_counter() - t0}
    return write_study(out / "study.json", {
        "study": "credit-exact", "config": asdict(config), "horizons": horizons,
        "seconds": time.perf_counter() - started})


__all__ = ["UNSCORED", "ExactCreditConfig", "exact_advantages", "run_exact_credit_study",
           "tabular_policy"]
