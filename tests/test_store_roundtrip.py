"""Property round trips: random valid trees written, read back, equal."""

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


def test_logprobs_stored_at_the_documented_precision(tmp_path: Path) -> None:
    """Full-precision float32 logprobs and entropies come back rounded to
    ``precision.MANTISSA_BITS`` bits: equal to ``round_float32`` of the input exactly,
    within ``RELATIVE_ERROR`` of it, and nothing else about the tree changes."""
    import numpy as np

    from rollout_store.precision import RELATIVE_ERROR, round_float32
    from rollout_store.synthetic import bel_shaped_batch

    batch = bel_shaped_batch(20, rollouts=4, depth=3, seed=3)
    store = _fresh(tmp_path)
    store.append_trees(batch, key="k")
    got = {t.tree_id: t for t in read_trees(store)}
    sent = batch.to_trees()
    n_changed = 0
    for tree in sent:
        for node in tree.nodes:
            back = got[tree.tree_id].node(node.node_id)
            for name in ("action_logprobs", "action_entropies"):
                x = np.asarray(getattr(node, name) or [], np.float32)
                y = np.asarray(getattr(back, name) or [], np.float32)
                assert np.array_equal(y, round_float32(x))
                assert np.all(np.abs(y - x) <= RELATIVE_ERROR * np.abs(x))
                n_changed += int(np.sum(y != x))
            node.action_logprobs = back.action_logprobs
            node.action_entropies = back.action_entropies
    assert n_changed > 0  # the synthetic values are full float32: rounding did happen
    assert_trees_equal(sent, list(got.values()))
    # rounding is idempotent: compacting (rewriting the rows) changes nothing
    assert np.array_equal(round_float32(round_float32(np.float32([-0.123456789]))),
                          round_float32(np.float32([-0.123456789])))
