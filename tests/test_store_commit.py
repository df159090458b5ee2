"""Commit semantics: idempotent retries, partial appends invisible, pinned readers, time travel."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pytest

from rollout_store import Store, StoreError, connect, read_arrow, read_polars
from rollout_store.store import CommitReport
from rollout_store.synthetic import bel_shaped_batch


def counts(store: Store, version: object = None) -> dict[str, int]:
    con = connect(store, version)  # type: ignore[arg-type]
    return {t: con.sql(f"SELECT count(*) FROM {t}").fetchall()[0][0]
            for t in ("trees", "nodes", "snapshots", "paths")}


def test_retried_append_is_stored_once(store: Store) -> None:
    batch = bel_shaped_batch(5, seed=1, snapshot_bytes=16)
    first = store.append_trees(batch, key="job-7:batch-0")
    again = store.append_trees(batch, key="job-7:batch-0")
    assert first.rows["trees"] == 5 and not first.skipped
    assert again.already_committed and again.rows == {}
    assert counts(store)["trees"] == 5
    assert counts(store)["nodes"] == batch.nodes.num_rows


def test_append_killed_before_trees_commit_is_invisible_then_retry_completes(
        store: Store) -> None:
    batch = bel_shaped_batch(4, seed=2, snapshot_bytes=16)
    # Simulate a writer that died after committing snapshots and nodes but
    # before the trees commit (the commit point): commit those two tables only.
    full = Store.append_trees
    report = CommitReport("k")

    def partial(self: Store, table: str, rows: pa.Table, key: str, rep: CommitReport,
                 *rest: object) -> None:
        if table != "trees":
            Store._commit_table(self, table, rows, key, rep, *rest)  # type: ignore[arg-type]

    store._commit_table = partial.__get__(store)  # type: ignore[method-assign]
    full(store, batch, key="k")
    del store._commit_table
    assert store.version()["nodes"] == 1 and store.version()["trees"] == 0
    assert counts(store) == {"trees": 0, "nodes": 0, "snapshots": 0, "paths": 0}
    assert read_polars(store, "nodes").collect().height == 0
    assert read_arrow(store, "snapshots").num_rows == 0
    report = store.append_trees(batch, key="k")  # the retry
    assert sorted(report.skipped) == ["nodes", "snapshots"] and report.rows == {"trees": 4}
    assert counts(store)["nodes"] == batch.nodes.num_rows  # not twice


def test_rerun_with_new_key_after_crash_does_not_duplicate(store: Store) -> None:
    """Orphan rows of a dead append stay invisible even when its trees are rewritten."""
    batch = bel_shaped_batch(3, seed=3)

    def no_trees(self: Store, table: str, rows: pa.Table, key: str, rep: CommitReport,
                 *rest: object) -> None:
        if table != "trees":
            Store._commit_table(self, table, rows, key, rep, *rest)  # type: ignore[arg-type]

    store._commit_table = no_trees.__get__(store)  # type: ignore[method-assign]
    store.append_trees(batch, key="old")
    del store._commit_table
    store.append_trees(batch, key="new")
    assert counts(store)["nodes"] == batch.nodes.num_rows


def test_pinned_reader_sees_same_rows_while_writers_append(store: Store) -> None:
    store.append_trees(bel_shaped_batch(3, seed=1, tree_prefix="a"), key="a")
    pinned = store.version()
    con = connect(store, pinned)
    before = con.sql("SELECT tree_id, node_id FROM nodes ORDER BY ALL").fetchall()
    for i in range(3):
        store.append_trees(bel_shaped_batch(2, seed=10 + i, tree_prefix=f"b{i}"), key=f"b{i}")
    assert con.sql("SELECT tree_id, node_id FROM nodes ORDER BY ALL").fetchall() == before
    assert connect(store, pinned).sql("SELECT count(*) FROM trees").fetchall() == [(3,)]
    assert read_arrow(store, "nodes", pinned).num_rows == len(before)
    assert counts(store)["trees"] == 3 + 6


def test_time_travel_by_trees_version(store: Store) -> None:
    sizes = [2, 3, 4]
    for i, n in enumerate(sizes):
        store.append_trees(bel_shaped_batch(n, seed=i, tree_prefix=f"v{i}"), key=f"v{i}")
    for version, expected in enumerate([0, 2, 5, 9]):
        assert counts(store, version)["trees"] == expected
    with pytest.raises(StoreError, match="no trees version 9"):
        connect(store, 9)


def test_credit_metric_and_reference_appends(store: Store) -> None:
    from datetime import UTC, datetime

    from rollout_store.schema import CREDITS, MC_REFERENCES, METRICS

    store.append_trees(bel_shaped_batch(1, seed=0, tree_prefix="c"), key="c")
    now = datetime.now(UTC)
    credits = pa.Table.from_pylist([
        {"run_id": "r", "method": "grpo", "method_params_hash": "h", "method_params": "{}",
         "tree_id": "c-0-0000000", "node_id": 1, "value": 0.5, "token_values": None,
         "policy_version": "v0", "created_at": now}], schema=CREDITS)
    store.append_credits(credits, key="credit-1")
    store.append_credits(credits, key="credit-1")
    refs = pa.Table.from_pylist([{"run_id": "r", "tree_id": "c-0-0000000", "node_id": 1,
                                  "k": 32, "successes": 7, "policy_version": "v0",
                                  "created_at": now}], schema=MC_REFERENCES)
    store.append_mc_references(refs)
    metrics = pa.Table.from_pylist([{"run_id": "r", "step": 0, "name": "loss", "value": 1.5,
                                     "created_at": now}], schema=METRICS)
    store.append_metrics(metrics)
    con = connect(store)
    assert con.sql("SELECT method, value FROM credits").fetchall() == [("grpo", 0.5)]
    assert con.sql("SELECT k, successes FROM mc_references").fetchall() == [(32, 7)]
    bad = refs.set_column(refs.schema.get_field_index("successes"), "successes",
                          pa.array([33], pa.int32()))
    with pytest.raises(ValueError, match=r"successes must lie in \[0, k\]"):
        store.append_mc_references(bad)
    nan = metrics.set_column(metrics.schema.get_field_index("value"), "value",
                             pa.array([float("nan")]))
    with pytest.raises(ValueError, match="non_finite"):
        store.append_metrics(nan)


def test_a_store_opened_before_another_writer_commits_sees_the_commit(store: Store) -> None:
    """``Store`` keeps the table handles its schema check opened for the first read; that
    read must bring them up to date, not return the tables as they were at open."""
    late = Store(store.path)  # its handles unused until the read below
    store.append_trees(bel_shaped_batch(2, rollouts=2, depth=2, seed=9, tree_prefix="w"),
                       key="late")
    assert late.version()["trees"] == store.version()["trees"]
    assert read_arrow(late, "trees", columns=["tree_id"]).num_rows == read_arrow(
        store, "trees", columns=["tree_id"]).num_rows
    dictionary = read_arrow(late, "nodes", columns=["tree_id", "node_id"],
                            dictionary=["tree_id"])
    assert pa.types.is_dictionary(dictionary.column("tree_id").type)
    assert dictionary.column("tree_id").cast(pa.string()).to_pylist() == read_arrow(
        store, "nodes", columns=["tree_id"]).column("tree_id").to_pylist()


def test_append_checks_read_only_the_files_whose_tree_ids_can_clash(store: Store) -> None:
    """Each data file's commit records its ``tree_id`` bounds; the duplicate-id check of an
    append and the stored-node check of a credit append read only the files whose bounds
    hold one of their ids (a trainer's store gains a file per iteration), and still find
    a clash inside another append's range."""
    from rollout_store import maintenance
    from rollout_store.schema import CREDITS
    from rollout_store.validate import TreeValidationError

    for i in range(6):
        store.append_trees(bel_shaped_batch(2, rollouts=2, depth=2, seed=i,
                                            tree_prefix=f"it{i:03d}"), key=f"k{i}")
    bounds = sorted((f.min_tree, f.max_tree) for f in store.files("trees"))
    assert bounds[0] == ("it000-0-0000000", "it000-0-0000001") and len(bounds) == 6
    reads: list[str] = []
    real_read = store.loc.read_table

    def counted(path: str, *args: object, **kwargs: object) -> pa.Table:
        reads.append(path)
        return real_read(path, *args, **kwargs)  # type: ignore[arg-type]

    store.loc.read_table = counted  # type: ignore[method-assign]
    credit = pa.Table.from_pylist([
        {"run_id": "r", "method": "grpo", "method_params_hash": "h", "method_params": "{}",
         "tree_id": "it003-3-0000001", "node_id": 1, "value": 0.5, "token_values": None,
         "policy_version": "v0", "created_at": datetime.now(UTC)}], schema=CREDITS)
    store.append_credits(credit)
    assert [p.split("/")[-2] for p in reads] == ["trees", "nodes"]  # not 6 + 6 files
    reads.clear()
    store.append_trees(bel_shaped_batch(2, rollouts=2, depth=2, seed=9, tree_prefix="it900"),
                       key="k9")
    assert not [p for p in reads if p.split("/")[-2] == "trees"]  # no range holds it900-*
    with pytest.raises(TreeValidationError, match=r"it003-3-0000000.*duplicate_tree_id"):
        store.append_trees(bel_shaped_batch(2, rollouts=2, depth=2, seed=3,
                                            tree_prefix="it003"), key="again")
    missing = credit.set_column(credit.schema.get_field_index("node_id"),
                                credit.schema.field("node_id"), pa.array([10_000], pa.int64()))
    with pytest.raises(TreeValidationError, match="unknown_node"):
        store.append_credits(missing)
    del store.loc.read_table
    maintenance.compact(store)
    assert [(f.min_tree, f.max_tree) for f in store.files("trees")] == [
        ("it000-0-0000000", "it900-9-0000001")]
    with pytest.raises(TreeValidationError, match="duplicate_tree_id"):
        store.append_trees(bel_shaped_batch(1, rollouts=2, depth=2, seed=5,
                                            tree_prefix="it005"), key="after")


def test_kept_table_handles_follow_other_writers_and_threads(store: Store) -> None:
    """The handles a ``Store`` keeps for its own version checks and commits (``_latest``,
    one per table and thread) see every other writer's commits, key checks included, and
    two threads appending through one ``Store`` both land."""
    import threading

    other = Store(store.path)
    store.append_trees(bel_shaped_batch(2, rollouts=2, depth=2, seed=1, tree_prefix="a"),
                       key="a")
    assert other.version() == store.version()  # both now hold handles
    for i in range(3):  # commits by one, seen by the other's kept handles
        other.append_trees(bel_shaped_batch(2, rollouts=2, depth=2, seed=2 + i,
                                            tree_prefix=f"b{i}"), key=f"b{i}")
        assert store.version() == other.version()
    again = store.append_trees(bel_shaped_batch(2, rollouts=2, depth=2, seed=4,
                                                tree_prefix="b2"), key="b2")
    assert again.already_committed  # the key the other Store committed, seen
    with pytest.raises(StoreError, match="commit key 'b1' already committed different"):
        store.append_trees(bel_shaped_batch(3, rollouts=2, depth=2, seed=9,
                                            tree_prefix="z"), key="b1")
    errors: list[BaseException] = []

    def append(prefix: str) -> None:
        try:
            for i in range(3):
                store.append_trees(bel_shaped_batch(1, rollouts=2, depth=2, seed=20 + i,
                                                    tree_prefix=f"{prefix}{i}"),
                                   key=f"{prefix}{i}")
        except BaseException as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=append, args=(p,)) for p in ("t", "u")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert counts(other)["trees"] == 2 + 3 * 2 + 2 * 3
