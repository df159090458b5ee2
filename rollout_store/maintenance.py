"""Store upkeep: ``info``, full integrity ``verify``, ``compact`` and ``vacuum``.

Compaction is delta-rs ``optimize.compact`` per table: it rewrites small files
into larger ones in a commit that removes the old files and adds the new ones
(``dataChange=false``), so no committed row is lost or duplicated, and it
commits with Delta's optimistic concurrency beside running appenders (an
append only adds files, so the two never conflict). Vacuum deletes files that
no current version references and that are older than a retention window;
the window must cover the longest append in flight (a writer's file exists
before its commit references it) and every reader pinned to an older version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_store.reader import committed_keys, iter_tree_batches, read_arrow
from rollout_store.schema import NODES, SCHEMA_VERSION, TABLE_NAMES
from rollout_store.store import CorruptFileError, Store, check_data_file
from rollout_store.validate import TreeValidationError, validate_nodes

MIN_VACUUM_RETENTION_HOURS = 1


def info(store: Store) -> dict[str, Any]:
    """Tables, versions, row counts (committed rows) and bytes; JSON-serialisable."""
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
            "schema_version": store.table_schema_version[name],
        }
    return {
        "store": str(store.path),
        "schema_version": SCHEMA_VERSION,
        "commits": len(keys),
        "tables": tables,
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
    """Read every committed byte: file sizes, Parquet page checksums, and tree rules.

    Each committed file must exist with its recorded size and read back with
    its page checksums verified; every stored tree must still satisfy the
    rules of ``validate.py``. A problem names the file or the tree and node.
    """
    report = VerifyReport()
    version = store.version()
    for name in TABLE_NAMES:
        for f in store.files(name, version, check=False):
            report.files_checked += 1
            try:
                check_data_file(f.path, f.size)
            except CorruptFileError as exc:
                report.problems.append(str(exc))
    if report.problems:
        return report
    try:
        for batch in iter_tree_batches(store, version):
            validate_nodes(batch, NODES)
            report.trees_checked += len(set(batch.column("tree_id").to_pylist()))
    except TreeValidationError as exc:
        report.problems.append(f"stored tree breaks a rule: {exc}")
    return report


def compact(store: Store, target_size: int | None = None) -> dict[str, Any]:
    """Rewrite each table's small files into large ones; returns delta-rs metrics per table."""
    out: dict[str, Any] = {}
    for name in TABLE_NAMES:
        dt = store.delta_table(name)
        if len(dt.file_uris()) <= 1:
            out[name] = {"numFilesAdded": 0, "numFilesRemoved": 0}
            continue
        metrics = dt.optimize.compact(target_size=target_size)
        out[name] = {k: metrics.get(k) for k in ("numFilesAdded", "numFilesRemoved")}
    return out


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

