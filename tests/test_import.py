"""``rollout_store.importers``: verl JSONL and TRL Parquet dumps as one-level trees.

Real dump files written by hand in ``tmp_path``, a real store, real DuckDB.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rollout_store import Store, connect
from rollout_store.import_checks import DumpImportError
from rollout_store.importers import (
    default_run_id,
    import_file,
    import_files,
    task_id_for,
)

P1 = "What is 2+3? Answer with a number."
P2 = "Name the capital of France."

# Three completions of P1 and two of P2, as verl writes them at step 3:
# `acc` (bool) and `pred` (str) are non-numeric extras, `format_reward` numeric.
VERL_ROWS: list[dict[str, Any]] = [
    {"input": P1, "output": "5", "gts": "5", "score": 1.0, "step": 3,
     "acc": True, "format_reward": 0.5, "pred": "5"},
    {"input": P1, "output": "6", "gts": "5", "score": 0.0, "step": 3,
     "acc": False, "format_reward": 0.5, "pred": "6"},
    {"input": P2, "output": "Paris", "gts": "Paris", "score": 1.0, "step": 3,
     "acc": True, "format_reward": 0.0, "pred": "Paris"},
    {"input": P1, "output": "five", "gts": "5", "score": 0.25, "step": 3,
     "acc": False, "format_reward": 0.0, "pred": None},
    {"input": P2, "output": "Lyon", "gts": "Paris", "score": 0, "step": 3,
     "acc": False, "format_reward": 1.0, "pred": "Lyon"},
]

# Two prompts x three completions at TRL step 5, two reward functions.
TRL_ROWS: dict[str, list[Any]] = {
    "step": [5] * 6,
    "prompt": [P1, P1, P1, P2, P2, P2],
    "completion": ["5", "6", "five", "Paris", "Lyon", "paris"],
    "accuracy_reward": [1.0, 0.0, 0.0, 1.0, 0.0, 1.0],
    "format_reward": [0.5, 0.5, 0.0, 0.25, 0.25, 0.0],
    "mode": ["train"] * 6,
    "advantage": [1.2, -0.4, -0.8, 0.7, -1.1, 0.4],
}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, columns: dict[str, list[Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def counts(store: Store) -> tuple[int, int, int]:
    con = connect(store)
    row = con.execute("SELECT (SELECT count(*) FROM trees), (SELECT count(*) FROM nodes), "
                  "(SELECT count(*) FROM credits)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", create=True)


@pytest.fixture
def verl_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "verl_run" / "3.jsonl", VERL_ROWS)


@pytest.fixture
def trl_file(tmp_path: Path) -> Path:
    return write_parquet(tmp_path / "trl_run" / "completions" / "completions_00005.parquet",
                         TRL_ROWS)


def test_verl_rows_become_one_tree_per_prompt(store: Store, verl_file: Path) -> None:
    (report,) = import_files(store, [verl_file], "verl-jsonl")
    assert (report.n_trees, report.n_rows, report.n_credits) == (2, 5, 0)
    assert not report.already_stored
    assert "2 trees, 5 completions" in report.summary()
    con = connect(store)
    trees = con.execute("""
        SELECT t.task_id, t.env, t.sampler, t.run_id, t.budget, t.n_nodes, t.meta,
               r.observation_text, r.kind
        FROM trees t JOIN nodes r ON r.tree_id = t.tree_id AND r.parent_id IS NULL
        ORDER BY r.observation_text""").fetchall()
    assert [t[7] for t in trees] == [P2, P1]
    for task_id, env, sampler, run_id, budget, n_nodes, meta, prompt, kind in trees:
        assert (env, sampler, run_id, kind) == ("verl", "group", "verl_run", "prompt")
        assert task_id == task_id_for(prompt)
        assert budget == n_nodes - 1 == (3 if prompt == P1 else 2)
        meta = json.loads(meta)
        assert meta["step"] == 3
        assert meta["source_file"] == str(verl_file.absolute())
        assert meta["gts"] == ("5" if prompt == P1 else "Paris")  # one per group: tree meta
    leaves = con.execute("""
        SELECT l.action_text, l.reward, l.reward_parts, l.kind, l.terminal, l.depth, l.meta
        FROM nodes l WHERE l.parent_id IS NOT NULL ORDER BY l.action_text""").fetchall()
    by_text = {r[0]: r for r in leaves}
    assert len(leaves) == 5
    for src in VERL_ROWS:
        _, reward, parts, kind, terminal, depth, meta = by_text[src["output"]]
        assert (kind, terminal, depth) == ("decision", True, 1)
        assert reward == float(src["score"])
        assert dict(parts) == {"format_reward": src["format_reward"]}
        meta = json.loads(meta)
        assert meta["acc"] is src["acc"] and meta["pred"] == src["pred"]
        assert "gts" not in meta
    path_rewards = con.execute("SELECT sum(reward), count(*) FROM paths").fetchone()
    assert path_rewards == (pytest.approx(sum(r["score"] for r in VERL_ROWS)), 5)


def test_trl_reward_is_sum_of_reward_columns_and_advantages_are_credits(
        store: Store, trl_file: Path) -> None:
    (report,) = import_files(store, [trl_file], "trl-parquet")
    assert (report.n_trees, report.n_rows, report.n_credits) == (2, 6, 6)
    assert report.run_id == "trl_run"  # skips the completions/ level
    con = connect(store)
    assert con.execute("SELECT DISTINCT env, run_id FROM trees").fetchall() == [("trl", "trl_run")]
    assert con.execute("SELECT count(*) FROM nodes WHERE parent_id IS NULL").fetchone() == (2,)
    leaves = con.execute("""
        SELECT l.action_text, l.reward, l.reward_parts, l.meta, c.value, c.method
        FROM nodes l LEFT JOIN credits c ON c.tree_id = l.tree_id AND c.node_id = l.node_id
        WHERE l.parent_id IS NOT NULL""").fetchall()
    assert len(leaves) == 6
    by_text = {r[0]: r for r in leaves}
    for i, text in enumerate(TRL_ROWS["completion"]):
        _, reward, parts, meta, advantage, method = by_text[text]
        acc, fmt = TRL_ROWS["accuracy_reward"][i], TRL_ROWS["format_reward"][i]
        assert reward == pytest.approx(acc + fmt)
        assert dict(parts) == {"accuracy_reward": acc, "format_reward": fmt}
        assert advantage == TRL_ROWS["advantage"][i]
        assert method == "source_advantage"
        assert json.loads(meta) == {"source_row": i, "mode": "train"}
    # Credits cover the leaves only: no row for a root.
    assert con.execute("""SELECT count(*) FROM credits c JOIN nodes n
                      ON c.tree_id = n.tree_id AND c.node_id = n.node_id
                      WHERE n.parent_id IS NULL""").fetchone() == (0,)


def test_trl_named_reward_columns(store: Store, trl_file: Path) -> None:
    import_files(store, [trl_file], "trl-parquet", reward_columns=["accuracy_reward"])
    con = connect(store)
    rows = con.execute("SELECT action_text, reward, reward_parts, meta FROM nodes "
                   "WHERE parent_id IS NOT NULL").fetchall()
    by_text = {r[0]: r for r in rows}
    for i, text in enumerate(TRL_ROWS["completion"]):
        _, reward, parts, meta = by_text[text]
        assert reward == TRL_ROWS["accuracy_reward"][i]
        assert dict(parts) == {"accuracy_reward": TRL_ROWS["accuracy_reward"][i]}
        assert json.loads(meta)["format_reward"] == TRL_ROWS["format_reward"][i]


def test_trl_nan_reward_cell_means_not_applicable(store: Store, tmp_path: Path) -> None:
    cols = {**TRL_ROWS, "format_reward": [math.nan, *TRL_ROWS["format_reward"][1:]]}
    path = write_parquet(tmp_path / "completions_00005.parquet", cols)
    import_file(store, path, "trl-parquet")
    row = connect(store).execute("SELECT reward, reward_parts, meta FROM nodes "
                             "WHERE action_text = '5'").fetchone()
    assert row is not None
    assert row[0] == 1.0 and dict(row[1]) == {"accuracy_reward": 1.0}
    assert json.loads(row[2])["missing_reward_parts"] == ["format_reward"]


def test_importing_twice_stores_once(store: Store, verl_file: Path, trl_file: Path) -> None:
    first = [import_file(store, verl_file, "verl-jsonl"),
             import_file(store, trl_file, "trl-parquet")]
    before = counts(store)
    assert before == (4, 15, 6)
    again = [import_file(store, verl_file, "verl-jsonl"),
             import_file(store, trl_file, "trl-parquet")]
    assert counts(store) == before
    assert all(r.already_stored for r in again)
    assert [r.key for r in again] == [r.key for r in first]
    assert "already stored" in again[0].summary()
    # A copy of the same bytes under another path is the same append.
    copy = verl_file.parent.parent / "elsewhere" / "3.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(verl_file.read_bytes())
    assert import_file(store, copy, "verl-jsonl").already_stored
    assert counts(store) == before


def test_same_prompt_and_step_in_two_files_are_two_trees(store: Store, tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "run" / "3.jsonl", VERL_ROWS[:2])
    b = write_jsonl(tmp_path / "run" / "3b.jsonl", VERL_ROWS[:2] + VERL_ROWS[3:4])
    reports = import_files(store, [a, b], "verl-jsonl")
    assert [r.n_trees for r in reports] == [1, 1]
    con = connect(store)
    assert con.execute("SELECT count(DISTINCT tree_id), count(DISTINCT task_id) FROM trees"
                   ).fetchone() == (2, 1)
    assert con.execute("SELECT n_nodes FROM trees ORDER BY n_nodes").fetchall() == [(3,), (4,)]


def test_redumped_file_of_same_run_is_refused(store: Store, tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "a" / "run" / "3.jsonl", VERL_ROWS)
    redump = write_jsonl(tmp_path / "b" / "run" / "3.jsonl", VERL_ROWS[:2])
    import_file(store, first, "verl-jsonl")
    before = counts(store)
    with pytest.raises(DumpImportError, match=r"duplicate_tree_id.*pass a distinct run id"):
        import_file(store, redump, "verl-jsonl")
    assert counts(store) == before
    assert import_file(store, redump, "verl-jsonl", run_id="run-b").n_trees == 1


def _bad_verl_lines() -> list[tuple[str, str, str]]:
    good = json.dumps(VERL_ROWS[0])
    return [
        ("not_json", '{"input": "x", "output": ', "not valid JSON"),
        ("missing_field", json.dumps({k: v for k, v in VERL_ROWS[0].items() if k != "output"}),
         "missing required field 'output'"),
        ("string_score", json.dumps({**VERL_ROWS[0], "score": "high"}),
         'score must be a number, got "high"'),
        ("nan_score", good.replace('"score": 1.0', '"score": NaN'), "score is nan"),
        ("not_object", "[1, 2]", "expected a JSON object"),
    ]


@pytest.mark.parametrize(("bad_line", "message"),
                         [pytest.param(line, msg, id=name) for name, line, msg in
                          _bad_verl_lines()])
def test_bad_verl_line_names_file_and_line_and_writes_nothing(
        store: Store, tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "run" / "7.jsonl"
    path.parent.mkdir()
    # Two good lines, a blank line (skipped, but counted), then the bad one: line 4.
    path.write_text(json.dumps(VERL_ROWS[0]) + "\n" + json.dumps(VERL_ROWS[1]) + "\n\n"
                    + bad_line + "\n" + json.dumps(VERL_ROWS[2]) + "\n")
    version = store.version()
    with pytest.raises(DumpImportError) as info:
        import_files(store, [path], "verl-jsonl")
    assert str(path) in str(info.value)
    assert "line 4" in str(info.value)
    assert message in str(info.value)
    assert (info.value.path, info.value.line) == (str(path), 4)
    assert store.version() == version
    assert counts(store) == (0, 0, 0)


@pytest.mark.parametrize(("drop", "reward_columns", "message"), [
    ("prompt", None, "missing required column(s) prompt"),
    ("completion", None, "missing required column(s) completion"),
    (None, ["accuracy_reward", "length_reward"], "reward column 'length_reward' does not exist"),
    (None, ["mode"], "reward column 'mode' is string, not numeric"),
])
def test_bad_trl_file_names_file_and_writes_nothing(
        store: Store, tmp_path: Path, drop: str | None, reward_columns: list[str] | None,
        message: str) -> None:
    cols = {k: v for k, v in TRL_ROWS.items() if k != drop}
    path = write_parquet(tmp_path / "completions_00005.parquet", cols)
    with pytest.raises(DumpImportError) as info:
        import_files(store, [path], "trl-parquet", reward_columns=reward_columns)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)
    assert counts(store) == (0, 0, 0)


@pytest.mark.parametrize(("column", "value", "message"), [
    ("prompt", None, "prompt is null"),
    ("advantage", math.nan, "advantage is nan"),
    ("step", None, "step must be an integer"),
])
def test_bad_trl_row_names_the_row(store: Store, tmp_path: Path, column: str, value: Any,
                                   message: str) -> None:
    cols = dict(TRL_ROWS)
    cols[column] = [*cols[column][:4], value, *cols[column][5:]]
    path = write_parquet(tmp_path / "completions_00005.parquet", cols)
    with pytest.raises(DumpImportError) as info:
        import_files(store, [path], "trl-parquet")
    assert f"{path}: row 4: {message}" in str(info.value)
    assert info.value.row == 4
    assert counts(store) == (0, 0, 0)


def test_bad_second_file_keeps_the_first(store: Store, tmp_path: Path, verl_file: Path) -> None:
    bad = write_jsonl(tmp_path / "verl_run" / "4.jsonl", [{"input": "x", "output": "y"}])
    with pytest.raises(DumpImportError, match=r"4\.jsonl: line 1: missing required field "
                       r"'score' \(1 earlier file"):
        import_files(store, [verl_file, bad], "verl-jsonl")
    assert counts(store) == (2, 7, 0)


def test_unknown_format_and_misplaced_options(store: Store, verl_file: Path) -> None:
    with pytest.raises(DumpImportError, match="unknown import format 'openrlhf'"):
        import_files(store, [verl_file], "openrlhf")
    with pytest.raises(DumpImportError, match="trl-parquet only"):
        import_files(store, [verl_file], "verl-jsonl", reward_columns=["score"])
    with pytest.raises(DumpImportError, match="no such file"):
        import_files(store, [verl_file.parent / "missing.jsonl"], "verl-jsonl")
    assert counts(store) == (0, 0, 0)


def test_default_run_id_is_the_run_directory(tmp_path: Path) -> None:
    out = tmp_path / "grpo-qwen"
    assert default_run_id(out / "completions" / "completions_00001.parquet",
                          "trl-parquet") == "grpo-qwen"
    assert default_run_id(out / "completions" / "train" / "completions_00001.parquet",
                          "trl-parquet") == "grpo-qwen"
    assert default_run_id(tmp_path / "rollouts" / "12.jsonl", "verl-jsonl") == "rollouts"


def test_cli_import(tmp_path: Path, verl_file: Path) -> None:
    from cli.main import app

    store_dir = tmp_path / "cli-store"
    args = ["import", "--store", str(store_dir), "--format", "verl-jsonl", str(verl_file),
            "--run-id", "exp-1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "3.jsonl: 2 trees, 5 completions" in " ".join(result.output.split())
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "already stored" in again.output
    con = connect(store_dir)
    assert con.execute("SELECT DISTINCT run_id FROM trees").fetchall() == [("exp-1",)]
    assert con.execute("SELECT count(*) FROM paths").fetchone() == (5,)

    bad = write_jsonl(tmp_path / "bad" / "9.jsonl", [{"input": "x", "output": "y",
                                                      "score": "n/a", "step": 9}])
    failed = CliRunner().invoke(app, ["import", "--store", str(store_dir), "--format",
                                      "verl-jsonl", str(bad)])
    assert failed.exit_code == 1
    message = " ".join(failed.output.split())  # rich wraps long lines
    assert f"{bad}: line 1: score must be a number" in message
