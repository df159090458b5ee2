"""ELPO hierarchical advantage and error-localized clip bounds (METHODS.md section 2, E3-E8).

Per tree, with trajectories = root-to-leaf paths and R = leaf reward:

* (E3) node value ``r(leaf) = R``, ``r(v) = mean_{c in Child(v)} r(c)``;
* (E4) branch advantage of each child ``c`` of a branching node (M > 1 children):
  ``A_b(c) = (r(c) - mu_b) / (sigma_b + eps)`` over the siblings; ``sigma_b = 0``
  gives 0 [R];
* (E5) trajectory advantage ``A_t(tau) = (R(tau) - mean) / (std + eps)`` over the
  tree's trajectories (or the task's, ``group="task"``; BEL builds one tree per
  prompt, so both read "all complete trajectories of the prompt");
* (E6) ``Abar_t(v)``, the mean of ``A_t`` over the trajectories through ``v``;
* (E7) ``A_hier(v) = lambda_tree * A_b(v) + (1 - lambda_tree) * Abar_t(v)`` for a
  child of a branching node; elsewhere ``A_hier = Abar_t`` [R, METHODS' choice;
  ``off_branch="scaled"`` takes the alternative ``A_b := 0``, i.e.
  ``(1 - lambda_tree) * Abar_t``]. All agent tokens of step ``v`` get ``A_hier(v)``;
* (E8) ``clip_low = eps_low + eps_elc`` on the agent tokens of the critical suffix
  (the tree's ``critical_node`` and its subtree: steps t_crit..T of every
  trajectory whose path contains it [R]), ``eps_low`` elsewhere;
  ``clip_high = eps_high``.

Both z-scores (E4, E5) use ``std`` and ``eps`` [R: the paper says "mean and
standard deviation"; we default to the unbiased std of verl, on which ELPO is
built]. A trajectory group of one gives ``A_t = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from train.credit.base import (
    Credit,
    GroupBy,
    OffBranch,
    Params,
    StdNorm,
    TreeArrays,
    node_to_tokens,
    register,
)
from train.credit.groups import check_choice, check_nonneg, group_zscore, trajectory_credit


@dataclass(frozen=True)
class ElpoParams(Params):
    """Hyperparameters of ``elpo`` (defaults: METHODS section 2.2-2.3, values [N])."""

    lambda_tree: float = 0.5
    """lambda_tree of E7: 0 gives plain group credit, 1 pure branch credit."""
    eps: float = 1e-6
    """epsilon of E4 and E5."""
    std: StdNorm = "unbiased"
    """sigma of E4 and E5 [R]: ``"unbiased"``, ``"population"`` or ``"none"`` (no division)."""
    group: GroupBy = "tree"
    """E5's trajectory group: the trajectories of the tree, or of every tree of the task."""
    off_branch: OffBranch = "trajectory"
    """E7 off branching children [R]: ``"trajectory"`` (A_hier = Abar_t) or ``"scaled"``
    (A_b := 0, so A_hier = (1 - lambda_tree) * Abar_t)."""
    eps_low: float = 0.2
    """epsilon_low of E8: the clip-low bound off the critical suffix."""
    eps_elc: float = 0.115
    """epsilon_elc of E8: added to eps_low on the critical suffix (0.2 + 0.115 = 0.315)."""
    eps_high: float = 0.315
    """epsilon_high of E9: the clip-high bound everywhere."""

    def __post_init__(self) -> None:
        check_choice("elpo", "std", self.std, StdNorm)
        check_choice("elpo", "group", self.group, GroupBy)
        check_choice("elpo", "off_branch", self.off_branch, OffBranch)
        check_nonneg("elpo", eps=self.eps, eps_low=self.eps_low, eps_elc=self.eps_elc,
                     eps_high=self.eps_high)
        if not 0.0 <= self.lambda_tree <= 1.0:
            raise ValueError(f"elpo: lambda_tree must lie in [0, 1] (E7 mixes branch and "
                             f"trajectory credit), got {self.lambda_tree!r}")
        if self.eps_low + self.eps_elc >= 1.0:
            raise ValueError(f"elpo: eps_low + eps_elc must be < 1 (the ratio's lower bound "
                             f"1 - eps_low - eps_elc must stay positive), got "
                             f"{self.eps_low + self.eps_elc!r}")

    def spans_trees(self) -> bool:
        return self.group == "task"


def n_children(batch: TreeArrays) -> np.ndarray:
    """(N,) number of children of each node."""
    return np.bincount(batch.parent[batch.parent >= 0], minlength=batch.n_nodes)


def node_value(batch: TreeArrays) -> np.ndarray:
    """(N,) E3: ``r(leaf) = R``, ``r(v)`` = mean of its children's ``r``.

    Bottom-up, one vectorised step per depth level: rows of one level sorted by
    row number hold each parent's children contiguously (preorder), so one
    ``np.add.reduceat`` sums every parent's children at once.
    """
    n = batch.n_nodes
    r = np.where(batch.is_leaf, batch.reward, np.nan).astype(np.float64)
    if n == 0:
        return r
    kids = n_children(batch)
    order = np.lexsort((np.arange(n), batch.depth))  # by depth, then row
    depth_sorted = batch.depth[order]
    bounds = np.searchsorted(depth_sorted, np.arange(int(depth_sorted[-1]) + 2))
    for d in range(int(depth_sorted[-1]), 0, -1):
        rows = order[bounds[d]:bounds[d + 1]]
        par = batch.parent[rows]
        starts = np.flatnonzero(np.concatenate([[True], par[1:] != par[:-1]]))
        parents = par[starts]
        r[parents] = np.add.reduceat(r[rows], starts) / kids[parents]
    return r


def branch_advantage(batch: TreeArrays, r: np.ndarray, std: StdNorm = "unbiased",
                     eps: float = 1e-6) -> np.ndarray:
    """(N,) E4: ``A_b(c) = (r(c) - mu_b) / (sigma_b + eps)`` over the siblings of ``c``.

    ``r`` (N,) is E3's node value. Defined for children of branching nodes (a
    parent with more than one child), NaN elsewhere; equal siblings give 0.
    """
    out = np.full(batch.n_nodes, np.nan)
    has_parent = batch.parent >= 0
    kids = n_children(batch)
    child = has_parent & (kids[np.where(has_parent, batch.parent, 0)] > 1)
    out[child] = group_zscore(r[child], batch.parent[child], std, eps)
    return out


def critical_suffix(batch: TreeArrays) -> np.ndarray:
    """(N,) bool: the nodes of each tree's critical subtree (``critical_node`` and below).

    Preorder makes the subtree of row ``c`` the rows ``c : c + subtree_size[c]``;
    a difference array marks them all at once.
    """
    crit = batch.critical_node[batch.critical_node >= 0]
    diff = np.zeros(batch.n_nodes + 1, np.int64)
    np.add.at(diff, crit, 1)
    np.add.at(diff, crit + batch.subtree_size[crit], -1)
    return np.cumsum(diff[:-1]) > 0


@register("elpo", ElpoParams)
def elpo(batch: TreeArrays, params: ElpoParams) -> Credit:
    """ELPO hierarchical advantage (E3-E7) and ELC per-token clip bounds (E8).

    Inputs: ``batch`` with N nodes, T tokens, B trees; ``batch.reward`` (N,) at
    leaves; ``batch.critical_node`` (B,), the row of each tree's localized first
    irrecoverable step (BEL) or -1; ``batch.task`` (B,) when ``group="task"``.

    Returns ``Credit``:

    * ``node`` (N,): ``A_hier`` (E7) of every node;
    * ``token`` (T,): ``A_hier`` of the node on each agent token, 0 on observation
      tokens;
    * ``clip_low`` (T,): ``eps_low + eps_elc`` on agent tokens of critical-suffix
      nodes, ``eps_low`` on every other token (E8);
    * ``clip_high`` (T,): ``eps_high`` everywhere (E9).
    """
    lam = params.lambda_tree
    a_t_bar = trajectory_credit(batch, params.group, params.std, params.eps)  # E5, E6
    a_b = branch_advantage(batch, node_value(batch), params.std, params.eps)  # E3, E4
    off = a_t_bar if params.off_branch == "trajectory" else (1.0 - lam) * a_t_bar
    a_hier = np.where(np.isnan(a_b), off, lam * a_b + (1.0 - lam) * a_t_bar)  # E7

    crit_tok = np.repeat(critical_suffix(batch), np.diff(batch.token_offsets))
    clip_low = np.where(crit_tok & batch.agent_mask, params.eps_low + params.eps_elc,
                        params.eps_low)
    clip_high = np.full(batch.n_tokens, params.eps_high)
    return Credit(node=a_hier, token=node_to_tokens(batch, a_hier), clip_low=clip_low,
                  clip_high=clip_high)
