"""Content digests of appended tables, recorded with each commit key (issue 13).

Each table's Delta application transaction of an append records ``Transaction(key,
digest)``: a retry under the same key must reproduce the same content, or it is refused
(``store.CommitKeyConflictError``). A digest is SHA-256 over the values of the columns in
``DIGEST_COLUMNS`` (rows sorted, so order-free), cut to 60 bits and offset by 2, since
``LEGACY_TXN_VERSION`` (1) marks appends from before digests were recorded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LEGACY_TXN_VERSION = 1  # appends before digests recorded version 1: nothing to compare


def content_digest(table: pa.Table, columns: Sequence[str], sort: Sequence[str]) -> int:
    """A 60-bit digest of ``columns`` of ``table``, rows sorted by ``sort`` (order-free).

    Canonical: values only (never Arrow buffer bytes, whose null slots and padding are
    undefined). Stored as a Delta application-transaction version, so it is an int >= 2
    (``LEGACY_TXN_VERSION`` is 1)."""
    t = table.select(list(columns))
    if t.num_rows and sort:
        t = t.take(pc.sort_indices(t, sort_keys=[(c, "ascending") for c in sort]))
    h = hashlib.sha256()
    for name in t.column_names:
        h.update(name.encode() + b"\x00")
        _hash_array(h, t.column(name).combine_chunks())
    return int(h.hexdigest()[:15], 16) + 2


def _hash_array(h: Any, arr: pa.Array) -> None:
    typ = arr.type
    h.update(str(typ).encode() + np.asarray(pc.is_valid(arr)).astype(np.uint8).tobytes())
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        h.update(np.asarray(pc.fill_null(pc.list_value_length(arr), -1)).tobytes())
        _hash_array(h, pc.list_flatten(arr))
    elif pa.types.is_string(typ) or pa.types.is_binary(typ):
        filled = pc.fill_null(arr, "" if pa.types.is_string(typ) else b"")
        offsets = np.frombuffer(filled.buffers()[1], np.int32)[
            filled.offset:filled.offset + len(filled) + 1]
        h.update(np.diff(offsets).tobytes())
        data = filled.buffers()[2]
        if data is not None and len(offsets):
            h.update(data.to_pybytes()[offsets[0]:offsets[-1]])
    elif pa.types.is_boolean(typ) or pa.types.is_integer(typ) or pa.types.is_floating(typ):
        fill = False if pa.types.is_boolean(typ) else 0
        h.update(np.asarray(pc.fill_null(arr, fill).to_numpy(zero_copy_only=False)).tobytes())
    else:  # structs, maps, timestamps: rare in digests, canonical through Python values
        h.update(json.dumps(arr.to_pylist(), default=str, sort_keys=True).encode())


# What a retry under the same key must reproduce exactly, per table.
DIGEST_COLUMNS: dict[str, tuple[list[str], list[str]]] = {
    "trees": (["tree_id", "run_id", "task_id", "env", "sampler", "budget", "seed", "n_nodes",
               "critical_node_id"], ["tree_id"]),
    "nodes": (["tree_id", "node_id", "parent_id", "kind", "action_token_ids",
               "observation_token_ids", "terminal", "reward", "snapshot_id"],
              ["tree_id", "node_id"]),
    "snapshots": (["snapshot_id", "tree_id"], ["tree_id", "snapshot_id"]),
    # Row identities only: a recomputed float may differ in its last bits.
    "credits": (["run_id", "method", "method_params_hash", "tree_id", "node_id"],
                ["method", "method_params_hash", "tree_id", "node_id", "run_id"]),
    "mc_references": (["run_id", "tree_id", "node_id", "k"], ["tree_id", "node_id", "k", "run_id"]),
    "metrics": (["run_id", "step", "name"], ["run_id", "step", "name"]),
    "policy_scores": (["run_id", "tree_id", "node_id", "kind", "policy_version"],
                      ["tree_id", "node_id", "kind", "policy_version", "run_id"]),
    "evaluations": (["run_id", "step", "mode", "task_index", "task_id", "eval_seed", "reward",
                     "success"], ["run_id", "step", "mode", "task_index"]),
}


def default_digest(name: str, table: pa.Table) -> int:
    """The digest recorded for an append of ``table`` to ``name`` (see ``DIGEST_COLUMNS``;
    a table without an entry: every column but ``created_at``, in the given order)."""
    if name in DIGEST_COLUMNS:
        return content_digest(table, *DIGEST_COLUMNS[name])
    return content_digest(table, [c for c in table.column_names if c != "created_at"], [])
