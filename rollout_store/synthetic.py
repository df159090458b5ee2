"""Fast synthetic tree batches for demos and benchmarks (numpy, no hypothesis).

``bel_shaped_batch`` builds trees shaped like ELPO's BEL sampler output: one
full trajectory per task, then suffixes branching from intermediate nodes of
the existing tree, ``rollouts`` leaves per tree, so prefixes are shared.
Texts are words drawn from a small vocabulary so compression ratios are not
flattered by random bytes; token ids index that vocabulary.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from rollout_store.schema import NODE_INPUT, SNAPSHOT_INPUT, TREE_INPUT
from rollout_store.tree import TreeBatch

_VOCAB = (
    "the of to and a in is it that for step tool call answer compute value result error "
    "check plan first then next total sum multiply add divide number order item cart price "
    "flight book seat date city search query return ok failed retry because so we need "
    "let me use calc python output print x y z 0 1 2 3 4 5 6 7 8 9 10 12 15 20 25 42 100"
)
_WORDS = np.array(_VOCAB.split())


def _lists(lengths: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, type_))


def bel_shaped_batch(
    n_trees: int,
    rollouts: int = 16,
    depth: int = 6,
    action_tokens: tuple[int, int] = (8, 40),
    observation_tokens: tuple[int, int] = (8, 60),
    snapshot_bytes: int = 0,
    seed: int = 0,
    tree_prefix: str = "tree",
    run_id: str = "synthetic",
) -> TreeBatch:
    """``n_trees`` trees of ``rollouts`` leaves each, every leaf at depth ``depth``.

    Rollout 0 is a full chain below the root; rollout r > 0 branches from a
    uniformly chosen non-leaf node of the tree so far and runs to depth
    ``depth``. Leaves get a 0/1 reward. With ``snapshot_bytes > 0`` every
    non-root node carries a snapshot of that many (compressible) bytes.
    """
    rng = np.random.default_rng(seed)
    tree_col: list[int] = []
    node_col: list[int] = []
    parent_col: list[int] = []
    depth_col: list[int] = []
    for t in range(n_trees):
        parents = [-1]
        depths = [0]
        inner: list[int] = [0]  # non-leaf nodes so far
        for r in range(rollouts):
            start = 0 if r == 0 else inner[int(rng.integers(len(inner)))]
            cur = start
            for d in range(depths[start] + 1, depth + 1):
                parents.append(cur)
                depths.append(d)
                cur = len(parents) - 1
                if d < depth:
                    inner.append(cur)
        n = len(parents)
        tree_col += [t] * n
        node_col += range(n)
        parent_col += parents
        depth_col += depths
    tree_idx = np.asarray(tree_col)
    node_ids = np.asarray(node_col, dtype=np.int64)
    parent = np.asarray(parent_col, dtype=np.int64)
    n_nodes = node_ids.size
    is_root = parent < 0
    is_leaf = np.asarray(depth_col) == depth
    tree_names = np.array([f"{tree_prefix}-{seed}-{t:07d}" for t in range(n_trees)], dtype=object)

    a_len = rng.integers(*action_tokens, size=n_nodes)
    a_len[is_root] = 0
    o_len = rng.integers(*observation_tokens, size=n_nodes)
    o_len[is_root] *= 3  # the prompt
    a_ids = rng.integers(0, _WORDS.size, size=int(a_len.sum())).astype(np.int32)
    o_ids = rng.integers(0, _WORDS.size, size=int(o_len.sum())).astype(np.int32)
    logprobs = -rng.exponential(0.5, size=a_ids.size).astype(np.float32)
    entropies = rng.exponential(1.0, size=a_ids.size).astype(np.float32)
    a_text = [" ".join(w) for w in np.split(_WORDS[a_ids], np.cumsum(a_len)[:-1])]
    o_text = [" ".join(w) for w in np.split(_WORDS[o_ids], np.cumsum(o_len)[:-1])]
    reward = np.where(is_leaf, rng.integers(0, 2, size=n_nodes).astype(np.float64), np.nan)
    kinds = np.where(is_root, "prompt", np.where(rng.random(n_nodes) < 0.5, "decision",
                                                 "feedback_response"))
    seg_len = np.where(is_root, 0, 1)
    seg_struct = pa.StructArray.from_arrays(
        [pa.array(["tool_call"] * int(seg_len.sum())),
         pa.array(np.zeros(int(seg_len.sum()), np.int32)),
         pa.array(a_len[~is_root].astype(np.int32))],
        fields=list(NODE_INPUT.field("segments").type.value_type),
    )
    snap_ids = None
    if snapshot_bytes:
        snap_ids = pa.array([None if r else f"{tree_names[t]}/{i}" for t, i, r in
                             zip(tree_idx, node_ids, is_root, strict=True)], pa.string())
    columns = {
        "tree_id": pa.array(tree_names[tree_idx], pa.string()),
        "node_id": pa.array(node_ids),
        "parent_id": pa.array(parent, mask=is_root),
        "kind": pa.array(kinds, pa.string()),
        "phase": pa.array([None if r else "explore" for r in is_root], pa.string()),
        "action_text": pa.array(a_text, pa.string()),
        "action_token_ids": _lists(a_len, a_ids, pa.int32()),
        "action_logprobs": _lists(a_len, logprobs, pa.float32()),
        "action_entropies": _lists(a_len, entropies, pa.float32()),
        "observation_text": pa.array(o_text, pa.string()),
        "observation_token_ids": _lists(o_len, o_ids, pa.int32()),
        "segments": pa.ListArray.from_arrays(
            pa.array(np.concatenate([[0], np.cumsum(seg_len)]).astype(np.int32)), seg_struct),
        "terminal": pa.array(is_leaf),
        "reward": pa.array(reward, mask=~is_leaf),
        "reward_parts": pa.array([[("outcome", float(r))] if leaf else None
                                  for r, leaf in zip(reward, is_leaf, strict=True)],
                                 NODE_INPUT.field("reward_parts").type),
        "snapshot_id": snap_ids if snap_ids is not None else pa.nulls(n_nodes, pa.string()),
        "n_gen_tokens": pa.array(a_len.astype(np.int32)),
        "tool_calls": pa.array(np.where(is_root, 0, 1).astype(np.int32)),
        "meta": pa.nulls(n_nodes, pa.string()),
    }
    nodes = pa.table(columns, schema=NODE_INPUT)
    now = datetime.now(UTC)
    trees = pa.table({
        "tree_id": pa.array(tree_names, pa.string()),
        "run_id": pa.array([run_id] * n_trees),
        "task_id": pa.array([f"task-{t}" for t in range(n_trees)]),
        "env": pa.array(["synthetic"] * n_trees),
        "env_config": pa.nulls(n_trees, pa.string()),
        "sampler": pa.array(["bel"] * n_trees),
        "policy_version": pa.array(["v0"] * n_trees),
        "policy_ref": pa.nulls(n_trees, pa.string()),
        "budget": pa.array([rollouts] * n_trees, pa.int32()),
        "rollouts_by_phase": pa.array([[("explore", rollouts)]] * n_trees,
                                      TREE_INPUT.field("rollouts_by_phase").type),
        "seed": pa.array([seed] * n_trees, pa.int64()),
        "critical_node_id": pa.nulls(n_trees, pa.int64()),
        "created_at": pa.array([now] * n_trees, TREE_INPUT.field("created_at").type),
        "meta": pa.nulls(n_trees, pa.string()),
    }, schema=TREE_INPUT)
    if snapshot_bytes and snap_ids is not None:
        ids = [s for s in snap_ids.to_pylist() if s is not None]
        filler = (b"state " * (snapshot_bytes // 6 + 1))[:snapshot_bytes]
        snaps = pa.table({
            "snapshot_id": pa.array(ids, pa.string()),
            "tree_id": pa.array([s.rsplit("/", 1)[0] for s in ids], pa.string()),
            "env": pa.array(["synthetic"] * len(ids)),
            "state": pa.array([filler + s.encode() for s in ids], pa.binary()),
        }, schema=SNAPSHOT_INPUT)
    else:
        snaps = SNAPSHOT_INPUT.empty_table()
    return TreeBatch(trees=trees, nodes=nodes, snapshots=snaps)


def wide_batch(n_children: int) -> TreeBatch:
    """One tree ``wide``: a root with ``n_children`` leaves (rewards alternate 0/1), the
    worst case of fan-out for the ``siblings`` view."""
    n = n_children + 1
    nodes = {f.name: pa.nulls(n, f.type) for f in NODE_INPUT}
    nodes.update(
        tree_id=pa.array(["wide"] * n, pa.string()),
        node_id=pa.array(range(n), pa.int64()),
        parent_id=pa.array([None] + [0] * n_children, pa.int64()),
        kind=pa.array(["prompt"] + ["decision"] * n_children, pa.string()),
        terminal=pa.array([False] + [True] * n_children, pa.bool_()),
        reward=pa.array([None] + [float(i % 2) for i in range(n_children)], pa.float64()),
    )
    trees = {f.name: pa.nulls(1, f.type) for f in TREE_INPUT}
    trees.update(tree_id=pa.array(["wide"]), run_id=pa.array(["bench"]),
                 task_id=pa.array(["t"]), env=pa.array(["none"]), sampler=pa.array(["none"]),
                 created_at=pa.array([0], pa.timestamp("us", tz="UTC")))
    return TreeBatch(pa.table(trees, schema=TREE_INPUT), pa.table(nodes, schema=NODE_INPUT),
                     SNAPSHOT_INPUT.empty_table())
