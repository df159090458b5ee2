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

Hardening (issue 13):

* Appends of one store are serialised at their commit point by an exclusive lock
  (``.append.lock``, ``fcntl.flock``): under it an append re-checks that no tree id
  of the batch is stored and that its key is not already committed, then writes and
  commits. Two concurrent writers of the same tree therefore cannot both store it
  (the second fails with ``duplicate_tree_id``), and the loser of a same-key race
  reads "already committed" instead of a raw ``CommitFailedError``.
* Each table's application transaction records a content digest of what the key
  committed (``Transaction(key, digest)``) and its row count (``key#rows``). A retry
  under the same key with other content (another ``--n-total``, say) is refused with
  ``CommitKeyConflictError`` saying which table differs and how, never mixed with the
  first attempt nor dropped as "already committed". Digests cover the content that
  defines a tree (ids, structure, tokens, rewards), not ``created_at`` or logprobs.
* Data files, the table directory, every commit file and ``_delta_log`` are fsync'd
  before the next table's commit (``deltalog.fsync_commit``).
* A damaged Delta log is a ``DamagedLogError`` naming the table and the log file.
* Every table commit lands at exactly the version after the one its checks read, or
  not at all (issue 21): a writer whose put for that version fails re-reads the table,
  re-checks (same key, duplicate tree ids) and tries again, so the duplicate check holds
  even for a writer stalled past its lease on object storage (``objectstore.py``).

Issue 16, locally as on object storage:

* Creating tables (``Store(path, create=True)``, and the tables a newer schema added) is
  serialised by ``.create.lock`` and re-checked under it: delta-rs turns a create that
  lost the race for version 0 into a second metadata commit, and two processes creating
  one new store at once used to both fail ("'nodes' is missing but 'trees' holds data").
* Every ``CHECKPOINT_EVERY`` commits of a table, the committing append writes a Delta
  checkpoint (``deltalog.checkpoint_if_due``), so opening a table replays at most that
  many JSON commits and a long-lived writer's memory stays flat.

Object storage (issue 16): ``Store("s3://bucket/prefix")`` is the same store on S3. Every
access to storage goes through ``self.loc`` (``objectstore.Location``): data files through
``pyarrow.fs``, the Delta log through delta-rs ``storage_options`` (commits by conditional
put), the append lock as a lease lock object instead of ``flock``; fsyncs apply to local
directories only (an object is durable once its PUT returns). ``objectstore.py`` documents
the concurrency design.

Why one module (about 1,150 lines): every part above runs on the ``Store``'s own state
(its ``Location``, the pinned table versions, the append and create locks), and the
schema upgrade of an older store runs as it opens, under the create lock: the tables a
newer schema version added (``_add_new_tables``, from the constructor) and its nullable
columns (``_add_new_columns``, from ``_check_table``), written through the same
data-file writer and commit path. The pure parts
already live apart: the schema and its history (``schema.py``), digests, the Delta log's
fsyncs and checkpoints (``deltalog.py``), object storage (``objectstore.py``).
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, CommitProperties, RemoveAction, Transaction

from rollout_store import snapshots as snap
from rollout_store.deltalog import checkpoint_if_due, describe_failure, fsync_commit, fsync_dir
from rollout_store.digests import (  # noqa: F401  (re-exported: store.content_digest, ...)
    DIGEST_COLUMNS,
    LEGACY_TXN_VERSION,
    content_digest,
    default_digest,
)
from rollout_store.errors import StoreError
from rollout_store.objectstore import Lease, Location, ObjectPath
from rollout_store.precision import round_nodes
from rollout_store.schema import (
    ADDED_COLUMNS,
    ADDED_TABLES,
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

ROW_GROUP_SIZE = 128 * 1024  # pyarrow's 1M-row single row groups read 1.3-1.8x slower here
# zstd's own default level; pyarrow's is 1. Measured on benchmarks/bench_store_size.py's
# nodes: 3% smaller files (texts 8-10% smaller), reads as fast (issue 26).
ZSTD_LEVEL = 3
COMPACTED_PREFIX = "compact-"  # files written by maintenance.compact: committed rows only
# Columns whose min and max each data file's commit records (``DataFile``): the commit
# key (uncommitted rows) and the tree id (which files an append's checks must read).
BOUNDED_COLUMNS = ("commit_key", "tree_id")


class DamagedLogError(StoreError):
    """A table's Delta log is garbled, truncated, has a gap or a bogus checkpoint hint."""


class CommitKeyConflictError(StoreError):
    """A commit key was already used for other content (a retry that is not a retry)."""


APPEND_LOCK = ".append.lock"
CREATE_LOCK = ".create.lock"  # creating the tables of a new store (flock, or a lease on S3)
# A Delta checkpoint of a table every this many of its commits (0: only delta-rs's own,
# every 100). Opening a table replays the log since its last checkpoint; at 100 JSON
# commits per replay one process's RSS crept up ~0.5 MiB per commit between checkpoints
# (benchmarks/bench_store_rss.py), and every open (several per append) got slower.
CHECKPOINT_EVERY = 10
# Tries of one table commit whose next version another commit took (each one re-checks
# against the version that won; the old delta-rs retry limit was the same).
COMMIT_ATTEMPTS = 100


def open_delta(uri: str, version: int | None = None, what: str = "",
               loc: Location | None = None) -> DeltaTable:
    """``DeltaTable(uri, version)``, with a damaged log as ``DamagedLogError`` naming the
    table (``what``) and the log file; ``TableNotFoundError`` passes through. ``loc`` gives
    the storage options of a store on object storage."""
    options = None if loc is None else loc.storage_options()
    try:
        return DeltaTable(uri, version=version, storage_options=options)
    except TableNotFoundError:
        raise
    except (DeltaError, OSError) as exc:
        raise DamagedLogError(describe_failure(
            uri, exc, what, None if loc is None else loc.filesystem)) from None


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
    without a row filter. ``min_tree`` / ``max_tree`` bound the file's ``tree_id``
    values the same way (None in files written before these statistics existed):
    the checks an append makes look only into files whose range holds one of its
    tree ids (``may_hold``).
    """

    path: str  # absolute
    size: int
    num_records: int | None
    min_key: str | None = None
    max_key: str | None = None
    min_tree: str | None = None
    max_tree: str | None = None

    @property
    def compacted(self) -> bool:
        return os.path.basename(self.path).startswith(COMPACTED_PREFIX)

    def may_hold(self, sorted_ids: Sequence[str]) -> bool:
        """Whether a ``tree_id`` of ``sorted_ids`` (ascending) can be in this file: False only
        when the file's recorded bounds exclude every one of them."""
        if self.min_tree is None or self.max_tree is None:
            return True
        first = bisect.bisect_left(sorted_ids, self.min_tree)
        return first < len(sorted_ids) and sorted_ids[first] <= self.max_tree


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


def _sorted_ids(ids: pa.Array | pa.ChunkedArray) -> list[str]:
    """The distinct non-null ids of ``ids``, ascending (the order of ``DataFile.may_hold``:
    code points, which is the byte order of UTF-8 that Arrow's min/max use)."""
    return sorted(i for i in pc.unique(ids).to_pylist() if i is not None)


def _table_config(name: TableName) -> dict[str, str | None]:
    return {
        CONFIG_TABLE_KEY: name,
        CONFIG_VERSION_KEY: str(SCHEMA_VERSION),
        CONFIG_FINGERPRINT_KEY: fingerprint(SCHEMAS[name]),
    }


def _delta_fields(schema: DeltaSchema | pa.Schema) -> dict[str, str]:
    """Column name -> its Delta type as canonical JSON."""
    if isinstance(schema, pa.Schema):
        schema = DeltaSchema.from_arrow(schema)
    return {f.name: json.dumps(json.loads(f.to_json())["type"], sort_keys=True)
            for f in schema.fields}


class Store:
    """A rollout-tree store rooted at ``path``.

    ``Store(path)`` opens an existing store and checks every table's schema
    version and fingerprint; ``Store(path, create=True)`` creates missing
    tables first. ``Store(path, tables=(...))`` opens and checks only the named
    tables at once and any other at its first use (a reader of a few tables:
    each table opened costs a read of its Delta log; with ``create`` every table
    is opened). Appends are methods; reads
    go through ``rollout_store.reader`` (DuckDB views, polars, arrow, streaming),
    pinned to ``store.version()``.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False,
                 tables: Sequence[TableName] | None = None) -> None:
        self.loc = Location(path)  # a local directory or s3://bucket/prefix (objectstore.py)
        self.path: Path | ObjectPath = self.loc.path
        self.table_schema_version: dict[str, int] = {}
        self._lease = Lease()  # the append lock while held (checked before each commit)
        self._pinned: dict[tuple[str, int], DeltaTable] = {}  # remote: see delta_table
        self._reading = 0  # > 0 inside pinned_reads (local stores cache pinned tables)
        # Each table as ``_check_table`` opened it, for the first ``delta_table`` call to
        # bring up to date (reading the log entries since) instead of opening it again.
        self._opened: dict[str, DeltaTable] = {}
        # The latest version of each table for this store's own version checks and
        # commits (``_latest``): one handle per table and thread, brought up to date by
        # reading the log entries since, never handed out (a caller's handle does not
        # move under it, and two threads appending through one Store share none).
        self._threads = threading.local()
        unknown = sorted(set(tables or ()) - set(TABLE_NAMES))
        if unknown:
            raise StoreError(f"no table named {', '.join(map(repr, unknown))} (the tables: "
                             f"{', '.join(TABLE_NAMES)})")
        now = TABLE_NAMES if tables is None or create else tuple(dict.fromkeys(tables))
        # Tables not opened yet: checked at first use (delta_table, a write).
        self._unchecked: set[str] = {str(n) for n in TABLE_NAMES} - set(now)
        if self.loc.remote:
            self._prepare_remote(create)
        else:
            self._prepare_local(create)
        self._add_new_tables()
        opened = self._open_tables(now)
        for name in now:
            self._check_table(name, opened[name])

    def _ensure_checked(self, name: str) -> None:
        """Check a table ``Store(path, tables=...)`` left unopened, once."""
        if name in self._unchecked:
            self._unchecked.discard(name)  # first: _check_table itself opens the table
            try:
                self._check_table(cast(TableName, name))
            except BaseException:
                self._unchecked.add(name)
                raise

    def _prepare_local(self, create: bool) -> None:
        path = self.path
        assert isinstance(path, Path)
        if create:
            if path.exists() and not path.is_dir():
                raise StoreError(f"{path}: not a directory (a store is a directory of "
                                 "tables)")
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"{path}: cannot create the store: "
                                 f"{exc.strerror or exc}") from None
            if not all(self._is_table(name) for name in TABLE_NAMES):
                # Two processes creating one store at once: delta-rs retries a create that
                # lost version 0 as a second metadata commit (version 1), and the next
                # table was then refused as "missing while trees holds data" in both
                # (tests/test_store_create_race.py). Serialised, and re-checked under it.
                with self._create_lock():
                    self._create_tables()
        elif path.exists() and not path.is_dir():
            raise StoreError(f"{path}: not a directory (a store is a directory of tables)")
        elif not path.is_dir():
            raise StoreError(f"{path}: no such store (create one with Store(path, "
                             "create=True) or any `rtrees` command that writes)")

    def _prepare_remote(self, create: bool) -> None:
        assert isinstance(self.path, ObjectPath)
        if not self.loc.bucket_exists():
            raise StoreError(f"{self.path}: bucket {self.path.bucket!r} does not exist or is "
                             "not readable with these credentials (create the bucket first)")
        if create and not all(self._is_table(name) for name in TABLE_NAMES):
            # As locally (_prepare_local), serialised by a lease lock and re-checked under it.
            with self._create_lock():
                self._create_tables()
        elif not create and not self._is_table("trees"):
            raise StoreError(f"{self.path}: no such store (create one with Store(path, "
                             "create=True) or any `rtrees` command that writes)")

    def _uri(self, name: str) -> str:
        return str(self.path / name)

    def _is_table(self, name: str) -> bool:
        try:
            return bool(DeltaTable.is_deltatable(self._uri(name),
                                                 storage_options=self.loc.storage_options()))
        except (DeltaError, OSError) as exc:
            raise StoreError(f"{self.path}: cannot read table {name!r}: "
                             f"{str(exc).splitlines()[0] if str(exc) else exc}") from None

    def _create_table(self, name: TableName) -> None:
        try:
            DeltaTable.create(
                self._uri(name), SCHEMAS[name], mode="ignore", name=name,
                configuration=_table_config(name), raise_if_key_not_exists=False,
                storage_options=self.loc.storage_options(),
            )
        except (DeltaError, OSError) as exc:
            if not self._is_table(name):
                raise StoreError(f"{self.path}: cannot create table {name!r}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else exc}") from None
            # a writer that does not take our create lock created it meanwhile

    def _create_tables(self) -> None:
        for name in TABLE_NAMES:
            if not self._is_table(name):
                self._refuse_recreate(name)
                self._create_table(name)

    def _add_new_tables(self) -> None:
        """Create the (empty) tables a newer schema version added (``ADDED_TABLES``) in a
        store written before them, so an older store opens; needs write access once."""
        if not self._is_table("trees"):
            return  # not a store (yet): _check_table names what is missing
        missing = [name for name in ADDED_TABLES if not self._is_table(name)]
        if missing:
            with self._create_lock(f"add tables {missing} (new in schema versions "
                                   f"{sorted({ADDED_TABLES[n] for n in missing})})"):
                self._create_added([n for n in missing if not self._is_table(n)])

    def _columns_due(self, name: TableName, dt: DeltaTable | None = None
                     ) -> tuple[int, list[pa.Field]] | None:
        """(the table's version, the ``ADDED_COLUMNS`` fields it lacks) when ``name`` (or
        ``dt``, the table opened) is a table of an older version that lacks exactly them (or
        already has them, from an upgrade stopped between its commits), else None: nothing
        to upgrade, or a table ``_check_table`` names as mismatched."""
        if name not in ADDED_COLUMNS:
            return None
        since, added = ADDED_COLUMNS[name]
        if dt is None:
            try:
                dt = open_delta(self._uri(name), what=f"{self.path}: table {name!r}",
                                loc=self.loc)
            except TableNotFoundError:
                return None
        config = dt.metadata().configuration
        try:
            version = int(config.get(CONFIG_VERSION_KEY) or -1)
        except ValueError:
            return None
        declared = SCHEMA_HISTORY.get(version, {}).get(name)
        if not 0 <= version < since or declared is None:
            return None
        if config.get(CONFIG_FINGERPRINT_KEY) != fingerprint(declared):
            return None
        actual = _delta_fields(dt.schema())
        before = pa.schema([f for f in SCHEMAS[name] if f.name not in added])
        if actual == _delta_fields(before) and before.equals(declared):
            return version, [SCHEMAS[name].field(c) for c in added]
        if actual == _delta_fields(SCHEMAS[name]):
            return version, []  # columns added, version not yet recorded
        return None

    def _add_new_columns(self, name: TableName) -> None:
        """Upgrade in place a table of an older version that lacks exactly the nullable
        columns a newer version added (``ADDED_COLUMNS``; ``_check_table`` asks), under the
        create lock: add them to its Delta schema, rewrite each data file without them with
        the columns null (one commit, ``dataChange=false``: every live file then has the
        declared schema, as readers, compaction and ``verify`` expect), then record the
        current version and fingerprint in its configuration, so the table stays writable.
        Each step is redone by the next open if a process dies between them. Needs write
        access once."""
        with self._create_lock(f"add columns to table {name!r} (schema version "
                               f"{SCHEMA_VERSION})"):
            found = self._columns_due(name)  # re-checked under the lock
            if found is not None:
                fields = found[1]
                try:
                    if fields:
                        self.delta_table(name).alter.add_columns(list(DeltaSchema.from_arrow(
                            pa.schema(fields)).fields))
                    self._rewrite_lacking(name)
                    self.delta_table(name).alter.set_table_properties({
                        CONFIG_VERSION_KEY: str(SCHEMA_VERSION),
                        CONFIG_FINGERPRINT_KEY: fingerprint(SCHEMAS[name])},
                        raise_if_not_exists=False)
                except (DeltaError, OSError) as exc:
                    raise StoreError(
                        f"{self.path}: cannot add columns {list(ADDED_COLUMNS[name][1])} to "
                        f"table {name!r} (new in schema version {ADDED_COLUMNS[name][0]}): "
                        f"{str(exc).splitlines()[0] if str(exc) else exc}; open the store "
                        "once with write access") from None

    def _rewrite_lacking(self, name: TableName) -> None:
        """Replace each live data file of ``name`` that lacks declared columns by a copy
        with them null (batch by batch), in one commit that changes no data."""
        full = SCHEMAS[name]
        root = str(self.path / name) + os.sep
        now = int(time.time() * 1000)
        actions: list[AddAction | RemoveAction] = []
        for f in self.files(name):
            parquet = self.loc.parquet_file(f.path, page_checksum_verification=True)
            have = set(parquet.schema_arrow.names)
            if have >= set(full.names):
                continue

            def batches(pf: pq.ParquetFile = parquet, have: set[str] = have
                        ) -> Iterator[pa.Table]:
                for batch in pf.iter_batches(batch_size=65_536, use_threads=False):
                    n = batch.num_rows
                    yield pa.table([batch.column(c.name) if c.name in have
                                    else pa.nulls(n, c.type) for c in full], schema=full)

            rel, size, stats = self.write_data_file(name, batches())
            actions += [RemoveAction(f.path.removeprefix(root), False, now, f.size, {}),
                        AddAction(rel, size, {}, now, False, stats)]
        if not actions:
            return
        dt = self.delta_table(name)
        before = dt.version()
        dt.create_write_transaction(
            actions, mode="append", schema=full, commit_properties=CommitProperties(
                custom_metadata={"rollout_trees.operation": "upgrade"}))
        if not self.loc.remote:
            fsync_commit(self.loc.table_uri(name), before, self.delta_table(name).version())

    @contextmanager
    def _create_lock(self, why: str = "create its tables") -> Iterator[None]:
        """Serialise creating tables: ``flock`` on ``.create.lock`` in the store directory
        (every process of a host), a lease lock object on object storage."""
        with ExitStack() as stack:
            try:
                stack.enter_context(self.loc.lock(CREATE_LOCK))
            except OSError as exc:
                raise StoreError(f"{self.path}: cannot {why}: cannot take {CREATE_LOCK}: "
                                 f"{exc.strerror or exc}; open the store once with write "
                                 "access") from None
            yield

    def _create_added(self, names: list[TableName]) -> None:
        for name in names:
            try:
                self._create_table(name)
            except StoreError as exc:
                raise StoreError(f"{exc} (new in schema version {ADDED_TABLES[name]}); open "
                                 "the store once with write access") from None

    # ------------------------------------------------------------------ schema
    def _refuse_recreate(self, name: TableName) -> None:
        """Refuse to create a missing ``trees``/``nodes``/``snapshots`` table next to ones
        holding data: it was lost, and an empty one would hide the loss."""
        core = ("trees", "nodes", "snapshots")
        if name not in core:
            return
        for other in core:
            uri = self._uri(other)
            # "Holds data": committed files, not version > 0 (a store left by the old
            # create race has a second metadata commit and nothing else).
            if (other != name and self._is_table(other)
                    and open_delta(uri, what=f"table {other!r}", loc=self.loc).file_uris()):
                raise StoreError(f"{self.path}: table {name!r} is missing but {other!r} "
                                 "holds data: the store is damaged (not recreating it)")

    def _open_tables(self, names: Sequence[TableName]
                     ) -> dict[str, DeltaTable | StoreError | TableNotFoundError]:
        """The tables ``names`` opened, side by side in threads (delta-rs reads the logs
        without the GIL: half the time of one after another), or the error each raised."""
        def one(name: str) -> DeltaTable | StoreError | TableNotFoundError:
            try:
                return open_delta(self._uri(name), what=f"{self.path}: table {name!r}",
                                  loc=self.loc)
            except (StoreError, TableNotFoundError) as exc:
                return exc

        if len(names) == 1:
            return {names[0]: one(names[0])}
        with ThreadPoolExecutor(len(names)) as pool:
            return dict(zip(names, pool.map(one, names), strict=True))

    def _check_table(self, name: TableName,
                     opened: DeltaTable | StoreError | TableNotFoundError | None = None
                     ) -> None:
        """Check the table's schema version and fingerprint (``opened``: the table as
        ``_open_tables`` opened it, or the error that raised; None: open it here)."""
        uri = self._uri(name)
        try:
            if isinstance(opened, Exception):
                raise opened
            dt = opened or open_delta(uri, what=f"{self.path}: table {name!r}", loc=self.loc)
        except TableNotFoundError:
            raise StoreError(f"{self.path}: not a rollout-trees store (table {name!r} "
                             "is missing)") from None
        config = dt.metadata().configuration
        if CONFIG_VERSION_KEY not in config:
            raise SchemaMismatchError(f"{uri}: a Delta table, but not one written by "
                                      "rollout-trees (no schema version in its configuration)")
        if self._columns_due(name, dt) is not None:
            self._add_new_columns(name)
            self._check_table(name)
            return
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
        if version < SCHEMA_VERSION and fingerprint(declared) == fingerprint(SCHEMAS[name]):
            version = SCHEMA_VERSION  # the table has not changed since: current, writable
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
        self._opened[name] = dt

    def columns(self, name: TableName, version: int | None = None) -> list[str]:
        """Columns physically present in the table (an older store may lack some), at
        ``version`` (latest if None)."""
        return list(_delta_fields(self.delta_table(name, version).schema()))

    def schema_version_of(self, name: TableName) -> int:
        """The store schema version table ``name`` was written with (checked first)."""
        self._ensure_checked(name)
        return self.table_schema_version[name]

    def _require_current(self, name: TableName) -> None:
        if self.schema_version_of(name) != SCHEMA_VERSION:
            raise SchemaMismatchError(
                f"{self.path / name}: store schema version "
                f"{self.table_schema_version[name]} is read-only for this rollout-trees "
                f"(writes schema version {SCHEMA_VERSION})"
            )

    # ---------------------------------------------------------------- versions
    def delta_table(self, name: TableName, version: int | None = None) -> DeltaTable:
        """The table at ``version`` (latest if None). On object storage a pinned version is
        loaded once per ``Store`` (a committed version never changes; loading one costs a
        listing and reads of the log)."""
        self._ensure_checked(name)
        if version is None and name in self._opened:
            dt = self._opened.pop(name)
            try:
                dt.update_incremental()
                return dt
            except (DeltaError, OSError):
                pass  # opened afresh below, which names what is wrong
        if version is None or not (self.loc.remote or self._reading):
            return open_delta(self._uri(name), version, f"{self.path}: table {name!r}",
                              self.loc)
        found = self._pinned.get((name, version))
        if found is None:
            found = open_delta(self._uri(name), version, f"{self.path}: table {name!r}",
                               self.loc)
            self._remember(name, version, found)
        return found

    def _latest(self, name: TableName) -> DeltaTable:
        """The table at its latest version, for reads inside this class that keep no
        handle across another ``_latest`` of the same table: the handle of the last call
        brought up to date (a fresh open costs a listing and a read of the log since the
        last checkpoint, several per append), opened afresh when that fails."""
        handles: dict[str, DeltaTable] = self._threads.__dict__.setdefault("handles", {})
        dt = handles.pop(name, None)
        if dt is not None:
            try:
                dt.update_incremental()
            except (DeltaError, OSError):
                dt = None  # opened afresh below, which names what is wrong
        if dt is None:
            dt = self.delta_table(name)
        handles[name] = dt
        return dt

    def _remember(self, name: TableName, version: int, dt: DeltaTable) -> None:
        if len(self._pinned) >= 256:
            self._pinned.clear()
        self._pinned[(name, version)] = dt

    @contextmanager
    def pinned_reads(self) -> Iterator[None]:
        """Within the block, each (table, version) of a local store is loaded from its
        Delta log once (as on object storage, always): a reader resolving one version and
        then listing files and columns of every table (``reader.connect``) opened each
        table three times. Left, the local cache is dropped, so a later read sees the log
        as it is then."""
        self._reading += 1
        try:
            yield
        finally:
            self._reading -= 1
            if not self._reading and not self.loc.remote:
                self._pinned.clear()

    def version(self, tables: Sequence[TableName] | None = None) -> StoreVersion:
        """The current version of every table (or of ``tables`` only, for a reader that
        reads just those: each table opened costs a read of its log); pass it to readers
        to pin a view."""
        out: dict[str, int] = {}
        for name in TABLE_NAMES if tables is None else tables:
            if not self._reading:
                out[name] = self._latest(name).version()
                continue
            dt = self.delta_table(name)  # its own handle: kept at this version
            out[name] = dt.version()
            self._remember(name, out[name], dt)  # in pinned_reads: loaded once
        return StoreVersion(out)

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

    def resolve(self, version: StoreVersion | int | None,
                tables: Sequence[TableName] | None = None) -> StoreVersion:
        """A pinned view: ``version`` itself, the latest (None; of ``tables`` only when
        given) or the store when ``trees`` reached that int version (time travel)."""
        if version is None:
            return self.version(tables)
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
        listed = self.loc.sizes(str(root)) if check and self.loc.remote else {}
        out = []
        nothing = [None] * actions.num_rows

        def stat(name: str) -> list[Any]:
            return (actions.column(name).to_pylist() if name in actions.column_names
                    else nothing)

        real_root = None if self.loc.remote else os.path.realpath(str(root))
        for path, size, n, kmin, kmax, tmin, tmax in zip(
                actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist(),
                actions.column("num_records").to_pylist(), stat("min.commit_key"),
                stat("max.commit_key"), stat("min.tree_id"), stat("max.tree_id"), strict=True):
            full = str(root / path)
            if _outside(str(path), full, real_root):
                # a forged log ``add`` of /etc/passwd or ../../x: never read it
                raise StoreError(f"{self.path}: the log of table {name!r} names a data file "
                                 f"outside the store ({path}); refusing to read it")
            if check:
                try:
                    actual = listed[full] if self.loc.remote else os.stat(full).st_size
                except (FileNotFoundError, KeyError):
                    raise CorruptFileError(full, f"data file of table {name!r} (version "
                                           f"{dt.version()}) is missing") from None
                if actual != size:
                    raise CorruptFileError(full, f"data file is {actual} bytes but its commit "
                                           f"recorded {size} (truncated or overwritten)")
            out.append(DataFile(full, int(size), None if n is None else int(n), kmin, kmax,
                                tmin, tmax))
        return out

    # ------------------------------------------------------------------ writes
    def write_data_file(self, name: TableName, batches: Iterable[pa.RecordBatch | pa.Table],
                        prefix: str = "part-") -> tuple[str, int, str]:
        """Write Parquet data for table ``name`` (not yet committed).

        Exact declared schema, zstd at ``ZSTD_LEVEL``, ``ROW_GROUP_SIZE`` row groups, page
        checksums, the schema fingerprint in the footer, fsync'd so that a commit
        never references a file that a crash could lose. Returns the path
        relative to the table, the size in bytes, and the Delta stats JSON
        (row count, and min/max ``commit_key`` and ``tree_id`` where the table has them).
        """
        schema = SCHEMAS[name].with_metadata({PARQUET_METADATA_KEY: json.dumps(
            {"table": name, "version": SCHEMA_VERSION, "fingerprint": fingerprint(SCHEMAS[name])}
        )})
        rel = f"{prefix}{uuid.uuid4().hex}.parquet"
        full = self.path / name / rel
        rows = 0
        bounds: dict[str, list[str]] = {}  # column -> the min and max of each batch
        with pq.ParquetWriter(self.loc.fs_path(str(full)), schema, compression="zstd",
                              compression_level=ZSTD_LEVEL, write_page_checksum=True,
                              filesystem=self.loc.filesystem) as writer:
            for part in batches:
                table = part if isinstance(part, pa.Table) else pa.Table.from_batches([part])
                writer.write_table(table.cast(schema), row_group_size=ROW_GROUP_SIZE)
                rows += table.num_rows
                for column in BOUNDED_COLUMNS:
                    if column in table.column_names and table.num_rows:
                        lo_hi = pc.min_max(table.column(column))
                        bounds.setdefault(column, []).extend(
                            [lo_hi["min"].as_py(), lo_hi["max"].as_py()])
        if isinstance(full, Path):
            with open(full, "rb") as fh:  # durable before a commit references it
                os.fsync(fh.fileno())
            fsync_dir(full.parent)  # and its name in the table directory
            size = full.stat().st_size
        else:  # an object exists, durably, once its (multipart) upload completed
            size = self.loc.size(str(full)) or 0
        stats: dict[str, Any] = {"numRecords": rows}
        if bounds:  # both columns are non-null wherever a table has them
            stats.update(minValues={c: min(v) for c, v in bounds.items()},
                         maxValues={c: max(v) for c, v in bounds.items()},
                         nullCount={c: 0 for c in bounds})
        return rel, size, json.dumps(stats)

    @contextmanager
    def _append_lock(self) -> Iterator[None]:
        """Serialise the commit points of this store's appends: a ``flock`` (all processes
        of a host) locally, a lease lock object on object storage (every host)."""
        with self.loc.lock(APPEND_LOCK, "a") as lease:
            self._lease = lease
            try:
                yield
            finally:
                self._lease = Lease()

    def _committed_under(self, name: TableName, key: str, digest: int, rows: int,
                         dt: DeltaTable | None = None) -> bool:
        """Whether ``key`` already committed ``name`` (at ``dt``'s version, latest if None);
        refuse it if with other content."""
        dt = self._latest(name) if dt is None else dt
        recorded = dt.transaction_version(key)
        if recorded is None:
            return False
        if recorded not in (LEGACY_TXN_VERSION, digest):
            then = dt.transaction_version(f"{key}#rows")
            counts = (f"{then} rows then, {rows} now" if then is not None and then != rows
                      else f"{rows} rows both times, other content")
            raise CommitKeyConflictError(
                f"{self.path}: commit key {key!r} already committed different {name} "
                f"({counts}): a retry must repeat the same content; use another key "
                "(run id) for different content")
        return True

    def _commit_table(self, name: TableName, table: pa.Table, key: str,
                      report: CommitReport, digest: int | None = None,
                      guard: tuple[int, Callable[[], None]] | None = None) -> None:
        """Write ``table`` as one Parquet file and commit it under application id ``key``.

        Call with the append lock held. ``digest`` (default: of all columns) is recorded
        with the key and checked on a retry. ``guard`` is ``(version, check)``: ``check``
        (an append's duplicate-tree-id check) passed against version ``version`` of this
        table or a later one, and runs again whenever the table has moved past that.

        The commit is made at exactly the version after the one the checks read
        (``max_commit_retries=0``: the commit file's conditional put fails if any other
        commit took that version). A writer that lost its lease and stalled past its last
        lease check therefore cannot commit over a clash it never saw: its put fails, it
        re-reads the table, re-runs the checks (a same-key commit that landed meanwhile is
        "already committed", the same tree ids are ``duplicate_tree_id``) and its lease
        check, and only then tries the next version (``objectstore.py``)."""
        self._require_current(name)
        if digest is None:
            digest = default_digest(name, table)
        dt = self._latest(name)
        if self._committed_under(name, key, digest, table.num_rows, dt):
            report.skipped.append(name)
            return
        if table.num_rows == 0:
            return
        keys_seen = dt.version()  # _committed_under read this version
        checked = None if guard is None else guard[0]
        rel, size, stats = self.write_data_file(name, [table])
        for _ in range(COMMIT_ATTEMPTS):
            dt = self._latest(name)
            before = dt.version()
            if before != keys_seen:
                if self._committed_under(name, key, digest, table.num_rows, dt):
                    report.skipped.append(name)  # a same-key writer committed it meanwhile
                    return
                keys_seen = before
            if guard is not None and before != checked:
                guard[1]()  # reads the latest version: ``before`` or later
                checked = before
            self._lease.check()  # on object storage: still ours, just before the commit
            try:
                dt.create_write_transaction(
                    [AddAction(rel, size, {}, int(time.time() * 1000), True, stats)],
                    mode="append", schema=SCHEMAS[name],
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(key, digest),
                                          Transaction(f"{key}#rows", table.num_rows)],
                        custom_metadata={"rollout_trees.commit_key": key},
                        max_commit_retries=0,  # exactly version before + 1, or nothing
                    ),
                )
            except CommitFailedError as exc:
                if self._latest(name).version() > before:
                    continue  # another commit took version before + 1: check against it
                raise StoreError(f"{self.path}: commit to table {name!r} failed: "
                                 f"{str(exc).splitlines()[0] if str(exc) else exc}") from None
            break
        else:
            raise StoreError(f"{self.path}: commit to table {name!r} failed: other commits "
                             f"took the next version {COMMIT_ATTEMPTS} times in a row")
        after = self._latest(name)
        if not self.loc.remote:
            fsync_commit(self._uri(name), before, after.version())
        checkpoint_if_due(after, before, CHECKPOINT_EVERY,
                          None if self.loc.remote else self._uri(name))
        report.rows[name] = table.num_rows
        report.bytes[name] = size

    def append_trees(self, trees: TreeBatch | Sequence[Tree], key: str | None = None
                     ) -> CommitReport:
        """Validate and commit a batch of trees (with their nodes and snapshots) atomically.

        ``key`` is the idempotency key: retrying an append with the same key
        after a crash or a lost acknowledgement stores the batch once. Without
        a key a fresh one is drawn (no retry protection). Raises
        ``TreeValidationError`` (nothing written) if any tree is bad or a tree
        id is already stored (checked at the commit point, under the append lock),
        and ``CommitKeyConflictError`` if ``key`` already committed other content.
        """
        batch = trees if isinstance(trees, TreeBatch) else TreeBatch.from_trees(trees)
        key = key or uuid.uuid4().hex
        report = CommitReport(key)
        structure = validate_batch(batch)
        counts = pc.value_counts(batch.nodes.column("tree_id"))
        n_nodes = dict(zip(counts.field("values").to_pylist(),
                           counts.field("counts").to_pylist(), strict=True))
        keys = pa.array(np.full(batch.nodes.num_rows, key, dtype=object), pa.string())
        nodes = round_nodes(batch.nodes)  # the stored precision of logprobs (precision.py)
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
        snapshots = snap.to_stored(batch.snapshots, key)
        tables: dict[TableName, pa.Table] = {"snapshots": snapshots, "nodes": nodes,
                                             "trees": trees_rows}
        digests = {name: default_digest(name, t) for name, t in tables.items()}
        tree_ids = batch.trees.column("tree_id")
        with self._append_lock():
            # Check every table first: a key whose trees landed must match in all three.
            done = {name: self._committed_under(name, key, digests[name], t.num_rows)
                    for name, t in tables.items()}
            if done["trees"]:
                report.skipped.append("trees")
                return report
            seen = self.delta_table("trees").version()
            self._refuse_stored_trees(tree_ids)  # reads version ``seen`` or a later one
            for name, table in tables.items():
                guard = (seen, lambda: self._refuse_stored_trees(tree_ids))
                self._commit_table(name, table, key, report, digests[name],
                                   guard if name == "trees" else None)
        return report

    def stored_tree_ids(self, version: StoreVersion | None = None,
                        among: pa.Array | pa.ChunkedArray | None = None) -> pa.ChunkedArray:
        """Every committed tree id (``trees`` rows are committed by definition); with
        ``among``, at least those of ``among`` that are stored (only the files whose
        ``tree_id`` bounds can hold one of them are read, so an append's duplicate-id
        check costs a read per file that could clash, not per file of the store)."""
        parts = []
        wanted = None if among is None else _sorted_ids(among)
        for f in self.files("trees", version):
            if wanted is not None and not f.may_hold(wanted):
                continue
            try:
                parts.append(self.loc.read_table(f.path, columns=["tree_id"],
                                                 page_checksum_verification=True
                                                 ).column("tree_id"))
            except (OSError, pa.ArrowException) as exc:
                raise CorruptFileError(f.path, f"cannot be read: {exc}") from exc
        chunks = [c for part in parts for c in part.chunks]
        return pa.chunked_array(chunks, pa.string())

    def _refuse_stored_trees(self, tree_ids: pa.ChunkedArray) -> None:
        stored = self.stored_tree_ids(among=tree_ids)
        clash = pc.is_in(tree_ids, value_set=stored)
        if pc.any(clash).as_py():
            tid = tree_ids[pc.index(clash, True).as_py()].as_py()
            raise TreeValidationError(tid, None, "duplicate_tree_id",
                                      "a tree with this id is already stored")

    def _append_rows(self, name: TableName, table: pa.Table, key: str | None) -> CommitReport:
        check_columns(table, SCHEMAS[name], name)
        key = key or uuid.uuid4().hex
        report = CommitReport(key)
        with self._append_lock():
            self._commit_table(name, table.select(SCHEMAS[name].names), key, report)
        return report

    def append_credits(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``credits`` schema (idempotent per ``key``); every row must
        name a stored node (``unknown_node``)."""
        _check_finite(table, "value", "credits")
        check_columns(table, SCHEMAS["credits"], "credits")
        self._refuse_unknown_nodes(table, "credits")
        return self._append_rows("credits", table, key)

    def stored_node_keys(self, tree_ids: pa.Array | pa.ChunkedArray) -> pa.Table:
        """``tree_id``, ``node_id`` of the committed nodes of ``tree_ids`` (reads only the
        files whose ``tree_id`` bounds can hold one of them)."""
        wanted = pc.unique(tree_ids)
        in_order = _sorted_ids(wanted)
        trees = []
        for f in self.files("trees"):
            if f.may_hold(in_order):
                trees.append(self.loc.read_table(f.path, columns=["tree_id", "commit_key"],
                                                 page_checksum_verification=True))
        parts = []
        if trees:
            stored = pa.concat_tables(trees)
            stored = stored.filter(pc.is_in(stored.column("tree_id"), value_set=wanted))
            keys = pc.unique(stored.column("commit_key"))
            for f in self.files("nodes"):
                if not f.may_hold(in_order):
                    continue
                if (not f.compacted and f.min_key is not None and f.min_key == f.max_key
                        and not pc.is_in(pa.array([f.min_key]), value_set=keys)[0].as_py()):
                    continue  # another append's file (or one that never committed)
                part = self.loc.read_table(f.path,
                                           columns=["tree_id", "node_id", "commit_key"],
                                           page_checksum_verification=True)
                mask = pc.and_(pc.is_in(part.column("tree_id"), value_set=wanted),
                               pc.is_in(part.column("commit_key"), value_set=keys))
                parts.append(part.filter(mask).select(["tree_id", "node_id"]))
        if not parts:
            return pa.table({"tree_id": pa.array([], pa.string()),
                             "node_id": pa.array([], pa.int64())})
        return pa.concat_tables(parts)

    def _refuse_unknown_nodes(self, table: pa.Table, what: str) -> None:
        if not len(table):
            return
        stored = self.stored_node_keys(table.column("tree_id"))

        def keys(t: pa.Table) -> pa.ChunkedArray | pa.Array:
            return pc.binary_join_element_wise(t.column("tree_id"),
                                               pc.cast(t.column("node_id"), pa.string()), "\x00")

        unknown = pc.invert(pc.is_in(keys(table), value_set=keys(stored)))
        if pc.any(unknown).as_py():
            row = pc.index(unknown, True).as_py()
            raise TreeValidationError(str(table["tree_id"][row]), table["node_id"][row].as_py(),
                                      "unknown_node", f"{what} row names a node that is not "
                                                      "stored")

    def append_mc_references(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``mc_references`` schema (idempotent per ``key``)."""
        bad = pc.or_(pc.less(table.column("successes"), 0),
                     pc.greater(table.column("successes"), table.column("k")))
        if len(table) and pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise TreeValidationError(str(table["tree_id"][row]), table["node_id"][row].as_py(),
                                      "mc_reference", "successes must lie in [0, k]")
        check_columns(table, SCHEMAS["mc_references"], "mc_references")
        self._refuse_unknown_nodes(table, "mc_references")
        return self._append_rows("mc_references", table, key)

    def append_policy_scores(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``policy_scores`` schema (idempotent per ``key``); every row
        must name a stored node (``unknown_node``)."""
        _check_finite(table, "value", "policy_scores")
        check_columns(table, SCHEMAS["policy_scores"], "policy_scores")
        self._refuse_unknown_nodes(table, "policy_scores")
        return self._append_rows("policy_scores", table, key)

    def append_labels(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``labels`` schema (idempotent per ``key``); every row must
        name a stored tree (``unknown_tree``) and, where ``node_id`` is set, a stored node
        (``unknown_node``). See ``rollout_store.labels``."""
        check_columns(table, SCHEMAS["labels"], "labels")
        tree_ids = table.column("tree_id")
        unknown = pc.invert(pc.is_in(tree_ids, value_set=self.stored_tree_ids(among=tree_ids)))
        if len(table) and pc.any(unknown).as_py():
            row = pc.index(unknown, True).as_py()
            raise TreeValidationError(str(tree_ids[row]), None, "unknown_tree",
                                      "labels row names a tree that is not stored")
        on_nodes = table.filter(pc.is_valid(table.column("node_id")))
        self._refuse_unknown_nodes(on_nodes, "labels")
        return self._append_rows("labels", table, key)

    def append_metrics(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``metrics`` schema (idempotent per ``key``)."""
        _check_finite(table, "value", "metrics")
        return self._append_rows("metrics", table, key)

    def append_evaluations(self, table: pa.Table, key: str | None = None) -> CommitReport:
        """Commit rows with the ``evaluations`` schema (per-task held-out outcomes;
        idempotent per ``key``)."""
        _check_finite(table, "reward", "evaluations")
        check_columns(table, SCHEMAS["evaluations"], "evaluations")
        return self._append_rows("evaluations", table, key)


def _outside(path: str, full: str, real_root: str | None) -> bool:
    """Whether a data file path from a Delta log leaves its table's directory: absolute,
    a URI, a ``..`` component, or (local stores, ``real_root`` given) a symlink out."""
    if path.startswith(("/", "\\")) or "://" in path or ".." in Path(path).parts:
        return True
    if real_root is None:
        return False
    return os.path.commonpath([real_root, os.path.realpath(full)]) != real_root


def check_data_file(path: str, size: int, loc: Location | None = None) -> None:
    """Raise ``CorruptFileError`` unless ``path`` has ``size`` bytes and reads back cleanly.

    Reads every page with its CRC checked (our writer stores page checksums).
    DuckDB does not check them, so this is what catches a flipped bit. ``loc`` is the
    store's location (needed for a store on object storage).
    """
    try:
        actual = os.stat(path).st_size if loc is None else loc.size(path)
    except FileNotFoundError:
        actual = None
    if actual is None:
        raise CorruptFileError(path, "committed data file is missing")
    if actual != size:
        raise CorruptFileError(path, f"{actual} bytes, the commit recorded {size} (truncated?)")
    try:
        (pq.ParquetFile(path, page_checksum_verification=True) if loc is None
         else loc.parquet_file(path, page_checksum_verification=True)).read()
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
