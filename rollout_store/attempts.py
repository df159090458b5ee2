"""Attempts of a run: resumed or retried writers, and the rows they supersede (issue 26).

A run (``run_id``) may be written by several attempts: a training run killed and resumed
with ``rtrees train --resume`` is a second attempt, starting again at the iteration of the
checkpoint it resumed from. Each attempt is recorded in ``metrics`` when it starts
(``rollout_store.maintenance.record_attempt``): a row ``name = 'attempt'``,
``step = ATTEMPT_STEP`` (-3, beside the trainer's run-token row at -2), ``value`` = the
first iteration it runs, ``created_at`` = when it started. Attempts of one run never
overlap in time (one trainer per run directory, ``train.trainer.lock_run_dir``), so a
row of the run belongs to the last attempt that started at or before its
``created_at`` (``attempt_rows``; rows written before any attempt was recorded count
as attempt 0).

A resumed attempt replays the iterations after its checkpoint under the same commit keys:
an exact replay (CPU) reproduces what the earlier attempt committed, and the store skips
it as already committed (nothing is superseded). A replay that differs (another device,
another library version) may not reuse the keys: it commits as a retry, under
``retry_key(key, n)`` (``KEY@aN``) with tree ids ``retry_tree_id(tree_id, n)``
(``ID@aN``). The views of ``reader.connect`` then hide what it superseded:

* ``trees_latest`` / ``nodes_latest``: the trees (and their nodes) whose commit key has no
  later retry: among the trees rows of one run whose commit keys share the part before
  ``@a``, those of the highest attempt N (a key without ``@aN`` is attempt 0);
* ``credits_latest``: credits of trees in ``trees_latest``, the last write (by
  ``created_at``) per (run, method, params hash, tree, node);
* ``metrics_latest``: the last write per (run, step, name), every bookkeeping row
  (step <= -2: run token, attempts) kept.

Readers of a run's training metrics (the viewer, ``analysis.table1``, the demo report, the
notebooks, ``train.trainer.read_metrics``) read ``TRAINING_METRICS``: ``metrics_latest``
without the bookkeeping rows, i.e. steps ``>= FIRST_METRIC_STEP`` (-1: the held-out
evaluation of the starting weights; 0, 1, ...: the iterations), through
``training_metrics`` or that SQL relation, never raw ``metrics``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from rollout_store.tree import Tree

if TYPE_CHECKING:
    import duckdb


ATTEMPT_METRIC: Final[str] = "attempt"
ATTEMPT_STEP: Final[int] = -3
RETRY_MARK: Final[str] = "@a"
_RETRY_RE = RETRY_MARK + "[0-9]+$"
FIRST_METRIC_STEP: Final[int] = -1
"""The first step of a run's own metrics (the starting weights' held-out evaluation);
steps below it are bookkeeping (-2: the trainer's run token, -3: attempts)."""
TRAINING_METRICS: Final[str] = (
    f"(SELECT * FROM metrics_latest WHERE step >= {FIRST_METRIC_STEP})")
"""SQL relation over a ``reader.connect`` connection: the metrics rows a reader of training
metrics sees (latest write per (run, step, name), no bookkeeping rows)."""


def retry_key(key: str, attempt: int) -> str:
    """The commit key attempt ``attempt`` (>= 2) commits a differing replay under."""
    if attempt < 2:
        raise ValueError(f"a retry is attempt 2 or later, not {attempt}")
    return f"{key}{RETRY_MARK}{attempt}"


def retry_tree_id(tree_id: str, attempt: int) -> str:
    """The id a tree re-sampled by attempt ``attempt`` is stored under (ids are unique)."""
    return retry_key(tree_id, attempt)


def as_retry(trees: Sequence[Tree], attempt: int) -> list[Tree]:
    """Copies of ``trees`` under their retry ids (``retry_tree_id``), nothing else changed."""
    return [dataclasses.replace(t, tree_id=retry_tree_id(t.tree_id, attempt)) for t in trees]


def create_views(con: duckdb.DuckDBPyConnection) -> None:
    """Create ``trees_latest``, ``nodes_latest``, ``credits_latest``, ``metrics_latest`` and
    ``attempts`` over a connection that has the store's table views (module docstring)."""
    con.execute(f"""
        CREATE OR REPLACE VIEW trees_latest AS
        SELECT * EXCLUDE (_slot, _attempt, _last) FROM (
            SELECT *, max(_attempt) OVER (PARTITION BY run_id, _slot) AS _last FROM (
                SELECT *, regexp_replace(commit_key, '{_RETRY_RE}', '') AS _slot,
                       coalesce(TRY_CAST(regexp_extract(commit_key, '{RETRY_MARK}([0-9]+)$',
                                                        1) AS INTEGER), 0) AS _attempt
                FROM trees))
        WHERE _attempt = _last""")
    con.execute("""
        CREATE OR REPLACE VIEW nodes_latest AS
        SELECT n.* FROM nodes n SEMI JOIN trees_latest t ON n.tree_id = t.tree_id""")
    con.execute("""
        CREATE OR REPLACE VIEW credits_latest AS
        SELECT * EXCLUDE (_rank) FROM (
            SELECT c.*, row_number() OVER (
                PARTITION BY run_id, method, method_params_hash, tree_id, node_id
                ORDER BY created_at DESC) AS _rank
            FROM credits c SEMI JOIN trees_latest t ON c.tree_id = t.tree_id)
        WHERE _rank = 1""")
    con.execute("""
        CREATE OR REPLACE VIEW metrics_latest AS
        SELECT * EXCLUDE (_rank) FROM (
            SELECT *, row_number() OVER (PARTITION BY run_id, step, name
                                         ORDER BY created_at DESC) AS _rank
            FROM metrics)
        WHERE _rank = 1 OR step <= -2""")
    con.execute(f"""
        CREATE OR REPLACE VIEW attempts AS
        SELECT run_id, row_number() OVER (PARTITION BY run_id ORDER BY created_at)::INTEGER
                   AS attempt,
               value::BIGINT AS start_iteration, created_at AS started_at
        FROM metrics WHERE name = '{ATTEMPT_METRIC}' AND step = {ATTEMPT_STEP}""")


def attempt_rows(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Per recorded attempt of every run: its number, first iteration, start time and the
    rows of ``trees``, ``credits`` and ``metrics`` it wrote (created in its time span), each
    with how many of them a later attempt superseded (absent from the ``*_latest`` view).
    Rows of such a run written before its first recorded attempt are attempt 0."""
    parts = []
    for table in ("trees", "credits", "metrics"):
        parts.append(f"""
            SELECT '{table}' AS tab, x.run_id, coalesce(a.attempt, 0) AS attempt,
                   count(*) AS n_rows, count(*) FILTER (WHERE l._hit IS NULL) AS superseded
            FROM (SELECT * FROM {table} WHERE run_id IN (SELECT run_id FROM attempts)) x
            ASOF LEFT JOIN attempts a ON x.run_id = a.run_id AND x.created_at >= a.started_at
            LEFT JOIN (SELECT DISTINCT {", ".join(_identity(table))}, true AS _hit
                       FROM {table}_latest) l
                 ON {" AND ".join(f"x.{c} = l.{c}" for c in _identity(table))}
            GROUP BY ALL""")
    counts = con.execute(" UNION ALL ".join(parts)).fetchall()
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for run_id, attempt, start, started in con.execute(
            "SELECT run_id, attempt, start_iteration, started_at FROM attempts "
            "ORDER BY run_id, attempt").fetchall():
        found[(run_id, attempt)] = {"run_id": run_id, "attempt": attempt,
                                    "start_iteration": start, "started_at": str(started)}
    for table, run_id, attempt, n_rows, superseded in counts:
        entry = found.setdefault((run_id, attempt), {
            "run_id": run_id, "attempt": attempt, "start_iteration": None, "started_at": None})
        entry[table] = {"rows": int(n_rows), "superseded": int(superseded)}
    out = []
    for key in sorted(found):
        entry = found[key]
        for table in ("trees", "credits", "metrics"):
            entry.setdefault(table, {"rows": 0, "superseded": 0})
        out.append(entry)
    return out


def training_metrics(con: duckdb.DuckDBPyConnection, run_id: str
                     ) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` of one run, steps ascending, from
    ``TRAINING_METRICS``: one value per (step, name), the last an attempt wrote, and no
    bookkeeping rows (step < ``FIRST_METRIC_STEP``)."""
    rows = con.execute(f"SELECT name, step, value FROM {TRAINING_METRICS} WHERE run_id = $r "
                       "ORDER BY name, step", {"r": run_id}).fetchall()
    out: dict[str, list[tuple[int, float]]] = {}
    for name, step, value in rows:
        out.setdefault(str(name), []).append((int(step), float(value)))
    return out


def _identity(table: str) -> list[str]:
    """Columns (never null) that name one row of ``table`` in its ``*_latest`` view."""
    return {"trees": ["tree_id", "commit_key"],
            "credits": ["run_id", "method", "method_params_hash", "tree_id", "node_id",
                        "created_at"],
            "metrics": ["run_id", "step", "name", "created_at"]}[table]


__all__ = ["ATTEMPT_METRIC", "ATTEMPT_STEP", "FIRST_METRIC_STEP", "RETRY_MARK",
           "TRAINING_METRICS", "as_retry", "attempt_rows", "create_views", "retry_key",
           "retry_tree_id", "training_metrics"]
