"""Study reports: ``results.json``, ``report.md`` and PNG plots, rebuilt from the store alone.

Every audit (DESIGN.md section 6) writes the same three kinds of file into one
directory. This module holds what they share:

* writers: ``write_json`` (NaN and inf become ``null``), ``markdown_table``,
  ``fmt_ci``;
* plots (matplotlib, ``Agg`` backend, imported when first used):
  ``bar_plot_with_intervals`` and ``scatter_panels``;
* a registry of report builders. An audit module registers a function that
  rebuilds its reports from a store::

      @register_report("ranking")
      def build(store: Store, out: Path) -> list[ReportOutput]: ...

  and ``build_reports(store, out)`` (``rtrees audit report``) runs every
  registered builder, each into ``out/<its subdirectories>``, and writes an
  index ``out/report.md`` linking them. Builders must read only the store
  (never run a policy or an environment): whatever they need from fresh
  samples is a collection job that has written to the store first.

To add an audit: write ``analysis/<audit>.py`` with a builder decorated by
``register_report``, and add the module name to ``AUDIT_MODULES`` so that
``build_reports`` imports it.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rollout_store.store import Store

# Modules whose import registers report builders (kept sorted).
AUDIT_MODULES: tuple[str, ...] = ("analysis.ranking",)


@dataclass(frozen=True)
class ReportOutput:
    """One report a builder wrote: its directory, a title, a one-line summary."""

    name: str
    directory: Path
    title: str
    summary: str = ""
    files: tuple[Path, ...] = ()


@dataclass
class BuildSummary:
    """What ``build_reports`` wrote, and which builders had nothing to report (and why)."""

    outputs: list[ReportOutput] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    index: Path | None = None


class NothingToReport(Exception):
    """Raised by a builder when the store holds no data for its audit (the reason)."""


ReportBuilder = Callable[["Store", Path], list[ReportOutput]]
REPORT_BUILDERS: dict[str, ReportBuilder] = {}


def register_report(name: str) -> Callable[[ReportBuilder], ReportBuilder]:
    """Register ``builder(store, out) -> [ReportOutput]`` under ``name`` (a decorator)."""

    def deco(builder: ReportBuilder) -> ReportBuilder:
        REPORT_BUILDERS[name] = builder
        return builder

    return deco


def build_reports(store: Store, out: Path, names: Sequence[str] | None = None) -> BuildSummary:
    """Run every registered builder (or those in ``names``) and write ``out/report.md``."""
    for module in AUDIT_MODULES:
        importlib.import_module(module)
    unknown = sorted(set(names or ()) - set(REPORT_BUILDERS))
    if unknown:
        raise ValueError(f"unknown report(s) {unknown}; choose from {sorted(REPORT_BUILDERS)}")
    out.mkdir(parents=True, exist_ok=True)
    summary = BuildSummary()
    for name in sorted(names or REPORT_BUILDERS):
        try:
            summary.outputs += REPORT_BUILDERS[name](store, out)
        except NothingToReport as exc:
            summary.skipped[name] = str(exc)
    lines = ["# Audit reports", "", f"Store: `{store.path}` (version {store.version()})", ""]
    for o in summary.outputs:
        rel = o.directory.relative_to(out) if o.directory.is_relative_to(out) else o.directory
        if o.files:
            lines.append(f"- [{o.title}]({rel.as_posix()}/report.md): {o.summary}")
        else:
            lines.append(f"- {o.title}: {o.summary}")
    for name, reason in summary.skipped.items():
        lines.append(f"- {name}: not built ({reason})")
    summary.index = out / "report.md"
    summary.index.write_text("\n".join(lines) + "\n")
    return summary


# ----- writers ------------------------------------------------------------------------------


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, numpy scalars and arrays -> Python, Paths -> str."""
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    if isinstance(obj, np.generic):
        return _clean(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as indented, key-sorted JSON (non-finite floats as ``null``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")
    return path


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for a report table; ``n/a`` for None or NaN."""
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}f}"


def fmt_ci(value: float | None, ci: Sequence[float | None], digits: int = 3) -> str:
    """``0.712 [0.650, 0.770]``."""
    return f"{fmt(value, digits)} [{fmt(ci[0], digits)}, {fmt(ci[1], digits)}]"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; the first column left-aligned, the rest right."""
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ----- plots --------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class BarSeries:
    """One panel of a bar plot: a value and an interval per label, a reference line."""

    title: str
    values: Sequence[float]
    intervals: Sequence[tuple[float, float]]
    ylabel: str = ""
    reference: float | None = None  # a horizontal line (chance level)


def bar_plot_with_intervals(path: Path, labels: Sequence[str], panels: Sequence[BarSeries],
                            suptitle: str = "") -> Path:
    """One bar per label in each panel, with its interval as an error bar; PNG at ``path``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1.0, 3.6),
                             squeeze=False)
    x = np.arange(len(labels))
    for ax, panel in zip(axes[0], panels, strict=True):
        values = np.asarray(panel.values, dtype=float)
        lo = np.array([iv[0] for iv in panel.intervals], dtype=float)
        hi = np.array([iv[1] for iv in panel.intervals], dtype=float)
        err = np.vstack([np.nan_to_num(values - lo), np.nan_to_num(hi - values)])
        ax.bar(x, np.nan_to_num(values), yerr=np.clip(err, 0.0, None), capsize=4,
               color="tab:blue", alpha=0.8)
        if panel.reference is not None:
            ax.axhline(panel.reference, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(x, list(labels), rotation=30, ha="right")
        ax.set_title(panel.title)
        ax.set_ylabel(panel.ylabel)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scatter_panels(path: Path, x: np.ndarray, ys: Mapping[str, np.ndarray], xlabel: str,
                   ylabel: str, suptitle: str = "", max_points: int = 20_000,
                   seed: int = 0) -> Path:
    """One scatter panel per entry of ``ys`` against the shared ``x`` (subsampled to
    ``max_points`` points, the same points in every panel); PNG at ``path``."""
    plt = _pyplot()
    n = len(x)
    keep = np.arange(n)
    if n > max_points:
        keep = np.sort(np.random.default_rng(seed).choice(n, max_points, replace=False))
    cols = min(len(ys), 4)
    rows = -(-len(ys) // cols) if ys else 1
    fig, axes = plt.subplots(rows, max(cols, 1), figsize=(3.4 * max(cols, 1), 3.2 * rows),
                             squeeze=False)
    for ax, (name, y) in zip(axes.flat, ys.items(), strict=False):
        ax.scatter(x[keep], np.asarray(y)[keep], s=6, alpha=0.35, linewidths=0)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(ys):]:
        ax.set_visible(False)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["AUDIT_MODULES", "REPORT_BUILDERS", "BarSeries", "BuildSummary", "NothingToReport",
           "ReportBuilder", "ReportOutput", "bar_plot_with_intervals", "build_reports", "fmt",
           "fmt_ci", "markdown_table", "register_report", "scatter_panels", "write_json"]
