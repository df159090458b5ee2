"""Gate-evaluation report (DSC-Gate Table 2 / METHODS.md section 5, L4) from the gate
study's files.

The data come from ``train.studies.gates`` (per (task, update) instance: each gate's
pick, its exact regret max_a Q_pi(s0, a) - Q_pi(s0, pick), new tool steps, DSC's
decisions, in ``instances.parquet``; per route the estimates and exact values in
``routes.parquet``; the D7 calibration in ``study.json``). This module reads those
files only and reports: mean regret, P(regret > 0.02), mean new tool steps,
any-refresh rate; DSC's reuse / transport / refresh split by update kind; the
task-cluster bootstrap CI (``analysis.stats``) of the paired regret difference
DSC - X; whether the paper's finding is reproduced ("reproduces" means: the
one-sided 95% upper bound of DSC - Gap is <= ``margin`` and DSC's mean new tool
steps are <= ``step_ratio_max`` times Gap's [R]).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from analysis.report import (
    ReportOutput,
    fmt,
    new_figure,
    open_study_of_kinds,
    register_study_report,
    save_figure,
    study_connection,
    study_number,
    study_path,
    write_study_results,
)
from analysis.stats import cluster_bootstrap_means, percentile_ci
from analysis.verdicts import verdict, verdict_lines

# METHODS.md section 5, L4 results (Table 2 of the paper).
PAPER_L4: dict[str, dict[str, float]] = {
    "dsc": {"regret": 0.00673, "p_regret": 0.029, "new_steps": 286, "any_refresh": 0.389},
    "gap": {"regret": 0.00669, "p_regret": 0.030, "new_steps": 472, "any_refresh": 0.635},
    "wis": {"regret": 0.00734, "p_regret": 0.038, "new_steps": 521, "any_refresh": 0.694},
    "dr": {"regret": 0.00812, "p_regret": 0.046, "new_steps": 558, "any_refresh": 0.726},
    "reuse_only": {"regret": 0.01284, "p_regret": 0.081, "new_steps": 0, "any_refresh": 0.0},
    "transport_only": {"regret": 0.00803, "p_regret": 0.047, "new_steps": 0,
                       "any_refresh": 0.0},
}



def gate_summary(instances_path: Path, routes_path: Path, config: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """The report's numbers from ``instances.parquet`` and ``routes.parquet`` (DuckDB);
    ``config`` is the study's settings (``study.json``: regret_threshold, margin,
    step_ratio_max, n_boot, seed)."""
    # settings from study.json are bound parameters, never SQL text
    thr = {"thr": study_number(config, "regret_threshold")}
    con = study_connection({"inst": instances_path, "routes": routes_path})
    table: dict[str, dict[str, Any]] = {}
    for gate, n, regret, p_regret, steps, refresh, max_regret in con.sql("""
            SELECT gate, count(*), avg(regret), avg(CASE WHEN regret > $thr THEN 1 ELSE 0
            END), avg(steps), avg(CASE WHEN refreshed THEN 1 ELSE 0 END), max(regret)
            FROM inst GROUP BY gate""", params=thr).fetchall():
        table[gate] = {"n": n, "regret": regret, "p_regret": p_regret, "new_steps": steps,
                       "any_refresh": refresh, "max_regret": max_regret}
    by_kind = {}
    for kind, n_reuse, n_transport, n_refresh, steps, refresh, regret in con.sql("""
            SELECT kind, sum(n_reuse), sum(n_transport), sum(n_refresh), avg(steps),
                   avg(CASE WHEN refreshed THEN 1 ELSE 0 END), avg(regret)
            FROM inst WHERE gate = 'dsc' GROUP BY kind ORDER BY kind""").fetchall():
        total = n_reuse + n_transport + n_refresh
        by_kind[kind] = {"reuse": n_reuse / total if total else math.nan,
                         "transport": n_transport / total if total else math.nan,
                         "refresh": n_refresh / total if total else math.nan,
                         "new_steps": steps, "any_refresh": refresh, "regret": regret}
    near_tie: dict[str, dict[str, Any]] = {}
    for gate, tie, n, steps, refresh, regret in con.sql("""
            SELECT gate, top2_gap < $thr AS tie, count(*), avg(steps),
                   avg(CASE WHEN refreshed THEN 1 ELSE 0 END), avg(regret)
            FROM inst GROUP BY gate, tie ORDER BY gate, tie""", params=thr).fetchall():
        near_tie.setdefault(gate, {})["near_tie" if tie else "clear"] = {
            "n": n, "new_steps": steps, "any_refresh": refresh, "regret": regret}
    mse = {}
    for est in ("reuse", "transport", "wis", "dr"):
        rows = con.sql(f"""SELECT avg(({est}_mean - q_pi) ^ 2) FROM routes
                           WHERE q_pi > 0 OR q_mu > 0""").fetchall()  # est: a constant
        mse[est] = rows[0][0]
    cols = con.sql("SELECT task_id, update, gate, regret, steps FROM inst "
                   "ORDER BY gate, task_id, update").fetchnumpy()
    gate_col = np.asarray(cols["gate"])
    regret = {g: np.asarray(cols["regret"])[gate_col == g] for g in table}
    steps = {g: np.asarray(cols["steps"])[gate_col == g].astype(np.float64) for g in table}
    clusters = np.asarray(cols["task_id"])[gate_col == "dsc"]
    values = {f"regret:{g}": regret[g] for g in table}
    for g in table:
        if g != "dsc":
            values[f"diff:{g}"] = regret["dsc"] - regret[g]
    boot = cluster_bootstrap_means(values, clusters, config["n_boot"], config["seed"])
    for g in table:
        table[g]["regret_ci95"] = percentile_ci(boot[f"regret:{g}"])
    diffs: dict[str, dict[str, Any]] = {}
    for g in table:
        if g == "dsc":
            continue
        b = boot[f"diff:{g}"]
        diffs[g] = {"value": float(values[f"diff:{g}"].mean()), "ci95": percentile_ci(b),
                    "upper95_one_sided": float(np.percentile(b, 95.0)),
                    "lower95_one_sided": float(np.percentile(b, 5.0))}
    step_ratios = {g: (float(steps["dsc"].mean() / steps[g].mean()) if steps[g].mean() > 0
                       else math.nan) for g in ("gap", "wis", "dr") if g in table}
    upper = diffs["gap"]["upper95_one_sided"]
    ratio = step_ratios.get("gap", math.nan)
    margin, ratio_max = config["margin"], config["step_ratio_max"]
    regret_ok = upper <= margin
    steps_ok = math.isfinite(ratio) and ratio <= ratio_max
    reproduced = bool(regret_ok and steps_ok)
    statement = (
        f"DSC vs Gap: regret difference {fmt(diffs['gap']['value'], 5)} (one-sided 95% "
        f"upper bound {fmt(upper, 5)}; margin {margin}) -> "
        f"{'within' if regret_ok else 'NOT within'} the margin; new tool steps ratio "
        f"DSC/Gap = {fmt(ratio, 3)} (threshold {ratio_max}) -> "
        f"{'markedly fewer' if steps_ok else 'NOT markedly fewer'}. The paper's finding "
        f"(DSC keeps regret within a small margin of Gap with markedly fewer new tool "
        f"steps) is {'REPRODUCED' if reproduced else 'NOT reproduced'} in this run.")
    return {"table": table, "dsc_by_kind": by_kind, "by_near_tie": near_tie, "route_mse": mse,
            "regret_diff_dsc_minus": diffs, "step_ratio_dsc_over": step_ratios,
            "finding": {"reproduced": reproduced, "regret_within_margin": regret_ok,
                        "markedly_fewer_steps": steps_ok, "margin": margin,
                        "paper_margin": 0.0005, "step_ratio_max": ratio_max,
                        "paper_step_ratio_vs_gap": 0.606, "statement": statement}}


GATE_KINDS = ("gates", "dsc-table2")  # study.json kinds this module reports
KAPPA_SCALES = (0.5, 0.75, 1.0, 1.5)  # the radius-sensitivity rows of the diagnostics


def _pair_sign(decision: np.ndarray, c_R: np.ndarray, c_T: np.ndarray) -> np.ndarray:
    """+1 / -1: the order a resolved pair's decision keeps (reuse: sign c_R, transport:
    sign c_T); 0 for refresh."""
    return np.where(decision == "reuse", np.sign(c_R),
                    np.where(decision == "transport", np.sign(c_T), 0.0))


def table2_analysis(instances_path: Path, pairs_path: Path, config: Mapping[str, Any]
                    ) -> dict[str, Any]:
    """Table 2 additions (``rtrees study dsc-table2``): paired task-bootstrap intervals of
    DSC - Gap new steps and of the branch-selective minus ordinary refresh share, results
    by task class (competing / serial), and where DSC spends its steps (its pairs by
    near tie |c_pi| < regret threshold, the radii, and the decisions the same estimates
    would give with every radius scaled by s, ``KAPPA_SCALES``, counted against the exact
    sign of c_pi: a sensitivity read-out, nothing is tuned on it)."""
    from train.credit.dsc_gate import gate_decision

    thr = study_number(config, "regret_threshold")  # bound parameters, never SQL text
    cap = study_number(config, "cap_steps")
    con = study_connection({"inst": instances_path, "pairs": pairs_path})
    cols = con.sql("SELECT task_id, update, gate, regret, steps FROM inst "
                   "ORDER BY gate, task_id, update").fetchnumpy()
    gate_col = np.asarray(cols["gate"])
    steps = {g: np.asarray(cols["steps"])[gate_col == g].astype(np.float64)
             for g in np.unique(gate_col)}
    clusters = np.asarray(cols["task_id"])[gate_col == "dsc"]
    values = {f"steps:{g}": v for g, v in steps.items()}
    values.update({f"steps_diff:{g}": steps["dsc"] - steps[g] for g in ("gap", "wis", "dr")
                   if g in steps})
    boot = cluster_bootstrap_means(values, clusters, config["n_boot"], config["seed"])
    steps_diff = {g: {"value": float(values[f"steps_diff:{g}"].mean()),
                      "ci95": percentile_ci(boot[f"steps_diff:{g}"])}
                  for g in ("gap", "wis", "dr") if f"steps_diff:{g}" in values}
    ratio_boot = boot["steps:dsc"] / np.where(boot["steps:gap"] > 0, boot["steps:gap"],
                                              np.nan) if "steps:gap" in boot else None
    ratio = {"value": float(steps["dsc"].mean() / steps["gap"].mean())
             if "gap" in steps and steps["gap"].mean() > 0 else math.nan,
             "ci95": percentile_ci(ratio_boot) if ratio_boot is not None else [math.nan] * 2}
    by_class: dict[str, dict[str, Any]] = {}
    for gate, cls, n, regret, p_regret, mean_steps, refresh in con.sql("""
            SELECT gate, task_class, count(*), avg(regret),
                   avg(CASE WHEN regret > $thr THEN 1 ELSE 0 END), avg(steps),
                   avg(CASE WHEN refreshed THEN 1 ELSE 0 END)
            FROM inst GROUP BY gate, task_class ORDER BY gate, task_class""",
            params={"thr": thr}).fetchall():
        by_class.setdefault(gate, {})[cls] = {"n": n, "regret": regret, "p_regret": p_regret,
                                              "new_steps": mean_steps, "any_refresh": refresh}
    capped = {}
    for gate, share, step_share in con.sql("""
            SELECT gate, avg(CASE WHEN steps >= $near_cap THEN 1 ELSE 0 END),
                   sum(CASE WHEN steps >= $near_cap THEN steps ELSE 0 END)
                       / nullif(sum(steps), 0)
            FROM inst GROUP BY gate ORDER BY gate""",
            params={"near_cap": 0.95 * cap}).fetchall():
        capped[gate] = {"instances": share, "steps": step_share}
    pairs = con.sql("SELECT * FROM pairs").fetchnumpy()
    pt = {k: np.asarray(v) for k, v in pairs.items()}
    out: dict[str, Any] = {"steps_diff_dsc_minus": steps_diff, "step_ratio_dsc_over_gap": ratio,
                           "by_task_class": by_class, "capped": capped,
                           "n_pairs": int(pt["decision"].size)
                           if "decision" in pt else 0}
    if not out["n_pairs"]:
        return out
    bs = (pt["kind"] == "branch_selective").astype(np.float64)
    od = (pt["kind"] == "ordinary").astype(np.float64)
    ref = (pt["decision"] == "refresh").astype(np.float64)
    if bs.any() and od.any():  # the synthetic updates (the LM variant has neither kind)
        sb = cluster_bootstrap_means({"bs": bs, "od": od, "ref_bs": ref * bs,
                                      "ref_od": ref * od},
                                     pt["task_id"], config["n_boot"], config["seed"] + 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            share_diff = sb["ref_bs"] / sb["bs"] - sb["ref_od"] / sb["od"]
        point = float((ref * bs).sum() / bs.sum()) - float((ref * od).sum() / od.sum())
        out["refresh_share_bs_minus_ordinary"] = {"value": point,
                                                  "ci95": percentile_ci(share_diff)}
    near = np.abs(pt["c_pi"]) < thr
    diag: dict[str, Any] = {}
    for name, m in (("near_tie", near), ("clear", ~near)):
        d = pt["decision"][m]
        diag[name] = {"n": int(m.sum()), **{k: float(np.mean(d == k)) if d.size else math.nan
                                           for k in ("reuse", "transport", "refresh")}}
    refresh = pt["decision"] == "refresh"
    diag["refresh_pairs_near_tie_share"] = float(np.mean(near[refresh])) if refresh.any() \
        else math.nan
    diag["median"] = {k: float(np.median(np.abs(pt[k]))) for k in (
        "c_R", "delta", "c_T", "r_R", "r_delta", "r_T")}
    sweep = []
    for scale in KAPPA_SCALES:
        dec = gate_decision(pt["c_R"], pt["delta"], pt["c_T"], scale * pt["r_R"],
                            scale * pt["r_delta"], scale * pt["r_T"])
        sign = _pair_sign(dec, pt["c_R"], pt["c_T"])
        resolved = dec != "refresh"
        wrong = resolved & (np.sign(pt["c_pi"]) != 0) & (sign != np.sign(pt["c_pi"]))
        wrong_relevant = wrong & ~near
        sweep.append({"scale": scale, **{k: float(np.mean(dec == k))
                                         for k in ("reuse", "transport", "refresh")},
                      "wrong_sign_rate_resolved": float(wrong.sum() / resolved.sum())
                      if resolved.any() else math.nan,
                      "wrong_sign_relevant": int(wrong_relevant.sum())})
    diag["radius_scale_sweep"] = sweep
    out["dsc_pairs"] = diag
    return out


SHARE_DELTA = 0.05
"""Equivalence margin (V1) of a difference in refresh share [R]: 5 points, a seventh of
the paper's +34.1. The regret claim is a non-inferiority bound (its margin is the
threshold), and the step and reuse-only claims register no margin: they are judged
superior, inferior or underpowered."""


def table2_verdicts(summary: Mapping[str, Any], extra: Mapping[str, Any],
                    config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Table 2 claims as verdicts (``analysis.verdicts``)."""
    out = []
    gap = summary["regret_diff_dsc_minus"].get("gap")
    margin = float(config["margin"])
    if gap is not None:
        out.append(verdict(
            f"Table 2: DSC's regret is non-inferior to Gap's (margin {margin})",
            "regret DSC - Gap, one-sided 95% bounds", gap["value"],
            [gap.get("lower95_one_sided", math.nan), gap["upper95_one_sided"]], margin,
            "below", "DSC 0.00673 vs Gap 0.00669 (+0.00004), non-inferior at 0.0005",
            level=0.90).to_json())  # two one-sided 95% bounds: a 90% interval
    steps = extra["steps_diff_dsc_minus"].get("gap")
    if steps is not None:
        ratio = extra["step_ratio_dsc_over_gap"]
        out.append(verdict(
            "Table 2: DSC spends fewer new tool steps than Gap", "new steps DSC - Gap",
            steps["value"], steps["ci95"], 0.0, "below", "286 vs 472 (ratio 0.606)",
            note=f"ratio DSC/Gap {fmt(ratio['value'])} [{fmt(ratio['ci95'][0])}, "
                 f"{fmt(ratio['ci95'][1])}]").to_json())
    reuse = summary["regret_diff_dsc_minus"].get("reuse_only")
    if reuse is not None:
        out.append(verdict(
            "Table 2: DSC has lower regret than reuse-only", "regret DSC - reuse-only",
            reuse["value"], reuse["ci95"], 0.0, "below", "0.00673 vs 0.01284").to_json())
    share = extra.get("refresh_share_bs_minus_ordinary")
    if share is not None:
        out.append(verdict(
            "Table 2: DSC refreshes more pairs after branch-selective than after ordinary "
            "updates", "refresh share branch-selective - ordinary", share["value"],
            share["ci95"], 0.0, "above", "55.9% vs 21.8% (+34.1 points)",
            delta=SHARE_DELTA).to_json())
    return out


def gate_plots(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Regret with CIs, new steps, and regret vs steps per gate; the file names."""
    table = results["table"]
    gates = [g for g in results["gates"] if g in table]
    files = []
    fig, ax = new_figure(7.0, 4.0)
    means = [table[g]["regret"] for g in gates]
    lo = [table[g]["regret"] - table[g]["regret_ci95"][0] for g in gates]
    hi = [table[g]["regret_ci95"][1] - table[g]["regret"] for g in gates]
    ax.bar(gates, means, yerr=[lo, hi], capsize=3)
    ax.set_ylabel("mean regret (exact), 95% task-bootstrap CI")
    ax.tick_params(axis="x", rotation=30)
    files.append(save_figure(fig, out_dir / "regret.png"))
    fig, ax = new_figure(7.0, 4.0)
    ax.bar(gates, [table[g]["new_steps"] for g in gates])
    ax.set_ylabel("mean new tool steps per instance")
    ax.tick_params(axis="x", rotation=30)
    files.append(save_figure(fig, out_dir / "new_steps.png"))
    fig, ax = new_figure()
    for g in gates:
        ax.scatter(table[g]["new_steps"], table[g]["regret"])
        ax.annotate(g, (table[g]["new_steps"], table[g]["regret"]), fontsize=8)
    ax.set_xlabel("mean new tool steps")
    ax.set_ylabel("mean regret")
    files.append(save_figure(fig, out_dir / "regret_vs_steps.png"))
    return files


def lm_check_summary(check_path: Path) -> dict[str, dict[str, Any]]:
    """Per model of the real-update variant (LM3, ``lm_check.parquet``): routes checked,
    mean and max |Q_exact - Q_MC|, the share within 2 standard errors, and the mean
    Q_exact - Q_MC over live routes (Q_MC > 0 or Q_exact > 0), also per root tool
    (``by_route``: a reading biased for one tool and against another shifts the root
    decision itself)."""
    con = study_connection({"chk": check_path})
    out: dict[str, dict[str, Any]] = {}
    for model, route, n, mae, worst, within, bias in con.sql("""
            SELECT model, route, count(*), avg(abs(q_exact - q_mc)), max(abs(q_exact - q_mc)),
                   avg(CASE WHEN abs(q_exact - q_mc) <= 2 * se + 1e-12 THEN 1 ELSE 0 END),
                   avg(q_exact - q_mc)
            FROM chk WHERE q_exact > 0 OR q_mc > 0
            GROUP BY GROUPING SETS ((model), (model, route))
            ORDER BY model, route NULLS FIRST""").fetchall():
        row = {"routes": n, "mean_abs": mae, "max_abs": worst, "within_2se": within,
               "mean_diff": bias}
        if route is None:
            out[model] = {**row, "by_route": {}}
        else:
            out[model]["by_route"][route] = row
    return out


def _updates_line(results: Mapping[str, Any]) -> str:
    """What the updates were: the synthetic kinds and KL targets, or the LM checkpoints."""
    c = results["config"]
    if c.get("lm_mu"):
        kl = results.get("mean_kl", {})
        models = ", ".join(f"{label} = `{spec}` (mean global KL from mu {fmt(kl.get(label))})"
                           for label, spec in zip(results.get("update_labels", []),
                                                  c["lm_pi"], strict=False))
        return (f"{results['n_eval_tasks']} evaluation tasks x {len(c['lm_pi'])} real updates "
                f"(mu = the language model `{c['lm_mu']}`; {models}; each model read as an "
                "observable-state policy, docs/METHODS.md 8.3, LM1-LM3) = ")
    return (f"{results['n_eval_tasks']} evaluation tasks x "
            f"{len(c['kinds']) * len(c['kl_targets'])} updates ({', '.join(c['kinds'])}; "
            f"matched global KL {c['kl_targets']}) = ")


def _lm_check_lines(results: Mapping[str, Any]) -> list[str]:
    chk = results.get("lm_check")
    if not chk:
        return []
    c = results["config"]
    lines = ["", "## The models' readings against the real models (LM3)", "",
             f"Exact Q_model(s0, a) of each reading against Monte Carlo of the real model "
             f"(full transcripts, {c['lm_check_k']} rollouts per root tool and outcome) on "
             f"{c['lm_check_tasks']} evaluation tasks; live routes only:", "",
             "| model (root tool) | routes | mean abs diff | max abs diff | within 2 SE "
             "| mean exact - MC |",
             "|---|---|---|---|---|---|"]
    for model, r in chk.items():
        for name, row in (("all", r), *r.get("by_route", {}).items()):
            lines.append(f"| {model} ({name}) | {row['routes']} | {fmt(row['mean_abs'], 4)} | "
                         f"{fmt(row['max_abs'], 4)} | {row['within_2se']:.0%} | "
                         f"{fmt(row['mean_diff'], 4)} |")
    return lines


def gate_report(results: dict[str, Any]) -> str:
    """The markdown report of a gate results dict (``gate_results``'s return value)."""
    c = results["config"]
    table = results["table"]
    cal = results["calibration"]
    lines = [
        ("# DSC-Gate Table 2 (L4 design on workflow, exact regret)"
         if results.get("audit") == "dsc-table2" else
         "# Gate evaluation (DSC-Gate Table 2, exact regret on workflow)"), "",
        _updates_line(results) +
        f"{results['n_instances']} instances; {c['n_old']} old trajectories per root action "
        f"from mu; calibration on {c['n_dev']} dev + {c['n_calib']} calib tasks; refresh "
        f"cap {c['cap_steps']} new tool steps, kappa_e = {c['kappa_e']}. Regret = max_a "
        "Q_pi(s0, a) - Q_pi(s0, pick), exact. Per-instance rows: `instances.parquet`; old "
        f"and refresh trajectories: the store `{results['store']}` (run `{results['run_id']}`)."
        , "",
        "## Result", "", results["finding"]["statement"], "",
        "| gate | regret [95% CI] | P(regret > 0.02) | new steps | any refresh "
        "| paper: regret | paper: P | paper: steps | paper: any refresh |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in results["gates"]:
        if g not in table:
            continue
        r = table[g]
        p = PAPER_L4.get(g)
        paper = (f"{p['regret']} | {p['p_regret']:.1%} | {p['new_steps']:.0f} | "
                 f"{p['any_refresh']:.1%}") if p else "- | - | - | -"
        lines.append(
            f"| {g} | {fmt(r['regret'], 5)} [{fmt(r['regret_ci95'][0], 5)}, "
            f"{fmt(r['regret_ci95'][1], 5)}] | {r['p_regret']:.1%} | {r['new_steps']:.0f} | "
            f"{r['any_refresh']:.1%} | {paper} |")
    lines += ["", "Paired regret differences DSC - X (task-cluster bootstrap, "
              f"{c['n_boot']} resamples):", "", "| X | difference | 95% CI |", "|---|---|---|"]
    for g, d in results["regret_diff_dsc_minus"].items():
        lines.append(f"| {g} | {fmt(d['value'], 5)} | [{fmt(d['ci95'][0], 5)}, "
                     f"{fmt(d['ci95'][1], 5)}] |")
    ratios = results["step_ratio_dsc_over"]
    lines += ["", "DSC's new-step ratios: " + ", ".join(
        f"{fmt(v, 3)} vs {g}" for g, v in ratios.items())
        + " (paper: 0.606 vs Gap, 0.549 vs WIS, 0.513 vs DR).", "",
        "## How DSC resolved pairs", "",
        "| update kind | reuse | transport | refresh | mean new steps | any refresh "
        "| regret |", "|---|---|---|---|---|---|---|"]
    for kind, r in results["dsc_by_kind"].items():
        lines.append(f"| {kind} | {r['reuse']:.1%} | {r['transport']:.1%} | "
                     f"{r['refresh']:.1%} | {r['new_steps']:.0f} | {r['any_refresh']:.1%} | "
                     f"{fmt(r['regret'], 5)} |")
    lines += ["", "(paper: ordinary 55.4% / 22.8% / 21.8%, 151 steps; branch-selective "
              "31.8% / 12.3% / 55.9%, 421 steps)", "",
              "## Near ties", "",
              f"Instances whose best two root actions are within {c['regret_threshold']} "
              "under pi (exact) are *near ties*: the refresh protocol can rarely resolve them "
              "within the cap, so refreshing gates tend to spend the cap there while the "
              "regret at stake is below the threshold.", "",
              "| gate | near ties: n | steps | any refresh | regret | clear: n | steps "
              "| any refresh | regret |", "|---|---|---|---|---|---|---|---|---|"]
    for g in results["gates"]:
        parts = results["by_near_tie"].get(g, {})
        cells = []
        for part in ("near_tie", "clear"):
            r = parts.get(part)
            cells.append(f"{r['n']} | {r['new_steps']:.0f} | {r['any_refresh']:.1%} | "
                         f"{fmt(r['regret'], 5)}" if r else "0 | - | - | -")
        lines.append(f"| {g} | {cells[0]} | {cells[1]} |")
    if "table2" in results:
        lines += _table2_lines(results)
    lines += _lm_check_lines(results)
    lines += ["",
              "## Estimators of Q_pi(s0, a) from the old data (MSE over evaluation routes, "
              "dead routes excluded)", "",
              "| reuse | transport | WIS | DR |", "|---|---|---|---|",
              "| " + " | ".join(fmt(results["route_mse"][k], 6)
                               for k in ("reuse", "transport", "wis", "dr")) + " |", "",
              "## D7 calibration", "",
              "| radius | residual variance (dev) | kappa (calib) | note |", "|---|---|---|---|"]
    for n in ("R", "delta", "T"):
        r = cal[n]
        note = ("too few calib tasks for the level: max used" if r["kappa_fallback_to_max"]
                else f"order statistic at level {c['level']}")
        lines.append(f"| {n} | {fmt(r['residual_var'], 6)} | {fmt(r['kappa'], 3)} | {note} |")
    lines += [
        "", "## Choices [R]", "",
        "- WIS prior: self-normalized ΣWR/ΣW, W = product of π/μ over the downstream steps "
        "(forced root action excluded); variance by the delta method, floored at 1/(4N²).",
        "- DR prior: sequential doubly robust (D_t = v̂_π(S_t) + rho_t(D_{t+1} - q̂(S_t, A_t)))"
        " with q̂ the old mean return after (state, action), cross-fitted on the opposite "
        "fold.",
        "- DSC refresh prior: the transported mean and its variance; Gap: reuse mean.",
        f"- kappa_e = {c['kappa_e']}; refresh rounds of {c['refresh_batch']} trajectories "
        "by largest remainder; common random numbers across gates.",
        f"- Reproduction criterion: one-sided 95% upper bound of DSC - Gap regret <= "
        f"{c['margin']} and DSC/Gap new steps <= {c['step_ratio_max']}.",
        ("- μ and π: the language models read per observable state on canonical "
         "histories (`train.studies.lm_tables`, docs/METHODS.md 8.3, LM1-LM3)."
         if c.get("lm_mu") else
         f"- μ: softmax of {c['mu_beta']}·Q* plus {c['mu_noise']}·N(0, 1) logit noise; "
         "updates: see `train.studies.drift` and "
         "`train.studies.workflow_study.update_direction`."),
        "", "Plots: " + ", ".join(f"`{f}`" for f in results["plots"]), "",
        f"Reproduce: `train.jobs.gate_study(out_dir, GateStudyConfig(**config))` with the "
        "config in "
        f"`results.json` ({results['seconds']['total']:.1f} s here).",
    ]
    return "\n".join(lines) + "\n"


def _table2_lines(results: dict[str, Any]) -> list[str]:
    """The report's Table 2 sections (``table2_analysis``) and the verdicts."""
    t2 = results["table2"]
    thr = results["config"]["regret_threshold"]
    lines = ["", "## Table 2: paired intervals, task classes, where DSC spends its steps", "",
             "The Result line above is the gate study's combined criterion (regret within the "
             "margin AND steps ratio <= step_ratio_max); the verdicts below judge each of the "
             "paper's claims on its own paired interval (``analysis.verdicts``).", ""]
    sd = t2["steps_diff_dsc_minus"]
    ratio = t2["step_ratio_dsc_over_gap"]
    lines += ["Paired new-step differences DSC - X (task bootstrap): " + "; ".join(
        f"{g} {fmt(d['value'], 1)} [{fmt(d['ci95'][0], 1)}, {fmt(d['ci95'][1], 1)}]"
        for g, d in sd.items())
        + f". Ratio DSC/Gap {fmt(ratio['value'])} [{fmt(ratio['ci95'][0])}, "
          f"{fmt(ratio['ci95'][1])}] (paper 0.606).", ""]
    share = t2.get("refresh_share_bs_minus_ordinary")
    if share:
        lines += [f"DSC's refresh share, branch-selective minus ordinary: "
                  f"{fmt(share['value'])} [{fmt(share['ci95'][0])}, {fmt(share['ci95'][1])}] "
                  "(paper: 0.559 - 0.218 = 0.341).", ""]
    lines += ["By task class (competing: mu's two best root actions within "
              f"{results['config'].get('competing_gap', 'n/a')} in Q_mu; serial: the rest; "
              "the paper's L4 test set is 270 competing + 90 serial):", "",
              "| gate | class | instances | regret | P(regret > thr) | new steps | any refresh |",
              "|---|---|---|---|---|---|---|"]
    for gate, parts in t2["by_task_class"].items():
        for cls, r in parts.items():
            lines.append(f"| {gate} | {cls} | {r['n']} | {fmt(r['regret'], 5)} | "
                         f"{r['p_regret']:.1%} | {r['new_steps']:.0f} | {r['any_refresh']:.1%} |")
    cap = t2.get("capped", {})
    if cap:
        lines += ["", f"Instances that reach the refresh cap (>= 95% of "
                  f"{results['config']['cap_steps']} new steps) and their share of each "
                  "gate's new steps: " + "; ".join(
                      f"{g} {fmt(r['instances'])} / {fmt(r['steps'])}" for g, r in cap.items()
                      if g in ("dsc", "gap", "wis", "dr")) + "."]
    diag = t2.get("dsc_pairs")
    if diag:
        med = diag["median"]
        lines += ["", f"DSC's {t2['n_pairs']} leader-vs-competitor pairs (evaluation "
                  f"instances). Near ties (exact |c_pi| < {thr}) vs clear pairs:", "",
                  "| pairs | n | reuse | transport | refresh |", "|---|---|---|---|---|"]
        for name in ("near_tie", "clear"):
            r = diag[name]
            lines.append(f"| {name} | {r['n']} | {fmt(r['reuse'])} | {fmt(r['transport'])} | "
                         f"{fmt(r['refresh'])} |")
        lines += ["", f"Share of refreshed pairs that are near ties: "
                  f"{fmt(diag['refresh_pairs_near_tie_share'])}. Median |c_R| "
                  f"{fmt(med['c_R'], 4)}, |delta| {fmt(med['delta'], 4)}, |c_T| "
                  f"{fmt(med['c_T'], 4)}; radii r_R {fmt(med['r_R'], 4)}, r_delta "
                  f"{fmt(med['r_delta'], 4)}, r_T {fmt(med['r_T'], 4)}.", "",
                  "Radius sensitivity (the same estimates, every radius times s; read-out "
                  "only, nothing is tuned on the evaluation split): decision shares and "
                  "wrong-sign rate among resolved pairs against the exact c_pi:", "",
                  "| s | reuse | transport | refresh | wrong sign (resolved) "
                  "| wrong sign, clear pairs |", "|---|---|---|---|---|---|"]
        for r in diag["radius_scale_sweep"]:
            lines.append(f"| {r['scale']} | {fmt(r['reuse'])} | {fmt(r['transport'])} | "
                         f"{fmt(r['refresh'])} | {fmt(r['wrong_sign_rate_resolved'])} | "
                         f"{r['wrong_sign_relevant']} |")
    lines += ["", "## Verdicts", "", *verdict_lines(results.get("verdicts", []))]
    return lines


def gate_results(study_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Any]:
    """The gate report of a study directory (``study.json``, ``instances.parquet``,
    ``routes.parquet``): write ``results.json``, ``report.md`` and PNG plots into
    ``out_dir`` (default: the study directory); return the results dict."""
    src, out, study = open_study_of_kinds(study_dir, out_dir, GATE_KINDS)
    kind = str(study["study"])
    instances = study_path(src, study["instances_path"], "instances_path")
    summary = gate_summary(instances, study_path(src, study["routes_path"], "routes_path"),
                           study["config"])
    results: dict[str, Any] = {
        "audit": kind, **{k: v for k, v in study.items() if k != "study"},
        **summary, "paper_l4": PAPER_L4}
    if study.get("pairs_path"):
        extra = table2_analysis(instances, study_path(src, study["pairs_path"], "pairs_path"),
                                study["config"])
        results["table2"] = extra
        results["verdicts"] = table2_verdicts(summary, extra, study["config"])
    if study.get("lm_check_path"):
        results["lm_check"] = lm_check_summary(study_path(src, study["lm_check_path"],
                                                          "lm_check_path"))
    results["plots"] = gate_plots(results, out)
    return write_study_results(out, results, gate_report(results))


@register_study_report("gates")
@register_study_report("dsc-table2")
def build_gate_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``) of the gate
    study and of ``rtrees study dsc-table2``."""
    res = gate_results(study_dir, out)
    title = "DSC-Gate Table 2" if res["audit"] == "dsc-table2" else "Gate evaluation"
    return ReportOutput(res["audit"], out, title, res["finding"]["statement"],
                        (out / "report.md",))


__all__ = ["GATE_KINDS", "KAPPA_SCALES", "PAPER_L4", "build_gate_report", "gate_plots",
           "gate_report", "gate_results", "gate_summary", "lm_check_summary", "table2_analysis",
           "table2_verdicts"]
