"""A store: one directory of Delta Lake tables (delta-rs) with atomic, idempotent appends.

Layout: ``<store>/<table>/`` is a Delta table for each name in
``schema.TABLE_NAMES``. Data files are Parquet files that this module writes
with pyarrow, with the exact declared Arrow schema (the schema fingerprint in
the footer, page checksums on), and then commits to the Delta log with
delta-rs. Delta gives the atomic, concurrent commits: a reader lists exactly
the files of one committed table version, never a glob of the directory, so a
stray or half-written file is invisible.

One append of trees touches three tables. It commits ``snapshots``, then
``nodes``, then ``trees`` last; each row of the first two carries the append's
``commit_key``, and every reader keeps only rows whose ``commit_key`` appears
in ``trees``. The ``trees`` commit is therefore the commit point of the whole
batch: a writer killed before it leaves only invisible rows. Each table's
commit also records the key as a Delta application transaction, so a retried
append with the same key skips the tables it already committed, and an append
whose ``trees`` commit landed is a no-op when retried.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import TableNotFoundError
from deltalake.transaction import AddAction, CommitProperties, Transaction

from rollout_store import snapshots as snap
from rollout_store.schema import (
    CONFIG_FINGERPRINT_KEY,
    CONFIG_TABLE_KEY,
    CONFIG_VERSION_KEY,
    PARQUET_METADATA_KEY,
    SCHEMA_HISTORY,
    SCHEMA_VERSION,
    SCHEMAS,
    TABLE_NAMES,
    SchemaMismatchError,
    TableName,
    fingerprint,
)
from rollout_store.tree import Tree, TreeBatch, validate_batch
from rollout_store.validate import TreeValidationError, check_columns

ROW_GROUP_SIZE = 128 * 1024  # GOTCHAS.md: 1M-row single row groups read 1.3-1.8x slower
COMPACTED_PREFIX = "compact-"  # files written by maintenance.compact: committed rows only


class StoreError(RuntimeError):
    """The store cannot be opened or read as asked (missing, corrupt, not a store)."""


class CorruptFileError(StoreError):
    """A committed data file is missing, truncated or damaged; ``path`` names it."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"{path}: {detail}")


@dataclass(frozen=True)
class DataFile:
    """One committed Parquet file of a table version.

    ``min_key`` / ``max_key`` are the file's smallest and largest ``commit_key``
    (from the commit's file statistics; None where the table has no key or the
    stats lack it). A file our writer appends holds one key (min == max); a
    file our compaction writes is named ``compact-*`` and holds committed rows
    only. Readers use this to skip uncommitted files and to read clean files
    without a row filter.
    """

    path: str  # absolute
    size: int
    num_records: int | None
    min_key: str | None = None
    max_key: str | None = None

    @property
    def compacted(self) -> bool:
        return os.path.basename(self.path).startswith(COMPACTED_PREFIX)


@dataclass(frozen=True)
class StoreVersion(Mapping[str, int]):
    """The Delta version of every table: a consistent, pinned view of a store."""

    versions: dict[str, int]

    def __getitem__(self, key: str) -> int:
        return self.versions[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.versions)

    def __len__(self) -> int:
        return len(self.versions)

    def __str__(self) -> str:
        return ", ".join(f"{k}@{v}" for k, v in self.versions.items())


@dataclass
class CommitReport:
    """What one append wrote: rows and bytes per table, and whether it was a retry."""

    commit_key: str
    rows: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # tables already committed under the key

    @property
    def already_committed(self) -> bool:
        return "trees" in self.skipped or (bool(self.skipped) and not self.rows)


def _table_config(name: TableName) -> dict[str, str | None]:
    return {
        CONFIG_TABLE_KEY: name,
        CONFIG_VERSION_KEY: str(SCHEMA_VERSION),
        CONFIG_FINGERPRINT_KEY: fingerprint(SCHEMAS[name]),
    }


def _delta_fields(schema: DeltaSchema | pa.Schema) -> dict[str, str]:
    if isinstance(schema, pa.Schema):
        schema = DeltaSchema.from_arrow(schema)
    return {f.name: json.dumps(json.loads(f.to_json())["type"], sort_keys=True)
            for f in schema.fields}


class Store:
    """A rollout-tree store rooted at ``path``.

    ``Store(path)`` opens an existing store and checks every table's schema
    version and fingerprint; ``Store(path, create=True)`` creates missing
    tables first. Appends are methods; reads go through ``rollout_store.reader``
    (DuckDB views, polars, arrow, streaming), pinned to ``store.version()``.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False) -> None:
        self.path = Path(path).absolute()
        self.table_schema_version: dict[str, int] = {}
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
            for name in TABLE_NAMES:
                if not DeltaTable.is_deltatable(str(self.path / name)):
                    DeltaTable.create(
                        str(self.path / name), SCHEMAS[name], mode="ignore", name=name,
                        configuration=_table_config(name), raise_if_key_not_exists=False,
                    )
        elif not self.path.is_dir():
            raise StoreError(f"{self.path}: no such store (create one with Store(path, "
                             "create=True) or any `rtrees` command that writes)")
        for name in TABLE_NAMES:
            self._check_table(name)

    # ------------------------------------------------------------------ schema
    def _check_table(self, name: TableName) -> None:
        uri = str(self.path / name)
        try:
            dt = DeltaTable(uri)
        except TableNotFoundError:
            raise StoreError(f"{self.path}: not a rollout-trees store (table {name!r} "
                             "is missing)") from None
        config = dt.metadata().configuration
        if CONFIG_VERSION_KEY not in config:
            raise SchemaMismatchError(f"{uri}: a Delta table, but not one written by "
                                      "rollout-trees (no schema version in its configuration)")
        version = int(config[CONFIG_VERSION_KEY] or -1)
        if version > SCHEMA_VERSION:
            raise SchemaMismatchError(
                f"{uri}: written with store schema version {version}, newer than this "
                f"rollout-trees supports ({SCHEMA_VERSION}); upgrade rollout-trees"
            )
        declared = SCHEMA_HISTORY.get(version, {}).get(name)
        actual = _delta_fields(dt.schema())
        if declared is None:
            raise SchemaMismatchError(f"{uri}: unknown store schema version {version}")
        diff = _field_diff(_delta_fields(declared), actual)
        if config.get(CONFIG_FINGERPRINT_KEY) != fingerprint(declared) or diff:
            raise SchemaMismatchError(
                f"{uri}: schema does not match schema version {version}: "
                + ("; ".join(diff) or "fingerprint differs")
            )
        if version < SCHEMA_VERSION:
            # Older store: readable if every column added since is nullable.
            added = [f for f in SCHEMAS[name] if f.name not in actual]
            strict = [f.name for f in added if not f.nullable]
            if strict:
                raise SchemaMismatchError(
                    f"{uri}: schema version {version} lacks non-nullable columns {strict} "
                    f"of version {SCHEMA_VERSION}; it cannot be read by this version"
                )
        self.table_schema_version[name] = version

    def columns(self, name: TableName) -> list[str]:
        """Columns physically present in the table (an older store may lack some)."""
        return list(_delta_fields(DeltaTable(str(self.path / name)).schema()))

    def _require_current(self, name: TableName) -> None:
        if self.table_schema_version[name] != SCHEMA_VERSION:
            raise SchemaMismatchError(
                f"{self.path / name}: store schema version "
                f"{self.table_schema_version[name]} is read-only for this rollout-trees "
                f"(writes schema version {SCHEMA_VERSION})"
            )

    # ---------------------------------------------------------------- versions
    def delta_table(self, name: TableName, version: int | None = None) -> DeltaTable:
        uri = str(self.path / name)
        return DeltaTable(uri) if version is None else DeltaTable(uri, version=version)

    def version(self) -> StoreVersion:
        """The current version of every table; pass it to readers to pin a view."""
        return StoreVersion({name: self.delta_table(name).version() for name in TABLE_NAMES})

    def version_at(self, trees_version: int) -> StoreVersion:
        """Time travel: the store as it was when ``trees`` reached ``trees_version``.

        Every other table is taken at its last version committed no later than
        that ``trees`` commit (appends commit ``trees`` last, so the batch's
        nodes and snapshots are included).
        """
        trees = self.delta_table("trees")
        if not 0 <= trees_version <= trees.version():
            raise StoreError(f"{self.path}: no trees version {trees_version} "
                             f"(latest is {trees.version()})")
        stamp = _commit_time(trees, trees_version)
        out = {"trees": trees_version}
        for name in TABLE_NAMES:
            if name != "trees":
                dt = self.delta_table(name)
                dt.load_as_version(stamp)
                out[name] = dt.version()
        return StoreVersion(out)

    def resolve(self, version: StoreVersion | int | None) -> StoreVersion:
        if version is None:
            return self.version()
        if isinstance(version, StoreVersion):
            return version
        return self.version_at(int(version))

    def files(self, name: TableName, version: StoreVersion | int | None = None,
              check: bool = True) -> list[DataFile]:
        """The committed data files of ``name`` at ``version`` (latest if None).

        With ``check``, each file must exist with the size its commit recorded;
        otherwise ``CorruptFileError`` names it (a truncated or replaced file).
        """
        pinned = self.resolve(version) if version is not None else None
        dt = self.delta_table(name, None if pinned is None else pinned[name])
        actions = pa.table(dt.get_add_actions(flatten=True))
        root = self.path / name
        out = []
        nothing = [None] * actions.num_rows
        lo = (actions.column("min.commit_key").to_pylist()
              if "min.commit_key" in actions.column_names else nothing)
        hi = (actions.column("max.commit_key").to_pylist()
              if "max.commit_key" in actions.column_names else nothing)
        for path, size, n, kmin, kmax in zip(
                actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist(),
                actions.column("num_records").to_pylist(), lo, hi, strict=True):
            full = str(root / path)
            if check:
                try:
                    actual = os.stat(full).st_size
                except FileNotFoundError:
                    raise CorruptFileError(full, f"data file of table {name!r} (version "
                                           f"{dt.version()}) is missing") from None
                if actual != size:
                    raise CorruptFileError(full, f"data file is {actual} bytes but its commit "
                                           f"recorded {size} (truncated or overwritten)")
            out.append(DataFile(full, int(size), None if n is None else int(n), kmin, kmax))
        return out

    # ------------------------------------------------------------------ writes
    def write_data_file(self, name: TableName, batches: Iterable[pa.RecordBatch | pa.Table],
                        prefix: str = "part-") -> tuple[str, int, str]:
        """Write Parquet data for table ``name`` (not yet committed).

        Exact declared schema, zstd, ``ROW_GROUP_SIZE`` row groups, page
        checksums, the schema fingerprint in the footer, fsync'd so that a commit
        never references a file that a crash could lose. Returns the path
        relative to the table, the size in bytes, and the Delta stats JSON
        (row count, and min/max ``commit_key`` where the table has one).
        """
        schema = SCHEMAS[name].with_metadata({PARQUET_METADATA_KEY: json.dumps(
            {"table": name, "version": SCHEMA_VERSION, "fingerprint": fingerprint(SCHEMAS[name])}
        )})
        rel = f"{prefix}{uuid.uuid4().hex}.parquet"
        full = self.path / name / rel
        rows = 0
        keys: list[str] = []
        with pq.ParquetWriter(full, schema, compression="zstd",
                              write_page_checksum=True) as writer:
            for part in batches:
                table = part if isinstance(part, pa.Table) else pa.Table.from_batches([part])
                writer.write_table(table.cast(schema), row_group_size=ROW_GROUP_SIZE)
                rows += table.num_rows
                if "commit_key" in table.column_names and table.num_rows:
                    bounds = pc.min_max(table.column("commit_key"))
                    keys += [bounds["min"].as_py(), bounds["max"].as_py()]
        with open(full, "rb") as fh:  # durable before a commit references it
            os.fsync(fh.fileno())
        stats: dict[str, Any] = {"numRecords": rows}
        if keys:
            stats.update(minValues={"commit_key": min(keys)}, maxValues={"commit_key": max(keys)},
                         nullCount={"commit_key": 0})
        return rel, full.stat().st_size, json.dumps(stats)

    def _commit_table(self, name: TableName, table: pa.Table, key: str,
                      report: CommitReport) -> None:
        """Write ``table`` as one Parquet file and commit it under application id ``key``."""
        self._require_current(name)
        dt = self.delta_table(name)
        if dt.transaction_version(key) is not None:
            report.skipped.append(name)
            return
        if table.num_rows == 0:
            return
        rel, size, stats = self.write_data_file(name, [table])
        dt.create_write_transaction(
            [AddAction(rel, size, {}, int(time.time() * 1000), True, stats)],
            mode="append", schema=SCHEMAS[name],
            commit_properties=CommitProperties(
                app_transactions=[Transaction(key, 1)],
                custom_metadata={"rollout_trees.commit_key": key},
                max_commit_retries=100,
            ),
        )
        report.rows[name] = table.num_rows
        report.bytes[name] = size

    def append_trees(self, trees: TreeBatch | Sequence[Tree], key: str | None = None
                     ) -> CommitReport:
        """Validate and commit a batch of trees (with their nodes and snapshots) atomically.

        ``key`` is the idempotency key: retrying an append with the same key
        after a crash or a lost acknowledgement stores the batch once. Without
        a key a fresh one is drawn (no retry protection). Raises
        ``TreeValidationError`` (nothing written) if any tree is bad or a tree
        id is already stored.
        """
        batch = trees if isinstance(trees, TreeBatch) else TreeBatch.from_trees(trees)
        key = key or uuid.uuid4().hex
        report = CommitReport(key)
        if self.delta_table("trees").transaction_version(key) is not None:
            report.skipped.append("trees")
            return report
        structure = validate_batch(batch)
        self._refuse_stored_trees(batch.trees.column("tree_id"))
        counts = pc.value_counts(batch.nodes.column("tree_id"))
        n_nodes = dict(zip(counts.field("values").to_pylist(),
                           counts.field("counts").to_pylist(), strict=True))
        keys = pa.array(np.full(batch.nodes.num_rows, key, dtype=object), pa.string())
        nodes = batch.nodes
        for col, values in (("depth", structure.depth), ("preorder", structure.preorder),
                            ("subtree_size", structure.subtree_size)):
            nodes = nodes.append_column(SCHEMAS["nodes"].field(col), pa.array(values, pa.int32()))
        nodes = nodes.append_column(SCHEMAS["nodes"].field("commit_key"), keys)
        trees_rows = batch.trees.append_column(
            SCHEMAS["trees"].field("n_nodes"),
            pa.array([n_nodes[t] for t in batch.trees.column("tree_id").to_pylist()], pa.int32()),
        ).append_column(SCHEMAS["trees"].field("commit_key"),
                        pa.array([key] * batch.trees.num_rows, pa.string()))
        trees_rows = trees_rows.select(SCHEMAS["trees"].names).cast(SCHEMAS["trees"])
        self._commit_table("snapshots", snap.to_stored(batch.snapshots, key), key, report)
        self._commit_table("nodes", nodes, key, report)
        self._commit_table("trees", trees_rows, key, report)
        return report

    def _refuse_stored_trees(self, tree_ids: pa.ChunkedArray) -> None:
        from rollout_store.reader import read_arrow  # reader imports store

        stored = read_arrow(self, "trees", columns=["tree_id", "commit_key"])
        clash = pc.is_in(tree_ids, value_set=stored.column("tree_id"))
        if pc.any(clash).as_py():
            tid = tree_ids[pc.index(clash, True).as_py()].as_py()
            raise TreeValidationError(tid, None, "duplicate_tree_id",
                                      "a tree with this id is already stored")

    def _append_rows(self, name: TableName, table: pa.Table, key: str | None) -> CommitReport:
        check_columns(table, SCHEMAS[name], name)
        key = key or uuid.uuid4().hex
        report = CommitReport(key)
        self._commit_table(name, table.select(SCHEMAS[name].names), key, report)
        return report

    def append_credits(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``credits`` schema (idempotent per ``key``)."""
        _check_finite(table, "value", "credits")
        return self._append_rows("credits", table, key)

    def append_mc_references(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``mc_references`` schema (idempotent per ``key``)."""
        bad = pc.or_(pc.less(table.column("successes"), 0),
                     pc.greater(table.column("successes"), table.column("k")))
        if len(table) and pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise TreeValidationError(str(table["tree_id"][row]), table["node_id"][row].as_py(),
                                      "mc_reference", "successes must lie in [0, k]")
        return self._append_rows("mc_references", table, key)

    def append_metrics(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``metrics`` schema (idempotent per ``key``)."""
        _check_finite(table, "value", "metrics")
        return self._append_rows("metrics", table, key)


def check_data_file(path: str, size: int) -> None:
    """Raise ``CorruptFileError`` unless ``path`` has ``size`` bytes and reads back cleanly.

    Reads every page with its CRC checked (our writer stores page checksums).
    DuckDB does not check them, so this is what catches a flipped bit.
    """
    try:
        actual = os.stat(path).st_size
    except FileNotFoundError:
        raise CorruptFileError(path, "committed data file is missing") from None
    if actual != size:
        raise CorruptFileError(path, f"{actual} bytes, the commit recorded {size} (truncated?)")
    try:
        pq.ParquetFile(path, page_checksum_verification=True).read()
    except Exception as exc:  # any decoding failure: a damaged file
        raise CorruptFileError(path, f"damaged Parquet data: {exc}") from exc


def _check_finite(table: pa.Table, column: str, what: str) -> None:
    values = table.column(column).to_numpy(zero_copy_only=False).astype(float)
    if not np.isfinite(values).all():
        row = int(np.argmax(~np.isfinite(values)))
        tid = table.column("tree_id")[row].as_py() if "tree_id" in table.column_names else None
        raise TreeValidationError(tid, None, "non_finite", f"{what}.{column} is {values[row]}")


def _field_diff(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    out = []
    for name, typ in expected.items():
        if name not in actual:
            out.append(f"missing column {name!r}")
        elif actual[name] != typ:
            out.append(f"column {name!r} has type {actual[name]}, expected {typ}")
    out += [f"unexpected column {name!r}" for name in actual if name not in expected]
    return out


def _commit_time(dt: DeltaTable, version: int) -> datetime:
    for entry in dt.history():
        if entry.get("version") == version:
            return datetime.fromtimestamp(entry["timestamp"] / 1000, tz=UTC)
    raise StoreError(f"{dt.table_uri}: version {version} is not in the table history")


def now_utc() -> datetime:
    return datetime.now(UTC)


def open_store(path: str | os.PathLike[str], create: bool = False) -> Store:
    """Open (or with ``create``, create) the store at ``path``."""
    return Store(path, create=create)
