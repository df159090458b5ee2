"""Reading a store: DuckDB views, polars and pyarrow readers, streaming tree batches.

Every reader resolves one ``StoreVersion`` first and reads exactly the files
committed at that version (never a glob), keeping only ``nodes`` and
``snapshots`` rows whose ``commit_key`` appears in ``trees`` (the commit point
of an append; see ``store.py``).

DuckDB views (``connect``):

* ``trees``, ``nodes``, ``snapshots``, ``credits``, ``mc_references``, ``metrics``:
  the tables, with the columns of ``schema.py``.
* ``paths``: one row per root-to-leaf trajectory: ``tree_id``, ``leaf_id``,
  ``depth``, ``reward``. Leaves are exactly the nodes with a reward (a rule the
  writer enforces), so no anti-join is needed.
* ``siblings``: one row per child of a branching node (a node with two or more
  children): ``tree_id``, ``parent_id``, ``child_id``, ``n_leaves`` and
  ``n_success`` (leaves below the child, and those with
  ``reward >= success_threshold``). Leaves below a child are found with the
  nested-set columns: preorder in ``[child.preorder, child.preorder +
  child.subtree_size)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from rollout_store.schema import SCHEMAS, TABLE_NAMES, TableName
from rollout_store.snapshots import from_stored
from rollout_store.store import (
    CorruptFileError,
    Store,
    StoreError,
    StoreVersion,
    check_data_file,
)
from rollout_store.tree import Tree, trees_from_tables

StoreLike = Store | str | os.PathLike[str]
_KEYED: tuple[TableName, ...] = ("nodes", "snapshots")


def as_store(store: StoreLike) -> Store:
    return store if isinstance(store, Store) else Store(store)


def _scan_format() -> ds.ParquetFileFormat:
    # Page checksums are written by our writer; verify them on every pyarrow read.
    return ds.ParquetFileFormat(
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(
            page_checksum_verification=True
        )
    )


def find_corrupt_file(paths: list[str], cause: BaseException) -> CorruptFileError:
    """Read each file in turn to name the one behind ``cause`` (a failed scan)."""
    for path in paths:
        try:
            pq.ParquetFile(path, page_checksum_verification=True).read()
        except Exception as exc:  # any failure here names the file
            return CorruptFileError(path, f"cannot be read: {exc}")
    return CorruptFileError(", ".join(paths[:3]), f"reading failed: {cause}")


def committed_keys(store: Store, version: StoreVersion) -> pa.Array:
    """The commit keys present in ``trees`` at ``version`` (the committed appends)."""
    table = _read(store, "trees", version, ["commit_key"], None)
    return pc.unique(table.column("commit_key").combine_chunks())


def _dataset(store: Store, name: TableName, version: StoreVersion) -> ds.Dataset | None:
    files = [f.path for f in store.files(name, version)]
    if not files:
        return None
    present = set(store.columns(name))
    schema = pa.schema([f for f in SCHEMAS[name] if f.name in present])
    return ds.dataset(files, schema=schema, format=_scan_format())


def _read(store: Store, name: TableName, version: StoreVersion,
          columns: list[str] | None, keys: pa.Array | None) -> pa.Table:
    dataset = _dataset(store, name, version)
    wanted = columns or SCHEMAS[name].names
    if dataset is None:
        return SCHEMAS[name].empty_table().select(wanted)
    filt = None if keys is None else pc.field("commit_key").isin(keys)
    present = [c for c in wanted if c in dataset.schema.names]
    try:
        table = dataset.to_table(columns=present, filter=filt)
    except (OSError, pa.ArrowException) as exc:
        raise find_corrupt_file(list(dataset.files), exc) from exc
    for c in wanted:  # columns an older schema version lacks read as nulls
        if c not in present:
            f = SCHEMAS[name].field(c)
            table = table.append_column(f, pa.nulls(len(table), f.type))
    return table.select(wanted)


def read_arrow(store: StoreLike, table: TableName, version: StoreVersion | int | None = None,
               columns: list[str] | None = None) -> pa.Table:
    """One table as a pyarrow Table (committed rows only), optionally some columns."""
    s = as_store(store)
    pinned = s.resolve(version)
    keys = committed_keys(s, pinned) if table in _KEYED else None
    return _read(s, table, pinned, columns, keys)


def read_polars(store: StoreLike, table: TableName,
                version: StoreVersion | int | None = None) -> pl.LazyFrame:
    """One table as a polars LazyFrame over the committed files (committed rows only)."""
    s = as_store(store)
    pinned = s.resolve(version)
    files = [f.path for f in s.files(table, pinned)]
    if not files:
        frame = pl.from_arrow(SCHEMAS[table].empty_table())
        assert isinstance(frame, pl.DataFrame)
        return frame.lazy()
    lazy = pl.scan_parquet(files)
    if table in _KEYED:
        keys = committed_keys(s, pinned).to_pylist()
        lazy = lazy.filter(pl.col("commit_key").is_in(keys))
    return lazy


def _sql_list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def connect(store: StoreLike, version: StoreVersion | int | None = None, *,
            success_threshold: float = 1.0, verify_checksums: bool = False,
            con: duckdb.DuckDBPyConnection | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the store's views (see the module docstring).

    ``version`` pins the view: a ``StoreVersion`` (e.g. ``store.version()``), an
    int (time travel to that ``trees`` version), or None for the latest.
    ``success_threshold`` defines a successful leaf in ``siblings``.
    Every committed file is checked to exist with its recorded size first, so a
    truncated file is reported by name here rather than mid-query. DuckDB does
    not check Parquet page checksums: ``verify_checksums`` reads every file once
    with them checked first (slow on large stores), so a flipped bit is reported
    by name instead of read silently.
    """
    s = as_store(store)
    pinned = s.resolve(version)
    con = con or duckdb.connect()
    for name in TABLE_NAMES:
        data_files = s.files(name, pinned)
        if verify_checksums:
            for f in data_files:
                check_data_file(f.path, f.size)
        files = [f.path for f in data_files]
        full = SCHEMAS[name]
        present = set(s.columns(name))
        empty = f"_empty_{name}"
        con.register(empty, full.empty_table())
        if not files:
            source = f"SELECT * FROM {empty}"
        elif present == set(full.names):
            source = f"SELECT * FROM read_parquet({_sql_list(files)})"
        else:  # an older schema version: fill the columns it lacks with nulls
            source = (f"SELECT * FROM {empty} UNION ALL BY NAME "
                      f"SELECT * FROM read_parquet({_sql_list(files)})")
        raw = f"_raw_{name}"
        con.execute(f"CREATE OR REPLACE VIEW {raw} AS {source}")
        if name in _KEYED:
            body = (f"SELECT * FROM {raw} WHERE commit_key IN "
                    "(SELECT DISTINCT commit_key FROM trees)")
        else:
            body = f"SELECT * FROM {raw}"
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")
    con.execute("""
        CREATE OR REPLACE VIEW paths AS
        SELECT tree_id, node_id AS leaf_id, depth, reward
        FROM nodes WHERE reward IS NOT NULL""")
    threshold = float(success_threshold)
    con.execute(f"""
        CREATE OR REPLACE VIEW siblings AS
        WITH kids AS (
            SELECT tree_id, parent_id, node_id, preorder, subtree_size, reward
            FROM nodes WHERE parent_id IS NOT NULL
        ), branching AS (
            SELECT tree_id, parent_id FROM kids GROUP BY tree_id, parent_id
            HAVING count(*) >= 2
        ), leaves AS (
            SELECT tree_id, preorder, reward FROM nodes WHERE reward IS NOT NULL
        )
        SELECT k.tree_id, k.parent_id, k.node_id AS child_id,
               count(*) AS n_leaves,
               count(*) FILTER (WHERE l.reward >= {threshold!r}) AS n_success
        FROM kids k
        SEMI JOIN branching b ON k.tree_id = b.tree_id AND k.parent_id = b.parent_id
        JOIN leaves l ON l.tree_id = k.tree_id
             AND l.preorder >= k.preorder AND l.preorder < k.preorder + k.subtree_size
        GROUP BY k.tree_id, k.parent_id, k.node_id""")
    return con


def iter_tree_batches(store: StoreLike, version: StoreVersion | int | None = None, *,
                      max_rows: int = 65_536,
                      columns: list[str] | None = None) -> Iterator[pa.Table]:
    """Stream the ``nodes`` table as Arrow tables, each holding whole trees only.

    Memory stays bounded by about ``max_rows`` rows plus the rows of trees
    that straddle a file or batch boundary, however large the store: files
    are scanned batch by batch and a tree is emitted once all its
    ``trees.n_nodes`` rows have arrived. ``columns`` must include ``tree_id``
    when given.
    """
    s = as_store(store)
    pinned = s.resolve(version)
    trees = _read(s, "trees", pinned, ["tree_id", "n_nodes", "commit_key"], None)
    if columns is not None and "tree_id" not in columns:
        raise ValueError("columns must include 'tree_id'")
    expected = dict(zip(trees.column("tree_id").to_pylist(),
                        trees.column("n_nodes").to_pylist(), strict=True))
    keys = pc.unique(trees.column("commit_key").combine_chunks())
    dataset = _dataset(s, "nodes", pinned)
    if dataset is None:
        return
    scanner = dataset.scanner(columns=columns, filter=pc.field("commit_key").isin(keys),
                              batch_size=min(max_rows, 65_536), batch_readahead=1,
                              fragment_readahead=1)
    pending: list[pa.RecordBatch] = []
    n_pending = 0
    try:
        for batch in scanner.to_batches():
            if batch.num_rows == 0:
                continue
            pending.append(batch)
            n_pending += batch.num_rows
            if n_pending >= max_rows:
                ready, rest = _split_complete(pa.Table.from_batches(pending), expected)
                pending, n_pending = rest.to_batches(), rest.num_rows
                if ready.num_rows:
                    yield ready
    except (OSError, pa.ArrowException) as exc:
        raise find_corrupt_file(list(dataset.files), exc) from exc
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


def read_trees(store: StoreLike, tree_ids: list[str] | None = None,
               version: StoreVersion | int | None = None) -> list[Tree]:
    """Load whole trees (nodes and decompressed snapshots) into ``Tree`` objects."""
    s = as_store(store)
    pinned = s.resolve(version)
    trees = read_arrow(s, "trees", pinned)
    nodes = read_arrow(s, "nodes", pinned)
    snaps = read_arrow(s, "snapshots", pinned)
    if tree_ids is not None:
        wanted = pa.array(tree_ids, pa.string())
        trees = trees.filter(pc.is_in(trees.column("tree_id"), value_set=wanted))
        nodes = nodes.filter(pc.is_in(nodes.column("tree_id"), value_set=wanted))
        snaps = snaps.filter(pc.is_in(snaps.column("tree_id"), value_set=wanted))
    nodes = nodes.sort_by([("tree_id", "ascending"), ("node_id", "ascending")])
    return trees_from_tables(trees, nodes, from_stored(snaps))


__all__ = ["connect", "iter_tree_batches", "read_arrow", "read_polars", "read_trees"]
