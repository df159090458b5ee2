"""``rtrees study NAME --small``: each study end to end at its test settings (issue 14).

Real environments, samplers, credits and stores. Each run writes report.md, results.json
and plots with one verdict per claim, and ``rtrees audit report --study DIR`` rebuilds
the same results from the data files alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.main import app
from train.jobs import STUDIES, run_study, study_config

runner = CliRunner()
VERDICTS = {"superior", "inferior", "equivalent", "underpowered"}


def _strip(doc: Any) -> Any:
    """results.json without what may differ between a run and its rebuild."""
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in ("plots", "seconds", "line")}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


def _run_and_rebuild(tmp_path: Path, name: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / name
    res = runner.invoke(app, ["study", name, "--out", str(out), "--small", *extra])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    assert results["verdicts"], "every study judges at least one claim"
    assert all(v["verdict"] in VERDICTS and v["verdict"] in v["line"]
               for v in results["verdicts"])
    assert results["verdicts"][0]["verdict"] in res.stdout
    assert (out / "report.md").read_text().startswith("# ")
    assert any(p.suffix == ".png" for p in out.iterdir())
    rebuilt = tmp_path / "rebuilt"
    res = runner.invoke(app, ["audit", "report", "--out", str(rebuilt), "--study", str(out)])
    assert res.exit_code == 0, res.output
    again = json.loads((rebuilt / name / "results.json").read_text())
    assert _strip(again) == _strip(results)
    return results


def test_dsc_l1_small(tmp_path: Path) -> None:
    res = _run_and_rebuild(tmp_path, "dsc-l1")
    per = res["summary"]["per_task"]
    assert per["n_tasks"] == 4 and per["abs_g"]["value"] > per["global_kl"]["value"]
    assert len(res["verdicts"]) == 4


def test_a_study_logs_its_power_then_its_progress(tmp_path: Path) -> None:
    """``run_study(log=...)`` (what ``rtrees study`` prints): the power lines before
    anything runs, then the study's own progress, counted to its end."""
    lines: list[str] = []
    run_study("dsc-l1", tmp_path / "l1", small=True, log=lines.append)
    assert lines[0].startswith("power: ")
    progress = [line for line in lines if line.startswith("tasks: ")]
    assert [line.split(" (")[0] for line in progress] == [f"tasks: {i}/4" for i in range(1, 5)]
    assert run_study("dsc-l1", tmp_path / "quiet", small=True)["verdicts"]  # log=None: quiet


def test_elpo_fig3_small(tmp_path: Path) -> None:
    res = _run_and_rebuild(tmp_path, "elpo-fig3", "--param", "n_tasks=3")
    wf = res["envs"]["workflow"]
    assert set(wf["references"]) == {"exact", "mean@32"} and wf["primary_reference"] == "exact"
    assert set(wf["coverage"]) == {"ELPO", "ELPO w/o BEL", "AEPO stand-in", "Tree-GRPO", "GRPO"}
    assert len(res["verdicts"]) == 4
    # --by sampler on the study's store gives the same point estimates per construction
    out = tmp_path / "by"
    cli = runner.invoke(app, ["audit", "ranking", "--store", str(tmp_path / "elpo-fig3" /
                                                                "store-workflow"),
                              "--methods", "elpo,tree_grpo", "--no-collect", "--by", "sampler",
                              "--bootstrap", "20", "--out", str(out)])
    assert cli.exit_code == 0, cli.output
    groups = json.loads((out / "results.json").read_text())["groups"]
    mean = wf["references"]["mean@32"]["point"]
    for construction, sampler, method in (("ELPO", "bel", "elpo"),
                                          ("ELPO w/o BEL", "random", "elpo"),
                                          ("AEPO stand-in", "entropy", "tree_grpo")):
        got = groups[sampler]["methods"][method]["pairwise_accuracy"]["estimate"]
        assert got == pytest.approx(mean[construction]["pairwise_accuracy"])


def test_dsc_table2_small(tmp_path: Path) -> None:
    res = _run_and_rebuild(tmp_path, "dsc-table2")
    t2 = res["table2"]
    sweep = {r["scale"]: r for r in t2["dsc_pairs"]["radius_scale_sweep"]}
    split = t2["dsc_pairs"]
    n = split["near_tie"]["n"] + split["clear"]["n"]
    assert n == t2["n_pairs"] > 0
    # at scale 1 the recomputed decisions are the stored ones
    stored = {k: (split["near_tie"][k] * split["near_tie"]["n"]
                  + split["clear"][k] * split["clear"]["n"]) / n
              for k in ("reuse", "transport", "refresh")}
    assert {k: sweep[1.0][k] for k in stored} == pytest.approx(stored)
    assert res["config"]["margin"] == 0.0005
    assert len(res["verdicts"]) == 4


def test_dsc_table2_real_update_variant_small(tmp_path: Path) -> None:
    """The LM variant (docs/METHODS.md 8.3, LM1-LM3) end to end: mu and pi1 the same tiny model, so
    the update is zero (KL 0 up to float noise; the old data alone decide, as for
    reuse-only), and the Monte Carlo check of both readings draws the same rollouts."""
    res = _run_and_rebuild(tmp_path, "dsc-table2", "--param", "lm_mu=tiny", "--param",
                           "lm_pi=tiny", "--param", "lm_check_tasks=2", "--param",
                           "lm_check_k=16")
    assert res["update_labels"] == ["pi1"] and res["mean_kl"]["pi1"] < 1e-9  # float noise:
    # mu and pi were scored in different batches
    assert res["n_instances"] == res["n_eval_tasks"]
    assert res["table"]["oracle"]["regret"] == 0.0
    assert res["table"]["transport_only"]["regret"] == res["table"]["reuse_only"]["regret"]
    assert len(res["verdicts"]) == 3  # no branch-selective update, so no share claim
    chk = res["lm_check"]
    assert set(chk) == {"mu", "pi1"} and chk["mu"] == chk["pi1"] and chk["mu"]["routes"] > 0
    assert "real updates" in (tmp_path / "dsc-table2" / "report.md").read_text()


def test_elpo_fig1_small(tmp_path: Path) -> None:
    res = _run_and_rebuild(tmp_path, "elpo-fig1")
    assert set(res["envs"]) == {"workflow", "calc"}
    arms = res["envs"]["workflow"]["arms"]
    assert arms["first_irrecoverable"]["n"] == res["envs"]["workflow"]["n_trajectories"] > 0
    assert all(0.0 <= arms[a]["exact"] <= 1.0 for a in arms if arms[a]["n"])
    calc = res["envs"]["calc"]["arms"]
    assert all(0.0 <= calc[a]["sampled"] <= 1.0 for a in calc if calc[a]["n"])
    # workflow: three claims (the matched control among them); calc: two or three (the
    # matched arm needs an error at or before BEL's t_crit)
    assert sum("(workflow)" in v["claim"] for v in res["verdicts"]) == 3
    assert len(res["verdicts"]) in (5, 6)


def test_elpo_fig1_workflow_only_small(tmp_path: Path) -> None:
    res = _run_and_rebuild(tmp_path, "elpo-fig1", "--param", "envs=workflow")
    assert set(res["envs"]) == {"workflow"} and len(res["verdicts"]) == 3


def test_fig1_errors_on_the_visible_state_can_follow_the_first_irrecoverable_step(
        tmp_path: Path) -> None:
    """On the full state every action after t_irr has Q* = 0, so no error (and no fixed
    error step) lies after it; on the visible state some do, and fixing them never
    recovers (the state is dead). The matched control never lies after t_irr."""
    from analysis.recovery import recovery_results
    from train.studies.recovery import RecoveryConfig, run_recovery_study

    got = {}
    for state in ("full", "visible"):
        config = RecoveryConfig(n_tasks=12, envs=("workflow",), n_boot=50, error_state=state)
        got[state] = recovery_results(run_recovery_study(tmp_path / state, config).parent)
    full = got["full"]["summary"]["by_position"]
    assert all("after" not in cells for cells in full.values()), full
    visible = got["visible"]["summary"]
    after = visible["by_position"]["random_error"]["after"]
    assert after["n"] > 0 and after["exact"] == 0.0
    assert "after" not in visible["by_position"]["matched_error"]
    assert set(visible["by_horizon"]) == {"12", "18", "24"}


def test_study_bad_input_is_one_line(tmp_path: Path) -> None:
    res = runner.invoke(app, ["study", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 1 and "unknown study 'nope'" in res.output
    res = runner.invoke(app, ["study", "dsc-l1", "--out", str(tmp_path), "--param", "bogus=1"])
    assert res.exit_code == 1 and "has no settings ['bogus']" in res.output
    res = runner.invoke(app, ["study", "dsc-l1", "--out", str(tmp_path), "--param",
                              "n_tasks=many"])
    assert res.exit_code == 1 and "expected int" in res.output
    assert "Traceback" not in res.output


def test_every_study_has_settings_and_a_small_version() -> None:
    assert {"dsc-l1", "elpo-fig3", "dsc-table2", "elpo-fig1"} <= set(STUDIES)
    for name in STUDIES:
        assert study_config(name) != study_config(name, small=True)
    cfg = study_config("elpo-fig3", {"envs": "workflow", "n_tasks": "5"})
    assert cfg.envs == ("workflow",) and cfg.n_tasks == 5
