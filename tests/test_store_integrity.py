"""Issue 13, the store: concurrent writers, retries with other content, lost commits,
damaged logs, durable commits. Real Delta tables, real processes, real files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rollout_store import Store, StoreError, TreeValidationError, connect, read_arrow
from rollout_store.maintenance import verify
from rollout_store.schema import SCHEMAS
from rollout_store.store import CommitKeyConflictError, CommitReport, DamagedLogError
from rollout_store.synthetic import bel_shaped_batch
from rollout_store.tree import Node, Tree

LOG = "_delta_log"


ROOT = Path(__file__).resolve().parents[1]


def _dir(store: Store) -> Path:
    """The directory of a local store (``Store.path`` is a ``Path`` or an ``ObjectPath``)."""
    assert isinstance(store.path, Path)
    return store.path


def _race(path: Path, keys: list[str]) -> list[str]:
    """Start one writer process per key, release them together, collect their outcomes."""
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.race_worker", str(path), k],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for k in keys]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return sorted(p.communicate(timeout=120)[0].strip() for p in procs)


def test_two_concurrent_writers_of_one_tree_store_it_once(tmp_path: Path) -> None:
    for round_ in range(3):
        path = tmp_path / f"s{round_}"
        Store(path, create=True)
        outcomes = _race(path, ["writer-a", "writer-b"])
        assert outcomes == ["duplicate_tree_id", "ok"], outcomes
        trees = read_arrow(Store(path), "trees", columns=["tree_id"])
        assert trees.num_rows == 3
        assert verify(Store(path)).ok


def test_same_key_race_loser_reads_already_committed(tmp_path: Path) -> None:
    path = tmp_path / "s"
    Store(path, create=True)
    assert _race(path, ["same-key", "same-key"]) == ["already", "ok"]
    con = connect(Store(path))
    assert con.sql("SELECT count(*) FROM nodes").fetchall()[0][0] == (
        bel_shaped_batch(3, rollouts=4, depth=3, seed=1, tree_prefix="same").nodes.num_rows)


def test_validate_reports_a_tree_stored_twice(store: Store) -> None:
    batch = bel_shaped_batch(2, rollouts=3, depth=3, seed=4)
    store.append_trees(batch, key="a")
    # What two racing writers left on main: the same trees under a second key.
    store._refuse_stored_trees = lambda ids: None  # type: ignore[method-assign,assignment]
    store.append_trees(batch, key="b")
    report = verify(Store(_dir(store)))
    assert not report.ok
    assert any("stored more than once" in p and "tree-4-0000000" in p for p in report.problems)


def _crash_before_trees(store: Store, batch: Any, key: str) -> None:
    def no_trees(self: Store, table: str, rows: pa.Table, k: str, rep: CommitReport,
                 *rest: Any) -> None:
        if table != "trees":
            Store._commit_table(self, table, rows, k, rep, *rest)  # type: ignore[arg-type]

    store._commit_table = no_trees.__get__(store)  # type: ignore[method-assign]
    store.append_trees(batch, key=key)
    del store._commit_table


def test_retry_with_other_content_after_a_crash_is_refused(store: Store) -> None:
    first = bel_shaped_batch(2, rollouts=3, depth=3, seed=5, tree_prefix="t")
    other = bel_shaped_batch(2, rollouts=6, depth=3, seed=5, tree_prefix="t")  # --n-total
    _crash_before_trees(store, first, "run:chunk-0")
    with pytest.raises(CommitKeyConflictError, match=r"'run:chunk-0'.*snapshots|nodes"):
        store.append_trees(other, key="run:chunk-0")
    assert read_arrow(store, "trees").num_rows == 0  # nothing mixed in
    store.append_trees(first, key="run:chunk-0")  # the true retry completes
    assert verify(store).ok


def test_retry_with_other_content_after_the_commit_is_refused(store: Store) -> None:
    first = bel_shaped_batch(2, rollouts=3, depth=3, seed=5, tree_prefix="t")
    other = bel_shaped_batch(3, rollouts=3, depth=3, seed=6, tree_prefix="t")
    store.append_trees(first, key="k")
    with pytest.raises(CommitKeyConflictError, match=r"rows then.*now"):
        store.append_trees(other, key="k")
    assert store.append_trees(first, key="k").already_committed  # an honest retry


def test_validate_finds_trees_whose_nodes_commit_is_gone(store: Store) -> None:
    for i in range(3):
        store.append_trees(bel_shaped_batch(2, rollouts=3, depth=3, seed=i,
                                            tree_prefix=f"b{i}"), key=f"k{i}")
    last = sorted((_dir(store) / "nodes" / LOG).glob("*.json"))[-1]
    last.unlink()
    report = verify(Store(_dir(store)))
    assert not report.ok
    assert any("nodes are missing" in p and "'b2-" in p for p in report.problems), report


def test_missing_nodes_table_is_not_recreated_empty(store: Store) -> None:
    store.append_trees(bel_shaped_batch(2, rollouts=3, depth=3), key="k")
    shutil.rmtree(_dir(store) / "nodes")
    with pytest.raises(StoreError, match="'nodes' is missing but 'trees' holds data"):
        Store(_dir(store), create=True)
    assert not (_dir(store) / "nodes").exists()


def _damage(path: Path, how: str) -> str:
    log = path / "nodes" / LOG
    commits = sorted(log.glob("*.json"))
    if how == "garbled":
        commits[1].write_text("{not json\n")
        return commits[1].name
    if how == "truncated":
        data = commits[-1].read_bytes()
        commits[-1].write_bytes(data[: len(data) // 2])
        return commits[-1].name
    if how == "gap":
        commits[1].unlink()
        return commits[1].name
    (log / "_last_checkpoint").write_text('{"version": 1, "size": 3}')
    return "_last_checkpoint"


@pytest.mark.parametrize("how", ["garbled", "truncated", "gap", "checkpoint"])
def test_damaged_delta_log_is_named(store: Store, how: str) -> None:
    for i in range(3):
        store.append_trees(bel_shaped_batch(1, rollouts=2, depth=2, seed=i,
                                            tree_prefix=f"d{i}"), key=f"k{i}")
    name = _damage(_dir(store), how)
    with pytest.raises(DamagedLogError) as info:
        Store(_dir(store))
    message = str(info.value)
    assert "'nodes'" in message and name in message and "\n" not in message
    assert "DeltaError" not in message and "<unknown>" not in message


def test_commits_are_fsynced_before_the_next_table(store: Store,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A spy on os.fsync (the real call still runs) records what was made durable."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store.append_trees(bel_shaped_batch(1, rollouts=2, depth=2, snapshot_bytes=8), key="k")
    commit = [s.split(os.sep)[-3] for s in synced if s.endswith("00000000000000000001.json")]
    assert commit == ["snapshots", "nodes", "trees"]
    for table in ("snapshots", "nodes", "trees"):
        assert str(store.path / table / LOG) in synced  # the directory entry too
        assert str(store.path / table) in synced  # the data file's name
    order = [s for s in synced if s.endswith(".json")]
    assert [s.split(os.sep)[-3] for s in order] == ["snapshots", "nodes", "trees"]


def test_siblings_view_is_linear_in_fan_out(store: Store) -> None:
    """100k children of one node: the range join took ~16 s here (quadratic: 4 s at 50k,
    131 s at 200k); the running-count view takes a fraction of a second."""
    import time

    from rollout_store.synthetic import wide_batch

    store.append_trees(wide_batch(100_000), key="wide")
    con = connect(store)
    start = time.perf_counter()
    rows = con.sql("SELECT count(*), sum(n_leaves), sum(n_success) FROM siblings").fetchall()
    assert time.perf_counter() - start < 3.0
    assert rows == [(100_000, 100_000, 50_000)]


# -- item 6: inputs the writer used to accept or crash on ------------------------------

def _small(tree_id: str = "t") -> Tree:
    return Tree(tree_id, [
        Node(0, None, kind="prompt", observation_text="p"),
        Node(1, 0, action_token_ids=[5, 6], action_logprobs=[-0.1, -0.2], snapshot_id="s1"),
        Node(2, 1, reward=1.0, terminal=True), Node(3, 0, reward=0.0, terminal=True),
    ], snapshots={"s1": b"x"})


def _node(i: int, **changes: Any) -> Any:
    def apply(t: Tree) -> None:
        for k, v in changes.items():
            setattr(t.nodes[i], k, v)
    return apply


def _tree(**changes: Any) -> Any:
    def apply(t: Tree) -> None:
        for k, v in changes.items():
            setattr(t, k, v)
    return apply


BAD_INPUTS: list[tuple[str, Any, str]] = [
    ("float node id", _node(3, node_id=3.7), "column_type"),
    ("float parent id", _node(3, parent_id=0.5), "column_type"),
    ("float token id", _node(1, action_token_ids=[5.5, 6]), "column_type"),
    ("negative token id", _node(1, action_token_ids=[-5, 6]), "token_id_range"),
    ("negative observation token", _node(1, observation_token_ids=[-1]), "token_id_range"),
    ("critical node 999", _tree(critical_node_id=999), "critical_node"),
    ("str node id", _node(3, node_id="3"), "column_type"),
    ("str parent id", _node(3, parent_id="0"), "column_type"),
    ("lone surrogate text", _node(1, action_text="a\ud800"), "column_type"),
    ("lone surrogate tree id", _tree(tree_id="t\udc00"), "column_type"),
    ("token over int32", _node(1, action_token_ids=[2**40, 6]), "column_type"),
    ("node id over int64", _node(3, node_id=2**70), "column_type"),
    ("str reward", _node(2, reward="1"), "column_type"),
    ("str terminal", _node(2, terminal="yes"), "column_type"),
    ("str logprob", _node(1, action_logprobs=["a", -0.2]), "column_type"),
    ("budget over int32", _tree(budget=2**40), "column_type"),
    ("seed over int64", _tree(seed=2**70), "column_type"),
    ("unserialisable meta", _tree(meta={"x": object()}), "column_type"),
    ("str snapshot state", _tree(snapshots={"s1": "text"}), "column_type"),
    ("int kind", _node(1, kind=3), "column_type"),
]


@pytest.mark.parametrize(("case", "change", "rule"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_named_validation_error(store: Store, case: str, change: Any,
                                               rule: str) -> None:
    tree = _small()
    change(tree)
    with pytest.raises(TreeValidationError) as info:
        store.append_trees([tree], key="k")
    assert info.value.rule == rule, info.value
    assert "tree 't" in str(info.value)
    assert store.version()["nodes"] == 0  # nothing written


def test_node_pointing_at_another_trees_snapshot_is_refused(store: Store) -> None:
    a, b = _small("a"), _small("b")
    a.snapshots = {}
    b.snapshots = {"s1": b"x", "s2": b"y"}
    b.nodes[1].snapshot_id = "s2"
    with pytest.raises(TreeValidationError, match=r"tree 'a', node 1.*belongs to tree 'b'"):
        store.append_trees([a, b], key="k")


def test_credits_and_references_must_name_stored_nodes(store: Store) -> None:
    from datetime import UTC, datetime

    store.append_trees([_small()], key="k")
    now = datetime.now(UTC)

    def credit(node_id: int) -> pa.Table:
        return pa.Table.from_pylist([{
            "run_id": "r", "method": "m", "method_params_hash": "h", "method_params": None,
            "tree_id": "t", "node_id": node_id, "value": 0.5, "token_values": None,
            "policy_version": None, "created_at": now}], schema=SCHEMAS["credits"])

    store.append_credits(credit(2), key="c-ok")
    with pytest.raises(TreeValidationError, match=r"node 999.*unknown_node"):
        store.append_credits(credit(999), key="c-bad")
    ref = pa.Table.from_pylist([{"run_id": "r", "tree_id": "nope", "node_id": 1, "k": 4,
                                 "successes": 1, "policy_version": None, "created_at": now}],
                               schema=SCHEMAS["mc_references"])
    with pytest.raises(TreeValidationError, match="unknown_node"):
        store.append_mc_references(ref, key="r-bad")
    assert verify(store).ok


def test_a_footer_bit_flip_that_pyarrow_reads_is_caught_by_validate(store: Store) -> None:
    """Find a footer byte whose flip pyarrow still reads (page checksums do not cover the
    footer) but DuckDB cannot; validate must report that file."""
    from rollout_store.store import check_data_file

    store.append_trees(bel_shaped_batch(2, rollouts=3, depth=3), key="k")
    victim = store.files("nodes")[0]
    original = Path(victim.path).read_bytes()
    footer_len = int.from_bytes(original[-8:-4], "little")
    found = False
    for offset in range(len(original) - 8 - footer_len, len(original) - 8):
        damaged = bytearray(original)
        damaged[offset] ^= 0x10
        Path(victim.path).write_bytes(damaged)
        try:
            check_data_file(victim.path, victim.size)
        except Exception:  # pyarrow noticed: not the case we look for
            continue
        report = verify(Store(_dir(store)))
        if not report.ok:
            assert any(Path(victim.path).name in p for p in report.problems), report
            found = True
            break
        import duckdb

        try:
            duckdb.execute(f"SELECT * FROM read_parquet('{victim.path}')").fetchall()
        except duckdb.Error:
            pytest.fail(f"flip at {offset}: DuckDB fails but validate passed")
    Path(victim.path).write_bytes(original)
    assert found, "no footer flip that pyarrow reads and DuckDB does not was found"


def test_commands_on_a_damaged_log_print_one_line(store: Store,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import app

    for i in range(2):
        store.append_trees(bel_shaped_batch(1, rollouts=2, depth=2, seed=i,
                                            tree_prefix=f"d{i}"), key=f"k{i}")
    name = _damage(_dir(store), "garbled")
    for args in (["store", "validate"], ["store", "info"], ["sql", "SELECT 1"]):
        with pytest.raises(SystemExit) as info:
            app([*args, "--store", str(store.path)])
        err = capsys.readouterr().err
        assert info.value.code == 1 and err.count("\n") == 1, err
        assert name in err and "'nodes'" in err and "Traceback" not in err


def _metric_rows(step: int) -> pa.Table:
    return pa.table({"run_id": ["cp"], "step": [step], "name": ["loss"], "value": [1.0],
                     "created_at": pa.array([0], SCHEMAS["metrics"].field("created_at").type)},
                    schema=SCHEMAS["metrics"])


def test_checkpoints_every_n_commits_keep_keys_and_rows(store: Store,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Issue 16: a Delta checkpoint every ``CHECKPOINT_EVERY`` commits of a table (opens
    replay a bounded log); the application transactions (commit keys, digests) and every
    row survive it, and a store read through its checkpoint validates."""
    import json

    from rollout_store import store as store_mod

    monkeypatch.setattr(store_mod, "CHECKPOINT_EVERY", 3)
    for step in range(1, 8):  # metrics versions 1..7 (0 is the create)
        store.append_metrics(_metric_rows(step), key=f"m{step}")
    log = _dir(store) / "metrics" / LOG
    assert sorted(p.name for p in log.glob("*.checkpoint.parquet")) == [
        f"{v:020d}.checkpoint.parquet" for v in (3, 6)]
    assert json.loads((log / "_last_checkpoint").read_text())["version"] == 6
    again = Store(_dir(store))
    assert again.append_metrics(_metric_rows(1), key="m1").skipped == ["metrics"]
    with pytest.raises(CommitKeyConflictError):
        again.append_metrics(_metric_rows(99), key="m2")  # other content, same key
    assert read_arrow(again, "metrics").num_rows == 7
    report = verify(again)
    assert report.ok, report.problems
