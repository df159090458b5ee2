"""SGCD: sibling-guided credit distillation (docs/METHODS.md section 11, Q1-Q5).

arXiv:2606.12634 (abstract only; the rest is our reconstruction, tagged [R] there).
The estimator is pure: the teacher (the policy with the contrast reference of Q2 in its
prompt) and student log-probabilities of each action token come in as
``extras["contrast_logprob"]`` and ``extras["student_logprob"]`` (T,), NaN where
unscored (a tree without both outcomes has no reference); a scoring job computes them
(``train.scoring``, kinds ``contrast:<summariser>`` and ``plain``).

Q4: ``A`` is the GRPO node credit (G1 with node means), ``d_t = teacher - student`` per
agent token, ``w_t = clip(1 + kappa sgn(A) d_t, 1 - c, 1 + c)`` and the token advantage
is ``w_t A`` (``w`` a constant: no gradient flows through the teacher). The training
sequence is the sampled transcript; the reference never enters it (Q5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from train.credit.base import (
    PLAIN,
    Credit,
    GroupBy,
    Params,
    SingleGroup,
    StdNorm,
    TreeArrays,
    register,
)
from train.credit.factor import STUDENT_LOGPROB, token_gap
from train.credit.groups import check_choice, check_nonneg, trajectory_credit

CONTRAST_LOGPROB: str = "contrast_logprob"
"""(T,) extras input: log pi_T(o_t | reference, o_<t) per action token (Q3), NaN unscored."""


@dataclass(frozen=True)
class SgcdParams(Params):
    """Hyperparameters of ``sgcd`` (Q2-Q4; all [R] beyond the abstract)."""

    token_scorer: ClassVar[str | None] = "teacher"

    std: StdNorm = "unbiased"
    """F_norm of the GRPO advantage (G1)."""
    eps: float = 1e-6
    """epsilon of G1."""
    single: SingleGroup = "zero"
    """A group of one trajectory (G1): 0, or its raw score."""
    group: GroupBy = "tree"
    """The G1 group: the trajectories of one tree, or of all trees of one task."""
    kappa: float = 1.0
    """Q4: scale of the divergence d_t in the weight (0: plain GRPO, no scores needed)."""
    c: float = 0.5
    """Q4: weights are bounded to [1 - c, 1 + c]; 0 <= c < 1 so no sign flips."""
    summariser: str = "template"
    """Q2: ``template`` (deterministic stand-in for the paper's LLM summary) or
    ``hf:PATH`` (a local chat model); names the ``policy_scores`` kind
    ``contrast:<summariser>`` the teacher scores are read from."""
    teacher: str | None = None
    """The policy whose stored scores give the Q3 log-probabilities; ``rtrees credit
    --param teacher=SPEC`` scores with SPEC and records its version; None: each tree's own
    ``policy_version`` (the weights that sampled it, as the trainer scores)."""

    def __post_init__(self) -> None:
        check_choice("sgcd", "std", self.std, StdNorm)
        check_choice("sgcd", "single", self.single, SingleGroup)
        check_choice("sgcd", "group", self.group, GroupBy)
        check_nonneg("sgcd", eps=self.eps, kappa=self.kappa)
        if not 0.0 <= self.c < 1.0:
            raise ValueError(f"sgcd: c must be in [0, 1) so weights stay > 0, got {self.c!r}")
        if self.summariser != "template" and not self.summariser.startswith("hf:"):
            raise ValueError(f"sgcd: summariser must be 'template' or 'hf:PATH', "
                             f"got {self.summariser!r}")

    def spans_trees(self) -> bool:
        return self.group == "task"

    @property
    def score_kind(self) -> str:
        """The ``policy_scores`` kind of the teacher scores (Q3)."""
        return f"contrast:{self.summariser}"

    def token_score_kinds(self) -> dict[str, str]:
        """Q3: the teacher's contrast and plain log-probabilities (none with ``kappa=0``)."""
        return {CONTRAST_LOGPROB: self.score_kind, STUDENT_LOGPROB: PLAIN} \
            if self.kappa > 0 else {}


def reshape_weights(node_credit: np.ndarray, node_of: np.ndarray, gap: np.ndarray,
                    kappa: float, c: float) -> np.ndarray:
    """Q4: (K,) ``clip(1 + kappa sgn(A) d, 1 - c, 1 + c)`` of K agent tokens, ``node_of``
    (K,) their node, ``gap`` (K,) d_t, ``node_credit`` (N,) A (finite)."""
    return np.clip(1.0 + kappa * np.sign(node_credit)[node_of] * gap, 1.0 - c, 1.0 + c)


@register("sgcd", SgcdParams)
def sgcd(batch: TreeArrays, params: SgcdParams) -> Credit:
    """SGCD credit (Q4) for every node and agent token of ``batch``.

    Inputs: leaf rewards; with ``kappa > 0`` ``extras["contrast_logprob"]`` and
    ``extras["student_logprob"]`` (T,). Returns ``Credit.node`` (N,) = the GRPO node
    credit (G1, node means) and ``Credit.token`` (T,) = ``w_t`` times it on agent tokens,
    ``w_t`` in [1 - c, 1 + c]; 0 on observation tokens.
    """
    node = trajectory_credit(batch, params.group, params.std, params.eps, params.single)
    a = np.nan_to_num(node)
    node_of = batch.token_node[batch.agent_mask]
    if params.kappa > 0.0:
        w = reshape_weights(a, node_of, token_gap(batch, CONTRAST_LOGPROB, STUDENT_LOGPROB),
                            params.kappa, params.c)
    else:
        w = np.ones(node_of.size)
    token = np.zeros(batch.n_tokens)
    token[batch.agent_mask] = w * a[node_of]
    return Credit(node=node, token=token)
