"""Peak RSS of a 100-iteration ``rtrees train`` run stays flat (issue 11).

Runs the trainer in this process on small settings (the tiny calc policy, 2 tasks x 2
rollouts per iteration, no held-out eval) and reads the per-iteration ``rss_mb`` metric
back from the store. Flat means: the RSS of the last 10 iterations exceeds that of
iterations 10-19 (after warm-up: allocator pools, caches) by less than 5%.

    .venv/bin/python benchmarks/bench_train_rss.py [--steps 100] [--checkpoint-every N]

``--checkpoint-every 0`` turns the store's own Delta checkpoints off
(``rollout_store.store.CHECKPOINT_EVERY``; delta-rs then checkpoints every 100 commits),
to see the growth they prevent.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rollout_store.store as store_module
from benchmarks._common import print_table, verdict
from train.config import load_config
from train.trainer import read_metrics, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--checkpoint-every", type=int, default=store_module.CHECKPOINT_EVERY,
                    help="Delta checkpoint every N commits of a table (0: off)")
    args = ap.parse_args()
    store_module.CHECKPOINT_EVERY = args.checkpoint_every
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, {"store": f"{tmp}/store", "out": f"{tmp}/run",
                                 "steps": args.steps, "tasks_per_step": 2, "n_total": 2,
                                 "heldout_tasks": 0, "max_new_tokens": 40, "minibatches": 2,
                                 "progress": False, "run_id": "rss"})
        train(cfg)
        rss = [v for _, v in read_metrics(cfg.store, "rss")["rss_mb"]]
    early = statistics.mean(rss[10:20]) if len(rss) >= 20 else rss[0]
    late = statistics.mean(rss[-10:])
    print_table(["iterations", "RSS MiB"],
                [[f"{i}-{min(i + 9, len(rss) - 1)}", f"{statistics.mean(rss[i:i + 10]):.1f}"]
                 for i in range(0, len(rss), 10)])
    growth = late / early
    verdict("RSS last 10 / iterations 10-19", growth, growth < 1.05, "< 1.05 (flat)")


if __name__ == "__main__":
    main()
