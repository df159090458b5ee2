"""Write: committing BEL-shaped trees to a store vs a bare Parquet write of the same rows.

Store side: ``Store.append_trees(batch, key=...)`` into a fresh store per
repetition: it validates every tree, derives ``depth``/``preorder``/
``subtree_size``, writes one Parquet file per table (zstd, 128Ki-row groups,
page checksums), fsyncs it and commits it to Delta (snapshots, nodes, trees).
Baseline: ``pyarrow.parquet.write_table(batch.nodes, path, compression="zstd")``
of the same ``batch.nodes`` table, everything else at pyarrow's defaults (no
fsync, no validation, no trees table). Two informative rows split the gap:
the bare write plus an fsync, and the bare write with the store's Parquet
settings plus an fsync. Batch generation and store creation are not timed.

Target (issue 2): the store append takes at most 2x the bare write.

    .venv/bin/python benchmarks/bench_store_write.py [--nodes 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from _common import Timings, print_timings, timed, verdict

from rollout_store import Store
from rollout_store.store import ROW_GROUP_SIZE
from rollout_store.synthetic import bel_shaped_batch

TARGET = 2.0
NODES_PER_TREE = 47.2  # mean size of a 16-rollout, depth-6 BEL-shaped tree (measured)


def fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000_000,
                        help="about this many nodes (trees of ~47 nodes)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions of each side")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one more store append with cProfile")
    args = parser.parse_args()

    n_trees = max(1, round(args.nodes / NODES_PER_TREE))
    start = time.perf_counter()
    batch = bel_shaped_batch(n_trees, rollouts=16, depth=6, seed=0)
    print(f"batch: {n_trees:,} trees, {batch.nodes.num_rows:,} nodes, "
          f"{batch.nodes.nbytes / 2**20:,.0f} MiB in Arrow "
          f"(generated in {time.perf_counter() - start:.1f} s, not timed)")

    store_t = Timings("store.append_trees (validate+derive+commit)")
    bare_t = Timings("bare write_table zstd  [baseline]")
    bare_sync_t = Timings("bare write_table zstd + fsync")
    bare_like_t = Timings("bare, store's Parquet settings + fsync")
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-write-") as tmp:
        root = Path(tmp)

        def store_append(rep: int) -> float:
            path = root / f"store-{rep}"
            store = Store(path, create=True)  # creation is not timed
            seconds = timed(lambda: store.append_trees(batch, key=f"bench-{rep}"))
            sizes["store nodes file"] = sum(f.size for f in store.files("nodes"))
            shutil.rmtree(path)
            return seconds

        def bare(rep: int, sync: bool, like_store: bool) -> float:
            path = root / f"bare-{rep}.parquet"
            options = ({"row_group_size": ROW_GROUP_SIZE, "write_page_checksum": True}
                       if like_store else {})

            def write() -> None:
                pq.write_table(batch.nodes, path, compression="zstd", **options)
                if sync:
                    fsync(path)

            seconds = timed(write)
            sizes["bare file" + (" (store settings)" if like_store else "")] = (
                path.stat().st_size)
            path.unlink()
            return seconds

        for rep in range(args.repeat):  # interleaved, so load spikes hit both sides
            store_t.seconds.append(store_append(rep))
            bare_t.seconds.append(bare(rep, sync=False, like_store=False))
            bare_sync_t.seconds.append(bare(rep, sync=True, like_store=False))
            bare_like_t.seconds.append(bare(rep, sync=True, like_store=True))

        print()
        print_timings([bare_t, bare_sync_t, bare_like_t, store_t], bare_t)
        print("bytes: " + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in sizes.items()))

        if args.profile:
            path = root / "store-profile"
            store = Store(path, create=True)
            profiler = cProfile.Profile()
            profiler.runcall(store.append_trees, batch, key="bench-profile")
            print("\ncProfile of one store append (top 20 by cumulative time):")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)

    ratio = store_t.min / bare_t.min
    print(f"\nratio of medians {store_t.median / bare_t.median:.2f}")
    verdict(f"write {batch.nodes.num_rows:,} nodes, store / bare zstd write_table (min)",
            ratio, ratio <= TARGET, f"<= {TARGET:g}x")


if __name__ == "__main__":
    main()
