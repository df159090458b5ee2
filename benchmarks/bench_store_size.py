"""Size: a store of BEL-shaped trees vs the same trajectories flattened to JSONL.

Store side: ``bel_shaped_batch(n_trees, rollouts=16, depth=6)`` committed with
``Store.append_trees``; its size is the sum of the committed data files of
every table (``maintenance.info(store)``), which includes the derived columns,
the per-token entropies and the ``commit_key`` column. The Delta log is
reported beside it but not counted (it is per commit, not per row).

Baseline: one JSONL line per root-to-leaf path (16 per tree), the way a
trajectory dump repeats the shared prefix on every line. Each line is a JSON
object with

* ``tree_id``, ``task_id``, ``leaf_id``, ``reward``;
* ``prompt`` (the root's observation text) and ``prompt_token_ids``;
* ``steps``: one object per node below the root along the path, with
  ``action_text``, ``action_token_ids``, ``action_logprobs``,
  ``observation_text``, ``observation_token_ids``.

Per-token entropies, segments and reward parts are *not* in the JSONL (the
store holds them), which favours the baseline. Logprobs are float32 values
converted with ``.tolist()`` and written by ``json.dumps`` (shortest float64
repr of the float32 value, as a dump of torch or numpy values produces).
Reported uncompressed (the target) and gzip'd at level 6 (the ``gzip`` CLI
default), for honesty.

The store keeps logprobs and entropies at 12 mantissa bits (relative error <= 1.22e-4,
``rollout_store/precision.py``); the JSONL keeps them at full float32 precision.

Targets: the store is at least 5x smaller than the plain JSONL (issue 2) and at least 2x
smaller than the gzip'd JSONL (issue 26).

    .venv/bin/python benchmarks/bench_store_size.py [--trees 2000]
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from _common import mib, print_table, verdict

from rollout_store import Store
from rollout_store.maintenance import info
from rollout_store.synthetic import bel_shaped_batch

TARGET = 5.0
TARGET_GZIP = 2.0
GZIP_LEVEL = 6  # the gzip command-line default


def write_jsonl(nodes: pa.Table, trees: pa.Table, plain: Path, gz: Path) -> int:
    """Write one line per root-to-leaf path to ``plain`` and ``gz``; return the line count."""
    col = {name: nodes.column(name).to_pylist() for name in (
        "tree_id", "node_id", "parent_id", "reward", "action_text", "action_token_ids",
        "action_logprobs", "observation_text", "observation_token_ids")}
    task_of = dict(zip(trees.column("tree_id").to_pylist(),
                       trees.column("task_id").to_pylist(), strict=True))
    # Rows of one tree are contiguous in a batch; index each tree's rows by node id.
    lines = 0
    with open(plain, "wb") as out, gzip.open(gz, "wb", compresslevel=GZIP_LEVEL) as zout:
        start = 0
        n = len(col["tree_id"])
        while start < n:
            tid = col["tree_id"][start]
            end = start
            while end < n and col["tree_id"][end] == tid:
                end += 1
            row_of = {col["node_id"][r]: r for r in range(start, end)}
            has_child = {col["parent_id"][r] for r in range(start, end)}
            root = next(r for r in range(start, end) if col["parent_id"][r] is None)
            for leaf in range(start, end):
                if col["node_id"][leaf] in has_child:
                    continue
                path = []
                r = leaf
                while r != root:
                    path.append(r)
                    r = row_of[col["parent_id"][r]]
                path.reverse()
                line = {
                    "tree_id": tid, "task_id": task_of[tid], "leaf_id": col["node_id"][leaf],
                    "reward": col["reward"][leaf],
                    "prompt": col["observation_text"][root],
                    "prompt_token_ids": col["observation_token_ids"][root],
                    "steps": [{
                        "action_text": col["action_text"][r],
                        "action_token_ids": col["action_token_ids"][r],
                        "action_logprobs": col["action_logprobs"][r],
                        "observation_text": col["observation_text"][r],
                        "observation_token_ids": col["observation_token_ids"][r],
                    } for r in path],
                }
                data = (json.dumps(line) + "\n").encode()
                out.write(data)
                zout.write(data)
                lines += 1
            start = end
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", type=int, default=2000,
                        help="BEL-shaped trees (16 rollouts, depth 6, ~47 nodes each)")
    args = parser.parse_args()

    batch = bel_shaped_batch(args.trees, rollouts=16, depth=6, seed=0)
    print(f"batch: {args.trees:,} trees, {batch.nodes.num_rows:,} nodes, "
          f"{args.trees * 16:,} root-to-leaf paths")
    with tempfile.TemporaryDirectory(prefix="bench-size-") as tmp:
        root = Path(tmp)
        store = Store(root / "store", create=True)
        store.append_trees(batch, key="bench-size")
        tables = info(store)["tables"]
        store_bytes = sum(t["bytes"] for t in tables.values())
        log_bytes = sum(p.stat().st_size for p in (root / "store").glob("*/_delta_log/*")
                        if p.is_file())

        start = time.perf_counter()
        plain, gz = root / "paths.jsonl", root / "paths.jsonl.gz"
        lines = write_jsonl(batch.nodes, batch.trees, plain, gz)
        print(f"JSONL: {lines:,} lines written in {time.perf_counter() - start:.1f} s")
        plain_bytes, gz_bytes = plain.stat().st_size, gz.stat().st_size

    print()
    rows: list[list[object]] = [
        [f"store: {name} data files", t["bytes"], mib(t["bytes"]), ""]
        for name, t in tables.items() if t["bytes"]
    ]
    rows += [
        ["store: all data files", store_bytes, mib(store_bytes), "1.00"],
        ["(store: Delta logs, not counted)", log_bytes, mib(log_bytes), ""],
        ["JSONL, plain  [baseline]", plain_bytes, mib(plain_bytes),
         f"{plain_bytes / store_bytes:.2f}"],
        [f"JSONL, gzip -{GZIP_LEVEL}", gz_bytes, mib(gz_bytes), f"{gz_bytes / store_bytes:.2f}"],
    ]
    print_table(["", "bytes", "size", "x store"], rows)
    print(f"\nper path: JSONL {plain_bytes / lines:,.0f} B, gzip'd {gz_bytes / lines:,.0f} B, "
          f"store {store_bytes / lines:,.0f} B")
    ratio = plain_bytes / store_bytes
    verdict(f"size, plain JSONL / store data files ({args.trees:,} trees; gzip'd JSONL is "
            f"{gz_bytes / store_bytes:.2f}x)", ratio, ratio >= TARGET, f">= {TARGET:g}x")
    gz_ratio = gz_bytes / store_bytes
    verdict(f"size, gzip'd JSONL / store data files ({args.trees:,} trees; "
            f"{store_bytes / batch.nodes.num_rows:,.0f} stored bytes per node)", gz_ratio,
            gz_ratio >= TARGET_GZIP, f">= {TARGET_GZIP:g}x")


if __name__ == "__main__":
    main()
