"""The main job (``rtrees demo``, ``train.demo.run_demo_job``) end to end on tiny settings,
its rerun, its report's arithmetic, and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis.demo_report import training_section
from cli.main import app
from rollout_store import Store, connect

runner = CliRunner()

TINY = ["--tasks", "1", "--n-total", "6", "--k", "2", "--steps", "2", "--tasks-per-step",
        "2", "--heldout-tasks", "4"]


def _sql(store: Path, query: str, **params: object) -> list[tuple[object, ...]]:
    return connect(Store(store)).execute(query, params).fetchall()


@pytest.mark.slow
def test_demo_trains_reports_and_rerun_reuses_everything(tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    args = ["demo", "--store", str(store), "--out", str(out), *TINY]
    first = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert first.exit_code == 0, first.output
    for text in ("Mean@2 ranking audit", "held-out success", "saved by reuse", "report:"):
        assert text in first.stdout
    for name in ("report.md", "results.json", "learning_curve.png", "demo.json",
                 "ranking/report.md", "ranking/results.json", "ranking/ranking.png",
                 "policy/step-000000/model.safetensors", "train/config.json"):
        assert (out / name).is_file(), name
    results = json.loads((out / "results.json").read_text())
    ranking = json.loads((out / "ranking" / "results.json").read_text())

    # ranking: every method, the audit's own numbers, per sampler
    assert set(results["ranking"]["methods"]) == {"grpo", "tree_grpo", "elpo", "caliper",
                                                  "trace"}
    for name, m in results["ranking"]["methods"].items():
        assert m["pairwise_accuracy"] == ranking["methods"][name]["pairwise_accuracy"]
        assert m["kendall_tau_b"] == ranking["methods"][name]["kendall_tau_b"]["macro"]
        assert 0.0 <= m["pairwise_accuracy"] <= 1.0 and m["n_prefixes"] > 0
    # the audit tells methods apart: on calc grpo and elpo order siblings identically by
    # construction, trace (scored by the starting policy) by another signal
    methods = results["ranking"]["methods"]

    def numbers(name: str) -> tuple[float, float]:
        return methods[name]["pairwise_accuracy"], methods[name]["kendall_tau_b"]

    assert numbers("grpo") == numbers("elpo")
    assert numbers("trace") != numbers("grpo")
    assert ["grpo", "elpo"] in results["ranking"]["identical"]["all"]
    assert not [pair for pair in results["ranking"]["identical"]["all"] if "trace" in pair]
    diff = ranking["paired_differences"]["grpo-trace"]["kendall_tau_b"]["macro"]["estimate"]
    assert diff != 0.0
    assert set(results["ranking"]["samplers"]) <= {"group", "bel", "caliper"}
    assert results["ranking"]["samplers"]

    # collection: one tree per sampler, as the store holds them
    for sampler, c in results["collection"].items():
        [(n,)] = _sql(store, "SELECT count(*) FROM trees WHERE run_id = $r", r=c["run_id"])
        assert c["trees"] == n == 1, sampler

    # training: the numbers are the metrics table's
    tr = results["training"]
    run = tr["run_id"]
    assert tr["iterations"] == 2

    def metric(name: str) -> list[tuple[object, ...]]:
        return _sql(store, "SELECT step, value FROM metrics WHERE run_id = $r AND name = $n "
                           "ORDER BY step", r=run, n=name)

    sampled = metric("heldout_sampled")
    assert sampled[0][0] == -1 and tr["heldout"]["sampled"]["before"] == sampled[0][1]
    assert tr["heldout"]["sampled"]["after"] == sampled[-1][1] and sampled[-1][0] == 1
    assert tr["tool_steps"]["new"] == sum(v for _, v in metric("new_tool_steps")) > 0  # type: ignore[misc]
    spent = sum(v for _, v in metric("reuse_new_tool_steps"))  # type: ignore[misc]
    refresh_all = sum(v for _, v in metric("reuse_refresh_all_tool_steps"))  # type: ignore[misc]
    assert tr["tool_steps"]["saved"] == refresh_all - spent
    assert tr["reuse_trees"] > 0  # the collected trees were reused (version 0 -> iteration 1)
    [(fresh,)] = _sql(store, "SELECT count(*) FROM trees WHERE run_id = $r AND "
                             "sampler <> 'refresh'", r=run)
    assert fresh == 2 * 2  # tasks_per_step fresh trees per iteration
    [(refreshed,)] = _sql(store, "SELECT count(*) FROM trees WHERE run_id = $r AND "
                                 "sampler = 'refresh'", r=run)
    assert refreshed == sum(v for _, v in metric("reuse_refreshed_trees"))  # type: ignore[misc]
    report = (out / "report.md").read_text()
    assert "grpo and elpo rank siblings identically" in report
    assert "learning_curve.png" in report

    # rerun: nothing new in the store, the finished training run skipped, same numbers
    version = Store(store).version()
    again = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert again.exit_code == 0, again.output
    assert "1 of 1 tasks already stored" in again.stdout
    assert "holds the finished run" in again.stdout
    assert dict(Store(store).version().versions) == dict(version.versions)
    rerun = json.loads((out / "results.json").read_text())
    assert rerun["ranking"]["methods"] == results["ranking"]["methods"]
    assert rerun["training"]["heldout"] == tr["heldout"]
    assert all(rerun["reused"].values()), rerun["reused"]


def test_training_section_arithmetic() -> None:
    """Versions: step -1 is version 0 (before), step s is version s + 1; tool steps sum over
    iterations and saved = refresh-all - spent by reuse."""
    metrics = {
        "heldout_sampled": [(-1, 0.5), (1, 0.6), (3, 0.75)],
        "heldout_greedy": [(-1, 0.8), (3, 0.9)],
        "loss": [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)],
        "reward": [(0, 0.4), (1, 0.5), (2, 0.55), (3, 0.6)],
        "new_tool_steps": [(0, 100.0), (1, 150.0), (2, 140.0), (3, 130.0)],
        "reuse_new_tool_steps": [(1, 40.0), (2, 30.0), (3, 20.0)],
        "reuse_refresh_all_tool_steps": [(1, 90.0), (2, 90.0), (3, 90.0)],
        "reuse_calibration_tool_steps": [(1, 12.0), (2, 0.0), (3, 0.0)],
        "reuse_trees": [(1, 3.0), (2, 3.0), (3, 3.0)],
    }
    tr = training_section(metrics, "r", {"steps": 4, "reuse": "dsc", "heldout_tasks": 10})
    assert tr["iterations"] == 4
    assert tr["heldout"]["sampled"] == {"before": 0.5, "after": 0.75, "after_version": 4,
                                        "curve": [(0, 0.5), (2, 0.6), (4, 0.75)]}
    assert tr["heldout"]["greedy"]["before"] == 0.8 and tr["heldout"]["greedy"]["after"] == 0.9
    assert tr["tool_steps"] == {"new": 520.0, "fresh": 430.0, "reuse_new": 90.0,
                                "calibration": 12.0, "refresh_all": 270.0, "saved": 180.0}
    assert tr["reuse_trees"] == 9.0
    empty = training_section({}, "r", {})
    assert empty["heldout"]["sampled"]["before"] is None and empty["iterations"] == 0


def test_demo_bad_settings_are_one_line_errors(tmp_path: Path) -> None:
    for extra, message in ((["--steps", "1"], "reuse needs train_steps >= 2"),
                           (["--tasks", "0"], "tasks must be >= 1")):
        result = runner.invoke(app, ["demo", "--store", str(tmp_path / "s"), "--out",
                                     str(tmp_path / "o"), *extra])
        assert result.exit_code == 1 and message in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


def test_pipeline_is_retired_and_the_store_demo_moved(tmp_path: Path) -> None:
    assert runner.invoke(app, ["pipeline", "--help"]).exit_code != 0
    result = runner.invoke(app, ["store", "demo", "--store", str(tmp_path / "syn"),
                                 "--trees", "40"])
    assert result.exit_code == 0, result.output
    assert "appended 1 commits, 0 already stored" in result.stdout
    assert "validate: ok" in result.stdout
