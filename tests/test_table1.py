"""Table 1 in miniature (``rtrees study table1``): the report from its files, the study.

The default test builds the report from metric rows committed to real stores (the
layout the study writes), recomputes each number from those rows, and rebuilds the
report through ``analysis.report.build_study_report`` (``rtrees audit report --study``).
The slow test runs the study itself at its small settings: real trainer runs, a rerun
that skips them, and a config the trainer may refuse recorded as ``not run``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import analysis.table1 as t1
from analysis.report import build_study_report
from rollout_store import Store
from rollout_store.schema import METRICS
from rollout_store.store import now_utc
from train.studies.table1 import CONFIGS, SMALL, Table1Config, run_table1_study, slug
from train.studies.workflow_study import write_study

N_TASKS = 20
STEPS = 2


def _commit(store_dir: Path, run_id: str, rows: dict[str, dict[int, float]]) -> None:
    store = Store(store_dir, create=True)
    names, steps, values = [], [], []
    for name, by_step in rows.items():
        for step, value in by_step.items():
            names.append(name)
            steps.append(step)
            values.append(value)
    now = pa.array([now_utc()] * len(names), METRICS.field("created_at").type)
    store.append_metrics(pa.table({
        "run_id": pa.array([run_id] * len(names), pa.string()),
        "step": pa.array(steps, pa.int64()), "name": pa.array(names, pa.string()),
        "value": pa.array(values, pa.float64()), "created_at": now}, schema=METRICS),
        key=f"{run_id}:metrics")


def _study(tmp_path: Path, finals: dict[str, list[int]], truncate: str | None = None
           ) -> Path:
    """A study directory in the layout of ``run_table1_study``: per (config, seed) a
    store whose metrics say held-out successes k/N_TASKS (start 5, end ``finals``);
    ``trace+group`` refused; ``truncate``: that config's runs lack their last iteration."""
    config = Table1Config(configs=(*finals, "trace+group"), seeds=(0, 1), steps=STEPS,
                          tasks_per_step=2, n_total=4, heldout_tasks=N_TASKS,
                          eval_every=1, n_boot=400)
    runs: list[dict[str, Any]] = []
    for name, ks in finals.items():
        env, sampler, credit = CONFIGS[name]
        for seed, k in zip(config.seeds, ks, strict=True):
            run_id = f"table1-{slug(name)}-s{seed}"
            d = f"runs/{slug(name)}-s{seed}"
            last = STEPS - 2 if name == truncate else STEPS - 1
            _commit(tmp_path / d / "store", run_id, {
                "heldout_sampled": {-1: 5 / N_TASKS, last: k / N_TASKS},
                "heldout_greedy": {-1: 6 / N_TASKS, last: (k + 1) / N_TASKS},
                "loss": {s: 0.1 for s in range(last + 1)},
                "new_tool_steps": {s: 10.0 * (seed + 1) for s in range(last + 1)},
                "env_steps": {s: 12.0 for s in range(last + 1)},
                "seconds_sample": {s: 1.5 for s in range(last + 1)}})
            runs.append({"config": name, "seed": seed, "env": env, "sampler": sampler,
                         "credit": credit, "run_id": run_id, "dir": d, "store": "store",
                         "train": "train", "status": "done", "seconds": 3.0})
    for seed in config.seeds:
        runs.append({"config": "trace+group", "seed": seed, "env": "calc",
                     "sampler": "group", "credit": "trace", "dir": f"runs/x-s{seed}",
                     "run_id": "x", "store": "store", "train": "train",
                     "status": "not run", "reason": "ConfigError: credit 'trace' refused"})
    from dataclasses import asdict

    write_study(tmp_path / "study.json", {
        "study": "table1", "config": asdict(config),
        "configs": {k: list(CONFIGS[k]) for k in config.configs}, "runs": runs,
        "seconds": 9.0})
    return tmp_path


def test_report_numbers_come_from_the_metric_rows(tmp_path: Path) -> None:
    study = _study(tmp_path, {"grpo+group": [8, 10], "elpo+bel": [16, 18]})
    res = t1.table1_results(study)
    grpo, elpo = res["configs"]["grpo+group"], res["configs"]["elpo+bel"]
    assert grpo["final_sampled"]["mean"] == pytest.approx(0.45)
    assert grpo["final_sampled"]["std"] == pytest.approx(np.std([0.4, 0.5], ddof=1))
    assert elpo["final_greedy"]["mean"] == pytest.approx(0.9)
    assert grpo["start_sampled"]["mean"] == pytest.approx(0.25)
    assert grpo["tool_steps"]["mean"] == pytest.approx((20 + 40) / 2)  # 2 iterations each
    assert grpo["rollouts"] == STEPS * 2 * 4
    assert grpo["seconds_per_iteration"] == pytest.approx(1.5)
    lo, hi = grpo["final_sampled"]["ci"]
    assert lo < 0.45 < hi and hi - lo < 0.6
    claims = {v["claim"].split(" (")[0]: v for v in res["verdicts"]}
    beats = claims["ELPO Table 1: ELPO beats GRPO"]
    assert beats["estimate"] == pytest.approx(0.4)
    assert beats["verdict"] == "reproduced"  # 0.85 vs 0.45 with 20 tasks: far apart
    trace = claims["TRACE Table 1: TRACE beats GRPO"]
    assert trace["verdict"] == "inconclusive" and "not run" in trace["note"]
    assert res["configs"]["trace+group"]["status"] == (
        "not run: ConfigError: credit 'trace' refused (seeds 0, 1)")
    report = (study / "report.md").read_text()
    assert "0.450 ± 0.071" in report and "0.850 ± 0.071" in report
    assert "ELPO's Table 1" in report and (study / "table1_curves.png").stat().st_size
    # the audit's rebuild from the files alone gives the same numbers
    again = build_study_report(study, tmp_path / "rebuilt")
    assert again.name == "table1"
    rebuilt = json.loads((tmp_path / "rebuilt" / "results.json").read_text())
    assert rebuilt == json.loads((study / "results.json").read_text())


def test_an_unfinished_run_is_not_counted(tmp_path: Path) -> None:
    study = _study(tmp_path, {"grpo+group": [8, 10], "elpo+bel": [16, 18]},
                   truncate="elpo+bel")
    res = t1.table1_results(study)
    elpo = res["configs"]["elpo+bel"]
    assert elpo["status"] == "not run: seed 0: incomplete (1/2 iterations); seed 1: "\
        "incomplete (1/2 iterations)" and "final_sampled" not in elpo
    assert {r["status"] for r in res["runs"] if r["config"] == "elpo+bel"} == {
        f"incomplete (1/{STEPS} iterations)"}


def test_bootstrap_of_a_rate_is_binomial() -> None:
    boots = t1.boot_means([0.5], 100, 4000, np.random.default_rng(0))
    assert boots.mean() == pytest.approx(0.5, abs=0.01)
    assert boots.std() == pytest.approx(0.05, rel=0.1)  # sqrt(0.25 / 100)


def test_small_study_runs_resumes_and_rebuilds(tmp_path: Path) -> None:
    config = Table1Config(**SMALL)
    out = tmp_path / "t1"
    run_table1_study(out, config)
    res = t1.table1_results(out)
    grpo = res["configs"]["grpo+group"]
    assert grpo["status"] == "done" and 0.0 <= grpo["final_sampled"]["mean"] <= 1.0
    assert grpo["tool_steps"]["mean"] > 0
    assert res["configs"]["trace+group"]["status"] == "done"
    slca = res["configs"]["slca+group (sgls)"]  # the committed sgls policy
    assert slca["status"] == "done" and slca["tool_steps"]["mean"] > 0
    first = json.loads((out / "study.json").read_text())
    run_table1_study(out, config)  # a rerun skips every finished run
    second = json.loads((out / "study.json").read_text())
    done = [r for r in second["runs"] if r["status"] == "done"]
    assert done and all(r.get("skipped") for r in done)
    assert [r["run_id"] for r in first["runs"]] == [r["run_id"] for r in second["runs"]]
    assert t1.table1_results(out)["configs"]["grpo+group"] == grpo


def test_factor_and_sgcd_configs_carry_their_recipe(tmp_path: Path) -> None:
    """issue 24: the study accepts factor and sgcd (not run by default), each with its loss
    or sampling recipe in the trainer config."""
    from train.studies.table1 import DEFAULT_CONFIGS, run_config

    assert "factor+group" not in DEFAULT_CONFIGS and "sgcd+group" not in DEFAULT_CONFIGS
    config = Table1Config(configs=("grpo+group", "factor+group", "sgcd+group"))
    fa = run_config("factor+group", 0, config, tmp_path)
    sg = run_config("sgcd+group", 0, config, tmp_path)
    base = run_config("grpo+group", 0, config, tmp_path)
    assert (fa.credit, fa.aggregation) == ("factor", "action-mean")
    assert (sg.credit, sg.dynamic_sampling) == ("sgcd", "resample")
    assert (base.aggregation, base.dynamic_sampling) == ("token-mean", "off")
