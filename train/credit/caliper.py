"""CALIPER: global GRPO credit plus localized leave-one-out credit (METHODS.md section 3, C4-C9).

Every clause of section 3 is [R] (no public text or code); the readings below are ours.

**The tree.** Full rollouts (sampler phase ``"explore"``) fork from the root. At
a position p of a failed rollout the sampler restores the state and draws K local
resamples (phase ``"local"``), which hang below the same node as the original
step of that rollout. So a *local group* is a node p (the *branching node*) with
at least one ``"local"`` child and at least one ``"explore"`` child; its members
are

* the K ``"local"`` children y_1..y_K (each the first step of a resampled suffix),
* y_0, the original failed suffix: p's ``"explore"`` child. When p has several
  (only the root, where the full rollouts fork, i.e. a D position in the first
  step), y_0 is the one marked True in the optional ``extras["caliper_y0"]``
  (N,) bool; without a mark, the one whose action tokens share the longest
  common prefixes with the resamples (summed over them), ties going to the first
  in preorder. Resamples at a D position copy the kept reasoning of y_0's step,
  so this finds y_0 unless the kept prefix is empty; samplers should mark it.

A node with ``"local"`` children but no ``"explore"`` child forms no group (a
resample of a resample is not a CALIPER group).

**Member return R_j** (C3): the mean reward of the leaves below the member that
are reached without leaving the member's phase. For a resample that is its whole
subtree (the mean leaf reward if it branches). For y_0 it is the original
rollout's own leaf: resamples hung deeper on the same failed rollout (other
positions) are not part of y_0's return. If no such leaf exists, the mean over
all leaves of the member's subtree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from train.credit.base import (
    Credit,
    NegativeEvidence,
    Params,
    StdNorm,
    TreeArrays,
    _positions,
    depth_levels,
    node_to_tokens,
    path_sum,
    register,
    subtree_sum,
)
from train.credit.groups import check_choice, check_nonneg, group_zscore, trajectory_mean

AGREEMENT_KEY = "caliper_agreement"  # extras (N,) float: a_g of C5 at each branching node
Y0_KEY = "caliper_y0"  # extras (N,) bool: marks y_0 among several explore children


@dataclass(frozen=True)
class CaliperParams(Params):
    """Hyperparameters of ``caliper`` (METHODS C4-C8; defaults from section 3).

    K (the number of resamples of C5) is not a parameter: it is read from each
    group in the tree, so a group cut short by the budget gets its true K.
    """

    lambda_loc: float = 1.0
    """lambda_loc of C7: weight of the local credit."""
    n0: float = 2.0
    """n_0 of C5: pseudo-count shrinking the reliability of small groups."""
    agreement: float = 1.0
    """a_g of C5 for a group without ``extras["caliper_agreement"]`` (or NaN there) [R]."""
    gamma: float = 0.5
    """gamma of C8: y_0's changed-region local credit is multiplied by (1 + gamma)."""
    w_min: float = 0.5
    """w_min of C8: strengthening needs w_p >= w_min [R: the value is ours]."""
    negative: NegativeEvidence = "scale"
    """C8's form: ``"scale"`` by (1 + gamma), ``"clip"`` (clip-low eps_low + eps_neg),
    ``"both"``, or ``"none"``."""
    eps_low: float = 0.2
    """epsilon_low of the clipped surrogate, returned as ``clip_low`` when C8 clips."""
    eps_neg: float = 0.115
    """eps_neg of C8, added to eps_low on y_0's changed region [R: ELC's eps_elc, E8]."""
    std: StdNorm = "unbiased"
    """F_norm of the global z-score (G1)."""
    eps: float = 1e-6
    """epsilon of G1."""
    local_phase: str = "local"
    """Sampler phase of local resamples."""
    explore_phase: str = "explore"
    """Sampler phase of full rollouts (and so of y_0)."""

    def __post_init__(self) -> None:
        check_choice("caliper", "negative", self.negative, NegativeEvidence)
        check_choice("caliper", "std", self.std, StdNorm)
        check_nonneg("caliper", lambda_loc=self.lambda_loc, n0=self.n0,
                     agreement=self.agreement, gamma=self.gamma, w_min=self.w_min,
                     eps_low=self.eps_low, eps_neg=self.eps_neg, eps=self.eps)
        if self.local_phase == self.explore_phase:
            raise ValueError("caliper: local_phase and explore_phase must differ")


@dataclass(frozen=True)
class CaliperGroups:
    """The local groups of a batch, one entry per member (M members in all).

    ``start:stop`` is the member's changed region M_j (C6) as offsets into its
    node's action tokens.
    """

    member: np.ndarray  # (M,) int64: node row of the member, ascending
    branch: np.ndarray  # (M,) int64: row of its group's branching node p
    is_y0: np.ndarray  # (M,) bool: the original failed suffix y_0
    k: np.ndarray  # (M,) int64: K, the number of resamples in the group
    ret: np.ndarray  # (M,) float64: R_j (C3, see the module docstring)
    a_loc: np.ndarray  # (M,) float64: leave-one-out credit (C4)
    w: np.ndarray  # (M,) float64: the group's reliability w_p (C5)
    start: np.ndarray  # (M,) int64: first changed action token (C6)
    stop: np.ndarray  # (M,) int64: end of the member's action tokens (C6)


def _phase_is(batch: TreeArrays, phase: str) -> np.ndarray:
    return np.asarray(batch.phase == phase, dtype=bool)


def _action_lengths(batch: TreeArrays) -> np.ndarray:
    """(N,) number of action tokens per node (they come first in each node's tokens)."""
    return np.bincount(batch.token_node[batch.agent_mask], minlength=batch.n_nodes)


def _common_prefix(batch: TreeArrays, a: np.ndarray, b: np.ndarray,
                   a_len: np.ndarray) -> np.ndarray:
    """(P,) length of the common prefix of the action tokens of rows ``a`` (P,), ``b`` (P,)."""
    length = np.minimum(a_len[a], a_len[b])
    pair = np.repeat(np.arange(a.size), length)  # (Q,) pair of each compared position
    rel = np.arange(pair.size) - np.repeat(np.cumsum(length) - length, length)  # (Q,)
    off = batch.token_offsets
    differ = batch.token_ids[off[a][pair] + rel] != batch.token_ids[off[b][pair] + rel]
    lcp = length.astype(np.int64)
    np.minimum.at(lcp, pair[differ], rel[differ])
    return lcp


def _member_returns(batch: TreeArrays) -> np.ndarray:
    """(N,) R of each node as a group member: its mean same-phase leaf reward (C3)."""
    parent = batch.parent
    leaf = batch.is_leaf & np.isfinite(batch.reward)
    total = np.where(leaf, batch.reward, 0.0)
    count = leaf.astype(np.float64)
    has_parent = parent >= 0
    same = has_parent & np.asarray(batch.phase == batch.phase[np.where(has_parent, parent, 0)],
                                   dtype=bool)
    sub_total, sub_count = subtree_sum(batch, total), subtree_sum(batch, count)
    for rows in reversed(depth_levels(batch)[1:]):  # bottom-up, one level at a time
        rows = rows[same[rows]]
        np.add.at(total, parent[rows], total[rows])
        np.add.at(count, parent[rows], count[rows])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, sub_total / sub_count)


def caliper_groups(batch: TreeArrays, params: CaliperParams) -> CaliperGroups:
    """The local groups of ``batch`` with their C4 credit, C5 reliability and C6 regions.

    * (C4) A_loc(y_j) = R_j - (1/K)·sum_{i != j} R_i over the K + 1 members, so
      the credits of a group sum to zero.
    * (C5) w_p = (K / (K + n_0))·a_g, with a_g read from
      ``extras["caliper_agreement"]`` (N,) at the branching node p (the historical
      sign agreement of bucket g, kept by the sampler); ``params.agreement`` where
      that extra is absent or NaN.
    * (C6) M_j, for a resample y_j: its action tokens from the first position
      where they differ from y_0's action tokens to the end of the step (its
      node); for y_0: from the earliest such position over the group's resamples
      (the resampling point p, as far as the tokens show it) to the end of its
      step. A resample identical to y_0's step has an empty region.
    """
    n = batch.n_nodes
    parent = batch.parent
    has_parent = parent >= 0
    par = np.where(has_parent, parent, 0)
    local = _phase_is(batch, params.local_phase) & has_parent
    explore = _phase_is(batch, params.explore_phase) & has_parent
    n_local = np.bincount(parent[local], minlength=n)  # (N,) resamples below each node
    n_explore = np.bincount(parent[explore], minlength=n)
    is_branch = (n_local > 0) & (n_explore > 0)
    loc = np.flatnonzero(local & is_branch[par])  # (L,) resamples y_1..y_K of all groups
    cand = np.flatnonzero(explore & is_branch[par])  # (E,) candidates for y_0

    # every (candidate, resample) pair below one branching node: (P,) each
    cand_sorted = cand[np.argsort(parent[cand], kind="stable")]
    first = np.searchsorted(parent[cand_sorted], parent[loc])
    n_cand = n_explore[parent[loc]]
    pair_l = np.repeat(loc, n_cand)
    pair_e = cand_sorted[_positions(first, n_cand)]
    a_len = _action_lengths(batch)
    lcp = _common_prefix(batch, pair_e, pair_l, a_len)  # (P,)

    # y_0 of each group: the marked candidate, else the longest shared prefixes
    score = np.bincount(pair_e, weights=lcp, minlength=n).astype(np.float64)  # (N,) exact
    if Y0_KEY in batch.extras:  # a mark outweighs any prefix total
        score += np.asarray(batch.extras[Y0_KEY], bool) * float(batch.n_tokens + 1)
    best = np.full(n, -1.0)
    np.maximum.at(best, parent[cand], score[cand])
    win = cand[score[cand] == best[parent[cand]]]
    y0_of = np.full(n, n, np.int64)  # (N,) y_0 row of each branching node
    np.minimum.at(y0_of, parent[win], win)
    y0 = y0_of[is_branch]

    # changed regions (C6)
    vs_y0 = pair_e == y0_of[parent[pair_l]]  # each resample has exactly one such pair
    start = np.zeros(n, np.int64)
    start[pair_l[vs_y0]] = lcp[vs_y0]
    start_y0 = a_len.astype(np.int64).copy()
    np.minimum.at(start_y0, pair_e[vs_y0], lcp[vs_y0])
    start[y0] = start_y0[y0]

    member = np.sort(np.concatenate([loc, y0]))  # (M,)
    is_y0 = np.zeros(n, bool)
    is_y0[y0] = True
    branch = parent[member]
    k = n_local[branch]
    ret = _member_returns(batch)[member]
    group_total = np.bincount(branch, weights=ret, minlength=n)
    a_loc = ret - (group_total[branch] - ret) / k  # (C4)
    agreement = np.full(member.size, params.agreement)
    if AGREEMENT_KEY in batch.extras:
        given = np.asarray(batch.extras[AGREEMENT_KEY], np.float64)[branch]
        agreement = np.where(np.isfinite(given), given, params.agreement)
    w = k / (k + params.n0) * agreement  # (C5)
    return CaliperGroups(member=member, branch=branch, is_y0=is_y0[member], k=k, ret=ret,
                         a_loc=a_loc, w=w, start=start[member],
                         stop=a_len[member].astype(np.int64))


def full_trajectory_leaves(batch: TreeArrays, params: CaliperParams) -> np.ndarray:
    """(N,) bool: leaves of full rollouts, i.e. leaves with a finite reward whose
    root path holds no node of phase ``params.local_phase`` (the group of C7's
    global z-score; local suffixes are not full trajectories)."""
    in_local = path_sum(batch, _phase_is(batch, params.local_phase)) > 0
    return batch.is_leaf & np.isfinite(batch.reward) & ~in_local


@register("caliper", CaliperParams)
def caliper(batch: TreeArrays, params: CaliperParams) -> Credit:
    """CALIPER credit (METHODS C4-C8) for a batch of N nodes, T tokens, B trees.

    Inputs: ``batch.phase`` (N,) (``"explore"`` / ``"local"``, see the module
    docstring), ``batch.reward`` (N,) at leaves, action ``token_ids`` (T,) for C6,
    optional ``extras["caliper_agreement"]`` (N,) float (a_g at branching nodes,
    C5) and ``extras["caliper_y0"]`` (N,) bool (marks y_0).

    * Global part: Â_global(τ) is the G1 z-score (``params.std``, ``params.eps``;
      0 for a group of one or a zero-variance group) of the rewards of the tree's
      full trajectories (``full_trajectory_leaves``), and a node carries the mean
      of Â_global over the full trajectories through it (E6 semantics: a shared
      prefix is trained once). Nodes no full trajectory passes through (inside
      local suffixes) carry 0.
    * (C7) A_tok = Â_global(node) + lambda_loc·w_p·A_loc(y_j)·1{tok ∈ M_j}, with
      A_loc, w_p and M_j from ``caliper_groups``. Later steps of a suffix
      (descendants of a member) get no local credit.
    * (C8) If A_loc(y_0) < 0 and w_p >= w_min: y_0's local credit is multiplied
      by (1 + gamma) (``negative`` ``"scale"``/``"both"``), and/or its
      changed-region tokens get ``clip_low = eps_low + eps_neg``
      (``"clip"``/``"both"``; then ``Credit.clip_low`` (T,) is eps_low elsewhere;
      otherwise it is None).

    Returns ``Credit``: ``token`` (T,) as above, 0 on observation tokens;
    ``node`` (N,) (C9): the credit of the node's last action token, i.e.
    Â_global(node), plus lambda_loc·w_p·A_loc (with C8's factor) at a group
    member whose changed region M_j is not empty (M_j always runs to the end of
    the step, so it holds the last action token). A member whose step equals
    y_0's (empty M_j) carries no local credit on any token, so none in its node
    value either; a node without action tokens carries Â_global(node). The
    value does not depend on where in the step the resample diverged, and
    ranking audits that read node values see what the tokens are trained on.
    """
    full = full_trajectory_leaves(batch, params)
    adv = np.full(batch.n_nodes, np.nan)
    adv[full] = group_zscore(batch.reward[full], batch.node_tree[full], params.std,
                             params.eps, "zero")
    a_global = np.nan_to_num(trajectory_mean(batch, adv))  # (N,) 0 off full trajectories

    g = caliper_groups(batch, params)
    strengthen = g.is_y0 & (g.a_loc < 0) & (g.w >= params.w_min)  # (M,) C8 applies
    scale = np.where(strengthen & (params.negative in ("scale", "both")),
                     1.0 + params.gamma, 1.0)
    local_value = params.lambda_loc * g.w * g.a_loc * scale  # (M,)

    length = g.stop - g.start
    node = a_global.copy()
    node[g.member] += np.where(length > 0, local_value, 0.0)  # C9: as its last action token
    token = node_to_tokens(batch, a_global)
    region = _positions(batch.token_offsets[g.member] + g.start, length)  # (sum length,)
    token[region] += np.repeat(local_value, length)

    clip_low = None
    if params.negative in ("clip", "both"):
        clip_low = np.full(batch.n_tokens, params.eps_low)
        s = strengthen
        clip_low[_positions(batch.token_offsets[g.member[s]] + g.start[s], length[s])] = (
            params.eps_low + params.eps_neg)
    return Credit(node=node, token=token, clip_low=clip_low)
