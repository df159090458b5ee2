"""Killed writers, concurrent appenders and compaction beside them (real processes)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from rollout_store import Store, connect, read_polars
from rollout_store.maintenance import compact, verify
from rollout_store.synthetic import bel_shaped_batch

ROOT = Path(__file__).resolve().parents[1]


def start_worker(store: Path, prefix: str, n: int, per_batch: int = 20) -> subprocess.Popen[str]:
    # stderr goes to a file: with one pipe, communicate() reads through the same
    # buffered stream that wait_ready() used, so no ACK line is lost.
    errfile = open(store.parent / f"{prefix}.stderr", "w")  # noqa: SIM115 - child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.append_worker", str(store), prefix, str(n),
         str(per_batch)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=errfile, text=True)


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "READY", f"worker did not start: {line!r}"


def acks(output: str) -> list[str]:
    return [line.split()[1] for line in output.splitlines() if line.startswith("ACK ")]


def check_consistent(store: Store) -> dict[str, int]:
    """Every committed tree is whole; DuckDB and polars agree on every count."""
    con = connect(store)
    per_tree = con.sql("""
        SELECT t.tree_id, t.n_nodes, count(n.node_id) AS got
        FROM trees t LEFT JOIN nodes n USING (tree_id) GROUP BY ALL""").fetchall()
    assert all(n == got for _, n, got in per_tree), "a committed tree is not whole"
    counts = {}
    for table in ("trees", "nodes", "snapshots"):
        duck = con.sql(f"SELECT count(*) FROM {table}").fetchall()[0][0]
        polars = read_polars(store, table).select(pl.len()).collect().item()
        assert duck == polars, (table, duck, polars)
        counts[table] = duck
    # Uncommitted rows (a killed append's nodes) exist on disk but are never visible.
    raw = sum(f.num_records or 0 for f in store.files("nodes"))
    assert raw >= counts["nodes"]
    return counts


@pytest.mark.slow  # ~35 s; tests/test_store_s3.py's kill -9 runs the same commit path
def test_kill_9_during_appends_leaves_only_whole_commits(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = Store(path, create=True)
    rng = random.Random(0)
    acked: set[str] = set()
    runs = 30
    for run in range(runs):
        proc = start_worker(path, f"run{run}", -1, per_batch=rng.choice([5, 20, 60]))
        wait_ready(proc)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        acked |= set(acks(out))
        check_consistent(store)
    con = connect(store)
    committed = {k for (k,) in con.sql("SELECT DISTINCT commit_key FROM trees").fetchall()}
    assert acked <= committed, "an acknowledged append is missing"
    # The store still accepts writes, and every byte still verifies.
    store.append_trees(bel_shaped_batch(3, seed=99, tree_prefix="after"), key="after")
    counts = check_consistent(store)
    assert counts["trees"] >= 3
    assert verify(store).ok


def test_four_concurrent_appenders_every_ack_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "store"
    Store(path, create=True)
    procs = [start_worker(path, f"w{i}", 15, per_batch=5) for i in range(4)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "a worker failed (see *.stderr)"
    acked = [k for out, _ in outputs for k in acks(out)]
    assert len(acked) == 60
    store = Store(path)
    con = connect(store)
    per_key = dict(con.sql("SELECT commit_key, count(*) FROM trees GROUP BY ALL").fetchall())
    assert sorted(per_key) == sorted(acked)
    assert set(per_key.values()) == {5}  # each acknowledged batch present exactly once
    check_consistent(store)


def test_compaction_beside_appenders_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = Store(path, create=True)
    procs = [start_worker(path, f"c{i}", 12, per_batch=5) for i in range(2)]
    for p in procs:
        wait_ready(p)
    rounds = 0
    while any(p.poll() is None for p in procs) or rounds == 0:
        compact(store)
        rounds += 1
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "a worker failed (see *.stderr)"
    compact(store)
    acked = sorted(k for out, _ in outputs for k in acks(out))
    con = connect(store)
    rows = con.sql("SELECT commit_key, count(*) FROM trees GROUP BY ALL ORDER BY 1").fetchall()
    assert [k for k, _ in rows] == acked and {c for _, c in rows} == {5}
    dup = con.sql("SELECT count(*) FROM (SELECT tree_id, node_id FROM nodes GROUP BY ALL "
                  "HAVING count(*) > 1)").fetchall()
    assert dup == [(0,)]
    check_consistent(store)
    assert len(store.files("nodes")) == 1
    assert verify(store).ok


def test_two_compactors_and_an_orphan_beside_appenders(tmp_path: Path) -> None:
    """Concurrent compactors never duplicate rows, and an uncommitted append's file
    is never merged (its rows must not resurface or vanish)."""
    path = tmp_path / "store"
    store = Store(path, create=True)
    orphan_batch = bel_shaped_batch(2, seed=7, tree_prefix="orphan")

    def no_trees(self: Store, table: str, rows: object, key: str, rep: object,
                 *rest: object) -> None:
        if table != "trees":
            Store._commit_table(self, table, rows, key, rep, *rest)  # type: ignore[arg-type]

    store._commit_table = no_trees.__get__(store)  # type: ignore[method-assign]
    store.append_trees(orphan_batch, key="orphan")
    del store._commit_table
    appender = start_worker(path, "a", 10, per_batch=5)
    compactors = [subprocess.Popen([sys.executable, "-m", "tests.helpers.compact_worker",
                                    str(path), "4"], cwd=ROOT, stdout=subprocess.PIPE,
                                   text=True) for _ in range(2)]
    out, _ = appender.communicate(timeout=300)
    for c in compactors:
        assert c.communicate(timeout=300)[0].split()[-1] == "DONE"
    compact(store)
    con = connect(store)
    per_key = dict(con.sql("SELECT commit_key, count(*) FROM trees GROUP BY ALL").fetchall())
    assert sorted(per_key) == sorted(acks(out)) and set(per_key.values()) == {5}
    assert con.sql("SELECT count(*) FROM (SELECT tree_id, node_id FROM nodes GROUP BY ALL "
                   "HAVING count(*) > 1)").fetchall() == [(0,)]
    check_consistent(store)
    orphan_files = [f for f in store.files("nodes") if f.min_key == "orphan"]
    assert len(orphan_files) == 1 and not orphan_files[0].compacted
    # The dead append can still complete with its key: its rows appear exactly once.
    store.append_trees(orphan_batch, key="orphan")
    assert connect(store).sql("SELECT count(*) FROM nodes WHERE tree_id LIKE 'orphan%'"
                              ).fetchall() == [(orphan_batch.nodes.num_rows,)]
    assert verify(store).ok
