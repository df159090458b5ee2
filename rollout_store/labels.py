"""Labels on trees and nodes (issue 26): ``rtrees label``, the viewer, ``labels_latest``.

A label is ``(tree_id, node_id or None for the whole tree, key, value, author,
created_at)``. Writes only append (``schema.LABELS``): the history stays, and the current
value of a key is the latest row (the reader's ``labels_latest`` view: last write wins).
Clearing a key appends a row with a null value.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Mapping
from datetime import UTC, datetime

import pyarrow as pa

from rollout_store.schema import LABELS
from rollout_store.store import CommitReport, Store

MAX_KEY = 100  # characters
MAX_VALUE = 10_000


def default_author() -> str:
    """``$RTREES_AUTHOR``, else the login name."""
    try:
        return os.environ.get("RTREES_AUTHOR") or getpass.getuser()
    except (KeyError, OSError):  # no login name (a container without passwd entry)
        return "unknown"


def label_rows(tree_id: str, node_id: int | None, values: Mapping[str, str | None],
               author: str | None = None, now: datetime | None = None) -> pa.Table:
    """``labels`` rows setting (or, with a None value, clearing) each key of ``values``;
    ``ValueError`` for an empty or over-long key or value."""
    if not values:
        raise ValueError("give at least one label (KEY=VALUE)")
    for key, value in values.items():
        if not key.strip() or len(key) > MAX_KEY:
            raise ValueError(f"label key {key!r}: 1 to {MAX_KEY} characters")
        if value is not None and len(value) > MAX_VALUE:
            raise ValueError(f"label {key!r}: value longer than {MAX_VALUE} characters")
    if node_id is not None and isinstance(node_id, bool | float):
        raise ValueError(f"node id must be an integer, got {node_id!r}")
    stamp = now or datetime.now(UTC)
    who = author or default_author()
    return pa.Table.from_pylist([
        {"tree_id": tree_id, "node_id": node_id, "key": key.strip(), "value": value,
         "author": who, "created_at": stamp} for key, value in values.items()],
        schema=LABELS)


def write_labels(store: Store, tree_id: str, node_id: int | None,
                 values: Mapping[str, str | None], author: str | None = None,
                 key: str | None = None) -> CommitReport:
    """Append labels of one tree (or one of its nodes); ``TreeValidationError`` when the
    tree or node is not stored, ``ValueError`` for a bad key or value."""
    return store.append_labels(label_rows(tree_id, node_id, values, author), key=key)


__all__ = ["default_author", "label_rows", "write_labels"]
