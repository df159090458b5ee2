"""The reuse experiment's arithmetic (``benchmarks/reuse.py``): arms, the area under the
success curve against new tool steps, and the paired verdicts on synthetic runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("reuse_experiment", ROOT / "benchmarks" / "reuse.py")
assert _spec and _spec.loader
reuse_experiment = importlib.util.module_from_spec(_spec)
sys.modules["reuse_experiment"] = reuse_experiment
_spec.loader.exec_module(reuse_experiment)


def test_auc_is_the_mean_of_the_interpolated_curve() -> None:
    xs = [0.0, 100.0, 300.0]
    ys = np.array([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    got = reuse_experiment.auc(xs, ys, 200.0)
    # task 0: a ramp 0 -> 1 over [0, 100], then 1: (50 + 100) / 200
    # task 1: 1 until 100, then 1 -> 0 over [100, 300], at 200 it is 0.5: (100 + 75) / 200
    assert got == pytest.approx([0.75, 0.875])
    # past the last evaluated version the curve stays flat
    assert reuse_experiment.auc([0.0, 50.0], np.array([[0.0], [1.0]]), 100.0) == \
        pytest.approx([0.75])
    assert reuse_experiment._interp(150.0, xs, ys) == pytest.approx([1.0, 0.75])


def test_arms_are_parsed_and_bad_ones_refused() -> None:
    assert reuse_experiment.Arm("dsc@8").name == "dsc@8"
    assert reuse_experiment.Arm("none").staleness is None
    for bad, msg in (("nope@2", "unknown rule"), ("none@2", "no staleness"),
                     ("all", "RULE@STALENESS"), ("all@0", ">= 1")):
        with pytest.raises(SystemExit, match=msg):
            reuse_experiment.Arm(bad)
    names = [a.name for a in reuse_experiment.default_arms([2, 8])]
    assert names[0] == "none" and len(names) == 1 + 2 * len(reuse_experiment.REUSE_RULES)


def _run(arm: str, seed: int, outcomes: np.ndarray, per_step: float) -> dict[str, Any]:
    """A synthetic run: evaluations at versions -1, 1, 3 (K, T) 0/1 outcomes, ``per_step``
    new tool steps per iteration."""
    steps = [-1, 1, 3]
    return {"horizon": 12, "arm": arm, "seed": seed,
            "evaluations": {"sampled": {str(s): row.astype(int).tolist()
                                        for s, row in zip(steps, outcomes, strict=True)}},
            "tool_steps_at": {"-1": 0.0, **{str(i): per_step * (i + 1) for i in range(4)}}}


def test_verdicts_call_a_large_paired_effect_and_an_identical_arm() -> None:
    rng = np.random.default_rng(0)
    seeds, tasks = list(range(6)), 200
    results = []
    for seed in seeds:
        base = rng.random((3, tasks)) < np.array([[0.3], [0.45], [0.5]])
        better = base | (rng.random((3, tasks)) < np.array([[0.0], [0.5], [0.6]]))
        results += [_run("none", seed, base, 100.0), _run("all@2", seed, base.copy(), 100.0),
                    _run("m2po@2", seed, better, 100.0)]
    vs = reuse_experiment.verdicts(results, ["none", "all@2", "m2po@2"], seeds, 400.0, 0.05)
    by = {(v["claim"].split()[1], v["statistic"].split("(")[0]): v for v in vs}
    assert len(vs) == 4 and all(v["level"] == pytest.approx(1 - 0.10 / 4) for v in vs)
    assert by[("all@2", "AUC")]["verdict"] == "equivalent"
    assert by[("all@2", "AUC")]["estimate"] == 0.0
    assert by[("m2po@2", "AUC")]["verdict"] == "superior"
    # at half the budget (200 tool steps: version 1) m2po's success is well above none's
    # final one, so the target is met
    assert by[("m2po@2", "success")]["verdict"] == "superior"
    # a missing seed makes the claim underpowered, not an error
    short = [r for r in results if not (r["arm"] == "m2po@2" and r["seed"] == 5)]
    vs = reuse_experiment.verdicts(short, ["none", "m2po@2"], seeds, 400.0, 0.05)
    assert {v["verdict"] for v in vs} == {"underpowered"}
