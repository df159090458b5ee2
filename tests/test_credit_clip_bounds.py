"""Per-token clip bounds in ``credits`` (issue 28; schema version 4): ELPO's E8 and
CALIPER's C8 bounds round-trip through the store, a store of version 3 is upgraded in
place on open (its rows kept, their bounds null), and the reuse stage reads an unchanged
stored tree's committed credit instead of running the estimator on it again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from credit_helpers import node
from deltalake import DeltaTable
from deltalake.transaction import AddAction

from rollout_store import schema as schema_mod
from rollout_store.reader import connect, read_arrow
from rollout_store.store import Store, now_utc
from rollout_store.tree import Tree
from train.batches import NodeCredit, node_credit, rows_credit
from train.credit import ESTIMATORS
from train.credit.base import Estimator, TreeArrays
from train.credit.elpo import ElpoParams, elpo
from train.credit.store_io import credit_trees, credit_trees_full, stored_credit
from train.reuse.stage import credit_stored


def bel_tree(tree_id: str = "bel") -> Tree:
    """docs/METHODS.md E8: node 4 is the critical node, its subtree {4, 6} the suffix."""
    return Tree(tree_id=tree_id, task_id="x", critical_node_id=4, nodes=[
        node(0, None, 0, 2), node(1, 0, 2, 1), node(2, 0, 1, 0), node(3, 1, 1, 0, reward=1.0),
        node(4, 1, 1, 1), node(5, 2, 1, 0, reward=0.0), node(6, 4, 2, 0, reward=0.0)])


def _same(a: dict[tuple[str, int], NodeCredit], b: dict[tuple[str, int], NodeCredit]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k].advantage, b[k].advantage.astype(np.float32))
        for x, y in ((a[k].clip_low, b[k].clip_low), (a[k].clip_high, b[k].clip_high)):
            if y is None or not len(y):
                assert x is None, k
            else:
                assert x is not None, k
                np.testing.assert_array_equal(x, y)  # float64: exactly the estimator's


def test_elpo_bounds_round_trip_through_the_store(store: Store) -> None:
    tree = bel_tree()
    store.append_trees([tree], key="t")
    rows, arrays, credit = credit_trees_full([tree], "elpo")
    assert credit.clip_low is not None and credit.clip_high is not None
    store.append_credits(rows, key="c")
    back = stored_credit(store, ["bel"], "elpo", ElpoParams().params_hash())
    assert back.num_rows == len(tree.nodes)
    got = rows_credit(back)
    _same(got, node_credit(arrays, credit))
    p = ElpoParams()
    assert got[("bel", 6)].clip_low is not None
    assert got[("bel", 6)].clip_low.tolist() == [p.eps_low + p.eps_elc] * 2  # E8 suffix
    assert got[("bel", 5)].clip_low is not None
    assert got[("bel", 5)].clip_low.tolist() == [p.eps_low]
    # a method that sets no bounds stores empty lists: read back as "none", not "unknown"
    grpo_rows = credit_trees([tree], "grpo")
    assert grpo_rows.column("clip_low").to_pylist() == [[]] * len(tree.nodes)
    store.append_credits(grpo_rows, key="g")
    from train.credit.grpo import GrpoParams

    plain = stored_credit(store, ["bel"], "grpo", GrpoParams().params_hash())
    assert plain.num_rows == len(tree.nodes)
    assert all(c.clip_low is None and c.clip_high is None for c in rows_credit(plain).values())


def _v3_store(path: Path) -> None:
    """A store as schema version 3 wrote it: every table with its version-3 schema and
    configuration, and one ``credits`` row in a data file committed to the log."""
    for name, schema in schema_mod.SCHEMA_HISTORY[3].items():
        DeltaTable.create(str(path / name), schema, name=name, configuration={
            schema_mod.CONFIG_TABLE_KEY: name, schema_mod.CONFIG_VERSION_KEY: "3",
            schema_mod.CONFIG_FINGERPRINT_KEY: schema_mod.fingerprint(schema)},
            raise_if_key_not_exists=False)
    old = schema_mod.SCHEMA_HISTORY[3]["credits"]
    assert "clip_low" not in old.names
    row = pa.Table.from_pylist([{"run_id": "r", "method": "elpo", "method_params_hash": "h",
                                 "method_params": None, "tree_id": "old", "node_id": 1,
                                 "value": 0.25, "token_values": [0.25],
                                 "policy_version": None, "created_at": now_utc()}],
                               schema=old)
    pq.write_table(row, path / "credits" / "old.parquet")
    size = (path / "credits" / "old.parquet").stat().st_size
    DeltaTable(str(path / "credits")).create_write_transaction(
        [AddAction("old.parquet", size, {}, 0, True, "{}")], mode="append", schema=old)


@pytest.mark.parametrize("stopped", [False, True])
def test_version_3_store_is_upgraded_on_open_and_keeps_its_rows(tmp_path: Path,
                                                                stopped: bool) -> None:
    """``stopped``: an earlier upgrade died after adding the columns to the Delta schema
    (before rewriting the files and recording the version); the next open finishes it."""
    path = tmp_path / "v3"
    _v3_store(path)
    before = DeltaTable(str(path / "credits"))
    assert before.metadata().configuration[schema_mod.CONFIG_VERSION_KEY] == "3"
    if stopped:
        from deltalake import Schema as DeltaSchema

        before.alter.add_columns(list(DeltaSchema.from_arrow(pa.schema(
            [schema_mod.CREDITS.field(c) for c in schema_mod.CLIP_BOUNDS])).fields))
    store = Store(path)
    assert store.table_schema_version["credits"] == schema_mod.SCHEMA_VERSION == 4
    after = DeltaTable(str(path / "credits"))
    config = after.metadata().configuration
    assert config[schema_mod.CONFIG_VERSION_KEY] == "4"
    assert config[schema_mod.CONFIG_FINGERPRINT_KEY] == schema_mod.fingerprint(
        schema_mod.CREDITS)
    assert [f.name for f in after.schema().fields] == schema_mod.CREDITS.names
    assert len(after.file_uris()) == 1  # the old file replaced by one with the columns null
    # the old row reads with null bounds (not recorded), and is not taken as stored credit
    con = connect(store)
    assert con.sql("SELECT tree_id, value, token_values, clip_low, clip_high "
                   "FROM credits").fetchall() == [("old", 0.25, [0.25], None, None)]
    table = read_arrow(store, "credits")
    assert table.column("clip_low").null_count == 1
    assert stored_credit(store, ["old"], "elpo", "h").num_rows == 0
    # writable now: trees and bounded credit rows go in and come back
    tree = bel_tree()
    store.append_trees([tree], key="t")
    rows = credit_trees([tree], "elpo")
    store.append_credits(rows, key="c")
    again = Store(path)  # a second open changes nothing
    assert DeltaTable(str(path / "credits")).version() == again.delta_table("credits").version()
    assert read_arrow(again, "credits").num_rows == 1 + len(tree.nodes)
    back = stored_credit(again, ["bel"], "elpo", ElpoParams().params_hash())
    _same(rows_credit(back), rows_credit(rows))
    # every live file has the declared schema: compaction merges old and new rows
    from rollout_store.maintenance import compact

    assert compact(again)["credits"]["numFilesAdded"] == 1
    merged = read_arrow(Store(path), "credits")
    assert merged.num_rows == 1 + len(tree.nodes) and merged.column("clip_low").null_count == 1


class Counted:
    """A real credit function (``credit_trees`` + ``rows_credit``, as the trainer's
    ``credit_for``) that records the trees it was asked to credit."""

    def __init__(self, method: str = "elpo") -> None:
        self.method = method
        self.calls: list[list[str]] = []

    def __call__(self, trees: Sequence[Tree]
                 ) -> tuple[pa.Table, dict[tuple[str, int], NodeCredit]]:
        self.calls.append([t.tree_id for t in trees])
        rows = credit_trees(trees, self.method, run_id="now")
        return rows, rows_credit(rows)


def test_credit_stored_reads_unchanged_trees_and_credits_the_rest(store: Store) -> None:
    """Of three stored trees: ``a`` has committed elpo rows and is unchanged (read back),
    ``b`` has none (credited), ``c`` has rows but the rule changed its returns (credited:
    its stored credit is of other data)."""
    a, b, c = bel_tree("a"), bel_tree("b"), bel_tree("c")
    store.append_trees([a, b, c], key="t")
    first = Counted()
    rows, _ = first([a, c])
    store.append_credits(rows, key="c")
    c_moved = replace(c, nodes=[replace(n, reward=0.5) if n.node_id == 3 else n
                                for n in c.nodes])
    key = ("elpo", ElpoParams().params_hash())
    counted = Counted()
    got_rows, credit, read = credit_stored(store, [a, b, c], [a, b, c_moved], counted, key,
                                           run_id="now")
    assert counted.calls == [["b", "c"]] and read == 1
    assert got_rows is not None
    assert sorted(set(got_rows.column("tree_id").to_pylist())) == ["a", "b", "c"]
    assert set(got_rows.column("run_id").to_pylist()) == {"now"}
    _same({k: v for k, v in credit.items() if k[0] == "a"},
          {k: v for k, v in rows_credit(rows).items() if k[0] == "a"})
    # no key (a prompt-group method): every tree is credited
    counted = Counted()
    credit_stored(store, [a, b], [a, b], counted, None, run_id="now")
    assert counted.calls == [["a", "b"]]


def test_trainer_reuse_runs_the_estimator_once_per_tree(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """``--reuse all`` with a registered counting estimator (ELPO, so the rows carry
    bounds): the stored trees' credit is read from the store, so the estimator sees each
    tree once, at its own iteration, and the stored trees' committed ``+reuse`` rows equal
    their original rows."""
    from train.config import load_config
    from train.trainer import read_metrics, train

    seen: list[str] = []

    def counted_elpo(batch: TreeArrays, p: ElpoParams) -> Any:
        seen.extend(batch.tree_ids)
        return elpo(batch, p)

    monkeypatch.setitem(ESTIMATORS, "counted", Estimator("counted", ElpoParams, counted_elpo))
    cfg = load_config(None, {"env": "calc", "policy": "tiny", "sampler": "group",
                             "credit": "counted", "steps": 3, "tasks_per_step": 2,
                             "n_total": 3, "heldout_tasks": 0, "max_new_tokens": 24,
                             "minibatches": 2, "seed": 7, "progress": False, "run_id": "r",
                             "reuse": "all", "reuse_per_step": 2, "max_staleness": 2,
                             "store": str(tmp_path / "s"), "out": str(tmp_path / "o")})
    train(cfg)
    m = read_metrics(cfg.store, "r")
    reused = [v for _, v in m["reuse_trees"]]
    assert sum(reused) > 0
    assert [v for _, v in m["reuse_credit_read_trees"]] == reused
    assert len(seen) == len(set(seen)) == 3 * 2  # the fresh trees, once each
    con = connect(Store(cfg.store))
    diff = con.sql("""
        SELECT count(*) FROM credits r JOIN credits o USING (tree_id, node_id)
        WHERE r.method = 'counted+reuse' AND o.method = 'counted'
          AND (r.token_values IS DISTINCT FROM o.token_values
               OR r.clip_low IS DISTINCT FROM o.clip_low
               OR r.clip_high IS DISTINCT FROM o.clip_high
               OR len(r.clip_low) != len(r.token_values))""")
    assert diff.fetchall() == [(0,)]
    n_reuse = con.sql("SELECT count(DISTINCT tree_id) FROM credits "
                      "WHERE method = 'counted+reuse'").fetchall()[0][0]
    assert n_reuse > 0
