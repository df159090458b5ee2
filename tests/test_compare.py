"""Issue 48 without a browser: the diff math, the viewer's new routes (auth, one-line
errors), ``rtrees diff`` / ``compare`` / ``sql --stores`` and the cross-store views.

The page itself is ``tests/test_compare_browser.py``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import compare_store
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from analysis.compare import (
    MAX_DIFF_PAIRS,
    compare_trajectories,
    root_path,
    sibling_diff,
    token_diff,
    wilson_interval,
)

# --- the math ---------------------------------------------------------------------------


def test_token_diff_hand_cases() -> None:
    assert token_diff([1, 2, 3], [1, 2, 3]) == [False] * 3
    assert token_diff([1, 2, 3], [1, 9, 3]) == [False, True, False]
    assert token_diff([1, 2, 3], [1, 2, 7, 3]) == [False, False, True, False]  # insertion
    assert token_diff([1, 2, 3], [1, 3]) == [False, False]  # a deletion marks nothing
    assert token_diff([], [4, 5]) == [True, True]
    assert token_diff("abcd", "abXd") == [False, False, True, False]


def test_token_diff_marks_the_whole_middle_past_the_bound() -> None:
    n = int(MAX_DIFF_PAIRS**0.5) + 2
    ref = [0, *range(1, n), 0]
    other = [0, *range(n, 1, -1), 0]
    marks = token_diff(ref, other)
    assert marks[0] is False and marks[-1] is False and all(marks[1:-1])


@given(st.lists(st.integers(0, 4), max_size=30), st.lists(st.integers(0, 4), max_size=30))
def test_unmarked_units_are_a_common_subsequence(ref: list[int], other: list[int]) -> None:
    marks = token_diff(ref, other)
    kept = [u for u, m in zip(other, marks, strict=True) if not m]
    it = iter(ref)
    assert all(any(u == r for r in it) for u in kept)  # kept is a subsequence of ref
    assert (not any(marks)) == (ref == other) or len(other) < len(ref)


def test_wilson_interval() -> None:
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0, 10)[1] == pytest.approx(
        0.2775, abs=1e-4)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson_interval(3, 2)


def test_sibling_diff_of_a_wide_node() -> None:
    tree = compare_store.wide_tree("w", 4, 8)
    res = sibling_diff(tree, 0, {"m": {1: 0.5, 2: -0.5}}, {2: [{"k": 4, "successes": 1}]},
                       decode=None)
    assert [c["child"] for c in res["columns"]] == [1, 2, 3, 4]
    assert res["reference"] == 1 and res["unit"] == "char"  # action texts differ by digit
    assert [c["action_parts_at"] for c in res["columns"]] == [None, 0, 0, 0]
    assert res["columns"][1]["credit"] == {"m": -0.5} and res["columns"][1]["mc"][0]["k"] == 4
    assert [c["leaves"] for c in res["columns"]] == [1, 1, 1, 1]
    assert [c["reward"] for c in res["columns"]] == [1.0, 0.0, 1.0, 0.0]
    decoded = sibling_diff(tree, 0, decode=lambda ids: [f"<{i}>" for i in ids], ref=3)
    assert decoded["unit"] == "token" and decoded["reference"] == 3
    col = decoded["columns"][1]["steps"][0]["action"]  # node 2 (3 at token 1) vs node 3
    assert [s["diff"] for s in col] == [False, True, False]
    assert col[1]["text"] == "<24>"  # its 3 matches node 3's (difflib), 24 does not
    cut = sibling_diff(tree, 0, max_children=2, ref=4)
    assert [c["child"] for c in cut["columns"]] == [1, 4] and cut["n_children"] == 4
    with pytest.raises(KeyError, match="no node 99"):
        sibling_diff(tree, 99)
    with pytest.raises(ValueError, match=r"not a branch point .* branching nodes: 0"):
        sibling_diff(tree, 2)
    with pytest.raises(ValueError, match="reference 0 is not a child"):
        sibling_diff(tree, 0, ref=0)


def test_compare_trajectories_aligns_by_step() -> None:
    tree = compare_store.wide_tree("w", 3, 4)
    assert [n.node_id for n in root_path(tree)] == [0, 1]  # best leaf: reward 1, first
    res = compare_trajectories([{"label": "a", "tree": tree, "leaf": 2},
                                {"label": "b", "tree": tree, "leaf": 2},
                                {"label": "c", "tree": tree, "leaf": 3}])
    assert res["steps"] == 2 and [c["label"] for c in res["columns"]] == ["a", "b", "c"]
    assert [c["action_parts_at"] for c in res["columns"]] == [None, None, 1]
    assert [c["outcome_parts_at"] for c in res["columns"]] == [None, None, 1]  # reward 0 vs 1
    with pytest.raises(ValueError, match="not a leaf"):
        root_path(tree, 0)
    with pytest.raises(ValueError, match="two or more"):
        compare_trajectories([{"label": "a", "tree": tree, "leaf": 2}])


# --- stores -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("cmp")
    compare_store.build(tmp / "a")
    b = compare_store.build(tmp / "b", run_b=False)
    b.append_trees([compare_store.wide_tree("wide", 3, 5)], key="wide")
    return tmp / "a", tmp / "b"


def test_cross_store_views(stores: tuple[Path, Path]) -> None:
    from rollout_store import StoreError
    from rollout_store.reader import connect, connect_stores, run_query

    a, b = stores
    con = connect_stores({"A": a, "B": b}, restricted=True)
    per = {name: {v: run_query(connect(p), f"SELECT count(*) AS n FROM {v}")["n"][0].as_py()
                  for v in ("trees", "nodes", "siblings", "paths", "metrics_latest")}
           for name, p in (("A", a), ("B", b))}
    for view in ("trees", "nodes", "siblings", "paths", "metrics_latest"):
        got = {r["store"]: r["n"] for r in run_query(
            con, f"SELECT store, count(*) AS n FROM {view} GROUP BY ALL").to_pylist()}
        assert got == {"A": per["A"][view], "B": per["B"][view]}, view
    # every view holds exactly each store's rows, whichever way it is read (one scan of
    # all stores' files, or a union of per-store views)
    from rollout_store.reader import UNION_VIEWS

    for view in UNION_VIEWS:
        union = run_query(con, f"SELECT * FROM {view}").to_pylist()
        alone = [{"store": name, **r} for name, p in (("A", a), ("B", b))
                 for r in run_query(connect(p), f"SELECT * FROM {view}").to_pylist()]
        assert sorted(map(repr, union)) == sorted(map(repr, alone)), view
    # the same tree id in both stores, with its siblings computed in each store alone
    rows = run_query(con, "SELECT store, count(*) AS n FROM siblings WHERE tree_id = 'bel-0' "
                          "GROUP BY ALL ORDER BY 1").to_pylist()
    assert rows == [{"store": "A", "n": 6}, {"store": "B", "n": 6}]  # 3 nodes x 2 children
    with pytest.raises(Exception, match="disabled by configuration"):
        run_query(con, "SELECT * FROM read_text('/etc/passwd')")
    with pytest.raises(StoreError, match="no such store"):
        connect_stores({"A": a, "X": a.parent / "nope"})
    with pytest.raises(ValueError, match="no store"):
        connect_stores({})


# --- the server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(stores: tuple[Path, Path]) -> Iterator[Any]:
    from analysis.viewer.server import start

    server, thread = start(list(stores))
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _get(server: Any, path: str, auth: bool = True) -> tuple[int, Any]:
    headers = {"Cookie": f"{server.cookie_name}={server.access_token}"} if auth else {}
    req = urllib.request.Request(server.url + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_routes_answer(served: Any, stores: tuple[Path, Path]) -> None:
    a, b = stores
    status, body = _get(served, "api/stores")
    assert status == 200 and [s["name"] for s in body] == [str(a), str(b)]
    status, body = _get(served, "api/siblings?tree=bel-0&node=0")
    assert status == 200 and [c["child"] for c in body["columns"]] == [1, 2]
    assert [[r["mean"] for r in c["mc"]] for c in body["columns"]] == [[0.75], [0.375]]
    status, body = _get(served, f"api/siblings?tree=wide&node=0&store={quote(str(b))}")
    assert status == 200 and len(body["columns"]) == 3
    paths = quote(json.dumps([[None, "bel-0", 3], [str(b), "wide", 2]]))
    status, body = _get(served, f"api/paths?paths={paths}")
    assert status == 200 and [c["store"] for c in body["columns"]] == [str(a), str(b)]
    status, body = _get(served, f"api/metrics_diff?a={compare_store.TRAIN_A}"
                                f"&b={compare_store.TRAIN_B}")
    assert status == 200
    reward = next(m for m in body["metrics"] if m["name"] == "reward")
    assert reward["shared_step"] == 5 and reward["delta"] == pytest.approx(0.25)
    assert [(h["step"], h["successes"], h["n"]) for h in body["heldout"]["b"]] == [
        (0, 4, 20), (5, 15, 20)]


def test_labels_go_to_the_chosen_store(served: Any, stores: tuple[Path, Path]) -> None:
    """``POST /api/label`` with ``store``: written to that store (as the server's user),
    read back from it; an unknown store is a one-line 404 and writes nothing."""
    def post(body: dict[str, Any]) -> tuple[int, Any]:
        req = urllib.request.Request(
            served.url + "api/label", data=json.dumps(body).encode(), method="POST",
            headers={"Cookie": f"{served.cookie_name}={served.access_token}",
                     "X-Rtrees-Token": served.token, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    _, b = stores
    status, body = post({"tree_id": "wide", "node_id": 1, "key": "k", "value": "v",
                         "store": str(b)})
    assert status == 200 and body["nodes"]["1"][0]["value"] == "v"
    assert _get(served, f"api/labels?tree=wide&store={quote(str(b))}")[1]["nodes"]["1"]
    assert _get(served, "api/labels?tree=wide")[1]["nodes"] == {}  # not in the first store
    status, body = post({"tree_id": "wide", "node_id": 1, "key": "k", "value": "v",
                         "store": "/nope"})
    assert status == 404 and "no store '/nope'" in body["error"]


@pytest.mark.parametrize(("path", "status", "says"), [
    ("api/siblings?tree=bel-0&node=99", 404, "no node 99"),
    ("api/siblings?tree=nope&node=0", 404, "no tree 'nope'"),
    ("api/siblings?tree=bel-0&node=x", 400, "node must be an integer"),
    ("api/siblings?tree=bel-0&node=3", 400, "not a branch point"),
    ("api/siblings?tree=bel-0&node=0&store=nope", 404, "no store 'nope'"),
    ("api/tree?id=bel-0&store=%2Fetc", 404, "no store '/etc'"),
    ("api/paths?paths=%5B1", 400, "JSON list"),
    ("api/paths?paths=%5B%5Bnull%2C%22bel-0%22%2C3%5D%5D", 400, "2 to 64"),
    ("api/paths?paths=" + quote('[[null,"bel-0",1],[null,"bel-0",3]]'), 400, "not a leaf"),
    ("api/metrics_diff?a=nope&b=nope", 404, "no metrics"),
    ("api/trees?where=regexp_matches(task_id%2C%20%27(%27)", 400, "filter failed"),
])
def test_bad_input_is_one_line(served: Any, path: str, status: int, says: str) -> None:
    got, body = _get(served, path)
    assert got == status and says in body["error"] and "\n" not in body["error"]


@pytest.mark.parametrize("path", ["api/stores", "api/siblings?tree=bel-0&node=0",
                                  "api/paths?paths=" + quote('[[null,"bel-0",3],[null,"bel-0",4]]'),
                                  "api/metrics_diff?a=x&b=y"])
def test_new_routes_need_the_access_token(served: Any, path: str) -> None:
    status, body = _get(served, path, auth=False)
    assert status == 403 and "access token" in body["error"]


# --- the CLI ----------------------------------------------------------------------------


def _run(*args: str) -> Any:
    from cli.main import app

    return CliRunner().invoke(app, list(args))


def test_cli_diff(stores: tuple[Path, Path]) -> None:
    a, _ = stores
    res = _run("diff", "--store", str(a), "--tree", "bel-0", "--node", "1")
    assert res.exit_code == 0, res.output
    assert "node 1 at depth 1 has 2 children" in res.output and "child 4:" in res.output
    assert "Mean@8" not in res.output.split("child 3")[1]  # Mean@k is stored for 1 and 2
    res = _run("diff", "--store", str(a), "--tree", "bel-0", "--node", "0", "--json")
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    assert [c["credit"]["grpo"] for c in body["columns"]] == [0.5, -0.5]
    for args, says in ((["--tree", "bel-0", "--node", "99"], "no node 99"),
                       (["--tree", "nope", "--node", "0"], "no tree 'nope'"),
                       (["--tree", "bel-0", "--node", "3"], "not a branch point"),
                       (["--tree", "bel-0", "--node", "-1"], "--node must be")):
        res = _run("diff", "--store", str(a), *args)
        assert res.exit_code == 1 and says in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1
    res = _run("diff", "--store", str(a.parent / "nope"), "--tree", "t", "--node", "0")
    assert res.exit_code == 1 and "no such store" in res.output


def test_cli_compare(stores: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = stores
    res = _run("compare", "--store", str(a), "--store", str(b), "--path", "bel-0:3",
               "--path", f"{b}@wide:2", "--json")
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    assert [c["label"] for c in body["columns"]] == [f"{a}:bel-0:3", f"{b}:wide:2"]
    res = _run("compare", "--store", str(a), "--path", "bel-0:3", "--path", "bel-0:6",
               "--export", str(tmp_path / "e"))
    assert res.exit_code == 0 and (tmp_path / "e" / "index.html").is_file(), res.output
    for paths, says in ((["bel-0:3"], "give 2 to 64 --path"),
                        (["bel-0:3", "bel-0:1"], "not a leaf"),
                        (["bel-0:3", "nope"], "no tree 'nope'")):
        res = _run("compare", "--store", str(a), *[x for p in paths for x in ("--path", p)])
        assert res.exit_code == 1 and says in res.output, res.output


def test_cli_sql_across_stores(stores: tuple[Path, Path]) -> None:
    a, b = stores
    res = _run("sql", "--stores", f"{a},{b}", "--format", "json",
               "SELECT store, count(*) AS n FROM trees GROUP BY ALL ORDER BY store")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == [{"store": str(a), "n": 3}, {"store": str(b), "n": 4}]
    for args, says in ((["--stores", f"{a},{a.parent / 'nope'}"], "no such store"),
                       (["--stores", f"{a},{a}"], "distinct store directories"),
                       (["--store", str(a), "--stores", str(b)], "not both")):
        res = _run("sql", *args, "SELECT 1")
        assert res.exit_code == 1 and says in res.output, res.output
    res = _run("sql", "--stores", f"{a},{b}", "SELECT regexp_matches(task_id, '(') FROM trees")
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1, res.output
    res = _run("sql", "--stores", f"{a},{b}", "COPY trees TO '/tmp/x.csv'")
    assert res.exit_code == 1 and "only SELECT and EXPLAIN" in res.output


def test_view_opens_several_stores_and_refuses_a_non_store(stores: tuple[Path, Path]) -> None:
    a, _ = stores
    res = _run("view", "--store", str(a), "--store", str(a.parent / "nope"))
    assert res.exit_code == 1 and "no such store" in res.output
    res = _run("view", "--store", str(a), "--store", str(a), "--port", "1")
    assert res.exit_code == 1 and "given twice" in res.output
