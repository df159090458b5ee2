"""Query: the store's ``siblings`` view vs the same SQL written by hand over one Parquet file.

Store side: ``rollout_store.connect(store)`` once (timed separately), then
``SELECT count(*), sum(n_leaves), sum(n_success) FROM siblings`` (or, with
``--fetch arrow``, ``SELECT * FROM siblings`` fetched to an Arrow table). The
view reads the committed file list and keeps only rows whose ``commit_key``
is in ``trees`` (see ``rollout_store/reader.py``).

Baseline: the stored ``nodes`` rows (``read_arrow(store, "nodes")``, with the
derived ``preorder`` and ``subtree_size``) written to one Parquet file with
the store's settings (zstd, 128Ki-row groups), and the view's SQL written by
hand against ``read_parquet('file')`` with no ``commit_key`` filtering, in a
fresh DuckDB connection. Both sides' full results are compared (sorted) before
timing. Informative rows, to show where a gap comes from: the hand SQL over a
file written with pyarrow's defaults (snappy, one row group per 1M rows); the
hand SQL with the view's row filter added (``commit_key IN (SELECT DISTINCT
commit_key FROM <trees file>)``); and the hand SQL filtered by the committed
keys written out as literals (``commit_key IN ('k1', ...)``, resolved in Python
first), a cheaper way the view could filter.

Target (issue 2): the view query takes at most 1.5x the bare query.

    .venv/bin/python benchmarks/bench_store_query.py [--nodes 1000000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
from _common import Timings, print_timings, timed, verdict

from rollout_store import Store, connect, read_arrow
from rollout_store.store import ROW_GROUP_SIZE
from rollout_store.synthetic import bel_shaped_batch

TARGET = 1.5
NODES_PER_TREE = 47.2  # mean size of a 16-rollout, depth-6 BEL-shaped tree (measured)
AGGREGATE = "SELECT count(*), sum(n_leaves), sum(n_success) FROM {siblings}"
FULL = "SELECT * FROM {siblings}"


def sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def bare_siblings(path: Path, threshold: float = 1.0, key_filter: str = "") -> str:
    """The ``siblings`` view of reader.py, by hand over one file (no commit keys unless
    ``key_filter``, a condition on ``commit_key``, is given)."""
    f = f"read_parquet({sql_str(str(path))})"
    if key_filter:
        f = f"(SELECT * FROM {f} WHERE {key_filter})"
    return f"""(
        WITH kids AS (
            SELECT tree_id, parent_id, node_id, preorder, subtree_size
            FROM {f} WHERE parent_id IS NOT NULL
        ), branching AS (
            SELECT tree_id, parent_id FROM kids GROUP BY tree_id, parent_id
            HAVING count(*) >= 2
        ), leaves AS (
            SELECT tree_id, preorder, reward FROM {f} WHERE reward IS NOT NULL
        )
        SELECT k.tree_id, k.parent_id, k.node_id AS child_id,
               count(*) AS n_leaves,
               count(*) FILTER (WHERE l.reward >= {threshold!r}) AS n_success
        FROM kids k
        SEMI JOIN branching b ON k.tree_id = b.tree_id AND k.parent_id = b.parent_id
        JOIN leaves l ON l.tree_id = k.tree_id
             AND l.preorder >= k.preorder AND l.preorder < k.preorder + k.subtree_size
        GROUP BY k.tree_id, k.parent_id, k.node_id)"""


def run(con: duckdb.DuckDBPyConnection, sql: str, fetch: str) -> object:
    rel = con.sql(sql)
    return rel.fetchall() if fetch == "aggregate" else rel.to_arrow_table()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000_000,
                        help="about this many nodes (trees of ~47 nodes)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions of each side")
    parser.add_argument("--fetch", choices=("aggregate", "arrow"), default="aggregate",
                        help="time the aggregate (default) or the whole view fetched to Arrow")
    args = parser.parse_args()
    sql = AGGREGATE if args.fetch == "aggregate" else FULL

    n_trees = max(1, round(args.nodes / NODES_PER_TREE))
    with tempfile.TemporaryDirectory(prefix="bench-query-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        store = Store(root / "store", create=True)
        batch = bel_shaped_batch(n_trees, rollouts=16, depth=6, seed=0)
        store.append_trees(batch, key="bench-query")
        n_nodes = batch.nodes.num_rows
        del batch
        stored = read_arrow(store, "nodes")
        bare_file, default_file = root / "nodes.parquet", root / "nodes-default.parquet"
        pq.write_table(stored, bare_file, compression="zstd", row_group_size=ROW_GROUP_SIZE)
        pq.write_table(stored, default_file)
        del stored
        print(f"store: {n_trees:,} trees, {n_nodes:,} nodes in one commit; bare files written "
              f"(setup {time.perf_counter() - start:.1f} s, not timed)")

        con = connect(store)
        bare_con = duckdb.connect()
        store_sql = sql.format(siblings="siblings")
        bare_sql = sql.format(siblings=bare_siblings(bare_file))
        default_sql = sql.format(siblings=bare_siblings(default_file))
        trees_files = ", ".join(sql_str(f.path) for f in store.files("trees"))
        semi_sql = sql.format(siblings=bare_siblings(bare_file, key_filter=(
            f"commit_key IN (SELECT DISTINCT commit_key FROM read_parquet([{trees_files}]))")))
        keys = con.sql("SELECT DISTINCT commit_key FROM trees").fetchall()
        literal_sql = sql.format(siblings=bare_siblings(bare_file, key_filter=(
            f"commit_key IN ({', '.join(sql_str(k) for (k,) in keys)})")))

        # Same answer on both sides: the whole view, sorted, and the aggregate.
        order = " ORDER BY tree_id, parent_id, child_id"
        full_store = con.sql(FULL.format(siblings="siblings") + order).to_arrow_table()
        full_bare = bare_con.sql(FULL.format(siblings=bare_siblings(bare_file)) + order
                                 ).to_arrow_table()
        agg_store = con.sql(AGGREGATE.format(siblings="siblings")).fetchall()
        agg_bare = bare_con.sql(AGGREGATE.format(siblings=bare_siblings(bare_file))).fetchall()
        same = full_store.equals(full_bare) and agg_store == agg_bare
        print(f"siblings rows: {full_store.num_rows:,}; aggregate {agg_store[0]}; "
              f"identical results: {same}")
        del full_store, full_bare

        connect_t = Timings("connect(store)")
        store_t = Timings(f"siblings view ({args.fetch})")
        bare_t = Timings("hand SQL, one file (store settings)  [baseline]")
        default_t = Timings("hand SQL, one file (pyarrow defaults)")
        semi_t = Timings("hand SQL + view's commit_key semi-join")
        literal_t = Timings("hand SQL + commit_key IN (literal keys)")
        for _ in range(args.repeat):  # interleaved, so load spikes hit every side
            connect_t.seconds.append(timed(lambda: connect(store)))
            store_t.seconds.append(timed(lambda: run(con, store_sql, args.fetch)))
            bare_t.seconds.append(timed(lambda: run(bare_con, bare_sql, args.fetch)))
            default_t.seconds.append(timed(lambda: run(bare_con, default_sql, args.fetch)))
            semi_t.seconds.append(timed(lambda: run(bare_con, semi_sql, args.fetch)))
            literal_t.seconds.append(timed(lambda: run(bare_con, literal_sql, args.fetch)))
        both = Timings("connect + siblings view",
                       [c + q for c, q in zip(connect_t.seconds, store_t.seconds, strict=True)])
        threads = bare_con.sql("SELECT current_setting('threads')").fetchall()[0][0]
        print(f"DuckDB {duckdb.__version__}, threads {threads}\n")
        print_timings([bare_t, default_t, semi_t, literal_t, store_t, connect_t, both],
                      bare_t)
        con.close()
        bare_con.close()

    ratio = store_t.min / bare_t.min
    print(f"\nratio of medians {store_t.median / bare_t.median:.2f}; identical results: {same}")
    verdict(f"query siblings over {n_nodes:,} nodes, view / hand SQL on one file (min)",
            ratio, ratio <= TARGET and same, f"<= {TARGET:g}x, identical results")


if __name__ == "__main__":
    main()
