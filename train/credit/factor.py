"""FACTOR: TD action credit and hindsight token allocation (docs/METHODS.md section 10).

arXiv:2608.07118 (official README). The estimator is pure: the teacher and student
log-probabilities of each action token come in as ``extras["hindsight_logprob"]`` and
``extras["student_logprob"]`` (T,), NaN where unscored; a scoring job computes them
(``train.scoring``, kinds ``hindsight`` and ``plain``) and the store keeps them.

Per node ``v`` of depth >= 1 (one action, taken in the state through its parent):

* F1: values ``Vt`` in advantage units: 0 at the root (the baseline) and at leaves
  (terminal); an inner node's value is its subtree's mean G1 advantage shrunk toward
  its parent's value with ``prior_weight`` pseudo-trajectories;
* F2: ``A*(v) = Vt(v) - Vt(parent) + 1{leaf} z_v``, which telescopes along every
  trajectory to its G1 advantage ``z_i`` (what ``grpo`` gives the leaf);
* F3-F5: token weights ``w_j = (1 - eta) + eta L softmax_j(sgn(A*) clip(Delta_j, -g, g)
  / tau)`` with ``Delta = teacher - student``; mean 1 over the action, all > 0, and the
  token advantage is ``w_j A*(v)``; ``eta`` is annealed over training steps
  (``eta_schedule``, the step recorded in the params) and the teacher reads the feedback
  in the context ``context`` names.

The root holds the prompt, not an action: node value 0 (its agent tokens, if any, 0).
Nodes with no rewarded trajectory below get NaN (stored as 0), like ``grpo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from train.credit.base import (
    HINDSIGHT_KINDS,
    PLAIN,
    Credit,
    GroupBy,
    Params,
    SingleGroup,
    StdNorm,
    TeacherContext,
    TreeArrays,
    depth_levels,
    register,
    subtree_sum,
)
from train.credit.groups import (
    check_choice,
    check_nonneg,
    group_zscore,
    leaf_groups,
    trajectory_leaves,
)

HINDSIGHT_LOGPROB: str = "hindsight_logprob"
"""(T,) extras input: log pi_T(a_j | s, feedback) per action token (F3 teacher), NaN unscored."""
STUDENT_LOGPROB: str = "student_logprob"
"""(T,) extras input: log pi(a_j | s) per action token (the student of F3 and Q3)."""
EtaSchedule = Literal["linear", "constant"]
"""F5's eta over training steps: ``linear`` (the paper's annealing) or ``constant``."""


@dataclass(frozen=True)
class FactorParams(Params):
    """Hyperparameters of ``factor`` (F1-F5); F4/F5 defaults are the paper's."""

    token_scorer: ClassVar[str | None] = "teacher"
    step_field: ClassVar[str | None] = "step"
    min_scored_tokens: ClassVar[int] = 2

    std: StdNorm = "unbiased"
    """F_norm of the trajectory advantage z_i (G1); ``"none"`` is the paper's G_i - b_i."""
    eps: float = 1e-6
    """epsilon of G1."""
    single: SingleGroup = "zero"
    """A group of one trajectory (G1): 0, or its raw score."""
    group: GroupBy = "tree"
    """The G1 group: the trajectories of one tree, or of all trees of one task."""
    prior_weight: float = 1.0
    """F1 kappa: pseudo-trajectories of the parent's value in a node's value (0: the pure
    Monte Carlo mean of its subtree)."""
    eta: float = 0.7
    """F5 eta at training step 0: the share of each action's credit allocated by the
    likelihood gap (0: uniform, no scores needed)."""
    eta_schedule: EtaSchedule = "linear"
    """F5: ``linear``, the paper's annealing ``eta_k = eta max(1 - k / eta_steps, 0)``
    at training step ``k = step``; ``constant``: ``eta`` at every step (the issue-24
    runs)."""
    eta_steps: int = 50
    """F5: the step at which the linear schedule reaches 0 (the paper's 50)."""
    step: int = 0
    """F5: the training step k of the weights that sampled the trees (the trainer sets it
    to the iteration, so the committed params name the eta used)."""
    context: TeacherContext = "turn"
    """F3: how the teacher sees the feedback: ``turn``, as the next observation turn in the
    policy's own chat format (score kind ``hindsight_turn``), or ``template``, appended to
    the last context turn after ``[feedback of your next step]`` (kind ``hindsight``, the
    issue-24 runs)."""
    gap_clip: float = 3.0
    """F4: |Delta| is clipped to this."""
    tau: float = 1.0
    """F5: softmax temperature."""
    teacher: str | None = None
    """The policy whose stored scores (``policy_scores`` kinds ``hindsight`` and ``plain``)
    give the F3 log-probabilities. ``rtrees credit --param teacher=SPEC`` loads SPEC, scores
    what is missing and records its version here; None: each tree's own
    ``policy_version`` (the weights that sampled it, as the trainer scores)."""

    def __post_init__(self) -> None:
        check_choice("factor", "std", self.std, StdNorm)
        check_choice("factor", "single", self.single, SingleGroup)
        check_choice("factor", "group", self.group, GroupBy)
        check_nonneg("factor", eps=self.eps, prior_weight=self.prior_weight,
                     gap_clip=self.gap_clip)
        check_choice("factor", "eta_schedule", self.eta_schedule, EtaSchedule)
        check_choice("factor", "context", self.context, TeacherContext)
        if self.eta_steps < 1 or self.step < 0:
            raise ValueError(f"factor: eta_steps must be >= 1 and step >= 0, got "
                             f"{self.eta_steps!r} and {self.step!r}")
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"factor: eta is a share in [0, 1], got {self.eta!r}")
        if not (np.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"factor: tau must be > 0, got {self.tau!r}")

    def spans_trees(self) -> bool:
        return self.group == "task"

    @property
    def eta_now(self) -> float:
        """F5: eta at training step ``step`` under ``eta_schedule``."""
        if self.eta_schedule == "constant":
            return self.eta
        return self.eta * max(1.0 - self.step / self.eta_steps, 0.0)

    def token_score_kinds(self) -> dict[str, str]:
        """F3: the teacher's hindsight log-probabilities (the kind of ``context``) and the
        student's plain ones; none where ``eta_now`` is 0."""
        if self.eta_now <= 0:
            return {}
        return {HINDSIGHT_LOGPROB: HINDSIGHT_KINDS[self.context], STUDENT_LOGPROB: PLAIN}


# ----------------------------------------------------------------- pure helpers
def state_values(batch: TreeArrays, z: np.ndarray, prior_weight: float) -> np.ndarray:
    """F1: (N,) Vt of every node from the leaf advantages ``z`` (N,) (finite at trajectory
    leaves, read there only).

    Top-down, one level at a time: Vt(root) = 0, Vt(leaf) = 0, and an inner node gets
    ``(S_v + kappa Vt(parent)) / (n_v + kappa)`` with S_v, n_v the sum and count of z
    over its trajectories; with no trajectory below it takes its parent's value.
    """
    leaf = trajectory_leaves(batch) & np.isfinite(z)
    n = subtree_sum(batch, leaf.astype(np.float64))
    s = subtree_sum(batch, np.where(leaf, z, 0.0))
    value = np.zeros(batch.n_nodes)
    for rows in depth_levels(batch)[1:]:
        par = value[batch.parent[rows]]
        with np.errstate(invalid="ignore", divide="ignore"):
            v = (s[rows] + prior_weight * par) / (n[rows] + prior_weight)
        value[rows] = np.where(n[rows] > 0, v, par)
    return np.where(batch.is_leaf, 0.0, value)


def td_credit(batch: TreeArrays, params: FactorParams) -> np.ndarray:
    """F1-F2: (N,) ``A*(v)`` of every node (0 at the root, NaN without a trajectory below)."""
    leaf = trajectory_leaves(batch)
    z = np.full(batch.n_nodes, np.nan)
    z[leaf] = group_zscore(batch.reward[leaf], leaf_groups(batch, leaf, params.group),
                           params.std, params.eps, params.single)
    value = state_values(batch, z, params.prior_weight)
    has = subtree_sum(batch, leaf.astype(np.float64)) > 0
    parent_value = np.where(batch.parent >= 0, value[np.maximum(batch.parent, 0)], 0.0)
    credit = value - parent_value + np.where(leaf, z, 0.0)
    credit = np.where(has, credit, np.nan)
    return np.where(batch.parent >= 0, credit, 0.0)


def allocation_weights(node_of: np.ndarray, gap: np.ndarray, sign: np.ndarray, n_nodes: int,
                       eta: float, gap_clip: float, tau: float) -> np.ndarray:
    """F4-F5: (K,) weight w_j = L rho_j of K action tokens.

    ``node_of`` (K,) the node of each token, ``gap`` (K,) Delta (finite), ``sign`` (N,)
    sgn(A*) per node. ``w = (1 - eta) + eta L softmax_j(s / tau)`` within each node, so
    the mean over a node's tokens is 1 and every weight is > 0 (>= 1 - eta).
    """
    s = sign[node_of] * np.clip(gap, -gap_clip, gap_clip) / tau  # (K,)
    top = np.full(n_nodes, -np.inf)
    np.maximum.at(top, node_of, s)
    e = np.exp(s - top[node_of])
    total = np.bincount(node_of, weights=e, minlength=n_nodes)
    length = np.bincount(node_of, minlength=n_nodes).astype(np.float64)
    return (1.0 - eta) + eta * length[node_of] * e / total[node_of]


def token_gap(batch: TreeArrays, teacher_key: str, student_key: str) -> np.ndarray:
    """(K,) teacher - student log-prob of each agent token (0 where either is NaN)."""
    for key in (teacher_key, student_key):
        if key not in batch.extras:
            raise KeyError(key)
        if np.shape(batch.extras[key]) != (batch.n_tokens,):
            raise ValueError(f"extras[{key!r}] must be shaped (T,) = ({batch.n_tokens},), "
                             f"got {np.shape(batch.extras[key])}")
    teacher = np.asarray(batch.extras[teacher_key], np.float64)[batch.agent_mask]
    student = np.asarray(batch.extras[student_key], np.float64)[batch.agent_mask]
    gap = teacher - student
    return np.where(np.isfinite(gap), gap, 0.0)


@register("factor", FactorParams)
def factor(batch: TreeArrays, params: FactorParams) -> Credit:
    """FACTOR credit (F1-F5) for every node and agent token of ``batch``.

    Inputs: leaf rewards; with ``eta_now > 0`` ``extras["hindsight_logprob"]`` and
    ``extras["student_logprob"]`` (T,) (NaN where a node is unscored: uniform there).
    Returns ``Credit.node`` (N,) = A*(v) (F2) and ``Credit.token`` (T,) = w_j A*(v) on
    agent tokens (F5; mean over a node's agent tokens = its node value), 0 elsewhere.
    """
    node = td_credit(batch, params)
    node_of = batch.token_node[batch.agent_mask]  # (K,)
    a = np.nan_to_num(node)
    eta = params.eta_now
    if eta > 0.0:
        gap = token_gap(batch, HINDSIGHT_LOGPROB, STUDENT_LOGPROB)
        w = allocation_weights(node_of, gap, np.sign(a), batch.n_nodes, eta,
                               params.gap_clip, params.tau)
    else:
        w = np.ones(node_of.size)
    token = np.zeros(batch.n_tokens)
    token[batch.agent_mask] = w * a[node_of]
    return Credit(node=node, token=token)
