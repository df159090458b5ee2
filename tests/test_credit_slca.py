"""SLCA-GRPO credit (METHODS S1, S5, S6), tested three ways: a hand case, a reference loop, invariants.

1. Hand-computed trees (S1 runs whatever the segment codes say, a truncated
   trajectory keeps its summary, the run split, a node shared by a summary run and a
   tool segment, missing HierR parts refused), the numbers worked out in comments.
2. A slow plain-Python reference over ``Tree`` objects (per trajectory: route
   every token, z-score per segment, average over trajectories through a node),
   compared with the vectorised estimator on random trees of
   ``rollout_store.testing`` with random HierR parts and segments.
3. Invariants: tool-token advantages do not move when only summary rewards
   change, a singleton segment gets 0, observation tokens get nothing, segment
   codes change nothing, batch order does not matter, a missing part is refused.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from credit_helpers import node as make_node
from credit_helpers import ref_zscore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_store.testing import tree_lists
from rollout_store.tree import Node, Tree
from train.credit import ESTIMATORS
from train.credit.base import Credit, TreeArrays, from_trees
from train.credit.slca import SlcaInputError, SlcaParams, segment_advantages, slca

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
Key = tuple[str, int]
S = math.sqrt


def node(nid: int, parent: int | None, actions: list[int], obs: list[int] | None = None,
         segments: list[tuple[str, int, int]] | None = None,
         parts: dict[str, float] | None = None) -> Node:
    """A node; a leaf when it has HierR ``parts`` (reward = (r_tool + r_sum) / 2)."""
    reward = None if parts is None else sum(parts.values()) / 2
    return make_node(nid, parent, actions, obs or [], reward, segments=segments or (),
                     parts=parts)


def by_node(batch: TreeArrays, credit: Credit) -> dict[Key, tuple[float, list[float]]]:
    """(tree id, node id) -> (node credit, its tokens' advantages)."""
    off = batch.token_offsets
    return {(batch.tree_ids[batch.node_tree[r]], int(batch.node_ids[r])):
            (float(credit.node[r]), credit.token[off[r]:off[r + 1]].tolist())
            for r in range(batch.n_nodes)}


def check(got: dict, key: Key, node_credit: float, tokens: list[float]) -> None:
    assert got[key][0] == pytest.approx(node_credit, abs=1e-9), key
    assert got[key][1] == pytest.approx(tokens, abs=1e-9), key


def z(dev: float, std: float) -> float:
    return dev / (std + 1e-6)


# ----------------------------------------------------------------- 1. hand-computed
def test_segments_are_runs_whatever_the_codes_say() -> None:
    # root [ | 100] - n1 [t t x | 50] - L1 [s s]  r_tool 1,   r_sum 0.5
    #              |  (tool_call 0:2, text 2:3) `- L2 [s s]  r_tool 0.5, r_sum 1   (answer code)
    #              `- n2 [t t | 51]      - L3 [s]    r_tool 0,   r_sum 0
    # S1: every path is two runs: n1 (n2) is the tool segment, the leaf the summary; the
    # malformed-turn "text" token x is a tool token like its neighbours.
    # Tool over (L1, L2, L3) = (1, 0.5, 0): mean 0.5, unbiased std 0.5 -> Â_tool = (1, 0, -1).
    # Sum over (0.5, 1, 0): mean 0.5, std 0.5 -> Â_sum = (0, 1, -1).
    # n1 tokens (x included): mean over L1, L2 of Â_tool = (1 + 0)/2 = 0.5; node 0.5.
    # n2: Â_tool(L3) = -1. Leaves: their Â_sum.
    tree = Tree("coded", [
        node(0, None, [], [100]),
        node(1, 0, [7, 7, 8], [50], [("tool_call", 0, 2), ("text", 2, 3)]),
        node(2, 1, [9, 9], segments=[("summary", 0, 2)], parts={"r_tool": 1.0, "r_sum": 0.5}),
        node(3, 1, [9, 9], segments=[("answer", 0, 2)], parts={"r_tool": 0.5, "r_sum": 1.0}),
        node(4, 0, [7, 7], [51], [("tool_call", 0, 2)]),
        node(5, 4, [9], segments=[("summary", 0, 1)], parts={"r_tool": 0.0, "r_sum": 0.0}),
    ])
    batch = from_trees([tree])
    got = by_node(batch, slca(batch, SlcaParams()))
    one = z(0.5, 0.5)
    check(got, ("coded", 0), 0.0, [0.0])
    check(got, ("coded", 1), one / 2, [one / 2, one / 2, one / 2, 0.0])
    check(got, ("coded", 2), 0.0, [0.0, 0.0])
    check(got, ("coded", 3), one, [one, one])
    check(got, ("coded", 4), -one, [-one, -one, 0.0])
    check(got, ("coded", 5), -one, [-one])


def test_truncated_trajectory_keeps_its_summary() -> None:
    # root [ | 100] - a [t | 50] - b [s]       (answer)     r_tool 1,   r_sum 1
    #              `- c [t | 51] - d [t | 52]  (step limit: a tool call, no answer)
    #                                                       r_tool 0.5, r_sum 0
    # S1: path b: tool a, summary b.  Path d: tool c, summary d (its last run).
    # Sum over (b, d) = (1, 0): mean 0.5, std sqrt(0.5) -> ±0.70711; tool over (1, 0.5):
    # mean 0.75, std sqrt(0.125) -> ±0.70711. Routing by codes left d out of the summary
    # group, so b's summary credit was 0 (a group of one).
    tree = Tree("cut", [
        node(0, None, [], [100]),
        node(1, 0, [7], [50], [("tool_call", 0, 1)]),
        node(2, 1, [9], segments=[("answer", 0, 1)], parts={"r_tool": 1.0, "r_sum": 1.0}),
        node(3, 0, [7], [51], [("tool_call", 0, 1)]),
        node(4, 3, [7], [52], [("tool_call", 0, 1)], parts={"r_tool": 0.5, "r_sum": 0.0}),
    ])
    batch = from_trees([tree])
    got = by_node(batch, slca(batch, SlcaParams()))
    a = z(0.5, S(0.5))
    t = z(0.25, S(0.125))
    check(got, ("cut", 1), t, [t, 0.0])
    check(got, ("cut", 2), a, [a])
    check(got, ("cut", 3), -t, [-t, 0.0])
    check(got, ("cut", 4), -a, [-a, 0.0])


def test_leaves_without_hierr_parts_are_refused() -> None:
    tree = Tree("calc", [node(0, None, [], [100]), node(1, 0, [7], [50]),
                         node(2, 1, [9], parts={"reward": 1.0}),
                         node(3, 1, [8], parts={"reward": 0.0, "r_tool": 1.0, "r_sum": 0.0})])
    batch = from_trees([tree])
    with pytest.raises(SlcaInputError, match=r"tree 'calc', node 2 has no 'r_tool' "
                                             r"\(1 such leaves\)"):
        slca(batch, SlcaParams())
    # Naming parts that every leaf carries works.
    named = slca(batch, SlcaParams(tool_part="reward", sum_part="reward"))
    assert np.isfinite(named.node).all()


def test_run_fallback_without_codes() -> None:
    # No segment codes: S1 on agent-token runs (observations split runs).
    # root [ | 100] - a [1 2 | 50] - b [3] (no obs) - c [4 | 99]   r_tool 1,   r_sum 1
    #              |              `- d [5 6]                      r_tool 0.5, r_sum 0
    #              |- e [7]                                       r_tool 0.3, r_sum 0.5
    #              `- g [8 | 52] - f [9]                          r_tool 0,   r_sum 0.5
    # Runs: path c: [1 2] | [3 4] -> tool a, summary b+c (c's trailing obs is no run).
    #       path d: [1 2] | [5 6] -> tool a, summary d.
    #       path e: one run [7] -> summary only: no tool segment (its r_tool is unused).
    #       path f: [8] | [9] -> tool g, summary f.
    # Tool over (c, d, f) = (1, 0.5, 0): Â_tool = (1, 0, -1) (mean 0.5, std 0.5).
    # Sum over (c, d, e, f) = (1, 0, 0.5, 0.5): mean 0.5, var (0.25 + 0.25)/3,
    #   std sqrt(1/6) = 0.408248 -> Â_sum = (1.2247, -1.2247, 0, 0).
    # a: mean over c, d of Â_tool = 0.5; b and c: Â_sum(c); d: Â_sum(d); g: -1; e, f: 0.
    tree = Tree("runs", [
        node(0, None, [], [100]),
        node(1, 0, [1, 2], [50]), node(2, 1, [3]),
        node(3, 2, [4], [99], parts={"r_tool": 1.0, "r_sum": 1.0}),
        node(4, 1, [5, 6], parts={"r_tool": 0.5, "r_sum": 0.0}),
        node(5, 0, [7], parts={"r_tool": 0.3, "r_sum": 0.5}),
        node(6, 0, [8], [52]), node(7, 6, [9], parts={"r_tool": 0.0, "r_sum": 0.5}),
    ])
    batch = from_trees([tree])
    got = by_node(batch, slca(batch, SlcaParams()))
    one, s = z(0.5, 0.5), z(0.5, S(1 / 6))
    check(got, ("runs", 1), one / 2, [one / 2, one / 2, 0.0])
    check(got, ("runs", 2), s, [s])
    check(got, ("runs", 3), s, [s, 0.0])
    check(got, ("runs", 4), -s, [-s, -s])
    check(got, ("runs", 5), 0.0, [0.0])
    check(got, ("runs", 6), -one, [-one, 0.0])
    check(got, ("runs", 7), 0.0, [0.0])
    tool, summ = segment_advantages(batch, SlcaParams())
    assert tool[batch.is_leaf].tolist() == pytest.approx([one, 0.0, 0.0, -one])  # c d e f
    assert summ[batch.is_leaf].tolist() == pytest.approx([s, -s, 0.0, 0.0])
    assert np.isnan(tool[~batch.is_leaf]).all()


def test_shared_node_mixes_summary_and_tool_routes() -> None:
    # root [ | 100] - w [1 2] (no obs) - x [3]                 r_sum 1     (one run: w+x)
    #                                  |- y [ | 50] - z [4]    r_tool 1,   r_sum 0
    #                                  `- y2 [ | 51] - z2 [5]  r_tool 0,   r_sum 0.5
    # Path x: a single run [1 2 3] -> w is summary; no tool segment (r_tool unused).
    # Paths z, z2: [1 2] | [4] -> w is tool, z (z2) summary.
    # Tool over (z, z2) = (1, 0): mean 0.5, std sqrt(0.5) -> Â_tool = ±0.5/0.70711.
    # Sum over (x, z, z2) = (1, 0, 0.5) -> Â_sum = (1, -1, 0).
    # w tokens: (Â_sum(x) + Â_tool(z) + Â_tool(z2))/3 = (1 + t - t)/3 = 1/3.
    tree = Tree("mixed", [
        node(0, None, [], [100]), node(1, 0, [1, 2]),
        node(2, 1, [3], parts={"r_tool": 0.2, "r_sum": 1.0}),
        node(3, 1, [], [50]), node(4, 3, [4], parts={"r_tool": 1.0, "r_sum": 0.0}),
        node(5, 1, [], [51]), node(6, 5, [5], parts={"r_tool": 0.0, "r_sum": 0.5}),
    ])
    batch = from_trees([tree])
    got = by_node(batch, slca(batch, SlcaParams()))
    one = z(0.5, 0.5)
    check(got, ("mixed", 1), one / 3, [one / 3, one / 3])
    check(got, ("mixed", 2), one, [one])
    check(got, ("mixed", 4), -one, [-one])
    check(got, ("mixed", 6), 0.0, [0.0])
    # Moving only the summary rewards moves w (a summary token on path x) but not the
    # per-trajectory tool advantages.
    moved = from_trees([dataclasses.replace(tree, nodes=[
        dataclasses.replace(n, reward_parts={**n.reward_parts, "r_sum": 0.0})
        if n.reward_parts else n for n in tree.nodes])])
    t0, _ = segment_advantages(batch, SlcaParams())
    t1, s1 = segment_advantages(moved, SlcaParams())
    assert np.array_equal(t0, t1, equal_nan=True)
    assert np.all(s1[moved.is_leaf] == 0.0)  # zero-variance group


def test_singleton_segment_gets_zero_and_lambdas_scale_after_normalisation() -> None:
    # Only L1 has a tool segment (L2 is a single run): a group of one -> Â_tool = 0.
    # Sum over (L1, L2) = (0, 1): mean 0.5, std sqrt(0.5) -> Â_sum = ∓0.70711, times
    # lambda_sum = 2 after normalisation -> ∓1.41421.
    tree = Tree("single", [
        node(0, None, [], [100]),
        node(1, 0, [1], [50]), node(2, 1, [2], parts={"r_tool": 5.0, "r_sum": 0.0}),
        node(3, 0, [3], parts={"r_tool": 1.0, "r_sum": 1.0}),
    ])
    batch = from_trees([tree])
    got = by_node(batch, slca(batch, SlcaParams(lambda_tool=3.0, lambda_sum=2.0)))
    half = 2 * z(0.5, S(0.5))
    check(got, ("single", 1), 0.0, [0.0, 0.0])
    check(got, ("single", 2), -half, [-half])
    check(got, ("single", 3), half, [half])


def test_registered_and_params_parse() -> None:
    est = ESTIMATORS["slca"]
    assert est.fn is slca
    assert est.parse_params({"sum_part": "judge", "lambda_tool": "0.5"}) == SlcaParams(
        sum_part="judge", lambda_tool=0.5)
    with pytest.raises(ValueError, match="std"):
        SlcaParams(std="bogus")  # type: ignore[arg-type]


# ----------------------------------------------------------------- 2. reference loop
def ref_routes(tree: Tree) -> dict[int, dict[tuple[int, int], str]]:
    """Leaf id -> {(node id, action position): "tool" / "sum"} along its path (S1 runs)."""
    out = {}
    for leaf in tree.leaves():
        runs: list[list[tuple[int, int]]] = []
        prev_agent = False
        for n in tree.path_to(leaf.node_id):
            for i in range(len(n.action_token_ids)):
                if not prev_agent:
                    runs.append([])
                runs[-1].append((n.node_id, i))
                prev_agent = True
            if n.observation_token_ids:
                prev_agent = False
        out[leaf.node_id] = {k: "sum" if j == len(runs) - 1 else "tool"
                             for j, run in enumerate(runs) for k in run}
    return out


def ref_slca(tree: Tree, p: SlcaParams) -> dict[Key, tuple[float, list[float]]]:
    by_id = {n.node_id: n for n in tree.nodes}
    routes = ref_routes(tree)
    adv: dict[int, dict[str, float]] = {leaf: {"tool": 0.0, "sum": 0.0} for leaf in routes}
    for seg, key, lam in (("tool", p.tool_part, p.lambda_tool),
                          ("sum", p.sum_part, p.lambda_sum)):
        members = [lf for lf, r in routes.items() if seg in r.values()]
        zs = ref_zscore([by_id[lf].reward_parts[key] for lf in members], p.std, p.eps)
        for lf, v in zip(members, zs, strict=True):
            adv[lf][seg] = lam * v
    out = {}
    for nid, n in by_id.items():
        through = [lf for lf in routes if nid in {v.node_id for v in tree.path_to(lf)}]
        tokens = []
        for i in range(len(n.action_token_ids)):
            total = 0.0
            for lf in through:
                total += adv[lf][routes[lf][(nid, i)]]
            tokens.append(total / len(through))
        node_credit = sum(tokens) / len(tokens) if tokens else 0.0
        out[(tree.tree_id, nid)] = (node_credit, tokens + [0.0] * len(n.observation_token_ids))
    return out


@st.composite
def slca_trees(draw: st.DrawFn) -> list[Tree]:
    """Random trees of ``rollout_store.testing`` with HierR parts at leaves and, per
    tree, either its random segments or none at all."""
    trees = draw(tree_lists(max_size=3, max_nodes=10))
    part = st.sampled_from([0.0, 0.25, 0.5, 1.0, -0.5])
    for t in trees:
        if draw(st.booleans()):
            for n in t.nodes:
                n.segments = []
        for n in t.nodes:
            if n.reward is not None:
                n.reward_parts = {"r_tool": draw(part), "r_sum": draw(part)}
    return trees


params_st = st.builds(SlcaParams, lambda_tool=st.sampled_from([1.0, 0.5]),
                      lambda_sum=st.sampled_from([1.0, 2.0]),
                      std=st.sampled_from(["unbiased", "population", "none"]))


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, (node_w, tok_w) in want.items():
        assert got[key][0] == pytest.approx(node_w, abs=1e-9), key
        assert got[key][1] == pytest.approx(tok_w, abs=1e-9), key


@SETTINGS
@given(slca_trees(), params_st)
def test_matches_reference_loop(trees: list[Tree], params: SlcaParams) -> None:
    batch = from_trees(trees)
    want: dict = {}
    for t in trees:
        want.update(ref_slca(t, params))
    assert_same(by_node(batch, slca(batch, params)), want)


# ----------------------------------------------------------------- 3. invariants
@SETTINGS
@given(slca_trees(), st.data())
def test_invariants(trees: list[Tree], data: st.DataObject) -> None:
    batch = from_trees(trees)
    credit = slca(batch, SlcaParams())
    # Tool output (observation) tokens never receive advantage.
    assert np.all(credit.token[~batch.agent_mask] == 0.0)
    # A segment present in a single trajectory of its tree gets 0 (S5).
    tool, summ = segment_advantages(batch, SlcaParams())
    tree_of = np.array(batch.tree_ids)[batch.node_tree]
    for t in trees:
        routes = ref_routes(t)
        for seg, adv in (("tool", tool), ("sum", summ)):
            members = [lf for lf, r in routes.items() if seg in r.values()]
            if len(members) == 1:
                row = (tree_of == t.tree_id) & (batch.node_ids == members[0])
                assert adv[row].tolist() == [0.0]
    # Batch order does not matter; segment codes change nothing (S1 reads runs).
    again = from_trees(trees[::-1])
    assert_same(by_node(again, slca(again, SlcaParams())), by_node(batch, credit))
    uncoded = from_trees([dataclasses.replace(t, nodes=[dataclasses.replace(n, segments=[])
                                                        for n in t.nodes]) for t in trees])
    assert_same(by_node(uncoded, slca(uncoded, SlcaParams())), by_node(batch, credit))

    # Changing only summary rewards moves no tool advantage, and no token that is a
    # tool token (or in no segment) on every trajectory through it.
    summary_only: dict[Key, bool] = {}
    for t in trees:
        for leaf_routes in ref_routes(t).values():
            for (nid, _), r in leaf_routes.items():
                key = (t.tree_id, nid)
                summary_only[key] = summary_only.get(key, False) or r == "sum"
    for t in trees:
        for n in t.nodes:
            if "r_sum" in n.reward_parts:
                n.reward_parts["r_sum"] = data.draw(st.sampled_from([0.0, 0.3, 1.0]))
    moved = from_trees(trees)
    t0, _ = segment_advantages(batch, SlcaParams())
    t1, _ = segment_advantages(moved, SlcaParams())
    assert np.array_equal(t0, t1, equal_nan=True)
    before, after = by_node(batch, credit), by_node(moved, slca(moved, SlcaParams()))
    for key, (_, tokens) in before.items():
        if not summary_only.get(key, False):
            assert after[key][1] == tokens, key
