"""The store commands of `rtrees`, driven through typer's runner and once as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from rollout_store import SCHEMA_VERSION, Store
from rollout_store.synthetic import bel_shaped_batch

runner = CliRunner()


def filled(tmp_path: Path) -> Path:
    store = Store(tmp_path / "store", create=True)
    for i in range(3):
        store.append_trees(bel_shaped_batch(4, seed=i, tree_prefix=f"b{i}"), key=f"b{i}")
    return store.path


def test_info_json(tmp_path: Path) -> None:
    path = filled(tmp_path)
    result = runner.invoke(app, ["store", "info", "--store", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["tables"]["trees"]["rows"] == 12
    assert data["tables"]["trees"]["version"] == 3 and data["commits"] == 3
    assert data["tables"]["nodes"]["bytes"] > 0 and data["schema_version"] == SCHEMA_VERSION
    table = runner.invoke(app, ["store", "info", "--store", str(path)])
    assert table.exit_code == 0 and "nodes" in table.stdout


def test_sql_formats_and_time_travel(tmp_path: Path) -> None:
    path = filled(tmp_path)
    q = "SELECT count(*) AS n FROM trees"
    as_json = runner.invoke(app, ["sql", q, "--store", str(path), "--format", "json"])
    assert json.loads(as_json.stdout) == [{"n": 12}]
    as_csv = runner.invoke(app, ["sql", q, "--store", str(path), "--format", "csv"])
    assert as_csv.stdout.split() == ['"n"', "12"]
    old = runner.invoke(app, ["sql", q, "--store", str(path), "--format", "json",
                              "--version", "1"])
    assert json.loads(old.stdout) == [{"n": 4}]
    bad = runner.invoke(app, ["sql", "SELECT nope FROM trees", "--store", str(path)])
    assert bad.exit_code == 1 and "nope" in bad.stderr


def test_validate_reports_damage(tmp_path: Path) -> None:
    path = filled(tmp_path)
    ok = runner.invoke(app, ["store", "validate", "--store", str(path)])
    assert ok.exit_code == 0 and "12 trees" in ok.stdout
    victim = Store(path).files("nodes")[1].path
    data = bytearray(Path(victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(victim).write_bytes(bytes(data))
    bad = runner.invoke(app, ["store", "validate", "--store", str(path)])
    assert bad.exit_code == 1 and Path(victim).name in bad.stderr.replace("\n", "")


def test_compact_keeps_rows(tmp_path: Path) -> None:
    path = filled(tmp_path)
    q = ["sql", "SELECT count(*) AS n FROM nodes", "--store", str(path), "--format", "json"]
    before = json.loads(runner.invoke(app, q).stdout)
    result = runner.invoke(app, ["store", "compact", "--store", str(path)])
    assert result.exit_code == 0, result.output
    assert "nodes: 3 files -> 1" in result.stdout
    assert json.loads(runner.invoke(app, q).stdout) == before
    refused = runner.invoke(app, ["store", "compact", "--store", str(path),
                                  "--retention-hours", "0"])
    assert refused.exit_code == 1 and "at least 1" in refused.stderr


def test_missing_store_is_a_clear_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["store", "info", "--store", str(tmp_path / "nope")])
    assert result.exit_code == 1 and "no such store" in result.stderr


def test_store_demo_runs_and_reruns_as_a_process(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "cli.main", "store", "demo", "--store", str(tmp_path / "demo"),
           "--trees", "300"]
    root = Path(__file__).resolve().parents[1]
    first = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "appended 2 commits, 0 already stored" in first.stdout
    assert "validate: ok" in first.stdout
    again = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert "appended 0 commits, 2 already stored" in again.stdout


def test_store_demo_refuses_no_trees_before_creating_the_store(tmp_path: Path) -> None:
    result = runner.invoke(app, ["store", "demo", "--store", str(tmp_path / "s"),
                                 "--trees", "0"])
    assert result.exit_code == 1 and "trees must be >= 1" in result.stderr
    assert not (tmp_path / "s").exists()
