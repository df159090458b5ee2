"""Streaming: peak RSS of ``iter_tree_batches`` as a store grows, vs loading it whole.

The store is built once, in commits of ``--commit-nodes`` BEL-shaped nodes
(16 rollouts, depth 6, so each commit is one realistic ~250k-row nodes file).
One batch is generated and committed again and again under fresh tree ids
(``c0000-...``, ``c0001-...``), which keeps generation out of the run time;
every file is compressed on its own, so the repetition does not shrink it.
``--short-tokens`` uses shorter token lists to save disk and time.

When the store reaches each of ``--sizes`` nodes, three fresh subprocesses
run one after the other, so generation memory is never counted; each reports
its own peak RSS (``VmHWM`` of ``/proc/self/status``; not ``ru_maxrss``, which
Linux carries over from the parent's image across fork and exec, so it would
count the generator's memory):

* ``open``: imports the libraries and opens the store (the floor);
* ``stream``: also streams ``nodes`` with ``iter_tree_batches(store,
  max_rows=65536)`` (all columns), counting rows and trees;
* ``read_arrow`` (the naive baseline): ``read_arrow(store, "nodes")``, the
  whole table at once.

Target (issue 2): streaming peaks under 1 GiB at every size and stays flat as
the store grows (here: peak at the largest size within 1.25x of the peak at
the smallest). The printed ratio is naive peak / streaming peak at the
largest size.

    .venv/bin/python benchmarks/bench_store_stream.py [--sizes 1000000 2500000 5000000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from _common import mib, print_table, verdict

from rollout_store import Store, TreeBatch, iter_tree_batches, read_arrow
from rollout_store.synthetic import bel_shaped_batch

TARGET_BYTES = 2**30
FLAT = 1.25  # largest-size peak within this factor of the smallest-size peak
NODES_PER_TREE = 47.2  # mean size of a 16-rollout, depth-6 BEL-shaped tree (measured)


@dataclass
class Point:
    """The three subprocess measurements at one store size."""

    nodes: int
    disk: int  # bytes of the committed nodes files
    open: dict[str, float]
    stream: dict[str, float]
    naive: dict[str, float]


def peak_rss() -> int:
    """Peak resident bytes of this process's own address space (Linux ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def child(mode: str, path: str, max_rows: int) -> None:
    """Run in a fresh process: open the store, do ``mode``, print JSON with the peak RSS."""
    start = time.perf_counter()
    store = Store(path)
    out: dict[str, float | int] = {}
    if mode == "stream":
        rows = trees = batches = largest = 0
        for batch in iter_tree_batches(store, max_rows=max_rows):
            rows += batch.num_rows
            trees += len(pc.unique(batch.column("tree_id")))
            batches += 1
            largest = max(largest, batch.num_rows)
        out = {"rows": rows, "trees": trees, "batches": batches, "largest_batch": largest}
    elif mode == "read_arrow":
        out = {"rows": read_arrow(store, "nodes").num_rows}
    out["seconds"] = time.perf_counter() - start
    out["peak_rss"] = peak_rss()
    print(json.dumps(out))


def measure(mode: str, path: Path, max_rows: int) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--store", str(path),
         "--max-rows", str(max_rows)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def renamed(batch: TreeBatch, prefix: str) -> TreeBatch:
    """The same trees under ids ``<prefix>-<n>`` instead of ``tree-0-<n>``."""
    def rename(table: pa.Table) -> pa.Table:
        i = table.schema.get_field_index("tree_id")
        ids = pc.replace_substring(table.column("tree_id"), "tree-0-", f"{prefix}-")
        return table.set_column(i, table.schema.field(i), ids)
    return TreeBatch(trees=rename(batch.trees), nodes=rename(batch.nodes),
                     snapshots=batch.snapshots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 2_500_000, 5_000_000],
                        help="measure when the store holds about this many nodes")
    parser.add_argument("--commit-nodes", type=int, default=250_000,
                        help="about this many nodes per commit (one nodes file each)")
    parser.add_argument("--max-rows", type=int, default=65_536,
                        help="iter_tree_batches(max_rows=...)")
    parser.add_argument("--short-tokens", action="store_true",
                        help="token lists of 4-16 (actions) and 4-24 (observations) tokens "
                             "instead of the defaults 8-40 and 8-60")
    parser.add_argument("--child", choices=("open", "stream", "read_arrow"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.store, args.max_rows)
        return

    tokens = ({"action_tokens": (4, 16), "observation_tokens": (4, 24)}
              if args.short_tokens else {})
    start = time.perf_counter()
    batch = bel_shaped_batch(max(1, round(args.commit_nodes / NODES_PER_TREE)), rollouts=16,
                             depth=6, seed=0, **tokens)
    per_commit = batch.nodes.num_rows
    print(f"one commit: {batch.trees.num_rows:,} trees, {per_commit:,} nodes "
          f"({'short' if args.short_tokens else 'default'} token lists; generated in "
          f"{time.perf_counter() - start:.1f} s)")

    results: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        path = Path(tmp) / "store"
        store = Store(path, create=True)
        commits = 0
        for size in sorted(args.sizes):
            start = time.perf_counter()
            while commits == 0 or commits * per_commit < size - per_commit // 2:
                store.append_trees(renamed(batch, f"c{commits:04d}"), key=f"bench-{commits}")
                commits += 1
            n_nodes = commits * per_commit
            disk = sum(f.size for f in store.files("nodes"))
            print(f"store at {n_nodes:,} nodes ({commits} commits, nodes files "
                  f"{mib(disk)}; appended in {time.perf_counter() - start:.1f} s); measuring")
            point = Point(n_nodes, disk, measure("open", path, args.max_rows),
                          measure("stream", path, args.max_rows),
                          measure("read_arrow", path, args.max_rows))
            results.append(point)
            for what, got in (("streamed", point.stream["rows"]),
                              ("read_arrow read", point.naive["rows"])):
                if got != n_nodes:
                    print(f"  !! {what} {got:,} rows, expected {n_nodes:,}")

    print()
    rows = []
    for r in results:
        o, s, n = r.open, r.stream, r.naive
        rows.append([r.nodes, mib(r.disk), mib(o["peak_rss"]), mib(s["peak_rss"]),
                     mib(s["peak_rss"] - o["peak_rss"]), f"{s['seconds']:.1f}",
                     f"{s['batches']:,} / {s['largest_batch']:,}",
                     mib(n["peak_rss"]), f"{n['seconds']:.1f}",
                     f"{n['peak_rss'] / s['peak_rss']:.2f}"])
    print_table(["nodes", "nodes files", "open: peak RSS", "stream: peak RSS", "stream - open",
                 "stream s", "batches / largest", "read_arrow: peak RSS", "read_arrow s",
                 "naive / stream"], rows)

    peaks = [r.stream["peak_rss"] for r in results]
    under = max(peaks) < TARGET_BYTES
    growth = peaks[-1] / peaks[0]
    last = results[-1]
    ratio = last.naive["peak_rss"] / last.stream["peak_rss"]
    print(f"\nstreaming peak: max {mib(max(peaks))} (limit {mib(TARGET_BYTES)}), "
          f"{growth:.2f}x from the smallest to the largest size (flat if <= {FLAT:g}x)")
    verdict(f"stream {last.nodes:,} nodes, peak RSS read_arrow / iter_tree_batches",
            ratio, under and growth <= FLAT,
            f"stream peak < 1 GiB at every size and growth <= {FLAT:g}x")


if __name__ == "__main__":
    main()
