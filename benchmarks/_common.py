"""Helpers shared by the store benchmarks: repeated timings, tables, verdict lines.

Timings on a shared 2-core machine are noisy, so every benchmark
times the store and its naive baseline alternately in one run, several times,
and reports min and median; the verdict uses the ratio of the minima (the
least disturbed runs), with the ratio of medians printed beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class Timings:
    """Wall-clock seconds of repeated runs of one thing."""

    name: str
    seconds: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain fixed-width table; the first column left-aligned, the rest right."""
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def print_timings(rows: Sequence[Timings], baseline: Timings) -> None:
    """min / median seconds of each row and its ratios to ``baseline``."""
    print_table(
        ["", "min s", "median s", "x base (min)", "x base (median)", "runs"],
        [[t.name, f"{t.min:.3f}", f"{t.median:.3f}", f"{t.min / baseline.min:.2f}",
          f"{t.median / baseline.median:.2f}", len(t.seconds)] for t in rows],
    )


def verdict(what: str, ratio: float, passed: bool, target: str) -> None:
    """The final line every benchmark prints (a measurement: never a non-zero exit)."""
    print(f"RESULT {what}: ratio {ratio:.2f} (target {target}) "
          f"{'PASS' if passed else 'FAIL'}")


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:,.2f} MiB"


def _fmt(cell: object) -> str:
    if isinstance(cell, float):
        return f"{cell:,.3f}"
    if isinstance(cell, int):
        return f"{cell:,}"
    return str(cell)
