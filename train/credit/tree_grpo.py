"""Tree-GRPO: intra-tree plus inter-tree group advantages (Ji et al. 2025, arXiv:2509.21240).

Tree-GRPO samples, for one prompt, M initial chains; each initial chain roots
its own tree, which is then expanded by suffix rollouts from its nodes. Our
``random`` sampler builds exactly that forest under one stored root: every
child of the stored root is the first step of one initial chain, and every
later expansion hangs inside the subtree of the chain it continues. So
(METHODS section 1.2, G9-G11):

* a *Tree-GRPO tree* is the subtree of one child of the stored root (a
  depth-1 node); its trajectories are the leaves below that child;
* the prompt's trees are the Tree-GRPO trees of every stored tree of the
  prompt group (run, sampler, policy version, task: ``batch.task``).

For the leaf of trajectory ``i`` in Tree-GRPO tree ``T`` of prompt group ``x``::

    A_intra(i) = (R_i - mean_{j in T} R_j) / (F_norm_{j in T} + eps)     (G9)
    A_inter(i) = (R_i - mean_{j in x} R_j) / (F_norm_{j in x} + eps)     (G10)
    A(i) = A_intra(i) + A_inter(i)                                       (G11)

Each z-score is METHODS G1 with the same ``std`` and ``eps``. An intra-tree
group of one (an unexpanded chain) gives A_intra = 0: its reward equals its own
mean [R]; ``single`` applies to the inter-tree group only. So a forest of
unbranched chains gets exactly GRPO over the prompt group
(``grpo`` with ``group="task"`` and the same ``std``, ``eps``, ``single``). A
node gets the mean of ``A`` over the trajectories through it (E6 semantics: a
shared prefix is trained once per node, not once per trajectory); the stored
root, shared by all the prompt's trees of that stored tree, gets the mean over
all its trajectories. A root that is itself a leaf is a Tree-GRPO tree of one.
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
from train.credit.groups import (
    check_choice,
    check_nonneg,
    group_zscore,
    root_child,
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
    """A prompt-level group of one trajectory: 0 or its raw score (G1). An intra-tree
    group of one always gives 0."""

    def __post_init__(self) -> None:
        check_choice("tree_grpo", "std", self.std, StdNorm)
        check_choice("tree_grpo", "single", self.single, SingleGroup)
        check_nonneg("tree_grpo", eps=self.eps)

    def spans_trees(self) -> bool:
        return True


def tree_of_leaf(batch: TreeArrays, leaf: np.ndarray) -> np.ndarray:
    """(L,) Tree-GRPO tree of each trajectory leaf (``leaf`` (N,) bool): its depth-1 ancestor
    row, or its own row for a root that is a leaf."""
    rows = np.flatnonzero(leaf)
    top = root_child(batch)[rows]
    return np.where(top >= 0, top, rows)


@register("tree_grpo", TreeGrpoParams)
def tree_grpo(batch: TreeArrays, params: TreeGrpoParams) -> Credit:
    """Tree-GRPO advantage ``A = A_intra + A_inter`` (G9-G11, module docstring).

    Inputs: ``batch`` with N nodes, T tokens, B trees; ``batch.reward`` (N,) at
    leaves; the depth-1 ancestors of the leaves give the intra-tree groups and
    ``batch.task`` (B,) the prompt-level (inter-tree) groups.

    Returns ``Credit``: ``node`` (N,), the leaf's ``A`` at a leaf and the mean of
    ``A`` over the trajectories through an inner node; ``token`` (T,), the node's
    credit on each agent token and 0 on observation tokens.
    """
    leaf = trajectory_leaves(batch)
    reward = batch.reward[leaf]
    intra = group_zscore(reward, tree_of_leaf(batch, leaf), params.std, params.eps, "zero")
    inter = group_zscore(reward, batch.task[batch.node_tree[leaf]], params.std, params.eps,
                         params.single)
    adv = np.full(batch.n_nodes, np.nan)
    adv[leaf] = intra + inter
    node = trajectory_mean(batch, adv)
    return Credit(node=node, token=node_to_tokens(batch, node))
