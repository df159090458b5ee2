"""Localization report: BEL's accuracy and consistency against the exact first
irrecoverable step, from the localization study's store.

The data come from ``train.studies.localization`` (METHODS.md section 2.1, ELPO's
BEL, E1-E2): every localization is a tree in ``<study dir>/store`` with
``trees.critical_node_id`` = BEL's localized node and, in ``meta["study"]``, the
exact node, X, mode, repeat, probes and suffix steps. This module reads that
store only: accuracy (localized == exact), signed error, probes, suffix rollouts
and steps, and the repeat agreement, by DuckDB SQL (``localization_summary``).

Consistency metrics: the pairwise agreement rate is the share of repeat pairs that
return the same step, the unanimity rate the share of trajectories on which every
repeat agrees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.report import (
    ReportOutput,
    StudyFileError,
    fmt,
    new_figure,
    open_study,
    register_study_report,
    save_figure,
    study_path,
    write_study_results,
)
from rollout_store import Store, connect

PROBE_PHASE = "probe"  # the phase of BEL's suffix rollouts (train.sampling.bel)


def localization_summary(store: Store, run_id: str) -> dict[str, Any]:
    """Accuracy, error, cost and repeat agreement per (mode, X), from the store's trees
    (``critical_node_id`` against ``meta.study.true_critical_node_id``)."""
    con = connect(store)
    # run_id comes from study.json: bound as a parameter (a TEMP TABLE, since a view
    # cannot hold one), never SQL text
    con.execute("""
        CREATE OR REPLACE TEMP TABLE loc AS
        SELECT json_extract(meta, '$.study.deterministic')::BOOLEAN AS deterministic,
               json_extract(meta, '$.study.x')::INTEGER AS x,
               json_extract(meta, '$.study.trajectory')::INTEGER AS trajectory,
               json_extract(meta, '$.study.repeat')::INTEGER AS repeat,
               json_extract(meta, '$.study.true_critical_step')::BIGINT AS truth,
               json_extract(meta, '$.study.localized_step')::BIGINT AS step,
               json_extract(meta, '$.study.true_critical_node_id')::BIGINT AS truth_node,
               json_extract(meta, '$.study.probes')::INTEGER AS probes,
               json_extract(meta, '$.study.suffix_steps')::BIGINT AS suffix_steps,
               json_extract(meta, '$.study.n_steps')::INTEGER AS n_steps,
               critical_node_id AS found_node,
               rollouts_by_phase[$phase] AS suffixes
        FROM trees WHERE run_id = $run_id""", {"phase": PROBE_PHASE, "run_id": str(run_id)})
    rows = con.sql("""
        SELECT deterministic, x, count(*) AS n, count(DISTINCT trajectory) AS n_traj,
               avg(CASE WHEN found_node = truth_node THEN 1.0 ELSE 0.0 END) AS accuracy,
               avg(step - truth) AS mean_error, avg(abs(step - truth)) AS mean_abs_error,
               avg(CASE WHEN step < truth THEN 1.0 ELSE 0.0 END) AS early,
               avg(CASE WHEN step > truth THEN 1.0 ELSE 0.0 END) AS late,
               avg(probes) AS probes, avg(coalesce(suffixes, 0)) AS suffixes,
               avg(suffix_steps) AS suffix_steps, avg(n_steps) AS trajectory_steps
        FROM loc GROUP BY deterministic, x ORDER BY deterministic DESC, x""").fetchall()
    agreement = {(d, x): (pairs, unanimous) for d, x, pairs, unanimous in con.sql("""
        WITH counts AS (
            SELECT deterministic, x, trajectory, found_node, count(*) AS c FROM loc
            GROUP BY deterministic, x, trajectory, found_node
        ), per_traj AS (
            SELECT deterministic, x, trajectory, sum(c * (c - 1)) AS same, sum(c) AS r,
                   count(*) AS distinct_found FROM counts
            GROUP BY deterministic, x, trajectory
        )
        SELECT deterministic, x,
               avg(CASE WHEN r > 1 THEN same / (r * (r - 1)) END),
               avg(CASE WHEN distinct_found = 1 THEN 1.0 ELSE 0.0 END)
        FROM per_traj GROUP BY deterministic, x""").fetchall()}
    names = ("deterministic", "x", "n", "n_trajectories", "accuracy", "mean_error",
             "mean_abs_error", "early_rate", "late_rate", "probes", "suffix_rollouts",
             "suffix_steps", "trajectory_steps")
    table = []
    for row in rows:
        rec = dict(zip(names, row, strict=True))
        pairs, unanimous = agreement[(rec["deterministic"], rec["x"])]
        rec["pairwise_agreement"] = pairs
        rec["unanimity"] = unanimous
        table.append(rec)
    return {"table": table}


def localization_plots(table: list[dict[str, Any]], out_dir: Path) -> list[str]:
    """Accuracy, repeat agreement and signed error vs X per mode; the file names."""
    files = []
    for metric, label, name in (
            ("accuracy", "accuracy (localized == exact t_crit)", "accuracy.png"),
            ("pairwise_agreement", "pairwise agreement across repeats", "agreement.png"),
            ("mean_error", "mean signed error (localized - exact)", "error.png")):
        fig, ax = new_figure()
        for det in sorted({r["deterministic"] for r in table}, reverse=True):
            rows = [r for r in table if r["deterministic"] == det]
            ax.plot([r["x"] for r in rows], [r[metric] for r in rows], marker="o",
                    label="deterministic" if det else "stochastic")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("suffix samples per probe X")
        ax.set_ylabel(label)
        ax.legend()
        files.append(save_figure(fig, out_dir / name))
    return files


def localization_report(results: dict[str, Any]) -> str:
    """The markdown report of a localization results dict (``localization_results``')."""
    c = results["config"]
    lines = [
        "# Localization audit (BEL vs the exact first irrecoverable step, workflow)", "",
        f"{c['n_tasks']} tasks per mode, up to {c['failures_per_task']} failed trajectories "
        f"of mu per task, each localized {c['repeats']} times per X with independent "
        f"suffix seeds; probe cap: {c['max_probes'] or 'none (search to L == R)'}. "
        f"Localizations are trees in the store `{results['store']}` (run "
        f"`{results['run_id']}`, `trees.critical_node_id` = localized step); the table is "
        "computed from the store by SQL.", "",
        f"BEL implementation: {results['bel_implementation']}", "",
        "| mode | X | localizations | accuracy | mean signed error | early / late "
        "| pairwise agreement | unanimous | probes | suffix rollouts | suffix steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["table"]:
        mode = "deterministic" if r["deterministic"] else "stochastic"
        lines.append(
            f"| {mode} | {r['x']} | {r['n']} | {fmt(r['accuracy'], 3)} | "
            f"{fmt(r['mean_error'], 3)} | {fmt(r['early_rate'], 3)} / "
            f"{fmt(r['late_rate'], 3)} | {fmt(r['pairwise_agreement'], 3)} | "
            f"{fmt(r['unanimity'], 3)} | {fmt(r['probes'], 2)} | "
            f"{fmt(r['suffix_rollouts'], 1)} | {fmt(r['suffix_steps'], 1)} |")
    lines += [
        "",
        "Reading: an *early* error (localized < exact) means every suffix from a still "
        "recoverable prefix failed: with few suffixes, or in stochastic mode where a "
        "recoverable state can have a small success probability under mu, BEL blames a "
        "step too early. A *late* error is impossible: L only moves past a prefix after a "
        "suffix from it succeeded, which proves that prefix recoverable, so L <= exact "
        "t_crit always (the late column is a check; with a probe cap the search can also "
        "stop early with L < R).", "",
        "Plots: " + ", ".join(f"`{f}`" for f in results["plots"]), "",
        f"Reproduce: `train.jobs.localization_study(out_dir, LocalizationConfig(**config))` "
        f"({results['seconds']:.1f} s here).",
    ]
    return "\n".join(lines) + "\n"


def localization_results(study_dir: str | Path, out_dir: str | Path | None = None
                         ) -> dict[str, Any]:
    """The localization report of a study directory (``study.json`` + ``store/``): write
    ``results.json``, ``report.md`` and PNG plots into ``out_dir`` (default: the study
    directory); return the results dict."""
    src, out, study = open_study(study_dir, out_dir, "localization")
    run_id = study.get("run_id")
    if not isinstance(run_id, str):
        raise StudyFileError(f"{src}/study.json: run_id must be a string, got {run_id!r}")
    summary = localization_summary(Store(study_path(src, study["store"], "store")), run_id)
    results: dict[str, Any] = {
        "audit": "localization", **{k: v for k, v in study.items() if k != "study"},
        **summary}
    results["plots"] = localization_plots(summary["table"], out)
    return write_study_results(out, results, localization_report(results))


@register_study_report("localization")
def build_localization_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``)."""
    res = localization_results(study_dir, out)
    best = max(res["table"], key=lambda r: r["accuracy"] or 0.0, default=None)
    summary = ("no localizations" if best is None else
               f"best accuracy {fmt(best['accuracy'])} at X = {best['x']} "
               f"({'deterministic' if best['deterministic'] else 'stochastic'})")
    return ReportOutput("localization", out, "BEL localization audit", summary,
                        (out / "report.md",))


__all__ = ["build_localization_report", "localization_plots", "localization_report",
           "localization_results", "localization_summary"]
