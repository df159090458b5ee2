"""RSS of one process committing to one store 300 times (issue 11's memory growth, store only).

Each iteration does what a training iteration does to the store: ``append_trees`` of a
small BEL-shaped batch, ``append_credits`` of one row per node of it, ``append_metrics`` of
a few rows; so iteration ``i`` is three commits (trees, credits, metrics; ``nodes`` and
``snapshots`` commit inside ``append_trees``). RSS is ``VmRSS`` of this process, read from
``/proc/self/status`` after each iteration, and printed at iterations 1, 100, 200 and 300;
the verdict is the growth from iteration 100 (after warm-up: allocator pools, imports) to
iteration 300.

``--checkpoint-every N`` sets the store's checkpoint cadence (``store.CHECKPOINT_EVERY``);
0 leaves only delta-rs's own checkpoints (every 100 commits), as before issue 16.

    .venv/bin/python benchmarks/bench_store_rss.py [--iterations 300] [--checkpoint-every N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa

from benchmarks._common import print_table, verdict
from rollout_store import store as store_mod
from rollout_store.schema import SCHEMAS
from rollout_store.store import Store, now_utc
from rollout_store.synthetic import bel_shaped_batch

MARKS = (1, 100, 200, 300)


def rss_mib() -> float:
    """Resident set size of this process now (``VmRSS``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def credit_rows(batch_nodes: pa.Table, it: int) -> pa.Table:
    """One ``credits`` row per node of the batch (value = the node's reward)."""
    n = batch_nodes.num_rows
    return pa.table({
        "run_id": pa.array(["rss"] * n, pa.string()),
        "method": pa.array(["grpo"] * n, pa.string()),
        "method_params_hash": pa.array(["0"] * n, pa.string()),
        "method_params": pa.array(["{}"] * n, pa.string()),
        "tree_id": batch_nodes.column("tree_id"),
        "node_id": batch_nodes.column("node_id"),
        "value": pa.array([float(it % 7)] * n, pa.float64()),
        "token_values": pa.array([None] * n, pa.list_(pa.float32())),
        "policy_version": pa.array([str(it)] * n, pa.string()),
        "created_at": pa.array([now_utc()] * n, SCHEMAS["credits"].field("created_at").type),
        "clip_low": pa.nulls(n, SCHEMAS["credits"].field("clip_low").type),
        "clip_high": pa.nulls(n, SCHEMAS["credits"].field("clip_high").type),
    }, schema=SCHEMAS["credits"])


def metric_rows(it: int, names: int = 12) -> pa.Table:
    return pa.table({
        "run_id": pa.array(["rss"] * names, pa.string()),
        "step": pa.array([it] * names, pa.int64()),
        "name": pa.array([f"m{j:02d}" for j in range(names)], pa.string()),
        "value": pa.array([float(j * it) for j in range(names)], pa.float64()),
        "created_at": pa.array([now_utc()] * names,
                               SCHEMAS["metrics"].field("created_at").type),
    }, schema=SCHEMAS["metrics"])


def run(iterations: int, root: Path) -> tuple[dict[int, float], float, int]:
    """RSS at each iteration in ``MARKS``, seconds per iteration, and the trees version."""
    store = Store(root / "store", create=True)
    seen: dict[int, float] = {}
    start = time.perf_counter()
    for it in range(1, iterations + 1):
        batch = bel_shaped_batch(2, rollouts=2, depth=3, seed=it, tree_prefix=f"it{it:04d}")
        store.append_trees(batch, key=f"rss:trees:{it}")
        store.append_credits(credit_rows(batch.nodes, it), key=f"rss:credit:{it}")
        store.append_metrics(metric_rows(it), key=f"rss:metrics:{it}")
        if it in MARKS or it == iterations:
            seen[it] = rss_mib()
    seconds = (time.perf_counter() - start) / iterations
    return seen, seconds, store.version()["trees"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--checkpoint-every", type=int, default=store_mod.CHECKPOINT_EVERY,
                    help="Delta checkpoint cadence in commits per table (0: delta-rs default, 100)")
    args = ap.parse_args()
    store_mod.CHECKPOINT_EVERY = args.checkpoint_every
    with tempfile.TemporaryDirectory(prefix="rss-") as tmp:
        seen, per_it, version = run(args.iterations, Path(tmp))
        logs = {t: len(list((Path(tmp) / "store" / t / "_delta_log").glob("*.checkpoint*")))
                for t in ("trees", "nodes", "credits", "metrics")}
    print(f"checkpoint every {args.checkpoint_every or 'never'} commits; "
          f"{per_it * 1000:.0f} ms per iteration; trees at version {version}; "
          f"checkpoint files: {logs}")
    print_table(["iteration", "RSS MiB"], [[it, f"{v:.1f}"] for it, v in sorted(seen.items())])
    base = seen.get(100, seen[min(seen)])
    growth = seen[max(seen)] / base
    verdict(f"RSS iteration {max(seen)} / iteration {100 if 100 in seen else min(seen)}",
            growth, growth < 1.05, "< 1.05 (flat)")


if __name__ == "__main__":
    main()
