"""The store tour behind ``rtrees store demo``: write, compact, query, validate (no policy
needed).

Synthetic BEL-shaped trees (``rollout_store.synthetic``) are appended in several
idempotent commits, the store is compacted, queried through the DuckDB views
(``siblings`` joined to ``nodes``) and fully verified. A rerun with the same seed
reuses what is stored (every commit key is already present). It exercises the store
alone; the main job (``make demo`` = ``rtrees demo``: a tiny policy, collection, credit,
the ranking audit, training with reuse) is ``train.demo.run_demo_job``.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rollout_store.maintenance import compact, info, verify
from rollout_store.reader import connect
from rollout_store.store import Store
from rollout_store.synthetic import bel_shaped_batch

_COMMIT_TREES = 250


def run_demo(path: Path, n_trees: int = 2000, seed: int = 0,
             console: Console | None = None) -> dict[str, object]:
    """Write ``n_trees`` synthetic trees to ``path`` and report on them; returns the summary.
    ``n_trees < 1`` is a ``ValueError`` raised before the store is created."""
    if n_trees < 1:
        raise ValueError(f"trees must be >= 1, got {n_trees}")
    console = console or Console()
    store = Store(path, create=True)
    n_commits = -(-n_trees // _COMMIT_TREES)
    written = skipped = 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("appending trees", total=n_commits)
        for i in range(n_commits):
            size = min(_COMMIT_TREES, n_trees - i * _COMMIT_TREES)
            key = f"demo:{seed}:{i}:{size}"
            if store.delta_table("trees").transaction_version(key) is not None:
                skipped += 1
            else:
                batch = bel_shaped_batch(size, seed=seed * 100_003 + i, snapshot_bytes=64,
                                         tree_prefix=f"demo-{i}")
                store.append_trees(batch, key=key)
                written += 1
            progress.advance(task)
    console.print(f"appended {written} commits, {skipped} already stored")
    compact(store)
    con = connect(store)
    summary = info(store)
    table = Table(title=f"store {store.path}")
    for col in ("table", "rows", "files", "bytes"):
        table.add_column(col, justify="left" if col == "table" else "right")
    for name, t in summary["tables"].items():
        table.add_row(name, f"{t['rows']:,}", str(t["files"]), f"{t['bytes']:,}")
    console.print(table)
    query = """
        SELECT n.depth AS branch_depth, count(*) AS children,
               round(avg(s.n_success::DOUBLE / s.n_leaves), 3) AS mean_success
        FROM siblings s JOIN nodes n ON n.tree_id = s.tree_id AND n.node_id = s.parent_id
        GROUP BY n.depth ORDER BY n.depth"""
    rows = con.sql(query).fetchall()
    q = Table(title="siblings by depth of the branching node")
    for col in ("branch depth", "children", "mean success below child"):
        q.add_column(col, justify="right")
    for r in rows:
        q.add_row(*(str(v) for v in r))
    console.print(q)
    report = verify(store)
    status = "ok" if report.ok else "PROBLEMS: " + "; ".join(report.problems)
    console.print(f"validate: {status} ({report.files_checked} files, "
                  f"{report.trees_checked} trees)")
    console.print(f"try: rtrees sql --store {path} \"SELECT * FROM paths LIMIT 5\"")
    return {"info": summary, "ok": report.ok, "written": written, "skipped": skipped}
