"""Dynamic sampling (METHODS Q1, DAPO's): keep only trees with both outcomes.

A tree whose leaves all succeed or all fail gives GRPO-family credit nothing to compare.
``dynamic_sampling`` resamples each such tree with new seeds (``rounds`` > 0: up to
``rounds`` more trees, the last one kept) or drops it (``rounds`` 0). Success is the
sampler's one rule, leaf reward >= ``SamplerConfig.success_threshold``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from rollout_store.tree import Tree
from train.envs import Task, make_env
from train.policies.base import Policy
from train.sampling.base import Sampler, mix_seed
from train.sampling.engine import Engine, TreeJob


def mixed(tree: Tree, success_threshold: float) -> bool:
    """Q1: the tree has a successful and a failed trajectory (a leaf with reward >=
    ``success_threshold`` and one below it)."""
    rewards = [n.reward for n in tree.leaves() if n.reward is not None]
    return (any(r >= success_threshold for r in rewards)
            and any(r < success_threshold for r in rewards))


def dynamic_sampling(trees: Sequence[Tree], tasks: Sequence[Task], sampler: Sampler,
                     policy: Policy, *, env: str, n_total: int, seed: int, it: int,
                     run_id: str, rounds: int) -> tuple[list[Tree], dict[str, float]]:
    """Q1 over iteration ``it``'s ``trees`` (tree j sampled for ``tasks[j]`` with budget
    ``n_total``). Each round resamples every tree still without both outcomes in one engine
    wavefront; tree j's round-r seed is keyed by (seed, it, j, r), so its content does not
    depend on which others were resampled with it, and its id is ``RUN/itIT/JJJ-dsR``.
    Returns the kept trees (iteration order) and the extra
    budget: ``ds_dropped_trees``, ``ds_extra_trees``, ``ds_extra_rollouts``,
    ``ds_extra_tool_steps`` (the discarded trees are not committed, but their rollouts
    and tool steps are counted). Never returns nothing: with no tree kept, the last one
    sampled is [R]."""
    threshold = sampler.config.success_threshold
    extra = {"ds_dropped_trees": 0.0, "ds_extra_trees": 0.0, "ds_extra_rollouts": 0.0,
             "ds_extra_tool_steps": 0.0}

    def discard(tree: Tree, sign: float = 1.0) -> None:
        extra["ds_extra_rollouts"] += sign * sum(n.reward is not None for n in tree.leaves())
        extra["ds_extra_tool_steps"] += sign * sum(n.tool_calls or 0 for n in tree.nodes)

    current = list(trees)
    for r in range(1, rounds + 1):
        redo = [j for j, tree in enumerate(current) if not mixed(tree, threshold)]
        if not redo:
            break
        for j in redo:
            discard(current[j])
            extra["ds_extra_trees"] += 1.0
        fresh = Engine(policy).sample_trees([
            TreeJob(sampler, partial(make_env, env), tasks[j], n_total,
                    seed=mix_seed(seed, "tree", it, j, "ds", r),
                    tree_id=f"{run_id}/it{it:06d}/{j:03d}-ds{r}", run_id=run_id)
            for j in redo])
        for j, tree in zip(redo, fresh, strict=True):
            current[j] = tree
    kept: list[Tree] = []
    for tree in current:
        if mixed(tree, threshold):
            kept.append(tree)
        else:
            discard(tree)
            extra["ds_dropped_trees"] += 1.0
    if not kept:  # never train on nothing: keep the last tree sampled [R]
        kept.append(current[-1])
        discard(current[-1], -1.0)
        extra["ds_dropped_trees"] -= 1.0
    return kept, extra


__all__ = ["dynamic_sampling", "mixed"]
