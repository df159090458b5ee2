"""ELPO Fig. 1 report: recovery after fixing one step (``rtrees study elpo-fig1``), per
environment (workflow: exact; calc: sampled, from BEL localizations).

Reads only ``recovery.parquet`` and ``study.json`` (``train.studies.recovery`` wrote
them; the definitions of failed trajectory, first irrecoverable step, error step and
fix are in that module's docstring). Per arm (the step fixed: first irrecoverable,
first error, random error):

* the recovery rate over failed trajectories, exact (mean of Q_mu(s_{k-1}, a*)) and
  sampled (successes / continuations), with task-bootstrap 95% CIs
  (``analysis.stats.cluster_bootstrap_means``: tasks resampled, their trajectories
  with them);
* paired differences between arms on the trajectories where both are defined
  (the same bootstrap), and the paper's ordering as verdicts
  (``analysis.verdicts``): first irrecoverable > first error > random error on the
  exact rate, and first irrecoverable > the position-matched random error (a random
  error at or before t_irr), which separates localization from position;
* recovery stratified by the fixed step's position relative to t_irr (before, at,
  after; first, random and matched error arms) and by horizon.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from analysis.report import (
    BarSeries,
    ReportOutput,
    bar_plot_with_intervals,
    fmt,
    fmt_ci,
    markdown_table,
    open_study,
    plain_name,
    register_study_report,
    study_connection,
    study_int,
    study_path,
    write_study_results,
)
from analysis.stats import cluster_bootstrap_means, percentile_ci
from analysis.verdicts import verdict, verdict_lines

ARMS = ("first_irrecoverable", "first_error", "random_error", "random_step", "matched_error")
PAPER_FIG1 = {"first_irrecoverable": 0.328, "first_error": 0.236, "random_error": 0.042,
              "random_step": math.nan,  # random step: our second reading of "random error"
              "matched_error": math.nan}  # the position-matched control: not in the paper
POSITIONS = ("before", "at", "after")
"""Where a fixed step lies relative to the first irrecoverable step t_irr."""
PAPER_TEXT = "AIME25: first irrecoverable 32.8% > first error 23.6% > random error 4.2%"


def _floats(values: Any) -> np.ndarray:
    """A DuckDB numpy column as float64 with NULL (a masked entry) as NaN."""
    return np.asarray(np.ma.filled(np.ma.asarray(values, dtype=np.float64), np.nan))


def recovery_envs(path: Path) -> list[str]:
    """The environments of ``recovery.parquet`` (files without an ``env`` column: workflow)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if "env" not in table.column_names:
        return ["workflow"]
    # env names become file names (recovery_<env>.png): plain names only
    return sorted((plain_name(e, f"{path}: env") for e in pc.unique(table.column("env"))
                   .to_pylist()), reverse=True)


def _paired_means(vals: dict[str, np.ndarray], tasks: Any, n_boot: int, seed: int
                  ) -> dict[str, dict[str, Any]]:
    """{name: {value, ci95}} of each per-trajectory difference in ``vals``: its mean and
    the task-bootstrap 95% interval (NaN where a value is missing)."""
    boot = cluster_bootstrap_means(vals, np.asarray(tasks), n_boot, seed)
    return {key: {"value": float(v.mean()),
                  "ci95": percentile_ci(boot[key]) if np.isfinite(v).all()
                  else [math.nan] * 2}
            for key, v in vals.items()}


def recovery_summary(path: Path, n_boot: int, seed: int, env: str = "workflow"
                     ) -> dict[str, Any]:
    """Every number of the report for one environment's rows of ``recovery.parquet``
    (DuckDB + the task bootstrap), and ``exact``: whether those rows carry exact recovery
    values (``recovery_results`` takes the study's ``exact_envs`` record instead when it
    has one)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows = pq.read_table(path)
    if "env" in rows.column_names:  # this environment's rows (no SQL text from the file)
        rows = rows.filter(pc.equal(rows.column("env"), str(env)))
    con = study_connection({"src": rows})
    arms: dict[str, Any] = {}
    for arm in ARMS:
        cols = con.sql("""SELECT task_id, exact_recovery, successes, resamples, changed,
                                 step, first_irrecoverable
                          FROM src WHERE arm = $arm AND step IS NOT NULL
                          ORDER BY trajectory""", params={"arm": arm}).fetchnumpy()
        n = len(cols["task_id"])
        if not n:
            arms[arm] = {"n": 0, "exact": math.nan, "exact_ci95": [math.nan] * 2,
                         "sampled": math.nan, "sampled_ci95": [math.nan] * 2}
            continue
        exact = _floats(cols["exact_recovery"])
        wins = np.asarray(cols["successes"], np.float64)
        k = np.asarray(cols["resamples"], np.float64)
        boot = cluster_bootstrap_means({"exact": exact, "wins": wins, "k": k},
                                       np.asarray(cols["task_id"]), n_boot, seed)
        arms[arm] = {
            "n": n, "n_tasks": int(np.unique(np.asarray(cols["task_id"])).size),
            "exact": float(exact.mean()), "exact_ci95": percentile_ci(boot["exact"])
            if np.isfinite(exact).all() else [math.nan, math.nan],
            "sampled": float(wins.sum() / k.sum()),
            "sampled_ci95": percentile_ci(boot["wins"] / boot["k"]),
            "action_changed": float(np.mean(np.asarray(cols["changed"], bool))),
            "mean_step": float(np.mean(np.asarray(cols["step"], np.float64)))}
    paired = con.sql("""
        SELECT a.task_id, a.exact_recovery AS irr, b.exact_recovery AS err,
               c.exact_recovery AS rnd, coalesce(d.exact_recovery, c.exact_recovery) AS stp,
               a.successes / a.resamples AS s_irr, b.successes / b.resamples AS s_err,
               c.successes / c.resamples AS s_rnd,
               coalesce(d.successes / d.resamples, c.successes / c.resamples) AS s_stp,
               a.step = b.step AS same_step
        FROM src a JOIN src b USING (trajectory) JOIN src c USING (trajectory)
        LEFT JOIN src d ON d.trajectory = a.trajectory AND d.arm = 'random_step'
        WHERE a.arm = 'first_irrecoverable' AND b.arm = 'first_error'
              AND c.arm = 'random_error' AND b.step IS NOT NULL
        ORDER BY a.trajectory""").fetchnumpy()
    diffs: dict[str, Any] = {}
    n_paired = len(paired["task_id"])
    if n_paired:
        def col(name: str) -> np.ndarray:
            return _floats(paired[name])

        vals = {"irr-err": col("irr") - col("err"), "err-rnd": col("err") - col("rnd"),
                "s:irr-err": col("s_irr") - col("s_err"),
                "s:err-rnd": col("s_err") - col("s_rnd"),
                "err-stp": col("err") - col("stp"), "s:err-stp": col("s_err") - col("s_stp")}
        diffs.update(_paired_means(vals, paired["task_id"], n_boot, seed + 1))
    matched = con.sql("""
        SELECT a.task_id, a.exact_recovery AS irr, m.exact_recovery AS mat,
               a.successes / a.resamples AS s_irr, m.successes / m.resamples AS s_mat
        FROM src a JOIN src m USING (trajectory)
        WHERE a.arm = 'first_irrecoverable' AND m.arm = 'matched_error'
              AND m.step IS NOT NULL
        ORDER BY a.trajectory""").fetchnumpy()
    n_matched = len(matched["task_id"])
    if n_matched:
        vals = {"irr-mat": _floats(matched["irr"]) - _floats(matched["mat"]),
                "s:irr-mat": _floats(matched["s_irr"]) - _floats(matched["s_mat"])}
        diffs.update(_paired_means(vals, matched["task_id"], n_boot, seed + 2))
    counts = con.sql("""
        SELECT count(DISTINCT trajectory), count(DISTINCT task_id),
               count(DISTINCT trajectory) FILTER (WHERE n_errors = 0)
        FROM src""").fetchall()[0]
    same = np.asarray(paired["same_step"], bool) if n_paired else np.zeros(0, bool)
    # exact values exist where the rows carry them (workflow); calc's are all NULL
    exact = con.sql("SELECT count(exact_recovery) > 0 OR count(*) = 0 FROM src"
                    ).fetchall()[0][0]
    return {"exact": bool(exact), "arms": arms, "paired": diffs, "n_paired": n_paired,
            "n_matched": n_matched,
            "by_position": _by_position(con),
            # a file without horizons (calc-only or hand-written): no per-horizon table
            "by_horizon": _by_horizon(con) if "horizon" in rows.column_names else {},
            "n_trajectories": int(counts[0]), "n_tasks": int(counts[1]),
            "n_without_error": int(counts[2]),
            "first_error_is_first_irrecoverable": float(same.mean()) if same.size
            else math.nan}


def _cell(n: Any, exact: Any, sampled: Any) -> dict[str, Any]:
    return {"n": int(n), "exact": math.nan if exact is None else float(exact),
            "sampled": math.nan if sampled is None else float(sampled)}


def _by_position(con: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """{arm: {position: {n, exact, sampled}}} of the error arms, position = the fixed
    step before, at or after the trajectory's t_irr (mean recovery, no interval)."""
    got = con.sql("""
        SELECT arm, CASE WHEN step < first_irrecoverable THEN 'before'
                         WHEN step = first_irrecoverable THEN 'at' ELSE 'after' END AS pos,
               count(*), avg(exact_recovery), sum(successes) / sum(resamples)
        FROM src WHERE step IS NOT NULL
             AND arm IN ('first_error', 'random_error', 'matched_error')
        GROUP BY ALL""").fetchall()
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm, pos, n, exact, sampled in got:
        out.setdefault(str(arm), {})[str(pos)] = _cell(n, exact, sampled)
    return out


def _by_horizon(con: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """{horizon: {arm: {n, exact, sampled}}} (workflow rows; calc has no horizon), with
    ``errors_after_irr`` the share of trajectories whose random error lies after t_irr
    (a uniform pick per trajectory: the trajectory-weighted share of error steps)."""
    got = con.sql("""
        SELECT horizon, arm, count(*), avg(exact_recovery), sum(successes) / sum(resamples),
               avg(CASE WHEN step > first_irrecoverable THEN 1.0 ELSE 0.0 END)
        FROM src WHERE step IS NOT NULL AND horizon IS NOT NULL
        GROUP BY ALL ORDER BY horizon, arm""").fetchall()
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for horizon, arm, n, exact, sampled, after in got:
        cell = _cell(n, exact, sampled)
        if arm == "random_error":
            cell["errors_after_irr"] = float(after)
        out.setdefault(str(horizon), {})[str(arm)] = cell
    return out


RECOVERY_DELTA = 0.02
"""Equivalence margin (V1) of a difference of recovery probabilities [R]: the margin
Table 1 uses for success rates."""


def recovery_kind(summary: dict[str, Any]) -> str:
    """``exact`` for an environment whose recovery is exact (``summary["exact"]``:
    workflow), else ``sampled`` (calc)."""
    return "exact" if summary.get("exact", True) else "sampled"


def recovery_verdicts(summary: dict[str, Any], env: str = "workflow"
                      ) -> list[dict[str, Any]]:
    """The paper's ordering on the paired recovery differences: exact where the env has
    exact values (workflow), sampled where it has none (calc; ``recovery_kind``)."""
    out = []
    kind = recovery_kind(summary)
    for key, (a, b, fixed) in (
            ("irr-err", ("first irrecoverable", "first error", "the first error step")),
            ("err-rnd", ("first error", "random error", "a random error step")),
            ("irr-mat", ("first irrecoverable", "matched error",
                         "a random error step at or before t_irr (position-matched)"))):
        k = key if kind == "exact" else f"s:{key}"
        if k not in summary["paired"] and key == "irr-mat":
            continue  # a study from before the matched arm existed
        d = summary["paired"].get(k, {"value": math.nan, "ci95": [math.nan, math.nan]})
        out.append(verdict(f"Fig. 1 ({env}): fixing the {a} step recovers more than fixing "
                           f"{fixed}", f"paired {kind} recovery difference {a} - {b}",
                           d["value"], d["ci95"], 0.0, "above", PAPER_TEXT,
                           delta=RECOVERY_DELTA).to_json())
    return out


def recovery_report(results: dict[str, Any]) -> str:
    """The markdown report of ``recovery_results``' dict."""
    c = results["config"]
    lines = ["# ELPO Fig. 1: recovery after fixing one step", ""]
    for env, s in results["envs"].items():
        lines += _env_lines(env, s, c)
    lines += ["## Verdicts", "", *verdict_lines(results["verdicts"]), "",
              "## Definitions [R]", "",
              "- workflow: first irrecoverable step = the first step after which success has "
              "probability 0 under every policy (exact reachability); error step: "
              f"V*(v) - Q*(v, a) > {c['tau_err']} for the action a taken before the step, v "
              f"the {c.get('error_state', 'full')} state before it (visible: what the agent "
              "sees, hidden flags off; full: hidden flags included, so no error can follow "
              "t_irr); fix = restore the state "
              "before the step, take argmax_a Q*(s, a), continue with mu; recovered = the "
              "continuation succeeds; exact recovery = Q_mu(s, a*).",
              "- calc: first irrecoverable step = BEL's t_crit on its tau* (the tiny "
              "policy's BEL tree, N_total 16); error step = an answer whose value is not the "
              "gold answer, or a tool call whose response is not the gold value; fix = the "
              "scripted expert's action (CalcEnv.expert_action) at the step's state, then "
              "the policy; sampled only.",
              "- random step (our second reading of the paper's \"random error step\"): one "
              "of steps 1..K uniformly, error or not (no verdict).",
              "- matched error (the position-matched control, not in the paper): a random "
              "error step at or before t_irr, the window the first irrecoverable step lies "
              "in; trajectories without such an error have no matched arm.", "",
              "Plots: " + ", ".join(f"`{p}`" for p in results["plots"]), "",
              f"Reproduce: `rtrees study elpo-fig1 --out DIR` with the settings in "
              f"`results.json` ({results['seconds']:.0f} s of data generation here)."]
    return "\n".join(lines) + "\n"


def _env_lines(env: str, s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    rows = []
    for arm in ARMS:
        r = s["arms"][arm]
        rows.append([arm.replace("_", " "), r["n"], fmt_ci(r["exact"], r["exact_ci95"]),
                     fmt_ci(r["sampled"], r["sampled_ci95"]),
                     fmt(r.get("action_changed", math.nan)), fmt(r.get("mean_step", math.nan), 2),
                     f"{PAPER_FIG1[arm]:.1%}" if math.isfinite(PAPER_FIG1[arm])
                     else "(4.2%: other reading)" if arm == "random_step" else "-"])
    who = (f"failed trajectories of mu (up to {c['failures_per_task']} per task)"
           if recovery_kind(s) == "exact"
           else "BEL-localized failed trajectories (tau*, one per tree)")
    lines = [
        f"## {env}", "",
        f"{s['n_trajectories']} {who} on {s['n_tasks']} {env} tasks; {s['n_without_error']} "
        f"of them have no error step. Sampled = {c['resamples']} continuations per fix. 95% "
        f"task-bootstrap CIs ({c['n_boot']} resamples).", "",
        markdown_table(["step fixed", "trajectories", "exact recovery", "sampled recovery",
                        "action changed", "mean step", "paper (AIME25)"], rows), "",
        f"Paired over the {s['n_paired']} trajectories with an error step (differences of "
        "recovery probabilities):", ""]
    drows = [[name, fmt_ci(s["paired"][k]["value"], s["paired"][k]["ci95"]),
              fmt_ci(s["paired"]["s:" + k]["value"], s["paired"]["s:" + k]["ci95"])]
             for k, name in (("irr-err", "first irrecoverable - first error"),
                             ("err-rnd", "first error - random error"),
                             ("err-stp", "first error - random step"),
                             ("irr-mat", "first irrecoverable - matched error"))
             if k in s["paired"]]
    lines += [markdown_table(["difference", "exact", "sampled"], drows), ""]
    if s.get("by_position"):
        prow = []
        for arm, cells in s["by_position"].items():
            prow.append([arm.replace("_", " "), *(
                f"{fmt(cells[p]['exact'])} / {fmt(cells[p]['sampled'])} (n {cells[p]['n']})"
                if p in cells else "-" for p in POSITIONS)])
        lines += ["Recovery (exact / sampled) by where the fixed step lies relative to the "
                  "first irrecoverable step t_irr:", "",
                  markdown_table(["step fixed", "before t_irr", "at t_irr", "after t_irr"],
                                 prow), ""]
    if s.get("by_horizon"):
        hrow = []
        for horizon, cells in s["by_horizon"].items():
            hrow.append([horizon, *(f"{fmt(cells[a]['exact'])} (n {cells[a]['n']})"
                                    if a in cells else "-" for a in ARMS),
                         fmt(cells.get("random_error", {}).get("errors_after_irr",
                                                               math.nan))])
        lines += ["Exact recovery by horizon (and the share of random error steps after "
                  "t_irr):", "",
                  markdown_table(["horizon", *(a.replace("_", " ") for a in ARMS),
                                  "random errors after t_irr"], hrow), ""]
    lines += [f"The first error step is the first irrecoverable step on "
              f"{fmt(s['first_error_is_first_irrecoverable'])} of those trajectories.", ""]
    return lines


def recovery_results(study_dir: str | Path, out_dir: str | Path | None = None
                     ) -> dict[str, Any]:
    """The ELPO Fig. 1 report of a study directory: ``results.json``, ``report.md`` and
    ``recovery.png`` into ``out_dir`` (default: the study directory)."""
    src, out, study = open_study(study_dir, out_dir, "elpo-fig1")
    config = study["config"]
    data = study_path(src, study["recovery_path"], "recovery_path")
    n_boot, seed = study_int(config, "n_boot"), study_int(config, "seed")
    envs = {env: recovery_summary(data, n_boot, seed, env) for env in recovery_envs(data)}
    if isinstance(study.get("exact_envs"), list):  # the study's record, else the rows
        for env, summary in envs.items():
            summary["exact"] = env in study["exact_envs"]
    plots, verdicts = [], []
    for env, summary in envs.items():
        arms = summary["arms"]
        path = out / f"recovery_{env}.png"
        bar_plot_with_intervals(path, [a.replace("_", " ") for a in ARMS], [
            BarSeries("exact recovery", [arms[a]["exact"] for a in ARMS],
                      [tuple(arms[a]["exact_ci95"]) for a in ARMS], "rate"),
            BarSeries("sampled recovery", [arms[a]["sampled"] for a in ARMS],
                      [tuple(arms[a]["sampled_ci95"]) for a in ARMS], "rate"),
            BarSeries("paper (AIME25)", [PAPER_FIG1[a] for a in ARMS],
                      [(PAPER_FIG1[a], PAPER_FIG1[a]) for a in ARMS], "rate")],  # NaN: no bar
            suptitle=f"{env}: recovery after fixing one step")
        plots.append(path.name)
        verdicts += recovery_verdicts(summary, env)
    first = next(iter(envs.values()))
    results: dict[str, Any] = {
        "audit": "elpo-fig1", "config": config, "envs": envs, "summary": first,
        "verdicts": verdicts, "paper": PAPER_FIG1, "plots": plots,
        "n_sampled_trajectories": study["n_sampled_trajectories"],
        "seconds": study["seconds"]}
    return write_study_results(out, results, recovery_report(results))


@register_study_report("elpo-fig1")
def build_recovery_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``)."""
    res = recovery_results(study_dir, out)
    parts = []
    for env, summary in res["envs"].items():
        key = recovery_kind(summary)
        parts.append(f"{env} ({key}) " + " / ".join(fmt(summary["arms"][a][key])
                                                    for a in ARMS[:3]))
    return ReportOutput("elpo-fig1", out, "ELPO Fig. 1: recovery after fixing one step",
                        "; ".join(parts) + " (paper 0.328 / 0.236 / 0.042)",
                        (out / "report.md",))


__all__ = ["ARMS", "PAPER_FIG1", "POSITIONS", "build_recovery_report", "recovery_envs",
           "recovery_kind", "recovery_report", "recovery_results", "recovery_summary",
           "recovery_verdicts"]
