"""The main job end to end (workflow + the exact tabular policy, to keep it fast)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from rollout_store import Store

runner = CliRunner()


def test_pipeline_runs_and_rerun_reuses_everything(tmp_path: Path) -> None:
    args = ["pipeline", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out"),
            "--env", "workflow", "--policy", "tabular", "--tasks", "4", "--k", "8"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "Mean@8 ranking audit" in first.stdout and "report:" in first.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(results["methods"]) == {"grpo", "elpo"}
    for m in results["methods"].values():
        assert 0.0 <= m["pairwise_accuracy"] <= 1.0 and m["n_prefixes"] > 0
    version = Store(tmp_path / "store").version()
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "4 of 4 tasks already stored" in again.stdout
    assert Store(tmp_path / "store").version() == version  # nothing new committed
    assert json.loads((tmp_path / "out" / "results.json").read_text())["methods"] == \
        results["methods"]
