"""``rtrees view`` without a browser (issue 26): what the page is served, from a real store.

The store is ``tests/viewer_store.py`` (three calc-shaped trees with known credit). The
page itself is driven in a real browser by ``tests/test_viewer_browser.py``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import viewer_store  # tests/viewer_store.py
from typer.testing import CliRunner
from viewer_store import ACTION_2, CREDIT

from analysis.viewer.data import (
    FilterError,
    ViewerData,
    checked_where,
    compare_credit,
    sibling_ranks,
)
from analysis.viewer.server import HOST, TOKEN_HEADER, start


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("viewer") / "store"
    viewer_store.build(path)
    return path


@pytest.fixture(scope="module")
def data(store_path: Path) -> ViewerData:
    return ViewerData(store_path)


def test_tree_filter_runs_as_sql_over_trees(data: ViewerData) -> None:
    ids = [t["tree_id"] for t in data.trees("sampler = 'bel' OR reward < 0.4")["trees"]]
    assert ids == ["bel-0", "cal-0"]  # cal-0: mean leaf reward 1/3
    assert [t["tree_id"] for t in data.trees(None, run_id="viewer-run")["trees"]] == \
        ["bel-0", "cal-0", "ref-0"]
    assert data.trees("critical_node_id = 2")["trees"][0]["leaves"] == 4


@pytest.mark.parametrize("text", [
    "1=1; COPY trees TO '/tmp/rtrees-viewer-leak.csv'",
    "tree_id IN (SELECT tree_id FROM read_text('/etc/passwd'))",
    "length((SELECT content FROM read_text('/etc/passwd'))) > 0",
    "1=1) UNION SELECT 1 FROM (SELECT 1",
    "true GROUP BY tree_id",
    "true ORDER BY tree_id",
    "no_such_column > 1",
    "read_text('/etc/passwd') IS NOT NULL",
    "",
])
def test_tree_filter_refuses_anything_but_one_expression(data: ViewerData, text: str) -> None:
    with data._lock, pytest.raises(FilterError):
        checked_where(data.con, text)
    if text:
        with pytest.raises(FilterError):
            data.trees(text)
    assert not Path("/tmp/rtrees-viewer-leak.csv").exists()


def test_one_tree_has_everything_the_panel_shows(data: ViewerData) -> None:
    tree = data.tree("bel-0")
    nodes = {n["id"]: n for n in tree["nodes"]}
    assert tree["tree"]["critical_node_id"] == 2
    assert tree["methods"] == ["grpo", "tree_grpo"]
    assert [n["id"] for n in tree["nodes"]] == [0, 1, 3, 4, 2, 5, 6]  # preorder
    assert (nodes[0]["x"], nodes[0]["depth"]) == (1.5, 0)  # centred over its leaves 0..3
    assert [nodes[i]["x"] for i in (3, 4, 5, 6)] == [0.0, 1.0, 2.0, 3.0]
    two = nodes[2]
    assert two["action_text"] == ACTION_2 and two["observation_text"] == "40"
    # token ids decoded by the calc tokenizer the tree's policy_ref names
    assert "".join(two["tokens"]["text"]) == ACTION_2
    assert len(two["tokens"]["logprob"]) == len(two["tokens"]["ids"])
    assert two["credit"]["grpo"] == {"value": CREDIT[("bel-0", 2)][0], "tokens": None}
    n = len(two["tokens"]["ids"])
    assert two["credit"]["tree_grpo"]["tokens"] == pytest.approx(
        viewer_store.token_credit("bel-0", 2, n), abs=1e-6)
    assert [(r["k"], r["successes"], r["mean"]) for r in nodes[1]["mc"]] == [(8, 6, 0.75)]
    snap = tree["snapshots"][two["snapshot_id"]]
    assert snap["env"] == "calc" and '"node": 2' in snap["preview"]
    assert tree["lineage"]["refreshed_by"] == ["ref-0"]
    assert tree["groups"] == []


def test_caliper_groups_and_refresh_lineage(data: ViewerData) -> None:
    assert data.tree("cal-0")["groups"] == [
        {"branch": 1, "members": [3, 4, 5], "y0": 3, "bucket": "F9"}]
    lineage = data.tree("ref-0")["lineage"]
    assert lineage["refresh_of"] == "bel-0" and lineage["lineage"] == {"1": 1, "2": 2}
    assert lineage["copied"] == {0: 0}
    with pytest.raises(KeyError, match="no tree 'nope'"):
        data.tree("nope")


def test_compare_by_sign_and_rank_by_hand() -> None:
    parents: dict[int, int | None] = {0: None, 1: 0, 2: 0, 3: 1, 4: 1}
    a = {1: 0.5, 2: -0.5, 3: 0.2, 4: 0.1}
    b = {1: -0.1, 2: 0.3, 3: 0.2, 4: 0.1}
    assert sibling_ranks(parents, a) == {1: 1, 2: 2, 3: 1, 4: 2}
    rows = {r["node_id"]: r for r in compare_credit(parents, a, b)}
    assert [n for n, r in rows.items() if r["sign_differs"]] == [1, 2]
    assert [n for n, r in rows.items() if r["rank_differs"]] == [1, 2]  # 1 and 2 swap
    assert not rows[3]["rank_differs"] and rows[3]["rank_a"] == 1


def test_compare_on_the_store(data: ViewerData) -> None:
    res = data.compare("bel-0", "grpo", "tree_grpo")
    assert res["sign_disagreements"] == 1 and res["rank_disagreements"] == 1
    (row,) = [r for r in res["rows"] if r["sign_differs"]]
    assert row["node_id"] == 4 and (row["rank_a"], row["rank_b"]) == (1, 2)
    with pytest.raises(KeyError, match="no credit of method 'elpo'"):
        data.compare("bel-0", "grpo", "elpo")


def test_metrics_and_runs(data: ViewerData) -> None:
    m = data.metrics(viewer_store.TRAIN_RUN)
    assert sorted(m) == ["loss", "reward"] and m["loss"][0] == [0, 1.0] and len(m["loss"]) == 6
    runs = {r["run_id"]: r for r in data.runs()}
    assert runs["viewer-run"]["trees"] == 3 and runs[viewer_store.TRAIN_RUN]["metrics"] == 2


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read().decode()
            return r.status, (json.loads(body) if "json" in r.headers["Content-Type"]
                              else body)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def test_server_is_local_and_read_only(store_path: Path) -> None:
    server, thread = start(store_path)
    try:
        assert server.server_address[0] == HOST == "127.0.0.1"
        # no access token: no page (and so no label token), no file, no answer
        status, body = _get(server.url)
        assert status == 403 and "access token" in body["error"]
        assert server.token not in json.dumps(body)
        assert _get(server.url + "api/runs")[0] == 403
        status, page = _get(server.login_url)  # the URL the CLI prints
        assert status == 200 and server.token in page and "viewer.js" in page
        auth = {"Cookie": f"{server.cookie_name}={server.access_token}"}
        assert _get(server.url + "static/viewer.js", auth)[0] == 200
        assert _get(server.url + "static/../data.py", auth)[0] == 404
        status, body = _get(server.url + "api/tree?id=bel-0", auth)
        assert status == 200 and body["tree"]["critical_node_id"] == 2
        assert _get(server.url + "api/tree?id=nope", auth)[0] == 404
        status, body = _get(server.url + "api/trees?where=1%3D1%3B%20DROP%20VIEW%20trees",
                            auth)
        assert status == 400 and "';'" in body["error"]
        assert _get(server.url + "api/trees", auth)[1]["trees"][0]["tree_id"] == "bel-0"
        # DNS rebinding: a request naming another host is refused, token or not
        assert _get(server.url + "api/runs", {**auth, "Host": "evil.example:80"})[0] == 403
        # the write route needs the page's token as well as the access token
        req = urllib.request.Request(server.url + "api/label", data=b"{}", method="POST",
                                     headers=auth)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 403
        req.add_header(TOKEN_HEADER, "wrong")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 403
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_cli_view_bad_input(tmp_path: Path) -> None:
    from cli.main import app

    res = CliRunner().invoke(app, ["view", "--store", str(tmp_path / "none")])
    assert res.exit_code == 1 and "no such store" in res.output
    res = CliRunner().invoke(app, ["view", "--store", str(tmp_path), "--port", "70000"])
    assert res.exit_code == 1 and "--port must be in 0..65535" in res.output


def test_static_export_embeds_every_answer(store_path: Path, tmp_path: Path) -> None:
    from analysis.viewer.export import export_static, static_key

    report = export_static(store_path, tmp_path / "out", run_id="viewer-run")
    html = report.path.read_text()
    assert report.trees == 3 and report.runs == 1
    assert "static/viewer.js" not in html and "window.RTREES_STATIC" in html  # one file
    start = html.index("window.RTREES_STATIC = ") + len("window.RTREES_STATIC = ")
    answers = json.loads(html[start:html.index(";</script>", start)])
    assert answers[static_key("/api/tree", id="bel-0")]["tree"]["critical_node_id"] == 2
    assert '<meta name="rtrees-token" content="">' in html  # no server: no token
    cmp = answers[static_key("/api/compare", tree="bel-0", a="grpo", b="tree_grpo")]
    assert cmp["sign_disagreements"] == 1
    assert static_key("/api/trees", run="viewer-run", where="") == "/api/trees|run=viewer-run"
    with pytest.raises(ValueError, match="no tree selected"):
        export_static(store_path, tmp_path / "none", where="sampler = 'nope'")
    with pytest.raises(ValueError, match="more than --max-trees 2"):
        export_static(store_path, tmp_path / "many", max_trees=2)
    with pytest.raises(ValueError, match="no tree 'nope'"):
        export_static(store_path, tmp_path / "bad", tree_ids=["bel-0", "nope"])
    with pytest.raises(FilterError):
        export_static(store_path, tmp_path / "bad", where="1=1; DROP VIEW trees")


def test_cli_view_export(store_path: Path, tmp_path: Path) -> None:
    from cli.main import app

    res = CliRunner().invoke(app, ["view", "--store", str(store_path), "--export",
                                   str(tmp_path / "e"), "--tree", "cal-0"])
    assert res.exit_code == 0, res.output
    assert "1 trees" in res.output and (tmp_path / "e" / "index.html").is_file()
    res = CliRunner().invoke(app, ["view", "--store", str(store_path), "--where", "1=1"])
    assert res.exit_code == 1 and "select trees for --export" in res.output


def test_stored_text_never_becomes_markup(tmp_path: Path) -> None:
    """A hostile action text is data: the static export's embedded answers cannot close
    the script element, and the page builds text nodes only (no innerHTML anywhere)."""
    from analysis.viewer.export import export_static
    from analysis.viewer.server import static_text
    from rollout_store import Store
    from rollout_store.tree import Node, Tree

    evil = "</script><script>alert(1)</script><img src=x onerror=alert(2)>"
    # an agent program's model call (node meta "call", ``train.envs.agent.program``): its
    # messages, their tool call ids and its parsed tool calls are a program's text too
    call = {"index": 1, "first": 0, "messages": [
        {"role": evil, "content": evil},
        {"role": "tool", "tool_call_id": evil, "content": [{"type": "text", "text": evil}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": evil, "function": {"name": evil, "arguments": evil}}]}],
        "tool_calls": [{"id": evil, "name": evil, "arguments": evil}]}
    store = Store(tmp_path / "s", create=True)
    store.append_trees([Tree("evil", [
        Node(0, None, "prompt", observation_text=evil),
        Node(1, 0, action_text=evil, terminal=True, reward=1.0, meta={"call": call}),
        Node(2, 0, action_text=evil + "!", observation_text=evil, terminal=True,
             reward=0.0, meta={"call": call, "diverged": {"call": 2, "field": evil}})])])
    html = export_static(store, tmp_path / "out").path.read_text()
    assert evil not in html and "\\u003c/script>\\u003cscript>alert(1)" in html
    assert html.count("<script>") == 2  # the data and the inlined viewer.js, nothing more
    assert '"tool_call_id": "\\u003c/script>' in html  # the call travels, as data
    viewer = static_text("viewer.js")
    assert "function drawCall(call)" in viewer and "n.meta.call" in viewer
    # the comparison views (issue 48): the N-way compare export embeds the same way
    from analysis.viewer.export import export_compare

    page = export_compare(store, [(None, "evil", 1), (None, "evil", 2)],
                          tmp_path / "cmp").path.read_text()
    assert evil not in page and "\\u003c/script>\\u003cscript>alert(1)" in page
    assert page.count("<script>") == 2
    assert ".innerHTML" not in static_text("viewer.js")  # the comment names it, no code


def test_export_never_overwrites_without_force(store_path: Path, tmp_path: Path) -> None:
    """``view --export DIR`` refuses an existing ``DIR/index.html`` (one line, exit 1, the
    file untouched, even a dangling symlink there) unless ``--force``."""
    from analysis.viewer.export import export_static
    from cli.main import app

    out = tmp_path / "e"
    out.mkdir()
    page = out / "index.html"
    page.write_text("my report")
    args = ["view", "--store", str(store_path), "--export", str(out), "--tree", "cal-0"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output
    assert res.output.strip().splitlines() == [f"error: {page} exists: pass --force to "
                                               "overwrite it"]
    assert page.read_text() == "my report"
    with pytest.raises(FileExistsError, match="pass --force"):
        export_static(store_path, out, tree_ids=["cal-0"])
    assert page.read_text() == "my report"
    res = CliRunner().invoke(app, [*args, "--force"])
    assert res.exit_code == 0, res.output
    assert "window.RTREES_STATIC" in page.read_text()
    # a dangling symlink is refused too: writing through it would create its target
    link_dir = tmp_path / "l"
    link_dir.mkdir()
    (link_dir / "index.html").symlink_to(tmp_path / "elsewhere.html")
    assert CliRunner().invoke(app, ["view", "--store", str(store_path), "--export",
                                    str(link_dir), "--tree", "cal-0"]).exit_code == 1
    assert not (tmp_path / "elsewhere.html").exists()
    # --force without --export is an error, not a silent no-op
    res = CliRunner().invoke(app, ["view", "--store", str(store_path), "--force"])
    assert res.exit_code == 1 and "--force overwrites the file of --export" in res.output
