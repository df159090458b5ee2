"""Helpers of the tests that run the real ``rtrees`` command line in a subprocess and
expect one named error line (moved from the hardening round's misc tests)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

from rollout_store import Store, connect

ROOT = Path(__file__).resolve().parents[1]


def rtrees(*args: str, timeout: float = 120, limit_as: int | None = None
           ) -> subprocess.CompletedProcess[str]:
    """The real command line (``python -m cli.main``), optionally under an address-space
    limit so that an unbounded read fails fast instead of eating the machine's memory."""
    def limit() -> None:
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, preexec_fn=limit,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def counts(store: Store) -> tuple[int, int]:
    con = connect(store)
    trees = con.execute("SELECT count(*) FROM trees").fetchone()
    nodes = con.execute("SELECT count(*) FROM nodes").fetchone()
    assert trees is not None and nodes is not None
    return int(trees[0]), int(nodes[0])


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth
