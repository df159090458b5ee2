"""Credit throughput: every estimator vectorised over a batch vs a per-tree Python loop.

Issue 4's target: at least 20x more trees per second for the vectorised path
than a plain-Python per-tree loop of the same estimator, for 100,000 stored
trees of 16 rollouts each.

* vectorised: the estimator called on batches of ``--batch-trees`` trees (the
  way ``rtrees credit`` calls it);
* per-tree loop (the baseline): the same estimator called once per tree in a
  Python loop (``TreeArrays.tree_slice``), timed on a ``--loop-trees`` subsample
  and reported as trees per second (the loop's cost is linear in trees);
* end to end: ``rtrees credit``'s ``compute_credits`` on a store of all the
  trees (DuckDB read ordered by prompt group, batching, the estimator, the commit).

Trees are BEL-shaped (``bel_shaped_batch``: 16 rollouts, depth ``--depth``) with
short token lists so 100k trees fit in memory. ``trace`` and ``dsc`` get random
inputs of the right shape in ``extras``. Run:
``.venv/bin/python benchmarks/bench_credit.py [--trees 100000]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rollout_store import Store
from rollout_store.synthetic import bel_shaped_batch
from train.credit import ESTIMATORS
from train.credit.base import TreeArrays, from_tables
from train.credit.store_io import compute_credits


def with_extras(batch: TreeArrays, rng: np.random.Generator) -> TreeArrays:
    n = batch.n_nodes
    extras = {
        "trace_ref_logprob": -rng.uniform(0.5, 8.0, size=n),
        "dsc_ratio": rng.uniform(0.5, 1.5, size=n),
        "dsc_state": rng.integers(0, 20, size=n),
    }
    return TreeArrays(**{**batch.__dict__, "extras": extras})


def build(n_trees: int, depth: int, seed: int) -> tuple[Any, TreeArrays]:
    tb = bel_shaped_batch(n_trees, rollouts=16, depth=depth, action_tokens=(2, 8),
                          observation_tokens=(2, 8), seed=seed)
    structure = tb.validate()
    nodes = tb.nodes
    import pyarrow as pa

    for name, values in (("depth", structure.depth), ("preorder", structure.preorder),
                         ("subtree_size", structure.subtree_size)):
        nodes = nodes.append_column(name, pa.array(values, pa.int32()))
    return tb, from_tables(tb.trees, nodes)


def split(batch: TreeArrays, size: int) -> list[TreeArrays]:
    """Consecutive sub-batches of ``size`` trees (numpy slicing, not timed)."""
    return [batch.trees_slice(lo, min(lo + size, batch.n_trees))
            for lo in range(0, batch.n_trees, size)]


# The synthetic leaves carry one reward part, "outcome": slca reads it as both HierR parts.
BENCH_PARAMS: dict[str, dict[str, str]] = {"slca": {"tool_part": "outcome", "sum_part": "outcome"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", type=int, default=100_000)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch-trees", type=int, default=10_000)
    ap.add_argument("--loop-trees", type=int, default=1_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--end-to-end", default="grpo,elpo",
                    help="methods also timed through compute_credits on a store ('' to skip)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    _, full = build(args.trees, args.depth, seed=0)
    full = with_extras(full, rng)
    batches = split(full, args.batch_trees)
    loop_batch = with_extras(build(args.loop_trees, args.depth, seed=1)[1], rng)
    singles = [loop_batch.tree_slice(b) for b in range(loop_batch.n_trees)]
    print(f"{full.n_trees:,} trees, {full.n_nodes:,} nodes, {full.n_tokens:,} tokens "
          f"(built in {time.perf_counter() - t0:.1f} s, not timed); per-tree loop on "
          f"{len(singles):,} trees")
    header = f"{'method':<10} {'vectorised trees/s':>19} {'per-tree loop trees/s':>22} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    ratios = {}
    for name, est in sorted(ESTIMATORS.items()):
        params = est.parse_params(BENCH_PARAMS.get(name, {}))
        vec_times, loop_times = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for b in batches:
                est(b, params)
            vec_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            for s in singles:
                est(s, params)
            loop_times.append(time.perf_counter() - start)
        vec = full.n_trees / min(vec_times)
        loop = len(singles) / min(loop_times)
        ratios[name] = vec / loop
        print(f"{name:<10} {vec:>19,.0f} {loop:>22,.0f} {vec / loop:>6.1f}x"
              f"   (median {full.n_trees / statistics.median(vec_times):,.0f} vs "
              f"{len(singles) / statistics.median(loop_times):,.0f})")
    methods = [m for m in args.end_to_end.split(",") if m]
    if methods:
        with tempfile.TemporaryDirectory() as tmp:
            tb, _ = build(args.trees, args.depth, seed=0)
            store = Store(Path(tmp) / "store", create=True)
            store.append_trees(tb, key="bench")
            for m in methods:
                start = time.perf_counter()
                report = compute_credits(store, m, progress=False)
                took = time.perf_counter() - start
                print(f"end to end `rtrees credit --method {m}`: {report.trees_done:,} trees "
                      f"in {took:.1f} s = {report.trees_done / took:,.0f} trees/s "
                      f"({report.commits} commits)")
    worst = min(ratios, key=lambda k: ratios[k])
    verdict = "PASS" if ratios[worst] >= 20 else "FAIL"
    print(f"RESULT credit vectorised / per-tree loop, worst method {worst}: ratio "
          f"{ratios[worst]:.1f} (target >= 20x) {verdict}")


if __name__ == "__main__":
    main()
