"""Credit drift and branch sensitivity (``train.studies.drift`` / ``.sensitivity`` generate,
``analysis.drift`` reports), exact.

Three ways: a hand-computed one-state case; exact G against a Monte
Carlo estimate through the real environment (the DSC transport correction of
stored trees); invariants (pi = mu gives zero drift, G is the first-order drift,
the two global-KL computations agree).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rollout_store import Store
from train.credit.dsc import RATIO, STATE, transport_returns
from train.envs.base import Task
from train.envs.workflow import (
    ACTION_TEXTS,
    StageSpec,
    TabularPolicy,
    WorkflowEnv,
    WorkflowModel,
    WorkflowSpec,
)
from train.jobs import drift_study
from train.studies.drift import DriftConfig, task_pairs
from train.studies.sensitivity import UpdateAnalysis, decision_states, occupancy
from train.studies.workflow_study import (
    apply_update,
    base_policy,
    load_route_data,
    make_tasks,
    make_updates,
    matched_update,
    route_tree,
    sample_from,
    stream_key,
    task_model,
    update_direction,
)

FAST, CAREFUL, SKIP = (ACTION_TEXTS[t] for t in ("fast", "careful", "skip"))


def _setup(index: int = 0, seed: int = 3) -> tuple[Task, WorkflowModel, TabularPolicy]:
    task = make_tasks(index + 1, seed)[index]
    model = task_model(task)
    return task, model, base_policy(model, np.random.default_rng([seed, index]))


def test_hand_computed_one_stage() -> None:
    """One required stage, horizon 1: Q(fast) = p_fast, Q(careful) = p_careful, Q(skip) = 0,
    whatever the policy, so no credit drifts and G = 0 (no downstream state)."""
    spec = WorkflowSpec((StageSpec("a", (), 0.8, 0.5, 0.5),), horizon=1)
    model = WorkflowModel(spec)
    mu = TabularPolicy(model)
    pi = mu.copy()
    pi.update(model.initial_state(), "fast", 2.0)
    ua = UpdateAnalysis(model, mu, pi)
    s0 = model.initial_state()
    assert ua.credit_old(s0, FAST, CAREFUL) == pytest.approx(0.3)
    assert ua.credit_new(s0, FAST, SKIP) == pytest.approx(0.8)
    assert ua.branch_sensitivity(s0, FAST, CAREFUL) == 0.0
    # The update changes only s0: KL(mu || pi) there, mu uniform over 3 actions.
    p = np.exp([2.0, 0.0, 0.0]) / np.exp([2.0, 0.0, 0.0]).sum()
    assert ua.global_kl() == pytest.approx(float(np.sum(np.log((1 / 3) / p)) / 3))
    # B(s0) = sum_u (pi - mu) Q_mu
    q = np.array([0.8, 0.5, 0.0])
    assert ua.advantage_shift(s0) == pytest.approx(float((p - 1 / 3) @ q))


def test_drift_exactly_zero_when_pi_equals_mu(tmp_path: Path) -> None:
    config = DriftConfig(n_tasks=2, kl_targets=(0.0,), n_boot=5)
    cols = task_pairs(make_tasks(1, config.seed)[0], config, 0)
    assert len(cols["drift"]) > 0
    assert all(d == 0.0 for d in cols["drift"])
    assert all(g == 0.0 for g in cols["g"])
    assert all(k == 0.0 for k in cols["global_kl"] + cols["pairwise_kl"])
    results = drift_study(tmp_path / "drift", config)
    assert results["summary"]["reversal_rate"] == 0.0
    assert results["summary"]["max_abs_drift"] == 0.0
    on_disk = json.loads((tmp_path / "drift" / "results.json").read_text())
    for key in ("audit", "config", "summary", "pairs_path", "plots", "seconds"):
        assert key in on_disk
    for key in ("reversal_rate", "by_update", "spearman", "rho_gain_g_over", "d6", "tau"):
        assert key in on_disk["summary"]
    assert (tmp_path / "drift" / "report.md").read_text().startswith("# Credit drift")
    for name in on_disk["plots"]:
        assert (tmp_path / "drift" / name).stat().st_size > 0


def test_drift_audit_small_run(tmp_path: Path) -> None:
    results = drift_study(tmp_path, DriftConfig(n_tasks=3, kl_targets=(0.2, 0.6), n_boot=20))
    s = results["summary"]
    assert s["n_pairs"] > 0 and 0.0 <= s["reversal_rate"] <= 1.0
    # G is the first-order drift: on these small updates it ranks |drift| far better than KL
    assert s["spearman"]["all"]["abs_g"] > 0.9
    assert s["spearman"]["all"]["abs_g"] > s["spearman"]["all"]["global_kl"]


def test_g_is_first_order_drift() -> None:
    """Delta c - G = O(eta^2): halving the step divides the gap by about 4."""
    _, model, mu = _setup()
    direction = update_direction(model, mu, "ordinary", np.random.default_rng(0))
    s0 = model.initial_state()
    errors = []
    for eta in (0.02, 0.01):
        ua = UpdateAnalysis(model, mu, apply_update(mu, direction, eta))
        drift = ua.credit_new(s0, FAST, CAREFUL) - ua.credit_old(s0, FAST, CAREFUL)
        g = ua.branch_sensitivity(s0, FAST, CAREFUL)
        assert g != 0.0
        errors.append(abs(drift - g))
    assert 3.0 < errors[0] / errors[1] < 5.0


def test_global_kl_matches_chain_rule_and_target() -> None:
    _, model, mu = _setup(1)
    for update in make_updates(model, mu, np.random.default_rng(1), kl_targets=(0.1, 0.5)):
        ua = UpdateAnalysis(model, mu, update.policy)
        assert update.kl == pytest.approx(ua.global_kl(), abs=1e-12)
        assert update.kl == pytest.approx(update.kl_target, rel=2e-3)
        # chain rule: sum over states of d_mu(s) KL_s, by the forward occupancy
        d = occupancy(model, mu)
        by_occupancy = sum(p * ua._kl.r(s) for s, p in d.items() if not model.is_terminal(s))
        assert by_occupancy == pytest.approx(update.kl, abs=1e-12)


def test_decision_states_are_recoverable_and_reachable() -> None:
    _, model, _ = _setup()
    states = decision_states(model)
    assert model.initial_state() in states
    assert all(model.recoverable(s) and not model.is_terminal(s) for s in states)


def test_exact_g_matches_monte_carlo_through_env(store: Store) -> None:
    """D2 vs D4: the transport correction delta = c_T - c_R of trees sampled from mu through
    ``WorkflowEnv.step`` and read back from the store estimates G(a, b) without bias."""
    task, model, mu = _setup(3)
    direction = update_direction(model, mu, "branch_selective", np.random.default_rng(5),
                                 branch_action=CAREFUL)
    pi = matched_update(model, mu, direction, 0.5, "branch_selective").policy
    env = WorkflowEnv()
    prompt = env.reset(task)
    snap = env.snapshot()
    n = 600
    routes = {a: [sample_from(env, snap, mu, stream_key("mc", a, k), a) for k in range(n)]
              for a in (FAST, CAREFUL)}
    store.append_trees([route_tree(task, "mc", "mc-run", (prompt, snap), routes, "old")])
    data = load_route_data(store, "mc-run")
    ratio = data.ratios([pi], [mu])
    batch = replace(data.batch, extras={RATIO: ratio, STATE: data.state_ids()})
    tr = transport_returns(batch)
    diff = tr.transported - tr.reward  # per-trajectory transport correction
    first = data.routes[0][0]
    a_rows, b_rows = tr.action == first, tr.action != first
    delta = diff[a_rows].mean() - diff[b_rows].mean()
    se = math.sqrt(diff[a_rows].var(ddof=1) / n + diff[b_rows].var(ddof=1) / n)
    exact = UpdateAnalysis(model, mu, pi).branch_sensitivity(model.initial_state(), FAST,
                                                             CAREFUL)
    assert data.route_actions[0] == [FAST, CAREFUL]
    assert abs(exact) > 2 * se, "the case should have a visible G"
    assert abs(delta - exact) < 3.5 * se, (delta, exact, se)
    assert se < 0.02
