"""SLCA-GRPO: segment-locked advantages with HierR routing (METHODS.md section 4, S1, S5, S6).

Each trajectory (root-to-leaf path) of a tree is one group member. Its leaf
carries the HierR parts ``reward_parts["r_tool"]`` (S2, S4) and
``reward_parts["r_sum"]`` (S3). The tool-decision tokens of the trajectory are
trained with the group-normalised tool reward only, and its summary tokens with
the summary reward only, so summary quality never leaks onto tool decisions.

**Segments (S1), as SLCA's own code splits ``response_mask``.** A trajectory's
policy tokens are its nodes' action tokens (``agent_mask``) in path order; they
form contiguous runs separated by observation tokens. The last run is the
summary segment, the union of all earlier runs the tool segment (a single run:
summary only). Segment codes of the environment (``tool_call``, ``text``, ...)
play no part: a malformed turn's ``text`` tokens are tool tokens when a later
run follows, and a trajectory cut at the step limit still has its last run as
its summary, as in SLCA.

A segment *exists* in a trajectory when it has at least one token there. Every
trajectory leaf must carry both reward parts: a tree whose leaves lack them
(not HierR-scored, e.g. calc trees) is refused with ``SlcaInputError`` naming
the tree, node and part, never credited with silent zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from train.credit.base import (
    Credit,
    Params,
    StdNorm,
    TreeArrays,
    depth_levels,
    path_sum,
    register,
    subtree_sum,
)
from train.credit.groups import check_choice, check_nonneg, group_zscore


class SlcaInputError(ValueError):
    """Trees that SLCA cannot credit (leaves without the HierR reward parts)."""


@dataclass(frozen=True)
class SlcaParams(Params):
    """Hyperparameters of ``slca`` (METHODS S5; defaults from the SLCA code [P])."""

    lambda_tool: float = 1.0
    """lambda_tool of S5, applied after normalisation."""
    lambda_sum: float = 1.0
    """lambda_sum of S5, applied after normalisation."""
    tool_part: str = "r_tool"
    """Key of the tool reward R_tool in ``reward_parts`` (S2)."""
    sum_part: str = "r_sum"
    """Key of the summary reward R_sum in ``reward_parts`` (S3)."""
    std: StdNorm = "unbiased"
    """sigma of S5: the unbiased std [P]; ``"population"`` / ``"none"`` for studies."""
    eps: float = 1e-6
    """The 1e-6 added to sigma in S5 [P]."""

    def __post_init__(self) -> None:
        check_choice("slca", "std", self.std, StdNorm)
        check_nonneg("slca", lambda_tool=self.lambda_tool, lambda_sum=self.lambda_sum,
                     eps=self.eps)


@dataclass(frozen=True)
class _Routes:
    """Where each trajectory's segments lie (arrays (N,), read at leaf rows)."""

    tool_exists: np.ndarray  # bool: the trajectory ending here has tool-segment tokens
    sum_exists: np.ndarray  # bool: it has summary-segment tokens
    last: np.ndarray  # int64: deepest node with agent tokens on the root path (-1: none)
    above: np.ndarray  # int64: parent of the first node of the last run (-1: none)
    joins_parent: np.ndarray  # bool (per node): its tokens continue the run open at its parent


def _routes(batch: TreeArrays) -> _Routes:
    """S1 for every trajectory at once; the run walk is one loop over depth levels."""
    n = batch.n_nodes
    parent = batch.parent
    a_len = np.bincount(batch.token_node[batch.agent_mask], minlength=n)
    has_a = a_len > 0
    has_o = (np.diff(batch.token_offsets) - a_len) > 0

    # Runs along each root path. top: first node of the run holding this node's
    # actions; open_after: first node of the run still open after this node's
    # tokens (-1 once an observation token closed it); last: deepest agent node.
    top = np.full(n, -1, np.int64)
    open_after = np.full(n, -1, np.int64)
    last = np.full(n, -1, np.int64)
    for d, rows in enumerate(depth_levels(batch)):
        if d == 0:
            open_before = np.full(rows.size, -1, np.int64)
            last_before = np.full(rows.size, -1, np.int64)
        else:
            open_before = open_after[parent[rows]]
            last_before = last[parent[rows]]
        ha = has_a[rows]
        top[rows] = np.where(ha, np.where(open_before >= 0, open_before, rows), -1)
        open_after[rows] = np.where(has_o[rows], -1, np.where(ha, top[rows], open_before))
        last[rows] = np.where(ha, rows, last_before)

    first_of_last = np.where(last >= 0, top[np.maximum(last, 0)], -1)
    above = np.where(first_of_last >= 0, parent[np.maximum(first_of_last, 0)], -1)
    agent_on_path = path_sum(batch, has_a)
    earlier_run = (above >= 0) & (agent_on_path[np.maximum(above, 0)] > 0)
    joins = (parent >= 0) & (open_after[np.maximum(parent, 0)] >= 0)
    return _Routes(tool_exists=earlier_run, sum_exists=last >= 0, last=last, above=above,
                   joins_parent=joins)


def _part(batch: TreeArrays, key: str) -> np.ndarray:
    """(N,) reward part ``key``; raises ``SlcaInputError`` at a leaf without it."""
    value = batch.reward_parts.get(key, np.full(batch.n_nodes, np.nan))
    missing = batch.is_leaf & ~np.isfinite(value)
    if missing.any():
        row = int(np.flatnonzero(missing)[0])
        raise SlcaInputError(
            f"slca needs the HierR reward parts at every leaf (S2-S3): tree "
            f"{batch.tree_ids[batch.node_tree[row]]!r}, node {batch.node_ids[row]} has no "
            f"{key!r} ({int(missing.sum())} such leaves); name the parts with "
            "tool_part=/sum_part=, or credit these trees with another method")
    return value


def segment_advantages(batch: TreeArrays, params: SlcaParams,
                       routes: _Routes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(S5) Â_tool and Â_sum of every trajectory, each (N,): set at leaves, NaN elsewhere.

    Â_seg,i = lambda_seg·(R_seg,i - mu)/(sigma + eps), mu and sigma (unbiased std)
    taken over the tree's trajectories where the segment exists. A trajectory
    without the segment, a group with fewer than 2 such members, or a
    zero-variance group gives 0. The optional KL term of S5 is not folded in.
    Raises ``SlcaInputError`` when a leaf lacks a reward part.
    """
    r = routes if routes is not None else _routes(batch)
    leaf = batch.is_leaf
    out = []
    for key, exists, lam in ((params.tool_part, r.tool_exists, params.lambda_tool),
                             (params.sum_part, r.sum_exists, params.lambda_sum)):
        value = _part(batch, key)
        member = leaf & exists
        adv = np.where(leaf, 0.0, np.nan)
        adv[member] = lam * group_zscore(value[member], batch.node_tree[member], params.std,
                                         params.eps, "zero")
        out.append(adv)
    return out[0], out[1]


@register("slca", SlcaParams)
def slca(batch: TreeArrays, params: SlcaParams) -> Credit:
    """SLCA-GRPO credit (METHODS S1, S5, S6) for a batch of N nodes, T tokens, B trees.

    Inputs: leaf ``reward_parts[tool_part]`` and ``[sum_part]`` (N,) (required at
    every leaf), ``agent_mask`` (T,); the group is the tree.

    * (S1) segments per trajectory: runs of agent tokens (module docstring).
    * (S5) Â_tool,i and Â_sum,i: ``segment_advantages``.
    * (S6) A_{i,t} = Â_tool,i·1{t ∈ tool_i} + Â_sum,i·1{t ∈ summary_i}.
    * A node shared by several trajectories is trained once: token t of node v
      gets the mean of A_{i,t} over all trajectories i through v. A shared node
      can end the last run on one path and an earlier run on another (a node
      without observation tokens followed by different children); it then mixes
      both segments, per trajectory.

    Returns ``Credit``: ``token`` (T,) as above, 0 on observation tokens;
    ``node`` (N,) the mean advantage of the node's agent tokens (0 for a node
    without any). Every agent token of a node gets the same value.
    Raises ``SlcaInputError`` for leaves without the reward parts.
    """
    n = batch.n_nodes
    r = _routes(batch)
    adv_tool, adv_sum = segment_advantages(batch, params, r)
    leaf = np.flatnonzero(batch.is_leaf)
    t_leaf, s_leaf = adv_tool[leaf], adv_sum[leaf]

    # Â_sum on the last run, summed bottom-up from its last agent node along the run
    # only (no subtraction, so a node outside every summary run gets exactly nothing
    # from summary rewards); Â_tool on the path above the run's first node.
    last, above = r.last[leaf], r.above[leaf]
    has_run = last >= 0
    run_sum = np.zeros(n)
    np.add.at(run_sum, last[has_run], s_leaf[has_run])
    for rows in reversed(depth_levels(batch)[1:]):
        rows = rows[r.joins_parent[rows]]
        np.add.at(run_sum, batch.parent[rows], run_sum[rows])
    cut = has_run & (above >= 0)
    run_tool = np.zeros(n)
    np.add.at(run_tool, above[cut], t_leaf[cut])

    n_traj = subtree_sum(batch, batch.is_leaf.astype(np.float64))  # (N,) >= 1
    per_node = (run_sum + subtree_sum(batch, run_tool)) / n_traj
    token = np.where(batch.agent_mask, per_node[batch.token_node], 0.0)
    node = np.where(np.bincount(batch.token_node[batch.agent_mask], minlength=n) > 0,
                    per_node, 0.0)
    return Credit(node=node, token=token)
