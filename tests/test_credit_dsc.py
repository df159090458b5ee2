"""DSC-Gate (METHODS D3-D5 transport, D7-D10 gate) tested three ways:

1. hand-computed trees and gate cases (numbers worked out in the comments);
2. a slow per-trajectory reference loop, written straight from D3-D5 on
   ``Tree`` objects, against the vectorised estimator on random batches;
3. invariants: transport with pi = mu equals reuse (D4), observation tokens,
   batch order, path sums.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
from credit_helpers import by_row, node, random_trees
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_store.tree import Node, Tree
from train.credit import ESTIMATORS
from train.credit.base import TreeArrays, from_trees, path_sum
from train.credit.dsc import RATIO, STATE, DSCParams, dsc, transport_returns
from train.credit.dsc_gate import (
    DSCGateParams,
    GatePairs,
    calibrate_kappa,
    calibrate_radii,
    dsc_gate,
    gate_decision,
)


def _node(nid: int, parent: int | None, reward: float | None = None, n_act: int = 1,
          n_obs: int = 1) -> Node:
    return node(nid, parent, [11] * n_act, [22] * n_obs, reward)


# ----------------------------------------------------------------- 1. hand-computed
#   r(0) -+- a(1) --- s(2) -+- L1(3)  R=1     preorder leaf rank 0 -> fold 0
#         |                 +- L2(4)  R=0     rank 1 -> fold 1
#         +- b(5) -+- L3(6)  R=1              rank 2 -> fold 0
#                  +- L4(7)  R=0              rank 3 -> fold 1
# ratio (pi/mu) and state id (S_t, h_t) of each depth >= 2 node:
#   s: 2.0 (z=1), state 7;  L1: 1.0 (z=0), state 8;  L2: 1.0 (z=0), state 8;
#   L3: 0.5 (z=-.5), state 7;  L4: 3.0 (z=2), state 9.
# Baselines (D4, cross-fitted): b^0 from fold-0 visits: state 7 visited by L1 (via s)
# and L3, both R=1 -> 1; state 8 by L1 -> 1; state 9 never -> fold-0 tree mean 1.
# b^1 from fold-1 visits: state 7 by L2 (via s) -> 0; state 8 by L2 -> 0; state 9 by L4 -> 0.
# T_i = R_i + sum_t z_t (R_i - b_t), b from the OTHER fold:
#   L1 (fold 0, b^1): 1 + 1*(1 - 0) + 0 = 2
#   L2 (fold 1, b^0): 0 + 1*(0 - 1) + 0 = -1
#   L3 (fold 0, b^1): 1 - .5*(1 - 0) = .5
#   L4 (fold 1, b^0): 0 + 2*(0 - 1) = -2
# Q_T(a) = (2 - 1)/2 = .5, Q_T(b) = (.5 - 2)/2 = -.75; Q_R(a) = Q_R(b) = .5.
_HAND = Tree("h", [_node(0, None, n_act=0), _node(1, 0), _node(2, 1), _node(3, 2, 1.0),
                   _node(4, 2, 0.0), _node(5, 0, n_act=2), _node(6, 5, 1.0),
                   _node(7, 5, 0.0, n_act=3)])
_HAND_RATIO = np.array([np.nan, np.nan, 2.0, 1.0, 1.0, np.nan, 0.5, 3.0])
_HAND_STATE = np.array([-1, -1, 7, 8, 8, -1, 7, 9])


def _hand_batch(ratio: np.ndarray = _HAND_RATIO) -> TreeArrays:
    return from_trees([_HAND], extras={RATIO: ratio, STATE: _HAND_STATE})


def test_transport_by_hand() -> None:
    batch = _hand_batch()
    tr = transport_returns(batch)
    assert tr.fold.tolist() == [0, 1, 0, 1]
    np.testing.assert_allclose(tr.transported, [2.0, -1.0, 0.5, -2.0])
    credit = dsc(batch, DSCParams())
    node = by_row(batch, credit.node)
    # leaves: T_i; root actions: Q_T; s: mean over L1, L2; root: mean over a, b = -.125
    assert [node[("h", i)] for i in range(8)] == pytest.approx(
        [-0.125, 0.5, 0.5, 2.0, -1.0, -0.75, 0.5, -2.0])
    # tokens: below a, Q_T(a) - (-.125) = .625; below b, -.75 + .125 = -.625; root none
    expected = np.repeat([0.625, 0.625, 0.625, 0.625, -0.625, -0.625, -0.625],
                         [1, 1, 1, 1, 2, 1, 3])
    np.testing.assert_allclose(credit.token[batch.agent_mask], expected)
    assert (credit.token[~batch.agent_mask] == 0).all()
    # reuse: plain means, Q_R(a) = Q_R(b) = .5 -> every advantage 0
    reuse = dsc(batch, DSCParams(mode="reuse"))
    assert [float(v) for v in reuse.node] == [0.5, 0.5, 0.5, 1.0, 0.0, 0.5, 1.0, 0.0]
    assert (reuse.token == 0).all()


def test_gate_on_the_hand_tree() -> None:
    # Leader by reuse credit: Q_R tie (.5, .5) -> the first in preorder, a.
    # c_R = 0, c_T = .5 - (-.75) = 1.25, delta = 1.25. N = 2 per action, floor 1/(4*4) = 1/16.
    # s_R^2: R_a = (1, 0) sample var .5 -> .5/2 = .25; same for b -> s_R = sqrt(.5)
    # s_T^2: T_a = (2, -1) var 4.5 -> 2.25; T_b = (.5, -2) var 3.125 -> 1.5625; s_T^2 = 3.8125
    # s_D^2 (D = T - R): D_a = (1, -1) var 2 -> 1; D_b = (-.5, -2) var 1.125 -> .5625; = 1.5625
    # (keeping cov(T, R): not s_T^2 + s_R^2 = 4.3125).
    pairs = dsc_gate(_hand_batch(), DSCGateParams(kappa_R=1, kappa_delta=1, kappa_T=1))
    assert pairs.leader.tolist() == [1] and pairs.competitor.tolist() == [5]
    assert pairs.c_R.tolist() == [0.0] and pairs.c_T.tolist() == [1.25]
    assert pairs.delta.tolist() == [1.25]
    np.testing.assert_allclose(pairs.s_R, [math.sqrt(0.5)])
    np.testing.assert_allclose(pairs.s_T, [math.sqrt(3.8125)])
    np.testing.assert_allclose(pairs.s_delta, [1.25])
    # D8: 0 - .707 > 1.25 + 1.25? no. D9: 1.25 > 1.953? no -> D10 refresh.
    assert pairs.decision.tolist() == ["refresh"]
    # kappa_T = .5: r_T = .976 < 1.25 -> transport.
    assert dsc_gate(_hand_batch(), DSCGateParams(kappa_T=0.5)).decision.tolist() == ["transport"]
    # residual variance widens r_T again: s_T^2 = 3.8125 + 3 -> r_T = .5 * 2.61 = 1.305 -> refresh
    wide = DSCGateParams(kappa_T=0.5, residual_var_T=3.0)
    assert dsc_gate(_hand_batch(), wide).decision.tolist() == ["refresh"]


# Two levels: the comparison at the inner branching node a (its children x, y) is
# anchored at a (D4): x and y are its forced actions, the downstream steps are the nodes
# two or more levels below a (L1, L2, L3), the trajectories the leaves below a.
#   r(0) -+- a(1) -+- x(2) --- L1(3)  R=1      leaf rank below a: 0 -> fold 0
#         |        +- y(4) -+- L2(5)  R=0      rank 1 -> fold 1
#         |                 +- L3(6)  R=1      rank 2 -> fold 0
#         +- b(7) --- L4(8)  R=0               (not below a: out of scope)
# ratios: x 3.0, y 1.0 (forced at a: ignored there), L1 2.0 (z=1) state 5,
#   L2 .5 (z=-.5) state 6, L3 1.5 (z=.5) state 6.
# b^0 (fold 0 = L1, L3): state 5 -> R_L1 = 1, state 6 -> R_L3 = 1.
# b^1 (fold 1 = L2): state 5 never -> fold-1 mean 0; state 6 -> R_L2 = 0.
#   L1 (fold 0, b^1): 1 + 1 * (1 - 0) = 2
#   L2 (fold 1, b^0): 0 - .5 * (0 - 1) = .5
#   L3 (fold 0, b^1): 1 + .5 * (1 - 0) = 1.5
_TWO = Tree("two", [_node(0, None, n_act=0), _node(1, 0), _node(2, 1), _node(3, 2, 1.0),
                    _node(4, 1), _node(5, 4, 0.0), _node(6, 4, 1.0), _node(7, 0),
                    _node(8, 7, 0.0)])
_TWO_RATIO = np.array([np.nan, np.nan, 3.0, 2.0, 1.0, 0.5, 1.5, np.nan, 1.0])
_TWO_STATE = np.array([-1, -1, 1, 5, 1, 6, 6, -1, 7])


def test_transport_anchored_at_an_inner_node_by_hand() -> None:
    batch = from_trees([_TWO], extras={RATIO: _TWO_RATIO, STATE: _TWO_STATE})
    row = {int(i): r for r, i in enumerate(batch.node_ids)}
    a = np.array([row[1]])
    tr = transport_returns(batch, anchor=a)
    assert [int(batch.node_ids[r]) for r in tr.leaf] == [3, 5, 6]
    assert [int(batch.node_ids[r]) for r in tr.action] == [2, 4, 4]
    assert tr.fold.tolist() == [0, 1, 0]
    np.testing.assert_allclose(tr.transported, [2.0, 0.5, 1.5])
    # the forced actions' own ratios do not enter the comparison at a ...
    other = _TWO_RATIO.copy()
    other[[2, 4]] = [0.25, 4.0]
    moved = transport_returns(from_trees([_TWO], extras={RATIO: other, STATE: _TWO_STATE}),
                              anchor=a)
    np.testing.assert_allclose(moved.transported, tr.transported)
    # ... while the root-level rule counts them (x is a downstream step of the root)
    root = transport_returns(from_trees([_TWO], extras={RATIO: other, STATE: _TWO_STATE}))
    assert root.transported[0] != pytest.approx(2.0)
    # the root as explicit anchor is the default
    np.testing.assert_allclose(transport_returns(batch, anchor=np.array([row[0]])).transported,
                               transport_returns(batch).transported)
    # gate at a: Q_R(x) = 1 > Q_R(y) = .5 -> leader x; c_R = .5, c_T = 2 - 1 = 1, delta = .5
    # s_R^2: x N=1 -> floor 1/4; y var(0, 1) = .5 / 2 = .25 -> .5
    # s_T^2: x floor 1/4; y var(.5, 1.5) = .5 / 2 = .25 -> .5
    # s_D^2: x floor 1/4; y D = (.5, .5) var 0 -> floor 1/16 -> .3125
    pairs = dsc_gate(batch, DSCGateParams(kappa_R=1, kappa_delta=1, kappa_T=1), anchor=a)
    assert pairs.leader.tolist() == [row[2]] and pairs.competitor.tolist() == [row[4]]
    np.testing.assert_allclose([pairs.c_R[0], pairs.c_T[0], pairs.delta[0]], [0.5, 1.0, 0.5])
    np.testing.assert_allclose([pairs.s_R[0], pairs.s_T[0], pairs.s_delta[0]],
                               np.sqrt([0.5, 0.5, 0.3125]))
    # D8: .5 - .707 > .5 + .559? no; D9: 1 > .707 -> transport
    assert pairs.decision.tolist() == ["transport"]
    with pytest.raises(ValueError, match="anchor"):
        transport_returns(batch, anchor=np.array([0, 1]))


def test_gate_reuse_branch_with_variance_floor() -> None:
    # Two root actions with 4 trajectories each, a always succeeds, b never; pi = mu.
    # c_R = 1, delta = 0. All sample variances are 0, so each mean's variance is the
    # floor 1/(4 * 4^2) = 1/64: s_R = s_delta = sqrt(2/64) = .1768, r = 2 * .1768 = .3536.
    # D8: 1 - .3536 = .6464 > 0 + .3536 -> reuse.
    nodes = [_node(0, None), _node(1, 0), _node(2, 0)]
    nodes += [_node(10 + i, 1, 1.0) for i in range(4)] + [_node(20 + i, 2, 0.0)
                                                          for i in range(4)]
    batch = from_trees([Tree("f", nodes)], extras={RATIO: np.ones(11),
                                                   STATE: np.zeros(11, np.int64)})
    pairs = dsc_gate(batch, DSCGateParams())
    np.testing.assert_allclose(pairs.s_R, [math.sqrt(2 / 64)])
    np.testing.assert_allclose(pairs.s_delta, [math.sqrt(2 / 64)])
    assert pairs.c_R.tolist() == [1.0] and pairs.delta.tolist() == [0.0]
    assert pairs.decision.tolist() == ["reuse"]
    # kappa_R = 3: 1 - .53 = .47 > .35? yes, still reuse; kappa_R = 5: .116 > .354? no ->
    # D9: |c_T| = 1 > r_T = .354 -> transport.
    assert dsc_gate(batch, DSCGateParams(kappa_R=5)).decision.tolist() == ["transport"]


def test_gate_decision_each_branch() -> None:
    # columns: c_R, delta, c_T, r_R, r_delta, r_T
    cases = [
        (0.5, 0.1, 0.6, 0.1, 0.1, 0.1, "reuse"),  # D8: .5 - .1 = .4 > .1 + .1
        (-0.5, -0.1, -0.6, 0.1, 0.1, 0.1, "reuse"),  # D8 uses absolute values
        (0.1, 0.3, 0.4, 0.1, 0.1, 0.2, "transport"),  # D8: 0 > .4 no; D9: .4 > .2
        (0.3, 0.0, 0.3, 0.1, 0.2, 0.1, "transport"),  # D8 tie .2 > .2 is false -> D9
        (0.1, 0.05, 0.15, 0.1, 0.1, 0.2, "refresh"),  # D8 no; D9: .15 > .2 no -> D10
        (0.1, 0.1, 0.2, 0.1, 0.1, 0.2, "refresh"),  # D9 tie: strict -> refresh
    ]
    cols = np.array([c[:6] for c in cases], np.float64).T
    assert gate_decision(*cols).tolist() == [c[6] for c in cases]


def test_calibrate_kappa_order_statistic() -> None:
    rng = np.random.default_rng(0)
    # 96 tasks at level .95: the ceil(97 * .95) = 93rd smallest (METHODS D7).
    errors = rng.permutation(np.arange(1.0, 97.0))
    assert calibrate_kappa(errors) == 93.0
    # per-task maxima over (pairs, updates, seeds) are taken first; signs dropped
    per_task = np.zeros((96, 2, 3))
    per_task[:, 1, 2] = -errors
    assert calibrate_kappa(per_task) == 93.0
    # n = 19: ceil(20 * .95) = 19 -> the largest; n = 10: ceil(11 * .95) = 11 > 10 -> inf
    assert calibrate_kappa(np.arange(1.0, 20.0)) == 19.0
    assert calibrate_kappa(np.arange(1.0, 11.0)) == math.inf
    # level .5, n = 4: ceil(2.5) = 3rd smallest
    assert calibrate_kappa(np.array([4.0, 1.0, 3.0, 2.0]), level=0.5) == 3.0
    with pytest.raises(ValueError):
        calibrate_kappa(np.array([]))


def test_registered_and_errors() -> None:
    assert ESTIMATORS["dsc"].params_type is DSCParams
    assert ESTIMATORS["dsc"].parse_params({"mode": "reuse"}) == DSCParams(mode="reuse")
    with pytest.raises(ValueError, match="mode"):
        DSCParams(mode="bogus")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=RATIO):
        dsc(from_trees([_HAND], extras={STATE: _HAND_STATE}), DSCParams())
    bad = _HAND_RATIO.copy()
    bad[3] = -1.0
    with pytest.raises(ValueError, match="node 3"):
        dsc(_hand_batch(bad), DSCParams())


# ----------------------------------------------------------------- 2. reference loop
def _prepare(trees: list[Tree], seed: int) -> tuple[list[Tree], np.ndarray, np.ndarray]:
    """0/1 (or float) rewards; random ratios (some exactly 1) and few states (collisions)."""
    rng = np.random.default_rng(seed)
    out = [replace(t, nodes=[replace(n, reward=float(rng.integers(0, 2)))
                             if n.reward is not None and rng.random() < 0.8 else n
                             for n in t.nodes]) for t in trees]
    n_nodes = sum(len(t.nodes) for t in out)
    ratio = rng.uniform(0.0, 3.0, n_nodes)
    ratio[rng.random(n_nodes) < 0.3] = 1.0
    state = rng.integers(0, 4, n_nodes)
    return out, ratio, state


def _reference(trees: list[Tree], ratio: np.ndarray, state: np.ndarray,
               mode: str) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], float]]:
    """D3-D5 per trajectory; returns (node credit, per-node token advantage)."""
    node_value: dict[tuple[str, int], float] = {}
    advantage: dict[tuple[str, int], float] = {}
    i = 0
    for t in trees:
        z = {}
        s = {}
        for n in t.nodes:
            z[n.node_id] = ratio[i] - 1.0
            s[n.node_id] = int(state[i])
            i += 1
        paths = [t.path_to(leaf.node_id) for leaf in t.leaves()]
        paths = [p for p in paths if len(p) >= 2]  # a trajectory starts with a root action
        folds = [rank % 2 for rank in range(len(paths))]
        visits: dict[tuple[int, int], list[float]] = defaultdict(list)
        fold_returns: dict[int, list[float]] = defaultdict(list)
        for path, f in zip(paths, folds, strict=True):
            r = path[-1].reward
            assert r is not None
            fold_returns[f].append(r)
            for step in path[2:]:
                visits[(f, s[step.node_id])].append(r)
        through: dict[int, list[float]] = defaultdict(list)
        for path, f in zip(paths, folds, strict=True):
            r = path[-1].reward
            assert r is not None
            total = r
            for step in path[2:]:  # D3: the forced root action (path[1]) is excluded
                other = visits.get((1 - f, s[step.node_id]))
                if other:
                    b = sum(other) / len(other)
                elif fold_returns[1 - f]:
                    b = sum(fold_returns[1 - f]) / len(fold_returns[1 - f])
                else:
                    b = 0.0
                total += z[step.node_id] * (r - b)  # D4
            for n in path[1:]:
                through[n.node_id].append(total if mode == "transport" else r)
        q = {n: sum(v) / len(v) for n, v in through.items()}
        root = t.root().node_id
        actions = t.children()[root]
        baseline = sum(q[a] for a in actions) / len(actions) if actions else math.nan
        for n in t.nodes:
            key = (t.tree_id, n.node_id)
            node_value[key] = baseline if n.node_id == root else q[n.node_id]
            path = t.path_to(n.node_id)
            advantage[key] = 0.0 if len(path) < 2 else q[path[1].node_id] - baseline
    return node_value, advantage


@settings(max_examples=30, deadline=None)
@given(trees=random_trees(), seed=st.integers(0, 2**32 - 1),
       mode=st.sampled_from(["transport", "reuse"]))
def test_matches_reference_loop(trees: list[Tree], seed: int, mode: str) -> None:
    trees, ratio, state = _prepare(trees, seed)
    batch = from_trees(trees, extras={RATIO: ratio, STATE: state})
    credit = dsc(batch, DSCParams(mode=mode))  # type: ignore[arg-type]
    ref_node, ref_adv = _reference(trees, ratio, state, mode)
    keys = list(zip([batch.tree_ids[t] for t in batch.node_tree],
                    batch.node_ids.tolist(), strict=True))
    np.testing.assert_allclose(credit.node, [ref_node[k] for k in keys], rtol=1e-9, atol=1e-9)
    adv = np.repeat([ref_adv[k] for k in keys], np.diff(batch.token_offsets))
    np.testing.assert_allclose(credit.token, np.where(batch.agent_mask, adv, 0.0),
                               rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------- 3. invariants
@settings(max_examples=25, deadline=None)
@given(trees=random_trees(), seed=st.integers(0, 2**32 - 1))
def test_transport_with_pi_equal_mu_is_reuse(trees: list[Tree], seed: int) -> None:
    # D4: every z = 0, so T_i = R_i exactly, whatever the baselines.
    trees, _, state = _prepare(trees, seed)
    ratio = np.ones(state.size)
    batch = from_trees(trees, extras={RATIO: ratio, STATE: state})
    transport = dsc(batch, DSCParams(mode="transport"))
    reuse = dsc(batch, DSCParams(mode="reuse"))
    np.testing.assert_array_equal(transport.node, reuse.node)
    np.testing.assert_array_equal(transport.token, reuse.token)
    pairs = dsc_gate(batch, DSCGateParams())
    np.testing.assert_array_equal(pairs.delta, 0.0)


@settings(max_examples=25, deadline=None)
@given(trees=random_trees(), seed=st.integers(0, 2**32 - 1),
       perm_seed=st.integers(0, 1000))
def test_batch_order_and_observation_tokens(trees: list[Tree], seed: int,
                                            perm_seed: int) -> None:
    trees, ratio, state = _prepare(trees, seed)
    batch = from_trees(trees, extras={RATIO: ratio, STATE: state})
    credit = dsc(batch, DSCParams())
    assert (credit.token[~batch.agent_mask] == 0).all()  # tool output never gets advantage
    pairs = dsc_gate(batch, DSCGateParams())

    starts = np.cumsum([0] + [len(t.nodes) for t in trees])
    order = np.random.default_rng(perm_seed).permutation(len(trees))

    def cat(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x[starts[i]:starts[i + 1]] for i in order])

    shuffled = from_trees([trees[i] for i in order], extras={RATIO: cat(ratio),
                                                             STATE: cat(state)})
    base = by_row(batch, credit.node)
    other = by_row(shuffled, dsc(shuffled, DSCParams()).node)
    assert base.keys() == other.keys()
    for key, value in base.items():
        assert other[key] == pytest.approx(value, rel=1e-9, abs=1e-9, nan_ok=True)
    # the gate resolves the same pairs the same way
    moved = dsc_gate(shuffled, DSCGateParams())

    def decisions(p: GatePairs, b: TreeArrays) -> dict[tuple[str, int, int], str]:
        return {(b.tree_ids[t], int(b.node_ids[lead]), int(b.node_ids[comp])): str(dec)
                for t, lead, comp, dec in zip(p.tree, p.leader, p.competitor, p.decision,
                                              strict=True)}

    assert decisions(pairs, batch) == decisions(moved, shuffled)

    # other observation token ids (same lengths) change nothing
    recoded = [replace(t, nodes=[replace(n, observation_token_ids=[7] * len(
        n.observation_token_ids)) for n in t.nodes]) for t in trees]
    again = dsc(from_trees(recoded, extras={RATIO: ratio, STATE: state}), DSCParams())
    np.testing.assert_array_equal(again.token, credit.token)


@settings(max_examples=20, deadline=None)
@given(trees=random_trees(max_trees=3, max_nodes=25), seed=st.integers(0, 2**32 - 1))
def test_path_sum_is_the_sum_over_ancestors(trees: list[Tree], seed: int) -> None:
    batch = from_trees(trees)
    values = np.random.default_rng(seed).normal(size=batch.n_nodes)
    got = path_sum(batch, values)
    for v in range(batch.n_nodes):
        total, cur = 0.0, v
        while cur >= 0:
            total += values[cur]
            cur = batch.parent[cur]
        assert got[v] == pytest.approx(total, abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(trees=random_trees(), seed=st.integers(0, 2**32 - 1))
def test_anchored_transport_is_the_subtree_s_own(trees: list[Tree], seed: int) -> None:
    """Anchored at any node v (D4), the transport of a tree equals the root-level
    transport of v's subtree taken as a tree of its own (v its root)."""
    trees, ratio, state = _prepare(trees, seed)
    batch = from_trees(trees, extras={RATIO: ratio, STATE: state})
    rng = np.random.default_rng(seed)
    anchor = np.array([rng.choice(np.flatnonzero(batch.node_tree == b))
                       for b in range(batch.n_trees)])
    got = transport_returns(batch, anchor=anchor)
    for b in range(batch.n_trees):
        v = int(anchor[b])
        rows = np.arange(v, v + int(batch.subtree_size[v]))
        ids = batch.node_ids[rows].tolist()
        tree = next(t for t in trees if t.tree_id == batch.tree_ids[b])
        by_id = {n.node_id: n for n in tree.nodes}
        sub = Tree(f"{tree.tree_id}/sub", [replace(by_id[i], parent_id=None) if i == ids[0]
                                         else by_id[i] for i in ids])
        alone = transport_returns(from_trees(
            [sub], extras={RATIO: batch.extras[RATIO][rows], STATE: batch.extras[STATE][rows]}))
        mine = got.tree == b
        assert [ids[r] for r in alone.leaf] == batch.node_ids[got.leaf[mine]].tolist()
        np.testing.assert_allclose(got.transported[mine], alone.transported,
                                   rtol=1e-12, atol=1e-12)
        assert [ids[r] for r in alone.action] == batch.node_ids[got.action[mine]].tolist()


def test_calibrate_radii_is_the_gate_study_s_calibration() -> None:
    """``dsc_gate.calibrate_radii`` (used by the trainer's reuse) gives exactly what the
    gate study's ``calibrate`` gives, and hand values on a two-tree case."""
    from train.studies.gates import calibrate

    rng = np.random.default_rng(3)
    trees = [Tree(f"c{k}", [_node(0, None), _node(1, 0), _node(2, 0),
                            *[_node(3 + i, 1, float(rng.integers(0, 2))) for i in range(4)],
                            *[_node(7 + i, 2, float(rng.integers(0, 2))) for i in range(4)]])
             for k in range(6)]
    batch = from_trees(trees, extras={RATIO: rng.uniform(0.5, 1.5, 66),
                                      STATE: np.zeros(66, np.int64)})
    pairs = dsc_gate(batch, DSCGateParams(kappa_R=1, kappa_delta=1, kappa_T=1))
    c_mu, c_pi = rng.normal(0, 0.3, (2, pairs.tree.size))
    split = ["dev", "calib", "dev", "calib", "calib", "eval"]
    assert calibrate_radii([(pairs, c_mu, c_pi)], split, 0.5) == calibrate(
        [(pairs, c_mu, c_pi)], split, 0.5)  # type: ignore[arg-type]
    # by hand: kappa_T at level .5 over 3 calib trees = the ceil(4 * .5) = 2nd smallest
    got = calibrate_radii([(pairs, c_mu, c_pi)], split, 0.5)
    dev = np.isin(pairs.tree, [0, 2])
    resid = max(0.0, float(np.mean((pairs.c_T - c_pi)[dev] ** 2 - pairs.s_T[dev] ** 2)))
    assert got["T"]["residual_var"] == pytest.approx(resid)
    std = np.abs(pairs.c_T - c_pi) / np.sqrt(pairs.s_T ** 2 + resid)
    per_tree = sorted(float(std[pairs.tree == t].max()) for t in (1, 3, 4))
    assert got["T"]["kappa"] == pytest.approx(per_tree[1])
    assert got["n_calib_tasks"] == 3
