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

How the token search is fast (benchmarks/bench_search.py: 1M nodes): the two token
columns are read as flat Arrow arrays (no per-node Python), candidates are the
positions equal to ``ids[0]`` (one vectorised comparison), and a candidate whose match
fits inside its segment is verified by ``len(ids) - 1`` vectorised gathers; only the
few candidates whose prefix matches up to their segment's end are followed into the
next segments (the node's observation, then each child's action) in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def search_tokens(store: StoreLike, ids: Sequence[int], limit: int = 100,
                  version: StoreVersion | int | None = None) -> SearchResult:
    """Where ``ids`` occur contiguously along a root-to-leaf path (module docstring)."""
    q = np.asarray([int(i) for i in ids], dtype=np.int64)
    if q.size == 0:
        raise ValueError("give at least one token id")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    nodes = read_arrow(store, "nodes", version, columns=list(TOKEN_COLUMNS))
    return find_token_runs(nodes, q, limit)


TOKEN_COLUMNS = ("tree_id", "node_id", "parent_id", "action_token_ids",
                 "observation_token_ids")


def find_token_runs(nodes: pa.Table, ids: Sequence[int] | np.ndarray, limit: int = 100
                    ) -> SearchResult:
    """``search_tokens`` over a nodes table in memory (``TOKEN_COLUMNS`` at least; trees
    whole, any row order)."""
    q = np.asarray(ids, dtype=np.int64)
    if q.size == 0:
        raise ValueError("give at least one token id")
    if q.min() < np.iinfo(np.int32).min or q.max() > np.iinfo(np.int32).max:
        return SearchResult(TOKEN_HITS.empty_table(), 0)  # token ids are int32
    q = q.astype(np.int32)
    n = nodes.num_rows
    # segment 2i: node i's action tokens; 2i + 1: its observation tokens
    vals, offs, lens = [], [], []
    for col in ("action_token_ids", "observation_token_ids"):
        v, o = _flat(nodes.column(col))
        vals.append(v)
        offs.append(o)
        lens.append(np.diff(o))
    m = q.size
    starts: list[tuple[int, int]] = []  # (node row, offset in the node's stream)
    partial: list[tuple[int, int, int]] = []  # (node row, offset, tokens matched so far)
    for part, (v, o) in enumerate(zip(vals, offs, strict=True)):
        cand = np.flatnonzero(v == q[0])
        if cand.size == 0:
            continue
        row = np.searchsorted(o, cand, side="right") - 1
        end = o[row + 1]
        room = end - cand  # tokens left in the segment from the candidate on
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
        hits += _cross(nodes, vals, offs, lens, q, partial)
    hits.sort(key=lambda h: (h[0], h[1], h[2]))
    total = len(hits)
    shown = hits[:int(limit)]
    rows = np.asarray([h[0] for h in shown], dtype=np.int64)
    table = pa.table({
        "tree_id": nodes.column("tree_id").take(pa.array(rows)) if n else pa.array([], pa.string()),
        "node_id": nodes.column("node_id").take(pa.array(rows)) if n else pa.array([], pa.int64()),
        "offset": pa.array([h[1] for h in shown], pa.int64()),
        "end_node_id": nodes.column("node_id").take(pa.array([h[2] for h in shown],
                                                             pa.int64()))
        if n else pa.array([], pa.int64()),
    }).cast(TOKEN_HITS)
    return SearchResult(table, total)


def _children(nodes: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """The child rows of every row as CSR arrays (vectorised): row r's children are
    ``kids[first[r]:first[r + 1]]``. Rows are keyed by (tree, node id) packed into one
    int64 (node ids are below 2**31, ``schema.MAX_NODE_ID``)."""
    tree = pc.dictionary_encode(nodes.column("tree_id").combine_chunks()).indices
    code = np.asarray(tree.to_numpy(zero_copy_only=False), dtype=np.int64) << 31
    key = code | np.asarray(nodes.column("node_id").to_numpy(), dtype=np.int64)
    parent = nodes.column("parent_id").combine_chunks()
    has_parent = np.asarray(parent.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    pkey = code | np.asarray(pc.fill_null(parent, 0).to_numpy(), dtype=np.int64)
    order = np.argsort(key, kind="stable")
    pos = np.searchsorted(key[order], pkey)
    pos = np.minimum(pos, len(order) - 1)
    parent_row = np.where(has_parent & (key[order][pos] == pkey), order[pos], -1)
    rows = np.flatnonzero(parent_row >= 0)
    by_parent = rows[np.argsort(parent_row[rows], kind="stable")]
    first = np.searchsorted(parent_row[by_parent], np.arange(nodes.num_rows + 1))
    return by_parent, first


def _cross(nodes: pa.Table, vals: list[np.ndarray], offs: list[np.ndarray],
           lens: list[np.ndarray], q: np.ndarray, partial: list[tuple[int, int, int]]
           ) -> list[tuple[int, int, int]]:
    """Follow the candidates whose prefix runs to their segment's end into the next
    segments along every path; (start row, offset, end row) of each full match."""
    kids, first = _children(nodes)
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


__all__ = ["SearchResult", "find_token_runs", "search_regex", "search_tokens"]
