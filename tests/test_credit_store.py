"""`rtrees credit`: credit for stored trees, committed once per (method, params)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app
from rollout_store import Store, connect
from rollout_store.synthetic import bel_shaped_batch
from train.credit.store_io import CreditError, compute_credits

runner = CliRunner()


def verl_dump(path: Path) -> Path:
    rows = [
        {"input": "2+2?", "output": "4", "score": 1.0, "step": 3},
        {"input": "2+2?", "output": "5", "score": 0.0, "step": 3},
        {"input": "2+2?", "output": "four", "score": 1.0, "step": 3},
        {"input": "3*3?", "output": "9", "score": 1.0, "step": 3},
        {"input": "3*3?", "output": "6", "score": 0.0, "step": 3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_grpo_on_imported_dump_is_the_group_advantage(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    dump = verl_dump(tmp_path / "3.jsonl")
    result = runner.invoke(app, ["import", "--store", str(store_dir), "--format", "verl-jsonl",
                                 str(dump)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["credit", "--store", str(store_dir), "--method", "grpo",
                                 "--param", "std=unbiased"])
    assert result.exit_code == 0, result.output
    con = connect(Store(store_dir))
    got = con.sql("""
        SELECT n.action_text, c.value FROM credits c
        JOIN nodes n USING (tree_id, node_id)
        WHERE c.method = 'grpo' AND n.reward IS NOT NULL ORDER BY n.action_text""").fetchall()
    # Group "2+2?": rewards (1, 0, 1), mean 2/3, unbiased std sqrt(1/3).
    s1 = np.sqrt(1 / 3)
    # Group "3*3?": rewards (1, 0), mean 1/2, unbiased std sqrt(1/2).
    s2 = np.sqrt(1 / 2)
    want = {"4": (1 - 2 / 3) / (s1 + 1e-6), "5": (0 - 2 / 3) / (s1 + 1e-6),
            "four": (1 - 2 / 3) / (s1 + 1e-6), "9": 0.5 / (s2 + 1e-6), "6": -0.5 / (s2 + 1e-6)}
    assert dict(got).keys() == want.keys()
    for text, value in got:
        assert value == pytest.approx(want[text], rel=1e-9)


def test_every_tree_once_and_rerun_changes_nothing(store: Store) -> None:
    store.append_trees(bel_shaped_batch(30, seed=1, tree_prefix="a"), key="a")
    n_nodes = connect(store).sql("SELECT count(*) FROM nodes").fetchall()[0][0]
    first = compute_credits(store, "elpo", {"lambda_tree": "0.5"}, max_nodes=500,
                            progress=False)
    assert first.trees_done == 30 and first.rows == n_nodes and first.commits > 1
    version = store.version()
    again = compute_credits(store, "elpo", {"lambda_tree": "0.5"}, progress=False)
    assert again.trees_done == 0 and again.trees_skipped == 30
    assert store.version() == version  # nothing committed
    # Other parameters are another credit; new trees get credit on the next run.
    other = compute_credits(store, "elpo", {"lambda_tree": "1.0"}, progress=False)
    assert other.trees_done == 30 and other.params_hash != first.params_hash
    store.append_trees(bel_shaped_batch(5, seed=2, tree_prefix="b"), key="b")
    more = compute_credits(store, "elpo", {"lambda_tree": "0.5"}, progress=False)
    assert more.trees_done == 5 and more.trees_skipped == 30
    con = connect(store)
    dup = con.sql("""SELECT count(*) FROM (SELECT method_params_hash, tree_id, node_id
                     FROM credits GROUP BY ALL HAVING count(*) > 1)""").fetchall()
    assert dup == [(0,)]


@pytest.mark.parametrize("method", ["grpo", "tree_grpo", "elpo", "caliper", "slca"])
def test_methods_without_extra_inputs_run_on_stored_trees(store: Store, method: str) -> None:
    store.append_trees(bel_shaped_batch(8, seed=3), key="a")
    report = compute_credits(store, method, progress=False)
    assert report.trees_done == 8
    con = connect(store)
    rows = con.sql(f"SELECT count(*), count(token_values) FROM credits "
                   f"WHERE method = '{method}'").fetchall()[0]
    assert rows[0] == con.sql("SELECT count(*) FROM nodes").fetchall()[0][0]


def test_clear_errors(store: Store) -> None:
    store.append_trees(bel_shaped_batch(2, seed=3), key="a")
    with pytest.raises(CreditError, match="unknown method 'nope'"):
        compute_credits(store, "nope", progress=False)
    with pytest.raises(CreditError, match="unknown parameter 'bogus'"):
        compute_credits(store, "grpo", {"bogus": "1"}, progress=False)
    with pytest.raises(CreditError, match="trace needs input"):
        compute_credits(store, "trace", progress=False)
    result = runner.invoke(app, ["credit", "--store", str(store.path), "--method", "grpo",
                                 "--param", "std"])
    assert result.exit_code == 1 and "KEY=VALUE" in result.stderr
