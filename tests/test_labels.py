"""Labels (issue 26): ``rtrees label``, the ``labels`` table and ``labels_latest`` view, an
older store gaining the table, and labels written from the viewer."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import viewer_store  # tests/viewer_store.py
from deltalake import DeltaTable
from typer.testing import CliRunner

from rollout_store import Store, TreeValidationError, connect, read_arrow
from rollout_store import schema as schema_mod
from rollout_store.labels import label_rows, write_labels


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return viewer_store.build(tmp_path / "store")


def _latest(store: Store) -> list[tuple[object, ...]]:
    return connect(store).execute("SELECT tree_id, node_id, key, value, author FROM "
                                  "labels_latest ORDER BY ALL").fetchall()


def test_last_write_wins_and_history_stays(store: Store) -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for i, (node, values) in enumerate([(None, {"verdict": "bad", "note": "x"}),
                                        (2, {"verdict": "critical"}),
                                        (None, {"verdict": "good"}),
                                        (None, {"note": None})]):
        store.append_labels(label_rows("bel-0", node, values, "ann",
                                       now=t0 + timedelta(seconds=i)))
    assert _latest(store) == [("bel-0", 2, "verdict", "critical", "ann"),
                              ("bel-0", None, "verdict", "good", "ann")]
    assert read_arrow(store, "labels").num_rows == 5  # the history: every write


def test_labels_name_stored_trees_and_nodes(store: Store) -> None:
    with pytest.raises(TreeValidationError, match="unknown_tree"):
        write_labels(store, "nope", None, {"k": "v"})
    with pytest.raises(TreeValidationError, match="unknown_node"):
        write_labels(store, "bel-0", 99, {"k": "v"})
    with pytest.raises(ValueError, match="label key ''"):
        write_labels(store, "bel-0", None, {"": "v"})
    with pytest.raises(ValueError, match="at least one label"):
        write_labels(store, "bel-0", None, {})
    assert read_arrow(store, "labels").num_rows == 0


def test_a_version_2_store_opens_and_gains_labels(store: Store) -> None:
    """A store written before labels (schema version 2, no labels table) opens, gets the
    empty table, keeps its rows and takes labels."""
    shutil.rmtree(store.path / "labels")
    for name in schema_mod.SCHEMA_HISTORY[2]:
        if schema_mod.SCHEMA_HISTORY[2][name] != schema_mod.SCHEMAS.get(name):
            continue  # credits gained columns in version 4 (tests/test_credit_clip_bounds.py)
        DeltaTable(str(store.path / name)).alter.set_table_properties(
            {schema_mod.CONFIG_VERSION_KEY: "2"}, raise_if_not_exists=False)
    old = Store(store.path)
    assert old.table_schema_version["trees"] == schema_mod.SCHEMA_VERSION  # unchanged: writable
    assert read_arrow(old, "trees").num_rows == 3
    write_labels(old, "cal-0", 3, {"y0": "checked"}, "me")
    assert _latest(old) == [("cal-0", 3, "y0", "checked", "me")]


def test_cli_label(store: Store) -> None:
    from cli.main import app

    path = str(store.path)
    res = CliRunner().invoke(app, ["label", "--store", path, "--tree", "bel-0", "--node", "4",
                                   "--set", "verdict=wrong sign", "--set", "by=hand",
                                   "--author", "me"])
    assert res.exit_code == 0 and "2 label rows written" in res.output, res.output
    res = CliRunner().invoke(app, ["label", "--store", path, "--tree", "bel-0", "--node", "4",
                                   "--clear", "by"])
    assert res.exit_code == 0, res.output
    assert _latest(store) == [("bel-0", 4, "verdict", "wrong sign", "me")]
    res = CliRunner().invoke(app, ["sql", "SELECT count(*) AS n FROM labels", "--store", path,
                                   "--format", "json"])
    assert json.loads(res.output) == [{"n": 3}]
    for args, msg in ((["--tree", "nope", "--set", "a=b"], "unknown_tree"),
                      (["--tree", "bel-0", "--node", "99", "--set", "a=b"], "unknown_node"),
                      (["--tree", "bel-0", "--set", "novalue"], "expected KEY=VALUE"),
                      (["--tree", "bel-0"], "at least one --set"),
                      (["--tree", "bel-0", "--set", "a=b", "--clear", "a"], "also given")):
        res = CliRunner().invoke(app, ["label", "--store", path, *args])
        assert res.exit_code == 1 and msg in res.output, (args, res.output)


def test_labels_in_the_viewer(store: Store) -> None:
    from analysis.viewer.data import ViewerData
    from analysis.viewer.server import TOKEN_HEADER, start

    write_labels(store, "bel-0", None, {"verdict": "bad"}, "me")
    data = ViewerData(store)
    assert data.trees("labels LIKE '%verdict=bad%'")["trees"][0]["tree_id"] == "bel-0"
    assert data.tree("bel-0")["labels"]["tree"][0]["value"] == "bad"
    server, thread = start(store)
    try:
        def post(body: dict[str, object], token: str) -> tuple[int, dict[str, object]]:
            req = urllib.request.Request(server.url + "api/label", method="POST",
                                         data=json.dumps(body).encode(),
                                         headers={TOKEN_HEADER: token,
                                                  "Cookie": f"{server.cookie_name}="
                                                            f"{server.access_token}",
                                                  "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        status, res = post({"tree_id": "bel-0", "node_id": 2, "key": "k", "value": "v"},
                           server.token)
        assert status == 200 and res["nodes"]["2"][0]["value"] == "v"  # JSON: str keys
        assert post({"tree_id": "bel-0", "node_id": 2, "key": "k", "value": "w"},
                    "forged")[0] == 403
        status, res = post({"tree_id": "bel-0", "node_id": 77, "key": "k", "value": "v"},
                           server.token)
        assert status == 400 and "unknown_node" in str(res["error"])
        assert ("bel-0", 2, "k", "v") in [r[:4] for r in _latest(Store(store.path))]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
