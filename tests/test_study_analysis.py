"""The report halves of ``rtrees study`` on tiny synthetic study files (issue 14).

Hand-checked values: the task-paired E10-E11 bootstrap against the tree-level
``ranking_statistics``, per-task Spearman, and the recovery summary of a hand-written
``recovery.parquet`` (the verdict rule has its own tests, ``test_verdicts.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.drift import per_task_spearman
from analysis.recovery import recovery_results
from analysis.stats import (
    ClusterSums,
    group_index,
    paired_cluster_ranking,
    prefix_stats,
    ranking_statistics,
)


def _ranking_rows(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    trees, parents, q, s = [], [], [], []
    for t in range(7):
        for parent in range(rng.integers(1, 4)):
            m = int(rng.integers(2, 6))
            trees += [t] * m
            parents += [parent] * m
            q += rng.integers(0, 4, m).tolist()
            s += rng.normal(size=(m, 2)).round(1).tolist()
    return (np.array(trees), np.array(parents), np.array(q, float), np.array(s))


def test_paired_cluster_ranking_matches_tree_level_statistics() -> None:
    """With one cluster per tree the point estimates are ranking_statistics' exactly."""
    tree, parent, q, scores = _ranking_rows()
    group = group_index([tree, parent])
    ref = ranking_statistics(tree, group, q, scores, ["a", "b"], n_boot=0)
    sums = {}
    for j, name in enumerate(("a", "b")):
        ps = prefix_stats(tree, group, q, scores[:, [j]])
        sums[name] = ClusterSums.of(ps, np.arange(7), 7)
    got = paired_cluster_ranking(sums, n_boot=200, seed=1)
    for name in ("a", "b"):
        m = ref.method(name)
        assert got["point"][name]["pairwise_accuracy"] == pytest.approx(m.pairwise_accuracy.value)
        assert got["point"][name]["tau_b_macro"] == pytest.approx(m.tau_b_macro.value)
        assert got["point"][name]["tau_b_pooled"] == pytest.approx(m.tau_b_pooled.value)
        lo, hi = got["ci"][name]["pairwise_accuracy"]
        assert lo <= got["point"][name]["pairwise_accuracy"] <= hi
    d = got["differences"]["a - b"]["pairwise_accuracy"]
    assert d["estimate"] == pytest.approx(ref.method("a").pairwise_accuracy.value
                                          - ref.method("b").pairwise_accuracy.value)


def test_paired_cluster_ranking_perfect_and_reversed_scores() -> None:
    tree = np.array([0, 0, 0, 1, 1])
    group = np.array([0, 0, 0, 1, 1])
    q = np.array([0.0, 0.5, 1.0, 0.2, 0.9])
    sums = {name: ClusterSums.of(prefix_stats(tree, group, q, (sign * q)[:, None]),
                                 np.array([0, 1]), 2) for name, sign in (("up", 1), ("down", -1))}
    got = paired_cluster_ranking(sums, n_boot=50, seed=0)
    assert got["point"]["up"] == {"pairwise_accuracy": 1.0, "tau_b_macro": 1.0,
                                  "tau_b_pooled": 1.0}
    assert got["point"]["down"]["pairwise_accuracy"] == 0.0
    assert got["differences"]["up - down"]["tau_b_macro"]["ci"] == [2.0, 2.0]


def test_per_task_spearman_hand_built() -> None:
    rng = np.random.default_rng(3)
    n = 30
    g = rng.normal(size=2 * n)
    table = {"task_id": np.array(["t0"] * n + ["t1"] * n), "drift": g * 2.0, "g": g,
             "pairwise_kl": rng.random(2 * n), "global_kl": np.repeat([0.1, 0.2, 0.3], 20)}
    out = per_task_spearman(table, n_boot=50, seed=0)
    assert out["abs_g"]["value"] == pytest.approx(1.0)
    assert out["n_tasks"] == 2
    # global KL takes one value in task t1 (rows 30-59: 0.2 x 10, 0.3 x 20): two values
    assert out["global_kl"]["n_tasks"] == 2
    assert out["gain_pairwise_kl"]["value"] == pytest.approx(
        1.0 - out["pairwise_kl"]["value"])


def test_recovery_summary_of_a_hand_written_file(tmp_path: Path) -> None:
    rows = []
    for task, traj, irr, err, rnd in (("a", "a/0", 0.2, 0.6, 0.1), ("a", "a/1", 0.4, 0.4, 0.0),
                                      ("b", "b/0", 0.0, 0.5, 0.3)):
        for arm, value in (("first_irrecoverable", irr), ("first_error", err),
                           ("random_error", rnd)):
            rows.append({"task_id": task, "horizon": 6, "trajectory": traj, "arm": arm,
                         "step": 2, "n_steps": 4, "n_errors": 1, "first_irrecoverable": 2,
                         "action": "fast", "fixed_action": "careful", "changed": True,
                         "exact_recovery": value, "successes": round(4 * value),
                         "resamples": 4})
    rows.append({**rows[0], "trajectory": "b/1", "task_id": "b", "arm": "first_error",
                 "step": None, "n_errors": 0})
    # the position-matched control: a/1 has no error at or before t_irr
    for traj, task, step, value in (("a/0", "a", 1, 0.3), ("a/1", "a", None, None),
                                    ("b/0", "b", 2, 0.1)):
        rows.append({**rows[0], "trajectory": traj, "task_id": task, "arm": "matched_error",
                     "step": step, "exact_recovery": value,
                     "successes": None if value is None else round(4 * value)})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "recovery.parquet")
    (tmp_path / "study.json").write_text(json.dumps({
        "study": "elpo-fig1", "recovery_path": "recovery.parquet", "seconds": 0.0,
        "n_sampled_trajectories": 9, "n_failed_trajectories": 4,
        "config": {"n_boot": 100, "seed": 0, "failures_per_task": 2, "resamples": 4,
                   "tau_err": 0.02}}))
    res = recovery_results(tmp_path)
    arms = res["summary"]["arms"]
    assert arms["first_irrecoverable"]["exact"] == pytest.approx((0.2 + 0.4 + 0.0) / 3)
    assert arms["first_error"]["n"] == 3  # the row without a step is left out
    assert res["summary"]["paired"]["irr-err"]["value"] == pytest.approx(
        ((0.2 - 0.6) + 0.0 + (0.0 - 0.5)) / 3)
    assert res["summary"]["paired"]["irr-mat"]["value"] == pytest.approx(
        ((0.2 - 0.3) + (0.0 - 0.1)) / 2)
    assert res["summary"]["n_matched"] == 2 and arms["matched_error"]["n"] == 2
    by_pos = res["summary"]["by_position"]
    assert by_pos["first_error"] == {"at": {"n": 3, "exact": pytest.approx(0.5),
                                            "sampled": pytest.approx(6 / 12)}}
    assert by_pos["matched_error"]["before"]["n"] == 1
    assert by_pos["matched_error"]["at"]["exact"] == pytest.approx(0.1)
    assert res["summary"]["by_horizon"]["6"]["random_error"]["errors_after_irr"] == 0.0
    assert [v["verdict"] for v in res["verdicts"]][:2] == ["inferior", "superior"]
    assert len(res["verdicts"]) == 3 and "position-matched" in res["verdicts"][2]["claim"]
    assert (tmp_path / "report.md").read_text().startswith("# ELPO Fig. 1")
