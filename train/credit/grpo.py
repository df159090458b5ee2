"""GRPO outcome advantage over rollout trees (METHODS.md section 1, G1).

A group is the set of trajectories (root-to-leaf paths) of one tree, or of all
trees of one task (``group="task"``): a ``group`` sampler tree with
``n_total`` leaves, or a one-level tree imported from a verl/TRL dump, is one
GRPO group. Each trajectory ``i`` gets the z-score of its leaf reward (G1)::

    A_i = (R_i - mean_j R_j) / (F_norm({R_j}) + eps)

and a node gets the mean of ``A_i`` over the trajectories through it
(METHODS E6 semantics): in flat GRPO every token of trajectory ``i`` carries
``A_i``; in a tree a shared prefix node lies on several trajectories and is
trained once, with their mean. On a one-level tree this is exactly the
per-completion group advantage of verl / TRL.

The group helpers live in ``train.credit.groups`` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from train.credit.base import (
    Credit,
    GroupBy,
    GrpoPreset,
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
    leaf_groups,
    trajectory_credit,
    trajectory_leaves,
    trajectory_mean,
)

__all__ = ["PRESETS", "GrpoParams", "check_choice", "check_nonneg", "group_zscore", "grpo",
           "leaf_groups", "trajectory_leaves", "trajectory_mean"]


# The frameworks' GRPO advantage, reproduced exactly by ``preset`` (std, eps, single):
# verl ``compute_grpo_outcome_advantage`` (verl/trainer/ppo/core_algos.py): torch.std
# (unbiased), epsilon=1e-6, and a group of one response gets mean 0, std 1.
# TRL ``GRPOTrainer._generate_and_score_completions``: ``.std(dim=1)`` (unbiased),
# ``advantages / (std_rewards + 1e-4)``; one generation per prompt gives
# ``(R - R) / (0 + 1e-4) = 0``.
PRESETS: dict[str, tuple[StdNorm, float, SingleGroup]] = {
    "verl": ("unbiased", 1e-6, "raw"),
    "trl": ("unbiased", 1e-4, "zero"),
}


@dataclass(frozen=True)
class GrpoParams(Params):
    """Hyperparameters of ``grpo`` (METHODS G1)."""

    std: StdNorm = "unbiased"
    """F_norm of G1: ``"unbiased"`` std (verl default, SLCA), ``"population"`` std
    (TRACE), or ``"none"`` (Dr.GRPO: ``A = R - mean``, no division and no eps)."""
    eps: float = 1e-6
    """epsilon of G1, added to the std [Seed]."""
    single: SingleGroup = "zero"
    """A group with one trajectory: ``"zero"`` gives 0; ``"raw"`` gives the raw score
    with mean 0 and F_norm 1 (verl): ``R / (1 + eps)``, or ``R`` when ``std="none"``."""
    group: GroupBy = "tree"
    """The group: the trajectories of one tree, or of all trees of one task."""
    preset: GrpoPreset | None = None
    """``"verl"`` (unbiased, eps 1e-6, single raw) or ``"trl"`` (unbiased, eps 1e-4,
    single zero) fix ``std``, ``eps`` and ``single`` (leave those at their defaults);
    ``None`` uses the fields."""

    def __post_init__(self) -> None:
        check_choice("grpo", "std", self.std, StdNorm)
        check_choice("grpo", "single", self.single, SingleGroup)
        check_choice("grpo", "group", self.group, GroupBy)
        check_nonneg("grpo", eps=self.eps)
        if self.preset is None:
            return
        check_choice("grpo", "preset", self.preset, GrpoPreset)
        defaults = {f.name: f.default for f in fields(self)}
        changed = [k for k in ("std", "eps", "single") if getattr(self, k) != defaults[k]]
        if changed:
            raise ValueError(f"grpo: preset={self.preset!r} fixes std, eps and single; "
                             f"also setting {changed} is ambiguous (drop the preset or them)")

    def resolved(self) -> tuple[StdNorm, float, SingleGroup]:
        """The effective ``(std, eps, single)``: the preset's, or the fields'."""
        if self.preset is not None:
            return PRESETS[self.preset]
        return self.std, self.eps, self.single

    def spans_trees(self) -> bool:
        return self.group == "task"


# ----------------------------------------------------------------- the estimator
@register("grpo", GrpoParams)
def grpo(batch: TreeArrays, params: GrpoParams) -> Credit:
    """GRPO (METHODS G1) with trajectory credit broadcast to tree nodes (E6 semantics).

    Inputs: ``batch`` with N nodes, T tokens, B trees; ``batch.reward`` (N,) at
    leaves, ``batch.node_tree`` (N,) and ``batch.task`` (B,) for the groups.

    Returns ``Credit``:

    * ``node`` (N,): at a leaf, the trajectory advantage
      ``A_i = (R_i - mean_group R) / (F_norm + eps)`` (G1; 0 for a zero-variance
      group; ``params.single`` for a group of one); at an inner node ``v``, the
      mean of ``A_i`` over the trajectories through ``v`` (E6).
    * ``token`` (T,): each agent token carries its node's credit; observation
      (tool output, prompt) tokens carry 0.

    On a one-level tree (a verl/TRL dump: prompt root, one leaf per completion)
    leaf credits equal the framework's per-completion advantage; with
    ``preset="verl"`` / ``"trl"`` exactly (up to verl's float32 ulp noise in a
    zero-variance group, which is exactly 0 here).
    """
    std, eps, single = params.resolved()
    node = trajectory_credit(batch, params.group, std, eps, single)
    return Credit(node=node, token=node_to_tokens(batch, node))
