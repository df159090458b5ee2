"""Tree-GRPO: intra-tree plus inter-tree group advantages (Ji et al. 2025, arXiv:2509.21240).

Our reading [R] (no equation text of Tree-GRPO is in ``papers/``; ELPO's paper
only cites it, and the Tree-GRPO abstract says it "estimates the grouped
relative advantages both on intra-tree and inter-tree levels"). For the leaf
of trajectory ``i`` of tree ``T`` of task (prompt) ``x``::

    A_intra(i) = (R_i - mean_{j in T} R_j) / (F_norm_{j in T} + eps)     tree-level group
    A_inter(i) = (R_i - mean_{j in x} R_j) / (F_norm_{j in x} + eps)     prompt-level group:
                                                                         every leaf of every
                                                                         tree of task x
    A(i) = A_intra(i) + A_inter(i)

(the unweighted sum). Each z-score is METHODS G1 with the same ``std``, ``eps``
and single-member rule. A node gets the mean of ``A`` over the trajectories
through it (E6 semantics: a shared prefix is trained once per node, not once
per trajectory). When a task has a single tree, both groups coincide and
``A = 2 * A_intra``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from train.credit.base import (
    Credit,
    Params,
    SingleGroup,
    StdNorm,
    TreeArrays,
    node_to_tokens,
    register,
)
from train.credit.grpo import (
    check_choice,
    check_nonneg,
    group_zscore,
    trajectory_leaves,
    trajectory_mean,
)


@dataclass(frozen=True)
class TreeGrpoParams(Params):
    """Hyperparameters of ``tree_grpo`` (both z-scores use them)."""

    std: StdNorm = "unbiased"
    """F_norm of each z-score: ``"unbiased"`` / ``"population"`` std, or ``"none"``."""
    eps: float = 1e-6
    """epsilon added to the std (METHODS G1)."""
    single: SingleGroup = "zero"
    """A group of one trajectory (e.g. the intra-tree group of a chain): 0 or raw score."""

    def __post_init__(self) -> None:
        check_choice("tree_grpo", "std", self.std, StdNorm)
        check_choice("tree_grpo", "single", self.single, SingleGroup)
        check_nonneg("tree_grpo", eps=self.eps)


@register("tree_grpo", TreeGrpoParams)
def tree_grpo(batch: TreeArrays, params: TreeGrpoParams) -> Credit:
    """Tree-GRPO advantage ``A = A_intra + A_inter`` (module docstring), mean over trajectories.

    Inputs: ``batch`` with N nodes, T tokens, B trees; ``batch.reward`` (N,) at
    leaves; ``batch.node_tree`` (N,) gives the tree-level group and
    ``batch.task`` (B,) the prompt-level group.

    Returns ``Credit``: ``node`` (N,), the leaf's ``A`` at a leaf and the mean of
    ``A`` over the trajectories through an inner node; ``token`` (T,), the node's
    credit on each agent token and 0 on observation tokens.
    """
    leaf = trajectory_leaves(batch)
    reward = batch.reward[leaf]
    tree = batch.node_tree[leaf]
    intra = group_zscore(reward, tree, params.std, params.eps, params.single)
    inter = group_zscore(reward, batch.task[tree], params.std, params.eps, params.single)
    adv = np.full(batch.n_nodes, np.nan)
    adv[leaf] = intra + inter
    node = trajectory_mean(batch, adv)
    return Credit(node=node, token=node_to_tokens(batch, node))
