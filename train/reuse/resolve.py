"""Resolution of a stored tree's sibling comparisons (docs/METHODS.md section 9,
"Sibling comparisons" and "Composition"; D3-D5, D7-D10) and ``RULES``, the registry of
named reuse rules. Pure: numpy and ``train.credit`` only (no torch, store, environments or
policies; ``tests/test_layering.py`` checks it).

A rule (``Rule``) declares what it needs (root snapshots for refresh draws, a pi_prox
forward pass, a D7 calibration), its decision per comparison (``decide``: every child
reused / transported / refreshed, or gated per pair), the behaviour weight of its stored
tokens (``weight``: G8 truncation or M2PO masking, M1) and how pi_prox is had (``prox``:
a forward pass, or the A-3PO interpolation P1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from rollout_store.tree import Tree
from train.credit.base import TreeArrays, from_trees, subtree_sum
from train.credit.dsc import RATIO, STATE, transport_returns
from train.credit.dsc_gate import dsc_gate
from train.reuse.params import REUSE_MODES, ReuseParams

ProxLogp = Mapping[tuple[str, int], np.ndarray]
"""(tree id, node id) -> (len A_v,) log pi_prox of the node's action tokens."""
Decision = Literal["reuse", "transport", "refresh"]
DECISIONS: tuple[Decision, ...] = ("reuse", "transport", "refresh")
Decide = Callable[[TreeArrays, int, ReuseParams], tuple[dict[int, Decision], list[Decision]]]
"""(arrays of one tree, row of a branching node, params) -> ({child node id: decision},
the decision of each of the comparison's pairs)."""


def _every_child(decision: Decision) -> Decide:
    def decide(arrays: TreeArrays, row: int, params: ReuseParams
               ) -> tuple[dict[int, Decision], list[Decision]]:
        children = np.flatnonzero(arrays.parent == row)  # A children: A - 1 pairs
        return ({int(arrays.node_ids[c]): decision for c in children},
                [decision] * (len(children) - 1))
    return decide


def _gated(arrays: TreeArrays, row: int, params: ReuseParams
           ) -> tuple[dict[int, Decision], list[Decision]]:
    """D8-D10 per leader-versus-competitor pair (``dsc_gate`` anchored at ``row``); the
    leader is transported if any of its pairs is not reused and refreshed if any is
    refreshed [R]."""
    ids = arrays.node_ids
    g = dsc_gate(arrays, params.gate, np.array([row]))
    use: dict[int, Decision] = {}
    comps = [int(ids[r]) for r in g.competitor]
    decisions: list[Decision] = list(g.decision.tolist())
    for comp, decision in zip(comps, decisions, strict=True):
        use[comp] = decision
    others = [use[c] for c in comps]
    for lead in {int(ids[r]) for r in g.leader}:
        use[lead] = ("refresh" if "refresh" in others else
                     "transport" if "transport" in others else "reuse")
    return use, decisions


def _gap_gated(arrays: TreeArrays, row: int, params: ReuseParams
               ) -> tuple[dict[int, Decision], list[Decision]]:
    """GG1 (the Gap gate, DSC-Gate's comparator) per leader-versus-competitor pair: reuse
    when the stored gap is resolved, ``|c_R| > r_R`` (D7's reuse radius), else refresh;
    no transport and no drift term. The leader is refreshed if any of its pairs is [R]."""
    ids = arrays.node_ids
    g = dsc_gate(arrays, params.gate, np.array([row]))
    decisions: list[Decision] = ["reuse" if abs(c) > r else "refresh"
                                 for c, r in zip(g.c_R.tolist(), g.r_R.tolist(), strict=True)]
    use: dict[int, Decision] = {int(ids[r]): d
                                for r, d in zip(g.competitor, decisions, strict=True)}
    for lead in {int(ids[r]) for r in g.leader}:
        use[lead] = "refresh" if "refresh" in decisions else "reuse"
    return use, decisions


@dataclass(frozen=True)
class Rule:
    """A named reuse rule: what it needs and how it decides (module docstring)."""

    name: str
    decide: Decide
    method_suffix: str
    """``credits.method`` of a stored tree's credit: ``{credit}+{method_suffix}``."""
    needs_snapshots: bool = False
    """Refresh draws continue from stored snapshots: trees without one are skipped."""
    calibrates: bool = False
    """The gate's kappas come from a D7 calibration (``train.reuse.calibrate``)."""
    gated: bool = False
    """A gate decides each pair from its stored data: trees too thin for any pair to be
    resolved are refused (``ReuseParams.min_trajectories``)."""
    weight: Literal["truncate", "m2po"] = "truncate"
    """Stored tokens' behaviour weight: G8 (``TrainConfig.is_mode`` above ``is_cap``) or
    M1 (M2PO: mask the largest squared log-ratios, the weight otherwise untruncated)."""
    prox: Literal["forward", "interp"] = "forward"
    """log pi_prox of stored tokens: a no-grad forward pass (D3), or P1 (A-3PO: the
    behaviour and current logprobs interpolated by staleness, no extra forward)."""


RULES: dict[str, Rule] = {
    "all": Rule("all", _every_child("reuse"), "reuse"),
    "transport": Rule("transport", _every_child("transport"), "transport"),
    "dsc": Rule("dsc", _gated, "dsc", needs_snapshots=True, calibrates=True, gated=True),
    "refresh": Rule("refresh", _every_child("refresh"), "refresh", needs_snapshots=True),
    "m2po": Rule("m2po", _every_child("reuse"), "m2po", weight="m2po"),  # M1
    "prox-interp": Rule("prox-interp", _every_child("reuse"), "prox-interp",
                        prox="interp"),  # P1
    "gap-gate": Rule("gap-gate", _gap_gated, "gap-gate", needs_snapshots=True,
                     calibrates=True, gated=True),  # GG1
}
"""The reuse rules by name (``TrainConfig.reuse``; ``none`` is no rule)."""
assert tuple(RULES) == REUSE_MODES[1:], "train.reuse.params.REUSE_MODES names the rules"


def get_rule(rule: Rule | str) -> Rule:
    """``rule`` itself, or the ``RULES`` entry of that name (``ValueError`` naming them)."""
    if isinstance(rule, Rule):
        return rule
    if rule not in RULES:
        raise ValueError(f"unknown reuse mode {rule!r}; choose from {tuple(RULES)}")
    return RULES[rule]


def dsc_extras(tree: Tree, prox: ProxLogp) -> dict[str, np.ndarray]:
    """``extras`` of ``train.credit.dsc`` for one tree (rows follow ``tree.nodes``):
    ``dsc_ratio`` (N,) = exp(sum log pi_prox - sum log mu) of each action (D3) and
    ``dsc_state`` (N,) = the parent's node id (siblings share their state [R])."""
    ratio = np.ones(len(tree.nodes))
    state = np.full(len(tree.nodes), -1, np.int64)
    for r, n in enumerate(tree.nodes):
        if n.parent_id is None:
            continue
        state[r] = n.parent_id
        lp = prox.get((tree.tree_id, n.node_id))
        if lp is not None:
            ratio[r] = float(np.exp(min(float(np.sum(lp)) - float(np.sum(n.action_logprobs)),
                                        20.0)))
    return {RATIO: ratio, STATE: state}


@dataclass
class Comparison:
    """One branching node of a stored tree and how its children were resolved.

    ``node`` the node id; ``children`` its child node ids (the forced actions);
    ``use`` {child: "reuse" | "transport" | "refresh"}; ``value`` {child: Q under the rule
    before any refresh}; ``prior`` {child: (mean, variance of the mean, N)} of the
    per-leaf values used (the refresh protocol's prior); ``leaves`` {child: leaf ids};
    ``plain`` {child: Q_R, the plain mean of the stored returns}.
    """

    node: int
    children: list[int]
    use: dict[int, Decision]
    value: dict[int, float]
    prior: dict[int, tuple[float, float, int]]
    leaves: dict[int, list[int]]
    plain: dict[int, float]

    @property
    def refresh(self) -> list[int]:
        return [c for c in self.children if self.use[c] == "refresh"]


@dataclass
class Resolution:
    """How one stored tree's comparisons were resolved.

    ``comparisons`` in preorder; ``route_of`` {leaf: its root action}; ``pairs``
    decisions counted per ``DECISIONS`` over all comparisons; ``transported`` /
    ``reward`` the root-anchored D4 T_i and the stored R_i per leaf; ``root`` the root's
    node id; ``feasible`` the pairs whose stored data could resolve their gap at all
    (``feasible_pairs``).
    """

    comparisons: list[Comparison]
    route_of: dict[int, int]
    pairs: Counter[str]
    transported: dict[int, float]
    reward: dict[int, float]
    root: int = 0
    feasible: int = 0

    @property
    def refresh(self) -> list[int]:
        """The root's children to refresh (empty when the root is not a comparison)."""
        at_root = [c for c in self.comparisons if c.node == self.root]
        return at_root[0].refresh if at_root else []

    @property
    def returns(self) -> dict[int, float]:
        """{leaf: the return its credit uses} without refresh posteriors."""
        return self.compose({})

    def compose(self, posterior: Mapping[tuple[int, int], float]) -> dict[int, float]:
        """Leaf returns whose child means at every comparison differ by its values
        (docs/METHODS.md section 9, "Composition"); ``posterior`` {(node, child):
        posterior mean} overrides the value of a refreshed child."""
        ret = dict(self.reward)
        for k, comp in enumerate(self.comparisons):
            q = {c: float(posterior.get((comp.node, c), comp.value[c])) for c in comp.children}
            if q == comp.plain:  # the stored means: every shift above kept their gaps
                continue
            n = {c: len(comp.leaves[c]) for c in comp.children}
            qbar = sum(n[c] * q[c] for c in comp.children) / sum(n.values())
            below = [leaf for c in comp.children for leaf in comp.leaves[c]]
            level = qbar if k == 0 else float(np.mean([ret[leaf] for leaf in below]))
            for c in comp.children:
                shift = level + q[c] - qbar - float(np.mean([ret[x] for x in comp.leaves[c]]))
                for leaf in comp.leaves[c]:
                    ret[leaf] += shift
        return ret


FEASIBLE_TRAJECTORIES = 8
"""Trajectories each side of a leader-versus-competitor pair needs before its stored gap
can be resolved [R]: with one a side the reuse radius at kappa_R = 2 is about 1.41 for
binary returns, more than any gap, so the gate can only refresh; 8 a side brings it to
about 0.5 (docs/METHODS.md section 9, "Feasible pairs")."""


def _pair_sizes(sizes: Mapping[int, int], plain: Mapping[int, float]) -> list[int]:
    """Per leader-versus-competitor pair of a comparison (the child with the best stored
    mean ``plain``, ties to the first, against each other child), the trajectories
    (``sizes``: per child) on its thinner side."""
    children = list(sizes)
    leader = max(children, key=lambda c: (plain[c], -children.index(c)))
    return [min(sizes[leader], sizes[c]) for c in children if c != leader]


def feasible_pairs(leaves: Mapping[int, Sequence[int]], plain: Mapping[int, float]) -> int:
    """Of a comparison's A - 1 pairs (``_pair_sizes``), those with at least
    ``FEASIBLE_TRAJECTORIES`` trajectories (``leaves``) on both sides."""
    sizes = {c: len(v) for c, v in leaves.items()}
    return sum(n >= FEASIBLE_TRAJECTORIES for n in _pair_sizes(sizes, plain))


def thickest_gated_pair(tree: Tree) -> int | None:
    """The most trajectories that one gated pair of ``tree`` holds on its thinner side (a
    pair of a comparison with a step below its forced actions, where the gate decides);
    None when the tree has no such comparison (every pair is reused soundly). A gated
    rule can resolve a stored gap only when this reaches ``FEASIBLE_TRAJECTORIES``.
    Leaf counts and reward sums per subtree come from ``subtree_sum``."""
    arrays = from_trees([tree])
    leaf = arrays.is_leaf.astype(np.float64)
    n_leaves = subtree_sum(arrays, leaf)
    rewards = subtree_sum(arrays, np.nan_to_num(arrays.reward) * leaf)
    parent = arrays.parent
    best: int | None = None
    for row in np.unique(parent[parent >= 0]).tolist():
        kids = np.flatnonzero(parent == row).tolist()
        if len(kids) < 2 or arrays.is_leaf[kids].all():
            continue
        sizes = {c: int(n_leaves[c]) for c in kids}
        best = max(best or 0, *_pair_sizes(sizes, {c: rewards[c] / sizes[c] for c in kids}))
    return best


def _stats(values: Sequence[float]) -> tuple[float, float, int]:
    vals = np.asarray(values, np.float64)
    var = float(vals.var(ddof=1)) / vals.size if vals.size > 1 else 0.0
    return float(vals.mean()), var, int(vals.size)


def resolve_tree(tree: Tree, rule: Rule | str, prox: ProxLogp,
                 params: ReuseParams) -> Resolution:
    """Resolve every branching node's leader-versus-competitor pairs by ``rule`` (a
    ``RULES`` entry or its name; docs/METHODS.md section 9, "Sibling comparisons"): D3-D5
    via ``transport_returns`` and the rule's decision (D7-D10 via ``dsc_gate`` for
    ``dsc``), both anchored at the node (D4)."""
    rule = get_rule(rule)
    arrays = from_trees([tree], dsc_extras(tree, prox))
    ids = arrays.node_ids
    root_tr = transport_returns(arrays)
    leaves = [int(ids[r]) for r in root_tr.leaf]
    route_of = {leaf: int(ids[a]) for leaf, a in zip(leaves, root_tr.action, strict=True)}
    reward = {leaf: float(v) for leaf, v in zip(leaves, root_tr.reward, strict=True)}
    transported = {leaf: float(v)
                   for leaf, v in zip(leaves, root_tr.transported, strict=True)}
    parent = arrays.parent
    n_children = np.bincount(parent[parent >= 0], minlength=arrays.n_nodes)
    pairs: Counter[str] = Counter()
    comparisons: list[Comparison] = []
    feasible = 0
    for row in np.flatnonzero(n_children >= 2).tolist():  # preorder
        anchor = np.array([row])
        tr = transport_returns(arrays, anchor)
        child_of = {int(ids[lf]): int(ids[a]) for lf, a in zip(tr.leaf, tr.action, strict=True)}
        r_of = {int(ids[lf]): float(v) for lf, v in zip(tr.leaf, tr.reward, strict=True)}
        t_of = {int(ids[lf]): float(v) for lf, v in zip(tr.leaf, tr.transported, strict=True)}
        children = [int(ids[c]) for c in np.flatnonzero(parent == row)]
        below = {c: [lf for lf, a in child_of.items() if a == c] for c in children}
        use: dict[int, Decision] = {}
        plain = {c: _stats([r_of[lf] for lf in below[c]])[0] for c in children}
        if not any(n_children[c] for c in np.flatnonzero(parent == row)):
            # every child is a leaf: no step below the forced actions, so no policy can
            # change their values (T = R) and a refresh would redraw only the env's noise
            pairs["reuse"] += len(children) - 1
            feasible += len(children) - 1  # reused soundly whatever their counts
            use = {c: "reuse" for c in children}
        else:
            use, decided = rule.decide(arrays, row, params)
            pairs.update(decided)
            feasible += feasible_pairs(below, plain)
        prior = {c: _stats([(r_of if use[c] == "reuse" else t_of)[lf] for lf in below[c]])
                 for c in children}
        comparisons.append(Comparison(int(ids[row]), children, use,
                                      {c: prior[c][0] for c in children}, prior, below, plain))
    return Resolution(comparisons, route_of, pairs, transported, reward, tree.root().node_id,
                      feasible)


def with_returns(tree: Tree, returns: Mapping[int, float]) -> Tree:
    """A copy of ``tree`` whose leaves carry ``returns`` (node id -> reward), so the
    credit estimator compares siblings with the rule's returns."""
    nodes = [replace(n, reward=float(returns[n.node_id])) if n.node_id in returns else n
             for n in tree.nodes]
    return replace(tree, nodes=nodes)


def tool_steps(tree: Tree) -> int:
    """Tool steps a tree's trajectories spent (what a refresh of all of them would cost)."""
    return sum(int(n.tool_calls or 0) for n in tree.nodes)


__all__ = ["DECISIONS", "FEASIBLE_TRAJECTORIES", "RULES", "Comparison", "Decision", "ProxLogp",
           "Resolution", "Rule", "dsc_extras", "feasible_pairs", "get_rule", "resolve_tree",
           "thickest_gated_pair",
           "tool_steps", "with_returns"]
