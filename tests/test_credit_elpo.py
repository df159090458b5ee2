"""``elpo`` estimator (METHODS E3-E8), tested three ways: a hand case, a reference loop, invariants.

1. A small tree with every quantity of E3-E8 worked out by hand in the comments.
2. A plain-Python reference (dicts and loops over ``Tree`` objects, one tree at
   a time) against the vectorised estimator on random batches of trees.
3. Invariants: an unbranched tree (a chain) has no branch credit; splitting a
   step off the branch points into a chain of two changes no token; tool output
   never gets or changes advantage; the order of trees does not matter.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import replace

import numpy as np
import pytest
from credit_helpers import (
    Key,
    agent_tokens_of,
    by_row,
    group_key,
    node,
    ref_zscore,
    split_step,
    with_more_tool_output,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_store.testing import tree_lists
from rollout_store.tree import Tree
from train.credit import ESTIMATORS
from train.credit.base import Credit, TreeArrays, from_trees
from train.credit.elpo import ElpoParams, elpo, node_value

EPS = 1e-6
_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=_SLOW_DATA)
QUICK = settings(max_examples=15, deadline=None, suppress_health_check=_SLOW_DATA)  # invariants


# ----------------------------------------------------------------- 1. by hand
def bel_tree() -> Tree:
    #   0 prompt (2 prompt tokens)
    #   ├── 1 (2 agent, 1 tool output)         branching
    #   │   ├── 3  R = 1 (1 agent)
    #   │   └── 4 (1 agent, 1 tool output)     critical node (first irrecoverable step)
    #   │       └── 6  R = 0 (2 agent)
    #   └── 2 (1 agent)
    #       └── 5  R = 0 (1 agent)
    return Tree(tree_id="bel", task_id="x", critical_node_id=4, nodes=[
        node(0, None, 0, 2), node(1, 0, 2, 1), node(2, 0, 1, 0), node(3, 1, 1, 0, reward=1.0),
        node(4, 1, 1, 1), node(5, 2, 1, 0, reward=0.0), node(6, 4, 2, 0, reward=0.0)])


def test_elpo_by_hand() -> None:
    batch = from_trees([bel_tree()])
    assert list(batch.node_ids) == [0, 1, 3, 4, 6, 2, 5]  # preorder
    # E3: r(3)=1, r(6)=0, r(4)=r(6)=0, r(1)=(1+0)/2=0.5, r(5)=0, r(2)=0, r(0)=(0.5+0)/2=0.25.
    r = by_row(batch, node_value(batch))
    assert r == {("bel", 0): 0.25, ("bel", 1): 0.5, ("bel", 3): 1.0, ("bel", 4): 0.0,
                 ("bel", 6): 0.0, ("bel", 2): 0.0, ("bel", 5): 0.0}
    # E4 at branching node 0, children r = 0.5, 0: mean 0.25, unbiased std
    # sqrt(2 * 0.25^2 / 1) = 0.353553 -> A_b(1) = 0.25/0.353553 = 0.707105, A_b(2) = -0.707105.
    ab1 = 0.25 / (math.sqrt(0.125) + EPS)
    # E4 at branching node 1, children r = 1, 0: mean 0.5, std sqrt(0.5) = 0.707107
    # -> A_b(3) = 0.707106, A_b(4) = -0.707106.
    ab3 = 0.5 / (math.sqrt(0.5) + EPS)
    # E5 over the tree's trajectories R = 1 (via 3), 0 (via 6), 0 (via 5): mean 1/3,
    # unbiased std sqrt((4/9 + 1/9 + 1/9)/2) = sqrt(1/3) = 0.577350
    # -> A_t = 1.154700 (path to 3), -0.577350 (paths to 6 and 5).
    s = math.sqrt(1 / 3)
    at_win, at_lose = (2 / 3) / (s + EPS), (-1 / 3) / (s + EPS)
    # E6: Abar_t(1) = mean(1.154700, -0.577350) = 0.288675; Abar_t(0) = 0;
    #     Abar_t(4) = Abar_t(6) = Abar_t(2) = Abar_t(5) = -0.577350; Abar_t(3) = 1.154700.
    bar1 = (at_win + at_lose) / 2
    # E7 with lambda 0.5: children of branching nodes (1, 2, 3, 4) mix both;
    #   A(1) = .5*0.707105 + .5*0.288675 = 0.497890; A(2) = .5*(-0.707105 - 0.577350) = -0.642228
    #   A(3) = .5*(0.707106 + 1.154700) = 0.930903;  A(4) = .5*(-0.707106 - 0.577350) = -0.642228
    # the root and the only children 5, 6 get Abar_t: 0, -0.577350, -0.577350.
    expected = {
        ("bel", 0): 0.0, ("bel", 1): 0.5 * ab1 + 0.5 * bar1, ("bel", 2): 0.5 * (-ab1 + at_lose),
        ("bel", 3): 0.5 * (ab3 + at_win), ("bel", 4): 0.5 * (-ab3 + at_lose),
        ("bel", 5): at_lose, ("bel", 6): at_lose,
    }
    credit = elpo(batch, ElpoParams())
    got = by_row(batch, credit.node)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert got[("bel", 1)] == pytest.approx(0.497890, abs=1e-6)
    assert got[("bel", 3)] == pytest.approx(0.930903, abs=1e-6)
    assert got[("bel", 4)] == pytest.approx(-0.642228, abs=1e-6)
    # Tokens in row order 0, 1, 3, 4, 6, 2, 5: (2 obs) (2 agent, 1 obs) (1) (1, 1 obs) (2) (1) (1)
    e = expected
    np.testing.assert_allclose(credit.token, [
        0, 0, e[("bel", 1)], e[("bel", 1)], 0, e[("bel", 3)], e[("bel", 4)], 0,
        e[("bel", 6)], e[("bel", 6)], e[("bel", 2)], e[("bel", 5)]], atol=1e-12)
    # E8: the critical suffix is node 4 and its subtree {6}: their agent tokens get
    # clip_low = 0.2 + 0.115 = 0.315, every other token 0.2 (4's tool output too).
    # clip_high = 0.315 everywhere.
    assert credit.clip_low is not None and credit.clip_high is not None
    np.testing.assert_allclose(credit.clip_low, [.2, .2, .2, .2, .2, .2, .315, .2, .315, .315,
                                                 .2, .2])
    np.testing.assert_allclose(credit.clip_high, [0.315] * 12)

    # lambda 0 is plain group credit (Abar_t everywhere); lambda 1 pure branch credit.
    plain = by_row(batch, elpo(batch, ElpoParams(lambda_tree=0.0)).node)
    assert plain[("bel", 1)] == pytest.approx(bar1) and plain[("bel", 4)] == pytest.approx(at_lose)
    branch = by_row(batch, elpo(batch, ElpoParams(lambda_tree=1.0)).node)
    assert branch[("bel", 3)] == pytest.approx(ab3) and branch[("bel", 5)] == pytest.approx(at_lose)
    # off_branch="scaled" (A_b := 0 off branch points): the root and 5, 6 get 0.5 * Abar_t.
    scaled = by_row(batch, elpo(batch, ElpoParams(off_branch="scaled")).node)
    assert scaled[("bel", 6)] == pytest.approx(0.5 * at_lose)
    assert scaled[("bel", 3)] == pytest.approx(expected[("bel", 3)])


def test_equal_siblings_and_lone_trajectory_give_zero() -> None:
    # 0 -> {1: R=1, 2: R=1}: sigma_b = 0 -> A_b = 0, and zero-variance E5 -> A_t = 0.
    # A lone chain (one trajectory) has no branch and a group of one -> 0 everywhere.
    tie = Tree(tree_id="tie", task_id="x", nodes=[
        node(0, None, 1), node(1, 0, reward=1.0), node(2, 0, reward=1.0)])
    lone = Tree(tree_id="lone", task_id="y", critical_node_id=1, nodes=[
        node(0, None, 1), node(1, 0), node(2, 1, reward=3.0)])
    credit = elpo(from_trees([tie, lone]), ElpoParams())
    assert np.all(credit.node == 0.0) and np.all(credit.token == 0.0)
    assert credit.clip_low is not None
    np.testing.assert_allclose(credit.clip_low, [0.2] * 3 + [0.2, 0.315, 0.315])


# ----------------------------------------------------------------- 2. reference loop
def ref_elpo(trees: list[Tree], p: ElpoParams) -> tuple[dict[Key, float], dict[Key, bool]]:
    """E3-E8 one tree at a time with dicts: (A_hier by node, critical-suffix flag by node)."""
    # E5: z-scores of the trajectories of each tree (or each task).
    members: dict[Hashable, list[tuple[str, int, float]]] = {}
    for t in trees:
        for leaf in t.leaves():
            assert leaf.reward is not None
            g: Hashable = t.tree_id if p.group == "tree" else group_key(t)
            members.setdefault(g, []).append((t.tree_id, leaf.node_id, leaf.reward))
    a_t: dict[Key, float] = {}
    for rows in members.values():
        for (tid, nid, _), z in zip(rows, ref_zscore([r for *_, r in rows], p.std, p.eps),
                                    strict=True):
            a_t[(tid, nid)] = z
    a_hier: dict[Key, float] = {}
    critical: dict[Key, bool] = {}
    for t in trees:
        kids = t.children()
        # E3: r bottom-up (reverse preorder visits children before parents).
        r: dict[int, float] = {}
        for n in reversed(list(t.preorder())):
            if kids[n.node_id]:
                r[n.node_id] = sum(r[c] for c in kids[n.node_id]) / len(kids[n.node_id])
            else:
                assert n.reward is not None
                r[n.node_id] = n.reward
        # E4: siblings under each branching node.
        a_b: dict[int, float] = {}
        for cs in kids.values():
            if len(cs) > 1:
                for c, z in zip(cs, ref_zscore([r[c] for c in cs], p.std, p.eps), strict=True):
                    a_b[c] = z
        # E6: mean A_t over the trajectories whose path contains the node.
        paths = {leaf.node_id: [n.node_id for n in t.path_to(leaf.node_id)]
                 for leaf in t.leaves()}
        for n in t.nodes:
            through = [a_t[(t.tree_id, lid)] for lid, path in paths.items() if n.node_id in path]
            bar = sum(through) / len(through)
            if n.node_id in a_b:  # E7
                value = p.lambda_tree * a_b[n.node_id] + (1 - p.lambda_tree) * bar
            else:
                value = bar if p.off_branch == "trajectory" else (1 - p.lambda_tree) * bar
            a_hier[(t.tree_id, n.node_id)] = value
            # E8: the node is at or below the critical node on its path.
            path_to_n = [m.node_id for m in t.path_to(n.node_id)]
            critical[(t.tree_id, n.node_id)] = t.critical_node_id in path_to_n
    return a_hier, critical


def ref_token_arrays(trees: list[Tree], batch: TreeArrays, a_hier: dict[Key, float],
                     critical: dict[Key, bool], p: ElpoParams
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(token advantages, clip_low) in the batch's token layout."""
    by_key = {(t.tree_id, n.node_id): n for t in trees for n in t.nodes}
    token: list[float] = []
    low: list[float] = []
    for t, nid in zip(batch.node_tree, batch.node_ids, strict=True):
        key = (batch.tree_ids[t], int(nid))
        n_act = len(by_key[key].action_token_ids)
        n_obs = len(by_key[key].observation_token_ids)
        token += [a_hier[key]] * n_act + [0.0] * n_obs
        crit = p.eps_low + p.eps_elc if critical[key] else p.eps_low
        low += [crit] * n_act + [p.eps_low] * n_obs
    return np.array(token), np.array(low)


@st.composite
def batches(draw: st.DrawFn, max_size: int = 4) -> list[Tree]:
    """Random trees, several sharing a task; some with a critical inner node."""
    trees = draw(tree_lists(max_size=max_size, max_nodes=20))
    out = []
    for t in trees:
        crit = draw(st.one_of(st.just(t.critical_node_id), st.none(),
                              st.sampled_from([n.node_id for n in t.nodes])))
        out.append(replace(t, task_id=draw(st.sampled_from(["u", "v"])), critical_node_id=crit))
    return out


PARAMS = st.builds(ElpoParams, lambda_tree=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
                   std=st.sampled_from(["unbiased", "population", "none"]),
                   group=st.sampled_from(["tree", "task"]),
                   off_branch=st.sampled_from(["trajectory", "scaled"]),
                   eps=st.sampled_from([1e-6, 0.0]), eps_elc=st.sampled_from([0.115, 0.3]))


def assert_matches_reference(trees: list[Tree], batch: TreeArrays, credit: Credit,
                             p: ElpoParams) -> None:
    a_hier, critical = ref_elpo(trees, p)
    got = by_row(batch, credit.node)
    assert got.keys() == a_hier.keys()
    keys = sorted(a_hier)
    np.testing.assert_allclose([got[k] for k in keys], [a_hier[k] for k in keys],
                               rtol=1e-9, atol=1e-8, equal_nan=True)
    token, low = ref_token_arrays(trees, batch, a_hier, critical, p)
    np.testing.assert_allclose(credit.token, token, rtol=1e-9, atol=1e-8, equal_nan=True)
    assert credit.clip_low is not None and credit.clip_high is not None
    np.testing.assert_allclose(credit.clip_low, low, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(credit.clip_high, np.full(batch.n_tokens, p.eps_high))


@SETTINGS
@given(trees=batches(), params=PARAMS)
def test_elpo_matches_reference(trees: list[Tree], params: ElpoParams) -> None:
    batch = from_trees(trees)
    assert_matches_reference(trees, batch, elpo(batch, params), params)


def test_elpo_deep_and_wide_tree_matches_reference() -> None:
    # A 300-step chain with a branch every 50 steps (the level loop at depth),
    # next to a star of 40 leaves (one wide level).
    nodes = [node(0, None, 1)]
    for i in range(1, 300):
        nodes.append(node(i, i - 1, 1, 1, reward=None))
        if i % 50 == 0:
            nodes.append(node(1000 + i, i - 1, 2, reward=float(i % 3)))
    nodes.append(node(300, 299, 1, reward=1.0))
    deep = Tree(tree_id="deep", task_id="x", critical_node_id=150, nodes=nodes)
    star = Tree(tree_id="star", task_id="x", nodes=[node(0, None, 0, 1)] + [
        node(i, 0, 1, reward=float(i % 4)) for i in range(1, 41)])
    trees = [deep, star]
    batch = from_trees(trees)
    for p in (ElpoParams(), ElpoParams(group="task", std="population")):
        assert_matches_reference(trees, batch, elpo(batch, p), p)


# ----------------------------------------------------------------- 3. invariants
def test_unbranched_tree_has_no_branch_credit() -> None:
    # A chain is one trajectory: with several chains of one task (group="task") every
    # step carries its trajectory's z-score, whatever lambda_tree: E4 never applies.
    def chain(tid: str, r: float) -> Tree:
        return Tree(tree_id=tid, task_id="x", nodes=[
            node(0, None, 0, 2), node(1, 0, 2, 1), node(2, 1, 1, 1), node(3, 2, 2, reward=r)])
    batch = from_trees([chain("c1", 1.0), chain("c2", 0.0), chain("c3", 0.0)])
    # R = 1, 0, 0: mean 1/3, unbiased std sqrt(1/3) -> 1.154700, -0.577350, -0.577350.
    s = math.sqrt(1 / 3)
    expected = np.repeat([(2 / 3) / (s + EPS), (-1 / 3) / (s + EPS), (-1 / 3) / (s + EPS)], 4)
    for lam in (0.0, 0.5, 1.0):
        credit = elpo(batch, ElpoParams(lambda_tree=lam, group="task"))
        np.testing.assert_allclose(credit.node, expected, atol=1e-12)


@QUICK
@given(trees=batches(max_size=3), params=PARAMS, data=st.data())
def test_splitting_an_unbranched_step_changes_nothing(trees: list[Tree], params: ElpoParams,
                                                       data: st.DataObject) -> None:
    # Off the branch points (the root, or an only child) a step split in two keeps every
    # token's advantage and clip bound. (A child of a branching node would not: E7 gives
    # branch credit to the first half only, since the second half's parent has one child.)
    b = data.draw(st.integers(0, len(trees) - 1))
    kids = trees[b].children()
    parent = {n.node_id: n.parent_id for n in trees[b].nodes}
    off_branch = [nid for nid, par in parent.items() if par is None or len(kids[par]) == 1]
    victim = data.draw(st.sampled_from(off_branch))
    before = [replace(t, nodes=[replace(n, segments=[], action_entropies=[]) for n in t.nodes])
              for t in trees]
    after = list(before)
    after[b] = split_step(before[b], victim)
    x, y = from_trees(before), from_trees(after)
    cx, cy = elpo(x, params), elpo(y, params)
    np.testing.assert_allclose(cx.token, cy.token, rtol=1e-9, atol=1e-10)
    np.testing.assert_array_equal(cx.clip_low, cy.clip_low)


@QUICK
@given(trees=batches(max_size=3), data=st.data())
def test_tool_output_never_gets_or_changes_advantage(trees: list[Tree],
                                                     data: st.DataObject) -> None:
    more = with_more_tool_output(trees, data)
    x, y = from_trees(trees), from_trees(more)
    cx, cy = elpo(x, ElpoParams()), elpo(y, ElpoParams())
    for batch, credit in ((x, cx), (y, cy)):
        assert np.all(credit.token[~batch.agent_mask] == 0.0)
        assert credit.clip_low is not None
        assert np.all(credit.clip_low[~batch.agent_mask] == 0.2)  # no ELC on tool output
    np.testing.assert_array_equal(cx.node, cy.node)
    np.testing.assert_array_equal(cx.token[x.agent_mask], cy.token[y.agent_mask])


@QUICK
@given(trees=batches(), params=PARAMS, data=st.data())
def test_order_of_trees_does_not_matter(trees: list[Tree], params: ElpoParams,
                                        data: st.DataObject) -> None:
    x, y = from_trees(trees), from_trees(data.draw(st.permutations(trees)))
    cx, cy = elpo(x, params), elpo(y, params)
    gx, gy = by_row(x, cx.node), by_row(y, cy.node)
    keys = sorted(gx)
    np.testing.assert_allclose([gx[k] for k in keys], [gy[k] for k in keys], rtol=1e-9,
                               atol=1e-10)
    assert cx.clip_low is not None and cy.clip_low is not None
    tx, ty = agent_tokens_of(x, cx.token), agent_tokens_of(y, cy.token)
    lx, ly = agent_tokens_of(x, cx.clip_low), agent_tokens_of(y, cy.clip_low)
    for k in keys:
        np.testing.assert_allclose(tx[k], ty[k], rtol=1e-9, atol=1e-10)
        assert lx[k] == ly[k]


def test_registered_and_params_checked() -> None:
    assert ESTIMATORS["elpo"].params_type is ElpoParams
    p = ElpoParams()
    assert (p.lambda_tree, p.eps_low, p.eps_elc, p.eps_high) == (0.5, 0.2, 0.115, 0.315)
    assert ESTIMATORS["elpo"].parse_params({"lambda_tree": "0.25"}).lambda_tree == 0.25
    with pytest.raises(ValueError, match="lambda_tree"):
        ElpoParams(lambda_tree=1.5)
    with pytest.raises(ValueError, match="off_branch"):
        ElpoParams(off_branch="zero")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps_low"):
        ElpoParams(eps_low=0.9, eps_elc=0.2)
