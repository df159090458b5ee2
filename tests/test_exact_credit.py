"""The exact credit audit (``rtrees study credit-exact``, issue 23 item 3): exact advantages
that telescope along every path, cosines in [-1, 1] for every horizon and method, verdicts
for each method against grpo, and a report rebuilt from the study's files alone."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from analysis.exact_credit import exact_credit_results
from rollout_store import Store, connect
from train.jobs import run_study, study_config


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("credit-exact")
    return out, run_study("credit-exact", out, small=True)


def test_exact_advantages_telescope_to_the_leaf_reward(study: tuple[Path, dict]) -> None:
    """X1: along a root-to-leaf path the advantages sum to R_leaf - V_mu(s_root), so the
    sum minus the reward is the same for every leaf of a tree (and not 0 everywhere)."""
    out, _ = study
    for h in study_config("credit-exact", small=True).horizons:
        adv = pq.read_table(out / f"exact-H{h}.parquet").to_pylist()
        a = {(r["tree_id"], r["node_id"]): r["advantage"] for r in adv}
        nodes = connect(Store(out / f"store-H{h}")).sql(
            "SELECT tree_id, node_id, parent_id, reward FROM nodes").fetchall()
        parent = {(t, n): p for t, n, p, _ in nodes}
        kids = {(t, p) for t, _, p, _ in nodes if p is not None}
        offsets: dict[str, list[float]] = defaultdict(list)
        for t, n, _, reward in nodes:
            if (t, n) in kids:
                continue
            total, v = 0.0, n
            while parent[(t, v)] is not None:
                total += a[(t, v)]
                v = parent[(t, v)]
            offsets[t].append(total - float(reward or 0.0))  # = -V_mu(s_root)
        assert offsets
        for values in offsets.values():
            assert max(values) - min(values) < 1e-9
        assert any(abs(v[0]) > 1e-6 for v in offsets.values())


def test_cosines_verdicts_and_rebuild(study: tuple[Path, dict], tmp_path: Path) -> None:
    out, results = study
    config = study_config("credit-exact", small=True)
    assert set(results["horizons"]) == {str(h) for h in config.horizons}
    for doc in results["horizons"].values():
        for m in config.methods:
            got = doc["methods"][m]
            assert got["trees"] == config.n_tasks
            assert -1.0 <= got["mean"] <= 1.0
    others = [m for m in config.methods if m != "grpo"]
    assert len(results["verdicts"]) == len(others) * len(config.horizons)
    assert {v["verdict"] for v in results["verdicts"]} <= {
        "superior", "inferior", "equivalent", "underpowered"}
    assert (out / "report.md").read_text().startswith("# Exact credit audit")
    again = exact_credit_results(out, tmp_path)  # from the study's files alone
    assert json.loads(json.dumps(again["horizons"])) == \
        json.loads((out / "results.json").read_text())["horizons"]


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="methods must include grpo"):
        study_config("credit-exact", {"methods": "elpo,trace"})
    with pytest.raises(ValueError, match="horizons"):
        study_config("credit-exact", {"horizons": "1"})
    with pytest.raises(ValueError, match="unknown sampler 'nope'"):
        study_config("credit-exact", {"sampler": "nope"})
