"""Reuse of stored trees (issue 12, ``train.reuse``): transport by hand (D4), pi = mu,
refresh from the stored snapshot, named skips, and reuse across a real ``kill -9``."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_store.reader import connect, read_trees
from rollout_store.store import open_store
from rollout_store.tree import Node, Tree
from train.batches import build_sequences
from train.config import ConfigError, TrainConfig, load_config
from train.envs import make_env
from train.policies import load_policy
from train.reuse import (
    ReuseParams,
    policy_step,
    refresh_routes,
    resolve_tree,
    score_actions,
    tree_problem,
)
from train.sampling import make_sampler
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
    # folds by leaf preorder rank: 3, 5 -> fold 0; 4, 6 -> fold 1. State = parent.
    # b^0(1) = R_3 = 1, b^1(1) = R_4 = 0, b^0(2) = R_5 = 0, b^1(2) = R_6 = 1.
    by_hand = {3: 1 + 0.5 * (1 - 0), 4: 0 + (-0.2) * (0 - 1),
               5: 0 + 0.2 * (0 - 1), 6: 1 + (-0.5) * (1 - 0)}
    for leaf, value in by_hand.items():
        assert res.transported[leaf] == pytest.approx(value, abs=1e-12)
        assert res.returns[leaf] == pytest.approx(value, abs=1e-12)
    assert res.pairs == {"transport": 1} and res.refresh == []
    # linear in z: scaling every z by 1.5 scales T - R by 1.5 (no products of ratios)
    scaled = resolve_tree(_hand_tree(), "transport", _prox(z, 1.5), ReuseParams())
    for leaf in by_hand:
        assert scaled.transported[leaf] - scaled.reward[leaf] == pytest.approx(
            1.5 * (res.transported[leaf] - res.reward[leaf]), abs=1e-12)


def test_pi_equals_mu_transport_is_reuse_and_dsc_has_no_drift() -> None:
    tree = _hand_tree()
    same = {("t", n.node_id): np.array(n.action_logprobs) for n in tree.nodes
            if n.parent_id is not None}
    reuse = resolve_tree(tree, "all", same, ReuseParams())
    transport = resolve_tree(tree, "transport", same, ReuseParams())
    assert transport.returns == reuse.returns == reuse.reward  # exactly
    # dsc: delta = 0, so a resolved reuse gap is reused and nothing is refreshed ...
    clear = Tree(tree_id="t", run_id="r", env="calc", nodes=[
        _node(0, None), _node(1, 0), _node(2, 0),
        *[_node(3 + i, 1, 1.0) for i in range(8)], *[_node(11 + i, 2, 0.0) for i in range(8)]])
    same = {("t", n.node_id): np.array(n.action_logprobs) for n in clear.nodes
            if n.parent_id is not None}
    res = resolve_tree(clear, "dsc", same, ReuseParams(kappa_R=1, kappa_delta=1, kappa_T=1))
    assert res.pairs == {"reuse": 1} and res.refresh == []
    assert res.returns == res.reward


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
    same = {("t", n.node_id): np.array(n.action_logprobs) for n in tree.nodes
            if n.parent_id is not None}
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
    assert set(got.posterior) == set(res.refresh)


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


SMALL = {"tasks_per_step": 2, "n_total": 3, "heldout_tasks": 0, "max_new_tokens": 40,
         "minibatches": 2, "progress": False, "run_id": "r", "reuse_per_step": 2,
         "max_staleness": 2}


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
    assert [v for _, v in m["reuse_trees"]][1:] == [2.0] * (steps - 1)
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
