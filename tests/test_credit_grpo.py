"""``grpo`` and ``tree_grpo`` estimators, tested three ways: a hand case, a reference loop, invariants.

1. Small trees with advantages worked out by hand in the comments.
2. A plain-Python reference (dicts and loops over ``Tree`` objects, one tree at
   a time) against the vectorised estimators on random batches of trees.
3. Invariants: splitting a step into an unbranched chain of two steps changes
   no token's advantage; tool output never gets (or changes) advantage; the
   verl / TRL presets equal those frameworks' formulas on one-level trees; the
   order of trees in a batch does not matter.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace

import numpy as np
import pytest
from credit_helpers import (
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
from train.credit.grpo import GrpoParams, grpo
from train.credit.tree_grpo import TreeGrpoParams, tree_grpo

EPS = 1e-6
_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=_SLOW_DATA)
QUICK = settings(max_examples=15, deadline=None, suppress_health_check=_SLOW_DATA)  # invariants


# ----------------------------------------------------------------- building trees by hand
def one_level(tree_id: str, rewards: Sequence[float], task: str = "x") -> Tree:
    """A verl/TRL dump as imported: a prompt root (tool-free, prompt tokens as
    observation) and one 2-token completion leaf per reward."""
    nodes = [node(0, None, 0, 3)]
    nodes += [node(i + 1, 0, 2, reward=r) for i, r in enumerate(rewards)]
    return Tree(tree_id=tree_id, nodes=nodes, task_id=task)


# ----------------------------------------------------------------- 1. hand-computed cases
def small_tree() -> Tree:
    #   0 prompt (3 prompt tokens, observation)
    #   ├── 1 (2 agent tokens, 1 tool-output token)
    #   │   ├── 3  R = 1
    #   │   └── 4  R = 0
    #   └── 2  R = 1 (2 agent tokens)
    return Tree(tree_id="a", task_id="x", nodes=[
        node(0, None, 0, 3), node(1, 0, 2, 1), node(2, 0, 2, 0, reward=1.0),
        node(3, 1, 1, 0, reward=1.0), node(4, 1, 1, 0, reward=0.0)])


def test_grpo_small_tree_by_hand() -> None:
    batch = from_trees([small_tree()])
    # Rows are in preorder with children by ascending id: 0, 1, 3, 4, 2.
    assert list(batch.node_ids) == [0, 1, 3, 4, 2]
    # Group = the three trajectories 0-1-3 (R=1), 0-1-4 (R=0), 0-2 (R=1).
    # mean = 2/3; deviations 1/3, -2/3, 1/3; unbiased var = (1/9+4/9+1/9)/2 = 1/3,
    # std = 0.57735.  A3 = A2 = (1/3)/0.57735 = 0.57735, A4 = -(2/3)/0.57735 = -1.1547.
    s = math.sqrt(1 / 3)
    a_hi, a_lo = (1 / 3) / (s + EPS), (-2 / 3) / (s + EPS)
    # Node 1 lies on 0-1-3 and 0-1-4: (0.57735 - 1.1547)/2 = -0.288675.
    # The root lies on all three: mean of a z-score group = 0.
    expected_node = [0.0, (a_hi + a_lo) / 2, a_hi, a_lo, a_hi]
    credit = grpo(batch, GrpoParams())
    np.testing.assert_allclose(credit.node, expected_node, atol=1e-12)
    assert credit.node[1] == pytest.approx(-0.288675, abs=1e-6)
    # Tokens: root 3 prompt tokens -> 0; node 1: 2 agent tokens + 1 tool output (0);
    # node 3: 1; node 4: 1; node 2: 2 agent tokens.
    n1 = (a_hi + a_lo) / 2
    np.testing.assert_allclose(credit.token, [0, 0, 0, n1, n1, 0, a_hi, a_lo, a_hi, a_hi],
                               atol=1e-12)

    # Population std: var = (6/9)/3 = 2/9, std = 0.471405; A3 = (1/3)/0.471405 = 0.707106.
    pop = grpo(batch, GrpoParams(std="population"))
    p = math.sqrt(2 / 9)
    np.testing.assert_allclose(pop.node[[2, 3]], [(1 / 3) / (p + EPS), (-2 / 3) / (p + EPS)])
    # Dr.GRPO (no F_norm): A = R - mean = 1/3, -2/3, 1/3; node 1 = (1/3 - 2/3)/2 = -1/6.
    dr = grpo(batch, GrpoParams(std="none"))
    np.testing.assert_allclose(dr.node, [0, -1 / 6, 1 / 3, -2 / 3, 1 / 3], atol=1e-12)


def test_grpo_zero_variance_and_single_member_groups() -> None:
    flat = one_level("flat", [0.1, 0.1, 0.1])  # all equal: exactly 0, no ulp noise / eps
    lone = Tree(tree_id="lone", task_id="y", nodes=[node(0, None, 2, 1, reward=0.7)])
    batch = from_trees([flat, lone])
    zero = grpo(batch, GrpoParams())
    assert np.all(zero.node == 0.0) and np.all(zero.token == 0.0)
    # A group of one: "raw" keeps its score with mean 0 and F_norm 1: 0.7 / (1 + 1e-6).
    raw = grpo(batch, GrpoParams(single="raw"))
    assert raw.node[-1] == 0.7 / (1 + EPS)
    np.testing.assert_array_equal(raw.token[-3:], [0.7 / (1 + EPS)] * 2 + [0.0])
    assert grpo(batch, GrpoParams(single="raw", std="none")).node[-1] == 0.7


def test_grpo_group_by_task() -> None:
    # Two one-level trees of one task: group="task" pools the 4 leaves,
    # rewards 1, 0 | 1, 1: mean 0.75, unbiased std = sqrt((3*0.0625 + 0.5625)/3) = 0.5.
    batch = from_trees([one_level("p", [1.0, 0.0]), one_level("q", [1.0, 1.0])])
    credit = grpo(batch, GrpoParams(group="task"))
    hi, lo = 0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS)  # 0.5, -1.5
    np.testing.assert_allclose(credit.node, [(hi + lo) / 2, hi, lo, hi, hi, hi], atol=1e-12)
    # Per tree instead: tree q has zero variance -> 0.
    assert np.all(grpo(batch, GrpoParams()).node[3:] == 0.0)


def test_tree_grpo_by_hand() -> None:
    # Task x has two stored trees; task z one (a separate prompt-level group). Each child
    # of a stored root roots one Tree-GRPO tree (an initial chain and its expansions).
    # t1: 0 -> {1: R=1, 2: R=0}                    two chains: Tree-GRPO trees {1}, {2}
    # t2: 0 -> 1 -> {2: R=1, 3: R=0}; 0 -> 4: R=0  Tree-GRPO trees {1: leaves 2, 3}, {4}
    t1 = one_level("t1", [1.0, 0.0])
    t2 = Tree(tree_id="t2", task_id="x", nodes=[
        node(0, None, 0, 2), node(1, 0, 1, 1), node(2, 1, reward=1.0), node(3, 1, reward=0.0),
        node(4, 0, reward=0.0)])
    t3 = one_level("t3", [0.0, 2.0], task="z")
    batch = from_trees([t1, t2, t3])
    credit = tree_grpo(batch, TreeGrpoParams())
    # Inter-tree (task x): rewards 1, 0, 1, 0, 0: mean 0.4, unbiased std sqrt(0.3) = 0.547723:
    #   R=1 -> 0.6/0.547723 = 1.095445;  R=0 -> -0.4/0.547723 = -0.730297.
    s5 = math.sqrt(0.3)
    inter1, inter0 = 0.6 / (s5 + EPS), -0.4 / (s5 + EPS)
    # Intra-tree: t1's trees and t2's tree {4} hold one leaf each -> 0. t2's tree {1}:
    # rewards 1, 0: mean 0.5, std sqrt(0.5) -> +-0.707107.
    s2 = math.sqrt(0.5)
    hi, lo = 0.5 / (s2 + EPS) + inter1, -0.5 / (s2 + EPS) + inter0  # 1.802552, -1.437404
    assert hi == pytest.approx(1.802552, abs=1e-5) and lo == pytest.approx(-1.437404, abs=1e-5)
    # t3 alone in task z: chains only, so A = inter = +-1/sqrt 2 (GRPO of the group).
    z = 1.0 / (math.sqrt(2) + EPS)
    expected = {
        ("t1", 0): (inter1 + inter0) / 2, ("t1", 1): inter1, ("t1", 2): inter0,
        # t2 root: (1.802552 - 1.437404 - 0.730297) / 3; node 1 lies on leaves 2 and 3.
        ("t2", 0): (hi + lo + inter0) / 3, ("t2", 1): (hi + lo) / 2, ("t2", 2): hi,
        ("t2", 3): lo, ("t2", 4): inter0,
        ("t3", 0): 0.0, ("t3", 1): -z, ("t3", 2): z,
    }
    got = by_row(batch, credit.node)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    # The old reading (intra = the whole stored tree) gave t3 exactly 2x GRPO.
    assert got[("t3", 2)] != pytest.approx(2 * z)


def test_tree_grpo_groups_never_mix_runs_samplers_or_versions() -> None:
    # Same task id, different runs / samplers / policy versions: separate prompt groups.
    base = one_level("a", [1.0, 0.0])
    others = [replace(one_level("b", [1.0, 1.0]), run_id="r2"),
              replace(one_level("c", [1.0, 1.0]), sampler="bel"),
              replace(one_level("d", [1.0, 1.0]), policy_version="v2")]
    for other in others:
        batch = from_trees([base, other])
        for credit in (tree_grpo(batch, TreeGrpoParams()), grpo(batch, GrpoParams(group="task"))):
            a = 0.5 / (math.sqrt(0.5) + EPS)
            np.testing.assert_allclose(credit.node, [0.0, a, -a, 0.0, 0.0, 0.0], atol=1e-12)


# ----------------------------------------------------------------- 2. reference loop
def ref_leaf_advantages(trees: list[Tree], group_of: Callable[[Tree, int], Hashable],
                        std: str, eps: float, single: str) -> dict[tuple[str, int], float]:
    """z-score of each leaf's reward within the leaves of its group, ``group_of(tree, leaf)``."""
    members: dict[Hashable, list[tuple[str, int, float]]] = {}
    for tree in trees:
        for leaf in tree.leaves():
            assert leaf.reward is not None
            members.setdefault(group_of(tree, leaf.node_id), []).append(
                (tree.tree_id, leaf.node_id, leaf.reward))
    out = {}
    for rows in members.values():
        zs = ref_zscore([r for _, _, r in rows], std, eps, single)
        for (tid, nid, _), z in zip(rows, zs, strict=True):
            out[(tid, nid)] = z
    return out


def ref_node_means(trees: list[Tree], leaf_adv: dict[tuple[str, int], float]
                   ) -> dict[tuple[str, int], float]:
    """Each node's mean of leaf advantages over the trajectories (root-to-leaf paths) through it."""
    out = {}
    for tree in trees:
        paths = {leaf.node_id: {n.node_id for n in tree.path_to(leaf.node_id)}
                 for leaf in tree.leaves()}
        for n in tree.nodes:
            through = [leaf_adv[(tree.tree_id, lid)] for lid, path in paths.items()
                       if n.node_id in path]
            out[(tree.tree_id, n.node_id)] = sum(through) / len(through)
    return out


def ref_tokens(trees: list[Tree], batch: TreeArrays,
               node_credit: dict[tuple[str, int], float]) -> np.ndarray:
    """Per-token advantages in the batch's layout: the node's credit on its action
    tokens, 0 on its observation tokens."""
    by_key = {(t.tree_id, n.node_id): n for t in trees for n in t.nodes}
    out: list[float] = []
    for t, nid in zip(batch.node_tree, batch.node_ids, strict=True):
        key = (batch.tree_ids[t], int(nid))
        n = by_key[key]
        out += [node_credit[key]] * len(n.action_token_ids) + [0.0] * len(n.observation_token_ids)
    return np.array(out)


def ref_grpo(trees: list[Tree], std: str, eps: float, single: str, group: str
             ) -> dict[tuple[str, int], float]:
    def group_of(tree: Tree, leaf: int) -> Hashable:
        return tree.tree_id if group == "tree" else group_key(tree)
    return ref_node_means(trees, ref_leaf_advantages(trees, group_of, std, eps, single))


def first_step(tree: Tree, leaf: int) -> Hashable:
    """The Tree-GRPO tree of a leaf: the root's child on its path (the root if it is the leaf)."""
    path = tree.path_to(leaf)
    return (tree.tree_id, path[1].node_id if len(path) > 1 else path[0].node_id)


def ref_tree_grpo(trees: list[Tree], std: str, eps: float, single: str
                  ) -> dict[tuple[str, int], float]:
    intra = ref_leaf_advantages(trees, first_step, std, eps, "zero")
    inter = ref_leaf_advantages(trees, lambda t, _: group_key(t), std, eps, single)
    return ref_node_means(trees, {k: intra[k] + inter[k] for k in intra})


def assert_matches(trees: list[Tree], batch: TreeArrays, credit: Credit,
                   expected: dict[tuple[str, int], float]) -> None:
    got = by_row(batch, credit.node)
    assert got.keys() == expected.keys()
    keys = sorted(expected)
    np.testing.assert_allclose([got[k] for k in keys], [expected[k] for k in keys],
                               rtol=1e-9, atol=1e-9, equal_nan=True)
    np.testing.assert_allclose(credit.token, ref_tokens(trees, batch, expected),
                               rtol=1e-9, atol=1e-9, equal_nan=True)


@st.composite
def batches(draw: st.DrawFn, max_size: int = 4) -> list[Tree]:
    """Random trees, several of them sharing a task (a prompt with several trees)."""
    trees = draw(tree_lists(max_size=max_size, max_nodes=20))
    tasks = draw(st.lists(st.sampled_from(["u", "v", "w"]), min_size=len(trees),
                          max_size=len(trees)))
    return [replace(t, task_id=k) for t, k in zip(trees, tasks, strict=True)]


@SETTINGS
@given(trees=batches(), std=st.sampled_from(["unbiased", "population", "none"]),
       single=st.sampled_from(["zero", "raw"]), group=st.sampled_from(["tree", "task"]),
       eps=st.sampled_from([1e-6, 1e-4, 0.0]))
def test_grpo_matches_reference(trees: list[Tree], std: str, single: str, group: str,
                                eps: float) -> None:
    batch = from_trees(trees)
    params = GrpoParams(std=std, single=single, group=group, eps=eps)  # type: ignore[arg-type]
    assert_matches(trees, batch, grpo(batch, params), ref_grpo(trees, std, eps, single, group))


@SETTINGS
@given(trees=batches(), std=st.sampled_from(["unbiased", "population", "none"]),
       single=st.sampled_from(["zero", "raw"]))
def test_tree_grpo_matches_reference(trees: list[Tree], std: str, single: str) -> None:
    batch = from_trees(trees)
    params = TreeGrpoParams(std=std, single=single)  # type: ignore[arg-type]
    assert_matches(trees, batch, tree_grpo(batch, params), ref_tree_grpo(trees, std, EPS, single))


# ----------------------------------------------------------------- 3. invariants
def no_segments(tree: Tree) -> Tree:
    return replace(tree, nodes=[replace(n, segments=[]) for n in tree.nodes])


ESTIMATOR_CASES = [("grpo", GrpoParams()), ("grpo", GrpoParams(group="task", std="none")),
                   ("tree_grpo", TreeGrpoParams())]


@QUICK
@given(trees=batches(max_size=3), data=st.data())
def test_unbranched_chain_split_changes_nothing(trees: list[Tree], data: st.DataObject) -> None:
    # A step split into a chain of two steps lies on the same trajectories, so every
    # token keeps its advantage (the token layout of the batch is identical). For
    # tree_grpo this holds for every step but the stored root, whose children root the
    # Tree-GRPO trees.
    b = data.draw(st.integers(0, len(trees) - 1))
    victim = data.draw(st.sampled_from([n.node_id for n in trees[b].nodes]))
    before = [no_segments(t) for t in trees]
    after = list(before)
    after[b] = split_step(before[b], victim)
    x, y = from_trees(before), from_trees(after)
    np.testing.assert_array_equal(x.agent_mask, y.agent_mask)
    for name, params in ESTIMATOR_CASES:
        if name == "tree_grpo" and victim == trees[b].root().node_id:
            continue  # splitting the root makes its children one Tree-GRPO tree (G9)
        cx, cy = ESTIMATORS[name](x, params), ESTIMATORS[name](y, params)
        np.testing.assert_allclose(cx.token, cy.token, rtol=1e-9, atol=1e-12)
        gx, gy = by_row(x, cx.node), by_row(y, cy.node)
        assert all(gx[k] == pytest.approx(gy[k], rel=1e-9, abs=1e-12) for k in gx)


def test_chain_tree_is_one_trajectory() -> None:
    # An unbranched tree is one trajectory: every step carries that trajectory's
    # advantage. Two chains of one task, group="task": rewards 2, 0 -> +-1/(sqrt 2 + eps).
    def chain(tid: str, r: float) -> Tree:
        return Tree(tree_id=tid, task_id="x", nodes=[
            node(0, None, 0, 2), node(1, 0, 2, 1), node(2, 1, 1, 1), node(3, 2, 2, reward=r)])
    batch = from_trees([chain("c1", 2.0), chain("c2", 0.0)])
    credit = grpo(batch, GrpoParams(group="task"))
    a = 1.0 / (math.sqrt(2) + EPS)
    np.testing.assert_allclose(credit.node, [a] * 4 + [-a] * 4)
    # ... the same as one one-level tree with the two trajectories as completions.
    flat = grpo(from_trees([one_level("f", [2.0, 0.0])]), GrpoParams())
    np.testing.assert_allclose(flat.node[1:], [a, -a])


@QUICK
@given(trees=batches(max_size=3), data=st.data())
def test_tool_output_never_gets_or_changes_advantage(trees: list[Tree],
                                                     data: st.DataObject) -> None:
    more = with_more_tool_output(trees, data)
    x, y = from_trees(trees), from_trees(more)
    for name, params in ESTIMATOR_CASES:
        cx, cy = ESTIMATORS[name](x, params), ESTIMATORS[name](y, params)
        for batch, credit in ((x, cx), (y, cy)):
            assert np.all(credit.token[~batch.agent_mask] == 0.0)
        np.testing.assert_array_equal(cx.node, cy.node)
        np.testing.assert_array_equal(cx.token[x.agent_mask], cy.token[y.agent_mask])


@QUICK
@given(trees=batches(), data=st.data())
def test_order_of_trees_does_not_matter(trees: list[Tree], data: st.DataObject) -> None:
    shuffled = data.draw(st.permutations(trees))
    x, y = from_trees(trees), from_trees(shuffled)
    for name, params in [*ESTIMATOR_CASES, ("grpo", GrpoParams(group="task"))]:
        cx, cy = ESTIMATORS[name](x, params), ESTIMATORS[name](y, params)
        gx, gy = by_row(x, cx.node), by_row(y, cy.node)
        keys = sorted(gx)
        np.testing.assert_allclose([gx[k] for k in keys], [gy[k] for k in keys],
                                   rtol=1e-9, atol=1e-12)
        tx, ty = agent_tokens_of(x, cx.token), agent_tokens_of(y, cy.token)
        for k in keys:
            np.testing.assert_allclose(tx[k], ty[k], rtol=1e-9, atol=1e-12)


# verl's compute_grpo_outcome_advantage, transcribed (verl/trainer/ppo/core_algos.py):
#   a group of one gets mean 0, std 1; otherwise torch.mean / torch.std (unbiased);
#   score = (score - mean) / (std + epsilon), epsilon = 1e-6.
def verl_advantages(scores: list[float], index: list[str]) -> list[float]:
    groups: dict[str, list[float]] = {}
    for s, i in zip(scores, index, strict=True):
        groups.setdefault(i, []).append(s)
    stats = {i: (0.0, 1.0) if len(g) == 1 else (statistics.fmean(g), statistics.stdev(g))
             for i, g in groups.items()}
    return [(s - stats[i][0]) / (stats[i][1] + 1e-6) for s, i in zip(scores, index, strict=True)]


# TRL's GRPOTrainer (scale_rewards="group"): advantages = rewards - group mean, divided by
# (group .std(dim=1), unbiased, + 1e-4); a group of one has std 0 and R - mean = 0.
def trl_advantages(rewards: list[float], index: list[str]) -> list[float]:
    groups: dict[str, list[float]] = {}
    for r, i in zip(rewards, index, strict=True):
        groups.setdefault(i, []).append(r)
    stats = {i: (statistics.fmean(g), statistics.stdev(g) if len(g) > 1 else 0.0)
             for i, g in groups.items()}
    return [(r - stats[i][0]) / (stats[i][1] + 1e-4) for r, i in zip(rewards, index, strict=True)]


def test_presets_equal_verl_and_trl_on_one_level_trees() -> None:
    # Prompt p: rewards 1, 0, 0, 1, 1: mean 0.6, unbiased std = sqrt((2*.36 + 3*.16)/4)
    # = sqrt(0.3) = 0.5477226.  verl: R=1 -> 0.4/(0.5477226 + 1e-6) = 0.7302954,
    # R=0 -> -0.6/(0.5477226 + 1e-6) = -1.0954431.  TRL: 0.4/(0.5477226 + 1e-4) = 0.7301634.
    # Prompt q: one completion, R = 0.5: verl keeps 0.5/(1 + 1e-6); TRL gives 0.
    # Prompt r: rewards 0.3, 0.3: zero variance -> 0 in both.
    rewards = {"p": [1.0, 0.0, 0.0, 1.0, 1.0], "q": [0.5], "r": [0.3, 0.3]}
    batch = from_trees([one_level(k, v, task=k) for k, v in rewards.items()])
    leaf = batch.is_leaf
    flat = [r for v in rewards.values() for r in v]
    index = [k for k, v in rewards.items() for _ in v]
    verl = grpo(batch, GrpoParams(preset="verl")).node[leaf]
    trl = grpo(batch, GrpoParams(preset="trl")).node[leaf]
    np.testing.assert_allclose(verl, verl_advantages(flat, index), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(trl, trl_advantages(flat, index), rtol=1e-12, atol=1e-15)
    s = math.sqrt(0.3)
    assert verl[0] == pytest.approx(0.4 / (s + 1e-6), rel=1e-12)
    assert verl[0] == pytest.approx(0.7302954, abs=1e-7)
    assert trl[0] == pytest.approx(0.4 / (s + 1e-4), rel=1e-12)
    assert trl[0] == pytest.approx(0.7301634, abs=1e-7)
    assert verl[5] == 0.5 / (1 + 1e-6) and trl[5] == 0.0
    assert np.all(verl[6:] == 0.0) and np.all(trl[6:] == 0.0)
    # Each completion's tokens carry its advantage; the prompt's tokens carry 0.
    token = grpo(batch, GrpoParams(preset="verl")).token
    assert np.all(token[~batch.agent_mask] == 0.0)
    np.testing.assert_allclose(token[batch.agent_mask], np.repeat(verl, 2))


def test_params_are_checked() -> None:
    with pytest.raises(ValueError, match="std"):
        GrpoParams(std="sample")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="preset"):
        GrpoParams(preset="openrlhf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ambiguous"):
        GrpoParams(preset="verl", eps=1e-3)
    with pytest.raises(ValueError, match="eps"):
        TreeGrpoParams(eps=-1.0)
    assert GrpoParams(preset="trl").resolved() == ("unbiased", 1e-4, "zero")
    assert ESTIMATORS["grpo"].parse_params({"preset": "verl"}).resolved() == (
        "unbiased", 1e-6, "raw")
    assert GrpoParams().params_hash() != GrpoParams(std="none").params_hash()


@st.composite
def chain_forests(draw: st.DrawFn) -> list[Tree]:
    """Stored trees whose root children are unbranched chains (Tree-GRPO's initial chains,
    never expanded), several trees sharing a task."""
    trees = []
    for b in range(draw(st.integers(1, 4))):
        nodes = [node(0, None, 0, 2)]
        for _ in range(draw(st.integers(1, 4))):
            parent = 0
            length = draw(st.integers(1, 3))
            for d in range(length):
                nid = len(nodes)
                leaf = d == length - 1
                reward = draw(st.sampled_from([0.0, 1.0, 0.5, 2.0])) if leaf else None
                nodes.append(node(nid, parent, draw(st.integers(0, 2)), 1, reward=reward))
                parent = nid
        trees.append(Tree(tree_id=f"c{b}", task_id=draw(st.sampled_from(["u", "v"])),
                          nodes=nodes))
    return trees


@QUICK
@given(trees=chain_forests(), std=st.sampled_from(["unbiased", "population", "none"]),
       single=st.sampled_from(["zero", "raw"]))
def test_chain_tree_grpo_is_grpo(trees: list[Tree], std: str, single: str) -> None:
    # An unexpanded initial chain is a Tree-GRPO tree of one trajectory: A_intra = 0, so
    # Tree-GRPO reduces to GRPO over the prompt group (G9-G11).
    batch = from_trees(trees)
    got = tree_grpo(batch, TreeGrpoParams(std=std, single=single))  # type: ignore[arg-type]
    want = grpo(batch, GrpoParams(std=std, single=single, group="task"))  # type: ignore[arg-type]
    np.testing.assert_array_equal(got.node, want.node)
    np.testing.assert_array_equal(got.token, want.token)
