"""Refresh of stored comparisons (docs/METHODS.md section 9, "Refresh"): the refresh
protocol of ``train.sampling.refresh`` on the refreshed comparisons of every stored tree of
a reuse step, all trees in one wavefront of the rollout engine (``refresh_trees``). Each
stored tree is one ``refresh_program``: a ``TreeBuilder`` grafted onto the stored paths
(restore the node's stored snapshot, reseed, force the stored child action with its tokens
and logprobs mu, continue with the current policy), cost in tool calls, at most
``refresh_cap`` per stored tree; its builder's tree (sampler ``refresh``) is committed with
its lineage. Rows are keyed by (seed, stored tree id) and the builder's (node, draw), so a
refreshed tree does not depend on the other trees of its batch or the batch budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from rollout_store.tree import Tree
from train.envs.base import Environment
from train.policies.base import Policy
from train.reuse.params import ReuseParams
from train.reuse.resolve import Resolution, tool_steps
from train.sampling.base import SamplerConfig, mix_seed
from train.sampling.engine import DEFAULT_MAX_ROWS, Engine, EnvSource, Program
from train.sampling.refresh import RefreshOutcome, Site, refresh_program


def has_snapshot(tree: Tree, node_id: int) -> bool:
    """Whether the store holds the node's environment snapshot (a refresh starts there)."""
    sid = tree.node(node_id).snapshot_id
    return sid is not None and sid in tree.snapshots


@dataclass
class Refreshed:
    """The outcome of refreshing one stored tree: the new tree (None when the protocol
    drew nothing), the posterior mean per refreshed (node, child), new tool steps spent,
    and the refreshed comparisons that had no snapshot to continue from."""

    tree: Tree | None
    posterior: dict[tuple[int, int], float]
    steps: int
    no_snapshot: int = 0


def engine_for(policy: Policy, env: EnvSource, max_rows: int = DEFAULT_MAX_ROWS) -> Engine:
    """An engine for programs that each use ``env``: a shared ``Environment`` object runs
    them one at a time (the results are the same: they do not depend on the batch), a
    factory runs them together."""
    return Engine(policy, max_rows=max_rows,
                  max_programs=1 if isinstance(env, Environment) else 64)


def refresh_trees(items: Sequence[tuple[Tree, Resolution, str]], env: EnvSource,
                  policy: Policy, *, run_id: str, seed: int, params: ReuseParams,
                  max_new_tokens: int, temperature: float,
                  engine: Engine | None = None) -> list[Refreshed]:
    """Refresh the refreshed children of every comparison of each (stored tree,
    resolution, new tree id) with ``refresh_program`` (prior from the comparison's
    ``prior``; rows keyed by ``mix_seed(seed, stored tree id)``), at most
    ``params.refresh_cap`` new tool steps per tree (0: ``tool_steps(tree)``), all trees in
    one ``Engine.run`` of ``engine`` (default ``engine_for(policy, env)``); returns one
    ``Refreshed`` per item, the new tree carrying its lineage (``meta``: refresh_of,
    refresh_of_version, refreshed_nodes, lineage)."""
    config = SamplerConfig(max_new_tokens=max_new_tokens, temperature=temperature)
    plans: list[tuple[list[Site], int]] = []
    programs: list[Callable[[], Program]] = []
    for tree, res, tree_id in items:
        sites, missing = [], 0
        for comp in res.comparisons:
            if len(comp.refresh) < 2:
                continue
            if not has_snapshot(tree, comp.node):
                missing += 1
                continue
            sites.append(Site(comp.node, tuple(comp.refresh), tuple(
                (float(comp.prior[c][0]), float(comp.prior[c][1]), float(comp.prior[c][2]))
                for c in comp.refresh)))
        plans.append((sites, missing))
        if sites:
            programs.append(partial(
                refresh_program, tree, sites, env, policy, config=config,
                seed=mix_seed(seed, tree.tree_id), tree_id=tree_id, run_id=run_id,
                cap=params.refresh_cap or max(tool_steps(tree), 1), kappa_e=params.kappa_e,
                batch=params.refresh_batch))
    outcomes: list[RefreshOutcome] = (engine or engine_for(policy, env)).run(programs)
    got = iter(outcomes)
    out = []
    for (tree, _, _), (sites, missing) in zip(items, plans, strict=True):
        if not sites:
            out.append(Refreshed(None, {}, 0, missing))
            continue
        outcome = next(got)
        posterior = {(s.node, c): float(r.mean[i]) for s, r in zip(sites, outcome.results,
                                                                   strict=True)
                     for i, c in enumerate(s.children)}
        new = _finish(tree, sites, outcome, policy) if outcome.steps or any(
            outcome.draws) else None
        out.append(Refreshed(new, posterior, outcome.steps, missing))
    return out


def _finish(tree: Tree, sites: Sequence[Site], outcome: RefreshOutcome, policy: Policy
            ) -> Tree:
    """The builder's tree with its lineage: each forced node's ``meta["refresh_of"]``
    names the stored child it replays, ``meta["lineage"]`` maps it to that child."""
    builder = outcome.builder
    lineage: dict[str, int] = {}
    for site, draws in zip(sites, outcome.draws, strict=True):
        for d in draws:
            child = site.children[d.route]
            node = builder.node(d.first)
            node.meta = {**(node.meta or {}),
                         "refresh_of": {"tree_id": tree.tree_id, "node_id": child}}
            lineage[str(d.first)] = child
    builder.meta.update({"refresh_of": tree.tree_id, "refresh_of_version": tree.policy_version,
                         "refreshed_nodes": [s.node for s, ds in zip(sites, outcome.draws,
                                                                      strict=True) if ds],
                         "lineage": lineage})
    builder.budget.n_total = builder.budget.used  # a refresh spends what its protocol drew
    return builder.finish()


def refresh_routes(tree: Tree, res: Resolution, env: EnvSource, policy: Policy, *,
                   tree_id: str, run_id: str, seed: int, params: ReuseParams,
                   max_new_tokens: int, temperature: float) -> Refreshed:
    """``refresh_trees`` of one stored tree."""
    return refresh_trees([(tree, res, tree_id)], env, policy, run_id=run_id, seed=seed,
                         params=params, max_new_tokens=max_new_tokens,
                         temperature=temperature)[0]


__all__ = ["Refreshed", "engine_for", "has_snapshot", "refresh_routes", "refresh_trees"]
