"""rollout_store: the archive of rollout trees (Delta Lake tables queried by DuckDB).

>>> from rollout_store import Store, connect
>>> store = Store("my-store", create=True)            # doctest: +SKIP
>>> store.append_trees(trees, key="run-1:batch-0")    # doctest: +SKIP
>>> connect(store).sql("SELECT count(*) FROM paths")  # doctest: +SKIP

Logging from your own training loop: ``TreeLogger`` (``rollout_store.logger``).
"""

from rollout_store.logger import PREVIOUS, LogReport, Step, TreeLogger
from rollout_store.reader import (
    connect,
    iter_tree_batches,
    read_arrow,
    read_polars,
    read_trees,
)
from rollout_store.schema import SCHEMA_VERSION, SCHEMAS, SchemaMismatchError
from rollout_store.store import (
    CommitReport,
    CorruptFileError,
    Store,
    StoreError,
    StoreVersion,
    open_store,
)
from rollout_store.tree import Node, Segment, Tree, TreeBatch
from rollout_store.validate import TreeValidationError

__all__ = [
    "PREVIOUS",
    "SCHEMAS",
    "SCHEMA_VERSION",
    "CommitReport",
    "CorruptFileError",
    "LogReport",
    "Node",
    "SchemaMismatchError",
    "Segment",
    "Step",
    "Store",
    "StoreError",
    "StoreVersion",
    "Tree",
    "TreeBatch",
    "TreeLogger",
    "TreeValidationError",
    "connect",
    "iter_tree_batches",
    "open_store",
    "read_arrow",
    "read_polars",
    "read_trees",
]
