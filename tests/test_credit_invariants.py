"""Invariants every registered estimator keeps, on random trees (docs/METHODS.md section 7).

* observation (tool-output, prompt) tokens never carry credit;
* a node value is consistent with its tokens (the relation each estimator documents);
* credit does not depend on the order of trees or on batching whole prompt groups apart.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_store.testing import tree_lists
from rollout_store.tree import Tree
from train.credit import ESTIMATORS
from train.credit.base import TreeArrays, from_trees
from train.credit.dsc import RATIO, STATE
from train.credit.factor import HINDSIGHT_LOGPROB, STUDENT_LOGPROB
from train.credit.sgcd import CONTRAST_LOGPROB, SgcdParams
from train.credit.trace import REF_LOGPROB

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Estimators whose every agent token of a node carries the node value.
CONSTANT_PER_NODE = ("grpo", "tree_grpo", "elpo", "trace")


@st.composite
def scored_trees(draw: st.DrawFn) -> list[Tree]:
    """Random trees in two prompt groups, HierR parts on every leaf (for slca)."""
    trees = draw(tree_lists(max_size=4, max_nodes=15))
    part = st.sampled_from([0.0, 0.25, 1.0, -0.5])
    out = []
    for t in trees:
        for n in t.nodes:
            if n.reward is not None:
                n.reward_parts = {"r_tool": draw(part), "r_sum": draw(part)}
        out.append(dataclasses.replace(t, task_id=draw(st.sampled_from(["u", "v"])),
                                       run_id="r", sampler="s", policy_version="v"))
    return out


def with_inputs(batch: TreeArrays, seed: int) -> TreeArrays:
    """The extras trace, dsc, factor and sgcd read, random but valid, keyed by (tree, node,
    token) so that reordering trees keeps each node's inputs; factor's and sgcd's per-token
    scores are NaN on some nodes (unscored) and on observation tokens."""
    def draw(tree: str, node: int, salt: int) -> float:
        return float(np.random.default_rng([seed, salt, zlib.crc32(tree.encode()), node]).random())

    keys = list(zip((batch.tree_ids[b] for b in batch.node_tree), batch.node_ids, strict=True))
    lbar = np.array([-0.1 - 3 * draw(t, int(n), 1) for t, n in keys])
    ratio = np.array([0.5 + draw(t, int(n), 2) for t, n in keys])
    state = np.array([int(4 * draw(t, int(n), 3)) for t, n in keys])
    tok_node = batch.token_node
    rank = np.arange(batch.n_tokens) - batch.token_offsets[tok_node]
    token_keys = [(keys[v][0], int(keys[v][1]) * 64 + int(k)) for v, k in zip(tok_node, rank,
                                                                             strict=True)]
    scored = np.array([draw(t, int(n), 4) < 0.8 for t, n in keys])[tok_node] & batch.agent_mask

    def logprobs(salt: int) -> np.ndarray:
        lp = np.array([-4 * draw(t, k, salt) for t, k in token_keys])
        return np.where(scored, lp, np.nan)

    return dataclasses.replace(batch, extras={
        REF_LOGPROB: lbar, RATIO: ratio, STATE: state, HINDSIGHT_LOGPROB: logprobs(5),
        STUDENT_LOGPROB: logprobs(6), CONTRAST_LOGPROB: logprobs(7)})


@SETTINGS
@given(trees=scored_trees(), seed=st.integers(0, 10_000))
def test_every_estimator_keeps_the_invariants(trees: list[Tree], seed: int) -> None:
    batch = with_inputs(from_trees(trees), seed)
    again = with_inputs(from_trees(trees[::-1]), seed)
    n_act = np.bincount(batch.token_node[batch.agent_mask], minlength=batch.n_nodes)
    for name, est in sorted(ESTIMATORS.items()):
        credit = est(batch, est.params_type())
        # Observation tokens never carry credit.
        assert np.all(credit.token[~batch.agent_mask] == 0.0), name
        # Node values are consistent with their tokens.
        has = n_act > 0
        node_of = batch.token_node[batch.agent_mask]
        tok = credit.token[batch.agent_mask]
        if name in CONSTANT_PER_NODE:
            np.testing.assert_allclose(tok, credit.node[node_of], atol=1e-9, err_msg=name)
        elif name == "slca":
            mean = np.bincount(node_of, weights=tok, minlength=batch.n_nodes)[has] / n_act[has]
            np.testing.assert_allclose(credit.node[has], mean, atol=1e-9, err_msg=name)
        elif name == "factor":  # F5: mean weight 1, no sign flip
            mean = np.bincount(node_of, weights=tok, minlength=batch.n_nodes)[has] / n_act[has]
            node = np.nan_to_num(credit.node)
            np.testing.assert_allclose(node[has], mean, atol=1e-9, err_msg=name)
            assert np.all(np.sign(tok) == np.sign(node[node_of])), name
        elif name == "sgcd":  # Q4: w A with w in [1 - c, 1 + c]
            c = SgcdParams().c
            node = np.nan_to_num(credit.node)[node_of]
            assert np.all(np.sign(tok) == np.sign(node)), name
            assert np.all(np.abs(tok) <= (1 + c) * np.abs(node) + 1e-12), name
            assert np.all(np.abs(tok) >= (1 - c) * np.abs(node) - 1e-12), name
        elif name == "caliper":  # C9: the credit of the last action token
            last = batch.token_offsets[:-1][has] + n_act[has] - 1
            np.testing.assert_allclose(credit.node[has], credit.token[last], atol=1e-9)
        # The order of trees does not matter.
        other = est(again, est.params_type())
        a = {(batch.tree_ids[b], int(n)): float(v) for b, n, v in
             zip(batch.node_tree, batch.node_ids, credit.node, strict=True)}
        b = {(again.tree_ids[t], int(n)): float(v) for t, n, v in
             zip(again.node_tree, again.node_ids, other.node, strict=True)}
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert b[key] == pytest.approx(value, abs=1e-9, nan_ok=True), (name, key)
