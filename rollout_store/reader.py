"""Reading a store: DuckDB views, polars and pyarrow readers, streaming tree batches.

Every reader resolves one ``StoreVersion`` first and reads exactly the files
committed at that version (never a glob). For ``nodes`` and ``snapshots`` it
then keeps only rows of committed appends, those whose ``commit_key`` appears
in ``trees`` (the commit point of an append; see ``store.py``), at file
granularity where it can (``visible_files``): a file holding one key is read
whole when the key is committed and skipped when not; a ``compact-*`` file
holds committed rows only; any other file is filtered row by row.

DuckDB views (``connect``):

* ``trees``, ``nodes``, ``snapshots``, ``credits``, ``mc_references``, ``metrics``,
  ``policy_scores``, ``labels``: the tables, with the columns of ``schema.py``.
* ``labels_latest``: the current labels, the last write per (``tree_id``, ``node_id``,
  ``key``) by ``created_at``, cleared keys (null value) left out; ``labels`` keeps the
  history.
* ``trees_latest``, ``nodes_latest``, ``credits_latest``, ``metrics_latest``: the tables
  without the rows a resumed or retried attempt of a run superseded, and ``attempts``
  (``run_id``, ``attempt``, ``start_iteration``, ``started_at``): the recorded attempts
  (``rollout_store.attempts``).
* ``paths``: one row per root-to-leaf trajectory: ``tree_id``, ``leaf_id``,
  ``depth``, ``reward``. Leaves are exactly the nodes with a reward (a rule the
  writer enforces), so no anti-join is needed.
* ``siblings``: one row per child of a branching node (a node with two or more
  children): ``tree_id``, ``parent_id``, ``child_id``, ``n_leaves`` and
  ``n_success`` (leaves below the child, and those with
  ``reward >= success_threshold``). Leaves below a child are found with the
  nested-set columns: preorder in ``[child.preorder, child.preorder +
  child.subtree_size)``, counted as the difference of a running leaf count at
  the two ends of that range (an equi-join, linear in fan-out; the range join it
  replaces was quadratic: 131 s for 200k children of one node).

``connect_stores({name: store, ...})`` (issue 48, ``rtrees sql --stores``) gives every
view above as the union of several stores' views, each row with a first column
``store``: the tables and ``paths`` as one scan of all the stores' files (each row named
by its file's store) where every store is local and its files hold committed rows only,
every other view as a union of per-store views (each store's in its own schema, so
``siblings`` and the ``*_latest`` views are computed within one store).

A store on object storage (``s3://``) is read the same way: pyarrow reads through the
store's ``S3FileSystem`` (``store.loc``), and DuckDB and polars scan Arrow datasets of the
same file lists over it (DuckDB's httpfs extension would need a download at run time).

duckdb and polars are imported when first used, so that processes that only
write or stream (collectors, the trainer) do not pay for them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollout_store.attempts import create_views
from rollout_store.objectstore import Location
from rollout_store.schema import SCHEMAS, TABLE_NAMES, TableName
from rollout_store.snapshots import from_stored
from rollout_store.sqlguard import QueryLimits, UnsafeSQLError, lock_down, run_limited
from rollout_store.store import (
    CorruptFileError,
    DataFile,
    Store,
    StoreError,
    StoreVersion,
    check_data_file,
)
from rollout_store.tree import Tree, trees_from_tables

if TYPE_CHECKING:
    import duckdb
    import polars as pl
    import pyarrow.dataset as ds

StoreLike = Store | str | os.PathLike[str]
_KEYED: tuple[TableName, ...] = ("nodes", "snapshots")
_STREAM_BATCH = 16_384  # rows decoded at a time while streaming (bounds memory)


def as_store(store: StoreLike) -> Store:
    return store if isinstance(store, Store) else Store(store)


@dataclass(frozen=True)
class Visible:
    """The files of one table version a reader must read, and how.

    ``whole`` files hold committed rows only; ``filtered`` files must be read
    keeping rows whose ``commit_key`` is in ``keys``. ``columns`` are the
    declared columns physically present (an older schema version may lack some).
    """

    whole: list[DataFile]
    filtered: list[DataFile]
    keys: pa.Array
    columns: list[str]

    @property
    def files(self) -> list[DataFile]:
        return self.whole + self.filtered


def committed_keys(store: Store, version: StoreVersion) -> pa.Array:
    """The commit keys present in ``trees`` at ``version`` (the committed appends)."""
    files = store.files("trees", version)
    if not files:
        return pa.array([], pa.string())
    table = _read_files([f.path for f in files], ["commit_key"], loc=store.loc)
    return pc.unique(table.column("commit_key").combine_chunks())


def visible_files(store: Store, name: TableName, version: StoreVersion,
                  keys: pa.Array | None = None) -> Visible:
    """Classify the committed files of ``name`` at ``version`` (see the module docstring)."""
    files = store.files(name, version)
    present = set(store.columns(name, version[name]))
    columns = [c for c in SCHEMAS[name].names if c in present]
    if name not in _KEYED:
        return Visible(files, [], pa.array([], pa.string()), columns)
    keys = committed_keys(store, version) if keys is None else keys
    key_set = set(keys.to_pylist())
    whole, filtered = [], []
    for f in files:
        if f.compacted:
            whole.append(f)
        elif f.min_key is not None and f.min_key == f.max_key:
            if f.min_key in key_set:
                whole.append(f)  # else: an append that never reached its commit point
        else:
            filtered.append(f)
    return Visible(whole, filtered, keys, columns)


def find_corrupt_file(paths: list[str], cause: BaseException,
                      loc: Location | None = None) -> CorruptFileError:
    """Read each file in turn to name the one behind ``cause`` (a failed read)."""
    for path in paths:
        try:
            (pq.ParquetFile(path, page_checksum_verification=True) if loc is None
             else loc.parquet_file(path, page_checksum_verification=True)).read()
        except Exception as exc:  # any failure here names the file
            return CorruptFileError(path, f"cannot be read: {exc}")
    return CorruptFileError(", ".join(paths[:3]), f"reading failed: {cause}")


def _read_files(paths: list[str], columns: list[str],
                keys: pa.Array | None = None, loc: Location | None = None,
                dictionary: Sequence[str] = ()) -> pa.Table:
    """Read ``columns`` of ``paths`` with page checksums verified, optionally key-filtered;
    the ``dictionary`` columns come back dictionary-encoded as Parquet holds them (no
    string is materialised or hashed)."""
    opts = {"read_dictionary": list(dictionary)} if dictionary else {}
    if keys is None and len(paths) > 1:
        try:  # one multi-threaded read: files decode in parallel (and on an object store
            # the round trips overlap); cold `rtrees search` spends most of its time here
            if loc is not None and loc.remote:
                return pq.read_table([loc.fs_path(p) for p in paths], filesystem=loc.fs,
                                     columns=columns, page_checksum_verification=True, **opts)
            return pq.read_table(paths, columns=columns, page_checksum_verification=True,
                                 **opts)
        except (OSError, pa.ArrowException):
            pass  # the file-by-file read below names the file at fault
    parts = []
    for path in paths:
        try:
            cols = columns if keys is None or "commit_key" in columns else [*columns,
                                                                            "commit_key"]
            table = (pq.read_table(path, columns=cols, page_checksum_verification=True, **opts)
                     if loc is None else
                     loc.read_table(path, columns=cols, page_checksum_verification=True,
                                    **opts))
            if keys is not None:
                table = table.filter(pc.is_in(table.column("commit_key"), value_set=keys))
                table = table.select(columns)
        except (OSError, pa.ArrowException) as exc:
            raise CorruptFileError(path, f"cannot be read: {exc}") from exc
        parts.append(table)
    return pa.concat_tables(parts, promote_options="permissive")


def _read(store: Store, name: TableName, version: StoreVersion,
          columns: list[str] | None, dictionary: Sequence[str] = ()) -> pa.Table:
    visible = visible_files(store, name, version)
    wanted = columns or SCHEMAS[name].names
    present = [c for c in wanted if c in visible.columns]
    coded = [c for c in dictionary if c in present]

    def field(c: str) -> pa.Field:
        f = SCHEMAS[name].field(c)
        return f.with_type(pa.dictionary(pa.int32(), f.type)) if c in dictionary else f

    parts = []
    if visible.whole:
        parts.append(_read_files([f.path for f in visible.whole], present, loc=store.loc,
                                 dictionary=coded))
    if visible.filtered:
        parts.append(_read_files([f.path for f in visible.filtered], present, visible.keys,
                                 loc=store.loc, dictionary=coded))
    schema = pa.schema([field(c) for c in present])
    if parts:
        table = pa.concat_tables([p if p.schema.equals(schema) else p.cast(schema)
                                  for p in parts])
    else:
        table = schema.empty_table()
    for c in wanted:  # columns an older schema version lacks read as nulls
        if c not in present:
            f = field(c)
            table = table.append_column(f, pa.nulls(len(table), f.type))
    return table.select(wanted)


def read_arrow(store: StoreLike, table: TableName, version: StoreVersion | int | None = None,
               columns: list[str] | None = None, *,
               dictionary: Sequence[str] = ()) -> pa.Table:
    """One table as a pyarrow Table (committed rows only), optionally some columns.

    ``dictionary`` names string columns to return dictionary-encoded (``dictionary<int32,
    string>``, as Parquet stores them: cheaper to read and to group or join by than the
    strings).
    """
    s = as_store(store)
    return _read(s, table, s.resolve(version), columns, dictionary)


def read_polars(store: StoreLike, table: TableName,
                version: StoreVersion | int | None = None) -> pl.LazyFrame:
    """One table as a polars LazyFrame over the committed files (committed rows only)."""
    import polars as pl

    s = as_store(store)
    visible = visible_files(s, table, s.resolve(version))
    frames = []

    def scan(files: list[DataFile]) -> pl.LazyFrame:
        if not s.loc.remote:
            return pl.scan_parquet([f.path for f in files])
        return pl.scan_pyarrow_dataset(_dataset(s, table, files, visible.columns))

    if visible.whole:
        frames.append(scan(visible.whole))
    if visible.filtered:
        keys = visible.keys.to_pylist()
        frames.append(scan(visible.filtered).filter(pl.col("commit_key").is_in(keys)))
    if not frames:
        empty = pl.from_arrow(SCHEMAS[table].empty_table())
        assert isinstance(empty, pl.DataFrame)
        return empty.lazy()
    return pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0]


def _sql_list(paths: list[DataFile]) -> str:
    return "[" + ", ".join("'" + f.path.replace("'", "''") + "'" for f in paths) + "]"


def _dataset(store: Store, name: TableName, files: list[DataFile],
             columns: list[str]) -> ds.Dataset:
    """An Arrow dataset of exactly ``files`` over the store's filesystem (no listing)."""
    import pyarrow.dataset as ds

    schema = pa.schema([SCHEMAS[name].field(c) for c in columns])
    return ds.dataset([store.loc.fs_path(f.path) for f in files], schema=schema,
                      format="parquet", filesystem=store.loc.fs)


def _scan_sql(con: duckdb.DuckDBPyConnection, store: Store, name: TableName, part: str,
              files: list[DataFile], columns: list[str], tag: str = "") -> str:
    """The FROM clause DuckDB reads ``files`` with: ``read_parquet`` of the file list for a
    local store, a registered Arrow dataset for one on object storage (named with ``tag``,
    so several stores' registrations on one connection stay apart)."""
    if not store.loc.remote:
        return f"read_parquet({_sql_list(files)})"
    view = f"_files_{name}_{part}{tag}"
    con.register(view, _dataset(store, name, files, columns))
    return view


def connect(store: StoreLike, version: StoreVersion | int | None = None, *,
            success_threshold: float = 1.0, verify_checksums: bool = False,
            con: duckdb.DuckDBPyConnection | None = None,
            restricted: bool = False,
            limits: QueryLimits | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the store's views (see the module docstring).

    ``version`` pins the view: a ``StoreVersion`` (e.g. ``store.version()``), an
    int (time travel to that ``trees`` version), or None for the latest.
    ``success_threshold`` defines a successful leaf in ``siblings``.
    Every committed file is checked to exist with its recorded size first, so a
    truncated file is reported by name here rather than mid-query. DuckDB does
    not check Parquet page checksums: ``verify_checksums`` reads every file once
    with them checked first (slow on large stores), so a flipped bit is reported
    by name instead of read silently.

    ``restricted`` locks the connection down for untrusted queries (``rtrees sql``):
    external access is disabled except for the committed data files of this view
    (``allowed_paths``), so a query can neither ``COPY`` over the store nor read
    host files, and the configuration is locked so it cannot be turned back on;
    ``limits`` (default ``QueryLimits()``) bound its memory, threads and temporary disk
    (no spilling unless ``limits.temp_directory`` is given; ``sqlguard.lock_down``).
    Pair it with ``run_query``, which runs only SELECT and EXPLAIN statements, within
    ``limits.timeout_s``.
    """
    s = as_store(store)
    with s.pinned_reads():  # each table's log read once, not three times
        con, readable, _ = _connect(s, version, success_threshold, verify_checksums, con)
    if restricted:  # remote files are read by pyarrow, never by DuckDB itself
        lock_down(con, [] if s.loc.remote else [f.path for f in readable], limits)
    return con


STORE_COLUMN = "store"  # the column ``connect_stores`` adds: which store a row came from
UNION_VIEWS = (*TABLE_NAMES, "labels_latest", "trees_latest", "nodes_latest",
               "credits_latest", "metrics_latest", "attempts", "paths", "siblings")


def connect_stores(stores: Mapping[str, StoreLike], *, success_threshold: float = 1.0,
                   verify_checksums: bool = False, restricted: bool = False,
                   limits: QueryLimits | None = None) -> duckdb.DuckDBPyConnection:
    """One DuckDB connection over several stores (issue 48): every view of ``connect``
    (``UNION_VIEWS``) as the union of the stores' views, each row with a first column
    ``store``, the name the row's store has in ``stores`` ({name: store}, names in the
    order given; the latest version of each).

    Each store's views live in their own schema (``s0``, ``s1``, ...; DuckDB binds a view's
    names in its own schema, so ``paths`` and ``siblings`` are computed per store and tree
    ids may repeat across stores), and the union views in ``main`` read them with ``UNION
    ALL BY NAME`` (a store of an older schema version has NULL in a newer column).
    ``restricted`` locks the connection down exactly as ``connect`` does, allowing the
    committed files of all the stores. ``StoreError`` names a store that is not one;
    ``ValueError`` for no store or an empty or repeated name."""
    import duckdb

    names = list(stores)
    if not names:
        raise ValueError("no store given")
    if any(not n or not n.strip() for n in names):
        raise ValueError("a store's name is empty")
    opened = {name: as_store(stores[name]) for name in names}
    con = duckdb.connect()
    readable: list[str] = []
    # per table: (file, store) of every store's files, while all can be read in one scan
    direct: dict[str, list[tuple[str, str]] | None] = {t: [] for t in TABLE_NAMES}
    for i, name in enumerate(names):
        s = opened[name]
        con.execute(f"CREATE SCHEMA s{i}")
        con.execute(f"USE memory.s{i}")
        with s.pinned_reads():
            _, files, visible = _connect(s, None, success_threshold, verify_checksums, con,
                                         f"_s{i}")
        if not s.loc.remote:
            readable += [f.path for f in files]
        for table, v in visible.items():
            pairs = direct[table]
            if s.loc.remote or v.filtered or len(v.columns) != len(SCHEMAS[table]) \
                    or pairs is None:
                direct[table] = None
            else:
                pairs += [(f.path, name) for f in v.whole]
    con.execute("USE memory.main")
    # Each store's views read their own files, so a query over the union binds (and reads
    # the footer of) every store's files separately; cached footers are read once per
    # connection (it cut planning a 10-store join from 68 ms to 17 ms here). Data files are
    # never rewritten in place (a commit adds new ones), so a cached footer stays true.
    con.execute("SET parquet_metadata_cache = true")
    for view in UNION_VIEWS:
        pairs = direct.get(view)
        if pairs:  # one scan of every store's files, each row named by its file's store
            # (a union of per-store scans paid ~3.5 ms of planning and pipelines per store)
            con.register(f"_store_of_{view}", pa.table({
                "filename": [f for f, _ in pairs], STORE_COLUMN: [n for _, n in pairs]}))
            con.execute(f"""CREATE VIEW {view} AS SELECT m.{STORE_COLUMN}, t.* EXCLUDE (filename)
                FROM read_parquet({_sql_list_paths([f for f, _ in pairs])}, filename = true) t
                JOIN _store_of_{view} m USING (filename)""")
            continue
        if view == "paths" and direct.get("nodes"):  # row by row: no per-store partition
            con.execute(f"CREATE VIEW paths AS SELECT {STORE_COLUMN}, {PATHS_COLUMNS} "
                        "FROM nodes WHERE reward IS NOT NULL")
            continue
        parts = [f"SELECT {_literal(name)} AS {STORE_COLUMN}, * FROM s{i}.{view}"
                 for i, name in enumerate(names)]
        con.execute(f"CREATE VIEW {view} AS " + " UNION ALL BY NAME ".join(parts))
    if restricted:
        lock_down(con, readable, limits)
    return con


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _sql_list_paths(paths: list[str]) -> str:
    return "[" + ", ".join(_literal(p) for p in paths) + "]"


PATHS_COLUMNS = "tree_id, node_id AS leaf_id, depth, reward"  # the paths view's columns


def _connect(s: Store, version: StoreVersion | int | None, success_threshold: float,
             verify_checksums: bool, con: duckdb.DuckDBPyConnection | None, tag: str = ""
             ) -> tuple[duckdb.DuckDBPyConnection, list[DataFile], dict[TableName, Visible]]:
    """The views of one store on ``con`` (a new connection if None), in its current
    schema; registered relations are named with ``tag``. Returns the connection, the
    files its views read and each table's ``Visible`` files."""
    import duckdb

    pinned = s.resolve(version)
    con = con or duckdb.connect()
    keys = committed_keys(s, pinned)
    con.register(f"_committed_keys{tag}", pa.table({"commit_key": keys}))
    readable: list[DataFile] = []
    seen: dict[TableName, Visible] = {}
    for name in TABLE_NAMES:
        visible = visible_files(s, name, pinned, keys)
        seen[name] = visible
        readable += visible.files  # Store.files refuses paths outside the store
        if verify_checksums:
            for f in visible.files:
                check_data_file(f.path, f.size, s.loc)
        full = SCHEMAS[name]
        empty = f"_empty_{name}{tag}"
        con.register(empty, full.empty_table())
        parts = []
        if visible.whole:
            scan = _scan_sql(con, s, name, "whole", visible.whole, visible.columns, tag)
            parts.append(f"SELECT * FROM {scan}")
        if visible.filtered:
            scan = _scan_sql(con, s, name, "filtered", visible.filtered, visible.columns,
                             tag)
            parts.append(f"SELECT * FROM {scan} "
                         f"WHERE commit_key IN (SELECT commit_key FROM _committed_keys{tag})")
        if not parts:
            source = f"SELECT * FROM {empty}"
        elif len(visible.columns) == len(full) and len(parts) == 1:
            source = parts[0]
        else:  # several parts, or an older schema version: align columns by name
            source = " UNION ALL BY NAME ".join([f"SELECT * FROM {empty}", *parts])
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {source}")
    # Last write wins per (tree, node, key); a null value clears the key (schema.LABELS).
    con.execute("""
        CREATE OR REPLACE VIEW labels_latest AS
        SELECT tree_id, node_id, key, value, author, created_at FROM (
            SELECT *, row_number() OVER (PARTITION BY tree_id, node_id, key
                                         ORDER BY created_at DESC) AS _rank
            FROM labels)
        WHERE _rank = 1 AND value IS NOT NULL""")
    create_views(con)  # trees_latest, nodes_latest, credits_latest, metrics_latest, attempts
    con.execute(f"""
        CREATE OR REPLACE VIEW paths AS
        SELECT {PATHS_COLUMNS}
        FROM nodes WHERE reward IS NOT NULL""")
    threshold = float(success_threshold)
    # Linear in fan-out: per tree, a running count of leaves (and successes) in preorder;
    # the leaves below a child are the count at the last node of its preorder range minus
    # the count just before it, found by an equi-join on preorder (no range join).
    con.execute(f"""
        CREATE OR REPLACE VIEW siblings AS
        WITH marked AS (
            SELECT tree_id, node_id, parent_id, preorder, subtree_size,
                   (reward IS NOT NULL)::BIGINT AS leaf,
                   coalesce(reward >= {threshold!r}, false)::BIGINT AS success
            FROM nodes
        ), running AS (
            SELECT *, sum(leaf) OVER w AS leaves_upto, sum(success) OVER w AS successes_upto
            FROM marked
            WINDOW w AS (PARTITION BY tree_id ORDER BY preorder
                         ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
        ), branching AS (
            SELECT tree_id, parent_id FROM nodes WHERE parent_id IS NOT NULL
            GROUP BY tree_id, parent_id HAVING count(*) >= 2
        )
        SELECT k.tree_id, k.parent_id, k.node_id AS child_id,
               (e.leaves_upto - k.leaves_upto + k.leaf)::BIGINT AS n_leaves,
               (e.successes_upto - k.successes_upto + k.success)::BIGINT AS n_success
        FROM running k
        SEMI JOIN branching b ON k.tree_id = b.tree_id AND k.parent_id = b.parent_id
        JOIN running e ON e.tree_id = k.tree_id
             AND e.preorder = k.preorder + k.subtree_size - 1""")
    return con, readable, seen


def run_query(con: duckdb.DuckDBPyConnection, query: str,
              limits: QueryLimits | None = None) -> pa.Table:
    """Run one read-only statement (SELECT or EXPLAIN) and return its rows, within
    ``limits.timeout_s`` seconds and ``limits.rss_growth`` of process memory growth
    (``QueryLimitError`` past either, or past the connection's memory or temporary-disk
    limit; ``rollout_store.sqlguard.run_limited``).

    Anything else (COPY, ATTACH, SET, CREATE, INSERT, PRAGMA, several statements) is
    refused with ``UnsafeSQLError`` (a ``ValueError``) before it runs."""
    import duckdb

    limits = limits or QueryLimits()
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.ParserException as exc:
        raise UnsafeSQLError(f"not valid SQL: {str(exc).splitlines()[0]}") from exc
    if len(statements) != 1:
        raise UnsafeSQLError(f"expected exactly one SQL statement, got {len(statements)}")
    kind = statements[0].type
    if kind not in (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN):
        raise UnsafeSQLError(f"only SELECT and EXPLAIN run here (read-only), not "
                             f"{kind.name}")

    def fetch() -> pa.Table:
        rel = con.sql(query)
        return pa.table({}) if rel is None else rel.to_arrow_table()

    return run_limited(con, fetch, limits)


def _stream_file(loc: Location, f: DataFile, columns: list[str] | None,
                 keys: pa.Array | None) -> Iterator[pa.RecordBatch]:
    """Record batches of one file, decoded a few thousand rows at a time."""
    try:
        parquet = loc.parquet_file(f.path, pre_buffer=False, page_checksum_verification=True)
        cols = None if columns is None else (
            columns if keys is None or "commit_key" in columns else [*columns, "commit_key"])
        for batch in parquet.iter_batches(batch_size=_STREAM_BATCH, columns=cols,
                                          use_threads=False):
            if keys is not None:
                batch = batch.filter(pc.is_in(batch.column("commit_key"), value_set=keys))
                if columns is not None and "commit_key" not in columns:
                    batch = batch.select(columns)
            yield batch
    except (OSError, pa.ArrowException) as exc:
        raise CorruptFileError(f.path, f"cannot be read: {exc}") from exc


def iter_tree_batches(store: StoreLike, version: StoreVersion | int | None = None, *,
                      max_rows: int = 65_536,
                      columns: list[str] | None = None) -> Iterator[pa.Table]:
    """Stream the ``nodes`` table as Arrow tables, each holding whole trees only.

    Memory stays bounded by about ``max_rows`` rows plus the rows of trees
    that straddle a file or batch boundary, however large the store: files
    are read a few thousand rows at a time and a tree is emitted once all its
    ``trees.n_nodes`` rows have arrived. ``columns`` must include ``tree_id``
    when given.
    """
    if columns is not None and "tree_id" not in columns:
        raise ValueError("columns must include 'tree_id'")
    s = as_store(store)
    pinned = s.resolve(version)
    trees = _read(s, "trees", pinned, ["tree_id", "n_nodes"])
    expected = dict(zip(trees.column("tree_id").to_pylist(),
                        trees.column("n_nodes").to_pylist(), strict=True))
    visible = visible_files(s, "nodes", pinned)
    sources = [(f, None) for f in visible.whole] + [(f, visible.keys) for f in visible.filtered]
    pending: list[pa.RecordBatch] = []
    n_pending = 0
    for f, keys in sources:
        for batch in _stream_file(s.loc, f, columns, keys):
            if batch.num_rows == 0:
                continue
            pending.append(batch)
            n_pending += batch.num_rows
            if n_pending >= max_rows:
                ready, rest = _split_complete(pa.Table.from_batches(pending), expected)
                pending, n_pending = rest.to_batches(), rest.num_rows
                if ready.num_rows:
                    yield ready
    if pending:
        ready, rest = _split_complete(pa.Table.from_batches(pending), expected)
        if rest.num_rows:
            tid = rest.column("tree_id")[0].as_py()
            raise StoreError(f"{s.path}: tree {tid!r} has fewer nodes than trees.n_nodes says")
        if ready.num_rows:
            yield ready


def _split_complete(table: pa.Table, expected: dict[str, int]) -> tuple[pa.Table, pa.Table]:
    counts = pc.value_counts(table.column("tree_id"))
    ids = counts.field("values").to_pylist()
    done = [t for t, c in zip(ids, counts.field("counts").to_pylist(), strict=True)
            if c == expected[t]]
    mask = pc.is_in(table.column("tree_id"), value_set=pa.array(done, pa.string()))
    return table.filter(mask), table.filter(pc.invert(mask))


def _rows_of_trees(store: Store, name: TableName, version: StoreVersion,
                   tree_ids: pa.Array, tree_keys: set[str], committed: pa.Array) -> pa.Table:
    """The committed rows of ``name`` (``nodes`` or ``snapshots``) of just ``tree_ids``.

    The filter is pushed down to the scan: a file our writer appended (one commit key)
    whose key is not the commit key of a wanted tree (``tree_keys``) is skipped unread;
    every other file is read with the Parquet predicate ``tree_id IN tree_ids`` (row
    groups whose ``tree_id`` statistics exclude every id are skipped, the rest filtered
    as they are decoded), plus ``commit_key IN committed keys`` for files that hold
    uncommitted rows (``committed``: the commit keys of ``trees``). Columns an older
    schema version lacks read as nulls.
    """
    visible = visible_files(store, name, version, committed)
    wanted = SCHEMAS[name].names
    present = [c for c in wanted if c in visible.columns]
    by_id = pc.field("tree_id").isin(tree_ids)
    parts = []
    for f in visible.whole + visible.filtered:
        if not f.compacted and f.min_key is not None and f.min_key == f.max_key \
                and f.min_key not in tree_keys:
            continue  # an append of other trees only
        clean = f in visible.whole
        predicate = by_id if clean else by_id & pc.field("commit_key").isin(visible.keys)
        cols = present if clean or "commit_key" in present else [*present, "commit_key"]
        try:
            table = store.loc.read_table(f.path, columns=cols, filters=predicate,
                                         page_checksum_verification=True)
        except (OSError, pa.ArrowException) as exc:
            raise CorruptFileError(f.path, f"cannot be read: {exc}") from exc
        parts.append(table.select(present))
    schema = pa.schema([SCHEMAS[name].field(c) for c in present])
    table = (pa.concat_tables([p.cast(schema) for p in parts]) if parts
             else SCHEMAS[name].empty_table().select(present))
    for c in wanted:
        if c not in present:
            field = SCHEMAS[name].field(c)
            table = table.append_column(field, pa.nulls(len(table), field.type))
    return table.select(wanted)


def read_trees(store: StoreLike, tree_ids: list[str] | None = None,
               version: StoreVersion | int | None = None, *,
               snapshots: bool = True) -> list[Tree]:
    """Load whole trees (nodes and, with ``snapshots``, decompressed snapshots) into
    ``Tree`` objects, in ``trees`` table order.

    With ``tree_ids`` only those trees are read: the filter is pushed down to the
    ``nodes`` / ``snapshots`` scans (``_rows_of_trees``: files of other appends are not
    opened, row groups of other trees not decoded), so the cost follows the trees
    asked for, not the store. Without ``snapshots`` trees come back with none.
    """
    s = as_store(store)
    pinned = s.resolve(version)
    trees = read_arrow(s, "trees", pinned)
    if tree_ids is None:
        nodes = read_arrow(s, "nodes", pinned)
        snaps = read_arrow(s, "snapshots", pinned) if snapshots else None
    else:
        wanted = pa.array(list(tree_ids), pa.string())
        committed = pc.unique(trees.column("commit_key").combine_chunks())
        trees = trees.filter(pc.is_in(trees.column("tree_id"), value_set=wanted))
        keys = {k for k in trees.column("commit_key").to_pylist() if k is not None}
        nodes = _rows_of_trees(s, "nodes", pinned, wanted, keys, committed)
        snaps = (_rows_of_trees(s, "snapshots", pinned, wanted, keys, committed) if snapshots
                 else None)
    nodes = nodes.sort_by([("tree_id", "ascending"), ("node_id", "ascending")])
    return trees_from_tables(trees, nodes, None if snaps is None else from_stored(snaps))


__all__ = ["Visible", "committed_keys", "connect", "iter_tree_batches", "read_arrow",
           "read_polars", "read_trees", "run_query", "visible_files"]
