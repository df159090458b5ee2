"""Store upkeep: ``info``, full integrity ``verify``, ``compact`` and ``vacuum``.

Compaction (``compact``) is ours rather than delta-rs ``optimize``: delta-rs
would merge the invisible rows of a dead append into a file with committed
rows and write files without our page checksums. delta-rs also accepted (we
measured) a commit removing files that another commit had already removed, so
concurrent compactors are serialised by a lock file. Vacuum deletes files that
no current version references and that are older than a retention window;
the window must cover the longest append in flight (a writer's file exists
before its commit references it) and every reader pinned to an older version.

On object storage (``s3://``) the compaction lock is a lease lock object (see
``objectstore.py``), checked once more right before each merge commits; ``verify``
fetches each committed file once and runs its checks on the local copy.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.transaction import AddAction, CommitProperties, RemoveAction

from rollout_store.attempts import ATTEMPT_METRIC, ATTEMPT_STEP, attempt_rows
from rollout_store.deltalog import fsync_commit, log_problems
from rollout_store.objectstore import Lease
from rollout_store.reader import (
    committed_keys,
    connect,
    iter_tree_batches,
    read_arrow,
    visible_files,
)
from rollout_store.schema import (
    NODES,
    SCHEMA_VERSION,
    SCHEMAS,
    TABLE_NAMES,
    TableName,
    metrics_table,
)
from rollout_store.store import (
    COMPACTED_PREFIX,
    CorruptFileError,
    DataFile,
    Store,
    StoreError,
    StoreVersion,
    check_data_file,
    now_utc,
)
from rollout_store.validate import TreeValidationError, validate_nodes

MIN_VACUUM_RETENTION_HOURS = 1


def info(store: Store) -> dict[str, Any]:
    """Tables, versions, row counts (committed rows) and bytes, and the rows each recorded
    attempt of a run wrote and how many of them later attempts superseded
    (``attempts.attempt_rows``); JSON-serialisable."""
    version = store.version()
    keys = committed_keys(store, version)
    tables: dict[str, Any] = {}
    for name in TABLE_NAMES:
        files = store.files(name, version)
        if name in ("nodes", "snapshots"):
            rows = read_arrow(store, name, version, columns=["commit_key"]).num_rows
            stored = sum(f.num_records or 0 for f in files)
        else:
            rows = stored = sum(f.num_records or 0 for f in files)
        tables[name] = {
            "version": version[name],
            "rows": rows,
            "uncommitted_rows": stored - rows,
            "files": len(files),
            "bytes": sum(f.size for f in files),
            "schema_version": store.schema_version_of(name),
        }
    return {
        "store": str(store.path),
        "schema_version": SCHEMA_VERSION,
        "commits": len(keys),
        "tables": tables,
        "attempts": attempt_rows(connect(store, version)),
    }


@dataclass
class VerifyReport:
    """Problems found by ``verify``; empty ``problems`` means the store is sound."""

    files_checked: int = 0
    trees_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(store: Store) -> VerifyReport:
    """Read every committed byte: logs, file sizes, page checksums, links and tree rules.

    Each table's Delta log must read cleanly (``deltalog.log_problems``); each
    committed file must exist with its recorded size, read back with its page
    checksums verified, and be readable by DuckDB too (a damaged footer can pass
    pyarrow); tree ids must be unique; every ``trees`` row must have exactly its
    ``n_nodes`` visible nodes and a ``critical_node_id`` (when set) among them;
    every snapshot a node names must be stored for the same tree; every credit and
    reference must name a stored node; and every stored tree must still satisfy the
    rules of ``validate.py``. A problem names the file, or the tree and node.
    """
    report = VerifyReport()
    for name in TABLE_NAMES:
        report.problems += [f"table {name!r}: damaged Delta log: {p}"
                            for p in log_problems(store.loc.table_uri(name),
                                                  store.loc.filesystem)]
    if report.problems:
        return report
    version = store.version()
    for name in TABLE_NAMES:
        for f in store.files(name, version, check=False):
            report.files_checked += 1
            try:
                _check_file(store, f)
            except CorruptFileError as exc:
                report.problems.append(str(exc))
    if report.problems:
        return report
    report.problems += _link_problems(store, version)
    if report.problems:
        return report
    try:
        for batch in iter_tree_batches(store, version):
            validate_nodes(batch, NODES)
            report.trees_checked += len(set(batch.column("tree_id").to_pylist()))
    except TreeValidationError as exc:
        report.problems.append(f"stored tree breaks a rule: {exc}")
    except StoreError as exc:
        report.problems.append(str(exc))
    return report


_MAX_LISTED = 5  # problems of one kind listed by name; the rest are counted


def _check_file(store: Store, f: DataFile) -> None:
    """``check_data_file`` and ``_check_duckdb_reads`` of one committed file; a file on
    object storage is fetched once and both checks read the local copy."""
    if not store.loc.remote:
        check_data_file(f.path, f.size)
        _check_duckdb_reads(f.path)
        return
    actual = store.loc.size(f.path)
    if actual is None:
        raise CorruptFileError(f.path, "committed data file is missing")
    if actual != f.size:
        raise CorruptFileError(f.path, f"{actual} bytes, the commit recorded {f.size} "
                               "(truncated?)")
    with store.loc.local_copy(f.path) as local:
        try:
            check_data_file(local, f.size)
            _check_duckdb_reads(local)
        except CorruptFileError as exc:
            detail = str(exc).removeprefix(f"{local}: ").replace(local, f.path)
            raise CorruptFileError(f.path, detail) from None


def _check_duckdb_reads(path: str) -> None:
    """Raise ``CorruptFileError`` unless DuckDB reads every row of ``path``."""
    import duckdb

    con = duckdb.connect()
    try:
        con.sql("SELECT * FROM read_parquet(" + "'" + path.replace("'", "''") + "')"
                ).to_arrow_table()
    except duckdb.Error as exc:
        raise CorruptFileError(path, f"DuckDB cannot read it: {str(exc).splitlines()[0]}"
                               ) from None
    finally:
        con.close()


def _listed(what: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return [f"{what}: {', '.join(items[:_MAX_LISTED])}{more}"]


def _link_problems(store: Store, version: StoreVersion) -> list[str]:
    """Cross-table checks: unique trees, node counts, snapshots, credits, references."""
    trees = read_arrow(store, "trees", version,
                       ["tree_id", "n_nodes", "critical_node_id", "commit_key"])
    nodes = read_arrow(store, "nodes", version, ["tree_id", "node_id", "snapshot_id"])
    snaps = read_arrow(store, "snapshots", version, ["snapshot_id", "tree_id"])
    out: list[str] = []
    counts = pc.value_counts(trees.column("tree_id")).to_pylist()
    twice = {c["values"] for c in counts if c["counts"] > 1}
    holders: dict[str, list[str]] = {}  # the commit keys of each duplicate (issue 21)
    for tid, key in zip(trees.column("tree_id").to_pylist(),
                        trees.column("commit_key").to_pylist(), strict=True):
        if tid in twice:
            holders.setdefault(tid, []).append(key)
    out += _listed("tree ids stored more than once",
                   [f"{t!r} x{len(keys)} (commit keys {', '.join(map(repr, sorted(keys)))})"
                    for t, keys in holders.items()])
    have = pc.value_counts(nodes.column("tree_id")).to_pylist()
    n_have = {c["values"]: c["counts"] for c in have}
    expected = dict(zip(trees.column("tree_id").to_pylist(),
                        trees.column("n_nodes").to_pylist(), strict=True))
    out += _listed("trees whose nodes are missing or extra (n_nodes vs visible nodes)",
                   [f"{t!r} {n} vs {n_have.get(t, 0)}" for t, n in expected.items()
                    if n_have.get(t, 0) != n])
    out += _listed("nodes of trees that have no trees row",
                   [repr(t) for t in n_have if t not in expected])
    node_keys = {(t, n) for t, n in zip(nodes.column("tree_id").to_pylist(),
                                        nodes.column("node_id").to_pylist(), strict=True)}
    crit = [(t, c) for t, c in zip(trees.column("tree_id").to_pylist(),
                                   trees.column("critical_node_id").to_pylist(), strict=True)
            if c is not None and (t, c) not in node_keys]
    out += _listed("critical_node_id is not a node of its tree",
                   [f"tree {t!r} node {c}" for t, c in crit])
    snap_pairs = set(zip(snaps.column("snapshot_id").to_pylist(),
                         snaps.column("tree_id").to_pylist(), strict=True))
    snap_ids = {sid for sid, _ in snap_pairs}
    bad_snap = []
    for t, n, sid in zip(nodes.column("tree_id").to_pylist(), nodes.column("node_id").to_pylist(),
                         nodes.column("snapshot_id").to_pylist(), strict=True):
        if sid is not None and (sid, t) not in snap_pairs:
            where = "of another tree" if sid in snap_ids else "missing"
            bad_snap.append(f"tree {t!r} node {n} -> {sid!r} ({where})")
    out += _listed("nodes whose snapshot is missing or belongs to another tree", bad_snap)
    for name in ("credits", "mc_references"):
        rows = read_arrow(store, name, version, ["tree_id", "node_id"])
        dangling = sorted({(t, n) for t, n in zip(rows.column("tree_id").to_pylist(),
                                                  rows.column("node_id").to_pylist(),
                                                  strict=True)} - node_keys)
        out += _listed(f"{name} rows naming a node that is not stored",
                       [f"tree {t!r} node {n}" for t, n in dangling])
    return out


def compact(store: Store, target_size: int | None = None) -> dict[str, dict[str, int]]:
    """Rewrite each table's small committed files into ``compact-*`` files.

    Only files whose rows are all committed are merged (a single-key file whose
    key is in ``trees``, or an earlier ``compact-*`` file): files of appends in
    flight are left alone, so a later commit point never finds its rows gone,
    and every compacted file holds committed rows only (readers read it without
    a row filter). Inputs are grouped up to ``target_size`` bytes (default
    ``TARGET_FILE_BYTES``) and streamed batch by batch, so memory stays bounded.
    Each group commits one Delta transaction that removes the inputs and adds
    the output (``dataChange=false``). An exclusive lock file serialises
    compactors, and the inputs are checked to be still live just before the
    commit; appenders never conflict with it. Returns files removed and added
    per table.
    """
    target = target_size or TARGET_FILE_BYTES
    out: dict[str, dict[str, int]] = {}
    with store.loc.lock(".compact.lock", "w") as lease:
        keys = committed_keys(store, store.version())
        for name in TABLE_NAMES:
            out[name] = {"numFilesRemoved": 0, "numFilesAdded": 0}
            store_version = store.version()
            visible = visible_files(store, name, store_version, keys)
            small = [f for f in visible.whole if f.size < target]
            for group in _groups(small, target):
                _merge(store, name, group, lease)
                out[name]["numFilesRemoved"] += len(group)
                out[name]["numFilesAdded"] += 1
    return out


TARGET_FILE_BYTES = 256 * 1024 * 1024


def _groups(files: list[DataFile], target: int) -> list[list[DataFile]]:
    """Consecutive groups of at least two files, each up to ``target`` bytes."""
    groups: list[list[DataFile]] = []
    current: list[DataFile] = []
    size = 0
    for f in files:
        if current and size + f.size > target:
            groups.append(current)
            current, size = [], 0
        current.append(f)
        size += f.size
    groups.append(current)
    return [g for g in groups if len(g) >= 2]


def _merge(store: Store, name: TableName, group: list[DataFile], lease: Lease) -> None:
    def batches() -> Iterator[pa.RecordBatch]:
        for f in group:
            parquet = store.loc.parquet_file(f.path, page_checksum_verification=True)
            yield from parquet.iter_batches(batch_size=65_536, use_threads=False)

    rel, size, stats = store.write_data_file(name, batches(), prefix=COMPACTED_PREFIX)
    dt = store.delta_table(name)
    live = {f.path for f in store.files(name, check=False)}
    gone = [f.path for f in group if f.path not in live]
    if gone:  # another process removed an input meanwhile: drop our output, keep theirs
        store.loc.delete(str(store.path / name / rel))
        raise StoreError(f"compaction of {name!r} raced with another: {gone[0]} is gone")
    now = int(time.time() * 1000)
    root = str(store.path / name) + os.sep
    actions: list[AddAction | RemoveAction] = [
        RemoveAction(f.path.removeprefix(root), False, now, f.size, {}) for f in group]
    actions.append(AddAction(rel, size, {}, now, False, stats))
    before = dt.version()
    lease.check()  # on object storage: the compaction lock is still ours
    dt.create_write_transaction(
        actions, mode="append", schema=SCHEMAS[name],
        commit_properties=CommitProperties(
            custom_metadata={"rollout_trees.operation": "compact"}, max_commit_retries=100),
    )
    if not store.loc.remote:
        fsync_commit(store.loc.table_uri(name), before, store.delta_table(name).version())


def vacuum(store: Store, retention_hours: int = 168, dry_run: bool = False) -> list[str]:
    """Delete unreferenced files older than ``retention_hours``; returns their paths.

    Refuses a window under ``MIN_VACUUM_RETENTION_HOURS``: an append in flight
    has written its file but not yet committed it, and vacuum would delete it.
    """
    if retention_hours < MIN_VACUUM_RETENTION_HOURS:
        raise ValueError(
            f"retention_hours={retention_hours} is below {MIN_VACUUM_RETENTION_HOURS}: "
            "files of appends still in flight (and of pinned readers) could be deleted"
        )
    removed: list[str] = []
    for name in TABLE_NAMES:
        dt = store.delta_table(name)
        removed += [f"{name}/{p}" for p in dt.vacuum(
            retention_hours=retention_hours, dry_run=dry_run, enforce_retention_duration=False
        )]
    return removed


def record_attempt(store: Store, run_id: str, start_iteration: int,
                   started_at: datetime | None = None) -> int:
    """Record that an attempt of ``run_id`` starts now at ``start_iteration``; returns its
    number (1 for the first recorded attempt of the run; ``rollout_store.attempts``)."""
    rows = read_arrow(store, "metrics", columns=["run_id", "step", "name"])
    prior = sum(1 for r, s, n in zip(rows.column("run_id").to_pylist(),
                                     rows.column("step").to_pylist(),
                                     rows.column("name").to_pylist(), strict=True)
                if r == run_id and s == ATTEMPT_STEP and n == ATTEMPT_METRIC)
    store.append_metrics(metrics_table(run_id, ATTEMPT_STEP,
                                       {ATTEMPT_METRIC: float(start_iteration)},
                                       started_at or now_utc()),
                         key=f"{run_id}:attempt:{uuid.uuid4().hex}")
    return prior + 1


