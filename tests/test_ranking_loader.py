"""``analysis.ranking_data.load_ranking_data`` (numpy joins on int64 node keys) against the
plain SQL it replaced (DuckDB joins and aggregates on string ids), over real stores with
what the fast path must get right: references pooled over several rows, at other k and
other policy versions, children without a reference, credits rewritten (the latest
``created_at`` wins), a second parameter hash, and both key layouts (``bincount`` over a
dense key space; sorting when one wide tree makes the key space sparse)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from analysis.ranking_data import RANKING_TABLES, TableSource, load_ranking_data, resolve_methods
from rollout_store import Store, connect
from rollout_store.schema import CREDITS, MC_REFERENCES
from rollout_store.store import now_utc
from rollout_store.synthetic import bel_shaped_batch, wide_batch
from rollout_store.tree import TreeBatch

K = 8

REFERENCE_SQL = """
    WITH kids AS (SELECT tree_id, parent_id, node_id FROM nodes WHERE parent_id IS NOT NULL),
    prefixes AS (SELECT tree_id, parent_id FROM kids GROUP BY ALL HAVING count(*) >= 2),
    ref AS (SELECT r.tree_id, r.node_id, sum(r.successes) AS successes, sum(r.k) AS k
            FROM mc_references r JOIN trees t USING (tree_id)
            WHERE r.k = $k AND r.policy_version IS NOT DISTINCT FROM
                  coalesce($policy, t.policy_version) GROUP BY ALL),
    score AS (SELECT tree_id, node_id, arg_max(value, created_at) AS s FROM credits
              WHERE method = $m AND method_params_hash = $h GROUP BY ALL),
    rows AS (SELECT c.*, ref.successes, ref.k, s.s FROM kids c JOIN prefixes USING (tree_id,
             parent_id) LEFT JOIN ref USING (tree_id, node_id)
             LEFT JOIN score s USING (tree_id, node_id)),
    complete AS (SELECT tree_id, parent_id FROM rows GROUP BY ALL HAVING count(k) = count(*))
    SELECT tree_id, parent_id, node_id, successes, k, s FROM rows
    SEMI JOIN complete USING (tree_id, parent_id) ORDER BY ALL"""


def _shifted(batch: TreeBatch, by: int) -> TreeBatch:
    """The same trees with every node id (and parent id) plus ``by``."""
    nodes = batch.nodes
    for name in ("node_id", "parent_id"):
        i = nodes.schema.get_field_index(name)
        nodes = nodes.set_column(i, nodes.schema.field(i), pc.add(nodes.column(name), by))
    return TreeBatch(batch.trees, nodes, batch.snapshots)


def _store(path: Path, wide: bool, shift: int = 0) -> Store:
    store = Store(path, create=True)
    store.append_trees(_shifted(bel_shaped_batch(12, rollouts=4, depth=3, seed=1,
                                                 run_id="r"), shift), key="bel")
    if wide:  # 1 tree of 1,201 nodes beside 12 small ones: len(trees) x span >> nodes
        store.append_trees(wide_batch(1200), key="wide")
    con = connect(store)
    nodes = con.sql("SELECT tree_id, node_id FROM nodes WHERE parent_id IS NOT NULL "
                    "ORDER BY ALL").fetchall()
    policy = dict(con.sql("SELECT tree_id, policy_version FROM trees").fetchall())
    rng = np.random.default_rng(0)
    t0 = now_utc()
    n = len(nodes)

    def refs(rows: list[tuple[str, int]], k: int, pv: list[str | None], key: str) -> None:
        m = len(rows)
        store.append_mc_references(pa.table({
            "run_id": ["r"] * m, "tree_id": [t for t, _ in rows],
            "node_id": pa.array([i for _, i in rows], pa.int64()),
            "k": pa.array([k] * m, pa.int32()),
            "successes": pa.array(rng.integers(0, k + 1, m), pa.int32()),
            "policy_version": pa.array(pv, pa.string()),
            "created_at": pa.array([t0] * m, MC_REFERENCES.field("created_at").type)},
            schema=MC_REFERENCES), key=key)

    keep = [r for r in nodes if r[0] == "wide" or rng.random() < 0.9]  # some lack one
    refs(keep, K, [policy[t] for t, _ in keep], "ref")
    twice = keep[::3]  # pooled with a second run's rows
    refs(twice, K, [policy[t] for t, _ in twice], "ref-again")
    refs(nodes, K, ["elsewhere"] * n, "ref-other-policy")
    refs(nodes, 2 * K, [policy[t] for t, _ in nodes], "ref-other-k")

    def credits(rows: list[tuple[str, int]], params_hash: str, at: timedelta, key: str
                ) -> None:
        m = len(rows)
        store.append_credits(pa.table({
            "run_id": ["r"] * m, "method": ["m"] * m, "method_params_hash": [params_hash] * m,
            "method_params": pa.nulls(m, pa.string()), "tree_id": [t for t, _ in rows],
            "node_id": pa.array([i for _, i in rows], pa.int64()),
            "value": pa.array(np.round(rng.normal(size=m), 1)),
            "token_values": pa.nulls(m, pa.list_(pa.float32())),
            "policy_version": ["v"] * m,
            "created_at": pa.array([t0 + at] * m, CREDITS.field("created_at").type),
            "clip_low": pa.nulls(m, CREDITS.field("clip_low").type),
            "clip_high": pa.nulls(m, CREDITS.field("clip_high").type)},
            schema=CREDITS), key=key)

    credits(nodes, "aaa", timedelta(0), "first")
    credits(nodes[::2], "aaa", timedelta(seconds=5), "rewrite")  # the latest wins
    credits(nodes[1::4], "aaa", -timedelta(seconds=5), "older")  # never seen
    credits(nodes, "bbb", timedelta(seconds=1), "other-hash")
    return store


@pytest.mark.parametrize("wide", [False, True], ids=["dense-keys", "sparse-keys"])
@pytest.mark.parametrize("policy", [None, "elsewhere"])
@pytest.mark.parametrize("source", ["duckdb", "parquet"])
def test_loader_equals_plain_sql(tmp_path: Path, wide: bool, policy: str | None,
                                 source: str) -> None:
    """Both sources: a DuckDB connection's views, and the pinned Parquet files read with
    dictionary-encoded ids (what ``ranking_audit`` uses)."""
    store = _store(tmp_path / "s", wide)
    con = connect(store)
    with store.pinned_reads():
        tables = (con if source == "duckdb" else
                  TableSource.pinned(store, store.resolve(None, RANKING_TABLES)))
        methods = resolve_methods(tables, ["m@aaa", "m@bbb"])
        data, dropped = load_ranking_data(tables, methods, K, policy)
    assert not dropped
    tree_ids = np.array(data.tree_ids, dtype=object)[data.tree]
    got = sorted(zip(tree_ids.tolist(), data.parent_id.tolist(), data.node_id.tolist(),
                     data.successes.tolist(), data.k_total.tolist(),
                     data.scores[:, 0].tolist(), data.scores[:, 1].tolist(), strict=True))
    want = {}
    for i, m in enumerate(methods):
        rows = con.execute(REFERENCE_SQL, {"k": K, "policy": policy, "m": m.method,
                                           "h": m.params_hash}).fetchall()
        want[i] = rows
    expected = [(*a, b[-1]) for a, b in zip(want[0], want[1], strict=True)]
    assert got == expected
    assert len(got) > 10
    if wide:
        assert "wide" in data.tree_ids
    # Trees are indexed in the order the nodes view first holds them.
    first_seen = list(dict.fromkeys(
        t for (t,) in con.sql("SELECT tree_id FROM nodes").fetchall() if t in data.tree_ids))
    assert data.tree_ids == first_seen
    assert np.all(np.diff(data.group) >= 0)


def test_node_ids_need_not_start_at_zero(tmp_path: Path) -> None:
    """Keys count node ids from the smallest child's parent (``lo``): the same trees with
    every node id plus 1,000 give the same audit rows, ids shifted."""
    rows = []
    for shift in (0, 1000):
        store = _store(tmp_path / f"s{shift}", wide=False, shift=shift)
        with store.pinned_reads():
            tables = TableSource.pinned(store, store.resolve(None, RANKING_TABLES))
            data, _ = load_ranking_data(tables, resolve_methods(tables, ["m@aaa"]), K)
        rows.append((data.parent_id - shift, data.node_id - shift, data.successes,
                     data.k_total, data.scores, data.group, data.tree_ids))
    assert len(rows[0][0]) > 10
    for a, b in zip(*rows, strict=True):
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
