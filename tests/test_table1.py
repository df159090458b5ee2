"""Table 1 in miniature (``rtrees study table1``): the report from its files, the study.

The default test builds the report from metric rows committed to real stores (the
layout the study writes), recomputes each number from those rows, and rebuilds the
report through ``analysis.report.build_study_report`` (``rtrees audit report --study``).
The slow test runs the study itself at its small settings: real trainer runs, a rerun
that skips them, and a config the trainer may refuse recorded as ``not run``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import analysis.table1 as t1
from analysis.report import build_study_report
from rollout_store import Store
from rollout_store.schema import EVALUATIONS, METRICS
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


def _commit_outcomes(store_dir: Path, run_id: str, step: int, mode: str, k: int) -> None:
    """Per-task outcomes of one evaluation: tasks 0..k-1 solved, the rest not."""
    store = Store(store_dir)
    n = N_TASKS
    store.append_evaluations(pa.table({
        "run_id": pa.array([run_id] * n, pa.string()), "step": pa.array([step] * n, pa.int64()),
        "mode": pa.array([mode] * n, pa.string()),
        "task_index": pa.array(range(n), pa.int32()),
        "task_id": pa.array([f"t{i}" for i in range(n)], pa.string()),
        "eval_seed": pa.array([7] * n, pa.int64()),
        "reward": pa.array([float(i < k) for i in range(n)], pa.float64()),
        "success": pa.array([i < k for i in range(n)], pa.bool_()),
        "steps": pa.array([1] * n, pa.int32()),
        "created_at": pa.array([now_utc()] * n, EVALUATIONS.field("created_at").type)},
        schema=EVALUATIONS), key=f"{run_id}:eval:{mode}")


def test_a_retried_evaluation_keeps_its_newest_rows(tmp_path: Path) -> None:
    """A step evaluated twice (an iteration retried after a crash) reads as its later
    rows, not as a mixture of both attempts."""
    Store(tmp_path / "s", create=True)
    _commit_outcomes(tmp_path / "s", "r", 1, "sampled", 3)
    store = Store(tmp_path / "s")
    retry = pa.table({
        "run_id": ["r"] * 2, "step": pa.array([1, 1], pa.int64()),
        "mode": ["sampled"] * 2, "task_index": pa.array([0, 5], pa.int32()),
        "task_id": ["t0", "t5"], "eval_seed": pa.array([7, 7], pa.int64()),
        "reward": [0.0, 1.0], "success": [False, True], "steps": pa.array([1, 1], pa.int32()),
        "created_at": pa.array([now_utc()] * 2, EVALUATIONS.field("created_at").type)},
        schema=EVALUATIONS)
    store.append_evaluations(retry, key="r:eval:sampled:retry-1")
    got = t1.read_outcomes(tmp_path / "s", "r")["sampled"][1]
    want = {i: float(i < 3) for i in range(N_TASKS)} | {0: 0.0, 5: 1.0}
    assert got == want
    outcomes = t1.read_outcomes(tmp_path / "s", "r")
    assert t1.outcomes_at(outcomes, 1, "sampled") == want
    assert t1.outcomes_at(outcomes, 2, "sampled") is None


def _study(tmp_path: Path, finals: dict[str, list[int]], truncate: str | None = None,
           per_task: bool = True) -> Path:
    """A study directory in the layout of ``run_table1_study``: per (config, seed) a
    store whose metrics say held-out successes k/N_TASKS (start 5, end ``finals``), and
    (``per_task``) the final evaluation's per-task rows; ``trace+group`` refused;
    ``truncate``: that config's runs lack their last iteration."""
    n_seeds = len(next(iter(finals.values())))
    config = Table1Config(configs=(*finals, "trace+group"), seeds=tuple(range(n_seeds)),
                          steps=STEPS,
                          tasks_per_step=2, n_total=4, heldout_tasks=N_TASKS,
                          eval_every=1)
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
                "entropy": {s: 0.8 - 0.1 * s - 0.01 * seed for s in range(last + 1)},
                "seconds_sample": {s: 1.5 for s in range(last + 1)}})
            if per_task:
                _commit_outcomes(tmp_path / d / "store", run_id, last, "sampled", k)
                _commit_outcomes(tmp_path / d / "store", run_id, last, "greedy", k + 1)
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
    study = _study(tmp_path, {"grpo+group": [8, 10, 9], "elpo+bel": [16, 18, 17]})
    res = t1.table1_results(study)
    grpo, elpo = res["configs"]["grpo+group"], res["configs"]["elpo+bel"]
    assert grpo["final_sampled"]["mean"] == pytest.approx(0.45)
    assert grpo["final_sampled"]["std"] == pytest.approx(np.std([0.4, 0.5, 0.45], ddof=1))
    assert elpo["final_greedy"]["mean"] == pytest.approx(0.9)
    assert grpo["start_sampled"]["mean"] == pytest.approx(0.25)
    assert grpo["tool_steps"]["mean"] == pytest.approx((20 + 40 + 60) / 3)  # 2 iterations
    assert grpo["rollouts"] == STEPS * 2 * 4
    assert grpo["seconds_per_iteration"] == pytest.approx(1.5)
    lo, hi = grpo["final_sampled"]["ci"]
    assert lo < 0.45 < hi and hi - lo < 0.6
    claims = {v["claim"].split(" (")[0]: v for v in res["verdicts"]}
    beats = claims["ELPO Table 1: ELPO beats GRPO"]
    assert beats["estimate"] == pytest.approx(0.4)
    # 0.85 vs 0.45 paired over 3 seeds x 20 tasks: far apart; two claims judged (K = 2)
    assert beats["verdict"] == "superior" and beats["level"] == pytest.approx(0.95)
    assert "3 seeds x 20 tasks" in beats["note"] and "greedy +0.400" in beats["note"]
    ours = t1.compare({s: {i: float(i < k) for i in range(N_TASKS)} for s, k in
                       enumerate([16, 18, 17])},
                      {s: {i: float(i < k) for i in range(N_TASKS)} for s, k in
                       enumerate([8, 10, 9])}, 0.95)
    assert ours is not None and beats["ci"] == pytest.approx(list(ours.ci))
    assert beats["mde"] == pytest.approx(ours.mde)
    trace = claims["TRACE Table 1: TRACE beats GRPO"]
    assert trace["verdict"] == "underpowered" and "not run" in trace["note"]
    assert res["configs"]["trace+group"]["status"] == (
        "not run: ConfigError: credit 'trace' refused (seeds 0, 1, 2)")
    report = (study / "report.md").read_text()
    assert "0.450 ± 0.050" in report and "0.850 ± 0.050" in report
    # the entropy of the first and the last iteration's samples, beside success
    assert grpo["final_entropy"]["mean"] == pytest.approx(0.7 - 0.01)
    assert "0.790 -> 0.690" in report
    assert "ELPO's Table 1" in report and (study / "table1_curves.png").stat().st_size
    # issue 24: a report with an SGCD row says its reference is the template stand-in
    assert "stand-in for the paper's LLM summary" not in report
    with_sgcd = {**res, "configs": {**res["configs"], "sgcd+group": {
        "env": "calc", "sampler": "group", "credit": "sgcd", "status": "not run"}}}
    assert "stand-in for the paper's LLM summary" in t1.table1_report(with_sgcd)
    # workflow rows name their start policy, horizons and marks; calc-only reports do not
    marked = {**res, "config": {**res["config"], "workflow_policy": "hf:/p",
                                "workflow_horizons": [18], "workflow_mark_optional": True},
              "configs": {**res["configs"], "grpo+group (workflow)": {
                  "env": "workflow", "sampler": "group", "credit": "grpo",
                  "status": "not run"}}}
    assert ("(workflow: hf:/p); workflow tasks at horizons [18], optional stages marked"
            in t1.table1_report(marked))
    assert "workflow" not in report.split("## calc")[0]
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


def test_stores_without_per_task_rows_pair_the_seed_rates(tmp_path: Path) -> None:
    """A study from before the evaluations table: the claim pairs per-seed rates."""
    study = _study(tmp_path, {"grpo+group": [8, 10, 9], "elpo+bel": [16, 19, 17]},
                   per_task=False)
    res = t1.table1_results(study)
    beats = {v["claim"].split(" (")[0]: v for v in res["verdicts"]}[
        "ELPO Table 1: ELPO beats GRPO"]
    d = np.array([16 - 8, 19 - 10, 17 - 9]) / N_TASKS
    from scipy import stats

    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
    assert beats["ci"] == pytest.approx([d.mean() - half, d.mean() + half])
    assert "3 seeds (rates)" in beats["note"]


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


def test_workflow_and_no_elc_configs_carry_horizons_and_recipe(tmp_path: Path) -> None:
    """issue 23 items 3-5: workflow configs train at the study's horizons, the no-ELC row
    sets eps_elc = 0 in its own directory, and the clip recipe reaches every run."""
    from analysis.power import study_power
    from train.studies.table1 import DEFAULT_CONFIGS, WORKFLOW_CONFIGS, run_config, slug

    assert not set(WORKFLOW_CONFIGS) & set(DEFAULT_CONFIGS) and len(WORKFLOW_CONFIGS) == 4
    config = Table1Config(configs=("elpo+bel", "elpo+bel (no ELC)", *WORKFLOW_CONFIGS),
                          epochs=2, minibatches=4, workflow_horizons=(12, 18))
    wf = run_config("elpo+bel (workflow)", 0, config, tmp_path)
    assert (wf.env, wf.sampler, wf.credit) == ("workflow", "bel", "elpo")
    assert wf.task_params == {"horizons": [12, 18]} and (wf.epochs, wf.minibatches) == (2, 4)
    noelc = run_config("elpo+bel (no ELC)", 0, config, tmp_path)
    calc = run_config("elpo+bel", 0, config, tmp_path)
    assert noelc.credit_params == {"eps_elc": "0"} and calc.credit_params == {}
    assert calc.task_params == {} and slug("elpo+bel (no ELC)") != slug("elpo+bel")
    assert len({slug(c) for c in config.configs}) == len(config.configs)
    # four claims among these configs (ELC, and three on workflow), each powered
    statement = study_power("table1", dataclasses.asdict(config))
    assert statement.sizes["claims"] == 4
    with pytest.raises(ValueError, match="minibatches"):
        Table1Config(minibatches=32, tasks_per_step=16)
    with pytest.raises(ValueError, match="workflow_horizons"):
        Table1Config(workflow_horizons=(1,))
    assert wf.policy == "tiny" and calc.policy == "tiny"
    marked = Table1Config(configs=WORKFLOW_CONFIGS, workflow_mark_optional=True,
                          workflow_policy="hf:/some/dir")
    wf = run_config("grpo+group (workflow)", 0, marked, tmp_path)
    assert wf.task_params == {"horizons": [18], "mark_optional": True}
    assert wf.policy == "hf:/some/dir"
    assert run_config("grpo+group", 0, marked, tmp_path).policy == "tiny"  # calc keeps it
    with pytest.raises(ValueError, match="workflow_policy"):
        Table1Config(workflow_policy="vllm:/x")
    # a checkpoint that does not exist stops the study before any run, calc ones included
    from train.studies.table1 import run_table1_study
    missing = dataclasses.replace(marked, configs=("grpo+group", *WORKFLOW_CONFIGS),
                                  workflow_policy=f"hf:{tmp_path / 'gone'}")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        run_table1_study(tmp_path / "study", missing)
    assert not (tmp_path / "study").exists()


def test_processes_sharing_a_study_directory_merge_their_runs(tmp_path: Path) -> None:
    """Two processes over one OUT, each given other seeds: the second to write study.json
    keeps the first's runs and seeds (same settings), in config order; a study of other
    settings in the directory is replaced, not merged."""
    from train.studies.table1 import merged_study

    path = tmp_path / "study.json"

    def run(name: str, seed: int) -> dict[str, Any]:
        return {"config": name, "seed": seed, "status": "done", "dir": f"runs/{name}-s{seed}"}

    first = Table1Config(configs=("elpo+bel", "grpo+group"), seeds=(0, 2))
    write_study(path, merged_study(path, first, [run("elpo+bel", 0), run("grpo+group", 2)]))
    second = dataclasses.replace(first, configs=("grpo+group", "tree_grpo+random"), seeds=(1,))
    doc = merged_study(path, second, [run("grpo+group", 1), {**run("grpo+group", 2),
                                                                 "status": "not run"}])
    assert doc["config"]["seeds"] == [0, 1, 2]
    assert doc["config"]["configs"] == ["grpo+group", "tree_grpo+random", "elpo+bel"]
    assert list(doc["configs"]) == doc["config"]["configs"]
    assert [(r["config"], r["seed"], r["status"]) for r in doc["runs"]] == [
        ("grpo+group", 1, "done"), ("grpo+group", 2, "not run"), ("elpo+bel", 0, "done")]
    other = dataclasses.replace(second, steps=second.steps + 1)
    alone = merged_study(path, other, [run("grpo+group", 1)])
    assert alone["config"]["seeds"] == [1] and len(alone["runs"]) == 1


def test_factor_and_sgcd_fair_arms_carry_their_recipes(tmp_path: Path) -> None:
    """issue 47: GRPO with SGCD's dynamic sampling and GRPO at SGCD's tool steps; FACTOR on
    BEL workflow trees with its new defaults beside GRPO on the same trees, at one lr, clip
    and optimizer-step count; the calc FACTOR rows keep the issue-24 recipe."""
    from analysis.power import study_power
    from analysis.table1 import CLAIMS
    from train.studies.table1 import FACTOR_WORKFLOW_CONFIGS, SGCD_CONFIGS, run_config, slug

    config = Table1Config(configs=(*SGCD_CONFIGS, *FACTOR_WORKFLOW_CONFIGS),
                          workflow_mark_optional=True, epochs=2, minibatches=4)
    sg = run_config("sgcd+group", 0, config, tmp_path)
    ds = run_config("grpo+group (ds)", 0, config, tmp_path)
    steps = run_config("grpo+group (steps)", 0, config, tmp_path)
    grpo = run_config("grpo+group", 0, config, tmp_path)
    assert (ds.credit, ds.dynamic_sampling, ds.n_total) == ("grpo", "resample", sg.n_total)
    assert sg.dynamic_sampling == "resample" and grpo.dynamic_sampling != "resample"
    assert steps.n_total == round(config.n_total * 1.73) == 14 and steps.credit == "grpo"
    assert steps.dynamic_sampling == grpo.dynamic_sampling
    fa = run_config("factor+bel (workflow)", 0, config, tmp_path)
    gb = run_config("grpo+bel (workflow)", 0, config, tmp_path)
    assert (fa.sampler, gb.sampler, fa.env, gb.env) == ("bel", "bel", "workflow", "workflow")
    assert fa.credit_params == {} and fa.aggregation == "action-mean"  # turn, annealed
    assert fa.task_params == gb.task_params == {"horizons": [18], "mark_optional": True}
    for f in ("lr", "epochs", "minibatches", "steps", "tasks_per_step", "n_total", "clip_low",
              "clip_high"):
        assert getattr(fa, f) == getattr(gb, f), f
    old = run_config("factor+group", 0, config, tmp_path)
    assert old.credit_params == {"context": "template", "eta_schedule": "constant"}
    assert len({slug(c) for c in config.configs}) == len(config.configs)
    names = {(a, b) for _, a, b, _ in CLAIMS}
    assert {("sgcd+group", "grpo+group (ds)"), ("sgcd+group", "grpo+group (steps)"),
            ("factor+bel (workflow)", "grpo+bel (workflow)")} <= names
    # SGCD vs GRPO (issue 24), vs GRPO with DS, vs GRPO at equal steps, FACTOR on workflow
    assert study_power("table1", dataclasses.asdict(config)).sizes["claims"] == 4
    with pytest.raises(ValueError, match="tool_step_ratio"):
        Table1Config(tool_step_ratio=0.5)
