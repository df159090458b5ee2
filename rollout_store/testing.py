"""Hypothesis strategies for random valid trees, and ``assert_trees_equal``.

Shipped with the package so that every later test (credit estimators,
samplers, audits) and users' own tests can draw random valid trees::

    from hypothesis import given
    from rollout_store.testing import trees, assert_trees_equal

    @given(trees())
    def test_something(tree): ...

Generated values round-trip exactly through the store: logprobs and
entropies are float32 values already at the stored precision
(``rollout_store.precision``), timestamps have microsecond precision.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
from hypothesis import strategies as st

from rollout_store.precision import round_float32
from rollout_store.schema import NODE_KINDS, SEGMENT_KINDS
from rollout_store.tree import Node, Segment, Tree

_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=20)


def _stored(x: float) -> float:
    """``x`` at the precision the store keeps logprobs and entropies at."""
    return float(round_float32(np.array([x], np.float32))[0])


_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-30.0,
                 max_value=0.0).map(_stored)
_ent = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=0.0,
                 max_value=12.0).map(_stored)
_reward = st.floats(allow_nan=False, allow_infinity=False, min_value=-10.0, max_value=10.0)
_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)


@st.composite
def parent_structures(draw: st.DrawFn, max_nodes: int = 30) -> list[int | None]:
    """Parent index of each node in creation order: node 0 is the root, node i > 0
    hangs below a uniformly drawn earlier node, optionally as a long chain."""
    n = draw(st.integers(1, max_nodes))
    shape = draw(st.sampled_from(["random", "chain", "star", "branchy"]))
    parents: list[int | None] = [None]
    for i in range(1, n):
        if shape == "chain":
            parents.append(i - 1)
        elif shape == "star":
            parents.append(0)
        elif shape == "branchy":
            parents.append(draw(st.integers(max(0, i - 3), i - 1)))
        else:
            parents.append(draw(st.integers(0, i - 1)))
    return parents


@st.composite
def nodes_for(draw: st.DrawFn, parents: list[int | None], max_tokens: int = 8,
              snapshot_prefix: str = "s") -> tuple[list[Node], dict[str, bytes]]:
    """Nodes for a parent structure, with shuffled node ids and valid contents."""
    n = len(parents)
    ids = draw(st.permutations(list(range(n))))
    id_offset = draw(st.sampled_from([0, 0, 1000, 2**31 - 2 - n]))
    node_ids = [i + id_offset for i in ids]
    has_child = [False] * n
    for p in parents:
        if p is not None:
            has_child[p] = True
    nodes: list[Node] = []
    snaps: dict[str, bytes] = {}
    for i, p in enumerate(parents):
        n_tok = draw(st.integers(0, max_tokens))
        tokens = draw(st.lists(st.integers(0, 50_000), min_size=n_tok, max_size=n_tok))
        logprobs = draw(st.lists(_f32, min_size=n_tok, max_size=n_tok))
        entropies = draw(st.one_of(st.just([]), st.lists(_ent, min_size=n_tok,
                                                         max_size=n_tok)))
        segments = []
        if n_tok:
            for _ in range(draw(st.integers(0, 2))):
                a = draw(st.integers(0, n_tok))
                b = draw(st.integers(a, n_tok))
                segments.append(Segment(draw(st.sampled_from(SEGMENT_KINDS)), a, b))
        leaf = not has_child[i]
        snapshot_id = None
        if draw(st.booleans()):
            snapshot_id = f"{snapshot_prefix}{node_ids[i]}"
            snaps[snapshot_id] = draw(st.binary(max_size=64))
        nodes.append(Node(
            node_id=node_ids[i],
            parent_id=None if p is None else node_ids[p],
            kind="prompt" if p is None else draw(st.sampled_from(NODE_KINDS[1:])),
            action_text=draw(_text), action_token_ids=tokens, action_logprobs=logprobs,
            action_entropies=entropies, observation_text=draw(_text),
            observation_token_ids=draw(st.lists(st.integers(0, 50_000), max_size=max_tokens)),
            segments=segments, terminal=leaf,
            reward=draw(_reward) if leaf else None,
            reward_parts=draw(st.dictionaries(st.sampled_from(["fmt", "name", "outcome"]),
                                              _reward, max_size=2)) if leaf else {},
            snapshot_id=snapshot_id,
            n_gen_tokens=draw(st.one_of(st.none(), st.just(n_tok))),
            tool_calls=draw(st.one_of(st.none(), st.integers(0, 3))),
            phase=draw(st.sampled_from([None, "explore", "probe", "suffix"])),
            meta=draw(st.one_of(st.none(), st.fixed_dictionaries({"note": _text}))),
        ))
    order = draw(st.permutations(list(range(n))))  # row order in the batch is arbitrary
    return [nodes[i] for i in order], snaps


_when = st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2030, 1, 1),
                     timezones=st.just(UTC))


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 30, max_tokens: int = 8,
          tree_id: str | None = None) -> Tree:
    """A random valid ``Tree`` (branching, depth, token lengths, snapshots vary)."""
    tid = tree_id or draw(_ids)
    parents = draw(parent_structures(max_nodes))
    nodes, snaps = draw(nodes_for(parents, max_tokens, snapshot_prefix=f"{tid}/"))
    leaf_ids = [n.node_id for n in nodes if n.reward is not None]
    return Tree(
        tree_id=tid, nodes=nodes, run_id=draw(st.sampled_from(["run-a", "run-b"])),
        task_id=draw(_ids), env=draw(st.sampled_from(["calc", "workflow", "python"])),
        sampler=draw(st.sampled_from(["group", "random", "bel", "caliper"])),
        env_config=draw(st.one_of(st.none(), st.fixed_dictionaries(
            {"difficulty": st.integers(1, 6)}))),
        policy_version=draw(st.one_of(st.none(), st.just("v1"))),
        policy_ref=draw(st.one_of(st.none(), st.just("/ckpt/v1"))),
        budget=draw(st.one_of(st.none(), st.integers(1, 64))),
        rollouts_by_phase=draw(st.dictionaries(st.sampled_from(["explore", "probe"]),
                                               st.integers(0, 32), max_size=2)),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**40))),
        critical_node_id=draw(st.one_of(st.none(), st.sampled_from(leaf_ids))),
        created_at=draw(_when),
        meta=draw(st.one_of(st.none(), st.fixed_dictionaries({"source": _text}))),
        snapshots=snaps,
    )


@st.composite
def tree_lists(draw: st.DrawFn, min_size: int = 1, max_size: int = 5,
               max_nodes: int = 30) -> list[Tree]:
    """Several random valid trees with distinct ids."""
    ids = draw(st.lists(_ids, min_size=min_size, max_size=max_size, unique=True))
    return [draw(trees(max_nodes=max_nodes, tree_id=t)) for t in ids]


def _node_dict(node: Node) -> dict[str, Any]:
    return dict(vars(node))


def assert_trees_equal(expected: Tree | list[Tree], actual: Tree | list[Tree],
                       rel_tol: float = 0.0) -> None:
    """Assert two trees (or lists, matched by tree id) hold the same data.

    Node order does not matter (nodes are matched by id). Floats compare
    exactly unless ``rel_tol`` is given. The message names the tree, node and field.
    """
    exp = expected if isinstance(expected, list) else [expected]
    act = actual if isinstance(actual, list) else [actual]
    exp_ids = sorted(t.tree_id for t in exp)
    act_ids = sorted(t.tree_id for t in act)
    assert exp_ids == act_ids, f"tree ids differ: {exp_ids} != {act_ids}"
    by_id = {t.tree_id: t for t in act}
    for e in exp:
        a = by_id[e.tree_id]
        for name in vars(e):
            if name == "nodes":
                continue
            assert _same(getattr(e, name), getattr(a, name), rel_tol), (
                f"tree {e.tree_id!r}: field {name!r}: {getattr(e, name)!r} != "
                f"{getattr(a, name)!r}")
        e_nodes = {n.node_id: _node_dict(n) for n in e.nodes}
        a_nodes = {n.node_id: _node_dict(n) for n in a.nodes}
        assert sorted(e_nodes) == sorted(a_nodes), f"tree {e.tree_id!r}: node ids differ"
        for nid, en in e_nodes.items():
            for key, value in en.items():
                assert _same(value, a_nodes[nid][key], rel_tol), (
                    f"tree {e.tree_id!r}, node {nid}: field {key!r}: {value!r} != "
                    f"{a_nodes[nid][key]!r}")


def _same(a: Any, b: Any, rel_tol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=rel_tol) if rel_tol else a == b
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y, rel_tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rel_tol) for k in a)
    return bool(a == b)
