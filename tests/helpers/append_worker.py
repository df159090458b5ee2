"""A writer process for crash and concurrency tests.

Usage: python -m tests.helpers.append_worker STORE PREFIX N_BATCHES [TREES_PER_BATCH]

Appends N_BATCHES batches (N_BATCHES < 0: forever) with idempotency keys
``PREFIX:i`` and prints ``READY`` once imported, then ``ACK PREFIX:i`` after
each append returns, so the parent knows exactly what was acknowledged.
"""

from __future__ import annotations

import sys

from rollout_store.store import Store
from rollout_store.synthetic import bel_shaped_batch


def main() -> None:
    path, prefix, n_batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    per_batch = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    store = Store(path)
    print("READY", flush=True)
    i = 0
    while n_batches < 0 or i < n_batches:
        key = f"{prefix}:{i}"
        batch = bel_shaped_batch(per_batch, rollouts=4, depth=4, seed=i,
                                 tree_prefix=prefix.replace(":", "_") + f"-{i}",
                                 snapshot_bytes=32)
        store.append_trees(batch, key=key)
        print(f"ACK {key}", flush=True)
        i += 1


if __name__ == "__main__":
    main()
