"""CALIPER credit (METHODS C4-C8), tested three ways: a hand case, a reference loop, invariants.

1. Hand-computed trees, the numbers worked out in comments.
2. A slow plain-Python reference over ``Tree`` objects, compared with the
   vectorised estimator on random CALIPER-shaped batches of several trees.
3. Invariants: local credit sums to zero per group, pre-divergence tokens and
   later steps get no local credit, an all-failed global group with a mixed
   local group still gives credit, observation tokens get nothing, batch order
   does not matter, and a tree without resamples is plain GRPO.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np
import pytest
from credit_helpers import node as make_node
from credit_helpers import ref_zscore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_store.tree import Node, Tree
from train.credit import ESTIMATORS
from train.credit.base import Credit, TreeArrays, from_trees
from train.credit.caliper import CaliperParams, caliper, caliper_groups
from train.credit.grpo import GrpoParams, grpo

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
Key = tuple[str, int]


# ----------------------------------------------------------------- building trees
def node(nid: int, parent: int | None, actions: list[int], obs: list[int] | None = None,
         phase: str | None = "explore", reward: float | None = None) -> Node:
    return make_node(nid, parent, actions, obs or [], reward, phase=phase)


def with_extras(batch: TreeArrays, agreement: dict[Key, float] | None = None,
                y0: set[Key] | None = None) -> TreeArrays:
    """``batch`` with the CALIPER extras, given by (tree id, node id)."""
    keys = [(batch.tree_ids[t], int(i)) for t, i in zip(batch.node_tree, batch.node_ids,
                                                        strict=True)]
    extras: dict[str, np.ndarray] = {}
    if agreement is not None:
        extras["caliper_agreement"] = np.array([agreement.get(k, np.nan) for k in keys])
    if y0 is not None:
        extras["caliper_y0"] = np.array([k in y0 for k in keys])
    return dataclasses.replace(batch, extras=extras)


def by_node(batch: TreeArrays, credit: Credit) -> dict[Key, tuple[float, list[float],
                                                                  list[float] | None]]:
    """(tree id, node id) -> (node credit, its tokens' advantages, their clip_low)."""
    out = {}
    off = batch.token_offsets
    for row in range(batch.n_nodes):
        key = (batch.tree_ids[batch.node_tree[row]], int(batch.node_ids[row]))
        lo, hi = int(off[row]), int(off[row + 1])
        clip = None if credit.clip_low is None else credit.clip_low[lo:hi].tolist()
        out[key] = (float(credit.node[row]), credit.token[lo:hi].tolist(), clip)
    return out


def check(got: dict, key: Key, node_credit: float, tokens: list[float]) -> None:
    assert got[key][0] == pytest.approx(node_credit, abs=1e-9), key
    assert got[key][1] == pytest.approx(tokens, abs=1e-9), key


# ----------------------------------------------------------------- 1. hand-computed
def failed_tree() -> Tree:
    """Two failed full rollouts; a local group of K = 3 below a1 (an F position).

    root -- a1 [1 2 3 | 50] -- a2 [4 5]  R=0        (y_0, explore)
         |                 |- l1 [4 9]  R=1        (local)
         |                 |- l2 [8 8]  R=1        (local)
         |                 `- l3 [4 5]  R=0        (local, identical to y_0)
         `- b1 [6 7 | 51] -- b2 [3]     R=0
    """
    return Tree("failed", [
        node(0, None, [], [100, 101]),
        node(1, 0, [1, 2, 3], [50]), node(2, 1, [4, 5], reward=0.0),
        node(3, 1, [4, 9], phase="local", reward=1.0),
        node(4, 1, [8, 8], phase="local", reward=1.0),
        node(5, 1, [4, 5], phase="local", reward=0.0),
        node(6, 0, [6, 7], [51]), node(7, 6, [3], reward=0.0),
    ])


def test_all_failed_global_group_mixed_local_group() -> None:
    # Global: both full rollouts fail, so Â_global = 0 everywhere (zero variance).
    # Local group at a1: R = (y0 0, l1 1, l2 1, l3 0), K = 3, sum 2.
    #   A_loc(y0) = 0 - 2/3 = -2/3;  l1 = 1 - 1/3 = 2/3;  l2 = 2/3;  l3 = 0 - 2/3 = -2/3.
    # w_p = K/(K + n0)·a_g = 3/5·1 = 0.6 >= w_min 0.5 and A_loc(y0) < 0: C8 scales y0 by 1.5.
    # Regions: l1 vs y0 [4 9]/[4 5] diverge at 1 -> token 9 gets 0.6·2/3 = 0.4;
    #   l2 diverges at 0 -> both tokens 0.4; l3 never diverges -> empty region;
    #   y0 from min(1, 0, 2) = 0 -> both tokens 0.6·(-2/3)·1.5 = -0.6.
    batch = from_trees([failed_tree()])
    got = by_node(batch, caliper(batch, CaliperParams()))
    f = "failed"
    check(got, (f, 2), -0.6, [-0.6, -0.6])
    check(got, (f, 3), 0.4, [0.0, 0.4])
    check(got, (f, 4), 0.4, [0.4, 0.4])
    # l3: empty changed region, so no token carries its local credit 0.6·(-2/3) = -0.4,
    # and neither does its node value (C9: the credit of its last action token).
    check(got, (f, 5), 0.0, [0.0, 0.0])
    for nid in (0, 1, 6, 7):  # no local credit, no global credit
        assert got[(f, nid)][0] == 0.0 and set(got[(f, nid)][1]) <= {0.0}
    assert got[(f, 2)][2] is None  # no clip bounds unless C8 clips

    groups = caliper_groups(batch, CaliperParams())
    assert sorted(groups.a_loc.tolist()) == pytest.approx([-2 / 3, -2 / 3, 2 / 3, 2 / 3])
    assert groups.w == pytest.approx([0.6] * 4)


def test_negative_evidence_clip_instead_of_scale() -> None:
    # negative="clip": y0's credit is not scaled (0.6·(-2/3) = -0.4) but its changed
    # region (both tokens) gets clip_low = eps_low + eps_neg = 0.2 + 0.115.
    batch = from_trees([failed_tree()])
    credit = caliper(batch, CaliperParams(negative="clip"))
    got = by_node(batch, credit)
    assert got[("failed", 2)][1] == pytest.approx([-0.4, -0.4])
    assert got[("failed", 2)][2] == pytest.approx([0.315, 0.315])
    assert credit.clip_low is not None
    assert np.count_nonzero(credit.clip_low != 0.2) == 2
    # "both" scales and clips; a_g = 0.5 gives w_p = 0.3 < w_min: neither.
    both = by_node(batch, caliper(batch, CaliperParams(negative="both")))
    assert both[("failed", 2)][1] == pytest.approx([-0.6, -0.6])
    assert both[("failed", 2)][2] == pytest.approx([0.315, 0.315])
    weak = by_node(batch, caliper(batch, CaliperParams(negative="both", agreement=0.5)))
    # w_p = 0.6·0.5 = 0.3: y0 tokens 0.3·(-2/3) = -0.2, clip_low stays 0.2.
    assert weak[("failed", 2)][1] == pytest.approx([-0.2, -0.2])
    assert weak[("failed", 2)][2] == pytest.approx([0.2, 0.2])


def root_group_tree() -> Tree:
    """A D-position group at the root: the resamples copy y0's kept prefix [1 2].

    root -- a1 [1 2 3 4 | 50] -- a2 [5]  R=0     (explore)
         |- b1 [1 5 | 51]     -- b2 [6]  R=1     (explore)
         |- c1 [6]                       R=0     (explore, leaf)
         |- l1 [1 2 7]                   R=1     (local)
         `- l2 [1 2 3 9]                 R=0     (local)
    """
    return Tree("root", [
        node(0, None, [], [100]),
        node(1, 0, [1, 2, 3, 4], [50]), node(2, 1, [5], reward=0.0),
        node(3, 0, [1, 5], [51]), node(4, 3, [6], reward=1.0),
        node(5, 0, [6], reward=0.0),
        node(6, 0, [1, 2, 7], phase="local", reward=1.0),
        node(7, 0, [1, 2, 3, 9], phase="local", reward=0.0),
    ])


def test_group_at_the_root_picks_y0_by_shared_prefix() -> None:
    # Global: full rewards (a 0, b 1, c 0): mean 1/3, unbiased std sqrt(1/3) = 0.57735.
    #   Â(a) = Â(c) = -(1/3)/0.57735 = -0.57735;  Â(b) = (2/3)/0.57735 = 1.1547.
    # y0 candidates: a1 shares 2 + 3 = 5 prefix tokens with (l1, l2), b1 1 + 1, c1 0: y0 = a1.
    # R = (a1 0, l1 1, l2 0), K = 2: A_loc = (-0.5, 1, -0.5).
    # a_g = 0.9 at the root: w_p = 2/4·0.9 = 0.45 < w_min 0.5, so no C8.
    # Regions: l1 from 2 (token 7): 0.45; l2 from 3 (token 9): 0.45·(-0.5) = -0.225;
    #   a1 from min(2, 3) = 2 (tokens 3, 4): -0.57735 - 0.225; a1 tokens 1, 2: -0.57735.
    s = math.sqrt(1 / 3)
    lo, hi = -(1 / 3) / (s + 1e-6), (2 / 3) / (s + 1e-6)
    batch = with_extras(from_trees([root_group_tree()]), agreement={("root", 0): 0.9})
    got = by_node(batch, caliper(batch, CaliperParams()))
    r = "root"
    check(got, (r, 1), lo - 0.225, [lo, lo, lo - 0.225, lo - 0.225, 0.0])  # obs 50: 0
    check(got, (r, 2), lo, [lo])
    check(got, (r, 3), hi, [hi, hi, 0.0])  # obs token 51 gets 0
    check(got, (r, 5), lo, [lo])
    check(got, (r, 6), 0.45, [0.0, 0.0, 0.45])
    check(got, (r, 7), -0.225, [0.0, 0.0, 0.0, -0.225])
    assert got[(r, 0)][0] == pytest.approx(0.0, abs=1e-12)

    # Marking c1 as y0 overrides the prefix rule: R(c1) = 0 gives the same A_loc, but
    # now nothing is shared, so every token of l1, l2 and c1 is changed.
    marked = with_extras(from_trees([root_group_tree()]), agreement={("root", 0): 0.9},
                         y0={("root", 5)})
    got = by_node(marked, caliper(marked, CaliperParams()))
    check(got, (r, 5), lo - 0.225, [lo - 0.225])
    check(got, (r, 1), lo, [lo] * 4 + [0.0])
    assert got[(r, 6)][1] == pytest.approx([0.45] * 3)
    assert got[(r, 7)][1] == pytest.approx([-0.225] * 4)


def test_y0_return_ignores_deeper_groups_and_branching_member_uses_mean() -> None:
    # One failed rollout root - s1 - s2 - s3 (R=0) with two groups on it:
    #   at s1: y0 = s2, resample m1 which branches into two leaves (R 1 and 0);
    #   at s2: y0 = s3, resample m2 (R=1).
    # R(s2) is its own rollout's leaf s3 (0), not the mean with m2's success.
    # Group s1: R = (s2 0, m1 mean(1, 0) = 0.5), K = 1: A_loc = (-0.5, 0.5).
    # Group s2: R = (s3 0, m2 1): A_loc = (-1, 1).
    tree = Tree("nested", [
        node(0, None, [], [100]),
        node(1, 0, [1], [50]), node(2, 1, [2], [51]), node(3, 2, [3], reward=0.0),
        node(4, 1, [7], [52], phase="local"),
        node(5, 4, [8], phase="local", reward=1.0), node(6, 4, [9], phase="local", reward=0.0),
        node(7, 2, [4], phase="local", reward=1.0),
    ])
    batch = from_trees([tree])
    g = caliper_groups(batch, CaliperParams())
    ids = batch.node_ids[g.member].tolist()
    assert dict(zip(ids, g.ret.tolist(), strict=True)) == {2: 0.0, 4: 0.5, 3: 0.0, 7: 1.0}
    assert dict(zip(ids, g.a_loc.tolist(), strict=True)) == {2: -0.5, 4: 0.5, 3: -1.0, 7: 1.0}
    # Later steps of a resampled suffix get no local credit (and no global credit).
    got = by_node(batch, caliper(batch, CaliperParams()))
    assert got[("nested", 5)][1] == [0.0] and got[("nested", 6)][1] == [0.0]


def test_registered_and_params_parse() -> None:
    est = ESTIMATORS["caliper"]
    assert est.fn is caliper
    params = est.parse_params({"gamma": "0.25", "negative": "both", "n0": "3"})
    assert params == CaliperParams(gamma=0.25, negative="both", n0=3.0)
    with pytest.raises(ValueError, match="negative"):
        CaliperParams(negative="bogus")  # type: ignore[arg-type]


# ----------------------------------------------------------------- 2. reference loop
def ref_caliper(tree: Tree, p: CaliperParams, agreement: dict[int, float],
                marked: set[int]) -> dict[Key, tuple[float, list[float], list[float] | None]]:
    """Per-tree plain-Python CALIPER, read straight off the module docstrings."""
    by_id = {n.node_id: n for n in tree.nodes}
    kids = tree.children()
    leaves = [n.node_id for n in tree.leaves()]
    paths = {leaf: [n.node_id for n in tree.path_to(leaf)] for leaf in leaves}

    full = [lf for lf in leaves if all(by_id[v].phase != p.local_phase for v in paths[lf])]
    z = dict(zip(full, ref_zscore([by_id[lf].reward or 0.0 for lf in full], p.std, p.eps),
                 strict=True))
    glob = {}
    for v in by_id:
        through = [z[lf] for lf in full if v in paths[lf]]
        glob[v] = sum(through) / len(through) if through else 0.0

    def lcp(a: int, b: int) -> int:
        x, y = by_id[a].action_token_ids, by_id[b].action_token_ids
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        return k

    def subtree_leaves(m: int, same_phase: bool) -> list[int]:
        out, stack = [], [m]
        while stack:
            v = stack.pop()
            if not kids[v]:
                out.append(v)
            stack.extend(c for c in kids[v]
                         if not same_phase or by_id[c].phase == by_id[v].phase)
        return out

    def ret(m: int) -> float:
        pure = subtree_leaves(m, True) or subtree_leaves(m, False)
        return sum(by_id[lf].reward or 0.0 for lf in pure) / len(pure)

    tokens = {v: [glob[v]] * len(n.action_token_ids) + [0.0] * len(n.observation_token_ids)
              for v, n in by_id.items()}
    clip: dict[int, list[float]] = {v: [p.eps_low] * len(tokens[v]) for v in by_id}
    node_credit = dict(glob)
    for v in by_id:
        local = [c for c in kids[v] if by_id[c].phase == p.local_phase]
        explore = [c for c in kids[v] if by_id[c].phase == p.explore_phase]
        if not local or not explore:
            continue
        y0 = max(explore, key=lambda e: (e in marked, sum(lcp(e, c) for c in local)))
        members = [y0, *local]
        k = len(local)
        r = {m: ret(m) for m in members}
        a_g = agreement.get(v, math.nan)
        a_g = p.agreement if math.isnan(a_g) else a_g
        w = k / (k + p.n0) * a_g
        for m in members:
            a_loc = r[m] - (sum(r.values()) - r[m]) / k
            start = min(lcp(c, y0) for c in local) if m == y0 else lcp(m, y0)
            strong = m == y0 and a_loc < 0 and w >= p.w_min
            value = p.lambda_loc * w * a_loc
            if strong and p.negative in ("scale", "both"):
                value *= 1 + p.gamma
            if start < len(by_id[m].action_token_ids):  # C9: a non-empty changed region
                node_credit[m] += value
            for t in range(start, len(by_id[m].action_token_ids)):
                tokens[m][t] += value
                if strong and p.negative in ("clip", "both"):
                    clip[m][t] = p.eps_low + p.eps_neg
    with_clip = p.negative in ("clip", "both")
    return {(tree.tree_id, v): (node_credit[v], tokens[v], clip[v] if with_clip else None)
            for v in by_id}


@st.composite
def caliper_trees(draw: st.DrawFn, tree_id: str) -> tuple[Tree, dict[int, float], set[int]]:
    """A random CALIPER-shaped tree, its agreement extras and y0 marks (by node id).

    Full rollouts are explore chains from the root; groups of 1-4 resamples hang
    below the root or inner chain nodes, copy a random prefix of y0's actions, and
    may branch. Tokens come from a tiny vocabulary so prefixes also match by chance.
    """
    tok = st.integers(0, 3)
    obs = st.lists(st.integers(90, 99), max_size=2)
    reward = st.sampled_from([0.0, 0.0, 1.0, 0.5])
    specs: list[dict[str, Any]] = [dict(parent=None, actions=draw(st.lists(tok, max_size=2)),
                                        obs=[100], phase=draw(st.sampled_from([None, "explore"])))]
    inner: list[int] = [0]  # candidate branching nodes: root and inner explore nodes
    for _ in range(draw(st.integers(1, 4))):
        parent = 0
        for step in range(draw(st.integers(1, 3))):
            specs.append(dict(parent=parent, actions=draw(st.lists(tok, max_size=5)),
                              obs=draw(obs), phase="explore"))
            parent = len(specs) - 1
            if step < 2:
                inner.append(parent)
        inner = [v for v in inner if v != parent]  # the chain's last node is a leaf
    for _ in range(draw(st.integers(0, 3))):
        p = draw(st.sampled_from(inner))
        y0_actions = next(s["actions"] for s in specs if s["parent"] == p
                          and s["phase"] == "explore")
        phase = draw(st.sampled_from(["local", "local", "local", "probe"]))
        for _ in range(draw(st.integers(1, 4))):
            keep = draw(st.integers(0, len(y0_actions)))
            specs.append(dict(parent=p, actions=y0_actions[:keep] + draw(st.lists(tok, max_size=3)),
                              obs=draw(obs), phase=phase))
            top = len(specs) - 1
            for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
                specs.append(dict(parent=top, actions=draw(st.lists(tok, max_size=3)), obs=[],
                                  phase=phase))
    has_child = {s["parent"] for s in specs}
    ids = draw(st.permutations(range(len(specs))))
    nodes = [node(ids[i], None if s["parent"] is None else ids[s["parent"]], s["actions"],
                  s["obs"], s["phase"], draw(reward) if i not in has_child else None)
             for i, s in enumerate(specs)]
    agreement = draw(st.dictionaries(st.sampled_from([ids[v] for v in inner]),
                                     st.sampled_from([0.0, 0.5, 0.9, 1.0, math.nan])))
    marked = set(draw(st.lists(st.sampled_from(ids), max_size=2)))
    return Tree(tree_id, nodes), agreement, marked


class CaliperCase(NamedTuple):
    """A random CALIPER batch: its trees, the agreement extras and the y0-marked nodes
    (both keyed by (tree id, node id))."""

    trees: list[Tree]
    agreement: dict[Key, float]
    marked: set[Key]


@st.composite
def caliper_batches(draw: st.DrawFn) -> CaliperCase:
    names = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4, unique=True))
    trees: list[Tree] = []
    agreement: dict[Key, float] = {}
    marked: set[Key] = set()
    for name in names:
        tree, agr, mk = draw(caliper_trees(name))
        trees.append(tree)
        agreement.update({(name, k): v for k, v in agr.items()})
        marked.update((name, k) for k in mk)
    return CaliperCase(trees, agreement, marked)


params_st = st.builds(CaliperParams, lambda_loc=st.sampled_from([1.0, 0.5]),
                      n0=st.sampled_from([2.0, 0.0]), gamma=st.sampled_from([0.5, 1.0]),
                      w_min=st.sampled_from([0.0, 0.5, 0.9]),
                      negative=st.sampled_from(["scale", "clip", "both", "none"]),
                      std=st.sampled_from(["unbiased", "population", "none"]))


def batch_of(trees: list[Tree], agreement: dict[Key, float], marked: set[Key]) -> TreeArrays:
    return with_extras(from_trees(trees), agreement=agreement, y0=marked)


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, (node_w, tok_w, clip_w) in want.items():
        node_g, tok_g, clip_g = got[key]
        assert node_g == pytest.approx(node_w, abs=1e-9), key
        assert tok_g == pytest.approx(tok_w, abs=1e-9), key
        assert (clip_g is None) == (clip_w is None), key
        if clip_w is not None:
            assert clip_g == pytest.approx(clip_w), key


@SETTINGS
@given(caliper_batches(), params_st)
def test_matches_reference_loop(case: CaliperCase, params: CaliperParams) -> None:
    trees, agreement, marked = case
    batch = batch_of(trees, agreement, marked)
    want: dict = {}
    for t in trees:
        want.update(ref_caliper(t, params, {k: v for (tid, k), v in agreement.items()
                                            if tid == t.tree_id},
                                {k for tid, k in marked if tid == t.tree_id}))
    assert_same(by_node(batch, caliper(batch, params)), want)


# ----------------------------------------------------------------- 3. invariants
@SETTINGS
@given(caliper_batches(), params_st)
def test_invariants(case: CaliperCase, params: CaliperParams) -> None:
    trees, agreement, marked = case
    batch = batch_of(trees, agreement, marked)
    credit = caliper(batch, params)
    g = caliper_groups(batch, params)

    # C4: leave-one-out credit sums to zero within each group.
    sums = np.bincount(g.branch, weights=g.a_loc, minlength=batch.n_nodes)
    assert np.allclose(sums, 0.0, atol=1e-9)
    # Tool output (observation) tokens never receive advantage.
    assert np.all(credit.token[~batch.agent_mask] == 0.0)
    # Local credit only inside changed regions: outside them the token advantage is
    # the node's global part, which is 0 at non-members off full trajectories
    # (pre-divergence tokens and later steps of a suffix).
    glob = caliper(batch, dataclasses.replace(params, lambda_loc=0.0))
    changed = np.zeros(batch.n_tokens, bool)
    for m, s, e in zip(g.member, g.start, g.stop, strict=True):
        changed[batch.token_offsets[m] + s: batch.token_offsets[m] + e] = True
    assert np.array_equal(credit.token[~changed], glob.token[~changed])
    # C9: a node's value is the credit of its last action token (Â_global without any).
    n_act = np.bincount(batch.token_node[batch.agent_mask], minlength=batch.n_nodes)
    last = batch.token_offsets[:-1] + n_act - 1
    has = n_act > 0
    np.testing.assert_allclose(credit.node[has], credit.token[last[has]], atol=1e-12)
    np.testing.assert_allclose(credit.node[~has], glob.node[~has], atol=1e-12)
    # Batch order does not matter.
    again = batch_of(trees[::-1], agreement, marked)
    assert_same(by_node(again, caliper(again, params)), by_node(batch, credit))


@SETTINGS
@given(caliper_batches())
def test_all_failed_full_rollouts_still_learn_from_mixed_groups(case: CaliperCase) -> None:
    trees, _, marked = case
    for t in trees:  # every full rollout fails
        for n in t.nodes:
            if n.reward is not None and n.phase != "local":
                n.reward = 0.0
    batch = batch_of(trees, {}, marked)
    credit = caliper(batch, CaliperParams())
    g = caliper_groups(batch, CaliperParams())
    # the global part is zero everywhere: non-members get nothing at all
    non_member = ~np.isin(np.arange(batch.n_nodes), g.member)
    assert np.all(credit.node[non_member] == 0.0)
    # a mixed group (some A_loc != 0) with a non-empty changed region gives credit there
    if np.any((g.stop > g.start) & (g.a_loc != 0)):
        assert np.any(credit.token != 0.0)


@SETTINGS
@given(caliper_batches())
def test_without_resamples_it_is_grpo(case: CaliperCase) -> None:
    trees = case.trees
    for t in trees:  # drop every resampled subtree
        local = {n.node_id for n in t.nodes if n.phase in ("local", "probe")}
        keep = []
        for n in t.nodes:
            path = {v.node_id for v in t.path_to(n.node_id)}
            if not path & local:
                keep.append(n)
        t.nodes = keep
    batch = from_trees(trees)
    got = caliper(batch, CaliperParams())
    want = grpo(batch, GrpoParams(std="unbiased", eps=1e-6, single="zero", group="tree"))
    assert np.allclose(got.node, want.node) and np.allclose(got.token, want.token)
