"""Search a store's trees (``rtrees search``, issue 26): text by regex, tokens by id.

* ``search_regex(store, pattern)``: nodes whose ``action_text`` or ``observation_text``
  matches ``pattern`` (RE2 syntax, DuckDB's ``regexp_matches``; the pattern is a bound
  parameter, never SQL text), with the character offset of the first match
  (0-based, in that text).
* ``search_tokens(store, ids)``: every place where the token ids ``ids`` occur
  contiguously in the token stream of a root-to-leaf path, crossing node boundaries.
  A node's stream is its action tokens then its observation tokens (the root: the
  prompt's observation tokens), and a path's stream is its nodes' streams in order, so
  a match may start in one node's action, run through its observation and end in a
  child's action. Each hit is ``(tree_id, node_id, offset, end_node_id)``: the node where
  the match starts, the offset in that node's stream (action positions first), and the
  node where it ends; a match that continues into several children is one hit per
  child it ends in (its start is shared).

How the token search is fast (benchmarks/bench_search.py: 1M nodes): the search runs
over a ``TokenIndex``, the two token columns as flat arrays with their offsets and the
children of every node as CSR arrays, built from one read of the ``nodes`` table and,
for a local store, kept in ``<store>/.search-index/`` for the store version it was
built at and memory-mapped by later searches (decoding the Parquet token columns is
most of a cold search). Candidates are the positions equal to ``ids[0]`` (one
vectorised comparison); a candidate whose match fits inside its segment is verified by
``len(ids) - 1`` vectorised gathers; only the few candidates whose prefix matches up to
their segment's end are followed into the next segments (the node's observation, then
each child's action) in Python.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_store.reader import StoreLike, as_store, connect, read_arrow
from rollout_store.store import StoreVersion

TOKEN_HITS = pa.schema([pa.field("tree_id", pa.string()), pa.field("node_id", pa.int64()),
                        pa.field("offset", pa.int64()), pa.field("end_node_id", pa.int64())])
TEXT_HITS = pa.schema([pa.field("tree_id", pa.string()), pa.field("node_id", pa.int64()),
                       pa.field("field", pa.string()), pa.field("offset", pa.int64())])


@dataclass(frozen=True)
class SearchResult:
    """The first ``limit`` hits (``hits``) and how many there are in all (``total``)."""

    hits: pa.Table
    total: int

    def summary(self) -> str:
        shown = self.hits.num_rows
        return f"{self.total} hits" + (f" (first {shown} shown)" if shown < self.total else "")


def search_regex(store: StoreLike, pattern: str, limit: int = 100,
                 version: StoreVersion | int | None = None) -> SearchResult:
    """Nodes whose action or observation text matches ``pattern`` (module docstring);
    one hit per (node, field). A bad pattern is DuckDB's ``InvalidInputException``."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    con = connect(as_store(store), version, restricted=True)
    sql = """
        WITH hits AS (
            SELECT tree_id, node_id, 'action' AS field,
                   strpos(action_text, regexp_extract(action_text, $p)) - 1 AS "offset"
            FROM nodes WHERE regexp_matches(action_text, $p)
            UNION ALL
            SELECT tree_id, node_id, 'observation',
                   strpos(observation_text, regexp_extract(observation_text, $p)) - 1
            FROM nodes WHERE regexp_matches(observation_text, $p))
        SELECT *, count(*) OVER () AS total FROM hits
        ORDER BY tree_id, node_id, field LIMIT $n"""
    table = con.sql(sql, params={"p": pattern, "n": int(limit)}).to_arrow_table()
    total = int(table.column("total")[0].as_py()) if table.num_rows else 0
    hits = table.drop_columns(["total"]).cast(TEXT_HITS)
    return SearchResult(hits, total)


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list<int32> column: node i's tokens are
    ``values[offsets[i]:offsets[i + 1]]``; a null list is empty."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    assert isinstance(arr, pa.ListArray)
    arr = pc.fill_null(arr, pa.scalar([], arr.type)) if arr.null_count else arr
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)  # int32, no copy
    values = values[offsets[0]:offsets[-1]] if len(offsets) else values[:0]
    return values, offsets - offsets[0]


TOKEN_COLUMNS = ("tree_id", "node_id", "parent_id", "action_token_ids",
                 "observation_token_ids")
INDEX_DIR = ".search-index"  # in a local store's directory; not a table (see TokenIndex)
_ARRAYS = ("action", "action_offsets", "observation", "observation_offsets", "node_ids",
           "kids", "first")


@dataclass(frozen=True)
class TokenIndex:
    """The flat arrays the token search scans, for the committed nodes of one version.

    ``action[action_offsets[r]:action_offsets[r + 1]]`` are row r's action tokens (int32),
    the same for ``observation``; ``tree_ids`` / ``node_ids`` name the rows; row r's
    children are ``kids[first[r]:first[r + 1]]``. Built from the ``nodes`` table in one
    read (``from_nodes``); for a local store it is saved under ``<store>/.search-index/``
    keyed by the ``trees`` and ``nodes`` table versions (which fix the visible rows) and
    memory-mapped by later searches of that version (``load_index``), so a warm search
    reads no Parquet. A new version builds a new index and removes the old ones.
    """

    action: np.ndarray
    action_offsets: np.ndarray
    observation: np.ndarray
    observation_offsets: np.ndarray
    node_ids: np.ndarray
    kids: np.ndarray
    first: np.ndarray
    tree_ids: pa.Array

    @staticmethod
    def from_nodes(nodes: pa.Table) -> TokenIndex:
        a, ao = _flat(nodes.column("action_token_ids"))
        o, oo = _flat(nodes.column("observation_token_ids"))
        kids, first = _children(nodes)
        return TokenIndex(a, ao, o, oo, np.asarray(nodes.column("node_id").to_numpy(),
                                                   dtype=np.int64),
                          kids, first, nodes.column("tree_id").combine_chunks())

    def save(self, folder: Path) -> None:
        """Write the arrays (``.npy``) and tree ids (Arrow IPC) into ``folder`` atomically
        (a temporary sibling renamed into place)."""
        tmp = folder.with_name(f"{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        for name in _ARRAYS:
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(getattr(self, name)))
        with pa.OSFile(str(tmp / "tree_ids.arrow"), "wb") as sink, \
                pa.ipc.new_file(sink, pa.schema([("tree_id", pa.string())])) as w:
            w.write_table(pa.table({"tree_id": self.tree_ids}))
        try:
            tmp.rename(folder)
        except OSError:  # another search built the same index meanwhile
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def load(folder: Path) -> TokenIndex:
        # np.asarray: plain ndarray views of the maps (no copy); indexing an np.memmap runs
        # its Python __getitem__, 0.5 s of a 1.9 s search that followed 150k candidates
        arrays = {name: np.asarray(np.load(folder / f"{name}.npy", mmap_mode="r"))
                  for name in _ARRAYS}
        tree_ids = pa.ipc.open_file(pa.memory_map(str(folder / "tree_ids.arrow"))
                                    ).read_all().column("tree_id").combine_chunks()
        return TokenIndex(tree_ids=tree_ids, **arrays)


def load_index(store: StoreLike, version: StoreVersion | int | None = None,
               cache: bool = True) -> TokenIndex:
    """The ``TokenIndex`` of ``store`` at ``version`` (latest if None): memory-mapped
    from ``<store>/.search-index/`` when built before, else built from the ``nodes``
    table (and, with ``cache`` on a local store, saved there)."""
    s = as_store(store)
    if not cache or s.loc.remote:
        return TokenIndex.from_nodes(read_arrow(s, "nodes", version, list(TOKEN_COLUMNS)))
    if version is None:  # the two versions that fix the visible nodes (cheaper than all)
        key = {name: s.delta_table(name).version() for name in ("trees", "nodes")}
    else:
        key = dict(s.resolve(version))
    root = Path(str(s.path)) / INDEX_DIR
    folder = root / f"trees{key['trees']}-nodes{key['nodes']}"
    if (folder / "tree_ids.arrow").is_file():
        try:
            return TokenIndex.load(folder)
        except (OSError, ValueError, pa.ArrowException):
            shutil.rmtree(folder, ignore_errors=True)  # damaged: rebuild below
    pinned = s.resolve(version) if version is not None else s.version()
    if {n: pinned[n] for n in key} != key:  # a commit landed meanwhile: index what we read
        folder = root / f"trees{pinned['trees']}-nodes{pinned['nodes']}"
    index = TokenIndex.from_nodes(read_arrow(s, "nodes", pinned, list(TOKEN_COLUMNS)))
    try:
        for old in root.glob("trees*-nodes*"):
            shutil.rmtree(old, ignore_errors=True)
        index.save(folder)
    except OSError:  # a read-only store: search without the cache
        pass
    return index


def search_tokens(store: StoreLike, ids: Sequence[int], limit: int = 100,
                  version: StoreVersion | int | None = None, cache: bool = True
                  ) -> SearchResult:
    """Where ``ids`` occur contiguously along a root-to-leaf path (module docstring), over
    the store's ``TokenIndex`` (built on first use, then reused; ``cache=False`` reads
    the ``nodes`` table every time)."""
    q = _query(ids, limit)
    return _runs(load_index(store, version, cache), q, limit)


def find_token_runs(nodes: pa.Table, ids: Sequence[int] | np.ndarray, limit: int = 100
                    ) -> SearchResult:
    """``search_tokens`` over a nodes table in memory (``TOKEN_COLUMNS`` at least; trees
    whole, any row order)."""
    q = _query(ids, limit)
    return _runs(TokenIndex.from_nodes(nodes), q, limit)


def _query(ids: Sequence[int] | np.ndarray, limit: int) -> np.ndarray:
    q = np.asarray([int(i) for i in ids], dtype=np.int64)
    if q.size == 0:
        raise ValueError("give at least one token id")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    return q


def _runs(index: TokenIndex, q64: np.ndarray, limit: int) -> SearchResult:
    """The search proper (module docstring) over ``index``."""
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    if q64.min() < lo or q64.max() > hi:
        return SearchResult(TOKEN_HITS.empty_table(), 0)  # token ids are int32
    q = q64.astype(np.int32)
    vals = [index.action, index.observation]
    offs = [index.action_offsets, index.observation_offsets]
    lens = [np.diff(o) for o in offs]
    m = q.size
    starts: list[tuple[int, int]] = []  # (node row, offset in the node's stream)
    partial: list[tuple[int, int, int]] = []  # (node row, offset, tokens matched so far)
    for part, (v, o) in enumerate(zip(vals, offs, strict=True)):
        cand = np.flatnonzero(v == q[0])
        if cand.size == 0:
            continue
        row = np.searchsorted(o, cand, side="right") - 1
        room = o[row + 1] - cand  # tokens left in the segment from the candidate on
        ok = np.ones(cand.size, dtype=bool)
        for j in range(1, m):
            inside = room > j
            idx = np.where(inside, cand + j, 0)
            ok &= ~inside | (v[idx] == q[j])
        local = cand - o[row] + (lens[0][row] if part == 1 else 0)
        whole = ok & (room >= m)
        starts += list(zip(row[whole].tolist(), local[whole].tolist(), strict=True))
        cut = ok & (room < m)
        partial += list(zip(row[cut].tolist(), local[cut].tolist(),
                            room[cut].tolist(), strict=True))
    hits: list[tuple[int, int, int]] = [(r, off, r) for r, off in starts]
    if partial:
        hits += _cross(index, vals, offs, lens, q, partial)
    hits.sort(key=lambda h: (h[0], h[1], h[2]))
    shown = hits[:int(limit)]
    rows = pa.array([h[0] for h in shown], pa.int64())
    table = pa.table({
        "tree_id": index.tree_ids.take(rows),
        "node_id": pa.array(index.node_ids[[h[0] for h in shown]], pa.int64()),
        "offset": pa.array([h[1] for h in shown], pa.int64()),
        "end_node_id": pa.array(index.node_ids[[h[2] for h in shown]], pa.int64()),
    }).cast(TOKEN_HITS)
    return SearchResult(table, len(hits))


def _children(nodes: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """The child rows of every row as CSR arrays (vectorised): row r's children are
    ``kids[first[r]:first[r + 1]]``, in row order. A parent's row is found directly when
    every tree's rows are contiguous with node ids 0, 1, ... in row order (as the writer
    lays trees out): row = the tree's first row + parent id; otherwise rows are keyed by
    (tree, node id) packed into one int64 (node ids are below 2**31,
    ``schema.MAX_NODE_ID``) and looked up by sorting."""
    if nodes.num_rows == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    n = nodes.num_rows
    tree = pc.dictionary_encode(nodes.column("tree_id").combine_chunks()).indices
    code = np.asarray(tree.to_numpy(zero_copy_only=False), dtype=np.int64)
    node = np.asarray(nodes.column("node_id").to_numpy(), dtype=np.int64)
    parent = nodes.column("parent_id").combine_chunks()
    has_parent = np.asarray(parent.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    pid = np.asarray(pc.fill_null(parent, 0).to_numpy(), dtype=np.int64)
    parent_row = None
    if np.all(code[1:] >= code[:-1]):  # first-seen codes: each tree's rows contiguous
        start = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])[code]
        if np.array_equal(node, np.arange(n) - start):
            size = np.bincount(code)[code]
            inside = has_parent & (pid >= 0) & (pid < size)
            parent_row = np.where(inside, start + pid, -1)
    if parent_row is None:
        key = (code << 31) | node
        pkey = (code << 31) | pid
        order = np.argsort(key, kind="stable")
        pos = np.minimum(np.searchsorted(key[order], pkey), n - 1)
        parent_row = np.where(has_parent & (key[order][pos] == pkey), order[pos], -1)
    rows = np.flatnonzero(parent_row >= 0)
    by_parent = rows[np.argsort(parent_row[rows], kind="stable")]
    first = np.r_[0, np.cumsum(np.bincount(parent_row[rows], minlength=n))]
    return by_parent, first.astype(np.int64)


def _cross(index: TokenIndex, vals: list[np.ndarray], offs: list[np.ndarray],
           lens: list[np.ndarray], q: np.ndarray, partial: list[tuple[int, int, int]]
           ) -> list[tuple[int, int, int]]:
    """Follow the candidates whose prefix runs to their segment's end into the next
    segments along every path; (start row, offset, end row) of each full match."""
    kids, first = index.kids, index.first
    out: list[tuple[int, int, int]] = []
    want = q.tolist()
    for row, off, matched in partial:
        part = 0 if off < lens[0][row] else 1
        stack = [(row, part, matched)]  # continue after segment (row, part)
        while stack:
            r, p, k = stack.pop()
            nxt = [(r, 1)] if p == 0 else [(int(c), 0) for c in kids[first[r]:first[r + 1]]]
            for nr, np_ in nxt:
                lo = int(offs[np_][nr])
                take = min(int(offs[np_][nr + 1]) - lo, q.size - k)
                if take and vals[np_][lo:lo + take].tolist() != want[k:k + take]:
                    continue
                if k + take == q.size:
                    out.append((row, off, nr))
                else:
                    stack.append((nr, np_, k + take))
    return out


__all__ = ["SearchResult", "TokenIndex", "find_token_runs", "load_index", "search_regex",
           "search_tokens"]
