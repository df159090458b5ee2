"""Study reports: ``results.json``, ``report.md`` and PNG plots, rebuilt from the store alone.

Every audit writes the same three kinds of file into one
directory. This module holds what they share:

* writers: ``write_json`` (NaN and inf become ``null``), ``markdown_table``,
  ``fmt_ci``;
* plots (matplotlib, ``Agg`` backend, imported when first used):
  ``bar_plot_with_intervals``, ``scatter_panels``, and ``new_figure`` /
  ``save_figure`` for a study's own plots;
* a registry of report builders. An audit module registers a function that
  rebuilds its reports from a store::

      @register_report("ranking")
      def build(store: Store, out: Path) -> list[ReportOutput]: ...

  and ``build_reports(store, out)`` (``rtrees audit report``) runs every
  registered builder, each into ``out/<its subdirectories>``, and writes an
  index ``out/report.md`` linking them. Builders must read only the store
  (never run a policy or an environment): whatever they need from fresh
  samples is a collection job that has written to the store first;
* a registry of *study* report builders (``register_study_report(kind)``): a study
  of ``train.studies`` writes ``study.json`` (with ``"study": kind``) and its data
  files into a directory; ``build_study_report(study_dir, out)`` rebuilds that
  study's ``results.json``, ``report.md`` and plots from those files alone, and
  ``build_reports(store, out, studies=[...])`` adds them to the index.

Number format: ``fmt`` (``n/a`` for None / NaN; 3 digits unless a table asks for
more), ``fmt_ci`` for ``value [low, high]``.

To add an audit: write ``analysis/<audit>.py`` with a builder decorated by
``register_report`` (or ``register_study_report``), and add the module name to
``AUDIT_MODULES`` so that ``build_reports`` imports it.
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
    import duckdb
    import pyarrow as pa

    from rollout_store.store import Store

# Modules whose import registers report builders (kept sorted).
AUDIT_MODULES: tuple[str, ...] = ("analysis.constructions", "analysis.drift",
                                   "analysis.exact_credit", "analysis.gates",
                                   "analysis.localization", "analysis.ranking_report",
                                   "analysis.recovery", "analysis.table1",
                                   "analysis.third_party")


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


class StudyFileError(ValueError):
    """A ``study.json`` value that cannot be used as it is (issue 21): a data path that
    leaves the study directory, a setting that is not a finite number, or a name that is
    not a plain file-name part."""


def study_path(src: Path, value: Any, key: str) -> Path:
    """``src / value`` for a data path named in ``study.json`` under ``key``, resolved
    (symlinks followed); ``StudyFileError`` unless it is a non-empty relative path that
    stays inside the study directory ``src``."""
    if not isinstance(value, str) or not value:
        raise StudyFileError(f"{src}/study.json: {key} must be a path inside the study "
                             f"directory, got {value!r}")
    root = Path(src).resolve()
    path = (root / value).resolve()
    if Path(value).is_absolute() or not path.is_relative_to(root):
        raise StudyFileError(f"{src}/study.json: {key} {value!r} points outside the study "
                             "directory")
    return path


def study_number(config: Any, key: str) -> float:
    """``config[key]`` (a study's settings from ``study.json``) as a finite float;
    ``StudyFileError`` for anything else (a string, a bool, NaN). Numbers go to SQL as
    bound parameters, never as text."""
    value = config.get(key) if isinstance(config, Mapping) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(
            value):
        raise StudyFileError(f"study.json config.{key} must be a finite number, got "
                             f"{value!r}")
    return float(value)


def study_int(config: Any, key: str) -> int:
    """``config[key]`` as an integer (``study_number``, whole)."""
    value = study_number(config, key)
    if not value.is_integer():
        raise StudyFileError(f"study.json config.{key} must be an integer, got "
                             f"{config[key]!r}")
    return int(value)


def plain_name(value: Any, what: str) -> str:
    """``value`` as a plain file-name part (letters, digits, ``_ - . @``, not starting with
    a dot): names from study files that end up in output file names (``StudyFileError``
    otherwise, e.g. ``../x``)."""
    text = str(value)
    if not text or text.startswith(".") or any(
            not (c.isascii() and (c.isalnum() or c in "_-.@")) for c in text):
        raise StudyFileError(f"{what} {text!r} is not a plain name (letters, digits, _ - . @)")
    return text


def study_connection(tables: Mapping[str, Path | pa.Table]) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection holding each Parquet file (read by pyarrow) or Arrow table of
    ``tables`` as the view of its name, locked down like ``rtrees sql``'s
    (``rollout_store.sqlguard.lock_down``: external access off, memory and threads
    bounded): a study's queries read those files and nothing else, with every value from
    ``study.json`` bound as a parameter."""
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollout_store.sqlguard import lock_down

    con = duckdb.connect()
    for name, path in tables.items():
        con.register(name, path if isinstance(path, pa.Table) else pq.read_table(path))
    return lock_down(con)


ReportBuilder = Callable[["Store", Path], list[ReportOutput]]
REPORT_BUILDERS: dict[str, ReportBuilder] = {}
StudyBuilder = Callable[[Path, Path], ReportOutput]  # (study dir, out dir)
STUDY_BUILDERS: dict[str, StudyBuilder] = {}


def register_report(name: str) -> Callable[[ReportBuilder], ReportBuilder]:
    """Register ``builder(store, out) -> [ReportOutput]`` under ``name`` (a decorator)."""

    def deco(builder: ReportBuilder) -> ReportBuilder:
        REPORT_BUILDERS[name] = builder
        return builder

    return deco


def register_study_report(kind: str) -> Callable[[StudyBuilder], StudyBuilder]:
    """Register ``builder(study_dir, out) -> ReportOutput`` for ``study.json``'s ``kind``."""

    def deco(builder: StudyBuilder) -> StudyBuilder:
        STUDY_BUILDERS[kind] = builder
        return builder

    return deco


# Upper bounds (inclusive) of the size settings a study.json's ``config`` may hold, by name:
# the bounds a study is run with (train.studies.STUDY_MAXIMA, which analysis may not
# import; tests/test_study_input.py keeps the two equal), checked again on reading, since
# the file can be edited between run and report (issue 50 item 8: n_boot=1e9 hung the
# report's bootstrap). A list setting is checked element by element.
STUDY_FILE_MAXIMA: dict[str, int] = {
    "n_tasks": 10_000, "calc_tasks": 10_000, "n_dev": 10_000, "n_calib": 10_000,
    "n_eval": 10_000, "n_old": 100_000, "n_boot": 100_000, "k": 10_000, "n_total": 4_096,
    "max_new_tokens": 32_768, "sgls_max_new_tokens": 32_768, "resamples": 10_000,
    "failures_per_task": 1_000, "max_attempts": 100_000, "repeats": 1_000,
    "n_initial": 4_096, "max_probes": 4_096, "cap_steps": 10_000_000, "refresh_batch": 4_096,
    "steps": 1_000_000, "tasks_per_step": 4_096, "heldout_tasks": 10_000,
    "eval_every": 1_000_000}
STUDY_FILE_MAX_ITEMS = 10_000
"""Most items of any list in a study.json's ``config`` (seeds, horizons, configs, ...)."""
STUDY_FILE_MAX_BYTES = 64 * 2**20
"""Largest ``study.json`` read (a study's own is a few KiB)."""


def read_study(study_dir: Path, kind: str | None = None) -> dict[str, Any]:
    """A study directory's ``study.json`` (``NothingToReport`` when there is none, or it
    is of another kind; ``StudyFileError`` naming the field when its ``config`` is missing,
    not an object, or holds a size setting that is not an integer in
    ``[0, STUDY_FILE_MAXIMA[name]]`` (n_boot at most 100,000, n_total 4,096, ...) or a list
    of more than ``STUDY_FILE_MAX_ITEMS`` items; or when the file is over
    ``STUDY_FILE_MAX_BYTES`` or nested too deeply to parse)."""
    path = Path(study_dir) / "study.json"
    if not path.is_file():
        raise NothingToReport(f"{study_dir} holds no study.json (run the study first)")
    if path.stat().st_size > STUDY_FILE_MAX_BYTES:
        raise StudyFileError(f"{path}: {path.stat().st_size} bytes, over the "
                             f"{STUDY_FILE_MAX_BYTES} bytes a study.json may hold")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise NothingToReport(f"{path} is not JSON: {exc}") from exc
    except (UnicodeDecodeError, RecursionError) as exc:
        raise StudyFileError(f"{path} is not readable JSON ({type(exc).__name__}: nested "
                             "too deeply or not UTF-8)") from None
    if not isinstance(doc, dict) or "study" not in doc:
        raise NothingToReport(f"{path} names no study kind")
    if kind is not None and doc["study"] != kind:
        raise NothingToReport(f"{path} is a {doc['study']!r} study, not {kind!r}")
    check_study_config(path, doc)
    return doc


def check_study_config(path: Path, doc: Mapping[str, Any]) -> None:
    """``StudyFileError`` naming ``path`` and the field unless ``doc["config"]`` is an
    object whose size settings are within bounds (``read_study``)."""
    if "config" not in doc:
        raise StudyFileError(f"{path}: config is missing (the study's settings; rerun the "
                             "study to rewrite it)")
    config = doc["config"]
    if not isinstance(config, dict):
        raise StudyFileError(f"{path}: config must be an object, got "
                             f"{type(config).__name__}")
    for name, value in config.items():
        if isinstance(value, list) and len(value) > STUDY_FILE_MAX_ITEMS:
            raise StudyFileError(f"{path}: config.{name} has {len(value)} items, more than "
                                 f"{STUDY_FILE_MAX_ITEMS}")
        if name not in STUDY_FILE_MAXIMA or value is None:
            continue
        bound = STUDY_FILE_MAXIMA[name]
        for v in value if isinstance(value, list) else [value]:
            if not isinstance(v, int) or isinstance(v, bool):
                raise StudyFileError(f"{path}: config.{name} must be an integer, got "
                                     f"{json.dumps(v)[:40]}")
            if not 0 <= v <= bound:
                raise StudyFileError(f"{path}: config.{name} must be in [0, {bound}], "
                                     f"got {v}")


def open_study(study_dir: str | Path, out_dir: str | Path | None, kind: str
               ) -> tuple[Path, Path, dict[str, Any]]:
    """(study directory, output directory (created; default: the study directory), its
    ``study.json``) for a report builder of ``kind``."""
    src = Path(study_dir)
    out = Path(out_dir) if out_dir is not None else src
    study = read_study(src, kind)
    out.mkdir(parents=True, exist_ok=True)
    return src, out, study


def open_study_of_kinds(study_dir: str | Path, out_dir: str | Path | None,
                        kinds: Sequence[str]) -> tuple[Path, Path, dict[str, Any]]:
    """``open_study`` for a report builder of several study kinds: the study's own kind
    (``study["study"]``) must be one of ``kinds``, else ``NothingToReport``."""
    kind = str(read_study(Path(study_dir))["study"])
    if kind not in kinds:
        raise NothingToReport(f"{study_dir} is a {kind!r} study, not one of {kinds}")
    return open_study(study_dir, out_dir, kind)


def build_study_report(study_dir: Path, out: Path | None = None) -> ReportOutput:
    """Rebuild one study's report from its directory (into ``out``, default the study
    directory itself)."""
    for module in AUDIT_MODULES:
        importlib.import_module(module)
    kind = str(read_study(study_dir)["study"])
    if kind not in STUDY_BUILDERS:
        raise NothingToReport(f"no report builder for study kind {kind!r}")
    return STUDY_BUILDERS[kind](Path(study_dir), Path(out) if out else Path(study_dir))


def build_reports(store: Store | None, out: Path, names: Sequence[str] | None = None,
                  studies: Sequence[Path] = ()) -> BuildSummary:
    """Run every registered store builder (or those in ``names``) on ``store`` (None: none)
    and rebuild each study directory of ``studies`` into ``out/<its name>``; write the
    index ``out/report.md``."""
    for module in AUDIT_MODULES:
        importlib.import_module(module)
    unknown = sorted(set(names or ()) - set(REPORT_BUILDERS))
    if unknown:
        raise ValueError(f"unknown report(s) {unknown}; choose from {sorted(REPORT_BUILDERS)}")
    out.mkdir(parents=True, exist_ok=True)
    summary = BuildSummary()
    for name in sorted(names or REPORT_BUILDERS):
        if store is None:
            break
        try:
            summary.outputs += REPORT_BUILDERS[name](store, out)
        except NothingToReport as exc:
            summary.skipped[name] = str(exc)
    for study_dir in studies:
        try:
            summary.outputs.append(build_study_report(study_dir, out / Path(study_dir).name))
        except NothingToReport as exc:
            summary.skipped[str(study_dir)] = str(exc)
    head = (f"Store: `{store.path}` (version {store.version()})" if store is not None
            else "No store.")
    lines = ["# Audit reports", "", head, ""]
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


def write_study_results(out: Path, results: dict[str, Any], report: str) -> dict[str, Any]:
    """Write a study report's two files into ``out``: the markdown ``report`` as
    ``report.md``, then ``results`` as ``results.json`` (``write_json``); return ``results``."""
    (out / "report.md").write_text(report)
    write_json(out / "results.json", results)
    return results


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


def new_figure(width: float = 6.0, height: float = 4.0) -> tuple[Any, Any]:
    """A matplotlib (figure, axes) on the Agg backend (no display needed)."""
    return _pyplot().subplots(figsize=(width, height))


def save_figure(fig: Any, path: Path) -> str:
    """Save ``fig`` as a PNG at ``path``, close it, and return the file name."""
    plt = _pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


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
    save_figure(fig, path)
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
    save_figure(fig, path)
    return path


__all__ = ["AUDIT_MODULES", "REPORT_BUILDERS", "STUDY_BUILDERS", "BarSeries", "BuildSummary",
           "NothingToReport", "ReportBuilder", "ReportOutput", "StudyBuilder",
           "bar_plot_with_intervals", "build_reports", "build_study_report", "fmt", "fmt_ci",
           "markdown_table", "new_figure", "open_study", "read_study", "register_report",
           "register_study_report", "save_figure", "scatter_panels", "write_json"]
