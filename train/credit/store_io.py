"""Credit for stored trees: ``rtrees credit`` (issue 4).

``compute_credits`` finds every stored tree that has no credit yet for
(method, params hash), streams those trees out of DuckDB ordered by task (so a
prompt-level group such as Tree-GRPO's never straddles two batches), runs the
vectorised estimator on each batch and commits one ``credits`` row per node.
Commits are keyed by method, params hash and the batch's trees, and trees that
already have credit are skipped, so running the command twice changes nothing
and an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.progress import Progress

from rollout_store.reader import connect
from rollout_store.schema import CREDITS, NODE_INPUT
from rollout_store.store import Store, now_utc
from train.credit import ESTIMATORS
from train.credit.base import Credit, TreeArrays, from_tables

_NODE_COLUMNS = [*NODE_INPUT.names, "depth", "preorder", "subtree_size"]
_TREE_COLUMNS = ["tree_id", "task_id", "critical_node_id", "policy_version"]


class CreditError(RuntimeError):
    """The method, its parameters or the stored trees do not allow computing credit."""


@dataclass
class CreditRunReport:
    method: str
    params_hash: str
    trees_done: int = 0
    trees_skipped: int = 0
    rows: int = 0
    commits: int = 0

    def summary(self) -> str:
        return (f"{self.method} [{self.params_hash}]: credit for {self.trees_done} trees "
                f"({self.rows} rows, {self.commits} commits); {self.trees_skipped} trees "
                "already had it")


def _batches(store: Store, method: str, params_hash: str, max_nodes: int
             ) -> Iterator[tuple[pa.Table, pa.Table]]:
    """(trees rows, nodes rows) of trees lacking credit, whole tasks per batch."""
    con = connect(store)
    con.execute(f"""
        CREATE TEMP TABLE todo AS
        SELECT {", ".join(_TREE_COLUMNS)} FROM trees
        WHERE tree_id NOT IN (SELECT DISTINCT tree_id FROM credits
                              WHERE method = $m AND method_params_hash = $h)
        ORDER BY task_id, tree_id""", {"m": method, "h": params_hash})
    todo = con.sql("SELECT * FROM todo").to_arrow_table()
    if todo.num_rows == 0:
        return
    cols = ", ".join(f"n.{c}" for c in _NODE_COLUMNS)
    reader = con.sql(f"""
        SELECT {cols}, t.task_id AS _task FROM nodes n JOIN todo t USING (tree_id)
        ORDER BY t.task_id, n.tree_id, n.preorder""").to_arrow_reader(65_536)
    pending: list[pa.RecordBatch] = []
    n_pending = 0
    for batch in reader:
        pending.append(batch)
        n_pending += batch.num_rows
        if n_pending >= max_nodes:
            table = pa.Table.from_batches(pending)
            tasks = table.column("_task")
            last = tasks[-1]
            done_mask = pc.not_equal(tasks, last)  # the last task may continue
            ready, rest = table.filter(done_mask), table.filter(pc.invert(done_mask))
            pending, n_pending = rest.to_batches(), rest.num_rows
            if ready.num_rows:
                yield _with_trees(todo, ready)
    if pending:
        yield _with_trees(todo, pa.Table.from_batches(pending))


def _with_trees(todo: pa.Table, nodes: pa.Table) -> tuple[pa.Table, pa.Table]:
    ids = pc.unique(nodes.column("tree_id"))
    trees = todo.filter(pc.is_in(todo.column("tree_id"), value_set=ids))
    return trees, nodes.drop_columns(["_task"])


def stored_extras(nodes: pa.Table) -> dict[str, np.ndarray]:
    """Estimator inputs that samplers record in node ``meta`` (rows follow ``nodes``).

    ``caliper_y0``: the CALIPER sampler marks the original failed suffix y_0 of
    each local group (``{"caliper_y0": true}``); without it the estimator
    falls back to guessing y_0 by shared prefix.
    """
    meta = pc.fill_null(nodes.column("meta"), "")
    y0 = pc.match_substring(meta, '"caliper_y0": true')
    return {"caliper_y0": np.asarray(y0.to_numpy(zero_copy_only=False), dtype=bool)}


def credit_rows(batch: TreeArrays, credit: Credit, trees: pa.Table, method: str,
                params_json: str, params_hash: str, run_id: str) -> pa.Table:
    """One ``credits`` row per node: ``value`` = node credit, ``token_values`` = the
    advantages of its action tokens (the agent tokens, in order)."""
    versions = dict(zip(trees.column("tree_id").to_pylist(),
                        trees.column("policy_version").to_pylist(), strict=True))
    tree_names = [batch.tree_ids[b] for b in batch.node_tree]
    values = np.asarray(credit.node, dtype=np.float64)
    if not np.isfinite(np.nan_to_num(values, nan=0.0)).all():
        raise CreditError(f"{method} produced inf credit")
    # Per-node action-token advantages: agent tokens are the first tokens of each node.
    n_agent = np.bincount(batch.token_node[batch.agent_mask], minlength=batch.n_nodes)
    token_vals = credit.token[batch.agent_mask].astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(n_agent)]).astype(np.int32)
    now = now_utc()
    n = batch.n_nodes
    return pa.table({
        "run_id": pa.array([run_id] * n, pa.string()),
        "method": pa.array([method] * n, pa.string()),
        "method_params_hash": pa.array([params_hash] * n, pa.string()),
        "method_params": pa.array([params_json] * n, pa.string()),
        "tree_id": pa.array(tree_names, pa.string()),
        "node_id": pa.array(batch.node_ids, pa.int64()),
        # Nodes without credit (the root, a non-leaf some methods leave undefined) store 0.
        "value": pa.array(np.nan_to_num(values, nan=0.0), pa.float64()),
        "token_values": pa.ListArray.from_arrays(pa.array(offsets), pa.array(token_vals)),
        "policy_version": pa.array([versions.get(t) for t in tree_names], pa.string()),
        "created_at": pa.array([now] * n, CREDITS.field("created_at").type),
    }, schema=CREDITS)


def compute_credits(store: Store, method: str, params: dict[str, str] | None = None,
                    run_id: str | None = None, max_nodes: int = 200_000,
                    progress: bool = True) -> CreditRunReport:
    """Compute and commit ``method`` credit for every stored tree that lacks it."""
    if method not in ESTIMATORS:
        raise CreditError(f"unknown method {method!r}; choose from {sorted(ESTIMATORS)}")
    estimator = ESTIMATORS[method]
    try:
        p: Any = estimator.parse_params(params or {})
    except (ValueError, TypeError) as exc:
        raise CreditError(str(exc)) from exc
    params_hash, params_json = p.params_hash(), p.to_json()
    run_id = run_id or f"credit-{method}-{params_hash}"
    report = CreditRunReport(method, params_hash)
    con = connect(store)
    total = con.sql("SELECT count(*) FROM trees").fetchall()[0][0]
    done_before = con.execute(
        "SELECT count(DISTINCT tree_id) FROM credits WHERE method = $m AND "
        "method_params_hash = $h", {"m": method, "h": params_hash}).fetchall()[0][0]
    report.trees_skipped = int(done_before)
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"credit {method}", total=max(total - done_before, 0))
        for trees, nodes in _batches(store, method, params_hash, max_nodes):
            batch = from_tables(trees, nodes, stored_extras(nodes))
            try:
                credit = estimator(batch, p)
            except KeyError as exc:
                raise CreditError(f"{method} needs input {exc} that stored trees do not "
                                  "carry (see the estimator's docstring)") from exc
            rows = credit_rows(batch, credit, trees, method, params_json, params_hash, run_id)
            ids = trees.column("tree_id").to_pylist()
            digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]
            store.append_credits(rows, key=f"credit:{method}:{params_hash}:{digest}")
            report.trees_done += len(ids)
            report.rows += rows.num_rows
            report.commits += 1
            bar.advance(task, len(ids))
    return report
