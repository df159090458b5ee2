"""Gate evaluation (``train.studies.gates`` + ``analysis.gates``; the refresh protocol of
``train.sampling.refresh``): exact regret, the refresh protocol, small real runs.

Real environment, real store, the real ``dsc_gate``; the refresh protocol is also
checked against hand-computed posteriors with a scripted sampler.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from train.envs.workflow_model import ObsKey, State
from train.jobs import gate_study
from train.sampling.refresh import beta_prior, refresh_protocol
from train.studies.gates import GATES, GateStudyConfig
from train.studies.workflow_study import Rollout

SMALL_CAP = 120
SMALL_EVAL = 3


def _small(**kw: Any) -> GateStudyConfig:
    """A run of a few seconds: 2 dev, 3 calib, 3 eval tasks of horizon 6, 16 old
    trajectories per action, a 120-step refresh cap."""
    return GateStudyConfig(n_dev=2, n_calib=3, n_eval=SMALL_EVAL, n_old=16,
                           cap_steps=SMALL_CAP, n_boot=50, horizons=(6,), **kw)


def _traj(steps: int, reward: float) -> Rollout:
    return Rollout(["a"] * steps, ["o"] * steps, [ObsKey(0, 0, False)] * steps,
                   [State(0, 0)] * (steps + 1), reward, True)


# ----------------------------------------------------------------- refresh protocol
def test_beta_prior_hand_computed() -> None:
    # v = 0.25 / 64 -> n0 = min(64, 64) = 64: 0.5 + 64 * 0.75, 0.5 + 64 * 0.25
    assert beta_prior(0.75, 0.25 / 64, 64) == (48.5, 16.5)
    # a tiny variance is capped at N pseudo-counts; m is clipped to [0, 1]
    assert beta_prior(1.3, 1e-15, 10) == (10.5, 0.5)
    # a large variance gives fewer pseudo-counts than N: n0 = 0.25 / 0.05 = 5
    assert beta_prior(0.4, 0.05, 64) == pytest.approx((2.5, 3.5))


def test_refresh_resolved_prior_spends_nothing() -> None:
    calls: list[tuple[int, int]] = []

    def sample(route: int, k: int) -> Rollout:
        calls.append((route, k))
        return _traj(3, 1.0)

    res = refresh_protocol(np.array([0.9, 0.1, 0.0]), np.full(3, 0.25 / 64), np.full(3, 64),
                           [0, 1, 2], sample)
    assert res.steps == 0 and res.resolved and res.leader == 0 and not calls


def test_refresh_samples_unresolved_routes_and_respects_the_cap() -> None:
    drawn: list[int] = []

    def sample(route: int, k: int) -> Rollout:
        drawn.append(route)
        return _traj(5, float(route == 1))  # route 1 always succeeds, route 0 never

    res = refresh_protocol(np.array([0.5, 0.5, 0.0]), np.full(3, 0.25 / 16), np.full(3, 16),
                           [0, 1, 2], sample, cap_steps=38, batch=4)
    # route 2 (resolved against either leader) never gets a trajectory
    assert 2 not in drawn
    assert res.steps == 38  # 7 complete trajectories (35 steps) + a cut one (3 steps)
    assert res.incomplete == 1 and int(res.n_new.sum()) == 8
    # posteriors: prior Beta(0.5 + 8, 0.5 + 8) plus the complete successes / failures
    alpha1 = 8.5 + (res.n_new[1] - (1 if drawn[-1] == 1 else 0))
    assert res.mean[1] == pytest.approx(alpha1 / (alpha1 + 8.5))
    assert res.leader == 1


def test_refresh_ends_when_draws_cost_nothing_and_the_routes_tie() -> None:
    """Two routes that answer at once (0 tool steps) with the same deterministic reward
    never resolve (gap 0); each draw is charged one step against the cap, so the protocol
    ends after cap_steps draws, reporting the 0 tool steps they really cost. It drew
    until memory ran out before (the reuse experiment, calc, dsc)."""
    drawn: list[int] = []

    def sample(route: int, k: int) -> Rollout:
        drawn.append(route)
        return _traj(0, 1.0)

    res = refresh_protocol(np.array([0.5, 0.5]), np.full(2, 0.25 / 4), np.full(2, 4),
                           [0, 1], sample, cap_steps=12, batch=4)
    assert len(drawn) == 12 and set(drawn) == {0, 1}
    assert res.steps == 0 and not res.resolved and res.incomplete == 0


# ----------------------------------------------------------------- real runs
def test_gate_audit_small_run(tmp_path: Path) -> None:
    results = gate_study(tmp_path, _small(kl_targets=(0.35,)))
    inst = pq.read_table(tmp_path / "instances.parquet").to_pydict()
    gates = np.array(inst["gate"])
    regret = np.array(inst["regret"])
    steps = np.array(inst["steps"])
    assert set(gates) == set(GATES)
    assert (regret[gates == "oracle"] == 0.0).all()  # exact regret: exactly zero
    assert (regret >= 0.0).all()
    for gate in ("reuse_only", "transport_only", "oracle"):
        assert (steps[gates == gate] == 0).all()
    assert (steps <= SMALL_CAP).all()
    on_disk = json.loads((tmp_path / "results.json").read_text())
    for key in ("audit", "config", "calibration", "table", "dsc_by_kind", "by_near_tie",
                "regret_diff_dsc_minus", "step_ratio_dsc_over", "finding", "paper_l4",
                "plots", "n_instances", "route_mse"):
        assert key in on_disk, key
    for gate in GATES:
        row = on_disk["table"][gate]
        assert {"regret", "p_regret", "new_steps", "any_refresh"} <= set(row)
    assert isinstance(on_disk["finding"]["reproduced"], bool)
    assert results["n_instances"] == 2 * SMALL_EVAL
    assert (tmp_path / "report.md").read_text().startswith("# Gate evaluation")
    for name in on_disk["plots"]:
        assert (tmp_path / name).stat().st_size > 0
    # the archive holds the old trees and the refresh trees of this run
    from rollout_store import Store, connect

    con = connect(Store(tmp_path / "store"))
    by_sampler = dict(con.sql("SELECT sampler, count(*) FROM trees GROUP BY sampler")
                      .fetchall())
    assert by_sampler["interventional"] == 8
    assert by_sampler.get("refresh", 0) >= 1


def test_transport_only_equals_reuse_only_when_pi_is_mu(tmp_path: Path) -> None:
    gate_study(tmp_path, _small(kl_targets=(0.0,), kinds=("ordinary",)))
    inst = pq.read_table(tmp_path / "instances.parquet").to_pydict()
    gates = np.array(inst["gate"])
    picks = np.array(inst["pick"])
    assert list(picks[gates == "transport_only"]) == list(picks[gates == "reuse_only"])
    routes = pq.read_table(tmp_path / "routes.parquet").to_pydict()
    # z = 0 everywhere: T_i = R_i exactly (D4), W_i = 1, and pi = mu exactly
    assert routes["transport_mean"] == routes["reuse_mean"]
    assert np.allclose(routes["wis_mean"], routes["reuse_mean"], atol=1e-12)
    assert routes["q_pi"] == routes["q_mu"]
