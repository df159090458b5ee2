"""Tree builders and plain-Python references shared by the credit tests (tests/test_credit_*.py).

    from credit_helpers import node, by_row, agent_tokens_of, ref_zscore, group_key

* ``node``: one hand-made ``Node`` (agent tokens first, then observation tokens);
* ``by_row`` / ``agent_tokens_of``: a batch's per-node values / per-node agent-token
  values keyed by (tree id, node id);
* ``ref_zscore``: METHODS G1 for one group, straight from the formula;
* ``group_key``: a tree's prompt group (run, sampler, policy version, task).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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
