"""Store upkeep: ``info``, full integrity ``verify``, ``compact`` and ``vacuum``.

Compaction (``compact``) is ours rather than delta-rs ``optimize``: delta-rs
would merge the invisible rows of a dead append into a file with committed
rows and write files without our page checksums. delta-rs also accepted (we
measured) a commit removing files that another commit had already removed, so
concurrent compactors are serialised by a lock file. Vacuum deletes files that
no current version references and that are older than a retention window;
the window must cover the longest append in flight (a writer's file exists
before its commit references it) and every reader pinned to an older version.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake.transaction import AddAction, CommitProperties, RemoveAction

from rollout_store.reader import committed_keys, iter_tree_batches, read_arrow, visible_files
from rollout_store.schema import NODES, SCHEMA_VERSION, SCHEMAS, TABLE_NAMES, TableName
from rollout_store.store import (
    COMPACTED_PREFIX,
    CorruptFileError,
    DataFile,
    Store,
    StoreError,
    check_data_file,
)
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
    with _exclusive(store.path / ".compact.lock"):
        keys = committed_keys(store, store.version())
        for name in TABLE_NAMES:
            out[name] = {"numFilesRemoved": 0, "numFilesAdded": 0}
            store_version = store.version()
            visible = visible_files(store, name, store_version, keys)
            small = [f for f in visible.whole if f.size < target]
            for group in _groups(small, target):
                _merge(store, name, group)
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


def _merge(store: Store, name: TableName, group: list[DataFile]) -> None:
    def batches() -> Iterator[pa.RecordBatch]:
        for f in group:
            parquet = pq.ParquetFile(f.path, page_checksum_verification=True)
            yield from parquet.iter_batches(batch_size=65_536, use_threads=False)

    rel, size, stats = store.write_data_file(name, batches(), prefix=COMPACTED_PREFIX)
    dt = store.delta_table(name)
    live = {f.path for f in store.files(name, check=False)}
    gone = [f.path for f in group if f.path not in live]
    if gone:  # another process removed an input meanwhile: drop our output, keep theirs
        (store.path / name / rel).unlink()
        raise StoreError(f"compaction of {name!r} raced with another: {gone[0]} is gone")
    now = int(time.time() * 1000)
    root = str(store.path / name) + os.sep
    actions: list[AddAction | RemoveAction] = [
        RemoveAction(f.path.removeprefix(root), False, now, f.size, {}) for f in group]
    actions.append(AddAction(rel, size, {}, now, False, stats))
    dt.create_write_transaction(
        actions, mode="append", schema=SCHEMAS[name],
        commit_properties=CommitProperties(
            custom_metadata={"rollout_trees.operation": "compact"}, max_commit_retries=100),
    )


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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

