"""The four-way verdict procedure (docs/METHODS.md V1-V5) on simulated studies.

Known effects go through the whole procedure (simulated per-task outcomes, the paired
two-way difference, the Bonferroni level, the rule): a true +0.03 must be called
``superior`` in at least 80% of studies of the size ``Design.seeds_needed`` chooses for
it, a true 0 ``equivalent`` at delta 0.02 in at least 80% of studies of the size chosen
for that, and a false ``superior`` at a true 0 may happen at most at the nominal rate.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.verdicts import (
    Design,
    family_level,
    judge,
    mde,
    paired_difference,
    verdict,
)

N_TASKS = 200
SD_SEED_ARM = 0.018  # per-arm training-seed sd of a final success rate
SIMS = 400


def _study(rng: np.random.Generator, effect: float, n_seeds: int) -> tuple[np.ndarray, ...]:
    """Per-(seed, task) outcomes of arms A and B: task difficulty shared by both arms
    (the pairing), a training-seed offset per arm and seed, Bernoulli evaluation."""
    base = rng.uniform(0.3, 0.7, N_TASKS)
    offs = rng.normal(0.0, SD_SEED_ARM, (2, n_seeds, 1))
    p_a = np.clip(base + effect / 2 + offs[0], 0, 1)
    p_b = np.clip(base - effect / 2 + offs[1], 0, 1)
    return (rng.random((n_seeds, N_TASKS)) < p_a).astype(float), \
        (rng.random((n_seeds, N_TASKS)) < p_b).astype(float)


def _design() -> Design:
    """The simulation's own variance components: the seed sd of a difference of two
    independent arms, Bernoulli noise at p about 0.5 with the correlation the shared
    difficulty induces (Var U(0.3, 0.7) / 0.25), no arm x task interaction beyond it."""
    return Design(sd_seed=SD_SEED_ARM * math.sqrt(2), sd_task=0.01, p=0.5,
                  rho=(0.4 ** 2 / 12) / 0.25)


def _rates(effect: float, n_seeds: int, delta: float | None, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    level = family_level(1)
    calls = {"superior": 0, "inferior": 0, "equivalent": 0, "underpowered": 0}
    for _ in range(SIMS):
        a, b = _study(rng, effect, n_seeds)
        d = paired_difference(a, b, level)
        calls[judge(*d.ci, 0.0, "above", delta)] += 1
    return {k: v / SIMS for k, v in calls.items()}


def test_true_effect_is_called_superior_at_the_planned_size() -> None:
    level = family_level(1)
    n = _design().seeds_needed(0.03, N_TASKS, level)
    assert n is not None and 2 <= n <= 40
    rates = _rates(0.03, n, 0.02, seed=1)
    assert rates["superior"] >= 0.80, (n, rates)
    assert rates["inferior"] == 0.0


def test_true_zero_is_called_equivalent_at_the_planned_size() -> None:
    level = family_level(1)
    n = _design().seeds_needed(0.02, N_TASKS, level, kind="equivalence")
    assert n is not None
    rates = _rates(0.0, n, 0.02, seed=2)
    assert rates["equivalent"] >= 0.80, (n, rates)


def test_false_superior_at_a_true_zero_stays_at_the_nominal_rate() -> None:
    """One direction of a 90% two-sided interval: 5%; 400 studies give a binomial sd of
    about 1.1%, so 0.05 + 3 sd bounds the rate a correct procedure shows."""
    rates = _rates(0.0, 6, 0.02, seed=3)
    assert rates["superior"] <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / SIMS), rates
    # ...and a procedure that is too conservative would never err: it must, sometimes
    assert rates["superior"] + rates["inferior"] > 0.0


def test_small_study_is_underpowered_not_inconclusive() -> None:
    rates = _rates(0.0, 3, 0.02, seed=4)
    assert rates["underpowered"] >= 0.8


def test_rule_by_hand() -> None:
    assert judge(0.01, 0.05, 0.0, "above", 0.02) == "superior"
    assert judge(-0.05, -0.01, 0.0, "above", 0.02) == "inferior"
    assert judge(-0.015, 0.019, 0.0, "above", 0.02) == "equivalent"
    assert judge(-0.015, 0.021, 0.0, "above", 0.02) == "underpowered"
    assert judge(-0.015, 0.019, 0.0, "above", None) == "underpowered"  # no margin: no TOST
    assert judge(-0.01, 0.0004, 0.0005, "below", 0.001) == "superior"
    assert judge(0.001, 0.002, 0.0005, "below", 0.001) == "inferior"
    assert judge(math.nan, 0.2, 0.0, "above", 0.1) == "underpowered"
    with pytest.raises(ValueError, match="delta"):
        judge(0.0, 0.1, 0.0, "above", math.nan)
    v = verdict("c", "x", 0.9, [0.85, 0.95], 0.0, "above", "p", 0.839, delta=0.02,
                level=0.9)
    assert v.verdict == "superior" and v.paper_inside is False
    assert "0.9 [0.85, 0.95]" in v.line() and "MDE" in v.line() and "delta 0.02" in v.line()


def test_paired_difference_by_hand() -> None:
    """Seed-paired rates: the paired t interval; (S, T): the two-way variance."""
    a = np.array([0.5, 0.6, 0.7])
    b = np.array([0.4, 0.6, 0.5])
    d = paired_difference(a, b, 0.9)
    diffs = a - b
    se = diffs.std(ddof=1) / math.sqrt(3)
    assert d.estimate == pytest.approx(diffs.mean())
    assert d.se == pytest.approx(se) and d.df == 2
    from scipy import stats

    assert d.ci[1] - d.estimate == pytest.approx(stats.t.ppf(0.95, 2) * se)
    # (S, T): the two-way variance v_seed + v_task - v_cell where it exceeds v_seed ...
    a3 = np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    b3 = np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    d3 = paired_difference(a3, b3, 0.9)
    dd = a3 - b3
    v_seed = ((dd.mean(axis=1) - dd.mean()) ** 2).sum() / 6
    v_task = ((dd.mean(axis=0) - dd.mean()) ** 2).sum() / 6
    v_cell = ((dd - dd.mean()) ** 2).sum() / 72
    assert v_seed + v_task - v_cell > v_seed
    assert d3.se == pytest.approx(math.sqrt(v_seed + v_task - v_cell)) and d3.df == 2
    # ... and never below the seed-cluster variance: with a pure seed effect the task and
    # cell terms would cancel part of it
    a2 = np.array([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    b2 = np.zeros((3, 2))
    d2 = paired_difference(a2, b2, 0.9)
    row = a2.mean(axis=1)
    v_seed = ((row - row.mean()) ** 2).sum() / 6
    assert d2.se == pytest.approx(math.sqrt(v_seed)) and d2.df == 1


def test_a_few_seeds_cannot_shrink_the_interval_below_the_seed_variation() -> None:
    """Sparse per-task differences (most tasks give both arms the same outcome, as on
    workflow where the deterministic env and converged policies agree): with 5 seeds the
    two-way estimator's task and cell terms can cancel its seed term by chance, which
    gave a Table 1 comparison an interval 6x narrower than its seeds' spread and a
    spurious 'inferior'. The interval is at least the seed-paired t interval's width."""
    rng = np.random.default_rng(47)  # a draw where the unfloored variance is 0.26 v_seed
    n_seeds, n_tasks = 5, 200
    a = (rng.random((n_seeds, n_tasks)) < 0.58).astype(float)
    b = a.copy()
    flip = rng.random((n_seeds, n_tasks)) < 0.05  # 5% of cells differ, in both directions
    b[flip] = 1.0 - b[flip]
    d = paired_difference(a, b, 0.967)
    seeds_only = paired_difference(a.mean(axis=1), b.mean(axis=1), 0.967)
    assert d.se >= seeds_only.se - 1e-12
    assert d.ci[1] - d.ci[0] >= seeds_only.ci[1] - seeds_only.ci[0] - 1e-12
    with pytest.raises(ValueError, match="2 seeds"):
        paired_difference(np.array([0.5]), np.array([0.4]), 0.9)


def test_design_planner_is_consistent() -> None:
    des = Design()
    lvl = family_level(5)
    assert lvl == pytest.approx(0.98)
    n = des.seeds_needed(0.05, 200, lvl)
    assert n is not None
    assert des.detectable(n, 200, lvl) <= 0.05 < des.detectable(n - 1, 200, lvl)
    assert mde(0.01, 0.9, None) == pytest.approx((1.6449 + 0.8416) * 0.01, rel=1e-3)
    # the task term alone exceeds the effect: no number of seeds suffices
    assert Design(sd_task=1.0).seeds_needed(0.01, 10, 0.9, max_seeds=50) is None
