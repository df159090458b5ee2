"""Every consumer of snapshots works with every snapshot strategy, through the one engine:
each sampler (group, random, entropy, bel, caliper, rooted) collects the same trees from
``calc`` whether its states are saved natively, by replay or by fork (the tiny policy in
float64, so the comparison is exact up to 1e-9); the Mean@k references, held-out
evaluation and a training run with the reuse refresh run on a replay and a fork copy of
calc."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from rollout_store import Store, read_trees
from train.envs import make_env
from train.envs.base import SnapshotStrategy
from train.envs.calc import CalcEnv
from train.sampling import SAMPLERS, make_sampler
from train.sampling.engine import Engine, TreeJob


class ReplayCalc(CalcEnv):
    """``calc`` whose snapshots are replayed (its own ``snapshot`` is never called)."""

    snapshot_strategy: ClassVar[SnapshotStrategy] = "replay"


class ForkCalc(CalcEnv):
    """``calc`` in a worker process, its snapshots forked copies."""

    snapshot_strategy: ClassVar[SnapshotStrategy] = "fork"


SPECS = {"native": "calc", "replay": "test_env_strategies_everywhere:ReplayCalc",
         "fork": "test_env_strategies_everywhere:ForkCalc"}
TASKS = CalcEnv.generate_tasks(3, seed=21)


@pytest.fixture(scope="module")
def policy() -> Any:
    from train.policies.tiny import load_tiny_policy

    return load_tiny_policy("calc", dtype=torch.float64)


def trees_of(spec: str, sampler: str, policy: Any) -> list[Any]:
    samp = make_sampler(sampler)
    jobs = [TreeJob(samp, lambda: make_env(spec), task, 6, seed=40 + i, tree_id=f"t/{i}")
            for i, task in enumerate(TASKS)]
    return Engine(policy).sample_trees(jobs)


def shape(tree: Any) -> list[tuple[Any, ...]]:
    return [(n.node_id, n.parent_id, n.action_token_ids, n.observation_text, n.reward,
             n.phase) for n in tree.nodes]


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_every_sampler_makes_the_same_trees_under_every_strategy(
        sampler: str, policy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # fork workers import it
    native = trees_of(SPECS["native"], sampler, policy)
    for strategy in ("replay", "fork"):
        other = trees_of(SPECS[strategy], sampler, policy)
        assert [shape(t) for t in other] == [shape(t) for t in native], strategy
        assert {t.env for t in other} == {SPECS[strategy]}
        worst = max(abs(a - b) for x, y in zip(native, other, strict=True)
                    for m, n in zip(x.nodes, y.nodes, strict=True)
                    for a, b in zip(m.action_logprobs, n.action_logprobs, strict=True))
        assert worst < 1e-9, (strategy, worst)


@pytest.mark.parametrize("strategy", [
    "replay", pytest.param("fork", marks=pytest.mark.slow)])  # fork: ~45 s of worker starts
def test_references_evaluation_and_refresh_run_on_the_strategy(
        strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from train.config import load_config
    from train.sampling.references import ReferenceConfig, collect_references
    from train.trainer import read_metrics, train

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    spec = SPECS[strategy]
    cfg = load_config(None, {
        "env": spec, "policy": "tiny:calc", "sampler": "bel", "steps": 2, "tasks_per_step": 2,
        "n_total": 4, "heldout_tasks": 2, "eval_every": 2, "max_new_tokens": 24,
        "reuse": "refresh", "reuse_per_step": 2, "max_staleness": 2,
        "reuse_params": "refresh_cap=4,min_trajectories=1", "progress": False,
        "run_id": "s", "store": str(tmp_path / "s"), "out": str(tmp_path / "run")})
    train(cfg)
    metrics = read_metrics(cfg.store, "s")
    assert len(metrics["loss"]) == 2
    assert any(v > 0 for _, v in metrics.get("reuse_trees", [])), metrics.keys()
    assert "heldout_success" in metrics or any(k.startswith("heldout") for k in metrics)
    store = Store(tmp_path / "s")
    trees = read_trees(store)
    assert {t.env for t in trees} == {spec}
    assert any(t.sampler == "refresh" for t in trees)  # refreshed through the strategy
    report = collect_references(store, ReferenceConfig(k=2), progress=False)
    assert report.children > 0
