"""DSC-Gate: first-order anchored transport of historical action credit (D3-D5).

METHODS.md section 5, arXiv:2609.29007 ("When Does Action Credit Need
Updating?"). The gate that chooses reuse / transport / refresh (D7-D10) is in
``train.credit.dsc_gate``.

Tree reading:

* The root is the fixed context. Its children are the forced root actions
  (a, b, ...). Each leaf below a root action is one old trajectory, sampled
  under the behaviour (old) policy mu after that forced action, with return R
  (in {0, 1} in the paper; any finite float works).
* The downstream steps t of trajectory i are the nodes of depth >= 2 on its
  path: the forced root action is excluded (D3).
* ``extras["dsc_ratio"]`` (N,) = pi(A_t | S_t, h_t) / mu(A_t | S_t, h_t) for the
  action each depth >= 2 node took (target over behaviour policy); ignored at
  depths 0 and 1 (may be NaN there).
* ``extras["dsc_state"]`` (N,) integer id of (S_t, h_t) at each depth >= 2 node
  (the state the action was taken in, with its remaining horizon); ids are
  scoped to the tree (two trees never share a baseline). Ignored at depths 0-1.

Anchors (D4 at any branching node): ``transport_returns(batch, anchor)`` and
``dsc_gate.dsc_gate(..., anchor)`` take, per tree, the row of the node whose
comparison is resolved; the reading above then holds for that node's subtree
(``anchored``): its children are the forced actions, the downstream steps the nodes
two or more levels below it, the trajectories the leaves below it. The default
anchor is the root (the ``dsc`` estimator's reading).

Cross-fitted baseline b_t (D4) [R]: the trajectories of a tree are split by
the *preorder rank of their leaf within the tree* (children by ascending node
id), rank 0, 2, 4, ... into fold 0 and 1, 3, 5, ... into fold 1. For a
trajectory of fold f, b_t = b^{1-f}(S_t, h_t): the mean return over the visits
of fold 1-f trajectories to that state, counting a visit once per
(trajectory, step) (a shared prefix node is a visit of every trajectory
through it), pooled over the tree's root actions (b is a function of the
state, not of the root action). Under mu the old trajectories are already
old-policy weighted, so it is a plain mean. Where fold 1-f never visits the
state, b falls back to fold 1-f's mean return in the tree, and to 0 when
fold 1-f is empty (a tree with one trajectory). Since E_mu[z_t | S_t, h_t] = 0
and b_t never uses trajectory i itself, the z_t * b_t term has mean zero: the
baseline changes the variance of T_i, not its expectation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from train.credit.base import (
    ACTION,
    Credit,
    Params,
    TreeArrays,
    node_to_tokens,
    path_sum,
    register,
    segment_stats,
    subtree_sum,
)
from train.credit.groups import root_child

DSCMode = Literal["transport", "reuse"]
"""Which historical credit: the first-order transported means (D4-D5) or plain means (c_R)."""

RATIO: str = "dsc_ratio"
"""(N,) extras input: pi/mu ratio of the action taken at each depth >= 2 node (D3)."""
STATE: str = "dsc_state"
"""(N,) extras input: integer id of the state (S_t, h_t) of each depth >= 2 node (D4)."""


@dataclass(frozen=True)
class DSCParams(Params):
    """Hyperparameters of DSC credit (D4-D5)."""

    node_scores: ClassVar[tuple[str, str] | None] = ("target", ACTION)
    trainer_refusal: ClassVar[str | None] = (
        "needs stored ratios and states: use --reuse dsc to gate stored trees")

    mode: DSCMode = "transport"
    """"transport": Q_T(a) = mean_i T_i(a) (D5); "reuse": Q_R(a) = mean_i R_i (c_R)."""
    target: str | None = None
    """The target policy pi of D3 whose stored scores (``policy_scores``, kind ``action``)
    give ``extras["dsc_ratio"]`` / ``["dsc_state"]``. ``rtrees credit --param
    target=SPEC`` loads SPEC, scores what is missing and records the policy's *version*
    here; None: the caller passes the extras."""

    def __post_init__(self) -> None:
        if self.mode not in ("transport", "reuse"):
            raise ValueError(f"mode must be 'transport' or 'reuse', got {self.mode!r}")


@dataclass(frozen=True)
class Transported:
    """Per-trajectory returns of a batch, L = trajectories (leaves of depth >= 1).

    ``leaf`` (L,) row of the leaf; ``action`` (L,) row of its forced root action;
    ``tree`` (L,) tree index; ``fold`` (L,) cross-fitting fold (0 / 1);
    ``reward`` (L,) R_i; ``transported`` (L,) T_i of D4.
    """

    leaf: np.ndarray
    action: np.ndarray
    tree: np.ndarray
    fold: np.ndarray
    reward: np.ndarray
    transported: np.ndarray


# ----------------------------------------------------------------- tree helpers
def root_action(batch: TreeArrays) -> np.ndarray:
    """(N,) row of each node's forced root action (its depth-1 ancestor); -1 at roots."""
    return root_child(batch)


def leaf_folds(batch: TreeArrays, leaves: np.ndarray) -> np.ndarray:
    """(L,) cross-fitting fold of ``leaves`` (sorted rows): preorder rank in its tree mod 2."""
    tree = batch.node_tree[leaves]
    first = np.searchsorted(tree, tree, side="left")  # rows are sorted by tree
    return (np.arange(leaves.size) - first) % 2


def _node_extra(batch: TreeArrays, name: str, meaning: str) -> np.ndarray:
    if name not in batch.extras:
        raise KeyError(f"dsc needs extras[{name!r}] (N,): {meaning}")
    values = np.asarray(batch.extras[name])
    if values.shape != (batch.n_nodes,):
        raise ValueError(f"extras[{name!r}] must be shaped (N,) = ({batch.n_nodes},), "
                         f"got {values.shape}")
    return values


def _where(batch: TreeArrays, row: int) -> str:
    return f"tree {batch.tree_ids[batch.node_tree[row]]!r}, node {batch.node_ids[row]}"


# ----------------------------------------------------------------- anchors
def anchored(batch: TreeArrays, anchor: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scope of each tree's comparison anchor (D4 at a branching node).

    ``anchor`` (B,) the row of each tree's anchor node (None: every tree's root). A node
    is in scope when it lies in its tree's anchor subtree (rows ``[a, a +
    subtree_size[a])`` in preorder). Returns ``scope`` (N,) bool, ``rel`` (N,) depth
    below the anchor (-1 out of scope) and ``action`` (N,) row of each scoped node's
    forced action (its ancestor one level below the anchor; -1 at the anchor and out of
    scope). With the root as anchor these are every node, ``depth`` and ``root_action``.
    """
    if anchor is None:
        return np.ones(batch.n_nodes, bool), batch.depth.copy(), root_action(batch)
    anchor = np.asarray(anchor, np.int64)
    if anchor.shape != (batch.n_trees,):
        raise ValueError(f"anchor must be shaped (B,) = ({batch.n_trees},), got {anchor.shape}")
    if ((anchor < 0) | (anchor >= batch.n_nodes)).any() or (
            batch.node_tree[np.clip(anchor, 0, max(batch.n_nodes - 1, 0))]
            != np.arange(batch.n_trees)).any():
        raise ValueError("anchor[b] must be a row of tree b")
    rows = np.arange(batch.n_nodes)
    a = anchor[batch.node_tree]
    scope = (rows >= a) & (rows < a + batch.subtree_size[a])
    rel = np.where(scope, batch.depth - batch.depth[a], -1)
    marker = np.where(scope & (rel <= 1), rows, -1)
    last = np.maximum.accumulate(marker) if batch.n_nodes else marker
    return scope, rel, np.where(scope & (rel >= 1), last, -1)


# ----------------------------------------------------------------- D3-D4
def transport_returns(batch: TreeArrays, anchor: np.ndarray | None = None) -> Transported:
    """D3-D4: T_i(a) = R_i + sum_t z_it [R_i - b_t(S_it, h_it)] for every old trajectory.

    ``anchor`` (B,) row of each tree's comparison node (None: the roots). The
    trajectories are the leaves below the anchor, a = their ancestor one level below it
    (the forced action of that comparison), and the downstream steps t the nodes two or
    more levels below the anchor (D3: the forced action excluded); folds and baselines
    use those trajectories only. z_t = ratio_t - 1 (D3), first order: no products of
    ratios. b_t is the cross-fitted state-time baseline (module docstring). With pi = mu
    every z is 0 and T_i = R_i exactly.
    Shapes: reads extras (N,); returns ``Transported`` with (L,) arrays.
    """
    n = batch.n_nodes
    _, depth, act = anchored(batch, anchor)
    ratio = _node_extra(batch, RATIO, "pi/mu ratio of each depth >= 2 node's action (D3)")
    state = _node_extra(batch, STATE, "integer state id (S_t, h_t) of each depth >= 2 node")
    steps = np.flatnonzero(depth >= 2)  # (S,) downstream steps
    ratio_s = np.asarray(ratio[steps], np.float64)
    bad = ~(np.isfinite(ratio_s) & (ratio_s >= 0))
    if bad.any():
        row = int(steps[bad][0])
        raise ValueError(f"{_where(batch, row)}: {RATIO} must be finite and >= 0, "
                         f"got {ratio[row]!r}")
    z = np.zeros(n)
    z[steps] = ratio_s - 1.0  # D3

    leaves = np.flatnonzero(batch.is_leaf & (depth >= 1))  # (L,) trajectories
    reward = batch.reward[leaves]
    if not np.isfinite(reward).all():
        row = int(leaves[~np.isfinite(reward)][0])
        raise ValueError(f"{_where(batch, row)}: leaf reward must be finite")
    fold = leaf_folds(batch, leaves)
    tree = batch.node_tree[leaves]

    # b^f(tree, state): mean return over fold-f visits; visits of a node = its fold-f leaves.
    # One int64 key per (tree, state): a 1-d unique is far faster than unique(axis=0).
    state_s = np.asarray(state[steps]).astype(np.int64)
    low = int(state_s.min(initial=0))
    span = int(state_s.max(initial=0)) - low + 1
    _, key = np.unique(batch.node_tree[steps] * span + (state_s - low), return_inverse=True)
    key = key.ravel()
    n_keys = int(key.max(initial=-1)) + 1
    baseline = []  # baseline[f] (N,): b^f at the step nodes, 0 elsewhere
    for f in (0, 1):
        in_fold = (fold == f).astype(np.float64)
        r_f = np.zeros(n)
        c_f = np.zeros(n)
        r_f[leaves] = reward * in_fold
        c_f[leaves] = in_fold
        visits = np.bincount(key, weights=subtree_sum(batch, c_f)[steps], minlength=n_keys)
        total = np.bincount(key, weights=subtree_sum(batch, r_f)[steps], minlength=n_keys)
        cnt_t = np.bincount(tree, weights=in_fold, minlength=batch.n_trees)
        sum_t = np.bincount(tree, weights=reward * in_fold, minlength=batch.n_trees)
        fallback = np.divide(sum_t, cnt_t, out=np.zeros(batch.n_trees), where=cnt_t > 0)
        b = np.zeros(n)
        b[steps] = np.where(visits[key] > 0, total[key] / np.maximum(visits[key], 1.0),
                            fallback[batch.node_tree[steps]])
        baseline.append(b)

    z_sum = path_sum(batch, z)[leaves]  # sum_t z_it
    zb = [path_sum(batch, z * b)[leaves] for b in baseline]  # sum_t z_it b^f_t
    zb_other = np.where(fold == 0, zb[1], zb[0])  # cross-fitting: the opposite fold's b
    transported = reward + reward * z_sum - zb_other  # D4
    return Transported(leaf=leaves, action=act[leaves], tree=tree, fold=fold,
                       reward=reward, transported=transported)


# ----------------------------------------------------------------- D5 credit
@register("dsc", DSCParams)
def dsc(batch: TreeArrays, params: DSCParams) -> Credit:
    """DSC credit of every node and agent token (D4-D5).

    ``Credit.node`` (N,): at a leaf its T_i (R_i when ``mode="reuse"``); at a
    forced root action a, Q_T(a) = mean_i T_i(a) (D5; Q_R(a) for reuse); at a
    deeper inner node the mean over the trajectories below it [R]; at the
    root the unweighted mean over its root actions of Q (the advantages'
    baseline) [R], NaN for a tree without root actions.
    ``Credit.token`` (T,) [R]: every agent token of a node below root action a
    gets Q(a) - mean_{a'} Q(a'), the mean taken over the tree's root actions,
    each counted once; root and observation tokens get 0.
    """
    tr = transport_returns(batch)
    n = batch.n_nodes
    value = np.zeros(n)
    count = np.zeros(n)
    value[tr.leaf] = tr.transported if params.mode == "transport" else tr.reward
    count[tr.leaf] = 1.0
    total = subtree_sum(batch, value)
    trajs = subtree_sum(batch, count)
    node = np.divide(total, trajs, out=np.full(n, np.nan), where=trajs > 0)

    actions = np.flatnonzero(batch.depth == 1)
    _, q_mean, _ = segment_stats(node[actions], batch.node_tree[actions], batch.n_trees)
    roots = batch.roots()
    node[roots] = q_mean[batch.node_tree[roots]]  # NaN where a tree has no root action
    act = root_action(batch)
    has = act >= 0
    adv = np.zeros(n)
    adv[has] = node[act[has]] - q_mean[batch.node_tree[has]]
    return Credit(node=node, token=node_to_tokens(batch, adv))
