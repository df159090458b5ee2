"""Vectorised validation of tree batches, and the structure it derives.

A batch is refused as a whole (``TreeValidationError``) when any tree breaks a
rule; the error names the tree id, the node id and the rule. The rules:

========================  ===================================================
rule                      meaning
========================  ===================================================
``column_type``           a column is missing or has the wrong Arrow type
``node_id_range``         a node id is outside ``[0, 2**31 - 1)``
``duplicate_node_id``     two nodes of one tree share an id
``self_loop``             a node is its own parent
``missing_parent``        a parent id is not a node of the same tree
                          (missing, or a node of another tree)
``no_root`` / ``several_roots``  a tree has zero or several parentless nodes
``cycle``                 following parents from a node never reaches the root
``length_mismatch``       token ids, logprobs (and entropies, when given)
                          have different lengths
``non_finite``            NaN or inf in a reward, a reward part or a logprob
``reward_on_non_leaf`` / ``missing_leaf_reward``  rewards are set exactly at leaves
``unknown_kind``          a node kind outside ``schema.NODE_KINDS``
``bad_segment``           a segment span outside the action's tokens, or an
                          unknown segment kind
``unknown_tree`` / ``empty_tree`` / ``duplicate_tree_id``
                          nodes and ``trees`` rows do not match one to one
``missing_snapshot``      a node names a snapshot the batch does not carry
                          for the node's own tree
``token_id_range``        a negative action or observation token id
``critical_node``         ``critical_node_id`` is not a node of its tree
``unknown_node``          a credit or reference names a node that is not stored
========================  ===================================================

Everything is numpy over whole columns: no Python loop per tree or per node,
except to describe the first offending node once a rule has failed. Tree
walks are pointer-jumping and level-synchronous, so a 100,000-deep chain works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_store.schema import MAX_NODE_ID, NODE_KINDS, SEGMENT_KINDS, schema_diff

_ID_BITS: Final[int] = 31


class TreeValidationError(ValueError):
    """A tree breaks a rule; ``tree_id``, ``node_id`` and ``rule`` say where and which."""

    def __init__(self, tree_id: str | None, node_id: int | None, rule: str, detail: str) -> None:
        self.tree_id = tree_id
        self.node_id = node_id
        self.rule = rule
        self.detail = detail
        where = []
        if tree_id is not None:
            where.append(f"tree {tree_id!r}")
        if node_id is not None:
            where.append(f"node {node_id}")
        prefix = ", ".join(where) + ": " if where else ""
        super().__init__(f"{prefix}[{rule}] {detail}")


@dataclass(frozen=True)
class TreeStructure:
    """What the validator derives from a nodes table (all arrays shaped ``(n_nodes,)``).

    ``depth`` is 0 at the root; ``preorder`` numbers each tree's nodes in
    depth-first order (children by ascending node id), and ``subtree_size``
    counts a node and its descendants, so the subtree of ``v`` is exactly the
    preorder range ``[preorder[v], preorder[v] + subtree_size[v])``.
    ``parent_index`` is the row of each node's parent (-1 at roots).
    """

    depth: np.ndarray
    preorder: np.ndarray
    subtree_size: np.ndarray
    parent_index: np.ndarray
    is_leaf: np.ndarray


def check_columns(table: pa.Table | pa.RecordBatch, expected: pa.Schema, what: str) -> None:
    """Refuse a table whose columns differ from ``expected`` (names, types, nullability).

    delta-rs would silently cast (the string "4" into an int column), so the
    exact Arrow schema is checked here before anything is written.
    """
    diff = schema_diff(expected, table.schema)
    if diff:
        raise TreeValidationError(None, None, "column_type", f"{what}: " + "; ".join(diff))
    for field in expected:
        if not field.nullable and table.column(field.name).null_count:
            raise TreeValidationError(
                None, None, "column_type", f"{what}: column {field.name!r} has nulls"
            )


def _np(arr: pa.ChunkedArray | pa.Array, fill: int | float | None = None) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if fill is not None and arr.null_count:
        arr = pc.fill_null(arr, fill)
    return arr.to_numpy(zero_copy_only=False)


class _Namer:
    """Maps a row index back to (tree id, node id) for error messages."""

    def __init__(self, tree_ids: pa.ChunkedArray, node_ids: np.ndarray) -> None:
        self.tree_ids = tree_ids
        self.node_ids = node_ids

    def fail(self, row: int, rule: str, detail: str) -> TreeValidationError:
        return TreeValidationError(
            str(self.tree_ids[int(row)]), int(self.node_ids[int(row)]), rule, detail
        )


def _list_lengths(col: pa.ChunkedArray) -> np.ndarray:
    return _np(pc.list_value_length(col), fill=0).astype(np.int64)


def _first_nonfinite_row(col: pa.ChunkedArray) -> int | None:
    """Row of the first list element that is NaN or inf, or None."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    flat = _np(pc.list_flatten(arr), fill=0.0)
    bad = ~np.isfinite(flat)
    if not bad.any():
        return None
    parents = _np(pc.list_parent_indices(arr))
    return int(parents[np.argmax(bad)])


def tree_structure(
    tree_ids: pa.ChunkedArray, node_ids: np.ndarray, parent_ids: pa.ChunkedArray
) -> TreeStructure:
    """Check the parent pointers of many trees at once and derive their structure.

    Raises ``TreeValidationError`` for the rules ``node_id_range``,
    ``duplicate_node_id``, ``self_loop``, ``missing_parent``, ``no_root``,
    ``several_roots`` and ``cycle``.
    """
    n = len(node_ids)
    namer = _Namer(tree_ids, node_ids)
    codes = _np(pc.dictionary_encode(tree_ids.combine_chunks()).indices).astype(np.int64)
    n_trees = int(codes.max()) + 1 if n else 0

    bad = (node_ids < 0) | (node_ids >= MAX_NODE_ID)
    if bad.any():
        row = int(np.argmax(bad))
        raise namer.fail(row, "node_id_range", f"node ids must lie in [0, {MAX_NODE_ID})")

    key = (codes << _ID_BITS) | node_ids
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    dup = np.flatnonzero(sorted_key[1:] == sorted_key[:-1])
    if dup.size:
        row = int(order[dup[0] + 1])
        raise namer.fail(row, "duplicate_node_id", "another node of this tree has the same id")

    is_root = _np(pc.is_null(parent_ids)).astype(bool)
    pid = _np(parent_ids, fill=0).astype(np.int64)
    nonroot = np.flatnonzero(~is_root)
    selfloop = nonroot[pid[nonroot] == node_ids[nonroot]]
    if selfloop.size:
        raise namer.fail(int(selfloop[0]), "self_loop", "the node is its own parent")
    prange = (pid[nonroot] < 0) | (pid[nonroot] >= MAX_NODE_ID)
    pkey = (codes[nonroot] << _ID_BITS) | np.where(prange, 0, pid[nonroot])
    pos = np.minimum(np.searchsorted(sorted_key, pkey), max(n - 1, 0))
    found = (sorted_key[pos] == pkey) & ~prange if n else np.zeros(0, bool)
    if not found.all():
        row = int(nonroot[np.argmax(~found)])
        raise namer.fail(
            row, "missing_parent", f"parent {int(pid[row])} is not a node of this tree"
        )
    parent_index = np.full(n, -1, dtype=np.int64)
    parent_index[nonroot] = order[pos]

    roots_per_tree = np.bincount(codes[is_root], minlength=n_trees)
    if (roots_per_tree == 0).any():
        tree = int(np.argmax(roots_per_tree == 0))
        row = int(np.argmax(codes == tree))
        raise TreeValidationError(str(tree_ids[row]), None, "no_root", "no node without a parent")
    if (roots_per_tree > 1).any():
        tree = int(np.argmax(roots_per_tree > 1))
        rows = np.flatnonzero(is_root & (codes == tree))
        raise namer.fail(
            int(rows[1]), "several_roots",
            f"the tree has {rows.size} parentless nodes (first: node {int(node_ids[rows[0]])})",
        )

    depth = _depth_by_pointer_jumping(parent_index, is_root, namer)
    is_leaf = np.ones(n, dtype=bool)
    is_leaf[parent_index[nonroot]] = False
    preorder, subtree_size = _nested_sets(parent_index, node_ids, depth)
    return TreeStructure(depth.astype(np.int32), preorder, subtree_size, parent_index, is_leaf)


def _depth_by_pointer_jumping(
    parent_index: np.ndarray, is_root: np.ndarray, namer: _Namer
) -> np.ndarray:
    """Depth of every node by pointer doubling: O(n log depth), no recursion.

    Invariant: ``anc[i]`` is an ancestor of ``i`` at distance ``dist[i]``;
    roots point to themselves at distance 0. After ceil(log2 n) + 1 rounds every
    node's ``anc`` is a root, unless the node lies on or below a cycle.
    """
    n = parent_index.size
    idx = np.arange(n)
    anc = np.where(is_root, idx, parent_index)
    dist = np.where(is_root, 0, 1).astype(np.int64)
    for _ in range(int(np.ceil(np.log2(max(n, 2)))) + 2):
        done = is_root[anc]
        if done.all():
            return dist
        dist = dist + dist[anc]
        anc = anc[anc]
    stuck = int(np.argmax(~is_root[anc]))
    # Walk from the stuck node until a node repeats: that node closes the cycle.
    seen: set[int] = set()
    row = stuck
    while row not in seen:
        seen.add(row)
        row = int(parent_index[row])
    raise namer.fail(row, "cycle", "following parent ids from this node returns to it")


def _nested_sets(
    parent_index: np.ndarray, node_ids: np.ndarray, depth: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Preorder numbers and subtree sizes, one vectorised pass per depth level.

    Nodes are sorted once by (depth, parent row, node id). Subtree sizes are
    summed bottom-up level by level; preorder is assigned top-down as
    ``pre[child] = pre[parent] + 1 + (sizes of the earlier siblings)``.
    """
    n = parent_index.size
    size = np.ones(n, dtype=np.int64)
    pre = np.zeros(n, dtype=np.int64)
    if n == 0:
        return pre.astype(np.int32), size.astype(np.int32)
    order = np.lexsort((node_ids, parent_index, depth))
    sorted_depth = depth[order]
    max_depth = int(sorted_depth[-1])
    bounds = np.searchsorted(sorted_depth, np.arange(max_depth + 2))
    for d in range(max_depth, 0, -1):
        level = order[bounds[d]:bounds[d + 1]]
        np.add.at(size, parent_index[level], size[level])
    for d in range(1, max_depth + 1):
        level = order[bounds[d]:bounds[d + 1]]
        parents = parent_index[level]
        sizes = size[level]
        csum = np.cumsum(sizes)
        first = np.ones(level.size, dtype=bool)
        first[1:] = parents[1:] != parents[:-1]
        group_start = np.maximum.accumulate(np.where(first, np.arange(level.size), 0))
        before = csum - sizes - (csum[group_start] - sizes[group_start])
        pre[level] = pre[parents] + 1 + before
    return pre.astype(np.int32), size.astype(np.int32)


def validate_nodes(nodes: pa.Table, expected: pa.Schema) -> TreeStructure:
    """Check a nodes table against every node rule; return its derived structure.

    ``nodes`` has the columns of ``expected`` (``schema.NODE_INPUT`` for a new
    batch, ``schema.NODES`` for stored rows), one row per node of any number
    of trees.
    """
    check_columns(nodes, expected, "nodes")
    node_ids = _np(nodes.column("node_id")).astype(np.int64)
    namer = _Namer(nodes.column("tree_id"), node_ids)

    kinds_ok = _np(pc.is_in(nodes.column("kind"), value_set=pa.array(NODE_KINDS)))
    if not kinds_ok.all():
        row = int(np.argmax(~kinds_ok))
        raise namer.fail(
            row, "unknown_kind",
            f"kind {nodes.column('kind')[row].as_py()!r} is not one of {list(NODE_KINDS)}",
        )

    structure = tree_structure(nodes.column("tree_id"), node_ids, nodes.column("parent_id"))

    n_tok = _list_lengths(nodes.column("action_token_ids"))
    n_lp = _list_lengths(nodes.column("action_logprobs"))
    n_ent = _list_lengths(nodes.column("action_entropies"))
    bad = (n_tok != n_lp) | ((n_ent != 0) & (n_ent != n_tok))
    if bad.any():
        row = int(np.argmax(bad))
        raise namer.fail(
            row, "length_mismatch",
            f"{n_tok[row]} action token ids, {n_lp[row]} logprobs, {n_ent[row]} entropies",
        )
    for column in ("action_logprobs", "action_entropies"):
        row_or_none = _first_nonfinite_row(nodes.column(column))
        if row_or_none is not None:
            raise namer.fail(row_or_none, "non_finite", f"NaN or inf in {column}")

    has_reward = _np(pc.is_valid(nodes.column("reward"))).astype(bool)
    reward = _np(nodes.column("reward"), fill=0.0)
    if not np.isfinite(reward).all():
        row = int(np.argmax(~np.isfinite(reward)))
        raise namer.fail(row, "non_finite", f"reward is {reward[row]}")
    parts = nodes.column("reward_parts").combine_chunks()
    part_values = _np(parts.items, fill=0.0)
    if not np.isfinite(part_values).all():
        offsets = _np(parts.offsets)
        row = int(np.searchsorted(offsets, np.argmax(~np.isfinite(part_values)), "right") - 1)
        raise namer.fail(row, "non_finite", "NaN or inf in reward_parts")
    wrong = structure.is_leaf & ~has_reward
    if wrong.any():
        raise namer.fail(int(np.argmax(wrong)), "missing_leaf_reward", "a leaf needs a reward")
    wrong = ~structure.is_leaf & has_reward
    if wrong.any():
        raise namer.fail(
            int(np.argmax(wrong)), "reward_on_non_leaf", "only leaves carry a reward"
        )
    for column in ("action_token_ids", "observation_token_ids"):
        arr = nodes.column(column).combine_chunks()
        flat = _np(pc.list_flatten(arr), fill=0)
        if flat.size and flat.min() < 0:
            row = int(_np(pc.list_parent_indices(arr))[int(np.argmax(flat < 0))])
            raise namer.fail(row, "token_id_range", f"negative token id in {column}")
    _check_segments(nodes.column("segments"), n_tok, namer)
    return structure


def _check_segments(col: pa.ChunkedArray, n_tok: np.ndarray, namer: _Namer) -> None:
    arr = col.combine_chunks()
    flat = pc.list_flatten(arr)
    if len(flat) == 0:
        return
    rows = _np(pc.list_parent_indices(arr)).astype(np.int64)
    start = _np(flat.field("start")).astype(np.int64)
    end = _np(flat.field("end")).astype(np.int64)
    kinds_ok = _np(pc.is_in(flat.field("kind"), value_set=pa.array(SEGMENT_KINDS))).astype(bool)
    bad = (start < 0) | (end < start) | (end > n_tok[rows]) | ~kinds_ok
    if bad.any():
        i = int(np.argmax(bad))
        raise namer.fail(
            int(rows[i]), "bad_segment",
            f"segment {flat[i].as_py()} must be a span of the {n_tok[rows[i]]} action tokens "
            f"with a kind in {list(SEGMENT_KINDS)}",
        )
