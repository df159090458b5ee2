"""In-memory rollout trees and their columnar batch form.

``Tree`` is what samplers build and what tests compare: a list of ``Node``
records plus the tree's metadata and its environment snapshots. ``TreeBatch``
is the columnar form the store writes (three Arrow tables with the
``schema.*_INPUT`` schemas); converting many trees to one batch is how a
collector commits them together. All walks are iterative (no recursion), so
a 100,000-deep chain works.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_store.schema import (
    NODE_INPUT,
    SNAPSHOT_INPUT,
    TREE_INPUT,
    NodeKind,
    SegmentKind,
)
from rollout_store.validate import (
    TreeStructure,
    TreeValidationError,
    check_columns,
    validate_nodes,
)

TurnRole = Literal["prompt", "action", "observation"]
Turn = tuple[TurnRole, str]
"""One turn of a transcript (``train.policies.base`` declares the same types for policies)."""


def extend_transcript(parent: tuple[Turn, ...], node: Node) -> tuple[Turn, ...]:
    """The transcript through step node ``node``: its parent's transcript, then
    ``("action", action_text)`` and ``("observation", observation_text)``. The one rule
    by which samplers build transcripts as they grow a tree and consumers rebuild them from
    stored trees (``Tree.transcripts``)."""
    return (*parent, ("action", node.action_text or ""),
            ("observation", node.observation_text or ""))


@dataclass(frozen=True)
class Segment:
    """A span ``[start, end)`` of a node's action tokens (a tool call, a summary, ...)."""

    kind: SegmentKind
    start: int
    end: int


@dataclass
class Node:
    """One step: the agent's action and the tool feedback it got (a ``nodes`` row)."""

    node_id: int
    parent_id: int | None
    kind: NodeKind = "decision"
    action_text: str = ""
    action_token_ids: list[int] = field(default_factory=list)
    action_logprobs: list[float] = field(default_factory=list)
    action_entropies: list[float] = field(default_factory=list)
    observation_text: str = ""
    observation_token_ids: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    terminal: bool = False
    reward: float | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    snapshot_id: str | None = None
    n_gen_tokens: int | None = None
    tool_calls: int | None = None
    phase: str | None = None
    meta: dict[str, Any] | None = None


@dataclass
class Tree:
    """A rollout tree: one task instance at one policy version (a ``trees`` row + nodes).

    ``snapshots`` maps snapshot ids to raw environment states (bytes); the
    store compresses them. The prompt is the root's ``observation_text``.
    """

    tree_id: str
    nodes: list[Node]
    run_id: str = "default"
    task_id: str = ""
    env: str = "none"
    sampler: str = "none"
    env_config: dict[str, Any] | None = None
    policy_version: str | None = None
    policy_ref: str | None = None
    budget: int | None = None
    rollouts_by_phase: dict[str, int] = field(default_factory=dict)
    seed: int | None = None
    critical_node_id: int | None = None
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    meta: dict[str, Any] | None = None
    snapshots: dict[str, bytes] = field(default_factory=dict)

    def validate(self) -> TreeStructure:
        """Check every rule of ``validate.py``; raise ``TreeValidationError`` naming the node."""
        return TreeBatch.from_trees([self]).validate()

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"tree {self.tree_id!r} has no node {node_id}")

    def children(self) -> dict[int, list[int]]:
        """Child ids of every node, ascending (leaves map to an empty list)."""
        out: dict[int, list[int]] = {n.node_id: [] for n in self.nodes}
        for n in self.nodes:
            if n.parent_id is not None:
                out.setdefault(n.parent_id, []).append(n.node_id)
        for kids in out.values():
            kids.sort()
        return out

    def root(self) -> Node:
        roots = [n for n in self.nodes if n.parent_id is None]
        if len(roots) != 1:
            raise TreeValidationError(self.tree_id, None, "no_root" if not roots else
                                      "several_roots", f"{len(roots)} parentless nodes")
        return roots[0]

    def preorder(self) -> Iterator[Node]:
        """Nodes in depth-first order, children by ascending id (iterative)."""
        by_id = {n.node_id: n for n in self.nodes}
        kids = self.children()
        stack = [self.root().node_id]
        while stack:
            nid = stack.pop()
            yield by_id[nid]
            stack.extend(reversed(kids[nid]))

    def transcripts(self) -> dict[int, tuple[Turn, ...]]:
        """The transcript through each node, by node id (the text its policy continued
        there): the root's is ``(("prompt", root observation),)``, a step node's its
        parent's extended by ``extend_transcript``."""
        out: dict[int, tuple[Turn, ...]] = {}
        for n in self.preorder():
            out[n.node_id] = ((("prompt", n.observation_text or ""),) if n.parent_id is None
                              else extend_transcript(out[n.parent_id], n))
        return out

    def leaves(self) -> list[Node]:
        kids = self.children()
        return [n for n in self.preorder() if not kids[n.node_id]]

    def path_to(self, node_id: int) -> list[Node]:
        """Nodes from the root to ``node_id`` inclusive (a trajectory when it is a leaf)."""
        by_id = {n.node_id: n for n in self.nodes}
        out = []
        cur: int | None = node_id
        while cur is not None:
            node = by_id[cur]
            out.append(node)
            cur = node.parent_id
            if len(out) > len(by_id):
                raise TreeValidationError(self.tree_id, node_id, "cycle", "parent ids loop")
        return out[::-1]


def _json(obj: dict[str, Any] | None) -> str | None:
    return None if obj is None else json.dumps(obj, sort_keys=True)


def _unjson(text: str | None) -> dict[str, Any] | None:
    return None if text is None else json.loads(text)


@dataclass(frozen=True)
class TreeBatch:
    """Many trees in columnar form: the unit the store validates and commits.

    ``trees`` has ``schema.TREE_INPUT``, ``nodes`` ``schema.NODE_INPUT``,
    ``snapshots`` ``schema.SNAPSHOT_INPUT`` (raw, uncompressed states).
    """

    trees: pa.Table
    nodes: pa.Table
    snapshots: pa.Table

    @staticmethod
    def from_trees(trees: Sequence[Tree]) -> TreeBatch:
        """The columnar form of ``trees``. A value of the wrong type (a str or float id, a
        lone surrogate, an int past its column's range, unserialisable meta) is a
        ``TreeValidationError`` (rule ``column_type``) naming the tree, node and column,
        never a raw Arrow error, and never silently cast (3.7 is not node 3)."""
        tree_rows = _rows(trees, _tree_row, lambda t: (t, None))
        node_rows = _rows([(t, n) for t in trees for n in t.nodes], _node_row,
                          lambda tn: tn)
        snap_rows = _rows([(t, sid, state) for t in trees for sid, state in t.snapshots.items()],
                          _snapshot_row, lambda tss: (tss[0], None))
        return TreeBatch(
            trees=_to_table(tree_rows, TREE_INPUT, "trees"),
            nodes=_to_table(node_rows, NODE_INPUT, "nodes"),
            snapshots=_to_table(snap_rows, SNAPSHOT_INPUT, "snapshots"),
        )

    def validate(self) -> TreeStructure:
        """Validate every tree of the batch (see ``validate.py``); return node structure."""
        return validate_batch(self)

    def to_trees(self) -> list[Tree]:
        """Back to in-memory trees (the inverse of ``from_trees``)."""
        return trees_from_tables(self.trees, self.nodes, self.snapshots)


def _tree_row(t: Tree) -> dict[str, Any]:
    return {
        "tree_id": t.tree_id, "run_id": t.run_id, "task_id": t.task_id, "env": t.env,
        "env_config": _json(t.env_config), "sampler": t.sampler,
        "policy_version": t.policy_version, "policy_ref": t.policy_ref,
        "budget": t.budget, "rollouts_by_phase": list(t.rollouts_by_phase.items()),
        "seed": t.seed, "critical_node_id": t.critical_node_id,
        "created_at": t.created_at, "meta": _json(t.meta),
    }


def _node_row(tn: tuple[Tree, Node]) -> dict[str, Any]:
    t, n = tn
    return {
        "tree_id": t.tree_id, "node_id": n.node_id, "parent_id": n.parent_id,
        "kind": n.kind, "phase": n.phase, "action_text": n.action_text,
        "action_token_ids": n.action_token_ids, "action_logprobs": n.action_logprobs,
        "action_entropies": n.action_entropies,
        "observation_text": n.observation_text,
        "observation_token_ids": n.observation_token_ids,
        "segments": [{"kind": s.kind, "start": s.start, "end": s.end} for s in n.segments],
        "terminal": n.terminal, "reward": n.reward,
        "reward_parts": list(n.reward_parts.items()), "snapshot_id": n.snapshot_id,
        "n_gen_tokens": n.n_gen_tokens, "tool_calls": n.tool_calls,
        "meta": _json(n.meta),
    }


def _snapshot_row(tss: tuple[Tree, str, bytes]) -> dict[str, Any]:
    t, sid, state = tss
    if not isinstance(state, bytes | bytearray | memoryview):
        raise TypeError(f"snapshot {sid!r} state must be bytes, got {type(state).__name__}")
    return {"snapshot_id": sid, "tree_id": t.tree_id, "env": t.env, "state": bytes(state)}


_CONVERSION_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError, UnicodeError,
                      AttributeError)


def _where(obj: Any) -> tuple[str | None, int | None]:
    tree, node = obj if isinstance(obj, tuple) else (obj, None)
    tid = getattr(tree, "tree_id", None)
    nid = getattr(node, "node_id", None)
    return (_printable(tid), nid if isinstance(nid, int) else None)


def _printable(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def _rows(items: Sequence[Any], make: Any, where: Any) -> list[dict[str, Any]]:
    """``[make(i) for i in items]``; a failure names the tree and node of the item."""
    try:
        return [make(i) for i in items]
    except _CONVERSION_ERRORS:
        pass
    for item in items:
        try:
            make(item)
        except _CONVERSION_ERRORS as exc:
            tid, nid = _where(where(item))
            raise TreeValidationError(tid, nid, "column_type",
                                      f"{type(exc).__name__}: {_printable(exc)}") from None
    raise AssertionError("unreachable: the batch conversion failed but no item did")


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _to_table(rows: list[dict[str, Any]], schema: pa.Schema, what: str) -> pa.Table:
    """``rows`` as a table of exactly ``schema``, refusing what Arrow would silently cast."""
    scalar_ints = [f.name for f in schema if pa.types.is_integer(f.type)]
    list_ints = [f.name for f in schema
                 if pa.types.is_list(f.type) and pa.types.is_integer(f.type.value_type)]
    for row in rows:
        for name in scalar_ints:
            value = row[name]
            if value is not None and not _is_int(value):
                raise _row_error(row, f"{what}.{name} must be an integer, got "
                                      f"{type(value).__name__} {value!r}")
    for name in list_ints:
        try:
            inferred = pa.array([row[name] for row in rows])
        except _CONVERSION_ERRORS:
            inferred = None  # mixed types: the conversion below names the row
        if inferred is not None and pa.types.is_list(inferred.type) and not (
                pa.types.is_integer(inferred.type.value_type)
                or pa.types.is_null(inferred.type.value_type)):
            bad = next(r for r in rows if any(not _is_int(x) for x in r[name] or []))
            raise _row_error(bad, f"{what}.{name} must hold integers, got "
                                  f"{inferred.type.value_type}")
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except _CONVERSION_ERRORS:
        pass
    for row in rows:
        for f in schema:
            try:
                pa.array([row[f.name]], f.type)
            except _CONVERSION_ERRORS as exc:
                raise _row_error(row, f"{what}.{f.name}: {type(exc).__name__}: "
                                      f"{_printable(exc)}") from None
    return pa.Table.from_pylist(rows, schema=schema)


def _row_error(row: dict[str, Any], detail: str) -> TreeValidationError:
    nid = row.get("node_id")
    return TreeValidationError(_printable(row.get("tree_id")), nid if _is_int(nid) else None,
                               "column_type", detail)


def trees_from_tables(
    trees: pa.Table, nodes: pa.Table, snapshots: pa.Table | None = None
) -> list[Tree]:
    """Build ``Tree`` objects from rows of the ``trees``/``nodes``/``snapshots`` tables.

    Extra columns (the derived ``depth``, ``preorder``, ... of stored nodes) are
    ignored. ``snapshots.state`` must hold raw (decompressed) states.
    """
    by_tree: dict[str, list[Node]] = {}
    for r in nodes.select(NODE_INPUT.names).to_pylist():
        by_tree.setdefault(r["tree_id"], []).append(Node(
            node_id=r["node_id"], parent_id=r["parent_id"], kind=r["kind"],
            action_text=r["action_text"] or "",
            action_token_ids=r["action_token_ids"] or [],
            action_logprobs=r["action_logprobs"] or [],
            action_entropies=r["action_entropies"] or [],
            observation_text=r["observation_text"] or "",
            observation_token_ids=r["observation_token_ids"] or [],
            segments=[Segment(s["kind"], s["start"], s["end"]) for s in r["segments"] or []],
            terminal=r["terminal"], reward=r["reward"],
            reward_parts=dict(r["reward_parts"] or []), snapshot_id=r["snapshot_id"],
            n_gen_tokens=r["n_gen_tokens"], tool_calls=r["tool_calls"], phase=r["phase"],
            meta=_unjson(r["meta"]),
        ))
    snaps: dict[str, dict[str, bytes]] = {}
    if snapshots is not None:
        for r in snapshots.select(["snapshot_id", "tree_id", "state"]).to_pylist():
            snaps.setdefault(r["tree_id"], {})[r["snapshot_id"]] = r["state"]
    out = []
    for r in trees.select(TREE_INPUT.names).to_pylist():
        out.append(Tree(
            tree_id=r["tree_id"], nodes=by_tree.get(r["tree_id"], []), run_id=r["run_id"],
            task_id=r["task_id"], env=r["env"], sampler=r["sampler"],
            env_config=_unjson(r["env_config"]), policy_version=r["policy_version"],
            policy_ref=r["policy_ref"], budget=r["budget"],
            rollouts_by_phase=dict(r["rollouts_by_phase"] or []), seed=r["seed"],
            critical_node_id=r["critical_node_id"], created_at=r["created_at"],
            meta=_unjson(r["meta"]), snapshots=snaps.get(r["tree_id"], {}),
        ))
    return out


def validate_batch(batch: TreeBatch) -> TreeStructure:
    """All rules of ``validate.py`` over a whole batch, plus the batch-level ones:
    trees and nodes match one to one, and every snapshot a node names is carried."""
    check_columns(batch.trees, TREE_INPUT, "trees")
    check_columns(batch.snapshots, SNAPSHOT_INPUT, "snapshots")
    tree_ids = batch.trees.column("tree_id")
    if len(pc.unique(tree_ids)) != len(tree_ids):
        counts = pc.value_counts(tree_ids).to_pylist()
        dup = next(c["values"] for c in counts if c["counts"] > 1)
        raise TreeValidationError(dup, None, "duplicate_tree_id", "two trees rows share this id")
    structure = validate_nodes(batch.nodes, NODE_INPUT)
    node_trees = batch.nodes.column("tree_id")
    unknown = pc.invert(pc.is_in(node_trees, value_set=tree_ids))
    if pc.any(unknown).as_py():
        row = pc.index(unknown, True).as_py()
        raise TreeValidationError(str(node_trees[row]), int(batch.nodes["node_id"][row].as_py()),
                                  "unknown_tree", "the node's tree has no trees row")
    empty = pc.invert(pc.is_in(tree_ids, value_set=node_trees))
    if pc.any(empty).as_py():
        row = pc.index(empty, True).as_py()
        raise TreeValidationError(str(tree_ids[row]), None, "empty_tree", "the tree has no nodes")
    # A node's snapshot must be carried for the node's own tree: match on (tree, snapshot).
    node_pairs = pc.binary_join_element_wise(node_trees, batch.nodes.column("snapshot_id"),
                                             "\x00")
    snap_pairs = pc.binary_join_element_wise(batch.snapshots.column("tree_id"),
                                             batch.snapshots.column("snapshot_id"), "\x00")
    has_snap = pc.is_valid(batch.nodes.column("snapshot_id"))
    missing = pc.and_(has_snap, pc.invert(pc.is_in(node_pairs, value_set=snap_pairs)))
    if pc.any(missing).as_py():
        row = pc.index(missing, True).as_py()
        sid = batch.nodes.column("snapshot_id")[row].as_py()
        owner = pc.filter(batch.snapshots.column("tree_id"),
                          pc.equal(batch.snapshots.column("snapshot_id"), sid))
        where = (f"it belongs to tree {owner[0].as_py()!r}" if len(owner)
                 else "it is not in the batch")
        raise TreeValidationError(
            str(node_trees[row]), int(batch.nodes["node_id"][row].as_py()),
            "missing_snapshot", f"snapshot {sid!r} is not this tree's: {where}",
        )
    crit = batch.trees.column("critical_node_id")
    if crit.null_count < len(crit):
        tree_pairs = pc.binary_join_element_wise(
            tree_ids, pc.cast(crit, pa.string()), "\x00")
        node_keys = pc.binary_join_element_wise(
            node_trees, pc.cast(batch.nodes.column("node_id"), pa.string()), "\x00")
        bad = pc.and_(pc.is_valid(crit), pc.invert(pc.is_in(tree_pairs, value_set=node_keys)))
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise TreeValidationError(str(tree_ids[row]), int(crit[row].as_py()),
                                      "critical_node", "critical_node_id is not a node of "
                                                       "this tree")
    return structure
