"""A writer for commit-race tests: python -m tests.helpers.race_worker STORE KEY.

Builds its batch (three trees ``same-*``), prints ``READY``, waits for a line on stdin,
appends with ``KEY`` and prints one line: ``ok``, ``already``, the validation rule that
refused it, or ``ERROR <type>: <message>``.
"""

from __future__ import annotations

import sys

from rollout_store.store import Store
from rollout_store.synthetic import bel_shaped_batch
from rollout_store.validate import TreeValidationError


def main() -> None:
    path, key = sys.argv[1], sys.argv[2]
    store = Store(path)
    batch = bel_shaped_batch(3, rollouts=4, depth=3, seed=1, tree_prefix="same")
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        report = store.append_trees(batch, key=key)
        print("already" if report.already_committed else "ok", flush=True)
    except TreeValidationError as exc:
        print(exc.rule, flush=True)
    except Exception as exc:  # the parent reports any other outcome
        print(f"ERROR {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
