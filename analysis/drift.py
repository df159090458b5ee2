"""Credit-drift report (DSC-Gate Figs. 2-3) from the drift study's ``pairs.parquet``.

The data come from ``train.studies.drift`` (exact credits, drift and branch
sensitivity per (task, update, decision state, action pair), METHODS.md section 5,
D1, D2, D6); this module reads that file only and computes (DuckDB SQL plus rank
statistics, ``analysis.stats``):

* reversal rate above the relevance threshold tau [R: tau = 0.02, the regret
  threshold of section 5]: among pairs with |c_mu| > tau, the fraction whose
  sign flips (c_mu * c_pi < 0);
* D6 check: among relevant pairs, how often the exact drift satisfies the
  sufficient survival condition |Delta c| < |c_mu|, and how often the first-order
  |G| < |c_mu| predicts survival correctly;
* Spearman rho of |Delta c| with the global KL, the pairwise KL and |G| (pooled
  over tasks, updates, states and pairs; also root-state pairs only), with a
  task-cluster bootstrap CI of each rho and of rho(|G|) - rho(KL) (the paper's L1
  contrast: 0.839 [0.830, 0.847] for |G| over KL);
* the same correlations within each task, averaged over tasks (``per_task_spearman``,
  task-bootstrap CIs), and the L1 verdicts (``l1_verdicts``, ``analysis.verdicts``).

The same report serves ``rtrees study dsc-l1`` (study kind ``dsc-l1``: the drift data at
the L1 settings of ``train.jobs``).

``drift_results(study_dir)`` writes ``results.json``, ``report.md`` and the plots;
``rtrees audit report --study DIR`` rebuilds them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.report import (
    ReportOutput,
    fmt,
    fmt_ci,
    new_figure,
    open_study_of_kinds,
    register_study_report,
    save_figure,
    study_connection,
    study_int,
    study_number,
    study_path,
    write_study_results,
)
from analysis.stats import cluster_draws, percentile_ci, spearman
from analysis.verdicts import verdict, verdict_lines

PAPER_L1_RHO_GAIN = (0.839, (0.830, 0.847))  # METHODS section 5 results, L1
DRIFT_KINDS = ("drift", "dsc-l1")  # study.json kinds this module reports


# ----------------------------------------------------------------- statistics
def _bootstrap_rho_gain(table: dict[str, np.ndarray], n_boot: int, seed: int
                        ) -> dict[str, list[float]]:
    """Task-cluster bootstrap percentile 95% CIs of the pooled rho(|G|) - rho(KL) (both
    KLs, keys ``global_kl`` / ``pairwise_kl``) and of each pooled rho (keys ``rho_abs_g``,
    ``rho_global_kl``, ``rho_pairwise_kl``)."""
    tasks = table["task_id"]
    names, inverse = np.unique(tasks, return_inverse=True)
    rows_of = [np.flatnonzero(inverse == i) for i in range(names.size)]
    rng = np.random.default_rng(seed)
    samples: dict[str, list[float]] = {k: [] for k in (
        "global_kl", "pairwise_kl", "rho_abs_g", "rho_global_kl", "rho_pairwise_kl")}
    drift = np.abs(table["drift"])
    for draws in cluster_draws(rng, n_boot, names.size):
        pick = np.concatenate([rows_of[i] for i in draws[0]])
        rho_g = spearman(drift[pick], np.abs(table["g"][pick]))
        samples["rho_abs_g"].append(rho_g)
        for name in ("global_kl", "pairwise_kl"):
            rho = spearman(drift[pick], table[name][pick])
            samples[f"rho_{name}"].append(rho)
            samples[name].append(rho_g - rho)
    return {name: percentile_ci(np.array(values)) for name, values in samples.items()}


def per_task_spearman(table: Mapping[str, np.ndarray], n_boot: int, seed: int
                      ) -> dict[str, Any]:
    """Spearman rho of |drift| with |G|, pairwise KL and global KL within each task (over
    its updates x states x pairs; the global KL varies across the task's updates), their
    means over tasks and the gains mean(rho_G - rho_KL), each with a task bootstrap
    percentile 95% CI (tasks resampled with replacement, ``cluster_draws``).

    This is the paper's L1 unit [R]: its Fig. 3 aggregates per-task gains ("each
    hexagon aggregates one or more confirmation tasks"). A task whose rho is undefined
    (constant drift) is left out of that mean."""
    tasks = np.asarray(table["task_id"])
    names, inverse = np.unique(tasks, return_inverse=True)
    per: dict[str, list[float]] = {"abs_g": [], "pairwise_kl": [], "global_kl": []}
    drift = np.abs(np.asarray(table["drift"], np.float64))
    for i in range(names.size):
        m = inverse == i
        per["abs_g"].append(spearman(drift[m], np.abs(table["g"][m])))
        per["pairwise_kl"].append(spearman(drift[m], table["pairwise_kl"][m]))
        per["global_kl"].append(spearman(drift[m], table["global_kl"][m]))
    arrays = {k: np.asarray(v) for k, v in per.items()}
    arrays["gain_global_kl"] = arrays["abs_g"] - arrays["global_kl"]
    arrays["gain_pairwise_kl"] = arrays["abs_g"] - arrays["pairwise_kl"]
    rng = np.random.default_rng([seed, 7])
    out: dict[str, Any] = {"n_tasks": int(names.size)}
    for name, values in arrays.items():
        finite = values[np.isfinite(values)]
        if not finite.size:
            out[name] = {"value": math.nan, "ci95": [math.nan, math.nan], "n_tasks": 0}
            continue
        boots = [float(np.mean(finite[d[0]])) for d in cluster_draws(rng, n_boot,
                                                                         finite.size)]
        out[name] = {"value": float(np.mean(finite)),
                     "ci95": percentile_ci(np.array(boots)) if boots else [math.nan] * 2,
                     "n_tasks": int(finite.size)}
    return out


RHO_DELTA = 0.02
"""Equivalence margin (V1) of a difference of Spearman correlations [R]."""


def l1_verdicts(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The L1 claim "|G| explains drift better than KL" (paper: the Spearman gain 0.839
    [0.830, 0.847]) judged on the per-task and the pooled gains over global and pairwise
    KL (``analysis.verdicts``)."""
    paper, (plo, phi) = PAPER_L1_RHO_GAIN
    text = f"|G| beats KL by {paper} [{plo}, {phi}] in Spearman rho (480 tasks, LM policy)"
    out = []
    per = summary["per_task"]
    for name, label in (("global_kl", "global KL"), ("pairwise_kl", "pairwise KL")):
        g = per[f"gain_{name}"]
        out.append(verdict(
            f"L1: |G| explains |drift| better than {label} (per task)",
            f"mean over tasks of rho(|G|) - rho({label})", g["value"], g["ci95"], 0.0,
            "above", text, paper, delta=RHO_DELTA).to_json())
        pooled = summary["rho_gain_g_over"][name]
        out.append(verdict(
            f"L1: |G| explains |drift| better than {label} (pooled)",
            f"pooled rho(|G|) - rho({label})", pooled["value"],
            pooled["ci95"] or [math.nan, math.nan], 0.0, "above", text, paper,
            delta=RHO_DELTA).to_json())
    return out


def _correlations(drift: np.ndarray, g: np.ndarray, global_kl: np.ndarray,
                  pairwise_kl: np.ndarray) -> dict[str, float]:
    a = np.abs(drift)
    return {"abs_g": spearman(a, np.abs(g)), "global_kl": spearman(a, global_kl),
            "pairwise_kl": spearman(a, pairwise_kl)}


def drift_summary(pairs_path: Path, tau: float = 0.02, n_boot: int = 300, seed: int = 0
                  ) -> dict[str, Any]:
    """Every statistic of the report, from the per-pair Parquet file (DuckDB + ranks)."""
    con = study_connection({"pairs": pairs_path})
    bound = {"tau": float(tau)}  # from study.json: a bound parameter, never SQL text
    by_update = con.sql("""
        SELECT kind, kl_target, count(*) AS n_pairs, avg(global_kl) AS global_kl,
               count(DISTINCT task_id) AS n_tasks,
               avg(abs(drift)) AS mean_abs_drift, max(abs(drift)) AS max_abs_drift,
               count(*) FILTER (WHERE abs(c_old) > $tau) AS n_relevant,
               count(*) FILTER (WHERE abs(c_old) > $tau AND c_old * c_new < 0) AS reversals,
               count(*) FILTER (WHERE abs(c_old) > $tau AND root) AS n_relevant_root,
               count(*) FILTER (WHERE abs(c_old) > $tau AND root AND c_old * c_new < 0)
                   AS reversals_root,
               count(*) FILTER (WHERE abs(c_old) > $tau AND live) AS n_relevant_live,
               count(*) FILTER (WHERE abs(c_old) > $tau AND live AND c_old * c_new < 0)
                   AS reversals_live
        FROM pairs GROUP BY kind, kl_target ORDER BY kind, kl_target""", params=bound
                        ).fetchall()
    rows = []
    for (kind, kl_target, n_pairs, gkl, n_tasks, mad, maxd, n_rel, rev, n_rel_root,
         rev_root, n_rel_live, rev_live) in by_update:
        rows.append({
            "kind": kind, "kl_target": kl_target, "global_kl": gkl, "n_tasks": n_tasks,
            "n_pairs": n_pairs, "mean_abs_drift": mad, "max_abs_drift": maxd,
            "n_relevant": n_rel, "reversals": rev,
            "reversal_rate": rev / n_rel if n_rel else math.nan,
            "n_relevant_root": n_rel_root, "reversals_root": rev_root,
            "reversal_rate_root": rev_root / n_rel_root if n_rel_root else math.nan,
            "n_relevant_live": n_rel_live, "reversals_live": rev_live,
            "reversal_rate_live": rev_live / n_rel_live if n_rel_live else math.nan})
    total = con.sql("""
        SELECT count(*) FILTER (WHERE abs(c_old) > $tau),
               count(*) FILTER (WHERE abs(c_old) > $tau AND c_old * c_new < 0),
               count(*) FILTER (WHERE abs(c_old) > $tau AND abs(drift) < abs(c_old)),
               count(*) FILTER (WHERE abs(c_old) > $tau AND abs(g) < abs(c_old)),
               count(*) FILTER (WHERE abs(c_old) > $tau AND abs(g) < abs(c_old)
                                AND c_old * c_new < 0),
               count(*) FILTER (WHERE abs(c_old) > $tau AND abs(g) >= abs(c_old)
                                AND c_old * c_new < 0),
               count(*), max(abs(drift)), avg(abs(drift - g)), avg(abs(drift))
        FROM pairs""", params=bound).fetchall()[0]
    (n_rel, rev, d6_exact, g_survive, g_survive_rev, g_flag_rev, n_all, max_drift,
     first_order_err, mean_drift) = total
    cols = con.sql("SELECT task_id, kind, root, drift, g, global_kl, pairwise_kl FROM pairs"
                   ).fetchnumpy()
    table = {k: np.asarray(v) for k, v in cols.items()}
    corr = {"all": _correlations(table["drift"], table["g"], table["global_kl"],
                                 table["pairwise_kl"])}
    root = table["root"].astype(bool)
    corr["root"] = _correlations(table["drift"][root], table["g"][root],
                                 table["global_kl"][root], table["pairwise_kl"][root])
    for kind in np.unique(table["kind"]):
        m = table["kind"] == kind
        corr[str(kind)] = _correlations(table["drift"][m], table["g"][m],
                                        table["global_kl"][m], table["pairwise_kl"][m])
    signed = (float(np.corrcoef(table["drift"], table["g"])[0, 1])
              if np.ptp(table["drift"]) > 0 and np.ptp(table["g"]) > 0 else math.nan)
    gain = {name: corr["all"]["abs_g"] - corr["all"][name]
            for name in ("global_kl", "pairwise_kl")}
    ci = _bootstrap_rho_gain(table, n_boot, seed) if n_boot > 0 else {}
    per_task = per_task_spearman(table, n_boot, seed)
    return {
        "tau": tau, "n_pairs": n_all, "n_relevant": n_rel, "reversals": rev,
        "reversal_rate": rev / n_rel if n_rel else math.nan,
        "max_abs_drift": max_drift, "mean_abs_drift": mean_drift,
        "by_update": rows,
        "d6": {
            "exact_survival_condition_rate": d6_exact / n_rel if n_rel else math.nan,
            "g_predicts_survival": g_survive, "reversed_despite_g_survival": g_survive_rev,
            "g_flags_risk": n_rel - g_survive, "reversed_among_g_flagged": g_flag_rev},
        "first_order": {"mean_abs_drift_minus_g": first_order_err,
                        "pearson_drift_g": signed},
        "spearman": corr,
        "rho_gain_g_over": {name: {"value": gain[name], "ci95": ci.get(name)}
                            for name in gain},
        "spearman_ci95": {name: ci.get(f"rho_{name}")
                          for name in ("abs_g", "global_kl", "pairwise_kl")},
        "per_task": per_task,
    }


# ----------------------------------------------------------------- plots and report
def drift_plots(table: pa.Table, summary: dict[str, Any], out_dir: Path) -> list[str]:
    """|drift| vs |G| and vs pairwise KL, reversal rate vs KL, Spearman bars; file names."""
    drift = np.abs(np.asarray(table.column("drift")))
    g = np.abs(np.asarray(table.column("g")))
    pkl = np.asarray(table.column("pairwise_kl"))
    kind = np.asarray(table.column("kind").to_pylist())
    files = []
    for name, x, label in (("drift_vs_g.png", g, "|G(a,b)| (D2, exact)"),
                           ("drift_vs_pairwise_kl.png", pkl, "pairwise KL")):
        fig, ax = new_figure()
        positive = (drift > 0) & (x > 0)
        for k in np.unique(kind):
            m = (kind == k) & positive
            ax.scatter(x[m], drift[m], s=4, alpha=0.4, label=str(k))
        if positive.any():  # log axes need data (with pi = mu every drift is 0)
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("|Δc| = |c_π - c_μ| (exact)")
        ax.legend(markerscale=3)
        files.append(save_figure(fig, out_dir / name))
    fig, ax = new_figure()
    for k in sorted({r["kind"] for r in summary["by_update"]}):
        rows = [r for r in summary["by_update"] if r["kind"] == k]
        ax.plot([r["global_kl"] for r in rows], [r["reversal_rate"] for r in rows],
                marker="o", label=k)
    ax.set_xlabel("global KL(P_μ ‖ P_π)")
    ax.set_ylabel(f"reversal rate (|c_μ| > {summary['tau']})")
    ax.legend()
    files.append(save_figure(fig, out_dir / "reversal_rate.png"))
    fig, ax = new_figure()
    groups = [k for k in summary["spearman"] if k != "all"]
    groups = ["all", *groups]
    width = 0.25
    for j, pred in enumerate(("abs_g", "pairwise_kl", "global_kl")):
        ax.bar(np.arange(len(groups)) + (j - 1) * width,
               [summary["spearman"][grp][pred] for grp in groups], width, label=pred)
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel("Spearman rho with |Δc|")
    ax.axhline(0.0, color="black", lw=0.5)
    ax.legend()
    files.append(save_figure(fig, out_dir / "spearman.png"))
    return files


def drift_report(results: dict[str, Any]) -> str:
    """The markdown report of a drift results dict (``drift_results``' return value)."""
    s = results["summary"]
    c = results["config"]
    lines = [
        ("# DSC-Gate L1: branch sensitivity explains credit drift (exact on workflow)"
         if results.get("audit") == "dsc-l1" else
         "# Credit drift audit (DSC-Gate Figs. 2-3, exact on workflow)"), "",
        f"{c['n_tasks']} workflow tasks (horizons {c['horizons']}), update kinds "
        f"{c['kinds']}, matched global-KL targets {c['kl_targets']}; {s['n_pairs']} "
        f"(update, decision state, action pair) rows; every value is exact (tabular "
        "policies, dynamic programming). Per-pair table: `pairs.parquet`.", "",
        "## Reversals", "",
        f"Relevance threshold τ = {s['tau']}: {s['n_relevant']} relevant pairs "
        f"(|c_μ| > τ), {s['reversals']} sign reversals, rate {fmt(s['reversal_rate'], 4)}. "
        "*Live* pairs are those where both actions can still succeed (Q* > 0); a pair with "
        "a dead action (e.g. skipping a required stage) has Q = 0 on that side under every "
        "policy and rarely flips. *Root*: pairs at the initial state (the three-action "
        "decision of the gate study).",
        "",
        "| kind | KL target | global KL | pairs | mean abs drift | max abs drift | relevant "
        "| reversal rate | live: relevant | live: reversal rate | root: relevant "
        "| root: reversal rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["by_update"]:
        lines.append(
            f"| {r['kind']} | {r['kl_target']} | {fmt(r['global_kl'], 3)} | {r['n_pairs']} | "
            f"{fmt(r['mean_abs_drift'], 4)} | {fmt(r['max_abs_drift'], 4)} | {r['n_relevant']} | "
            f"{fmt(r['reversal_rate'], 4)} | {r['n_relevant_live']} | "
            f"{fmt(r['reversal_rate_live'], 4)} | {r['n_relevant_root']} | "
            f"{fmt(r['reversal_rate_root'], 4)} |")
    d6 = s["d6"]
    lines += [
        "",
        f"D6 (|Δc| < |c_μ| suffices for survival) holds exactly for "
        f"{fmt(d6['exact_survival_condition_rate'], 4)} of relevant pairs. The first-order "
        f"version |G| < |c_μ| predicts survival for {d6['g_predicts_survival']} of them, "
        f"of which {d6['reversed_despite_g_survival']} reversed anyway; of the "
        f"{d6['g_flags_risk']} it flags, {d6['reversed_among_g_flagged']} reversed.",
        "",
        "## What predicts the drift", "",
        f"G is the first-order drift: mean |Δc - G| = "
        f"{fmt(s['first_order']['mean_abs_drift_minus_g'], 5)} against mean |Δc| = "
        f"{fmt(s['mean_abs_drift'], 5)}; Pearson(Δc, G) = "
        f"{fmt(s['first_order']['pearson_drift_g'], 3)}.", "",
        "Spearman rho of |Δc| with each predictor:", "",
        "| subset | abs G | pairwise KL | global KL |", "|---|---|---|---|",
    ]
    for grp, row in s["spearman"].items():
        lines.append(f"| {grp} | {fmt(row['abs_g'], 3)} | {fmt(row['pairwise_kl'], 3)} | "
                     f"{fmt(row['global_kl'], 3)} |")
    gain = s["rho_gain_g_over"]
    ci_g, ci_p = gain["global_kl"]["ci95"], gain["pairwise_kl"]["ci95"]
    paper, (plo, phi) = PAPER_L1_RHO_GAIN
    sci = s.get("spearman_ci95", {})
    if any(sci.values()):
        lines += ["", "Pooled rho with task-bootstrap 95% CIs: " + "; ".join(
            f"{name} {fmt_ci(s['spearman']['all'][name], sci[name])}"
            for name in ("abs_g", "pairwise_kl", "global_kl") if sci.get(name))]
    per = s["per_task"]
    lines += ["", f"Per task (Spearman within each of {per['n_tasks']} tasks, then the mean "
              "over tasks; the paper's Fig. 3 unit [R]), task-bootstrap 95% CIs:", "",
              "| statistic | mean over tasks | 95% CI | tasks |", "|---|---|---|---|"]
    for name, label in (("abs_g", "rho(|G|)"), ("pairwise_kl", "rho(pairwise KL)"),
                        ("global_kl", "rho(global KL)"),
                        ("gain_global_kl", "rho(|G|) - rho(global KL)"),
                        ("gain_pairwise_kl", "rho(|G|) - rho(pairwise KL)")):
        row = per[name]
        lines.append(f"| {label} | {fmt(row['value'])} | [{fmt(row['ci95'][0])}, "
                     f"{fmt(row['ci95'][1])}] | {row['n_tasks']} |")
    lines += [
        "",
        f"rho(|G|) - rho(global KL) = {fmt(gain['global_kl']['value'], 3)}"
        + (f" [{fmt(ci_g[0], 3)}, {fmt(ci_g[1], 3)}]" if ci_g else "")
        + f"; rho(|G|) - rho(pairwise KL) = {fmt(gain['pairwise_kl']['value'], 3)}"
        + (f" [{fmt(ci_p[0], 3)}, {fmt(ci_p[1], 3)}]" if ci_p else "")
        + f" (task-cluster bootstrap 95% CIs, {c['n_boot']} resamples). The paper's L1 "
        f"reports |G| beating KL by {paper} [{plo}, {phi}] (480 tasks, an LM policy).",
        "",
        "## Verdicts", "", *verdict_lines(results.get("verdicts", [])), "",
        "## Definitions [R]", "",
        "- credit c(a, b) = Q(s, a) - Q(s, b) at every recoverable decision state reachable "
        "under μ; drift Δc = c_π - c_μ.",
        "- global KL = KL(P_μ ‖ P_π) of the trajectory distributions from the initial state "
        "= E_μ[Σ_t KL(μ(·|S_t) ‖ π(·|S_t))]; pairwise KL(a, b) = the same sum over the "
        "states after a plus after b (μ's occupancy).",
        "- updates: natural-gradient direction Q_μ - V_μ (unit RMS) plus 0.5·N(0,1) noise; "
        "branch-selective ones weight each state by how selectively one non-leading root "
        "action's branch (the runner-up unless its branch has no selective state) visits "
        "it; step size matched to each KL target by bisection.",
        "",
        "Plots: " + ", ".join(f"`{f}`" for f in results["plots"]), "",
        f"Reproduce: `train.jobs.drift_study(out_dir, DriftConfig(**config))` with the config in "
        f"`results.json` ({results['seconds']:.1f} s here).",
    ]
    return "\n".join(lines) + "\n"


def drift_results(study_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Any]:
    """The drift report of a study directory (``study.json`` + ``pairs.parquet``): write
    ``results.json``, ``report.md`` and PNG plots into ``out_dir`` (default: the study
    directory); return the results dict (the content of results.json)."""
    src, out, study = open_study_of_kinds(study_dir, out_dir, DRIFT_KINDS)
    kind = str(study["study"])
    config = study["config"]
    pairs_path = study_path(src, study["pairs_path"], "pairs_path")
    summary = drift_summary(pairs_path, study_number(config, "tau"),
                            study_int(config, "n_boot"), study_int(config, "seed"))
    results: dict[str, Any] = {
        "audit": kind, "config": config, "summary": summary,
        "pairs_path": study["pairs_path"], "plots": [], "verdicts": l1_verdicts(summary),
    }
    results["plots"] = drift_plots(pq.read_table(pairs_path), summary, out)
    results["seconds"] = study["seconds"]
    return write_study_results(out, results, drift_report(results))


@register_study_report("drift")
@register_study_report("dsc-l1")
def build_drift_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``) of the drift
    study and of ``rtrees study dsc-l1`` (the same data at L1 settings)."""
    res = drift_results(study_dir, out)
    s = res["summary"]
    title = "DSC-Gate L1: branch sensitivity and drift" if res["audit"] == "dsc-l1" \
        else "Credit drift audit"
    return ReportOutput(res["audit"], out, title,
                        f"rho(|G|) = {fmt(s['spearman']['all']['abs_g'])}, reversal rate "
                        f"{fmt(s['reversal_rate'])}; "
                        + ", ".join(v["verdict"] for v in res["verdicts"]),
                        (out / "report.md",))


__all__ = ["DRIFT_KINDS", "PAPER_L1_RHO_GAIN", "build_drift_report", "drift_plots",
           "drift_report", "drift_results", "drift_summary", "l1_verdicts",
           "per_task_spearman"]
