"""Property round trips: random valid trees written, read back, equal (STYLE rule 9)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pyarrow as pa
from hypothesis import HealthCheck, given, settings

from rollout_store import Store, connect, iter_tree_batches, read_polars, read_trees
from rollout_store.testing import assert_trees_equal, tree_lists, trees
from rollout_store.tree import Tree, TreeBatch

_counter = itertools.count()
# tmp_path is shared across examples; each example makes its own store inside it.
_FIXTURE_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
               HealthCheck.data_too_large]


def _fresh(tmp_path: Path) -> Store:
    return Store(tmp_path / f"s{next(_counter)}", create=True)


@settings(max_examples=25, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(batch=tree_lists(max_size=4))
def test_write_read_equal(tmp_path: Path, batch: list[Tree]) -> None:
    store = _fresh(tmp_path)
    report = store.append_trees(batch, key="k")
    assert report.rows["trees"] == len(batch)
    assert report.rows["nodes"] == sum(len(t.nodes) for t in batch)
    assert_trees_equal(batch, read_trees(store))


@settings(max_examples=40, deadline=None)
@given(tree=trees(max_nodes=40))
def test_batch_form_round_trip(tree: Tree) -> None:
    """Tree -> columnar batch -> Tree is lossless (no store involved)."""
    assert_trees_equal(tree, TreeBatch.from_trees([tree]).to_trees())


@settings(max_examples=15, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(batch=tree_lists(min_size=2, max_size=6))
def test_all_readers_agree(tmp_path: Path, batch: list[Tree]) -> None:
    """DuckDB, polars, arrow streaming and the Tree reader see the same nodes."""
    store = _fresh(tmp_path)
    half = len(batch) // 2
    store.append_trees(batch[:half], key="a")
    store.append_trees(batch[half:], key="b")
    n = sum(len(t.nodes) for t in batch)
    con = connect(store)
    assert con.sql("SELECT count(*) FROM nodes").fetchall() == [(n,)]
    assert read_polars(store, "nodes").collect().height == n
    streamed = list(iter_tree_batches(store, max_rows=7))
    assert sum(b.num_rows for b in streamed) == n
    for b in streamed:  # whole trees only: every tree's rows arrive in one batch
        ids = set(b.column("tree_id").to_pylist())
        for tid in ids:
            want = next(len(t.nodes) for t in batch if t.tree_id == tid)
            assert b.filter(pa.compute.equal(b.column("tree_id"), tid)).num_rows == want
    leaves = sum(1 for t in batch for node in t.nodes if node.reward is not None)
    assert con.sql("SELECT count(*) FROM paths").fetchall() == [(leaves,)]
    assert_trees_equal(batch, read_trees(store))
