"""The one schema of a rollout-tree store (docs/reference/store-schema.md), declared once.

Every table of a store is a Delta Lake table whose data files are Parquet
files written with exactly the Arrow schema declared here. The schema carries a
version (``SCHEMA_VERSION``) and a fingerprint (a hash of every table's exact
Arrow schema); both are stored in each Delta table's configuration and checked
when a store is opened:

* a store written by an older schema version opens, provided every column this
  version added is nullable (readers fill it with nulls); a table this version
  added (``ADDED_TABLES``) is created empty when such a store is opened, and a
  table whose schema did not change since its version stays writable;
* a store written by a newer version, or one whose fingerprint does not match
  the declared schema of its version, fails with ``SchemaMismatchError`` naming
  the difference.

Column names are the public interface (issue 2): ``tree_id``, ``node_id``,
``parent_id`` (null at the root), ``reward`` (set exactly at leaves),
``credits.method`` / ``credits.value``, ``mc_references.k`` / ``.successes``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import datetime
from typing import Final, Literal, get_args

import pyarrow as pa

SCHEMA_VERSION: Final[int] = 4
"""2: the policy_scores table; 3: evaluations and labels; 4: ``credits.clip_low`` /
``clip_high`` (added in place on open, ``ADDED_COLUMNS``)."""

TableName = Literal["trees", "nodes", "snapshots", "credits", "mc_references", "metrics",
                    "policy_scores", "evaluations", "labels"]
TABLE_NAMES: Final[tuple[TableName, ...]] = get_args(TableName)

NodeKind = Literal["prompt", "decision", "feedback_response"]
NODE_KINDS: Final[tuple[NodeKind, ...]] = get_args(NodeKind)

SegmentKind = Literal["tool_call", "summary", "answer", "text"]
SEGMENT_KINDS: Final[tuple[SegmentKind, ...]] = get_args(SegmentKind)

# Node ids are per-tree integers in [0, MAX_NODE_ID): the validator packs
# (tree, node) into one int64 key, and int32 keeps the derived columns small.
MAX_NODE_ID: Final[int] = 2**31 - 1

CONFIG_VERSION_KEY: Final[str] = "rollout_trees.schema_version"
CONFIG_FINGERPRINT_KEY: Final[str] = "rollout_trees.schema_fingerprint"
CONFIG_TABLE_KEY: Final[str] = "rollout_trees.table"
PARQUET_METADATA_KEY: Final[bytes] = b"rollout_trees.schema"


def _f(name: str, type_: pa.DataType, nullable: bool = True) -> pa.Field:
    return pa.field(name, type_, nullable=nullable)


TIMESTAMP = pa.timestamp("us", tz="UTC")
REWARD_PARTS = pa.map_(pa.string(), pa.float64())
SEGMENT = pa.struct([_f("kind", pa.string(), False), _f("start", pa.int32(), False),
                     _f("end", pa.int32(), False)])

TREES = pa.schema([
    _f("tree_id", pa.string(), False),
    _f("run_id", pa.string(), False),
    _f("task_id", pa.string(), False),
    _f("env", pa.string(), False),
    _f("env_config", pa.string()),  # JSON
    _f("sampler", pa.string(), False),
    _f("policy_version", pa.string()),
    _f("policy_ref", pa.string()),  # where the checkpoint that produced the tree lives
    _f("budget", pa.int32()),  # n_total rollouts the sampler was allowed
    _f("rollouts_by_phase", pa.map_(pa.string(), pa.int32())),
    _f("seed", pa.int64()),
    _f("critical_node_id", pa.int64()),  # BEL: the localized first irrecoverable step
    _f("n_nodes", pa.int32(), False),  # lets streaming readers know when a tree is whole
    _f("commit_key", pa.string(), False),  # idempotency key of the append that wrote it
    _f("created_at", TIMESTAMP, False),
    _f("meta", pa.string()),  # JSON: anything source-specific (ground truth, import origin)
])

# Columns the caller supplies for each tree; the writer adds n_nodes and commit_key.
TREE_INPUT = pa.schema([f for f in TREES if f.name not in ("n_nodes", "commit_key")])

# Columns the caller supplies for each node; the writer derives the rest.
NODE_INPUT = pa.schema([
    _f("tree_id", pa.string(), False),
    _f("node_id", pa.int64(), False),
    _f("parent_id", pa.int64()),
    _f("kind", pa.string(), False),
    _f("phase", pa.string()),  # sampler phase that spent the rollout (explore, probe, ...)
    _f("action_text", pa.string()),
    _f("action_token_ids", pa.list_(pa.int32())),
    _f("action_logprobs", pa.list_(pa.float32())),
    _f("action_entropies", pa.list_(pa.float32())),
    _f("observation_text", pa.string()),
    _f("observation_token_ids", pa.list_(pa.int32())),
    _f("segments", pa.list_(SEGMENT)),  # token spans of the action: tool call vs summary
    _f("terminal", pa.bool_(), False),
    _f("reward", pa.float64()),  # set exactly at leaves
    _f("reward_parts", REWARD_PARTS),
    _f("snapshot_id", pa.string()),
    _f("n_gen_tokens", pa.int32()),
    _f("tool_calls", pa.int32()),
    _f("meta", pa.string()),
])

# Derived by the writer from the parent pointers (see validate.tree_structure):
# depth (root 0), and a nested-set interval so that "the leaves below node v"
# is the range preorder in [v.preorder, v.preorder + v.subtree_size).
NODE_DERIVED = pa.schema([
    _f("depth", pa.int32(), False),
    _f("preorder", pa.int32(), False),
    _f("subtree_size", pa.int32(), False),
])

# Every stored nodes/snapshots row carries the idempotency key of the append that
# wrote it. An append commits snapshots, then nodes, then the trees rows last:
# readers see only rows whose commit_key appears in ``trees``, so a writer killed
# between those commits leaves nothing visible (see store.py).
COMMIT_KEY = _f("commit_key", pa.string(), False)

NODES = pa.schema([*NODE_INPUT, *NODE_DERIVED, COMMIT_KEY])

SNAPSHOT_INPUT = pa.schema([
    _f("snapshot_id", pa.string(), False),
    _f("tree_id", pa.string(), False),
    _f("env", pa.string(), False),
    _f("state", pa.binary(), False),  # raw environment state; the writer compresses it
])

SNAPSHOTS = pa.schema([
    _f("snapshot_id", pa.string(), False),
    _f("tree_id", pa.string(), False),
    _f("env", pa.string(), False),
    _f("state", pa.binary(), False),  # zstd-compressed
    _f("state_hash", pa.string(), False),  # sha256 of the uncompressed state
    COMMIT_KEY,
])

CREDITS_V3 = pa.schema([
    _f("run_id", pa.string(), False),
    _f("method", pa.string(), False),
    _f("method_params_hash", pa.string(), False),
    _f("method_params", pa.string()),  # JSON of the hyperparameters behind the hash
    _f("tree_id", pa.string(), False),
    _f("node_id", pa.int64(), False),
    _f("value", pa.float64(), False),
    _f("token_values", pa.list_(pa.float32())),  # per-token advantages where the method has them
    _f("policy_version", pa.string()),
    _f("created_at", TIMESTAMP, False),
])
"""``credits`` of schema versions 1-3."""

# Per-token clip epsilons of the clipped surrogate (1 - clip_low <= ratio <= 1 + clip_high)
# of the node's action tokens where the method sets them (ELPO E8, CALIPER C8): a list as
# long as ``token_values``; an empty list where the method sets none (the trainer's
# ``clip_low`` / ``clip_high`` apply); null where not recorded (rows written before
# version 4, imported rows). float64: the trainer compares them with its own epsilons.
CLIP_BOUNDS: Final[tuple[str, ...]] = ("clip_low", "clip_high")
CREDITS = pa.schema([*CREDITS_V3, *(_f(name, pa.list_(pa.float64())) for name in CLIP_BOUNDS)])

MC_REFERENCES = pa.schema([
    _f("run_id", pa.string(), False),
    _f("tree_id", pa.string(), False),
    _f("node_id", pa.int64(), False),
    _f("k", pa.int32(), False),
    _f("successes", pa.int32(), False),
    _f("policy_version", pa.string()),
    _f("created_at", TIMESTAMP, False),
])

METRICS = pa.schema([
    _f("run_id", pa.string(), False),
    _f("step", pa.int64(), False),
    _f("name", pa.string(), False),
    _f("value", pa.float64(), False),
    _f("created_at", TIMESTAMP, False),
])


def metrics_table(run_id: str, step: int, values: Mapping[str, float],
                  created_at: datetime) -> pa.Table:
    """``METRICS`` rows of one run and step: one row per ``values`` item, in its order."""
    n = len(values)
    return pa.table({
        "run_id": pa.array([run_id] * n, pa.string()), "step": pa.array([step] * n, pa.int64()),
        "name": pa.array(list(values), pa.string()),
        "value": pa.array([float(v) for v in values.values()], pa.float64()),
        "created_at": pa.array([created_at] * n, METRICS.field("created_at").type),
    }, schema=METRICS)


# Log-probabilities a named policy gives stored text, computed once and reused (issue 10):
# kind "gold_answer": TRACE T2, value = mean log-prob of the task's gold answer after the
# transcript through the node; kind "action": DSC D3, value = sum of the log-probs of the
# node's own action tokens after the transcript through its parent. Keyed by (tree_id,
# node_id, kind, policy_version) of the scoring policy.
POLICY_SCORES = pa.schema([
    _f("run_id", pa.string(), False),
    _f("tree_id", pa.string(), False),
    _f("node_id", pa.int64(), False),
    _f("kind", pa.string(), False),
    _f("policy_version", pa.string(), False),  # of the scoring policy
    _f("policy_ref", pa.string()),  # the spec that loaded it
    _f("value", pa.float64(), False),
    _f("token_logprobs", pa.list_(pa.float32())),
    _f("created_at", TIMESTAMP, False),
])

# Per-task held-out outcomes of a training run's evaluations (docs/METHODS.md V2: verdicts
# pair arms by seed AND task, so rates alone are not enough). One row per (run_id, step,
# mode, task_index): ``step`` as in ``metrics`` (-1: the starting weights), ``mode``
# "sampled" (temperature 1) or "greedy", ``task_index`` the task's position in the run's
# fixed held-out split, ``eval_seed`` the seed of that evaluation's sampling streams
# (shared by every run evaluated at the same step, so arms pair on it), ``success`` the
# one success rule of the evaluation (reward >= 1).
EVALUATIONS = pa.schema([
    _f("run_id", pa.string(), False),
    _f("step", pa.int64(), False),
    _f("mode", pa.string(), False),
    _f("task_index", pa.int32(), False),
    _f("task_id", pa.string(), False),
    _f("eval_seed", pa.int64(), False),
    _f("reward", pa.float64(), False),
    _f("success", pa.bool_(), False),
    _f("steps", pa.int32(), False),
    _f("created_at", TIMESTAMP, False),
])

# Labels people put on trees and nodes (issue 26: `rtrees label`, the viewer). Append-only
# history: a label is the row with the latest created_at per (tree_id, node_id, key) (the
# reader's ``labels_latest`` view; last write wins), and a null value clears it.
LABELS = pa.schema([
    _f("tree_id", pa.string(), False),
    _f("node_id", pa.int64()),  # null: a label of the whole tree
    _f("key", pa.string(), False),
    _f("value", pa.string()),  # null: the key cleared
    _f("author", pa.string()),
    _f("created_at", TIMESTAMP, False),
])

SCHEMAS: Final[dict[TableName, pa.Schema]] = {
    "trees": TREES,
    "nodes": NODES,
    "snapshots": SNAPSHOTS,
    "credits": CREDITS,
    "mc_references": MC_REFERENCES,
    "metrics": METRICS,
    "policy_scores": POLICY_SCORES,
    "evaluations": EVALUATIONS,
    "labels": LABELS,
}

# Released schemas by version. A new version appends here; never edit an entry.
_V3: Final[dict[TableName, pa.Schema]] = {**SCHEMAS, "credits": CREDITS_V3}
SCHEMA_HISTORY: Final[dict[int, dict[TableName, pa.Schema]]] = {
    1: {name: schema for name, schema in _V3.items()
        if name not in ("policy_scores", "evaluations", "labels")},
    2: {name: schema for name, schema in _V3.items()
        if name not in ("evaluations", "labels")},
    3: _V3,
    4: SCHEMAS,
}
# Tables added after version 1 (a store of an older version lacks them until it is opened
# for writing once; see Store.__init__).
ADDED_TABLES: Final[dict[TableName, int]] = {"policy_scores": 2, "evaluations": 3,
                                             "labels": 3}
# Nullable columns added to an existing table, by the version that added them: a table of
# an older version lacking exactly these is upgraded in place when the store is opened
# (the columns added to its Delta schema, its version and fingerprint set; old rows read
# the columns as null), so it stays writable (see Store.__init__).
ADDED_COLUMNS: Final[dict[TableName, tuple[int, tuple[str, ...]]]] = {
    "credits": (4, CLIP_BOUNDS)}


def describe_type(schema: pa.Schema) -> str:
    """One line per field, ``name: type [not null]``; the fingerprint's input."""
    lines = []
    for field in schema:
        lines.append(f"{field.name}: {field.type}{'' if field.nullable else ' not null'}")
    return "\n".join(lines)


def fingerprint(schema: pa.Schema) -> str:
    """A short sha256 of a table schema's names, types and nullability."""
    return hashlib.sha256(describe_type(schema).encode()).hexdigest()[:16]


def schema_diff(expected: pa.Schema, actual: pa.Schema) -> list[str]:
    """Human-readable differences between two schemas (empty when equal)."""
    out: list[str] = []
    exp = {f.name: f for f in expected}
    act = {f.name: f for f in actual}
    for name, f in exp.items():
        if name not in act:
            out.append(f"missing column {name!r} ({f.type})")
        elif not act[name].type.equals(f.type):
            out.append(f"column {name!r} is {act[name].type}, expected {f.type}")
        elif act[name].nullable and not f.nullable:
            out.append(f"column {name!r} is nullable, expected not null")
    for name in act:
        if name not in exp:
            out.append(f"unexpected column {name!r} ({act[name].type})")
    return out


class SchemaMismatchError(RuntimeError):
    """A store, table or batch does not match the declared schema."""
