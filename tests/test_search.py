"""``rtrees search`` (issue 26): regex over node text, token-id runs across node boundaries.

The token search is checked three ways: a hand-built tree whose hits are known, a
brute-force reference (every root-to-leaf path's token stream scanned in Python) over
random trees, and through the store and the CLI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rollout_store import Store
from rollout_store.search import find_token_runs, search_regex, search_tokens
from rollout_store.tree import Node, Tree, TreeBatch


def _tree(tid: str = "t") -> Tree:
    # streams (action | observation): 0: (|1 2)  1: (3|4)  2: (5|)  3: (|6 7)  4: (4 5|)
    def node(i: int, p: int | None, a: list[int], o: list[int], leaf: bool = False) -> Node:
        return Node(i, p, "prompt" if p is None else "decision", action_text=f"act {i}",
                    action_token_ids=a, action_logprobs=[-0.1] * len(a),
                    action_entropies=[0.1] * len(a), observation_text=f"obs {i} 42",
                    observation_token_ids=o, terminal=leaf, reward=1.0 if leaf else None)
    return Tree(tid, [node(0, None, [], [1, 2]), node(1, 0, [3], [4]),
                      node(2, 1, [5], [], True), node(3, 0, [], [6, 7], True),
                      node(4, 1, [4, 5], [], True)])


def _hits(nodes_table: object, ids: list[int]) -> set[tuple[str, int, int, int]]:
    res = find_token_runs(nodes_table, ids, limit=10**9)  # type: ignore[arg-type]
    return set(zip(*(res.hits.column(c).to_pylist() for c in res.hits.column_names),
                   strict=True))


def test_hand_built_tree() -> None:
    nodes = TreeBatch.from_trees([_tree()]).nodes
    assert _hits(nodes, [2, 3, 4]) == {("t", 0, 1, 1)}  # prompt -> action -> observation
    assert _hits(nodes, [4, 5]) == {("t", 1, 1, 2), ("t", 4, 0, 4)}  # across, and inside
    assert _hits(nodes, [2, 6, 7]) == {("t", 0, 1, 3)}  # through an empty action
    assert _hits(nodes, [1, 2, 3, 4, 4, 5]) == {("t", 0, 0, 4)}
    assert _hits(nodes, [7, 1]) == set()  # not along one path
    assert _hits(nodes, [5]) == {("t", 2, 0, 2), ("t", 4, 1, 4)}


def _reference(tree: Tree, q: list[int]) -> set[tuple[str, int, int, int]]:
    """Brute force: scan each root-to-leaf path's stream; dedupe shared prefixes."""
    out = set()
    for leaf in tree.leaves():
        stream: list[tuple[int, int, int]] = []  # (token, node, offset in node)
        for n in tree.path_to(leaf.node_id):
            for k, tok in enumerate(list(n.action_token_ids) + list(n.observation_token_ids)):
                stream.append((tok, n.node_id, k))
        toks = [s[0] for s in stream]
        for i in range(len(toks) - len(q) + 1):
            if toks[i:i + len(q)] == q:
                out.add((tree.tree_id, stream[i][1], stream[i][2], stream[i + len(q) - 1][1]))
    return out


@st.composite
def token_trees(draw: st.DrawFn, tid: str) -> Tree:
    """A random tree over a 3-token alphabet (so that runs occur); empty segments too."""
    n = draw(st.integers(1, 10))
    parents = [None] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    toks = st.lists(st.integers(0, 2), max_size=3)
    kids = {p for p in parents if p is not None}
    nodes = []
    for i, p in enumerate(parents):
        a = [] if p is None else draw(toks)
        nodes.append(Node(i, p, "prompt" if p is None else "decision", action_token_ids=a,
                          action_logprobs=[-0.1] * len(a), action_entropies=[0.1] * len(a),
                          observation_token_ids=draw(toks), terminal=i not in kids,
                          reward=0.0 if i not in kids else None))
    return Tree(tid, nodes)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 99), min_size=1, max_size=3, unique=True).flatmap(
           lambda ids: st.tuples(*(token_trees(f"t{i}") for i in ids))),
       st.lists(st.integers(0, 2), min_size=1, max_size=4), st.randoms())
def test_matches_a_brute_force_scan(trees: tuple[Tree, ...], q: list[int],
                                    rnd: object) -> None:
    nodes = TreeBatch.from_trees(list(trees)).nodes
    perm = list(range(nodes.num_rows))
    rnd.shuffle(perm)  # type: ignore[attr-defined]
    expected = set().union(*(_reference(t, q) for t in trees))
    assert _hits(nodes.take(perm), q) == expected  # any row order


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    s = Store(tmp_path_factory.mktemp("search") / "store", create=True)
    s.append_trees([_tree("a"), _tree("b")], key="one")
    return s


def test_search_the_store(store: Store) -> None:
    res = search_tokens(store, [4, 5], limit=3)
    assert res.total == 4 and res.hits.num_rows == 3 and "first 3" in res.summary()
    assert res.hits.to_pylist()[0] == {"tree_id": "a", "node_id": 1, "offset": 1,
                                       "end_node_id": 2}
    text = search_regex(store, r"obs [23] \d+")
    assert text.total == 4
    assert text.hits.to_pylist()[0] == {"tree_id": "a", "node_id": 2, "field": "observation",
                                        "offset": 0}
    assert search_regex(store, "4(2)").hits.column("offset").to_pylist()[0] == 6
    with pytest.raises(ValueError, match="at least one token id"):
        search_tokens(store, [])


def test_the_index_is_reused_and_follows_new_versions(tmp_path: Path) -> None:
    from rollout_store.search import INDEX_DIR

    s = Store(tmp_path / "store", create=True)
    s.append_trees([_tree("a")], key="one")
    assert search_tokens(s, [2, 3, 4]).total == 1
    (built,) = (Path(s.path) / INDEX_DIR).iterdir()
    mtime = (built / "action.npy").stat().st_mtime_ns
    assert search_tokens(s, [2, 3, 4]).total == 1  # read back, not rebuilt
    assert (built / "action.npy").stat().st_mtime_ns == mtime
    s.append_trees([_tree("b")], key="two")
    assert search_tokens(s, [2, 3, 4]).total == 2  # a new version: a new index
    (again,) = (Path(s.path) / INDEX_DIR).iterdir()
    assert again.name != built.name
    assert search_tokens(s, [2, 3, 4], version=1, cache=False).total == 1  # time travel
    (again / "kids.npy").write_bytes(b"garbage")  # a damaged index is rebuilt
    assert search_tokens(s, [2, 3, 4]).total == 2


def test_cli_search(store: Store, tmp_path: Path) -> None:
    from cli.main import app

    path = str(store.path)
    res = CliRunner().invoke(app, ["search", "--store", path, "--tokens", "2,6,7",
                                   "--format", "csv"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[:2] == ['"tree_id","node_id","offset","end_node_id"',
                                           '"a",0,1,3']
    res = CliRunner().invoke(app, ["search", "--store", path, "--regex", "act [0-9]"])
    assert res.exit_code == 0 and "10 hits" in res.output
    for args, msg in ((["--tokens", "1,x"], "--tokens"), ([], "one of --regex or --tokens"),
                      (["--regex", "a", "--tokens", "1"], "one of --regex or --tokens"),
                      (["--regex", "(unclosed"], "regex"),
                      (["--tokens", "1", "--limit", "0"], "--limit")):
        res = CliRunner().invoke(app, ["search", "--store", path, *args])
        assert res.exit_code != 0 and msg in res.output, (args, res.output)
