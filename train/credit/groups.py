"""Group helpers shared by the outcome-group estimators (METHODS G1, E5, E6).

``group_zscore`` is the G1 z-score within integer-keyed groups,
``trajectory_mean`` the E6 mean over the trajectories through each node,
``trajectory_credit`` the two composed (each trajectory's z-scored outcome, averaged
onto the nodes);
``trajectory_leaves`` / ``leaf_groups`` pick the trajectories and their group
(tree or prompt group). ``check_choice`` / ``check_nonneg`` validate estimator
params. Used by ``grpo``, ``tree_grpo``, ``elpo``, ``caliper``, ``slca``;
``train.credit.grpo`` re-exports them for older imports.
"""

from __future__ import annotations

from typing import Any, get_args

import numpy as np

from train.credit.base import GroupBy, SingleGroup, StdNorm, TreeArrays, segment_stats, subtree_sum


def check_choice(owner: str, name: str, value: Any, options: Any) -> None:
    """Raise if ``value`` is not one of the ``Literal`` type ``options``."""
    allowed = get_args(options)
    if value not in allowed:
        raise ValueError(f"{owner}: {name}={value!r} is not one of {list(allowed)}")


def check_nonneg(owner: str, **values: float) -> None:
    """Raise if any of ``values`` is negative or not finite."""
    for name, value in values.items():
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


def trajectory_leaves(batch: TreeArrays) -> np.ndarray:
    """(N,) bool: rows that end a trajectory (a leaf with a finite reward)."""
    return batch.is_leaf & np.isfinite(batch.reward)


def leaf_groups(batch: TreeArrays, leaf: np.ndarray, group: GroupBy) -> np.ndarray:
    """(L,) group key of each trajectory leaf ``leaf`` (N,) bool: its tree or its task."""
    tree = batch.node_tree[leaf]
    return tree if group == "tree" else batch.task[tree]


def group_zscore(values: np.ndarray, groups: np.ndarray, std: StdNorm, eps: float,
                 single: SingleGroup = "zero") -> np.ndarray:
    """(K,) G1 z-score of ``values`` (K,) within groups keyed by ``groups`` (K,) ints.

    ``(v - mean) / (F_norm + eps)``, or ``v - mean`` when ``std="none"``. A group
    whose values are all equal (or whose std is 0 in floating point) gives
    exactly 0, with no ulp noise divided by eps; a group of one gives 0, or
    ``v / (1 + eps)`` (``v`` when ``std="none"``) with ``single="raw"``.
    """
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return values.copy()
    _, g = np.unique(groups, return_inverse=True)
    g = g.ravel()
    k = int(g.max()) + 1
    count, mean, sd = segment_stats(values, g, k, ddof=1 if std == "unbiased" else 0)
    lo = np.full(k, np.inf)
    hi = np.full(k, -np.inf)
    np.minimum.at(lo, g, values)
    np.maximum.at(hi, g, values)
    centred = values - mean[g]
    flat = hi == lo
    if std == "none":
        adv = centred
    else:
        flat |= sd == 0.0  # equal values, or spread too small to square (eps = 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            adv = centred / (sd[g] + eps)
    adv = np.where(flat[g], 0.0, adv)
    if single == "raw":
        raw = values if std == "none" else values / (1.0 + eps)
        adv = np.where(count[g] == 1, raw, adv)
    return adv


def trajectory_mean(batch: TreeArrays, leaf_values: np.ndarray) -> np.ndarray:
    """(N,) mean of ``leaf_values`` (N,) over the trajectories through each node (E6).

    ``leaf_values`` is read at trajectory leaves only (finite there). A leaf gets
    its own value exactly; a node with no trajectory below gets NaN.
    """
    has = trajectory_leaves(batch) & np.isfinite(leaf_values)
    total = subtree_sum(batch, np.where(has, leaf_values, 0.0))
    count = subtree_sum(batch, has.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(count > 0, total / count, np.nan)
    return np.where(has, leaf_values, out)


def trajectory_credit(batch: TreeArrays, group: GroupBy, std: StdNorm, eps: float,
                      single: SingleGroup = "zero") -> np.ndarray:
    """(N,) outcome-group credit of every node: each trajectory's reward z-scored within
    its ``group`` (G1 / E5, ``group_zscore`` over ``leaf_groups``), then each node's mean
    over the trajectories through it (E6, ``trajectory_mean``)."""
    leaf = trajectory_leaves(batch)
    adv = np.full(batch.n_nodes, np.nan)
    adv[leaf] = group_zscore(batch.reward[leaf], leaf_groups(batch, leaf, group), std, eps,
                             single)
    return trajectory_mean(batch, adv)


def root_child(batch: TreeArrays) -> np.ndarray:
    """(N,) row of each node's depth-1 ancestor (itself at depth 1); -1 at roots.

    In preorder the last row of depth <= 1 at or before a node of depth >= 1
    is its depth-1 ancestor, so a running maximum finds it.
    """
    n = batch.n_nodes
    marker = np.where(batch.depth <= 1, np.arange(n), -1)
    last = np.maximum.accumulate(marker) if n else marker
    return np.where(batch.depth >= 1, last, -1)
