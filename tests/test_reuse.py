"""Reuse of stored trees (issue 12, ``train.reuse``): transport by hand (D4), pi = mu,
refresh from the stored snapshot, named skips, and reuse across a real ``kill -9``."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_store.maintenance import compact
from rollout_store.reader import connect, read_trees
from rollout_store.store import CorruptFileError, Store, open_store
from rollout_store.tree import Node, Tree
from train.config import ConfigError, TrainConfig, load_config
from train.envs import make_env
from train.policies import load_policy
from train.reuse import (
    CALIB_FRAC,
    ReuseParams,
    calibrate_gate,
    gate_params,
    in_calib_split,
    policy_step,
    refresh_routes,
    refresh_trees,
    resolve_tree,
    score_actions,
    select_stored,
    tree_problem,
    write_params,
)
from train.sampling import make_sampler
from train.sequences import build_sequences
from train.trainer import TrainError, latest_checkpoint, read_metrics, train

MU = math.log(0.5)  # every hand-made action: one token sampled with probability 0.5


def _node(nid: int, parent: int | None, reward: float | None = None) -> Node:
    if parent is None:
        return Node(node_id=nid, parent_id=None, kind="prompt", observation_text="p")
    return Node(node_id=nid, parent_id=parent, action_text=f"a{nid}", action_token_ids=[nid],
                action_logprobs=[MU], observation_text=f"o{nid}", reward=reward,
                terminal=reward is not None)


def _hand_tree() -> Tree:
    """Root actions 1 (leaves 3: R=1, 4: R=0) and 2 (leaves 5: R=0, 6: R=1)."""
    nodes = [_node(0, None), _node(1, 0), _node(2, 0), _node(3, 1, 1.0), _node(4, 1, 0.0),
             _node(5, 2, 0.0), _node(6, 2, 1.0)]
    return Tree(tree_id="t", nodes=nodes, run_id="r", env="calc")


def _prox(ratios: dict[int, float], scale: float = 1.0) -> dict[tuple[str, int], np.ndarray]:
    """log pi = log(mu * (1 + scale * z)) for each node's single token."""
    return {("t", n): np.array([MU + math.log(1.0 + scale * (r - 1.0))])
            for n, r in ratios.items()}


def test_transport_equals_d4_by_hand_and_is_linear_in_z() -> None:
    z = {3: 1.5, 4: 0.8, 5: 1.2, 6: 0.5}
    res = resolve_tree(_hand_tree(), "transport", _prox(z), ReuseParams())
    # root comparison (anchor 0): folds by leaf preorder rank: 3, 5 -> fold 0; 4, 6 ->
    # fold 1. State = parent. b^0(1) = R_3 = 1, b^1(1) = R_4 = 0, b^0(2) = R_5 = 0,
    # b^1(2) = R_6 = 1.
    by_hand = {3: 1 + 0.5 * (1 - 0), 4: 0 + (-0.2) * (0 - 1),
               5: 0 + 0.2 * (0 - 1), 6: 1 + (-0.5) * (1 - 0)}
    for leaf, value in by_hand.items():
        assert res.transported[leaf] == pytest.approx(value, abs=1e-12)
    # Q_T(1) = (1.5 + .2) / 2 = .85, Q_T(2) = (-.2 + .5) / 2 = .15 (Qbar = .5). Nodes 1
    # and 2 compare leaves (no step below: reused), so within them the stored gaps stay:
    # leaves of 1 -> .85 -+ .5, leaves of 2 -> .15 -+ .5.
    composed = {3: 1.35, 4: 0.35, 5: -0.35, 6: 0.65}
    for leaf, value in composed.items():
        assert res.returns[leaf] == pytest.approx(value, abs=1e-12)
    assert res.pairs == {"transport": 1, "reuse": 2} and res.refresh == []
    # linear in z: scaling every z by 1.5 scales T - R by 1.5 (no products of ratios)
    scaled = resolve_tree(_hand_tree(), "transport", _prox(z, 1.5), ReuseParams())
    for leaf in by_hand:
        assert scaled.transported[leaf] - scaled.reward[leaf] == pytest.approx(
            1.5 * (res.transported[leaf] - res.reward[leaf]), abs=1e-12)


def _stored_logprobs(tree: Tree) -> dict[tuple[str, int], np.ndarray]:
    """Every non-root node's stored logprobs as the current ones: pi = mu."""
    return {(tree.tree_id, n.node_id): np.array(n.action_logprobs) for n in tree.nodes
            if n.parent_id is not None}


def _two_level_tree() -> Tree:
    """0 -+- 1 -+- 2 --- 3 (R=1)
          |     +- 4 -+- 5 (R=0)
          |           +- 6 (R=1)
          +- 7 --- 8 (R=0)"""
    nodes = [_node(0, None), _node(1, 0), _node(2, 1), _node(3, 2, 1.0), _node(4, 1),
             _node(5, 4, 0.0), _node(6, 4, 1.0), _node(7, 0), _node(8, 7, 0.0)]
    return Tree(tree_id="t", nodes=nodes, run_id="r", env="calc")


def test_comparisons_below_the_root_are_anchored_at_their_node() -> None:
    """D4 at each branching node of a two-level tree, by hand, and the composed returns.

    ratios (z): 2: 1.5 (.5), 3: 2 (1), 4: .5 (-.5), 5: .5 (-.5), 6: 1.5 (.5), 8: 1.2 (.2);
    states are parents.
    Anchor 1 (children 2, 4; steps 3, 5, 6; folds 3 -> 0, 5 -> 1, 6 -> 0):
      b^0(2) = R_3 = 1, b^0(4) = R_6 = 1; b^1(2): no visit -> fold-1 mean 0, b^1(4) = R_5 = 0
      T_3 = 1 + 1 (1 - 0) = 2, T_5 = 0 - .5 (0 - 1) = .5, T_6 = 1 + .5 (1 - 0) = 1.5
      Q(2) = 2, Q(4) = 1 (the root-level rule would count z_2, z_4 too).
    Anchor 0 (children 1, 7; steps 2-6, 8; folds 3 -> 0, 5 -> 1, 6 -> 0, 8 -> 1):
      b^0(1) = 1 (leaves 3, 6), b^0(2) = 1, b^0(4) = 1, b^0(7): none -> fold-0 mean 1;
      b^1(1) = 0 (leaf 5), b^1(2): none -> 0, b^1(4) = 0, b^1(7) = 0
      T_3 = 1 + .5 (1 - 0) + 1 (1 - 0) = 2.5; T_5 = 0 - .5 (0 - 1) - .5 (0 - 1) = 1
      T_6 = 1 - .5 (1 - 0) + .5 (1 - 0) = 1; T_8 = 0 + .2 (0 - 1) = -.2
      Q(1) = 4.5 / 3 = 1.5, Q(7) = -.2.
    Anchor 4: leaf children, reused.
    Composition: root Qbar = (3 * 1.5 - .2) / 4 = 1.075; leaves of 1 shifted to mean 1.5
      (+5/6): 3 -> 11/6, 5 -> 5/6, 6 -> 11/6; 8 -> -.2. Node 1 (mean 1.5, Qbar 4/3):
      child 2 -> 1.5 + 2 - 4/3 = 13/6, child 4 -> mean 7/6: 5 -> 2/3, 6 -> 5/3.
    """
    z = {2: 1.5, 3: 2.0, 4: 0.5, 5: 0.5, 6: 1.5, 7: 1.0, 8: 1.2}
    res = resolve_tree(_two_level_tree(), "transport", _prox(z), ReuseParams())
    assert [c.node for c in res.comparisons] == [0, 1, 4]
    root, inner, low = res.comparisons
    assert root.value == pytest.approx({1: 1.5, 7: -0.2})
    assert inner.value == pytest.approx({2: 2.0, 4: 1.0})
    assert low.use == {5: "reuse", 6: "reuse"}
    assert res.transported == pytest.approx({3: 2.5, 5: 1.0, 6: 1.0, 8: -0.2})
    assert res.returns == pytest.approx({3: 13 / 6, 5: 2 / 3, 6: 5 / 3, 8: -0.2})
    assert res.pairs == {"transport": 2, "reuse": 1}
    # reuse: the stored returns exactly; refresh: the inner comparison is refreshed too
    assert resolve_tree(_two_level_tree(), "all", _prox(z), ReuseParams()).returns == {
        3: 1.0, 5: 0.0, 6: 1.0, 8: 0.0}
    ref = resolve_tree(_two_level_tree(), "refresh", _prox(z), ReuseParams())
    assert [c.refresh for c in ref.comparisons] == [[1, 7], [2, 4], []]
    # a posterior replaces a refreshed child's value at its comparison only
    moved = ref.compose({(1, 2): 0.0, (1, 4): 1.0})
    assert moved[5] - moved[6] == pytest.approx(-1.0)  # the leaf gap below 4 is kept
    assert moved[3] - np.mean([moved[5], moved[6]]) == pytest.approx(-1.0)
    assert np.mean([moved[3], moved[5], moved[6]]) == pytest.approx(1.5)  # Q_T(1) kept


def test_pi_equals_mu_transport_is_reuse_and_dsc_has_no_drift() -> None:
    tree = _hand_tree()
    same = _stored_logprobs(tree)
    reuse = resolve_tree(tree, "all", same, ReuseParams())
    transport = resolve_tree(tree, "transport", same, ReuseParams())
    assert transport.returns == reuse.returns == reuse.reward  # exactly
    # dsc: delta = 0, so a resolved reuse gap is reused and nothing is refreshed ...
    clear = Tree(tree_id="t", run_id="r", env="calc", nodes=[
        _node(0, None), _node(1, 0), _node(2, 0),
        *[_node(3 + i, 1, 1.0) for i in range(8)], *[_node(11 + i, 2, 0.0) for i in range(8)]])
    same = _stored_logprobs(clear)
    ones = ReuseParams.parse({"kappa_R": 1, "kappa_delta": 1, "kappa_T": 1})
    res = resolve_tree(clear, "dsc", same, ones)
    assert res.pairs == {"reuse": 15} and res.refresh == []  # 1 root pair + 2 x 7 leaf pairs
    assert not any(c.refresh for c in res.comparisons)
    assert res.returns == res.reward


def test_gap_gate_reuses_a_resolved_gap_and_refreshes_the_rest() -> None:
    """GG1: a resolved stored gap is reused whatever the drift (DSC would transport or
    refresh when the old data moved), an unresolved one is refreshed, never transported."""
    clear = Tree(tree_id="t", run_id="r", env="calc", nodes=[
        _node(0, None), _node(1, 0), _node(2, 0),
        *[_node(3 + i, 1, 1.0) for i in range(8)], *[_node(11 + i, 2, 0.0) for i in range(8)]])
    ones = ReuseParams.parse({"kappa_R": 1, "kappa_delta": 1, "kappa_T": 1})
    same = _stored_logprobs(clear)
    res = resolve_tree(clear, "gap-gate", same, ones)
    assert res.pairs == {"reuse": 15} and res.refresh == [] and res.returns == res.reward
    # the policy moved toward the better root action's failures: DSC no longer reuses
    # its pair (the transported gap drifted), the Gap gate still does
    mixed = Tree(tree_id="m", run_id="r", env="calc", nodes=[
        _node(0, None), _node(1, 0), _node(2, 0),
        *[_node(3 + i, 1, 1.0 if i < 6 else 0.0) for i in range(8)],
        *[_node(11 + i, 2, 0.0) for i in range(8)]])
    moved = {k: v + (2.0 if k[1] in (9, 10) else 0.0)
             for k, v in _stored_logprobs(mixed).items()}
    dsc = resolve_tree(mixed, "dsc", moved, ones)
    gap = resolve_tree(mixed, "gap-gate", moved, ones)
    assert set(dsc.comparisons[0].use.values()) != {"reuse"}
    assert gap.comparisons[0].use == {1: "reuse", 2: "reuse"}
    # an unresolved gap (equal means, few leaves) is refreshed
    tied = Tree(tree_id="u", run_id="r", env="calc", nodes=[
        _node(0, None), _node(1, 0), _node(2, 0), _node(3, 1, 1.0), _node(4, 1, 0.0),
        _node(5, 2, 1.0), _node(6, 2, 0.0)])
    res = resolve_tree(tied, "gap-gate", _stored_logprobs(tied), ones)
    assert res.comparisons[0].use == {1: "refresh", 2: "refresh"}
    assert "transport" not in res.pairs


def test_behaviour_free_rules_on_real_scores(tmp_path: Path) -> None:
    """Scored under the weights that sampled (pi = mu up to float error), transported
    returns equal the stored returns within 1e-4 and the ratios are 1 within 1e-4."""
    policy = load_policy("tiny", "calc")
    env = make_env("calc")
    task = type(env).generate_tasks(1, seed=3)[0]
    tree = make_sampler("group", max_new_tokens=40).sample_tree(env, policy, task, 4, seed=1,
                                                                tree_id="t", run_id="r")
    seqs = [build_sequences(tree, policy.prompt_ids)]  # type: ignore[attr-defined]
    prox = score_actions(policy.model, seqs, "tree", 16_384, policy.pad_id)  # type: ignore
    for n in tree.nodes:
        if n.parent_id is not None:
            assert np.abs(prox[("t", n.node_id)] - np.array(n.action_logprobs)).max() < 1e-4
    res = resolve_tree(tree, "transport", prox, ReuseParams())
    for leaf, r in res.reward.items():
        assert abs(res.transported[leaf] - r) < 1e-3


def test_refresh_starts_from_the_stored_snapshot() -> None:
    """calc is deterministic: the forced stored root action, replayed from the stored root
    snapshot, gets exactly the stored child's observation; lineage is recorded."""
    policy = load_policy("tiny", "calc")
    env = make_env("calc")
    task = type(env).generate_tasks(1, seed=5)[0]
    tree = make_sampler("group", max_new_tokens=40).sample_tree(env, policy, task, 3, seed=2,
                                                                tree_id="t", run_id="r")
    same = _stored_logprobs(tree)
    res = resolve_tree(tree, "refresh", same, ReuseParams())
    assert len(res.refresh) == 3
    got = refresh_routes(tree, res, env, policy, tree_id="t-refresh", run_id="r", seed=0,
                         params=ReuseParams(refresh_cap=8, refresh_batch=2),
                         max_new_tokens=40, temperature=1.0)
    assert got.tree is not None and got.steps > 0
    new = got.tree
    new.validate()
    lineage = (new.meta or {})["lineage"]
    assert (new.meta or {})["refresh_of"] == "t"
    for child in (n for n in new.nodes if n.parent_id == 0):
        stored = tree.node(lineage[str(child.node_id)])
        assert child.observation_text == stored.observation_text
        assert child.action_token_ids == stored.action_token_ids
        assert child.action_logprobs == stored.action_logprobs  # mu, for G8
        assert (child.meta or {})["refresh_of"]["node_id"] == stored.node_id
    assert {c for _, c in got.posterior} == set(res.refresh)


def test_named_skips_and_config_errors(tmp_path: Path) -> None:
    tree = _hand_tree()
    tree.nodes[3] = Node(node_id=3, parent_id=1, action_text="x", action_token_ids=[3],
                         action_logprobs=[], reward=1.0, terminal=True)
    assert tree_problem(tree, False) == "no_logprobs"
    assert tree_problem(_hand_tree(), True) == "no_snapshot"
    assert tree_problem(_hand_tree(), False) is None
    assert policy_step("/x/checkpoints/step-000012") == 12 and policy_step(None) is None
    for kw, match in (({"reuse": "some"}, "reuse must be one of"),
                      ({"is_mode": "clip"}, "is_mode must be one of"),
                      ({"is_cap": 0.5}, "is_cap"), ({"max_staleness": 0}, "max_staleness"),
                      ({"reuse_params": {"kappa": 1}}, "unknown key 'kappa'")):
        with pytest.raises(ConfigError, match=match):
            TrainConfig(**kw)
    for where, match in (("no_such_column = 1", "not a valid filter"),
                         ("run_id = 'nobody'", "selects no stored tree")):
        with pytest.raises(TrainError, match=match):
            train(load_config(None, {"store": str(tmp_path / "s"), "out": str(tmp_path / "o"),
                                     "reuse": "all", "reuse_from": where, "progress": False}))
        assert not (tmp_path / "o").exists()


def _sided(per_side: int, *, leaf_children: bool = False) -> Tree:
    """Two root actions with ``per_side`` trajectories below each (each a leaf of its own
    intermediate step), or, with ``leaf_children``, a root whose children are leaves."""
    if leaf_children:
        return Tree(tree_id="leafy", run_id="r", env="calc",
                    nodes=[_node(0, None), _node(1, 0, 1.0), _node(2, 0, 0.0)])
    nodes = [_node(0, None), _node(1, 0), _node(2, 0)]
    for side in (1, 2):
        for i in range(per_side):
            nodes.append(_node(len(nodes), side, float(side == 1 and i % 2 == 0)))
    return Tree(tree_id=f"sided{per_side}", run_id="r", env="calc", nodes=nodes)


def test_gated_rules_refuse_thin_trees_by_name() -> None:
    """A gated pair needs FEASIBLE_TRAJECTORIES (8) a side: thinner trees are skipped as
    ``thin``, and a selection of only thin trees is a one-line ``ReuseError``; a tree whose
    comparisons are all leaf children has no gated pair and is kept."""
    from train.reuse.params import ReuseError
    from train.reuse.resolve import FEASIBLE_TRAJECTORIES, thickest_gated_pair
    from train.reuse.select import Selection, refuse_thin

    group = Tree(tree_id="g", run_id="r", env="calc", nodes=[
        _node(0, None), *[_node(i, 0) for i in (1, 2, 3)],
        *[_node(i + 3, i, float(i == 1)) for i in (1, 2, 3)]])
    assert thickest_gated_pair(group) == 1  # a group tree: one trajectory per root action
    assert thickest_gated_pair(_sided(8)) == 8 == FEASIBLE_TRAJECTORIES
    assert thickest_gated_pair(_sided(3)) == 3
    assert thickest_gated_pair(_sided(0, leaf_children=True)) is None
    assert thickest_gated_pair(_two_level_tree()) == 1
    trees = [_sided(8), _sided(3), group, _sided(0, leaf_children=True)]
    sel = Selection(trees, [1, 2, 1, 1], Counter({"stale": 2}))
    kept = refuse_thin(sel, 8, rule="dsc", iteration=3)
    assert [t.tree_id for t in kept.trees] == ["sided8", "leafy"]
    assert kept.staleness == [1, 1] and kept.skipped == {"stale": 2, "thin": 2}
    assert refuse_thin(sel, 1, rule="dsc", iteration=3).trees == trees  # refusal off
    with pytest.raises(ReuseError, match=r"reuse gap-gate: all 2 stored trees of iteration 3 "
                                         r"are too thin to gate \(the best pair has 3 "
                                         r"trajectories a side, the gate needs 8\)") as exc:
        refuse_thin(Selection([group, _sided(3)], [1, 1]), 8, rule="gap-gate", iteration=3)
    assert "\n" not in str(exc.value)


def test_a_calibrating_rule_refuses_a_calibration_that_cannot_certify_its_level(
        tmp_path: Path) -> None:
    """D7 at level 0.95 needs 19 calib trees (alternating with dev: calib_trees >= 37);
    fewer is refused before training, by ``dsc`` and ``gap-gate`` only, unless the
    kappas are given (calibration off) or the level is lowered."""
    from train.reuse.params import calib_needed

    assert [calib_needed(x) for x in (0.5, 0.8, 0.9, 0.95)] == [1, 4, 9, 19]
    assert ReuseParams().calibration_problem() is None  # the default: 38 trees
    assert ReuseParams.parse({"calib_trees": 37}).calibration_problem() is None
    problem = ReuseParams.parse({"calib_trees": 36}).calibration_problem()
    assert problem is not None and "needs 19 calib trees (calib_trees >= 37" in problem
    assert ReuseParams.parse({"calib_trees": 2, "calib_level": 0.5}).calibration_problem() \
        is None
    assert ReuseParams.parse({"calib_trees": 2, "kappa_R": 2}).calibration_problem() is None
    for rule, refused in (("dsc", True), ("gap-gate", True), ("all", False)):
        cfg = load_config(None, {"store": str(tmp_path / rule), "out": str(tmp_path / "o"),
                                 "reuse": rule, "reuse_params": "calib_trees=6",
                                 "reuse_from": "run_id = 'nobody'", "progress": False})
        match = "D7 calibration at calib_level=0.95 needs 19" if refused else "selects no"
        with pytest.raises(TrainError, match=match):
            train(cfg)
        assert not (tmp_path / "o").exists()
        assert (tmp_path / rule).exists() != refused  # a refusal creates no store either


def test_cli_has_the_reuse_flags() -> None:
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    for flag in ("--reuse", "--reuse-from", "--reuse-per-step", "--max-staleness",
                 "--is-cap", "--is-mode", "--reuse-param"):
        assert flag in result.output
    fields = CliRunner().invoke(app, ["train", "--fields"]).output
    for name in ("reuse:", "reuse_from:", "reuse_per_step:", "max_staleness:", "is_cap:",
                 "is_mode:", "reuse_params:"):
        assert name in fields


def _calc_trees(n: int, sampler: str = "group", seed: int = 0) -> list[Tree]:
    policy = load_policy("tiny", "calc")
    env = make_env("calc")
    tasks = type(env).generate_tasks(n, seed=seed)
    return [make_sampler(sampler, max_new_tokens=40).sample_tree(
        env, policy, task, 3, seed=seed + i, tree_id=f"t{i}", run_id="r")
        for i, task in enumerate(tasks)]


def test_read_trees_streams_only_the_named_trees(tmp_path: Path) -> None:
    """With ids, ``read_trees`` opens only the files that can hold them (a corrupt file
    of another append is never read), equals the whole read, and skips snapshots when
    told; after compaction the tree_id predicate still selects exactly those trees."""
    trees = [Tree(tree_id=f"t{i}", run_id="r", env="calc", snapshots={f"t{i}/0": bytes([i]) * 9},
                  nodes=[replace(n, snapshot_id=f"t{i}/0") if n.parent_id is None else n
                         for n in _hand_tree().nodes]) for i in range(3)]
    store = Store(tmp_path / "s", create=True)
    for i, t in enumerate(trees):
        store.append_trees([t], key=f"k{i}")
    whole = {t.tree_id: t for t in read_trees(store)}
    got = read_trees(store, ["t1"])
    assert [t.tree_id for t in got] == ["t1"]
    assert got[0].nodes == whole["t1"].nodes and got[0].snapshots == whole["t1"].snapshots
    assert read_trees(store, ["t1"], snapshots=False)[0].snapshots == {}
    assert read_trees(store, []) == []
    # corrupt the nodes file of append k2: a read of t1 does not open it, a full read does
    victim = next(f for f in store.files("nodes") if f.min_key == "k2")
    Path(victim.path).write_bytes(b"\0" * victim.size)  # same size: only a read sees it
    two = {t.tree_id: t.nodes for t in read_trees(store, ["t0", "t1"])}
    assert two == {k: whole[k].nodes for k in ("t0", "t1")}
    with pytest.raises(CorruptFileError):
        read_trees(store)
    other = Store(tmp_path / "c", create=True)
    for i, t in enumerate(trees):
        other.append_trees([t], key=f"k{i}")
    compact(other)
    assert all(f.compacted for f in other.files("nodes"))
    again = read_trees(other, ["t2", "t0"])
    assert sorted(t.tree_id for t in again) == ["t0", "t2"]
    assert {t.tree_id: t.nodes for t in again} == {k: whole[k].nodes for k in ("t0", "t2")}


def test_refresh_below_the_root_copies_the_path_and_continues_the_stored_child() -> None:
    """A BEL tree on calc whose root has one child and whose node 2 branches into
    children with steps below: ``refresh`` refreshes node 2 from its own snapshot; the
    new tree copies the path root -> 2 (no new tool steps there) and each forced child
    gets the stored child's observation (calc is deterministic)."""
    policy = load_policy("tiny", "calc")
    env = make_env("calc")
    task = type(env).generate_tasks(1, seed=1)[0]
    for seed in range(1, 40):  # the first tree of that shape (the sampled streams decide)
        tree = make_sampler("bel", max_new_tokens=40).sample_tree(
            env, policy, task, 4, seed=seed, tree_id="t", run_id="r")
        same = _stored_logprobs(tree)
        res = resolve_tree(tree, "refresh", same, ReuseParams())
        inner = [c for c in res.comparisons if c.refresh and c.node != tree.root().node_id]
        if inner and res.refresh == []:
            break
    assert inner and res.refresh == []  # the root is no comparison here
    got = refresh_routes(tree, res, env, policy, tree_id="t-refresh", run_id="r", seed=0,
                         params=ReuseParams(refresh_cap=12, refresh_batch=3),
                         max_new_tokens=40, temperature=1.0)
    assert got.tree is not None  # (its draws may all answer at once: 0 tool steps)
    new = got.tree
    new.validate()
    meta = new.meta or {}
    assert meta["lineage"]
    assert meta["refreshed_nodes"] == [inner[0].node]
    copies = [n for n in new.nodes if (n.meta or {}).get("copy_of") is not None]
    assert [(n.meta or {})["copy_of"] for n in copies] == [
        n.node_id for n in tree.path_to(inner[0].node)[1:]]
    assert all(n.tool_calls == 0 for n in copies)
    assert sum(n.tool_calls or 0 for n in new.nodes) == got.steps
    for nid, stored_id in meta["lineage"].items():
        child, stored = new.node(int(nid)), tree.node(stored_id)
        assert child.parent_id == copies[-1].node_id
        assert child.observation_text == stored.observation_text
        assert child.action_logprobs == stored.action_logprobs
    assert {n for n, _ in got.posterior} == {inner[0].node}


def test_calibration_split_and_its_record_survive_a_restart(tmp_path: Path) -> None:
    """The D7 split is a hash split of tree ids; user kappas switch calibration off; a
    calibration recorded in reuse_params.json is kept by a restart's ``write_params`` and
    reused by a later iteration (``gate_params``) without new draws; before one ran (too
    few calibration trees) the start kappas are used and nothing is spent."""
    ids = [f"run/it{i:06d}/{j:03d}" for i in range(50) for j in range(8)]
    frac = np.mean([in_calib_split(i) for i in ids])
    assert abs(frac - CALIB_FRAC) < 0.06
    assert not ReuseParams.parse({"kappa_R": 1}).calibrate
    assert ReuseParams.parse({"kappa_R": 1, "calibrate": "true"}).calibrate
    with pytest.raises(ValueError, match="calibrate"):
        ReuseParams.parse({"calibrate": "maybe"})
    params = ReuseParams()
    calibrated = params.with_kappas({"kappa_R": 3.5, "kappa_T": 1.25, "residual_var_T": 0.1})
    out = tmp_path / "o"
    write_params(out, calibrated, {"status": "calibrated", "iteration": 3,
                                   "kappas": calibrated.kappas(), "split": "test"})
    write_params(out, params)  # a resumed run writes its (start) params again
    record = json.loads((out / "reuse_params.json").read_text())
    assert record["calibration"]["iteration"] == 3 and record["kappa_R"] == 3.5
    env = make_env("calc")
    policy = load_policy("tiny", "calc")
    sel = select_stored(Store(tmp_path / "s", create=True), reuse_from="", run_id="r",
                        env="calc", iteration=4, max_staleness=2, per_step=2, seed=0,
                        need_snapshots=True, tokenizer_dir=None)
    kw = {"iteration": 4, "seed": 0, "max_new_tokens": 40, "temperature": 1.0}
    later, spent, ran = gate_params(sel, params, env, policy, out=out, **kw)  # type: ignore
    assert later == calibrated and spent == 0 and ran is None
    start, spent, ran = gate_params(sel, params, env, policy, out=tmp_path / "o2", **kw)  # type: ignore
    assert start == params and spent == 0 and ran is None


@pytest.mark.slow
def test_calibrate_gate_on_new_draws() -> None:
    """``calibrate_gate`` on three calc trees: kappas from new draws under mu and pi (here
    the same tiny policy, so c_T = c_R), trees alternating calib / dev."""
    policy = load_policy("tiny", "calc")
    env = make_env("calc")
    trees = _calc_trees(3, seed=4)
    new, record = calibrate_gate(trees, ReuseParams(calib_draws=2), env, policy, seed=0,
                                 max_new_tokens=40, temperature=1.0, load_mu=lambda t: policy)
    assert record["status"] == "calibrated" and record["tool_steps"] > 0
    assert list(record["trees"].values()) == ["calib", "dev", "calib"]
    radii = record["radii"]
    assert radii["n_calib_tasks"] == 2 and radii["n_dev_pairs"] > 0
    for x in ("R", "delta", "T"):
        assert math.isfinite(radii[x]["kappa"]) and radii[x]["kappa"] >= 0
        # two calib trees cannot certify level .95: the maximum, floored at the start 2
        assert radii[x]["kappa_fallback_to_max"]
        assert new.kappas()[f"kappa_{x}"] == pytest.approx(max(radii[x]["kappa"], 2.0))


SMALL = {"tasks_per_step": 2, "n_total": 3, "heldout_tasks": 0, "max_new_tokens": 40,
         "minibatches": 2, "progress": False, "run_id": "r", "reuse_per_step": 2,
         "max_staleness": 2, "reuse_params": "calib_trees=2,calib_level=0.5,calib_draws=1,"
                         "min_trajectories=1"}


@pytest.mark.slow
def test_reuse_run_commits_credit_skips_stale_and_survives_kill9(tmp_path: Path) -> None:
    """A ``--reuse dsc`` run: stored credit committed as grpo+dsc with the current version,
    refreshes committed with lineage, stale trees skipped and counted; a real ``kill -9``
    then ``--resume`` uses the same stored trees and reaches the same parameters."""
    steps = 5
    straight = load_config(None, {**SMALL, "reuse": "dsc", "steps": steps,
                                  "store": str(tmp_path / "s1"), "out": str(tmp_path / "o1")})
    train(straight)
    m = read_metrics(straight.store, "r")
    # r/it000000/000, r/it000001/000, r/it000002/001 and r/it000003/000 fall in the
    # calibration split (held apart): at iteration 1 one tree is left to train on
    assert [v for _, v in m["reuse_trees"]][1:] == [1.0] + [2.0] * (steps - 2)
    lines = [json.loads(x) for x in (Path(straight.out) / "reuse.jsonl").read_text().splitlines()]
    assert all(not in_calib_split(x["tree_id"]) for x in lines if "tree_id" in x)
    params = json.loads((Path(straight.out) / "reuse_params.json").read_text())
    assert params["calibration"]["status"] == "calibrated"
    assert params["calibration"]["iteration"] == 2  # two calibration trees by then
    assert set(params["calibration"]["trees"]) == {"r/it000000/000", "r/it000001/000"}
    assert params["kappa_T"] == params["calibration"]["kappas"]["kappa_T"]
    assert max(v for _, v in m["reuse_skip_stale"]) > 0
    assert max(v for _, v in m["reuse_staleness_max"]) <= 2
    con = connect(open_store(straight.store))
    methods = {r[0] for r in con.sql("SELECT DISTINCT method FROM credits").fetchall()}
    assert methods == {"grpo", "grpo+dsc"}
    fresh = read_trees(straight.store)
    refreshed = [t for t in fresh if t.sampler == "refresh"]
    ids = {t.tree_id for t in fresh}
    assert all((t.meta or {})["refresh_of"] in ids for t in refreshed)

    killed = load_config(None, {**SMALL, "reuse": "dsc", "steps": steps,
                                "store": str(tmp_path / "s2"), "out": str(tmp_path / "o2")})
    rtrees = str(Path(sys.executable).with_name("rtrees"))
    args = [rtrees, "train", "--store", killed.store, "--out", killed.out, "--steps",
            str(steps), "--reuse", "dsc", "--reuse-per-step", "2", "--max-staleness", "2"]
    args += [f"--set={k}={v}" for k, v in SMALL.items()
             if k not in ("reuse_per_step", "max_staleness")]
    log = open(tmp_path / "killed.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    target = Path(killed.out) / "checkpoints" / "step-000003"
    deadline = time.time() + 600
    while not target.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-2000:]
    time.sleep(0.5)  # into iteration 3: its trees may be committed, its checkpoint not
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    out = subprocess.run([rtrees, "train", "--out", killed.out, "--resume"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    a, b = read_metrics(straight.store, "r"), read_metrics(killed.store, "r")
    for name in ("reuse_trees", "reuse_new_tool_steps", "reuse_pairs_refresh", "loss"):
        assert a[name] == b[name], name
    for p, q in zip(_params(straight.out), _params(killed.out), strict=True):
        assert torch.equal(p, q)
    again = read_trees(killed.store)
    assert len(again) == len({t.tree_id for t in again}) == len(fresh)


def _params(out: str) -> list[torch.Tensor]:
    ckpt = latest_checkpoint(Path(out))
    assert ckpt is not None
    policy = load_policy(f"hf:{ckpt}", "calc")
    return [p.detach().clone() for p in policy.model.parameters()]  # type: ignore[attr-defined]


# ---- registered rules (issue 28): RULES, m2po (M1), prox-interp (P1), update-to-data (U1)

def test_rules_registry_names_every_mode_and_declares_needs() -> None:
    from train.reuse.params import REUSE_MODES
    from train.reuse.resolve import RULES, get_rule

    assert tuple(RULES) == REUSE_MODES[1:]
    assert {n for n, r in RULES.items() if r.needs_snapshots} == {"dsc", "refresh",
                                                                   "gap-gate"}
    assert [n for n, r in RULES.items() if r.calibrates] == ["dsc", "gap-gate"]
    assert RULES["m2po"].weight == "m2po" and RULES["prox-interp"].prox == "interp"
    with pytest.raises(ValueError, match="unknown reuse mode 'nope'"):
        get_rule("nope")
    # a new rule resolves through the same code path, no mode string tested anywhere
    res = resolve_tree(_two_level_tree(), "m2po", _prox({3: 1.5, 4: 0.8}), ReuseParams())
    assert res.returns == resolve_tree(_two_level_tree(), "all", _prox({}),
                                       ReuseParams()).returns


def test_m2po_mask_drops_the_largest_squared_log_ratios_until_the_mean_is_under() -> None:
    from train.reuse.stage import m2po_mask

    r = torch.tensor([0.1, -0.9, 0.05, 0.5, -0.2], dtype=torch.float64)
    keep = m2po_mask(r, 0.04)
    # squares .01 .81 .0025 .25 .04: drop .81 -> mean .0756; drop .25 -> .0175 <= .04
    assert keep.tolist() == [True, False, True, False, True]
    assert float((r[keep] ** 2).mean()) <= 0.04
    # the fewest dropped: keeping the next largest back would break the bound
    assert float((r[[0, 2, 3, 4]] ** 2).mean()) > 0.04
    assert m2po_mask(r, 1.0).all()  # already under: nothing dropped
    gen = np.random.default_rng(0)
    for _ in range(50):  # the defining property on random inputs
        x = torch.tensor(gen.normal(0, gen.uniform(0.05, 1.0), gen.integers(1, 40)))
        thr = float(gen.uniform(0.0, 0.3))
        k = m2po_mask(x, thr)
        sq = x**2
        if k.any():
            assert float(sq[k].mean()) <= thr + 1e-12
            assert float(sq[~k].min() if (~k).any() else np.inf) >= float(sq[k].max())


def test_prox_interp_moves_from_mu_to_pi_with_staleness() -> None:
    from train.reuse.stage import interp_prox

    mu = torch.tensor([-1.0, -1.0, -1.0])
    pi = torch.tensor([-0.5, -0.5, -0.5], requires_grad=True)
    got = interp_prox(mu, pi, torch.tensor([0.0, 1.0, 3.0]))
    assert got.tolist() == pytest.approx([-1.0, -0.75, -0.625])  # alpha = s / (s + 1)
    assert not got.requires_grad  # a constant of the loss, as pi_prox is


def test_stage_weight_reads_stored_tokens_from_the_micro_batch() -> None:
    """G8 / M1 / P1 in ``ReuseStage.weight``: fresh tokens (``mb.stored`` False) get
    w = 1 and keep their old logprobs whatever their log-ratio."""
    from train.batches import MicroBatch
    from train.reuse.resolve import RULES
    from train.reuse.stage import ReuseStage

    k = 4
    z = torch.zeros(k)
    mb = MicroBatch(input_ids=torch.zeros((1, 1), dtype=torch.long),
                    position_ids=torch.zeros((1, 1), dtype=torch.long),
                    attention_mask=torch.ones((1, 1), dtype=torch.long),
                    loss_row=torch.zeros(k, dtype=torch.long),
                    loss_col=torch.zeros(k, dtype=torch.long),
                    targets=torch.zeros(k, dtype=torch.long),
                    old_logp=torch.tensor([-0.1, -0.1, -2.0, -0.4]),
                    behav_logp=torch.tensor([-1.0, -1.0, -1.0, -0.5]),
                    advantage=z, clip_low=z, clip_high=z, traj_count=z, inv_len_sum=z,
                    keys=[(0, 0, i) for i in range(k)], n_tokens=1,
                    stored=torch.tensor([False, True, True, True]),
                    staleness=torch.tensor([0.0, 2.0, 2.0, 2.0]))
    logp = torch.tensor([-0.1, -0.2, -0.3, -0.4])
    for name in ("all", "m2po", "prox-interp"):
        stage = ReuseStage(RULES[name], ReuseParams.parse({"m2po_threshold": 0.05}), "", 2,
                           4, 2.0, "truncate")
        w, old = stage.weight(mb, logp)
        assert float(w[0]) == 1.0 and float(old[0]) == pytest.approx(-0.1), name
        m = stage.loss_metrics()
        if name == "m2po":  # log-ratios .9, -1, .1: drop -1 and .9 -> .01 <= .05
            assert w.tolist()[1:] == pytest.approx([0.0, 0.0, math.exp(0.1)])
            assert m["m2po_masked_frac"] == pytest.approx(2 / 3)
        if name == "all":  # G8: truncated at the cap 2
            assert w.tolist()[1:] == pytest.approx([2.0, math.exp(-1.0), math.exp(0.1)])
        if name == "prox-interp":  # alpha 2/3 toward the current logprobs
            assert old.tolist()[1:] == pytest.approx([-1 + 2 / 3 * 0.8, -1 + 2 / 3 * 0.7,
                                                      -0.5 + 2 / 3 * 0.1])


@pytest.mark.parametrize("rule", ["m2po", "prox-interp",
                                  pytest.param("gap-gate", marks=pytest.mark.slow)])
def test_new_rules_train_and_utd_counts_extra_passes(tmp_path: Path, rule: str) -> None:
    """A short run of each new rule trains on stored trees; ``stored_passes=3`` adds two
    optimizer passes over the stored trees' parts, counted in the metrics; P1 reports the
    forward tokens it saved."""
    cfg = load_config(None, {**SMALL, "reuse": rule, "steps": 3, "n_total": 2,
                             "max_new_tokens": 24,
                             "reuse_params": "stored_passes=3,min_trajectories=1",
                             "store": str(tmp_path / "s"), "out": str(tmp_path / "o")})
    train(cfg)
    m = read_metrics(cfg.store, "r")
    trees = [v for _, v in m["reuse_trees"]]
    extra = [v for _, v in m["reuse_extra_optimizer_steps"]]
    assert trees[0] == 0 and max(trees) > 0
    if rule == "gap-gate":  # GG1 refreshes the unresolved pairs: refreshed trees train too
        trees = [t + r for t, (_, r) in zip(trees, m["reuse_refreshed_trees"], strict=True)]
        assert max(v for _, v in m["reuse_pairs_refresh"]) > 0
    # two parts of stored trees per extra pass when there are 2 stored trees, else one
    for n, e in zip(trees, extra, strict=True):
        assert e == 2 * min(n, 2) if n else e == 0
    steps = [v for _, v in m["grad_norm"]]
    assert len(steps) == 3
    if rule == "prox-interp":
        saved = [v for _, v in m["reuse_prox_forward_tokens_saved"]]
        assert saved[0] == 0 and max(saved) > 0
    con = connect(open_store(cfg.store))
    methods = {r[0] for r in con.sql("SELECT DISTINCT method FROM credits").fetchall()}
    assert methods == {"grpo", f"grpo+{rule}"}


def test_refresh_does_not_depend_on_the_row_budget() -> None:
    """``refresh_trees`` over four stored calc trees (every refreshed comparison of every
    tree in one engine run) with row budgets 1, 7 and 64: the same refreshed trees (up to
    the float noise of batched matmuls, bounded as in ``tests/test_engine.py``), the same
    posteriors and costs; budget 64 decodes rows of several trees per call."""
    from test_engine import DTYPE, LOGPROB_TOL, differences  # tests/ is on sys.path

    from train.sampling.engine import Engine

    policy = load_policy("tiny", "calc", dtype=DTYPE)  # float64: no token parts on any CPU
    trees = _calc_trees(4, seed=3)
    items = [(t, resolve_tree(t, "refresh", _stored_logprobs(t), ReuseParams()), f"new/{i}")
             for i, t in enumerate(trees)]
    assert sum(len(res.refresh) >= 2 for _, res, _ in items) >= 2
    runs = {}
    for budget in (1, 7, 64):
        engine = Engine(policy, max_rows=budget)
        runs[budget] = (refresh_trees(items, lambda: make_env("calc"), policy, run_id="r",
                                      seed=5, params=ReuseParams(refresh_cap=8),
                                      max_new_tokens=40, temperature=1.0, engine=engine),
                        engine.stats)
    base, stats1 = runs[1]
    assert stats1.max_call_rows == 1 and runs[64][1].max_call_rows > 4
    assert runs[64][1].policy_calls < stats1.policy_calls
    assert sum(r.tree is not None for r in base) >= 2
    for budget in (7, 64):
        for a, b in zip(base, runs[budget][0], strict=True):
            assert (a.steps, a.no_snapshot) == (b.steps, b.no_snapshot)
            assert a.posterior.keys() == b.posterior.keys()
            assert all(abs(a.posterior[k] - b.posterior[k]) < 1e-12 for k in a.posterior)
            assert (a.tree is None) == (b.tree is None)
            if a.tree is not None and b.tree is not None:
                diff, worst = differences(a.tree, b.tree)
                assert diff == [] and worst < LOGPROB_TOL, (budget, diff[:5])


def test_feasible_pairs_need_eight_trajectories_a_side() -> None:
    """A pair is feasible with at least FEASIBLE_TRAJECTORIES trajectories on both sides;
    an all-leaf comparison's pairs count as feasible (reused soundly)."""
    from train.reuse.resolve import FEASIBLE_TRAJECTORIES, feasible_pairs

    assert FEASIBLE_TRAJECTORIES == 8
    clear = Tree(tree_id="t", run_id="r", env="calc", nodes=[
        _node(0, None), _node(1, 0), _node(2, 0),
        *[_node(3 + i, 1, 1.0) for i in range(8)], *[_node(11 + i, 2, 0.0) for i in range(8)]])
    res = resolve_tree(clear, "dsc", _stored_logprobs(clear), ReuseParams())
    assert res.feasible == 15 == sum(res.pairs.values())  # 1 root pair + 2 x 7 leaf pairs
    tied = Tree(tree_id="u", run_id="r", env="calc", nodes=[
        _node(0, None), _node(1, 0), _node(2, 0), _node(3, 1, 1.0), _node(4, 1, 0.0),
        _node(5, 2, 1.0), _node(6, 2, 0.0)])
    res = resolve_tree(tied, "gap-gate", _stored_logprobs(tied), ReuseParams())
    assert res.feasible == 2 and sum(res.pairs.values()) == 3  # the root pair: 2 a side
    # the leader is the best stored mean; a short competitor makes only its own pair fail
    leaves = {1: list(range(8)), 2: list(range(8, 16)), 3: [16]}
    assert feasible_pairs(leaves, {1: 0.2, 2: 0.9, 3: 0.5}) == 1
    assert feasible_pairs(leaves, {1: 0.2, 2: 0.1, 3: 0.9}) == 0  # the leader has 1
