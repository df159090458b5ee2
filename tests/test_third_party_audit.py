"""``rtrees study third-party-audit`` (issue 47 item 4): the report's verdicts from an audit's
paired differences (fast, on a written study directory), and the whole study on a real
third-party environment (slow)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from analysis.third_party import command, third_party_results


def _est(estimate: float | None, lo: float | None, hi: float | None) -> dict[str, Any]:
    return {"estimate": estimate, "ci": [lo, hi]}


def _method(pa: float | None, prefixes: int = 6) -> dict[str, Any]:
    return {"pairwise_accuracy": pa, "kendall_tau_b": {"macro": pa, "pooled": pa},
            "ci": {"pairwise_accuracy": [pa, pa], "kendall_tau_b": {"macro": [pa, pa],
                                                                    "pooled": [pa, pa]}},
            "n_prefixes": prefixes, "n_pairs": 5}


def _study(tmp_path: Path, diffs: dict[str, Any], methods: list[str],
           prefixes: dict[str, int] | None = None) -> Path:
    config = {"env": "gym-frozenlake", "policy": "tiny", "n_tasks": 12, "n_total": 8, "k": 32,
              "seed": 0, "methods": methods, "baseline": "grpo", "delta": 0.05,
              "max_new_tokens": 64, "n_boot": 2000}
    (tmp_path / "audit").mkdir()
    (tmp_path / "audit" / "results.json").write_text(json.dumps({
        "coverage": {"n_trees": 12, "n_prefixes_audited": 30, "n_pairs": 40},
        "methods": {m: _method(0.6, (prefixes or {}).get(m, 6)) for m in methods},
        "paired_differences": diffs}))
    (tmp_path / "study.json").write_text(json.dumps({
        "study": "third-party-audit", "config": config, "store": "store", "audit": "audit",
        "env_class": "x:Y", "exact_values": False, "methods": methods,
        "dropped": {"slca": "ValueError: no segments"}, "claims": len(methods) - 1,
        "level": 0.975, "seconds": {}}))
    return tmp_path


def test_verdicts_follow_the_paired_interval_and_its_orientation(tmp_path: Path) -> None:
    diffs = {
        "elpo-grpo": {"pairwise_accuracy": _est(0.2, 0.1, 0.3)},        # above 0
        "grpo-trace": {"pairwise_accuracy": _est(0.2, 0.1, 0.3)},       # trace below grpo
        "caliper-grpo": {"pairwise_accuracy": _est(0.0, -0.02, 0.03)},  # inside +-0.05
        "grpo-tree_grpo": {"pairwise_accuracy": _est(0.01, -0.2, 0.1)},  # wide
        "factor-grpo": {"pairwise_accuracy": _est(None, None, None)},   # no pair ranked
        "sgcd-grpo": {"pairwise_accuracy": _est(0.0, 0.0, 0.0)},        # one prefix only
    }
    methods = ["grpo", "tree_grpo", "elpo", "caliper", "trace", "factor", "sgcd"]
    res = third_party_results(_study(tmp_path, diffs, methods, {"sgcd": 1}))
    got = {m.split("@")[0]: r.get("verdict") for m, r in res["methods"].items()}
    assert got == {"grpo": None, "elpo": "superior", "trace": "inferior",
                   "caliper": "equivalent", "tree_grpo": "underpowered",
                   "factor": "underpowered", "sgcd": "underpowered"}
    trace = res["methods"]["trace"]["difference"]
    assert trace["estimate"] == pytest.approx(-0.2) and trace["ci"] == pytest.approx(
        [-0.3, -0.1])
    assert math.isnan(res["methods"]["factor"]["difference"]["estimate"])
    assert len(res["verdicts"]) == 6 and all(v["level"] == 0.975 for v in res["verdicts"])
    # a zero-width interval from one ranked prefix is printed, not judged equivalent
    sgcd = next(v for v in res["verdicts"] if "sgcd" in v["claim"])
    assert "only 1 ranked prefix" in sgcd["note"]
    report = (tmp_path / "report.md").read_text()
    assert "slca: ValueError: no segments" in report
    assert command(res["config"]) in report
    assert json.loads((tmp_path / "results.json").read_text())["audit"] == "third-party-audit"


def test_the_reproducing_command_carries_every_setting_off_its_default() -> None:
    from train.jobs import study_config

    config = {"env": "reasoning-gym", "policy": "tiny", "n_tasks": 12, "n_total": 8,
              "k": 16, "seed": 3, "methods": ["grpo", "elpo"], "baseline": "grpo",
              "delta": 0.05, "max_new_tokens": 64, "n_boot": 2000}
    line = command(config)
    params = dict(p.split("=", 1) for p in line.split("--param ")[1:])
    params = {k: v.strip() for k, v in params.items()}
    rebuilt = study_config("third-party-audit", params)
    assert rebuilt.k == 16 and rebuilt.seed == 3 and rebuilt.methods == ("grpo", "elpo")
    assert rebuilt.env == "reasoning-gym" and rebuilt.n_tasks == 12
    # task options travel as one shell-quoted JSON object
    import shlex

    mix = {"datasets": ["products"], "dataset_config": {"products": {"max_terms": 2}}}
    words = shlex.split(command({**config, "task_params": mix}))
    params = dict(w.split("=", 1) for w in words[words.index("--out") + 2:] if w != "--param")
    assert study_config("third-party-audit", params).task_params == mix


def test_bad_settings_are_refused_in_one_line() -> None:
    from train.jobs import study_config

    with pytest.raises(ValueError, match="baseline"):
        study_config("third-party-audit", {"methods": "elpo,trace"})
    with pytest.raises(ValueError, match="n_total must be >= 4"):
        study_config("third-party-audit", {"n_total": "2"})


@pytest.mark.slow
def test_the_small_study_runs_on_frozenlake(tmp_path: Path) -> None:
    """The whole study at its small settings on gymnasium's FrozenLake with the untrained
    tiny model (random weights: the plumbing, not a result)."""
    pytest.importorskip("gymnasium")
    from train.jobs import run_study

    res = run_study("third-party-audit", tmp_path, {"env": "gym-frozenlake",
                                                    "policy": "tiny:calc"}, small=True)
    assert res["coverage"]["n_trees"] == 3
    assert {m.split("@")[0] for m in res["methods"]} == {"grpo", "tree_grpo", "elpo"}
    assert len(res["verdicts"]) == 2
    assert (tmp_path / "store").is_dir() and (tmp_path / "report.md").is_file()
