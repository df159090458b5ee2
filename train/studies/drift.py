"""Credit-drift study (DSC-Gate Figs. 2-3): how action credit moves across a policy update.

METHODS.md section 5 (D1, D2, D6). On ``workflow`` tasks
with tabular policies every number is exact:

1. an old policy mu per task (``workflow_study.base_policy``) and updates
   mu -> pi of several sizes: for each update kind (ordinary / branch-selective)
   one random direction scaled to each matched global-KL target (the L1 sweep,
   KL(P_mu || P_pi) = .15/.35/.60/.85 by default);
2. at every recoverable decision state reachable under mu, for every pair (a, b)
   of valid actions: the old credit c_mu = Q_mu(a) - Q_mu(b), the new credit c_pi,
   the drift Delta c = c_pi - c_mu, the branch sensitivity G(a, b) (D2), the pairwise
   KL and the update's global KL (``train.studies.sensitivity``);
3. the per-pair table goes to ``pairs.parquet`` (``run_drift_study``); every
   statistic is computed from that file by ``analysis.drift`` (DuckDB SQL plus rank
   statistics): ``analysis.drift.drift_summary(out_dir / "pairs.parquet", tau)``.

The statistics (reversal rates, the D6 check, Spearman rho of |Delta c| with
|G| and the KLs, task-cluster bootstrap CIs) are ``analysis.drift``'s.

Reproduce: ``train.jobs.drift_study(out_dir, DriftConfig(...))`` (every random
choice is seeded by ``seed``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from train.coerce import check_bounds, check_types
from train.envs.base import Task
from train.envs.workflow import DEFAULT_HORIZONS
from train.studies import STUDY_MAXIMA
from train.studies.sensitivity import UpdateAnalysis, action_pairs, decision_states, occupancy
from train.studies.workflow_study import (
    DEFAULT_KL_TARGETS,
    UPDATE_KINDS,
    Log,
    UpdateKind,
    base_policy,
    log_progress,
    make_study_dir,
    make_tasks,
    make_updates,
    task_model,
    tool_name,
    write_study,
)


@dataclass(frozen=True)
class DriftConfig:
    """The drift audit's settings (defaults: about 10-20 s on one core)."""

    n_tasks: int = 12
    """Workflow tasks (horizons cycle through ``horizons``)."""
    seed: int = 0
    """Seeds the tasks, mu and the update directions."""
    horizons: tuple[int, ...] = DEFAULT_HORIZONS
    """Task horizons (DSC-Gate L1: 6 / 9 / 12)."""
    kinds: tuple[UpdateKind, ...] = UPDATE_KINDS
    """Update kinds (``workflow_study.update_direction``)."""
    kl_targets: tuple[float, ...] = DEFAULT_KL_TARGETS
    """Matched global-KL sizes of the updates (0 gives pi = mu)."""
    tau: float = 0.02
    """Relevance threshold of the reversal rate: pairs with |c_mu| > tau [R]."""
    n_boot: int = 300
    """Task-cluster bootstrap resamples for the Spearman contrasts."""
    mu_beta: float = 3.0
    """mu's logits = mu_beta * Q* + mu_noise * N(0, 1) (``base_policy``)."""
    mu_noise: float = 0.5
    noise_frac: float = 0.5
    """Noise share of an update direction (``update_direction``)."""

    def __post_init__(self) -> None:
        check_types(self)  # train.coerce: field types, finite floats (issue 21)
        check_bounds(self, {"n_tasks": 1, "n_boot": 1}, STUDY_MAXIMA)
        if not self.kl_targets or min(self.kl_targets) < 0:
            raise ValueError(f"kl_targets must be non-empty and >= 0, got {self.kl_targets}")
        if self.tau < 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")


@dataclass
class _Columns:
    values: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, **row: Any) -> None:
        for k, v in row.items():
            self.values.setdefault(k, []).append(v)


def task_pairs(task: Task, config: DriftConfig, task_index: int) -> dict[str, list[Any]]:
    """The per-pair rows of one task: every update x decision state x action pair."""
    model = task_model(task)
    rng = np.random.default_rng([config.seed, task_index, 1])
    mu = base_policy(model, rng, config.mu_beta, config.mu_noise)
    updates = make_updates(model, mu, rng, config.kinds, config.kl_targets, config.noise_frac)
    s0 = model.initial_state()
    states = decision_states(model)
    d_mu = occupancy(model, mu)
    optimal = model.optimal_values()
    cols = _Columns()
    for u_index, update in enumerate(updates):
        ua = UpdateAnalysis(model, mu, update.policy)
        global_kl = ua.global_kl()
        for s in states:
            for a, b in action_pairs(model, s):
                c_old, c_new = ua.credit_old(s, a, b), ua.credit_new(s, a, b)
                cols.add(task_id=task.task_id, horizon=model.horizon, update=u_index,
                         kind=update.kind, kl_target=update.kl_target, eta=update.eta,
                         global_kl=global_kl, stage=s.stage, t=s.t, broken=s.broken,
                         root=s == s0, occupancy=d_mu.get(s, 0.0),
                         live=optimal.q(s, a) > 0.0 and optimal.q(s, b) > 0.0,
                         action_a=tool_name(a),
                         action_b=tool_name(b), c_old=c_old, c_new=c_new,
                         drift=c_new - c_old, g=ua.branch_sensitivity(s, a, b),
                         pairwise_kl=ua.pairwise_kl(s, a, b))
    return cols.values


def collect_pairs(config: DriftConfig, log: Log | None = None) -> pa.Table:
    """The per-pair table of every task (exact; no sampling); progress lines to ``log``."""
    tasks = make_tasks(config.n_tasks, config.seed, config.horizons)
    merged: dict[str, list[Any]] = {}
    start = time.perf_counter()
    for i, task in enumerate(tasks):
        for k, v in task_pairs(task, config, i).items():
            merged.setdefault(k, []).extend(v)
        log_progress(log, "tasks", i + 1, len(tasks), start)
    return pa.table(merged)


def run_drift_study(out_dir: str | Path, config: DriftConfig | None = None,
                    kind: str = "drift", log: Log | None = None) -> Path:
    """Write the per-pair table ``pairs.parquet`` and ``study.json`` (study ``kind``:
    ``drift``, or ``dsc-l1`` for ``rtrees study dsc-l1``) to ``out_dir`` (the report:
    ``analysis.drift.drift_results``); return the path of ``study.json``. Progress lines
    go to ``log``."""
    config = config or DriftConfig()
    out = make_study_dir(out_dir)
    start = time.perf_counter()
    pairs_path = out / "pairs.parquet"
    pq.write_table(collect_pairs(config, log), pairs_path)
    return write_study(out / "study.json", {
        "study": kind, "config": asdict(config), "pairs_path": pairs_path.name,
        "seconds": time.perf_counter() - start})


__all__ = ["DriftConfig", "collect_pairs", "run_drift_study", "task_pairs"]
