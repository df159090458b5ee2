"""``rtrees export --format hf|atif|adp`` and ``rtrees import --format atif`` (issue 26).

Each export is read back with the format's own reader where one is installed
(``datasets.load_dataset("parquet")``; else pyarrow reads the shards) and, for ATIF and
ADP, every record is validated against the schema of ``rollout_store.exporters``; the
contents are compared with the store. ATIF trajectories imported into a new store give
back each path's text, token ids, logprobs and reward.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pyarrow.dataset as pads
import pytest
import viewer_store  # tests/viewer_store.py
from typer.testing import CliRunner

from rollout_store import Store, connect, read_trees
from rollout_store.exporters import (
    ADP_SCHEMA,
    ATIF_SCHEMA,
    SCHEMA_VERSION,
    export_paths,
    parse_tool_call,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return viewer_store.build(tmp_path_factory.mktemp("export") / "store")


def _paths(store: Store) -> dict[str, list[int]]:
    """'tree/leaf' -> node ids along the path (root excluded), from the store."""
    out = {}
    for t in read_trees(store, snapshots=False):
        for leaf in t.leaves():
            out[f"{t.tree_id}/{leaf.node_id}"] = [n.node_id for n in t.path_to(leaf.node_id)][1:]
    return out


def test_hf_export_reads_back(store: Store, tmp_path: Path) -> None:
    report = export_paths(store, "hf", tmp_path / "hf")
    expected = _paths(store)
    assert report.paths == len(expected) == 10 and report.trees == 3
    try:
        import datasets

        ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "hf" / "data"),
                                   split="train")
        rows = ds.to_list()
    except ImportError:  # not installed here: the Parquet shards with pyarrow
        rows = pads.dataset(str(tmp_path / "hf" / "data")).to_table().to_pylist()
    got = {f"{r['tree_id']}/{r['leaf_id']}": [s["node_id"] for s in r["steps"]] for r in rows}
    assert got == expected
    bel2 = next(r for r in rows if r["tree_id"] == "bel-0" and r["leaf_id"] == 5)
    step = bel2["steps"][0]
    assert step["action_text"] == viewer_store.ACTION_2 and step["observation_text"] == "40"
    assert {c["method"]: c["value"] for c in step["credit"]} == {
        "grpo": viewer_store.CREDIT[("bel-0", 2)][0], "tree_grpo": viewer_store.CREDIT[
            ("bel-0", 2)][1]}
    assert bel2["reward"] == 0.0 and bel2["prompt"].startswith("What is 17*23")
    info = json.loads((tmp_path / "hf" / "dataset_info.json").read_text())
    assert info["splits"]["train"]["num_examples"] == 10 and "steps" in info["features"]
    meta = json.loads((tmp_path / "hf" / "metadata.json").read_text())
    assert meta["schema_version"] == SCHEMA_VERSION and meta["paths"] == 10
    assert meta["store_version"] == dict(store.version())
    assert meta["columns"]["reward"]["mean"] == pytest.approx(
        sum(r["reward"] for r in rows) / 10)
    assert meta["columns"]["prompt_token_ids"]["elements"] > 0
    with pytest.raises(ValueError, match="already holds an export"):
        export_paths(store, "hf", tmp_path / "hf")


def test_atif_export_validates_and_round_trips(store: Store, tmp_path: Path) -> None:
    export_paths(store, "atif", tmp_path / "atif", tree_ids=["bel-0"])
    files = sorted((tmp_path / "atif" / "trajectories").glob("*.json"))
    assert len(files) == 4
    trajs = [json.loads(f.read_text()) for f in files]
    for t in trajs:
        jsonschema.validate(t, ATIF_SCHEMA)
    t5 = next(t for t in trajs if t["session_id"] == "bel-0/5")
    agent = [s for s in t5["steps"] if s["source"] == "agent"]
    assert agent[0]["tool_calls"][0]["function_name"] == "calc"
    assert agent[0]["tool_calls"][0]["arguments"] == {"expr": "17+23"}
    assert agent[0]["observation"]["results"][0]["content"] == "40"
    # prompt token ids: everything before the action along the path
    assert agent[1]["metrics"]["prompt_token_ids"] == (
        t5["extra"]["prompt_token_ids"] + agent[0]["metrics"]["completion_token_ids"]
        + agent[0]["extra"]["observation_token_ids"])
    assert t5["final_metrics"]["extra"]["reward"] == 0.0

    fresh = Store(tmp_path / "back", create=True)
    from cli.main import app

    res = CliRunner().invoke(app, ["import", str(tmp_path / "atif" / "trajectories"),
                                   "--store", str(fresh.path), "--format", "atif"])
    assert res.exit_code == 0 and "4 trees imported" in res.output, res.output
    res = CliRunner().invoke(app, ["import", str(tmp_path / "atif" / "trajectories"),
                                   "--store", str(fresh.path), "--format", "atif"])
    assert "already stored" in res.output
    original = {t.tree_id: t for t in read_trees(store, ["bel-0"], snapshots=False)}["bel-0"]
    back = read_trees(fresh, snapshots=False)
    assert len(back) == 4
    for t in back:
        leaf = original.node(int(t.meta["session_id"].split("/")[1]))
        path = original.path_to(leaf.node_id)
        chain = sorted(t.nodes, key=lambda n: n.node_id)
        assert chain[0].observation_text == path[0].observation_text
        assert [n.action_text for n in chain[1:]] == [n.action_text for n in path[1:]]
        assert [n.action_token_ids for n in chain[1:]] == [n.action_token_ids for n in path[1:]]
        assert [n.action_logprobs for n in chain[1:]] == [n.action_logprobs for n in path[1:]]
        assert [n.observation_text for n in chain[1:]] == [n.observation_text for n in path[1:]]
        assert chain[-1].reward == leaf.reward


def test_adp_export_validates(store: Store, tmp_path: Path) -> None:
    export_paths(store, "adp", tmp_path / "adp", run_id=viewer_store.RUN)
    records = [json.loads(line) for line in (tmp_path / "adp" / "adp.jsonl").read_text()
               .splitlines()]
    assert len(records) == 10
    for r in records:
        jsonschema.validate(r, ADP_SCHEMA)
    r = next(r for r in records if r["id"] == "bel-0/5")
    assert [c["class_"] for c in r["content"]] == [
        "text_observation", "api_action", "text_observation", "message_action"]
    assert r["content"][1]["kwargs"] == {"expr": "17+23"} and r["details"]["reward"] == 0.0
    assert r["details"]["credit"]["2"]["grpo"] == viewer_store.CREDIT[("bel-0", 2)][0]
    with pytest.raises(jsonschema.ValidationError):  # the schema check bites
        jsonschema.validate({"id": "x", "content": [{"class_": "bogus"}], "details": {}},
                            ADP_SCHEMA)


def test_bad_input(store: Store, tmp_path: Path) -> None:
    from cli.main import app

    for args, msg in ((["--format", "hf", "--tree", "nope"], "no tree 'nope'"),
                      (["--format", "atif", "--run", "no-such-run"], "no path selected"),
                      (["--format", "xml"], "Invalid value")):
        res = CliRunner().invoke(app, ["export", "--store", str(store.path), "--out",
                                       str(tmp_path / "o"), *args])
        assert res.exit_code != 0 and msg in res.output, (args, res.output)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": "ATIF-v1.4", "steps": [
        {"step_id": 1, "source": "user", "message": "hi"}]}))
    fresh = tmp_path / "fresh"
    res = CliRunner().invoke(app, ["import", str(bad), "--store", str(fresh), "--format",
                                   "atif"])
    assert res.exit_code == 1 and "no agent step" in res.output
    assert connect(Store(fresh)).execute("SELECT count(*) FROM trees").fetchall() == [(0,)]
    assert parse_tool_call("<tool_call>not json</tool_call>") is None
    assert parse_tool_call('x <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>') \
        == ("f", {"a": 1})
