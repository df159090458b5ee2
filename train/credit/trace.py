"""TRACE: turn-level TD credit from a frozen reference model's gold-answer log-probability.

METHODS.md section 6 (T1-T7), arXiv:2607.13988. The estimator is pure: the
reference model's scores come in as ``extras["trace_ref_logprob"]`` (N,), the
mean per-token log-probability of the gold answer y* given the transcript
through each node (T2, see ``mean_gold_logprob``); computing them needs a
policy and is a separate step.

Tree reading (our choices, tagged [R] in METHODS' sense):

* The root holds S_0, the prompt. A non-root node at depth ``d`` holds one agent
  action and the tool observation it got, so the transcript through it is
  S_d (T1). Its action is TRACE's turn ``k = d - 1`` (0-based), the action taken
  in S_{d-1}; the node carries delta_{d-1}, c_{d-1} and r_{d-1}.
* **Answer tail** [R]: a non-root leaf *without observation tokens* is the
  final answer (our environments answer ``<answer>`` with an empty
  observation, METHODS T7). It has no S after it, so it is not a TD turn; its
  ``trace_ref_logprob`` is ignored (may be NaN) and its tokens get only
  ``alpha_out * A_out``. A leaf *with* an observation (e.g. a run cut at the
  step limit after a tool call) is a TD turn and its observation is S_T.
* A trajectory is a root-to-leaf path; T = its number of TD turns (the leaf's
  depth, minus one for an answer tail).
* **Shared prefixes** [R]: a node on several trajectories gets the mean over
  those trajectories of the per-trajectory token advantage of T7. delta (T4)
  depends only on the node and its parent, but c_k (T5) and the terminal
  bonus (T6) depend on the trajectory once the window reaches its end. Every
  trajectory through a node has the same weight, as in ELPO's E6.
* The root (the prompt, no TD turn) gets ``alpha_out`` times the mean A_out
  of the trajectories below it; it normally has no agent tokens anyway.
* A_out (T7) is the z-score of the leaf reward within its group (``group``:
  the tree's trajectories, or all trajectories of the trees of one task),
  with the population std (METHODS G1, eps 1e-6; a constant group gives 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from train.credit.base import (
    GOLD,
    Credit,
    GroupBy,
    Params,
    TreeArrays,
    node_to_tokens,
    register,
    segment_stats,
    subtree_sum,
)

REF_LOGPROB: str = "trace_ref_logprob"
"""Name of the (N,) extras input: mean gold-answer log-prob at each node (T2)."""


@dataclass(frozen=True)
class TraceParams(Params):
    """Hyperparameters of TRACE (T3-T7); defaults are the paper's training values."""

    node_scores: ClassVar[tuple[str, str] | None] = ("ref", GOLD)

    eps: float = 0.1
    """T3: d_k = -lbar_k + eps. epsilon_train = 0.1; the paper's worked example uses 1e-3."""
    gamma: float = 0.8
    """T5/T6: discount inside the window and of the terminal outcome term."""
    horizon: int = 3
    """T5: K, the window length; h_k = min(k + K - 1, T - 1)."""
    out_scale: float = 2.0
    """T6: scale of the outcome term added when the window reaches the last turn."""
    alpha_out: float = 1.0
    """T7: weight of the outcome advantage A_out on every agent token."""
    alpha_turn: float = 0.2
    """T7: weight of the turn credit r_k on the tokens of turn k."""
    norm_eps: float = 1e-6
    """G1: epsilon added to the population std of A_out's z-score."""
    group: GroupBy = "tree"
    """A_out's group: the tree's trajectories ("tree") or all trees of a task ("task")."""
    ref: str | None = None
    """The frozen reference policy of T2 whose stored scores (``policy_scores``, kind
    ``gold_answer``) give ``extras["trace_ref_logprob"]``. ``rtrees credit --param
    ref=SPEC`` loads SPEC, scores what is missing and records the policy's *version*
    here (so the params hash names the weights); None: the caller passes the extras."""

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0 so that d_k = -lbar_k + eps > 0, got {self.eps}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma is a discount in [0, 1], got {self.gamma}")
        if self.horizon < 1:
            raise ValueError(f"horizon K must be >= 1 (the window holds turn k), "
                             f"got {self.horizon}")
        if self.norm_eps < 0:
            raise ValueError(f"norm_eps must be >= 0, got {self.norm_eps}")
        if self.group not in ("tree", "task"):
            raise ValueError(f"group must be 'tree' or 'task', got {self.group!r}")

    def spans_trees(self) -> bool:
        return self.group == "task"


# ----------------------------------------------------------------- pure helpers
def mean_gold_logprob(token_logprob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """T2: lbar_k = (1/|y*|) sum_j log pi_ref(y*_j | S_k, y*_<j), for S scored states.

    ``token_logprob`` (M,) holds the teacher-forced per-token log-probs of the
    gold answer, state after state; state ``k`` owns ``offsets[k]:offsets[k+1]``
    (``offsets`` (S + 1,), starting at 0). Returns (S,). Every state must score
    at least one token.
    """
    bounds: np.ndarray = np.asarray(offsets, np.int64)
    lengths = bounds[1:] - bounds[:-1]  # (S,)
    if (lengths <= 0).any():
        raise ValueError("every state needs at least one gold-answer token")
    owner = np.repeat(np.arange(lengths.size), lengths)
    total = np.bincount(owner, weights=np.asarray(token_logprob, np.float64),
                        minlength=lengths.size)
    return total / lengths


def answer_tail(batch: TreeArrays) -> np.ndarray:
    """(N,) bool: non-root leaves with no observation tokens (the final answer, no TD turn)."""
    obs_len = np.bincount(batch.token_node[~batch.agent_mask], minlength=batch.n_nodes)
    return batch.is_leaf & (batch.parent >= 0) & (obs_len == 0)


def td_deltas(batch: TreeArrays, eps: float) -> np.ndarray:
    """T3-T4: (N,) delta of the turn each node holds; 0 at the root and answer tails.

    d_k = -lbar_k + eps and V_k = log(d_0 / d_k) (T3), so
    delta_k = V_{k+1} - V_k = log(d_k / d_{k+1}) (T4): a node's delta is
    ``log(d[parent] / d[node])``. Summed along a trajectory it telescopes to
    V_T - V_0 = log(d_0 / d_T). Reads ``extras["trace_ref_logprob"]`` (N,).
    """
    if REF_LOGPROB not in batch.extras:
        raise KeyError(f"trace needs extras[{REF_LOGPROB!r}] (N,): the mean gold-answer "
                       "log-prob given the transcript through each node (T2)")
    lbar = np.asarray(batch.extras[REF_LOGPROB], np.float64)
    if lbar.shape != (batch.n_nodes,):
        raise ValueError(f"extras[{REF_LOGPROB!r}] must be shaped (N,) = ({batch.n_nodes},), "
                         f"got {lbar.shape}")
    state = ~answer_tail(batch)  # nodes whose transcript is a TD state S_k
    d = -lbar + eps  # (N,) T3
    bad = state & ~(np.isfinite(d) & (d > 0))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"tree {batch.tree_ids[batch.node_tree[row]]!r}, node {batch.node_ids[row]}: "
            f"d = -lbar + eps must be finite and > 0 (lbar = {lbar[row]!r}, eps = {eps})")
    turn = state & (batch.parent >= 0)
    delta = np.zeros(batch.n_nodes)
    delta[turn] = np.log(d[batch.parent[turn]] / d[turn])
    return delta


def _outcome_zscore(batch: TreeArrays, leaves: np.ndarray, params: TraceParams) -> np.ndarray:
    """T7 / G1: (L,) A_out of each leaf, z-scored in its group with the population std."""
    reward = batch.reward[leaves]
    if not np.isfinite(reward).all():
        row = int(leaves[~np.isfinite(reward)][0])
        raise ValueError(f"tree {batch.tree_ids[batch.node_tree[row]]!r}, node "
                         f"{batch.node_ids[row]}: leaf reward must be finite")
    tree = batch.node_tree[leaves]
    group = tree if params.group == "tree" else batch.task[tree]
    n_groups = int(group.max(initial=-1)) + 1
    _, mean, std = segment_stats(reward, group, n_groups, ddof=0)
    lo = np.full(n_groups, np.inf)
    hi = np.full(n_groups, -np.inf)
    np.minimum.at(lo, group, reward)
    np.maximum.at(hi, group, reward)
    z = (reward - mean[group]) / (std[group] + params.norm_eps)
    return np.where(lo[group] == hi[group], 0.0, z)  # G1: a constant group gives 0


def _mean_turn_credit(batch: TreeArrays, delta: np.ndarray, turn: np.ndarray,
                      tail: np.ndarray, leaves: np.ndarray, a_out: np.ndarray,
                      n_traj: np.ndarray, params: TraceParams) -> np.ndarray:
    """T5-T6: (N,) mean over the trajectories through each TD-turn node of r_k; 0 elsewhere.

    For trajectory i through node v (depth d, turn k = d - 1, T_i turns), the
    window covers v and the next ``m = min(K - 1, T_i - d)`` nodes on i's path:
    c = sum_{j<=m} gamma^j delta(w_j) / sum_{j<=m} gamma^j, and the terminal term
    out_scale * gamma^(T_i - k) * A_out,i joins when h_k = T_i - 1, i.e.
    T_i - d <= K - 1 (T6). Without materialising (trajectory, node) pairs:

    * "near" pairs (T_i - d <= K - 1) are visited by walking up to K levels from
      each trajectory's last turn, accumulating the window sum by Horner's rule
      (num <- delta(v) + gamma * num);
    * the other pairs have a full window; summed over all trajectories through
      v, the full-window numerators equal F(v) = sum_{j<K} gamma^j sum over the
      descendants w of v j levels down of delta(w) * n_traj(w), minus the near
      pairs' (truncated) numerators.

    Costs O((N + L) * min(K, max depth)) time and O(N + L) memory.
    """
    n, gamma, big_k = batch.n_nodes, params.gamma, params.horizon
    parent = batch.parent
    kc = min(big_k, int(batch.depth.max(initial=0)))  # longer windows never fit a tree
    z_part = np.cumsum(gamma ** np.arange(kc, dtype=np.float64))  # (kc,) sum_{j<=s} gamma^j
    z_full = float(big_k) if gamma == 1.0 else (1.0 - gamma**big_k) / (1.0 - gamma)

    r_sum = np.zeros(n)  # (N,) sum over trajectories through the node of r_k
    near_num = np.zeros(n)  # (N,) sum of the near pairs' window numerators
    cur = np.where(tail[leaves], parent[leaves], leaves)  # (L,) each trajectory's last turn
    num = np.zeros(leaves.size)
    alive = turn[cur]
    for s in range(kc):  # s = T_i - d: height above the last turn
        idx = cur[alive]
        num[alive] = delta[idx] + gamma * num[alive]
        c = num[alive] / z_part[s]
        bonus = params.out_scale * gamma ** (s + 1) * a_out[alive]  # T6, T - k = s + 1
        r_sum += np.bincount(idx, weights=c + bonus, minlength=n)
        near_num += np.bincount(idx, weights=num[alive], minlength=n)
        cur = np.where(alive, parent[cur], cur)
        alive &= turn[cur]

    far = np.zeros(n)  # F(v)
    x = delta * n_traj  # (N,) 0 off turn nodes
    anc = np.arange(n)
    ok = turn.copy()
    for j in range(kc):
        far += gamma**j * np.bincount(anc[ok], weights=x[ok], minlength=n)
        anc = np.where(ok, parent[anc], anc)
        ok &= turn[anc]
    r_sum += (far - near_num) / z_full
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(turn, r_sum / n_traj, 0.0)


@register("trace", TraceParams)
def trace(batch: TreeArrays, params: TraceParams) -> Credit:
    """TRACE turn-level credit (T1-T7) for every node and agent token of ``batch``.

    Input: ``extras["trace_ref_logprob"]`` (N,) = lbar at each node (root: S_0;
    ignored at answer tails); leaf rewards. Returns ``Credit.node`` (N,): the
    mean over the trajectories through the node of
    A_tok = alpha_out * A_out + alpha_turn * r_turn (T7; r = 0 at the root and
    answer tails), and ``Credit.token`` (T,): the node value on its agent tokens,
    0 on observation tokens.
    """
    tail = answer_tail(batch)
    delta = td_deltas(batch, params.eps)
    turn = (batch.parent >= 0) & ~tail
    leaves = np.flatnonzero(batch.is_leaf)
    a_out = _outcome_zscore(batch, leaves, params)  # (L,)
    leaf_ind = np.zeros(batch.n_nodes)
    leaf_ind[leaves] = 1.0
    n_traj = subtree_sum(batch, leaf_ind)  # (N,) trajectories through each node, >= 1
    a_leaf = np.zeros(batch.n_nodes)
    a_leaf[leaves] = a_out
    a_mean = subtree_sum(batch, a_leaf) / n_traj  # (N,) mean A_out through the node
    r_mean = _mean_turn_credit(batch, delta, turn, tail, leaves, a_out, n_traj, params)
    node = params.alpha_out * a_mean + params.alpha_turn * r_mean
    return Credit(node=node, token=node_to_tokens(batch, node))
