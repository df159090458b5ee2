"""Localization audit (``train.studies.localization`` + ``analysis.localization``): BEL
against the exact first irrecoverable step.

A hand-built failed trajectory with a known t_crit, the invariant that BEL never
localizes late, and small real audit runs whose numbers come back from the store.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from train.envs.base import Task
from train.envs.workflow import (
    ACTION_TEXTS,
    StageSpec,
    TabularPolicy,
    WorkflowEnv,
    WorkflowModel,
    WorkflowSpec,
)
from train.jobs import localization_study
from train.studies.localization import LocalizationConfig, bel_search
from train.studies.workflow_study import base_policy, make_tasks, rollout, sample_from, task_model

CAREFUL, SKIP = ACTION_TEXTS["careful"], ACTION_TEXTS["skip"]


def _chain_task() -> Task:
    """Three required stages in a chain, deterministic, horizon 5: every tool but skip works."""
    spec = WorkflowSpec(tuple(StageSpec(n, (i - 1,) if i else (), 0.9, 0.8, 0.9)
                              for i, n in enumerate(("fetch", "parse", "deploy"))),
                        horizon=5, rng_seed=3, deterministic=True)
    return Task("chain", "workflow", WorkflowModel(spec).prompt(), max_steps=5,
                config=spec.to_config())


def test_hand_built_failure_is_localized_at_the_skip() -> None:
    """careful, skip (a required stage: the run is silently corrupt), careful: t_crit = 2."""
    env = WorkflowEnv()
    env.reset(_chain_task())
    snaps = [env.snapshot()]
    states = [env.state]
    for action in (CAREFUL, SKIP, CAREFUL):
        env.step(action)
        snaps.append(env.snapshot())
        states.append(env.state)
    assert env.done and env.state.corrupt
    assert env.model.first_irrecoverable_step(states) == 2
    policy = TabularPolicy(env.model)  # uniform over fast / careful / skip
    result = bel_search(env, snaps, policy, x=16, key=("hand",))
    # L = 1, R = 3: m = 2 is corrupt, no suffix can succeed -> R = 2; m = 1 still works
    # (a suffix succeeds with probability (2/3)^2 per try) -> L = 2 = R.
    assert result.anchors == ((2, False), (1, True))
    assert result.t_crit == 2
    assert result.probes == 2 and result.suffix_rollouts == 32
    capped = bel_search(env, snaps, policy, x=16, key=("hand",), max_probes=1)
    assert capped.t_crit == 1 and capped.probes == 1  # stopped with L < R: early, not late


def test_bel_never_localizes_late_stochastic() -> None:
    """L only passes a prefix after a success from it, so L <= the exact t_crit."""
    env = WorkflowEnv()
    for i, task in enumerate(make_tasks(4, 21)):
        model = task_model(task)
        mu = base_policy(model, np.random.default_rng(i))
        env.reset(task)
        start = env.snapshot()
        for attempt in range(40):
            traj = sample_from(env, start, mu, 1000 * i + attempt, snapshots=True)
            if traj.reward >= 1.0:
                continue
            truth = model.first_irrecoverable_step(traj.states)
            assert truth is not None
            for x in (1, 4):
                found = bel_search(env, traj.snapshots, mu, x, (i, attempt, x)).t_crit
                assert 1 <= found <= truth


def test_rollout_snapshots_restore_each_prefix() -> None:
    env = WorkflowEnv()
    task = make_tasks(1, 5)[0]
    env.reset(task)
    mu = TabularPolicy(env.model)
    traj = rollout(env, mu, random.Random(0), snapshots=True)
    assert len(traj.snapshots) == traj.steps + 1
    for k, snap in enumerate(traj.snapshots):
        env.restore(snap)
        assert env.state == traj.states[k]


def test_localization_audit_deterministic_accuracy(tmp_path: Path) -> None:
    config = LocalizationConfig(n_tasks=4, deterministic_modes=(True,), x_values=(1, 16),
                                failures_per_task=2, repeats=2)
    results = localization_study(tmp_path, config)
    rows = {r["x"]: r for r in results["table"]}
    assert rows[16]["accuracy"] >= 0.95
    assert rows[16]["pairwise_agreement"] >= 0.95
    assert rows[1]["late_rate"] == rows[16]["late_rate"] == 0.0
    assert rows[16]["n"] == 2 * results["n_failed_trajectories"]["deterministic"]
    on_disk = json.loads((tmp_path / "results.json").read_text())
    for key in ("audit", "config", "run_id", "store", "bel_implementation", "table", "plots",
                "n_failed_trajectories", "seconds"):
        assert key in on_disk, key
    for key in ("accuracy", "pairwise_agreement", "unanimity", "mean_error", "probes",
                "suffix_rollouts"):
        assert key in on_disk["table"][0], key
    assert (tmp_path / "report.md").read_text().startswith("# Localization audit")
    for name in on_disk["plots"]:
        assert (tmp_path / name).stat().st_size > 0
    # the repeats and X values of one failed trajectory localize the same trajectory
    from rollout_store import Store, connect

    con = connect(Store(tmp_path / "store"))
    per_traj = con.sql("""
        SELECT json_extract(meta, '$.study.trajectory') AS traj,
               count(DISTINCT json_extract(meta, '$.study.true_critical_node_id')),
               count(DISTINCT json_extract(meta, '$.bel.trajectory_leaf')), count(*)
        FROM trees GROUP BY traj""").fetchall()
    assert per_traj and all(n_truth == n_leaf == 1 and n == 4 for _, n_truth, n_leaf, n
                            in per_traj)
    # rerunning the same config reuses the archived localizations (idempotent commit)
    again = localization_study(tmp_path, config)
    assert again["table"] == results["table"]


def test_local_implementation_agrees(tmp_path: Path) -> None:
    config = LocalizationConfig(n_tasks=3, deterministic_modes=(True,), x_values=(16,),
                                failures_per_task=1, repeats=2, implementation="local")
    results = localization_study(tmp_path, config)
    row = results["table"][0]
    assert row["accuracy"] >= 0.95 and row["late_rate"] == 0.0
    assert "bel_search" in results["bel_implementation"]
