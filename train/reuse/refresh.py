"""Refresh of stored comparisons (docs/METHODS.md section 9, "Refresh"): the refresh
protocol of ``train.sampling.refresh`` per refreshed comparison, in preorder, with draws by
``PolicyRefresh`` (restore the node's stored snapshot, reseed, force the stored child
action with its tokens and logprobs mu, continue with the current policy), cost in tool
calls, at most ``refresh_cap`` per stored tree; the draws committed as one new tree per
stored tree (sampler ``refresh``) with its lineage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rollout_store.tree import Node, Tree
from train.envs.base import Environment
from train.policies.base import Policy
from train.reuse.params import ReuseParams
from train.reuse.resolve import Resolution, tool_steps
from train.sampling.base import SamplerConfig
from train.sampling.refresh import (
    Drawn,
    Forced,
    PolicyRefresh,
    RefreshSampler,
    refresh_protocol,
)
from train.scoring import transcripts


def forced(node: Node) -> Forced:
    """A stored node's action, to be forced first by ``PolicyRefresh``."""
    return Forced(node.action_text, tuple(node.action_token_ids), tuple(node.action_logprobs),
                  tuple(node.action_entropies), tuple(node.segments))


def node_draws(tree: Tree, node_id: int, children: Sequence[int], env: Environment,
               policy: Policy, *, seed: int, max_new_tokens: int, temperature: float,
               records: bool) -> PolicyRefresh | None:
    """``PolicyRefresh`` from stored node ``node_id`` (its snapshot, transcript and depth)
    with ``children``'s stored actions forced first; key parts (tree id, child id); cost
    in tool calls. None when the node has no stored snapshot."""
    n = tree.node(node_id)
    if n.snapshot_id is None or n.snapshot_id not in tree.snapshots:
        return None
    path = tree.path_to(node_id)
    return PolicyRefresh(
        env, policy, transcripts(tree)[node_id], tree.snapshots[n.snapshot_id],
        [forced(tree.node(c)) for c in children],
        max_steps=(tree.env_config or {}).get("max_steps"), seed=seed,
        config=SamplerConfig(max_new_tokens=max_new_tokens, temperature=temperature),
        key_parts=[(tree.tree_id, c) for c in children], budget="tool_calls",
        records=records, depth=len(path) - 1)


@dataclass
class Refreshed:
    """The outcome of refreshing one stored tree: the new tree (None when the protocol
    drew nothing), the posterior mean per refreshed (node, child), new tool steps spent,
    and the refreshed comparisons that had no snapshot to continue from."""

    tree: Tree | None
    posterior: dict[tuple[int, int], float]
    steps: int
    no_snapshot: int = 0


def refresh_routes(tree: Tree, res: Resolution, env: Environment, policy: Policy, *,
                   tree_id: str, run_id: str, seed: int, params: ReuseParams,
                   max_new_tokens: int, temperature: float) -> Refreshed:
    """Refresh the refreshed children of every comparison of ``res`` (preorder) with the
    refresh protocol of ``train.sampling.refresh`` (prior from the comparison's
    ``prior``) and ``PolicyRefresh`` draws from the node's stored snapshot, at most
    ``params.refresh_cap`` new tool steps for the tree (0: ``tool_steps(tree)``); returns
    the new tree with its lineage (module docstring)."""
    posterior: dict[tuple[int, int], float] = {}
    groups: list[tuple[int, list[int], list[Drawn]]] = []
    spent = missing = 0
    cap = params.refresh_cap or max(tool_steps(tree), 1)
    for comp in res.comparisons:
        routes = comp.refresh
        if len(routes) < 2 or spent >= cap:
            continue
        draw = node_draws(tree, comp.node, routes, env, policy, seed=seed,
                          max_new_tokens=max_new_tokens, temperature=temperature,
                          records=True)
        if draw is None:
            missing += 1
            continue
        sampler = RefreshSampler(draw)
        mean = np.array([comp.prior[c][0] for c in routes])
        var = np.array([comp.prior[c][1] for c in routes])
        n_old = np.array([comp.prior[c][2] for c in routes], np.float64)
        # the protocol's Beta prior takes returns in [0, 1] (transported ones are clipped)
        out = refresh_protocol(mean, var, n_old, list(range(len(routes))), sampler,
                               kappa_e=params.kappa_e, cap_steps=cap - spent,
                               batch=params.refresh_batch)
        posterior.update({(comp.node, c): float(out.mean[i]) for i, c in enumerate(routes)})
        drawn = [d for _, d in sorted(sampler.cache.items())]
        spent += sum(d.steps for d in drawn)
        if drawn:
            groups.append((comp.node, routes, drawn))
    if not groups:
        return Refreshed(None, posterior, spent, missing)
    new = _refresh_tree(tree, groups, tree_id=tree_id, run_id=run_id, policy=policy,
                        seed=seed)
    return Refreshed(new, posterior, spent, missing)


def _refresh_tree(tree: Tree, groups: Sequence[tuple[int, list[int], list[Drawn]]], *,
                  tree_id: str, run_id: str, policy: Policy, seed: int) -> Tree:
    root = tree.root()
    encode: Callable[[str], list[int]] | None = getattr(policy, "encode", None)
    nodes = [Node(node_id=0, parent_id=None, kind="prompt",
                  observation_text=root.observation_text, snapshot_id=f"{tree_id}/0")]
    snapshots = {f"{tree_id}/0": tree.snapshots[root.snapshot_id or ""]}
    copied = {root.node_id: 0}  # stored node id -> new node id (the copied paths)
    lineage: dict[str, int] = {}
    n_drawn = env_steps = 0
    for node_id, routes, drawn in groups:
        for stored in tree.path_to(node_id)[1:]:
            if stored.node_id in copied:
                continue
            nid = len(nodes)
            has = stored.snapshot_id is not None and stored.snapshot_id in tree.snapshots
            nodes.append(replace(
                stored, node_id=nid, parent_id=copied[stored.parent_id or 0],
                snapshot_id=f"{tree_id}/{nid}" if has else None, tool_calls=0,
                phase="refresh", reward=None, reward_parts={}, terminal=False,
                meta={**(stored.meta or {}), "copy_of": stored.node_id}))
            if has:
                snapshots[f"{tree_id}/{nid}"] = tree.snapshots[stored.snapshot_id or ""]
            copied[stored.node_id] = nid
        for d in drawn:
            n_drawn += 1
            env_steps += len(d.records)
            parent = copied[node_id]
            for j, s in enumerate(d.records):
                nid = len(nodes)
                leaf = s.done or j == len(d.records) - 1
                meta: dict[str, Any] | None = None
                if j == 0:
                    child = tree.node(routes[d.route])
                    kind = child.kind
                    meta = {"refresh_of": {"tree_id": tree.tree_id, "node_id": child.node_id}}
                    lineage[str(nid)] = child.node_id
                else:
                    feedback = "<tool_response>" in nodes[parent].observation_text
                    kind = "feedback_response" if feedback else "decision"
                if s.truncated:
                    meta = {**(meta or {}), "truncated": True}
                nodes.append(Node(
                    node_id=nid, parent_id=parent, kind=kind,
                    action_text=s.action_text, action_token_ids=list(s.token_ids),
                    action_logprobs=list(s.logprobs), action_entropies=list(s.entropies),
                    observation_text=s.observation,
                    observation_token_ids=[int(i) for i in encode(s.observation)]
                    if callable(encode) and s.observation else [],
                    segments=list(s.segments), terminal=s.done,
                    reward=float(s.reward_parts.get("reward", 0.0))
                    if leaf and not s.truncated else (0.0 if leaf else None),
                    reward_parts=dict(s.reward_parts) if leaf else {},
                    snapshot_id=f"{tree_id}/{nid}", n_gen_tokens=len(s.token_ids),
                    tool_calls=int(s.tool_call), phase="refresh", meta=meta))
                snapshots[f"{tree_id}/{nid}"] = s.snapshot
                parent = nid
    ref = getattr(policy, "policy_ref", None)
    return Tree(
        tree_id=tree_id, nodes=nodes, run_id=run_id, task_id=tree.task_id, env=tree.env,
        sampler="refresh", env_config=dict(tree.env_config or {}),
        policy_version=str(policy.policy_version), policy_ref=None if ref is None else str(ref),
        budget=n_drawn, rollouts_by_phase={"refresh": n_drawn}, seed=seed,
        meta={"refresh_of": tree.tree_id, "refresh_of_version": tree.policy_version,
              "refreshed_nodes": [g[0] for g in groups], "lineage": lineage,
              "env_steps": env_steps},
        snapshots=snapshots)


__all__ = ["Refreshed", "forced", "node_draws", "refresh_routes"]
