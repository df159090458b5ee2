"""The derived views `paths` and `siblings` against brute-force walks of random trees."""

from __future__ import annotations

import itertools
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from rollout_store import Store, connect
from rollout_store.testing import tree_lists
from rollout_store.tree import Tree

_n = itertools.count()


def brute_siblings(trees: list[Tree], threshold: float) -> set[tuple[str, int, int, int, int]]:
    out = set()
    for t in trees:
        kids = t.children()
        for parent, children in kids.items():
            if len(children) < 2:
                continue
            for c in children:
                stack, leaves = [c], []
                while stack:
                    v = stack.pop()
                    if kids[v]:
                        stack.extend(kids[v])
                    else:
                        leaves.append(t.node(v).reward)
                wins = sum(1 for r in leaves if r is not None and r >= threshold)
                out.add((t.tree_id, parent, c, len(leaves), wins))
    return out


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=tree_lists(max_size=4, max_nodes=25))
def test_views_match_brute_force(tmp_path: Path, batch: list[Tree]) -> None:
    store = Store(tmp_path / f"s{next(_n)}", create=True)
    store.append_trees(batch)
    for threshold in (0.0, 1.0):
        con = connect(store, success_threshold=threshold)
        got = set(con.sql("SELECT * FROM siblings").fetchall())
        assert got == brute_siblings(batch, threshold)
    paths = set(connect(store).sql("SELECT tree_id, leaf_id, depth, reward FROM paths")
                .fetchall())
    want = {(t.tree_id, leaf.node_id, len(t.path_to(leaf.node_id)) - 1, leaf.reward)
            for t in batch for leaf in t.leaves()}
    assert paths == want
