"""A compactor process for concurrency tests: python -m tests.helpers.compact_worker STORE N."""

from __future__ import annotations

import sys

from rollout_store.maintenance import compact
from rollout_store.store import Store


def main() -> None:
    store = Store(sys.argv[1])
    print("READY", flush=True)
    for _ in range(int(sys.argv[2])):
        compact(store)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
