"""The ``siblings`` view at large fan-out: the running-count view against the range join.

One tree whose root has N leaf children (the worst case of a wide branching node). The
range join it replaced joined every child with every leaf of its tree and filtered on
the preorder interval: quadratic in fan-out (issue 13 measured 131 s at 200k). Both
views are timed on the same store, alternately; the old one only up to ``--old-max``.

    .venv/bin/python -m benchmarks.bench_store_siblings [--sizes 10000,25000,50000,200000]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import duckdb

from benchmarks._common import print_table, timed
from rollout_store import Store, connect
from rollout_store.synthetic import wide_batch

OLD_VIEW = """
    CREATE OR REPLACE VIEW siblings_old AS
    WITH kids AS (
        SELECT tree_id, parent_id, node_id, preorder, subtree_size, reward
        FROM nodes WHERE parent_id IS NOT NULL
    ), branching AS (
        SELECT tree_id, parent_id FROM kids GROUP BY tree_id, parent_id HAVING count(*) >= 2
    ), leaves AS (
        SELECT tree_id, preorder, reward FROM nodes WHERE reward IS NOT NULL
    )
    SELECT k.tree_id, k.parent_id, k.node_id AS child_id, count(*) AS n_leaves,
           count(*) FILTER (WHERE l.reward >= 1.0) AS n_success
    FROM kids k
    SEMI JOIN branching b ON k.tree_id = b.tree_id AND k.parent_id = b.parent_id
    JOIN leaves l ON l.tree_id = k.tree_id
         AND l.preorder >= k.preorder AND l.preorder < k.preorder + k.subtree_size
    GROUP BY k.tree_id, k.parent_id, k.node_id"""


def _times(con: duckdb.DuckDBPyConnection, query: str, repeat: int) -> list[float]:
    return [timed(lambda: con.sql(query).fetchall()) for _ in range(repeat)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,25000,50000,200000")
    parser.add_argument("--old-max", type=int, default=50_000,
                        help="largest fan-out the quadratic view is timed at")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(x) for x in args.sizes.split(",")):
            store = Store(Path(tmp) / f"s{size}", create=True)
            store.append_trees(wide_batch(size), key="wide")
            con = connect(store)
            con.execute(OLD_VIEW)
            q = "SELECT count(*), sum(n_leaves), sum(n_success) FROM {}"
            new = _times(con, q.format("siblings"), args.repeat)
            old: list[float] = []
            if size <= args.old_max:
                assert (con.sql(q.format("siblings")).fetchall()
                        == con.sql(q.format("siblings_old")).fetchall())
                old = _times(con, q.format("siblings_old"), args.repeat)
            rows.append([f"{size:,}", f"{min(new):.3f}",
                         f"{min(old):.3f}" if old else "(not run)",
                         f"{min(old) / min(new):.0f}x" if old else ""])
    print_table(["children", "running-count view s (min)", "range-join view s (min)",
                 "speed-up"], rows)


if __name__ == "__main__":
    main()
