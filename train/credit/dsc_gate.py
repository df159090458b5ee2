"""DSC-Gate decision rule (D5, D7-D10) and the calibration of its radii
(``calibrate_kappa``, ``calibrate_radii``).

METHODS.md section 5, arXiv:2609.29007. Per context (tree), the leader root
action is compared with each competitor; the pair is resolved by

* **reuse** (D8) if |c_R| - r_R > |delta| + r_Delta: the old gap outlasts any
  drift the transport can see, so the old ranking stands;
* else **transport** (D9) if |c_T| > r_T: the transported gap is resolved;
* else **refresh** (D10): sample new trajectories under the target policy.

c_R = Q_R(lead) - Q_R(comp) (plain sample means), c_T = Q_T(lead) - Q_T(comp)
(transported, D5), delta = c_T - c_R. Radii (D7): r_X = kappa_X * s_X with
s_X = sqrt(sampling variance + residual variance from the development set).

Readings [R]:

* The sampling variance of a difference of two action means is the sum of
  the two means' variances (different root actions use disjoint
  trajectories). Each mean's variance is the sample variance (ddof 1) over N
  and is floored at 1/(4 N^2) (D7's floor, "each estimator"); with N = 1 the
  sample variance is undefined and only the floor counts.
* s_Delta keeps the covariance: delta's per-trajectory term is D_i = T_i - R_i,
  computed on the *same* trajectories as c_R, so its variance
  var(T) + var(R) - 2 cov(T, R) is the sample variance of D_i, not
  s_T^2 + s_R^2.
* The leader of a tree is its root action with the largest reuse credit Q_R
  (the existing ranking whose survival the gate tests; "signs are oriented
  by old credit"); ties go to the first in preorder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from train.credit.base import Params, TreeArrays, segment_stats
from train.credit.dsc import anchored, transport_returns

GateDecision = Literal["reuse", "transport", "refresh"]
"""D8-D10 outcome of one leader-versus-competitor pair."""


@dataclass(frozen=True)
class DSCGateParams(Params):
    """Radii of the gate (D7). Placeholder kappas of 2: use ``calibrate_kappa`` on dev tasks."""

    kappa_R: float = 2.0
    """D7: multiplier of s_R (reuse gap radius); calibrated by ``calibrate_kappa``."""
    kappa_delta: float = 2.0
    """D7: multiplier of s_Delta (transport correction radius)."""
    kappa_T: float = 2.0
    """D7: multiplier of s_T (transported gap radius)."""
    residual_var_R: float = 0.0
    """D7: residual variance of c_R measured on the development set."""
    residual_var_delta: float = 0.0
    """D7: residual variance of delta measured on the development set."""
    residual_var_T: float = 0.0
    """D7: residual variance of c_T measured on the development set."""

    def __post_init__(self) -> None:
        for name in ("kappa_R", "kappa_delta", "kappa_T", "residual_var_R",
                     "residual_var_delta", "residual_var_T"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0 (a radius or a variance), got {value}")


@dataclass(frozen=True)
class GatePairs:
    """One row per leader-versus-competitor pair, P pairs; every array is (P,).

    ``tree`` tree index; ``leader`` / ``competitor`` rows of the root actions;
    ``c_R``, ``c_T``, ``delta`` the gaps (D5); ``s_R``, ``s_delta``, ``s_T`` and
    ``r_R``, ``r_delta``, ``r_T`` the scales and radii (D7); ``decision`` the
    D8-D10 outcome as strings ("reuse" / "transport" / "refresh").
    """

    tree: np.ndarray
    leader: np.ndarray
    competitor: np.ndarray
    c_R: np.ndarray
    c_T: np.ndarray
    delta: np.ndarray
    s_R: np.ndarray
    s_delta: np.ndarray
    s_T: np.ndarray
    r_R: np.ndarray
    r_delta: np.ndarray
    r_T: np.ndarray
    decision: np.ndarray


def gate_decision(c_R: np.ndarray, delta: np.ndarray, c_T: np.ndarray, r_R: np.ndarray,
                  r_delta: np.ndarray, r_T: np.ndarray) -> np.ndarray:
    """D8-D10 for arrays of pairs (all (P,) or broadcastable); returns (P,) str.

    reuse if |c_R| - r_R > |delta| + r_Delta (D8); else transport if
    |c_T| > r_T (D9); else refresh (D10). Strict inequalities: a tie refreshes.
    """
    c_R, delta, c_T, r_R, r_delta, r_T = np.broadcast_arrays(
        *(np.asarray(x, np.float64) for x in (c_R, delta, c_T, r_R, r_delta, r_T)))
    reuse = np.abs(c_R) - r_R > np.abs(delta) + r_delta
    transport = ~reuse & (np.abs(c_T) > r_T)
    out = np.full(c_R.shape, "refresh", dtype="<U9")
    out[transport] = "transport"
    out[reuse] = "reuse"
    return out


def _mean_variance(var: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Variance of a sample mean: var / N floored at 1 / (4 N^2) (D7)."""
    return np.maximum(var / count, 1.0 / (4.0 * count**2))


def dsc_gate(batch: TreeArrays, params: DSCGateParams,
             anchor: np.ndarray | None = None) -> GatePairs:
    """D5 + D7-D10: resolve every leader-versus-competitor pair of forced actions.

    Reads the same inputs as the ``dsc`` estimator (``extras["dsc_ratio"]``,
    ``extras["dsc_state"]``, leaf rewards). ``anchor`` (B,) the row of each tree's
    comparison node (``dsc.anchored``; None: the roots): its children are the forced
    actions, the transport is anchored there (D4). Trees whose anchor has fewer than
    two children give no pair. Returns ``GatePairs`` ((P,) arrays), pairs ordered by
    tree, then competitor row.
    """
    tr = transport_returns(batch, anchor)
    _, rel, _ = anchored(batch, anchor)
    actions = np.flatnonzero(rel == 1)  # (A,) sorted rows
    n_act = actions.size
    which = np.searchsorted(actions, tr.action)  # (L,) index into actions
    diff = tr.transported - tr.reward  # D_i = T_i - R_i, keeps cov(T, R) (D7)
    count, q_R, sd_R = segment_stats(tr.reward, which, n_act, ddof=1)
    _, q_T, sd_T = segment_stats(tr.transported, which, n_act, ddof=1)
    _, _, sd_D = segment_stats(diff, which, n_act, ddof=1)
    # ddof 1 is NaN for one trajectory: only the floor remains.
    var_R, var_T, var_D = (np.nan_to_num(sd**2) for sd in (sd_R, sd_T, sd_D))
    mv_R = _mean_variance(var_R, count)
    mv_T = _mean_variance(var_T, count)
    mv_D = _mean_variance(var_D, count)

    tree_a = batch.node_tree[actions]
    order = np.lexsort((actions, -q_R, tree_a))  # per tree: best Q_R first, then preorder
    first = np.ones(n_act, bool)
    first[1:] = tree_a[order][1:] != tree_a[order][:-1]
    leader_of_tree = np.full(batch.n_trees, -1)
    leader_of_tree[tree_a[order][first]] = order[first]  # index into actions
    comp = np.flatnonzero(leader_of_tree[tree_a] != np.arange(n_act))  # (P,) competitors
    lead = leader_of_tree[tree_a[comp]]

    c_R = q_R[lead] - q_R[comp]
    c_T = q_T[lead] - q_T[comp]
    delta = c_T - c_R
    s_R = np.sqrt(mv_R[lead] + mv_R[comp] + params.residual_var_R)
    s_delta = np.sqrt(mv_D[lead] + mv_D[comp] + params.residual_var_delta)
    s_T = np.sqrt(mv_T[lead] + mv_T[comp] + params.residual_var_T)
    r_R = params.kappa_R * s_R
    r_delta = params.kappa_delta * s_delta
    r_T = params.kappa_T * s_T
    return GatePairs(
        tree=tree_a[comp], leader=actions[lead], competitor=actions[comp], c_R=c_R, c_T=c_T,
        delta=delta, s_R=s_R, s_delta=s_delta, s_T=s_T, r_R=r_R, r_delta=r_delta, r_T=r_T,
        decision=gate_decision(c_R, delta, c_T, r_R, r_delta, r_T))


def calibrate_kappa(errors_per_task: np.ndarray, level: float = 0.95) -> float:
    """D7: kappa = the ceil((n + 1) * level)-th smallest per-task max standardized |error|.

    ``errors_per_task`` (n,) holds each calibration task's maximum
    standardized error |estimate - truth| / s_X, or (n, ...) per task with
    the maximum (over pairs, primary updates, seeds) still to take; signs are
    dropped. With n = 96 and level 0.95 this is the 93rd of 96 (ceil(97 * 0.95)),
    the paper's choice; the split-conformal order statistic covers a new
    task's maximum with probability >= level. Returns inf when
    ceil((n + 1) * level) > n (too few tasks to certify that level).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    errors = np.abs(np.asarray(errors_per_task, np.float64))
    if errors.ndim == 0 or errors.shape[0] == 0:
        raise ValueError("need at least one calibration task")
    if errors.size == 0 or np.isnan(errors).any():
        raise ValueError("calibration errors must be non-empty and not NaN")
    per_task = errors.reshape(errors.shape[0], -1).max(axis=1)  # (n,)
    n = per_task.size
    # The 1e-9 keeps exact products (e.g. 20 * 0.95 = 19) from rounding up a rank.
    rank = math.ceil((n + 1) * level - 1e-9)
    if rank > n:
        return math.inf
    return float(np.sort(per_task)[rank - 1])


def calibrate_radii(per_update: Sequence[tuple[GatePairs, np.ndarray, np.ndarray]],
                    split_of_tree: Sequence[str], level: float) -> dict[str, Any]:
    """D7: residual variances on ``dev`` trees, kappas on ``calib`` trees.

    The one calibration of the gate's radii (the gate study's ``calibrate`` and the
    trainer's ``train.reuse`` use it). ``per_update``: (pairs computed with kappas 1 and
    zero residuals, target c_mu (P,), target c_pi (P,)) per update; ``split_of_tree[b]``
    is ``"dev"``, ``"calib"`` or anything else (unused) for tree index b of the pairs.
    Errors: c_R - c_mu, delta - (c_pi - c_mu), c_T - c_pi. Residual variance of X:
    max(0, mean over dev pairs of err_X^2 - s_X^2) (0 without dev pairs); kappa_X:
    ``calibrate_kappa`` of the per-tree maxima of |err_X| / sqrt(s_X^2 + residual) over
    the calib trees, or their maximum where too few trees certify ``level``
    (``kappa_fallback_to_max``), inf without calib trees. Returns {"n_dev_pairs",
    "n_calib_tasks", "R" | "delta" | "T": {"residual_var", "kappa",
    "kappa_fallback_to_max", "max_standardized_error"}}.
    """
    names = ("R", "delta", "T")
    errors: dict[str, list[np.ndarray]] = {n: [] for n in names}
    scales: dict[str, list[np.ndarray]] = {n: [] for n in names}
    trees: list[np.ndarray] = []
    for pairs, c_mu, c_pi in per_update:
        errors["R"].append(pairs.c_R - c_mu)
        errors["delta"].append(pairs.delta - (c_pi - c_mu))
        errors["T"].append(pairs.c_T - c_pi)
        for n, s in zip(names, (pairs.s_R, pairs.s_delta, pairs.s_T), strict=True):
            scales[n].append(s)
        trees.append(pairs.tree)
    tree = np.concatenate(trees) if trees else np.zeros(0, np.int64)
    split = np.array([str(split_of_tree[int(t)]) for t in tree], dtype=np.str_)
    out: dict[str, Any] = {"n_dev_pairs": int((split == "dev").sum()),
                           "n_calib_tasks": len(set(tree[split == "calib"].tolist()))}
    for n in names:
        err = np.concatenate(errors[n]) if errors[n] else np.zeros(0)
        s = np.concatenate(scales[n]) if scales[n] else np.zeros(0)
        dev = split == "dev"
        resid = max(0.0, float(np.mean(err[dev] ** 2 - s[dev] ** 2))) if dev.any() else 0.0
        cal = split == "calib"
        std = np.abs(err[cal]) / np.sqrt(s[cal] ** 2 + resid)
        per_task = np.array([std[tree[cal] == t].max() for t in np.unique(tree[cal])])
        kappa = calibrate_kappa(per_task, level) if per_task.size else math.inf
        fallback = not math.isfinite(kappa)
        if fallback and per_task.size:  # too few tasks for the level: use the maximum
            kappa = float(per_task.max())
        out[n] = {"residual_var": resid, "kappa": kappa, "kappa_fallback_to_max": fallback,
                  "max_standardized_error": float(per_task.max()) if per_task.size else None}
    return out
