"""Loading the ranking audit's data (``analysis.ranking``, ELPO §5; METHODS.md §2.4) from
the store alone: the children of every branching node with their Monte-Carlo reference
q(c) = successes / k and every audited method's score (``load_ranking_data`` ->
``RankingData``), the methods resolved to their stored credits (``resolve_methods``,
``MethodRef``), and the errors that name the command to run (``RankingError``).

Computation: projected reads of ``nodes``, ``mc_references``, ``trees`` and ``credits``
(``TableSource``: straight from the committed Parquet files of one pinned version, ids
dictionary-encoded as stored, for ``ranking_audit``; or through a DuckDB connection's
views), joined in numpy on one int64 key per (tree, node), give one row per child of
every branching node (reference and every method's score);
pairs are formed with numpy index arithmetic within each prefix and reduced with
``bincount`` (no Python loop per prefix); each bootstrap resample is a vector of tree
counts, so all resamples are one matrix product with per-tree sums. Trees are indexed in
the order the ``nodes`` view first holds them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.stats import RankingStatistics, group_index, ranking_statistics

if TYPE_CHECKING:
    import duckdb

    from rollout_store.schema import TableName
    from rollout_store.store import Store, StoreVersion

RANKING_TABLES: tuple[TableName, ...] = ("trees", "nodes", "credits", "mc_references")
"""The tables the audit reads (``ranking_audit`` pins just these)."""
MissingCredit = Literal["error", "drop"]


class RankingError(RuntimeError):
    """The store lacks what the audit needs (credits, references); the message says what
    to run."""


# ===== the store side (SQL) ==================================================================


@dataclass(frozen=True)
class MethodRef:
    """One method's credits to audit: its name, parameter hash, and the report label."""

    method: str
    params_hash: str
    params_json: str | None
    label: str

    def credit_command(self, store: str) -> str:
        """The ``rtrees credit`` command that computes this credit."""
        cmd = f"rtrees credit --store {store} --method {self.method}"
        try:
            params = json.loads(self.params_json) if self.params_json else {}
        except json.JSONDecodeError:
            params = {}
        if isinstance(params, dict):
            cmd += "".join(f" --param {k}={v}" for k, v in params.items())
        return cmd


_CREDIT_COLUMNS = ("tree_id", "node_id", "value", "created_at", "method", "method_params_hash",
                   "method_params")
_NODE_COLUMNS = ("tree_id", "parent_id", "node_id")
_REFERENCE_COLUMNS = ("tree_id", "node_id", "successes", "k", "policy_version")
_TREE_COLUMNS = ("tree_id", "policy_version")
_CODED = frozenset({"tree_id", "method", "method_params_hash", "method_params",
                    "policy_version", "sampler", "run_id"})  # read dictionary-encoded


class TableSource:
    """Projected reads of a store's tables as Arrow, each (table, columns) read once.

    From a DuckDB connection with the store's views (``rollout_store.connect``; ``SELECT
    columns FROM table``, ``TableSource.of``), or straight from the committed Parquet files
    of one pinned version (``TableSource.pinned``): no DuckDB connection or views, the id
    and name columns (``_CODED``) read dictionary-encoded as Parquet holds them, so joins
    on tree ids hash each distinct id once rather than every row's string.
    """

    def __init__(self, read: Callable[[TableName, tuple[str, ...]], pa.Table]) -> None:
        self._read = read
        self._cache: dict[tuple[TableName, tuple[str, ...]], pa.Table] = {}

    @classmethod
    def of(cls, source: duckdb.DuckDBPyConnection | TableSource) -> TableSource:
        if isinstance(source, TableSource):
            return source
        con = source

        def read(name: TableName, columns: tuple[str, ...]) -> pa.Table:
            # constant table and column names of this module, never user text
            return con.sql(f"SELECT {', '.join(columns)} FROM {name}").to_arrow_table()

        return cls(read)

    @classmethod
    def pinned(cls, store: Store, version: StoreVersion) -> TableSource:
        """Reads of ``store`` at ``version`` (call within ``store.pinned_reads()`` so each
        table's log is read once)."""
        from rollout_store.reader import read_arrow

        def read(name: TableName, columns: tuple[str, ...]) -> pa.Table:
            return read_arrow(store, name, version, list(columns),
                              dictionary=[c for c in columns if c in _CODED])

        return cls(read)

    def table(self, name: TableName, columns: Sequence[str]) -> pa.Table:
        key = (name, tuple(columns))
        if key not in self._cache:
            self._cache[key] = self._read(*key)
        return self._cache[key]


def _unified(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """The column dictionary-encoded, every chunk with one dictionary (first-seen order)."""
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    return column.unify_dictionaries()


def _values(column: pa.ChunkedArray) -> pa.Array:
    """The distinct values of a column (dictionary values when it is encoded: a value
    no row uses may be among them)."""
    column = _unified(column)
    return (column.chunk(0).dictionary if column.num_chunks
            else pa.array([], column.type.value_type))


def _encode(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """(the distinct values in first-seen order, (N,) int64 code of each row: its index
    in them, -1 for a null), for a plain or dictionary-encoded column."""
    column = _unified(column)
    if not column.num_chunks:
        return pa.array([], column.type.value_type), np.zeros(0, np.int64)
    codes = np.empty(len(column), np.int64)  # filled chunk by chunk: one new array
    start = 0
    for c in column.chunks:
        codes[start:start + len(c)] = (c.indices if not c.null_count
                                       else pc.fill_null(c.indices, -1)).to_numpy()
        start += len(c)
    return column.chunk(0).dictionary, codes


def _codes_in(column: pa.ChunkedArray, names: pa.Array, null: int = -1) -> np.ndarray:
    """(N,) int64: each row's index in ``names``, -1 where absent, ``null`` for a null;
    the distinct values are looked up once (cheap for dictionary-encoded ids)."""
    values, codes = _encode(column)
    if values.equals(names):  # the same dictionary (tables written in one tree order)
        return codes if null == -1 else np.where(codes < 0, null, codes)
    found = pc.fill_null(pc.index_in(values, value_set=names), -1).to_numpy()
    lookup = np.append(found.astype(np.int64), null)
    return np.take(lookup, codes, out=codes, mode="wrap")  # code -1 takes the last entry


def credit_hashes(source: duckdb.DuckDBPyConnection | TableSource
                  ) -> dict[str, list[tuple[str, str | None]]]:
    """Every method's parameter hashes with their params JSON (the first non-null one
    stored), most recent first (by the latest ``created_at``; ties by hash)."""
    t = TableSource.of(source).table("credits", _CREDIT_COLUMNS)
    at = pc.cast(t.column("created_at"), pa.int64()).to_numpy()
    methods, hashes = _values(t.column("method")), _values(t.column("method_params_hash"))
    size = len(methods) * len(hashes)
    last = np.full(size, np.iinfo(np.int64).min)
    first = np.full(size, len(at))
    params = t.column("method_params")
    if size == 1:
        # one method, one hash: no per-row codes (each would be an (N,) int64 array)
        present = np.arange(min(len(at), 1))
        last[:] = at.max(initial=last[0])
        has = pc.index(pc.is_valid(params), True).as_py()
        first[:] = len(at) if has < 0 else has
    else:
        pair = _encode(t.column("method"))[1] * len(hashes) + _encode(
            t.column("method_params_hash"))[1]
        has = np.flatnonzero(pc.is_valid(params).to_numpy(zero_copy_only=False))
        np.maximum.at(last, pair, at)
        np.minimum.at(first, pair[has], has)
        present = np.flatnonzero(np.bincount(pair, minlength=size))
    m_names, h_names = methods.to_pylist(), hashes.to_pylist()
    rows = sorted(((m_names[g // len(hashes)], -int(last[g]), h_names[g % len(hashes)],
                    None if first[g] == len(at) else params[int(first[g])].as_py())
                   for g in present), key=lambda r: r[:3])
    out: dict[str, list[tuple[str, str | None]]] = {}
    for method, _, hash_, js in rows:
        out.setdefault(method, []).append((hash_, js))
    return out


def resolve_methods(source: duckdb.DuckDBPyConnection | TableSource, names: Sequence[str],
                    store: str = "STORE") -> list[MethodRef]:
    """``method`` or ``method@HASH`` names to the credits they denote.

    ``method`` alone takes the parameter hash written last; ``method@HASH`` takes
    the one hash starting with HASH. Raises ``RankingError`` naming the command to
    run when a method has no credits.
    """
    if not names:
        raise RankingError("no methods to audit")
    available = credit_hashes(source)
    refs = []
    for name in names:
        method, _, prefix = name.strip().partition("@")
        hashes = available.get(method, [])
        if not hashes:
            raise RankingError(
                f"method {method!r} has no credits in {store}; compute them with: "
                f"rtrees credit --store {store} --method {method}"
                + (f" (methods with credits: {', '.join(sorted(available))})"
                   if available else ""))
        if prefix:
            hits = [(h, p) for h, p in hashes if h.startswith(prefix)]
            if len(hits) != 1:
                raise RankingError(
                    f"{name!r}: {'no' if not hits else 'several'} {method} parameter hashes "
                    f"start with {prefix!r}; stored hashes: {', '.join(h for h, _ in hashes)}")
            h, params = hits[0]
        else:
            h, params = hashes[0]
        refs.append(MethodRef(method, h, params, name.strip()))
    labels = [r.label for r in refs]
    if len(set(labels)) != len(labels):
        raise RankingError(f"methods named twice: {labels}")
    return refs


_BRANCHING_SQL = """
    kids AS (SELECT tree_id, parent_id, node_id FROM nodes WHERE parent_id IS NOT NULL),
    prefixes AS (SELECT tree_id, parent_id FROM kids GROUP BY tree_id, parent_id
                 HAVING count(*) >= 2)"""


def _credit_filter(methods: Sequence[MethodRef], params: dict[str, object]) -> str:
    terms = []
    for i, m in enumerate(methods):
        params[f"m{i}"], params[f"h{i}"] = m.method, m.params_hash
        terms.append(f"(method = $m{i} AND method_params_hash = $h{i})")
    return " OR ".join(terms)


def missing_credit(con: duckdb.DuckDBPyConnection, methods: Sequence[MethodRef]
                   ) -> dict[str, tuple[int, int, str | None]]:
    """Per method label: (trees with a branching node lacking its credit, such trees in
    all, an example tree id). Used to fail before an expensive reference job."""
    params: dict[str, object] = {}
    where = _credit_filter(methods, params)
    rows = con.execute(f"""
        WITH {_BRANCHING_SQL},
        audited AS (SELECT DISTINCT tree_id FROM prefixes),
        have AS (SELECT DISTINCT method, method_params_hash, tree_id FROM credits
                 WHERE {where})
        SELECT h.method, h.method_params_hash, count(DISTINCT h.tree_id)
        FROM have h SEMI JOIN audited a USING (tree_id) GROUP BY ALL""", params).fetchall()
    n_audited = con.sql(f"WITH {_BRANCHING_SQL} SELECT count(DISTINCT tree_id) "
                        "FROM prefixes").fetchall()[0][0]
    have = {(m, h): n for m, h, n in rows}
    out = {}
    for m in methods:
        n_missing = int(n_audited) - int(have.get((m.method, m.params_hash), 0))
        example = None
        if n_missing:
            found = con.execute(f"""
                WITH {_BRANCHING_SQL}
                SELECT min(tree_id) FROM (SELECT DISTINCT tree_id FROM prefixes) a
                WHERE tree_id NOT IN (SELECT tree_id FROM credits WHERE method = $m
                                      AND method_params_hash = $h)""",
                {"m": m.method, "h": m.params_hash}).fetchall()
            example = found[0][0]
        out[m.label] = (n_missing, int(n_audited), example)
    return out


def credit_error(ref: MethodRef, n_missing: int, n_total: int, example: str | None,
                 store: str) -> RankingError:
    return RankingError(
        f"method {ref.label!r} ({ref.method}, params {ref.params_hash}) has no credit for "
        f"{n_missing} of {n_total} audited trees (e.g. {example!r}); compute it with: "
        f"{ref.credit_command(store)}")


@dataclass(frozen=True)
class RankingData:
    """One row per child of every audited prefix, sorted by (tree, prefix, child)."""

    labels: tuple[str, ...]
    tree_ids: list[str]  # tree index -> tree_id
    tree: np.ndarray  # (N,) int64 tree index
    group: np.ndarray  # (N,) int64 prefix index (non-decreasing)
    parent_id: np.ndarray  # (N,) int64
    node_id: np.ndarray  # (N,) int64
    successes: np.ndarray  # (N,) int64
    k_total: np.ndarray  # (N,) int64 rollouts behind the reference (k, or a multiple)
    scores: np.ndarray  # (N, K) float64
    n_prefixes_branching: int = 0  # every branching node of the store
    n_prefixes_missing_reference: int = 0  # some child lacks a reference at this k

    @property
    def q(self) -> np.ndarray:
        return self.successes / self.k_total

    def statistics(self, n_boot: int = 2000, level: float = 0.95,
                   seed: int = 0) -> RankingStatistics:
        return ranking_statistics(self.tree, self.group, self.q, self.scores, self.labels,
                                  n_boot, level, seed)

    def subset(self, tree_mask: np.ndarray) -> RankingData:
        """The rows of the trees with ``tree_mask[tree]`` (a (T,) bool array), prefixes
        renumbered; tree indices and ids are kept (so bootstrap units stay trees)."""
        rows = np.flatnonzero(np.asarray(tree_mask, bool)[self.tree])
        tree, parent = self.tree[rows], self.parent_id[rows]
        return replace(self, tree=tree, group=group_index([tree, parent]), parent_id=parent,
                       node_id=self.node_id[rows], successes=self.successes[rows],
                       k_total=self.k_total[rows], scores=self.scores[rows])

    @staticmethod
    def from_table(table: pa.Table, labels: Sequence[str]) -> RankingData:
        """From columns tree_id, parent_id, node_id, successes, k and one ``s{i}`` score column
        per label (any row order; sorted here unless already sorted by tree and prefix)."""
        enc = pc.dictionary_encode(table.column("tree_id")).combine_chunks()
        tree = enc.indices.to_numpy().astype(np.int64)
        names = enc.dictionary.to_pylist()
        parent = table.column("parent_id").to_numpy().astype(np.int64)
        node = table.column("node_id").to_numpy().astype(np.int64)
        # Sort only when needed: prefixes must be contiguous, trees in first-seen order.
        found = _row_order(tree, parent, node)
        order = slice(None) if found is None else found
        tree, parent, node = tree[order], parent[order], node[order]

        def col(name: str, dtype: type) -> np.ndarray:
            return table.column(name).to_numpy().astype(dtype)[order]

        scores = np.zeros((len(tree), len(labels)))
        for i in range(len(labels)):
            scores[:, i] = col(f"s{i}", np.float64)
        return RankingData(
            labels=tuple(labels), tree_ids=[str(t) for t in names], tree=tree,
            group=group_index([tree, parent]), parent_id=parent, node_id=node,
            successes=col("successes", np.int64), k_total=col("k", np.int64), scores=scores)


@dataclass(frozen=True)
class _NodeKeys:
    """One int64 key per (tree, node): ``code(tree_id) · span + node_id - lo``, tree ids
    coded by their index in ``names``, node ids in ``[lo, lo + span)``; ``dense`` when
    arrays of ``size`` = len(names) · span entries are small enough to index by key."""

    names: pa.Array
    lo: int
    span: int
    dense: bool

    @property
    def size(self) -> int:
        return len(self.names) * self.span

    def of(self, t: pa.Table) -> tuple[np.ndarray, np.ndarray | slice]:
        """(keys, row indices) of the rows of ``t`` (``tree_id``, ``node_id``) whose tree is in
        ``names`` and node in range: the others can match no child. The indices are
        ``slice(None)`` when that is every row (no copy to index with)."""
        code = _codes_in(t.column("tree_id"), self.names)
        node = t.column("node_id").to_numpy().astype(np.int64, copy=False)
        if self.lo:
            node = node - self.lo
        if not len(code) or (code.min() >= 0 and node.min() >= 0 and node.max() < self.span):
            return _keyed(code, self.span, node), slice(None)  # every row (the usual)
        rows = np.flatnonzero((code >= 0) & (node >= 0) & (node < self.span))
        return _keyed(code[rows], self.span, node[rows]), rows


def _keyed(code: np.ndarray, span: int, offset: np.ndarray) -> np.ndarray:
    """``code · span + offset`` (int64) with one new array: an audit's peak memory is its
    page faults, a cost comparable to its arithmetic here."""
    out = np.multiply(code, span, dtype=np.int64)
    out += offset
    return out


def _at_keys(keys: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sorted unique ``keys``: (index of each target in ``keys``, whether it is there)."""
    if not len(keys):
        return np.zeros(len(targets), np.int64), np.zeros(len(targets), bool)
    pos = np.minimum(np.searchsorted(keys, targets), len(keys) - 1)
    return pos, keys[pos] == targets


def _unique_rows(nk: _NodeKeys, keys: np.ndarray, targets: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """With dense keys each held by at most one row (the usual case: one reference, one
    credit per node): (the row of each target key, whether it has one), by one scatter of
    row numbers over the key space; None when keys are sparse or some key has several."""
    if not nk.dense:
        return None
    dtype = np.int32 if len(keys) < 2**31 else np.int64  # half the memory, as often
    index: np.ndarray = np.full(nk.size, -1, dtype)
    index[keys] = np.arange(len(keys), dtype=dtype)
    if np.count_nonzero(index >= 0) != len(keys):
        return None
    rows = index[targets]
    return rows, rows >= 0


def _pick(column: np.ndarray, rows: np.ndarray, hit: np.ndarray, fill: float = 0) -> np.ndarray:
    """``column[rows]`` where ``hit``, else ``fill``."""
    if not len(column):
        return np.full(len(rows), fill, column.dtype)
    picked = column[rows]
    if not hit.all():
        picked[~hit] = fill
    return picked


def _sums_at(nk: _NodeKeys, keys: np.ndarray, columns: Sequence[np.ndarray],
             targets: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """(per column, Σ of its int values at each target key; whether the key has any row)."""
    unique = _unique_rows(nk, keys, targets)
    if unique is not None:  # nothing to add up
        rows, hit = unique
        return [_pick(c, rows, hit).astype(np.int64, copy=False) for c in columns], hit
    if nk.dense:
        n = np.bincount(keys, minlength=nk.size)
        return [np.bincount(keys, c.astype(np.float64), minlength=nk.size)[targets].astype(
            np.int64) for c in columns], n[targets] > 0  # exact: sums < 2^53
    order = np.argsort(keys, kind="stable")
    found, first = np.unique(keys[order], return_index=True)
    pos, hit = _at_keys(found, targets)
    if not len(first):
        return [np.zeros(len(targets), np.int64) for _ in columns], hit
    return [np.add.reduceat(c.astype(np.int64)[order], first)[pos] for c in columns], hit


def _latest_at(nk: _NodeKeys, keys: np.ndarray, created: np.ndarray, values: np.ndarray,
               targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value of the largest ``created`` per target key (ties: the first row), whether the key
    has any row)."""
    unique = _unique_rows(nk, keys, targets)
    if unique is not None:  # one write per node: no sort
        rows, hit = unique
        return _pick(values.astype(np.float64, copy=False), rows, hit), hit
    order = np.lexsort((-created, keys))  # per key the latest first; ties in row order
    found, first = np.unique(keys[order], return_index=True)
    pos, hit = _at_keys(found, targets)
    latest = values[order][first]
    return latest[pos] if len(first) else np.zeros(len(targets)), hit


def _row_order(tree: np.ndarray, parent: np.ndarray, node: np.ndarray) -> np.ndarray | None:
    """The permutation sorting rows by (tree, parent, node), None when already sorted."""
    d_tree, d_parent, d_node = np.diff(tree), np.diff(parent), np.diff(node)
    if np.all((d_tree > 0) | ((d_tree == 0) & ((d_parent > 0) | (
            (d_parent == 0) & (d_node > 0))))):
        return None
    return np.lexsort((node, parent, tree))


@dataclass(frozen=True)
class _Children:
    """Every child of a branching node (a parent with >= 2 children), N rows sorted by
    (tree, parent, node): tree ``names[code]``, trees in the order the ``nodes`` view first
    holds them; the pooled reference (``successes``, ``k``; 0 where ``has_ref`` is false)
    and per method i its latest credit ``scores[:, i]`` (where ``has_score[:, i]``)."""

    names: pa.Array  # (T,) string tree ids
    code: np.ndarray  # (N,) int64, non-decreasing
    parent: np.ndarray  # (N,) int64
    node: np.ndarray  # (N,) int64
    successes: np.ndarray  # (N,) int64
    k: np.ndarray  # (N,) int64
    has_ref: np.ndarray  # (N,) bool
    scores: np.ndarray  # (N, K) float64
    has_score: np.ndarray  # (N, K) bool


def _branching_children(source: TableSource, methods: Sequence[MethodRef],
                        k: int, reference_policy: str | None = None) -> _Children:
    """The children of every branching node with their reference and latest scores:
    ``successes`` = Σ successes and ``k`` = Σ k over the child's ``mc_references`` rows at
    ``k`` from the tree's policy version (or ``reference_policy``; a tree without a
    ``trees`` row has none), and per method the ``value`` of its largest ``created_at``
    (ties: the first row read).

    Four projected reads (``nodes``' ids, the references, ``trees``' policy versions, the
    credits; no token column), joined in numpy on one int64 key per node (``_NodeKeys``:
    tree ids coded once, by their first row in ``nodes``), by ``bincount`` over the key
    space when it is at most 4x the children (else by sorting), rather than as DuckDB hash
    joins and aggregates on string ids (about 4x the bare query of
    ``benchmarks/bench_ranking.py`` on their own).
    """
    nodes = source.table("nodes", _NODE_COLUMNS)
    names, code = _encode(nodes.column("tree_id"))
    # Temporaries are few and freed early: at this size the peak memory's page faults
    # cost about as much as the arithmetic (benchmarks/README.md, the ranking audit).
    is_child = pc.is_valid(nodes.column("parent_id")).to_numpy(zero_copy_only=False)
    code = code[is_child]
    parent = pc.fill_null(nodes.column("parent_id"), 0).to_numpy().astype(
        np.int64, copy=False)[is_child]
    node = nodes.column("node_id").to_numpy().astype(np.int64, copy=False)[is_child]
    del is_child
    lo = int(min(parent.min(), node.min())) if len(node) else 0
    span = int(max(parent.max(), node.max())) - lo + 1 if len(node) else 1
    if len(names) * span * span >= 2**62:
        raise RankingError(f"node ids span {span} in {len(names)} trees: too wide to key")
    if lo:
        parent, node = parent - lo, node - lo  # offsets in [0, span) from here on
    nk = _NodeKeys(names, lo, span, len(names) * span <= 4 * len(node) + 1024)
    prefix = _keyed(code, span, parent)
    if nk.dense:
        sibling = (np.bincount(prefix, minlength=nk.size) >= 2)[prefix]
    else:
        _, inverse, counts = np.unique(prefix, return_inverse=True, return_counts=True)
        sibling = (counts >= 2)[inverse]
        del inverse
    every = bool(sibling.all())  # every child is a sibling (no copies needed)
    rows: np.ndarray | slice = slice(None) if every else np.flatnonzero(sibling)
    del sibling
    prefix, offset = prefix[rows], node[rows]
    same = prefix[1:] == prefix[:-1]  # sorted by (tree, parent, node)? bools only
    if (prefix[1:] < prefix[:-1]).any() or (same & (offset[1:] < offset[:-1])).any():
        order = np.argsort(_keyed(prefix, span, offset), kind="stable")
        rows, every = order if isinstance(rows, slice) else rows[order], False
    del prefix, offset, same
    if not every:
        code, parent, node = code[rows], parent[rows], node[rows]
    target = _keyed(code, span, node)
    if lo:
        parent, node = parent + lo, node + lo

    ref = source.table("mc_references", _REFERENCE_COLUMNS)
    keys, at = nk.of(ref)
    # IS NOT DISTINCT FROM on policy versions, as codes in one vocabulary (null -> -2):
    # the reference's against the named one or its tree's (-3: the tree has no row).
    trees = source.table("trees", _TREE_COLUMNS)
    # Each version once: a named version that is also a tree's own (the audit's policy is
    # the one that collected the trees) must have one code, or the references, coded by
    # their first occurrence, never match the named one's.
    vocab = pc.unique(pa.concat_arrays([
        pc.drop_null(trees.column("policy_version").cast(pa.string())).combine_chunks(),
        pa.array([reference_policy], pa.string())]))
    tree_policy = np.full(len(names) + 1, -3)
    tree_code = _codes_in(trees.column("tree_id"), names)
    tree_policy[tree_code] = _codes_in(trees.column("policy_version"), vocab, -2)
    tree_policy[-1] = -3  # trees outside ``names`` (code -1) hold no child
    one_policy = np.unique(tree_policy[:-1])  # keys hold only trees in ``names``
    want = one_policy[0] if len(one_policy) == 1 else tree_policy[keys // span]
    if reference_policy is not None:
        named = pc.index(vocab, reference_policy).as_py()
        want = np.where(want == -3, -3, named)
    ok = ((ref.column("k").to_numpy()[at] == k)
          & (_codes_in(ref.column("policy_version"), vocab, -2)[at] == want))
    if not ok.all():
        keys, at = keys[ok], np.flatnonzero(ok) if isinstance(at, slice) else at[ok]
    (successes, k_total), has_ref = _sums_at(
        nk, keys, [ref.column(c).to_numpy()[at] for c in ("successes", "k")], target)
    del keys, at, ok, want

    credit = source.table("credits", _CREDIT_COLUMNS)
    pairs = list(dict.fromkeys((m.method, m.params_hash) for m in methods))
    credit_keys, credit_at = nk.of(credit)
    created = pc.cast(credit.column("created_at"), pa.int64()).to_numpy()[credit_at]
    values = credit.column("value").to_numpy().astype(np.float64, copy=False)[credit_at]
    method_names = _values(credit.column("method"))
    hash_names = _values(credit.column("method_params_hash"))
    pair_of = None  # one method, one hash, the one audited: every row is its
    if (len(pairs), len(method_names), len(hash_names)) != (1, 1, 1) or (
            method_names[0].as_py(), hash_names[0].as_py()) != pairs[0]:
        lookup = np.full((len(method_names) + 1, len(hash_names) + 1), -1)  # -1: null
        for j, (method, params_hash) in enumerate(pairs):
            mi = method_names.index(method).as_py()
            hi = hash_names.index(params_hash).as_py()
            if mi >= 0 and hi >= 0:
                lookup[mi, hi] = j
        pair_of = lookup[_encode(credit.column("method"))[1],
                         _encode(credit.column("method_params_hash"))[1]][credit_at]
    latest: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    for j, pair in enumerate(pairs):
        mine = slice(None) if pair_of is None else np.flatnonzero(pair_of == j)
        latest[pair] = _latest_at(nk, credit_keys[mine], created[mine], values[mine], target)
    scores = np.zeros((len(target), len(methods)))
    has_score = np.zeros((len(target), len(methods)), bool)
    for i, m in enumerate(methods):
        scores[:, i], has_score[:, i] = latest[(m.method, m.params_hash)]
    if not has_ref.all():
        successes, k_total = np.where(has_ref, successes, 0), np.where(has_ref, k_total, 0)
    return _Children(nk.names, code, parent, node, successes, k_total, has_ref, scores,
                     has_score)


def load_ranking_data(source: duckdb.DuckDBPyConnection | TableSource,
                      methods: Sequence[MethodRef], k: int,
                      reference_policy: str | None = None, *, store: str = "STORE",
                      on_missing_credit: MissingCredit = "error"
                      ) -> tuple[RankingData, dict[str, str]]:
    """The children of every branching node with their reference and scores
    (``_branching_children``).

    A prefix is audited when every child has a reference (k rollouts, from the tree's
    own policy version or ``reference_policy``). Among audited prefixes a child without
    a method's score means its tree lacks that credit: ``RankingError`` naming the
    ``rtrees credit`` command (``on_missing_credit="error"``), or the method is dropped
    (``"drop"``; returned with the reason). Trees are indexed in the order the ``nodes``
    view first holds them (the bootstrap's resampling units).
    """
    c = _branching_children(TableSource.of(source), methods, k, reference_policy)
    # Complete prefixes (every child referenced); rows are sorted, so prefixes contiguous.
    group = group_index([c.code, c.parent])
    sizes = np.bincount(group)
    n_ref = np.bincount(group, c.has_ref, minlength=len(sizes))
    complete = n_ref == sizes
    n_branching, n_partial = len(sizes), int(np.sum(~complete & (n_ref > 0)))
    every = bool(complete.all())  # the usual: no copy of the children's arrays
    rows: np.ndarray | slice = slice(None) if every else np.flatnonzero(complete[group])
    code = c.code[rows]  # non-decreasing; numbers trees by their first row in ``nodes``
    starts = np.r_[True, code[1:] != code[:-1]] if len(code) else np.zeros(0, bool)
    codes, tree = code[starts], (np.cumsum(starts) - 1).astype(np.int64)
    dropped: dict[str, str] = {}
    keep = []
    for i, m in enumerate(methods):
        missing = ~c.has_score[rows, i]
        if missing.any():
            lacking = np.unique(code[missing])
            example = min(c.names.take(pa.array(lacking)).to_pylist())
            err = credit_error(m, len(lacking), len(codes), example, store)
            if on_missing_credit == "error":
                raise err
            dropped[m.label] = str(err)
        else:
            keep.append(i)
    parent = c.parent[rows]
    scores = c.scores[rows]
    data = RankingData(
        labels=tuple(methods[i].label for i in keep),
        tree_ids=c.names.take(pa.array(codes)).cast(pa.string()).to_pylist(), tree=tree,
        # trees renumbered in order: the prefixes are those of (code, parent) when every
        # one is kept
        group=group if every else group_index([tree, parent]), parent_id=parent,
        node_id=c.node[rows], successes=c.successes[rows], k_total=c.k[rows],
        scores=scores if len(keep) == scores.shape[1] else scores[:, keep],
        n_prefixes_branching=n_branching, n_prefixes_missing_reference=n_partial)
    return data, dropped


# ===== the audit =============================================================================
