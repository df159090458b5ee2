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

The helpers ``trajectory_leaves``, ``group_zscore`` and ``trajectory_mean`` are
shared with ``tree_grpo`` and ``elpo``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, get_args

import numpy as np

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
    segment_stats,
    subtree_sum,
)


def check_choice(owner: str, name: str, value: Any, options: Any) -> None:
    """Raise if ``value`` is not one of the ``Literal`` type ``options``."""
    allowed = get_args(options)
    if value not in allowed:
        raise ValueError(f"{owner}: {name}={value!r} is not one of {list(allowed)}")


def check_nonneg(owner: str, **values: float) -> None:
    """Raise if any of ``values`` is negative or not finite."""
    for name, value in values.items():
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


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


# ----------------------------------------------------------------- shared helpers
def trajectory_leaves(batch: TreeArrays) -> np.ndarray:
    """(N,) bool: rows that end a trajectory (a leaf with a finite reward)."""
    return batch.is_leaf & np.isfinite(batch.reward)


def leaf_groups(batch: TreeArrays, leaf: np.ndarray, group: GroupBy) -> np.ndarray:
    """(L,) group key of each trajectory leaf ``leaf`` (N,) bool: its tree or its task."""
    tree = batch.node_tree[leaf]
    return tree if group == "tree" else batch.task[tree]


def group_zscore(values: np.ndarray, groups: np.ndarray, std: StdNorm, eps: float,
                 single: SingleGroup = "zero") -> np.ndarray:
    """(K,) G1 z-score of ``values`` (K,) within groups keyed by ``groups`` (K,) ints.

    ``(v - mean) / (F_norm + eps)``, or ``v - mean`` when ``std="none"``. A group
    whose values are all equal (or whose std is 0 in floating point) gives
    exactly 0, with no ulp noise divided by eps; a group of one gives 0, or
    ``v / (1 + eps)`` (``v`` when ``std="none"``) with ``single="raw"``.
    """
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return values.copy()
    _, g = np.unique(groups, return_inverse=True)
    g = g.ravel()
    k = int(g.max()) + 1
    count, mean, sd = segment_stats(values, g, k, ddof=1 if std == "unbiased" else 0)
    lo = np.full(k, np.inf)
    hi = np.full(k, -np.inf)
    np.minimum.at(lo, g, values)
    np.maximum.at(hi, g, values)
    centred = values - mean[g]
    flat = hi == lo
    if std == "none":
        adv = centred
    else:
        flat |= sd == 0.0  # equal values, or spread too small to square (eps = 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            adv = centred / (sd[g] + eps)
    adv = np.where(flat[g], 0.0, adv)
    if single == "raw":
        raw = values if std == "none" else values / (1.0 + eps)
        adv = np.where(count[g] == 1, raw, adv)
    return adv


def trajectory_mean(batch: TreeArrays, leaf_values: np.ndarray) -> np.ndarray:
    """(N,) mean of ``leaf_values`` (N,) over the trajectories through each node (E6).

    ``leaf_values`` is read at trajectory leaves only (finite there). A leaf gets
    its own value exactly; a node with no trajectory below gets NaN.
    """
    has = trajectory_leaves(batch) & np.isfinite(leaf_values)
    total = subtree_sum(batch, np.where(has, leaf_values, 0.0))
    count = subtree_sum(batch, has.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(count > 0, total / count, np.nan)
    return np.where(has, leaf_values, out)


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
    leaf = trajectory_leaves(batch)
    adv = np.full(batch.n_nodes, np.nan)
    adv[leaf] = group_zscore(batch.reward[leaf], leaf_groups(batch, leaf, params.group),
                             std, eps, single)
    node = trajectory_mean(batch, adv)
    return Credit(node=node, token=node_to_tokens(batch, node))
