"""Single-machine throughput of each stage, the inputs of docs/SCALE.md (issue 16).

Four stages, each timed in this process (wall seconds, and CPU seconds of the process,
all threads, beside them: on a shared machine the wall time carries other people's load,
the CPU time much less of it):

1. **collect**: ``train.sampling.collect.collect`` of ``--tasks`` calc tasks with the tiny
   calc policy and the ``group`` sampler at ``--n-total``, one worker, into a fresh store
   (sampling, env steps, validation, commits). Trees/s and nodes/s.
2. **commit**: ``Store.append_trees`` of ``--commit-batches`` BEL-shaped batches of
   ``--commit-trees`` trees (``rollout_store.synthetic.bel_shaped_batch``, 16 rollouts,
   depth 6, ~47 nodes per tree), generation not timed. Nodes/s. Then
   ``--small-commits`` appends of 2 trees each: the latency of the first 5 and the last
   5, and its growth per committed file (the duplicate-id check reads every ``trees``
   file: the cost compaction bounds).
3. **query**: a store of ``--query-trees`` BEL-shaped trees in ``--query-files`` commits;
   ``connect`` and the ``siblings`` and ``paths`` views (``SELECT count(*), sum(...)``,
   as in bench_store_query.py), min of ``--repeat``, before and after
   ``maintenance.compact``. Seconds per million nodes, stored bytes per node, and the
   duplicate-tree-id check (``stored_tree_ids``: seconds per million stored trees, and
   per extra file, reading every file; and as an append makes it at its commit point,
   reading only the files whose ``tree_id`` bounds hold one of its ids).
4. **train**: ``benchmarks/bench_train_layout.py`` at a small size (its own process):
   loss-step tokens per second of the ``paths`` and ``tree`` layouts on BEL trees.

Ends with ``SCALE <name> <value>`` lines, one per number SCALE.md uses.

    nice -n 19 .venv/bin/python benchmarks/scale.py [--tasks 8 --n-total 8 ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import print_table
from rollout_store import Store, connect
from rollout_store.maintenance import compact, info
from rollout_store.synthetic import bel_shaped_batch

ROOT = Path(__file__).resolve().parent.parent
RESULTS: dict[str, float] = {}


def clocked(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall s, process CPU s, result) of one call of ``fn``."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def record(name: str, value: float) -> None:
    RESULTS[name] = value


def stage_collect(root: Path, tasks: int, n_total: int) -> None:
    from train.envs import env_class
    from train.policies import load_policy
    from train.sampling.collect import collect

    policy = load_policy("tiny", "calc")
    task_list = env_class("calc").generate_tasks(tasks + 1, seed=0)
    warm = Store(root / "collect-warm", create=True)  # first forward passes, not timed
    collect(warm, "calc", policy, "group", task_list[-1:], n_total, seed=0, run_id="warm",
            progress=False)
    task_list = task_list[:-1]
    store = Store(root / "collect", create=True)
    wall, cpu, report = clocked(lambda: collect(store, "calc", policy, "group", task_list,
                                                n_total, seed=0, run_id="scale",
                                                progress=False))
    con = connect(store)
    nodes, tokens = con.sql("SELECT count(*), sum(len(action_token_ids) + "
                            "coalesce(len(observation_token_ids), 0)) FROM nodes").fetchall()[0]
    print(f"collect: {report.trees} trees (group, n_total {n_total}, tiny calc policy, one "
          f"worker), {nodes} nodes, {tokens} tokens; {wall:.1f} s wall, {cpu:.1f} s CPU")
    record("collect_trees_per_s", report.trees / wall)
    record("collect_trees_per_cpu_s", report.trees / cpu)
    record("collect_nodes_per_tree", nodes / report.trees)
    record("collect_tokens_per_tree", tokens / report.trees)


def stage_commit(root: Path, batches: int, trees: int, small: int) -> None:
    store = Store(root / "commit", create=True)
    data = [bel_shaped_batch(trees, seed=i, tree_prefix=f"c{i}") for i in range(batches)]
    nodes = sum(b.nodes.num_rows for b in data)
    walls, cpus = 0.0, 0.0
    for i, batch in enumerate(data):
        wall, cpu, _ = clocked(partial(store.append_trees, batch, key=f"c{i}"))
        walls, cpus = walls + wall, cpus + cpu
    print(f"commit: {batches} appends of {trees} trees, {nodes} nodes; {walls:.1f} s wall, "
          f"{cpus:.1f} s CPU")
    record("commit_nodes_per_s", nodes / walls)
    record("commit_nodes_per_cpu_s", nodes / cpus)
    lat = []
    for i in range(small):
        batch = bel_shaped_batch(2, rollouts=2, depth=3, seed=1000 + i, tree_prefix=f"s{i}")
        lat.append(clocked(partial(store.append_trees, batch, key=f"s{i}"))[0])
    first, last = sum(lat[:5]) / 5, sum(lat[-5:]) / 5
    per_file = (last - first) / max(small - 5, 1)
    print(f"small appends (2 trees): first 5 {first * 1000:.0f} ms, last 5 "
          f"{last * 1000:.0f} ms, +{per_file * 1000:.2f} ms per committed trees file")
    record("small_commit_s", first)
    record("small_commit_s_per_file", per_file)


QUERIES = {"siblings": "SELECT count(*), sum(n_leaves), sum(n_success) FROM siblings",
           "paths": "SELECT count(*), sum(depth), avg(reward) FROM paths"}


def _queries(store: Store, repeat: int) -> dict[str, float]:
    """Min seconds of ``connect`` and of each query in ``QUERIES`` (after one warm run)."""
    out = {"connect": min(clocked(partial(connect, store))[0] for _ in range(repeat))}
    con = connect(store)
    for view, sql in QUERIES.items():
        con.sql(sql).fetchall()  # warm
        out[view] = min(clocked(con.sql(sql).fetchall)[0] for _ in range(repeat))
    return out


def stage_query(root: Path, trees: int, files: int, repeat: int) -> None:
    store = Store(root / "query", create=True)
    per = trees // files
    for i in range(files):
        store.append_trees(bel_shaped_batch(per, seed=i, tree_prefix=f"q{i}"), key=f"q{i}")
    stats = info(store)["tables"]
    nodes = stats["nodes"]["rows"]
    data_bytes = sum(t["bytes"] for t in stats.values())
    before = _queries(store, repeat)
    ids_before = min(clocked(store.stored_tree_ids)[0] for _ in range(repeat))
    # What an append's check reads: only the files whose tree_id bounds hold a new id
    # (a new run's or iteration's ids, outside every stored range, read none).
    new_ids = pa.array([f"q{files}-{j}" for j in range(per)])
    ids_append = min(clocked(partial(store.stored_tree_ids, among=new_ids))[0]
                     for _ in range(repeat))
    wall, _, _ = clocked(lambda: compact(store))
    after = _queries(Store(str(store.path)), repeat)
    ids_after = min(clocked(Store(str(store.path)).stored_tree_ids)[0] for _ in range(repeat))
    n_files = info(Store(str(store.path)))["tables"]["nodes"]["files"]
    rows = [[k, f"{before[k]:.3f}", f"{after[k]:.3f}",
             "-" if k == "connect" else f"{before[k] / nodes * 1e6:.2f}",
             "-" if k == "connect" else f"{after[k] / nodes * 1e6:.2f}"] for k in before]
    print(f"query: {per * files} trees, {nodes} nodes in {files} commits, "
          f"{data_bytes / nodes:.0f} stored bytes per node; compact {wall:.1f} s")
    print_table(["", f"s ({files} nodes files)", f"s (compacted: {n_files})", "s/M nodes",
                 "s/M nodes (compacted)"], rows)
    n_trees = per * files
    print(f"duplicate-id check (stored_tree_ids, every append does it under the lock): "
          f"{ids_before * 1000:.1f} ms over {files} trees files, {ids_after * 1000:.1f} ms "
          f"compacted: {ids_after / n_trees * 1e9:.0f} ns per tree, "
          f"+{(ids_before - ids_after) / max(files - 1, 1) * 1000:.2f} ms per extra file; "
          f"as an append of {per} new ids makes it (files pruned by their tree_id bounds): "
          f"{ids_append * 1000:.1f} ms")
    record("id_check_append_s", ids_append)
    record("id_check_s_per_M_trees", ids_after / n_trees * 1e6)
    record("id_check_s_per_file", (ids_before - ids_after) / max(files - 1, 1))
    record("connect_s", before["connect"])
    record("connect_s_compacted", after["connect"])
    for k in QUERIES:
        record(f"query_{k}_s_per_M_nodes", before[k] / nodes * 1e6)
        record(f"query_{k}_s_per_M_nodes_compacted", after[k] / nodes * 1e6)
    record("stored_bytes_per_node", data_bytes / nodes)
    record("query_nodes", nodes)
    record("compact_s_per_M_nodes", wall / nodes * 1e6)


def stage_train(trees: int) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train_layout.py"), "--trees",
           str(trees), "--repeats", "1", "--archs", "tiny", "--sizes", ""]
    wall, _, proc = clocked(lambda: subprocess.run(cmd, cwd=ROOT, capture_output=True,
                                                   text=True, timeout=600))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("tokens/s")), "")
    found = dict(re.findall(r"(\S+) (\d+)(?:,|$)", line.split(":", 1)[-1]))
    if proc.returncode or not found:
        print(f"train: bench_train_layout.py failed (rc {proc.returncode}): "
              f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        return
    print(f"train ({' '.join(cmd[1:])}, {wall:.0f} s): {line}")
    record("train_tokens_per_s_paths", float(found["paths"]))
    record("train_tokens_per_s_tree", float(found["tree"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--n-total", type=int, default=8)
    ap.add_argument("--commit-batches", type=int, default=4)
    ap.add_argument("--commit-trees", type=int, default=500)
    ap.add_argument("--small-commits", type=int, default=40)
    ap.add_argument("--query-trees", type=int, default=6000)
    ap.add_argument("--query-files", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--train-trees", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["collect", "commit", "query", "train"])
    args = ap.parse_args()
    start = time.perf_counter()
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        root = Path(tmp)
        if "collect" not in args.skip:
            stage_collect(root, args.tasks, args.n_total)
        if "commit" not in args.skip:
            stage_commit(root, args.commit_batches, args.commit_trees, args.small_commits)
        if "query" not in args.skip:
            stage_query(root, args.query_trees, args.query_files, args.repeat)
    if "train" not in args.skip:
        stage_train(args.train_trees)
    print(f"total {time.perf_counter() - start:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    for name, value in RESULTS.items():
        print(f"SCALE {name} {value:.6g}")


if __name__ == "__main__":
    main()
