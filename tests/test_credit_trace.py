"""TRACE (METHODS T1-T7) tested three ways:

1. small hand-computed trees (numbers worked out in the comments), including
   METHODS' numeric unit test;
2. a slow per-trajectory reference loop, written straight from T1-T7 on
   ``Tree`` objects, against the vectorised estimator on random batches;
3. invariants: telescoping (T4), observation tokens, batch order, slices.
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
from train.credit.base import from_trees
from train.credit.trace import (
    REF_LOGPROB,
    TraceParams,
    answer_tail,
    mean_gold_logprob,
    td_deltas,
    trace,
)

LN2 = math.log(2.0)
SQRT2 = math.sqrt(2.0)


def _node(nid: int, parent: int | None, n_act: int = 1, n_obs: int = 1,
          reward: float | None = None) -> Node:
    """A node with ``n_act`` action tokens and ``n_obs`` observation tokens."""
    return node(nid, parent, [11] * n_act, [22] * n_obs, reward)


# ----------------------------------------------------------------- 1. hand-computed
def test_methods_unit_test_eps_1e3() -> None:
    # METHODS section 6: with eps = 1e-3, lbar -5.1187 -> -1.5712 gives
    # delta = log((5.1187 + .001) / (1.5712 + .001)) = log(3.25640) = 1.1806, and
    # -10.6570 -> -7.1061 gives log(10.658 / 7.1071) = log(1.49963) = 0.4052.
    t = Tree("t", [_node(0, None, 0, 3), _node(1, 0, 2, 2, reward=1.0)])
    u = Tree("u", [_node(0, None, 0, 3), _node(1, 0, 2, 2, reward=0.0)])
    batch = from_trees([t, u], extras={REF_LOGPROB: np.array([-5.1187, -1.5712,
                                                              -10.6570, -7.1061])})
    delta = by_row(batch, td_deltas(batch, 1e-3))
    assert round(delta[("t", 1)], 4) == 1.1806
    assert round(delta[("u", 1)], 4) == 0.4052
    # With eps = 0.1 the same transitions give 1.1387 and 0.4006 (METHODS).
    delta = by_row(batch, td_deltas(batch, 0.1))
    assert round(delta[("t", 1)], 4) == 1.1387
    assert round(delta[("u", 1)], 4) == 0.4006
    # One trajectory per tree: A_out = 0 (constant group). T = 1, k = 0: the window is
    # delta_0 alone, so node 1 gets alpha_turn * delta_0 = 0.2 * 1.13869.
    credit = trace(batch, TraceParams())
    node = by_row(batch, credit.node)
    assert node[("t", 1)] == pytest.approx(0.2 * math.log(5.2187 / 1.6712), abs=1e-12)


def test_branched_tree_by_hand() -> None:
    # r (S_0) -+- a -+- b   leaf WITH observation: a TD turn, R = 1   (trajectory 1, T = 2)
    #          |     +- c   leaf without observation: answer tail, R = 0 (trajectory 2, T = 1)
    #          +- e         answer tail right after the prompt, R = 0   (trajectory 3, T = 0)
    # eps = 1 and lbar = -3, -1, 0 at r, a, b give d = 4, 2, 1: delta_a = log(4/2) = ln 2,
    # delta_b = log(2/1) = ln 2 (lbar at the tails is ignored: NaN).
    # A_out: R = (1, 0, 0), mean 1/3, population std sqrt(2/9); norm_eps = 0 gives
    # A_b = (2/3) / sqrt(2/9) = sqrt 2 and A_c = A_e = -1/sqrt 2.
    # K = 2, gamma = 0.5, out_scale = 2, alpha_out = 1, alpha_turn = 0.5.
    # Trajectory 1: k=0 (a): h = min(1, 1) = 1 = T-1: c = (ln2 + .5 ln2)/1.5 = ln2,
    #   bonus 2 * .5^2 * sqrt2 = sqrt2/2; k=1 (b): c = ln2, bonus 2 * .5 * sqrt2 = sqrt2.
    # Trajectory 2: k=0 (a): h = 0 = T-1: c = ln2, bonus 2 * .5 * (-1/sqrt2) = -sqrt2/2.
    # a = mean(sqrt2 + .5(ln2 + sqrt2/2), -sqrt2/2 + .5(ln2 - sqrt2/2)) = sqrt2/4 + ln2/2
    # b = sqrt2 + .5(ln2 + sqrt2) = 1.5 sqrt2 + ln2/2;  c = e = -1/sqrt2;  r = mean A = 0.
    tree = Tree("h", [_node(0, None, 0, 4), _node(1, 0), _node(2, 1, 2, 1, reward=1.0),
                      _node(3, 1, 3, 0, reward=0.0), _node(4, 0, 1, 0, reward=0.0)])
    lbar = np.array([-3.0, -1.0, 0.0, np.nan, np.nan])
    batch = from_trees([tree], extras={REF_LOGPROB: lbar})
    assert answer_tail(batch).tolist() == [False, False, False, True, True]
    params = TraceParams(eps=1.0, gamma=0.5, horizon=2, out_scale=2.0, alpha_out=1.0,
                         alpha_turn=0.5, norm_eps=0.0)
    credit = trace(batch, params)
    node = by_row(batch, credit.node)
    assert node[("h", 0)] == pytest.approx(0.0, abs=1e-12)
    assert node[("h", 1)] == pytest.approx(SQRT2 / 4 + LN2 / 2)  # 0.700127
    assert node[("h", 2)] == pytest.approx(1.5 * SQRT2 + LN2 / 2)  # 2.467894
    assert node[("h", 3)] == pytest.approx(-1 / SQRT2)  # answer tail: A_out only
    assert node[("h", 4)] == pytest.approx(-1 / SQRT2)
    # tokens: node value on its action tokens, 0 on every observation token
    expected = np.repeat([node[("h", i)] for i in range(5)], [0, 1, 2, 3, 1])
    np.testing.assert_allclose(credit.token[batch.agent_mask], expected, atol=1e-12)
    assert (credit.token[~batch.agent_mask] == 0).all()


def test_window_cut_before_the_end_by_hand() -> None:
    # Chain r - a - b - c, c a leaf with an observation (T = 3). eps = .5 and
    # lbar = -7.5, -3.5, -.5, 0 give d = 8, 4, 1, .5: delta = ln2, 2 ln2, ln2 (T4;
    # the sum 4 ln2 = log(8 / .5) = V_3 - V_0). K = 2, gamma = .5, alpha_turn = 1:
    # a (k=0): h = min(1, 2) = 1 < T-1, c = (ln2 + .5 * 2ln2) / 1.5 = 4/3 ln2 = 0.924196
    # b (k=1): h = 2,  c = (2ln2 + .5 ln2) / 1.5 = 5/3 ln2 = 1.155245
    # c (k=2): h = 2,  c = ln2 = 0.693147. One trajectory: A_out = 0, no bonus.
    tree = Tree("c", [_node(0, None, 0), _node(1, 0), _node(2, 1), _node(3, 2, reward=1.0)])
    batch = from_trees([tree], extras={REF_LOGPROB: np.array([-7.5, -3.5, -0.5, 0.0])})
    params = TraceParams(eps=0.5, gamma=0.5, horizon=2, alpha_turn=1.0)
    delta = td_deltas(batch, params.eps)
    assert delta.sum() == pytest.approx(math.log(8 / 0.5))
    node = trace(batch, params).node
    np.testing.assert_allclose(node, [0.0, 4 / 3 * LN2, 5 / 3 * LN2, LN2], atol=1e-12)


def test_mean_gold_logprob() -> None:
    # T2: three states scoring 2, 1 and 3 gold tokens.
    lp = np.array([-1.0, -3.0, -0.5, -2.0, -2.0, -5.0])
    out = mean_gold_logprob(lp, np.array([0, 2, 3, 6]))
    np.testing.assert_allclose(out, [-2.0, -0.5, -3.0])
    with pytest.raises(ValueError, match="at least one"):
        mean_gold_logprob(lp, np.array([0, 2, 2, 6]))


def test_registered_and_params_checked() -> None:
    assert ESTIMATORS["trace"].params_type is TraceParams
    assert ESTIMATORS["trace"].parse_params({"horizon": "5", "group": "task"}) == \
        TraceParams(horizon=5, group="task")
    with pytest.raises(ValueError, match="horizon"):
        TraceParams(horizon=0)
    with pytest.raises(ValueError, match="eps"):
        TraceParams(eps=0.0)


def test_bad_inputs_are_named() -> None:
    tree = Tree("t", [_node(0, None), _node(1, 0, reward=1.0)])
    with pytest.raises(KeyError, match=REF_LOGPROB):
        trace(from_trees([tree]), TraceParams())
    batch = from_trees([tree], extras={REF_LOGPROB: np.array([-1.0, 0.5])})
    with pytest.raises(ValueError, match="node 1"):  # d = -0.5 + 0.1 < 0
        trace(batch, TraceParams())


# ----------------------------------------------------------------- 2. reference loop
def _prepare(trees: list[Tree], seed: int) -> tuple[list[Tree], np.ndarray]:
    """Random answer tails, 0/1 or float rewards, and lbar (node-list order)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in trees:
        nodes = []
        for n in t.nodes:
            if n.reward is not None:
                if rng.random() < 0.4:
                    n = replace(n, observation_token_ids=[])
                if rng.random() < 0.6:
                    n = replace(n, reward=float(rng.integers(0, 2)))
            nodes.append(n)
        out.append(replace(t, nodes=nodes))
    n_nodes = sum(len(t.nodes) for t in out)
    lbar = -rng.exponential(3.0, n_nodes)
    lbar[rng.random(n_nodes) < 0.1] = 0.0  # a perfectly predicted answer
    return out, lbar


def _reference(trees: list[Tree], lbar: np.ndarray,
               p: TraceParams) -> dict[tuple[str, int], float]:
    """T1-T7 per trajectory, straight from METHODS; shared nodes average over trajectories."""
    ell = {}
    i = 0
    for t in trees:
        for n in t.nodes:
            ell[(t.tree_id, n.node_id)] = lbar[i]
            i += 1
    groups: dict[str, list[float]] = defaultdict(list)
    for t in trees:
        key = t.tree_id if p.group == "tree" else t.task_id
        groups[key].extend(leaf.reward for leaf in t.leaves())  # type: ignore[misc]
    values: dict[tuple[str, int], list[float]] = defaultdict(list)
    for t in trees:
        rewards = groups[t.tree_id if p.group == "tree" else t.task_id]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        for leaf in t.leaves():
            assert leaf.reward is not None
            a_out = 0.0 if len(set(rewards)) == 1 else (leaf.reward - mean) / (std + p.norm_eps)
            path = t.path_to(leaf.node_id)
            tail = len(path) > 1 and not leaf.observation_token_ids
            big_t = len(path) - 1 - int(tail)
            d = [-ell[(t.tree_id, n.node_id)] + p.eps for n in path[:big_t + 1]]  # T3
            v = [math.log(d[0] / dk) for dk in d]
            delta = [v[k + 1] - v[k] for k in range(big_t)]  # T4
            for pos, n in enumerate(path):
                k = pos - 1  # the node at depth k + 1 holds turn k
                value = p.alpha_out * a_out
                if 0 <= k < big_t:
                    h = min(k + p.horizon - 1, big_t - 1)  # T5
                    w = [p.gamma ** (u - k) for u in range(k, h + 1)]
                    c = sum(wu * delta[u] for wu, u in zip(w, range(k, h + 1), strict=True))
                    c /= sum(w)
                    r = c + (p.out_scale * p.gamma ** (big_t - k) * a_out if h == big_t - 1
                             else 0.0)  # T6
                    value += p.alpha_turn * r  # T7
                values[(t.tree_id, n.node_id)].append(value)
    return {key: sum(v) / len(v) for key, v in values.items()}


_params = st.builds(
    TraceParams, eps=st.sampled_from([1e-3, 0.1, 1.0]),
    gamma=st.sampled_from([0.0, 0.5, 0.8, 1.0]), horizon=st.sampled_from([1, 2, 3, 5, 40]),
    out_scale=st.sampled_from([0.0, 2.0]), alpha_out=st.sampled_from([1.0, 0.3]),
    alpha_turn=st.sampled_from([0.2, 1.0]), group=st.sampled_from(["tree", "task"]))


@settings(max_examples=30, deadline=None)
@given(trees=random_trees(), seed=st.integers(0, 2**32 - 1),
       params=_params)
def test_matches_reference_loop(trees: list[Tree], seed: int, params: TraceParams) -> None:
    trees, lbar = _prepare(trees, seed)
    batch = from_trees(trees, extras={REF_LOGPROB: lbar})
    credit = trace(batch, params)
    ref = _reference(trees, lbar, params)
    expected = np.array([ref[(batch.tree_ids[t], int(i))]
                         for t, i in zip(batch.node_tree, batch.node_ids, strict=True)])
    np.testing.assert_allclose(credit.node, expected, rtol=1e-9, atol=1e-9)
    lengths = np.diff(batch.token_offsets)
    np.testing.assert_allclose(credit.token, np.where(batch.agent_mask,
                                                      np.repeat(expected, lengths), 0.0),
                               rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------- 3. invariants
@settings(max_examples=25, deadline=None)
@given(trees=random_trees(max_trees=3, max_nodes=25), seed=st.integers(0, 2**32 - 1))
def test_td_credit_telescopes(trees: list[Tree], seed: int) -> None:
    # T4: along every trajectory, sum of delta = V_T - V_0 = log(d_0 / d_T).
    trees, lbar = _prepare(trees, seed)
    batch = from_trees(trees, extras={REF_LOGPROB: lbar})
    eps = 0.1
    delta = td_deltas(batch, eps)
    d = -batch.extras[REF_LOGPROB] + eps
    tail = answer_tail(batch)
    for leaf in np.flatnonzero(batch.is_leaf):
        last = batch.parent[leaf] if tail[leaf] else leaf
        path, cur = [], leaf
        while cur >= 0:
            path.append(cur)
            cur = batch.parent[cur]
        root = path[-1]
        assert sum(delta[v] for v in path) == pytest.approx(math.log(d[root] / d[last]),
                                                            abs=1e-9)
    # With K = 1 and no outcome term, a turn's credit is its own delta (T5: c_k = delta_k).
    p = TraceParams(eps=eps, horizon=1, out_scale=0.0, alpha_out=0.0, alpha_turn=1.0)
    np.testing.assert_allclose(trace(batch, p).node, delta, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(trees=random_trees(), seed=st.integers(0, 2**32 - 1),
       params=_params, perm_seed=st.integers(0, 1000))
def test_batch_order_slices_and_observation_tokens(trees: list[Tree], seed: int,
                                                   params: TraceParams,
                                                   perm_seed: int) -> None:
    trees, lbar = _prepare(trees, seed)
    batch = from_trees(trees, extras={REF_LOGPROB: lbar})
    credit = trace(batch, params)
    assert (credit.token[~batch.agent_mask] == 0).all()  # tool output never gets advantage
    base = by_row(batch, credit.node)

    # batch order does not matter
    starts = np.cumsum([0] + [len(t.nodes) for t in trees])
    order = np.random.default_rng(perm_seed).permutation(len(trees))
    shuffled = from_trees([trees[i] for i in order], extras={REF_LOGPROB: np.concatenate(
        [lbar[starts[i]:starts[i + 1]] for i in order])})
    other = by_row(shuffled, trace(shuffled, params).node)
    assert other.keys() == base.keys()
    for key, value in base.items():
        assert other[key] == pytest.approx(value, rel=1e-9, abs=1e-9)

    # other observation token ids (same lengths) change nothing
    recoded = [replace(t, nodes=[replace(n, observation_token_ids=[7] * len(
        n.observation_token_ids)) for n in t.nodes]) for t in trees]
    again = trace(from_trees(recoded, extras={REF_LOGPROB: lbar}), params)
    np.testing.assert_array_equal(again.token, credit.token)

    # with per-tree groups, a batch equals its trees one at a time
    if params.group == "tree":
        for b in range(batch.n_trees):
            one = batch.tree_slice(b)
            rows = np.flatnonzero(batch.node_tree == b)
            np.testing.assert_allclose(trace(one, params).node, credit.node[rows],
                                       rtol=1e-9, atol=1e-9)
