"""`rtrees credit`: credit for stored trees, committed once per (method, params)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli.main import app
from rollout_store import Store, connect
from rollout_store.schema import CREDITS
from rollout_store.synthetic import bel_shaped_batch
from rollout_store.testing import tree_lists
from rollout_store.tree import Tree
from train.credit.grpo import GrpoParams
from train.credit.store_io import CreditError, compute_credits, credit_trees

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


@pytest.mark.parametrize("method", ["grpo", "tree_grpo", "elpo", "caliper", "slca", "factor",
                                    "sgcd"])
def test_methods_without_extra_inputs_run_on_stored_trees(store: Store, method: str) -> None:
    store.append_trees(bel_shaped_batch(8, seed=3), key="a")
    # The synthetic leaves carry one reward part, "outcome": slca needs HierR parts (S1).
    # factor / sgcd without their teacher weights (eta = 0, kappa = 0) need no scores.
    params = {"slca": {"tool_part": "outcome", "sum_part": "outcome"}, "factor": {"eta": "0"},
              "sgcd": {"kappa": "0"}}.get(method, {})
    report = compute_credits(store, method, params, progress=False)
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
    with pytest.raises(CreditError, match="slca needs the HierR reward parts at every leaf"):
        compute_credits(store, "slca", progress=False)
    for method in ("factor", "sgcd"):  # token scores of the trees' own versions: none stored
        with pytest.raises(CreditError, match=rf"{method}: 2 tree\(s\) have no stored 'plain' "
                                              r"scores of their own policy versions"):
            compute_credits(store, method, progress=False)
    with pytest.raises(CreditError, match=r"factor needs input 'hindsight_logprob'.*teacher="):
        credit_trees(bel_shaped_batch(1, seed=3).to_trees(), "factor")
    result = runner.invoke(app, ["credit", "--store", str(store.path), "--method", "grpo",
                                 "--param", "std"])
    assert result.exit_code == 1 and "KEY=VALUE" in result.stderr


# ----------------------------------------------------------------- credit is history-free
PROMPT_GROUP_METHODS = [("tree_grpo", {}), ("grpo", {"group": "task"}),
                        ("elpo", {"group": "task"}), ("grpo", {}),
                        ("factor", {"group": "task", "eta": "0"}),
                        ("sgcd", {"group": "task", "kappa": "0"})]


def _values(store: Store, method: str) -> dict[tuple[str, int], float]:
    rows = connect(store).sql(f"SELECT tree_id, node_id, value FROM credits "
                              f"WHERE method = '{method}'").fetchall()
    return {(t, n): v for t, n, v in rows}


def test_credit_is_the_same_in_one_call_or_several(tmp_path: Path) -> None:
    # Two runs that share task ids: each (run, task) is its own prompt group, so crediting
    # the first run, then the second, equals crediting both at once (and in many batches).
    first = bel_shaped_batch(6, seed=1, tree_prefix="a")
    second = bel_shaped_batch(6, seed=2, tree_prefix="b", run_id="second")
    for method, params in PROMPT_GROUP_METHODS:
        tag = f"{method}-{len(params)}"
        several = Store(tmp_path / f"several-{tag}", create=True)
        several.append_trees(first, key="a")
        compute_credits(several, method, params, progress=False)
        several.append_trees(second, key="b")
        compute_credits(several, method, params, progress=False)
        once = Store(tmp_path / f"once-{tag}", create=True)
        once.append_trees(first, key="a")
        once.append_trees(second, key="b")
        report = compute_credits(once, method, params, max_nodes=150, progress=False)
        assert report.commits >= 2  # groups were cut into several batches
        got, want = _values(several, method), _values(once, method)
        assert got.keys() == want.keys() and len(got) > 0
        assert got == want, method  # identical, bit for bit


def test_a_group_that_grew_after_credit_is_refused(store: Store) -> None:
    store.append_trees(bel_shaped_batch(4, seed=1, tree_prefix="a"), key="a")
    compute_credits(store, "tree_grpo", progress=False)
    compute_credits(store, "grpo", progress=False)
    # Same run, same tasks, another seed: the trees join the credited groups.
    store.append_trees(bel_shaped_batch(4, seed=2, tree_prefix="b"), key="b")
    version = store.version()
    with pytest.raises(CreditError, match=r"4 group\(s\) gained trees after they were "
                                          r"credited: \(run 'synthetic', sampler 'bel'"):
        compute_credits(store, "tree_grpo", progress=False)
    assert store.version() == version  # nothing committed
    # Per-tree credit does not depend on other trees: the new trees just get theirs.
    assert compute_credits(store, "grpo", progress=False).trees_done == 4
    result = runner.invoke(app, ["credit", "--store", str(store.path), "--method", "tree_grpo"])
    assert result.exit_code == 1 and "gained trees" in result.stderr
    assert "Traceback" not in result.output


def test_credit_trees_is_the_store_code_path(store: Store) -> None:
    batch = bel_shaped_batch(5, seed=4)
    store.append_trees(batch, key="a")
    compute_credits(store, "elpo", {"group": "task"}, progress=False)
    rows = credit_trees(batch.to_trees(), "elpo", {"group": "task"})
    assert rows.schema == CREDITS
    stored = _values(store, "elpo")
    got = {(t, n): v for t, n, v in zip(rows.column("tree_id").to_pylist(),
                                        rows.column("node_id").to_pylist(),
                                        rows.column("value").to_pylist(), strict=True)}
    assert got == stored
    assert credit_trees(batch.to_trees(), "grpo", GrpoParams(group="task")).num_rows == len(got)
    with pytest.raises(CreditError, match="unknown method"):
        credit_trees(batch.to_trees(), "nope")


@st.composite
def grouped_trees(draw: st.DrawFn) -> list[Tree]:
    """Random trees in a few prompt groups: shared task ids across two runs and samplers."""
    trees = draw(tree_lists(max_size=5, max_nodes=15))
    out = []
    for t in trees:
        out.append(replace(t, task_id=draw(st.sampled_from(["u", "v"])),
                           run_id=draw(st.sampled_from(["r1", "r2"])),
                           sampler=draw(st.sampled_from(["bel", "random"])),
                           policy_version="v0"))
    return out


HISTORY_CASES = [("grpo", {"group": "task"}), ("elpo", {"group": "task"}), ("tree_grpo", {}),
                 ("caliper", {}), ("grpo", {})]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(trees=grouped_trees(), data=st.data())
def test_credit_is_independent_of_how_groups_are_batched(trees: list[Tree],
                                                         data: st.DataObject) -> None:
    # Credit of every tree is the same whether its prompt group is credited with all
    # others at once or group by group, in any order (credit is a function of the group).
    for method, params in HISTORY_CASES:
        whole = _rows(credit_trees(trees, method, params))
        keys = sorted({(t.run_id, t.sampler, t.policy_version, t.task_id) for t in trees})
        order = data.draw(st.permutations(keys))
        parts: dict[tuple[str, int], float] = {}
        for key in order:
            group = [t for t in trees if (t.run_id, t.sampler, t.policy_version, t.task_id)
                     == key]
            parts.update(_rows(credit_trees(group, method, params)))
        assert parts == whole, method  # identical, bit for bit


def _rows(table: pa.Table) -> dict[tuple[str, int], float]:
    return {(t, n): v for t, n, v in zip(table.column("tree_id").to_pylist(),
                                         table.column("node_id").to_pylist(),
                                         table.column("value").to_pylist(), strict=True)}
