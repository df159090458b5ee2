"""Tree builders and plain-Python references shared by the credit tests (tests/test_credit_*.py).

    from credit_helpers import node, random_trees, by_row, agent_tokens_of, ref_zscore, group_key

* ``node``: one hand-made ``Node`` (agent tokens first, then observation tokens);
* ``random_trees``: a Hypothesis strategy for random valid batches of small trees;
* ``split_step`` / ``with_more_tool_output``: a tree with one step split in two / batch
  with extra observation tokens drawn on every node (the invariance tests' edits);
* ``by_row`` / ``agent_tokens_of``: a batch's per-node values / per-node agent-token
  values keyed by (tree id, node id);
* ``ref_zscore``: METHODS G1 for one group, straight from the formula;
* ``group_key``: a tree's prompt group (run, sampler, policy version, task).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from hypothesis import strategies as st

from rollout_store.testing import parent_structures
from rollout_store.tree import Node, Segment, Tree
from train.credit.base import TreeArrays

Key = tuple[str, int]


def node(nid: int, parent: int | None, actions: int | Sequence[int] = 1,
         obs: int | Sequence[int] = 0, reward: float | None = None, *,
         phase: str | None = None, segments: Sequence[tuple[str, int, int]] = (),
         parts: dict[str, float] | None = None) -> Node:
    """A node with agent tokens ``actions`` then observation tokens ``obs``.

    An int gives that many tokens (ids ``0..n-1`` for actions, ``100..`` for
    observations); a list gives the ids. ``reward`` (or ``parts``) makes it a
    terminal leaf; ``segments`` are (kind, start, end) spans of the action tokens.
    """
    act = list(range(actions)) if isinstance(actions, int) else list(actions)
    ob = list(range(100, 100 + obs)) if isinstance(obs, int) else list(obs)
    leaf = reward is not None or parts is not None
    return Node(node_id=nid, parent_id=parent, kind="prompt" if parent is None else "decision",
                action_token_ids=act, action_logprobs=[-0.5] * len(act),
                observation_token_ids=ob,
                segments=[Segment(k, a, b) for k, a, b in segments],  # type: ignore[arg-type]
                terminal=leaf, reward=reward, reward_parts=dict(parts or {}), phase=phase)


@st.composite
def random_trees(draw: st.DrawFn, max_trees: int = 4, max_nodes: int = 20) -> list[Tree]:
    """Random valid trees: shapes from ``rollout_store.testing.parent_structures``, shuffled
    node ids and rows, 0-3 action / 0-2 observation tokens, 0/1 or float leaf rewards,
    two task ids. (The full ``testing.trees()`` also draws texts, entropies and snapshots,
    which credit never reads and which cost 95% of the time.)"""
    shapes = draw(st.lists(parent_structures(max_nodes), min_size=1, max_size=max_trees))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    trees = []
    for b, parents in enumerate(shapes):
        ids = rng.permutation(len(parents)) + int(rng.choice([0, 1000]))
        inner = {p for p in parents if p is not None}
        nodes = []
        for i, p in enumerate(parents):
            n_act, n_obs = int(rng.integers(0, 4)), int(rng.integers(0, 3))
            reward = None
            if i not in inner:
                reward = float(rng.integers(0, 2)) if rng.random() < 0.7 else float(rng.normal())
            nodes.append(Node(int(ids[i]), None if p is None else int(ids[p]),
                              kind="prompt" if p is None else "decision",
                              action_token_ids=[11] * n_act, action_logprobs=[-0.5] * n_act,
                              observation_token_ids=[22] * n_obs, terminal=reward is not None,
                              reward=reward))
        trees.append(Tree(f"t{b}", [nodes[j] for j in rng.permutation(len(nodes))],
                          task_id=f"task{int(rng.integers(0, 2))}"))
    return trees


def split_step(tree: Tree, node_id: int) -> Tree:
    """Split step ``node_id`` into an unbranched chain of two steps: the first keeps
    its id, place and the first part of its agent tokens; a new only child takes the
    rest, its tool output, its reward and its children. The token sequence of every
    trajectory is unchanged."""
    new_id = max(n.node_id for n in tree.nodes) + 1
    nodes = []
    for n in tree.nodes:
        if n.node_id != node_id:
            parent = new_id if n.parent_id == node_id else n.parent_id
            nodes.append(replace(n, parent_id=parent, segments=[]))
            continue
        k = len(n.action_token_ids) // 2
        nodes.append(replace(n, action_token_ids=n.action_token_ids[:k],
                             action_logprobs=n.action_logprobs[:k],
                             action_entropies=n.action_entropies[:k] if n.action_entropies
                             else [], observation_token_ids=[], observation_text="",
                             segments=[], terminal=False, reward=None, reward_parts={},
                             n_gen_tokens=None))
        nodes.append(replace(n, node_id=new_id, parent_id=node_id, kind="decision",
                             action_token_ids=n.action_token_ids[k:],
                             action_logprobs=n.action_logprobs[k:],
                             action_entropies=n.action_entropies[k:] if n.action_entropies
                             else [], segments=[], snapshot_id=None, n_gen_tokens=None))
    return replace(tree, nodes=nodes)


def with_more_tool_output(trees: Sequence[Tree], data: st.DataObject) -> list[Tree]:
    """``trees`` with 0-3 observation tokens (ids 0-9, drawn from ``data``) appended to
    every node's tool output."""
    return [replace(t, nodes=[replace(n, observation_token_ids=n.observation_token_ids
                                      + data.draw(st.lists(st.integers(0, 9), max_size=3)))
                              for n in t.nodes]) for t in trees]


def by_row(batch: TreeArrays, values: np.ndarray) -> dict[Key, float]:
    """Per-node ``values`` (N,) keyed by (tree id, node id)."""
    return {(batch.tree_ids[t], int(n)): float(v)
            for t, n, v in zip(batch.node_tree, batch.node_ids, values, strict=True)}


def agent_tokens_of(batch: TreeArrays, token: np.ndarray) -> dict[Key, list[float]]:
    """Per-node agent-token values of ``token`` (T,) keyed by (tree id, node id)."""
    out = {}
    for row in range(batch.n_nodes):
        lo, hi = batch.token_offsets[row], batch.token_offsets[row + 1]
        key = (batch.tree_ids[batch.node_tree[row]], int(batch.node_ids[row]))
        out[key] = [float(x) for x in token[lo:hi][batch.agent_mask[lo:hi]]]
    return out


def ref_zscore(values: Sequence[float], std: str, eps: float,
               single: str = "zero") -> list[float]:
    """METHODS G1 for one group: (v - mean) / (F_norm + eps).

    Equal values give 0; a group of one gives 0, or with ``single="raw"`` its
    value over (1 + eps) (the value itself when ``std="none"``).
    """
    n = len(values)
    if n == 1 and single == "raw":
        return [values[0] if std == "none" else values[0] / (1 + eps)]
    if n < 2 or all(v == values[0] for v in values):
        return [0.0] * n
    mean = sum(values) / n
    if std == "none":
        return [v - mean for v in values]
    var = sum((v - mean) ** 2 for v in values) / (n - 1 if std == "unbiased" else n)
    if var == 0.0:  # spread too small to square (subnormal rewards): zero variance
        return [0.0] * n
    return [(v - mean) / (math.sqrt(var) + eps) for v in values]


def group_key(tree: Tree) -> tuple[str, str, str | None, str]:
    """The prompt group of ``tree`` (METHODS "Prompt groups")."""
    return (tree.run_id, tree.sampler, tree.policy_version, tree.task_id)
