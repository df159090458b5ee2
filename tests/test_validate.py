"""Every bad-tree rule gives its error, naming tree, node and rule, and writes nothing."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pyarrow as pa
import pytest

from rollout_store import Store, TreeValidationError, connect, read_trees
from rollout_store.tree import Node, Segment, Tree, TreeBatch


def good_tree(tree_id: str = "t") -> Tree:
    return Tree(tree_id, [
        Node(0, None, kind="prompt", observation_text="Compute 2+3."),
        Node(1, 0, action_text="<tool_call>", action_token_ids=[5, 6, 7],
             action_logprobs=[-0.1, -0.2, -0.3], action_entropies=[1.0, 0.5, 0.2],
             segments=[Segment("tool_call", 0, 3)], snapshot_id="s1"),
        Node(2, 1, kind="feedback_response", action_token_ids=[8], action_logprobs=[-1.0],
             reward=1.0, terminal=True, reward_parts={"outcome": 1.0}),
        Node(3, 1, kind="feedback_response", reward=0.0, terminal=True),
        Node(4, 0, reward=0.0, terminal=True),
    ], snapshots={"s1": b"state-1"})


def mutate(fn: Callable[[Tree], None]) -> Tree:
    t = copy.deepcopy(good_tree("bad"))
    fn(t)
    return t


def _set(target: int, /, **changes: object) -> Callable[[Tree], None]:
    def apply(t: Tree) -> None:
        node = next(n for n in t.nodes if n.node_id == target)
        for k, v in changes.items():
            setattr(node, k, v)
    return apply


CASES: list[tuple[str, Callable[[Tree], None], int | None]] = [
    ("duplicate_node_id", lambda t: t.nodes.append(Node(3, 0, reward=1.0)), 3),
    ("node_id_range", _set(4, node_id=-1), -1),
    ("node_id_range", _set(4, node_id=2**31), 2**31),
    ("self_loop", _set(4, parent_id=4), 4),
    ("missing_parent", _set(4, parent_id=99), 4),
    ("several_roots", _set(4, parent_id=None), None),
    ("no_root", lambda t: (_set(0, parent_id=1)(t)), None),
    ("cycle", lambda t: t.nodes.extend([Node(5, 6), Node(6, 5, reward=0.0)]), None),
    ("length_mismatch", _set(1, action_logprobs=[-0.1]), 1),
    ("length_mismatch", _set(1, action_entropies=[0.1, 0.2]), 1),
    ("non_finite", _set(2, reward=math.nan), 2),
    ("non_finite", _set(2, reward=math.inf), 2),
    ("non_finite", _set(1, action_logprobs=[-0.1, math.nan, -0.3]), 1),
    ("non_finite", _set(1, action_entropies=[0.1, math.inf, 0.3]), 1),
    ("non_finite", _set(2, reward_parts={"fmt": math.nan}), 2),
    ("reward_on_non_leaf", _set(1, reward=0.5), 1),
    ("missing_leaf_reward", _set(3, reward=None), 3),
    ("unknown_kind", _set(1, kind="thought"), 1),
    ("bad_segment", _set(1, segments=[Segment("tool_call", 1, 9)]), 1),
    ("bad_segment", _set(1, segments=[Segment("tool_call", 2, 1)]), 1),
    ("bad_segment", _set(1, segments=[Segment("mystery", 0, 1)]), 1),  # type: ignore[arg-type]
    ("missing_snapshot", _set(3, snapshot_id="nope"), 3),
]


@pytest.mark.parametrize(("rule", "fn", "node_id"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_refused_and_nothing_written(store: Store, rule: str, fn: Callable[[Tree], None],
                                          node_id: int | None) -> None:
    before = store.version()
    bad = mutate(fn)
    with pytest.raises(TreeValidationError) as info:
        store.append_trees([good_tree("ok-1"), bad, good_tree("ok-2")], key="batch")
    err = info.value
    assert err.rule == rule, str(err)
    assert err.tree_id == "bad", str(err)
    if node_id is not None:
        assert err.node_id == node_id, str(err)
    assert f"[{rule}]" in str(err) and "'bad'" in str(err)
    assert store.version() == before  # not one table got a commit
    assert connect(store).sql("SELECT count(*) FROM nodes").fetchall() == [(0,)]
    with pytest.raises(TreeValidationError):
        bad.validate()  # the in-memory check gives the same refusal


def test_cycle_names_a_node_on_the_cycle(store: Store) -> None:
    bad = mutate(lambda t: t.nodes.extend([Node(5, 6), Node(6, 7), Node(7, 5, reward=0.0)]))
    with pytest.raises(TreeValidationError) as info:
        bad.validate()
    assert info.value.rule == "cycle" and info.value.node_id in (5, 6, 7)


def test_wrong_column_types_refused(store: Store) -> None:
    batch = TreeBatch.from_trees([good_tree()])
    # delta-rs would cast the string "4" into an integer column without a word.
    as_text = batch.nodes.set_column(
        batch.nodes.schema.get_field_index("node_id"), "node_id",
        pa.array([str(v) for v in batch.nodes.column("node_id").to_pylist()]))
    for bad_batch in (
        TreeBatch(batch.trees, as_text, batch.snapshots),
        TreeBatch(batch.trees, batch.nodes.drop_columns(["reward"]), batch.snapshots),
        TreeBatch(batch.trees.drop_columns(["env"]), batch.nodes, batch.snapshots),
    ):
        with pytest.raises(TreeValidationError) as info:
            store.append_trees(bad_batch, key="x")
        assert info.value.rule == "column_type"
        assert "node_id" in str(info.value) or "reward" in str(info.value) \
            or "env" in str(info.value)
    assert store.version()["nodes"] == 0


def test_batch_level_rules(store: Store) -> None:
    t = good_tree()
    with pytest.raises(TreeValidationError, match="duplicate_tree_id"):
        store.append_trees([t, copy.deepcopy(t)])
    batch = TreeBatch.from_trees([t])
    with pytest.raises(TreeValidationError, match="unknown_tree"):
        store.append_trees(TreeBatch(batch.trees.slice(0, 0), batch.nodes, batch.snapshots))
    with pytest.raises(TreeValidationError, match="empty_tree"):
        store.append_trees(TreeBatch(batch.trees, batch.nodes.slice(0, 0),
                                     batch.snapshots.slice(0, 0)))
    store.append_trees([t], key="first")
    with pytest.raises(TreeValidationError, match="already stored"):
        store.append_trees([copy.deepcopy(t)], key="second")
    assert len(read_trees(store)) == 1


def test_hundred_thousand_deep_chain(store: Store) -> None:
    n = 100_000
    nodes = [Node(0, None, kind="prompt")] + [Node(i, i - 1) for i in range(1, n)]
    nodes[-1].reward = 1.0
    chain = Tree("chain", nodes)
    structure = chain.validate()
    assert int(structure.depth.max()) == n - 1
    assert [n.node_id for n in chain.preorder()][:3] == [0, 1, 2]
    assert len(chain.path_to(n - 1)) == n
    store.append_trees([chain], key="chain")
    con = connect(store)
    assert con.sql("SELECT leaf_id, depth FROM paths").fetchall() == [(n - 1, n - 1)]
    assert con.sql("SELECT max(subtree_size) FROM nodes").fetchall() == [(n,)]
