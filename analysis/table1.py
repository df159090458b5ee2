"""Table 1 in miniature, the report (``rtrees study table1``).

Reads only the study's files (``train.studies.table1`` wrote them): ``study.json`` (the
configs, seeds and each run's status) and, per finished run, the ``metrics`` table of its
store (``runs/<slug>-s<seed>/store``), where the trainer commits one row per (iteration,
metric). Metric steps are iterations ``it`` (0-based; ``-1`` holds the evaluation of the
starting weights), so held-out success after ``i`` iterations is the row at step
``i - 1``.

Per config, over its seeds s = 1..S:

* final held-out success (sampled, temperature 1, one rollout per held-out task; and
  greedy) after the study's ``steps`` iterations: mean and sample std over seeds;
* tool steps spent: the sum over iterations of ``new_tool_steps`` (every tool call of the
  fresh trees), and rollouts = steps x tasks_per_step x n_total (equal by construction);
* learning curves: held-out sampled success against iteration and against cumulative
  tool steps (``table1_curves.png``).

**Intervals and verdicts** (``analysis.verdicts``, docs/METHODS.md V1-V5). Each run's
evaluation commits its per-task outcomes to the ``evaluations`` table (schema 3); arms
share training seeds, the held-out split and the evaluation seeds (the trainer seeds an
evaluation by its step alone), so each claim "A > B" is judged on the paired
differences d[s, t] of final held-out sampled success (seed x task two-way variance, the
evaluation noise counted once), at the Bonferroni level 1 - 0.10 / K of the study's K
claims, with the pre-registered equivalence margin ``delta`` of the study's config and
the minimum detectable effect beside it. Runs without per-task rows (stores older than
schema 3) pair their per-seed rates instead. A config's own interval is the t interval of
its seeds' final rates. Greedy success is differenced the same way and printed beside
(sharpening alone raises sampled success). The paper's numbers (other models, benchmarks
and scales) are printed beside ours, not compared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from analysis.report import (
    ReportOutput,
    fmt,
    fmt_ci,
    markdown_table,
    open_study,
    register_study_report,
    save_figure,
    study_path,
    write_study_results,
)
from analysis.verdicts import (
    Difference,
    family_level,
    paired_difference,
    verdict,
    verdict_counts,
    verdict_lines,
)

KIND = "table1"
PAPER_TABLE = ("ELPO's Table 1 (paper 001, 'Learning from the Irrecoverable'): RL methods "
               "compared by held-out accuracy at the same per-input rollout budget "
               "N_total = 16, every branch expansion counted as one rollout; the TRACE, "
               "CALIPER and SLCA-GRPO rows come from those papers' main comparisons "
               "(docs/METHODS.md). `grep -l 'Table 1' papers/*.txt` finds only the DSC-Gate "
               "paper (004), whose Table 1 compares gate decisions, not training methods; "
               "ELPO's text writes 'Table 1' with a no-break space")
# (claim, A, B, paper): "A > B" in final held-out sampled success.
CLAIMS: tuple[tuple[str, str, str, str], ...] = (
    ("ELPO Table 1: ELPO beats GRPO", "elpo+bel", "grpo+group",
     "Qwen2.5-7B average ELPO 60.7 vs GRPO 51.2"),
    ("ELPO Table 1: ELPO beats tree-rollout baselines", "elpo+bel", "tree_grpo+random",
     "ELPO above the agentic tree-rollout rows (ARPO, AEPO; Tree-GRPO-style random "
     "branching is ELPO w/o BEL's construction); average 60.7 vs DemyAgent 59.4"),
    ("TRACE Table 1: TRACE beats GRPO", "trace+group", "grpo+group",
     "Qwen3-4B average TRACE 34.0 vs GRPO 29.5"),
    ("CALIPER: CALIPER beats GRPO", "caliper+caliper", "grpo+group",
     "'overall outperforms GRPO' (abstract; no numbers recovered)"),
    ("SLCA-GRPO: SLCA beats GRPO on SGLS", "slca+group (sgls)", "grpo+group (sgls)",
     "7B: +2.53 points in-domain over GRPO"),
    ("FACTOR: FACTOR beats GRPO", "factor+group", "grpo+group",
     "TD action credit with hindsight token allocation beats trajectory-level GRPO "
     "(abstract; docs/METHODS.md section 10)"),
    ("SGCD: SGCD beats GRPO", "sgcd+group", "grpo+group",
     "sibling-guided credit distillation beats GRPO (abstract; docs/METHODS.md "
     "section 11)"),
    ("FACTOR F6: the action-mean loss beats token-mean", "factor+group",
     "factor+group (tm)", "the action-mean reduction removes the dependence of an "
     "action's surrogate weight on its token length (abstract; docs/METHODS.md F6)"),
    ("FACTOR F5: hindsight token weights beat uniform ones", "factor+group",
     "factor+group (eta 0)", "feedback-conditioned likelihood gaps allocate each "
     "action's credit across its tokens (abstract; docs/METHODS.md F3-F5)"),
    ("ELPO E8: ELC beats ELPO without it", "elpo+bel", "elpo+bel (no ELC)",
     "ELPO's ablation: the wider lower clip bound on the critical suffix helps"),
    ("ELPO Table 1 on workflow: ELPO beats GRPO", "elpo+bel (workflow)",
     "grpo+group (workflow)", "as the calc claim, at a horizon where credit matters"),
    ("ELPO on workflow: ELPO beats tree-rollout baselines", "elpo+bel (workflow)",
     "tree_grpo+random (workflow)", "as the calc claim, at a horizon where credit matters"),
    ("CALIPER on workflow: CALIPER beats GRPO", "caliper+caliper (workflow)",
     "grpo+group (workflow)", "as the calc claim, at a horizon where credit matters"),
    ("FACTOR on branching workflow trees: FACTOR beats GRPO", "factor+bel (workflow)",
     "grpo+bel (workflow)", "TD action credit with hindsight token allocation beats "
     "trajectory-level GRPO (abstract); here on the same BEL trees, a teacher that reads "
     "the feedback as its next turn and the annealed eta (docs/METHODS.md section 10)"),
    ("SGCD: the reshaping beats GRPO with the same dynamic sampling", "sgcd+group",
     "grpo+group (ds)", "SGCD's bounded credit weighting improves on GRPO (abstract); the "
     "arms differ only in Q2-Q4"),
    ("SGCD: SGCD beats GRPO at the same tool steps", "sgcd+group", "grpo+group (steps)",
     "SGCD's dynamic sampling and reshaping beat GRPO given the tool steps they spend "
     "(abstract; docs/METHODS.md Q1)"),
)
DEFAULT_DELTA = 0.02
"""Equivalence margin of studies whose config predates ``Table1Config.delta``."""


def read_run_metrics(store_dir: Path, run_id: str) -> dict[str, dict[int, float]]:
    """``{name: {step: value}}`` of one run from its store's training metrics
    (``rollout_store.attempts.training_metrics``: the latest write per step, no bookkeeping
    rows)."""
    from rollout_store import Store, connect
    from rollout_store.attempts import training_metrics

    return {name: dict(rows)
            for name, rows in training_metrics(connect(Store(store_dir)), run_id).items()}


def read_outcomes(store_dir: Path, run_id: str) -> dict[str, dict[int, dict[int, float]]]:
    """``{mode: {step: {task_index: success}}}`` of one run's held-out evaluations from its
    store's ``evaluations`` table (step -1: the starting weights); a step a retried
    iteration evaluated again keeps its newest row per task (largest ``created_at``)."""
    from rollout_store import Store, connect

    con = connect(Store(store_dir))
    rows = con.execute(
        "SELECT mode, step, task_index, arg_max(success, created_at) FROM evaluations "
        "WHERE run_id = ? GROUP BY ALL ORDER BY mode, step, task_index", [run_id]).fetchall()
    out: dict[str, dict[int, dict[int, float]]] = {}
    for mode, step, task, ok in rows:
        out.setdefault(str(mode), {}).setdefault(int(step), {})[int(task)] = float(ok)
    return out


def outcomes_at(outcomes: Mapping[str, Mapping[int, dict[int, float]]], step: int,
                mode: str) -> dict[int, float] | None:
    """``{task_index: success}`` at metric ``step`` in ``mode`` of one run's
    ``read_outcomes``; None when the run has no such rows."""
    return outcomes.get(mode, {}).get(step) or None


def run_summary(metrics: Mapping[str, Mapping[int, float]], steps: int) -> dict[str, Any]:
    """One run's numbers: held-out success at the start and after ``steps`` iterations,
    the policy's mean token entropy on its training samples in the first and the last
    iteration (sharpening alone raises sampled success: entropy falls with it), its curve
    (iteration, sampled, cumulative tool steps), tool and env steps, seconds."""
    sampled = metrics.get("heldout_sampled", {})
    greedy = metrics.get("heldout_greedy", {})
    entropy = metrics.get("entropy", {})
    tool = metrics.get("new_tool_steps", {})
    env_steps = metrics.get("env_steps", {})
    done = sorted(s for s in metrics.get("loss", {}) if s >= 0)
    cum = np.cumsum([tool.get(s, 0.0) for s in range(steps)]) if steps else np.zeros(0)
    curve = [{"iteration": s + 1, "heldout_sampled": v,
              "tool_steps": float(cum[s]) if s >= 0 else 0.0}
             for s, v in sorted(sampled.items())]
    phases = ("seconds_sample", "seconds_commit", "seconds_credit", "seconds_train",
              "seconds_eval")
    return {"iterations": len(done), "complete": steps - 1 in sampled,
            "start_sampled": sampled.get(-1), "start_greedy": greedy.get(-1),
            "final_sampled": sampled.get(steps - 1), "final_greedy": greedy.get(steps - 1),
            "start_entropy": entropy.get(0), "final_entropy": entropy.get(steps - 1),
            "tool_steps": float(sum(tool.get(s, 0.0) for s in range(steps))),
            "env_steps": float(sum(env_steps.get(s, 0.0) for s in range(steps))),
            "train_seconds": float(sum(v for p in phases
                                       for v in metrics.get(p, {}).values())),
            "curve": curve}


def _outcomes(rows: Sequence[Mapping[str, Any]], key: str) -> dict[int, Any]:
    """``{seed: per-task outcomes (dict) or the final rate (float)}`` of finished runs."""
    out: dict[int, Any] = {}
    for r in rows:
        if r["status"] == "done" and r.get(key) is not None:
            out[int(r["seed"])] = r[key]
    return out


def compare(a: Mapping[int, Any], b: Mapping[int, Any], level: float) -> Difference | None:
    """The paired difference of two configs' outcomes (``_outcomes``) on their common
    seeds: per (seed, task) where every common run has the same tasks, else per seed
    (rates); None below two common seeds."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    per_task = all(isinstance(a[s], dict) and isinstance(b[s], dict) for s in seeds)
    if per_task:
        tasks = sorted(a[seeds[0]])
        if all(sorted(a[s]) == tasks and sorted(b[s]) == tasks for s in seeds) and \
                len(tasks) >= 2:
            ya = np.array([[a[s][i] for i in tasks] for s in seeds])
            yb = np.array([[b[s][i] for i in tasks] for s in seeds])
            return paired_difference(ya, yb, level)
    ra = np.array([_rate(a[s]) for s in seeds])
    rb = np.array([_rate(b[s]) for s in seeds])
    return paired_difference(ra, rb, level)


def _rate(x: Any) -> float:
    return float(np.mean(list(x.values()))) if isinstance(x, dict) else float(x)


def _t_interval(xs: Sequence[float], level: float) -> list[float]:
    """The t interval of a mean over seeds (nan below two seeds): V2's seed-level interval
    of ``xs`` against 0."""
    arr = np.asarray(xs, np.float64)
    if arr.size < 2:
        return [math.nan, math.nan]
    return list(paired_difference(arr, np.zeros_like(arr), level).ci)


def _reasons(refused: Sequence[tuple[int, str]], unfinished: Sequence[Mapping[str, Any]]
             ) -> str:
    """``REASON (seeds 0, 1); seed 2: incomplete (3/20 iterations)``."""
    by_reason: dict[str, list[int]] = {}
    for seed, reason in refused:
        by_reason.setdefault(reason, []).append(seed)
    parts = [f"{reason} (seeds {', '.join(map(str, seeds))})"
             for reason, seeds in by_reason.items()]
    parts += [f"seed {r['seed']}: {r['status']}" for r in unfinished]
    return "; ".join(parts)


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    arr = np.asarray(xs, np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else math.nan


def table1_results(study_dir: str | Path, out_dir: str | Path | None = None
                   ) -> dict[str, Any]:
    """The Table 1 report of a study directory: ``results.json``, ``report.md`` and
    ``table1_curves.png`` into ``out_dir`` (default: the study directory); returns the
    results dict."""
    src, out, study = open_study(study_dir, out_dir, KIND)
    c = study["config"]
    steps = int(c["steps"])
    delta = float(c.get("delta", DEFAULT_DELTA))
    claims = [cl for cl in CLAIMS if cl[1] in study["configs"] and cl[2] in study["configs"]]
    level = family_level(max(len(claims), 1))
    configs: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for name, (env, sampler, credit) in study["configs"].items():
        mine = [r for r in study["runs"] if r["config"] == name]
        rows, reasons = [], []
        for r in mine:
            row = {k: r[k] for k in ("config", "seed", "run_id", "status")}
            if r["status"] == "done":
                store_dir = study_path(src, f"{r['dir']}/{r['store']}", "runs[].dir/store")
                m = read_run_metrics(store_dir, r["run_id"])
                row.update(run_summary(m, steps))
                outcomes = read_outcomes(store_dir, r["run_id"])  # both modes, one read
                for mode in ("sampled", "greedy"):
                    row[f"tasks_{mode}"] = outcomes_at(outcomes, steps - 1, mode)
                if not row["complete"]:
                    row["status"] = f"incomplete ({row['iterations']}/{steps} iterations)"
            else:
                row["reason"] = r.get("reason", "")
                reasons.append((r["seed"], row["reason"]))
            runs.append(row)
            rows.append(row)
        ok = [r for r in rows if r["status"] == "done"]
        finals = [float(r["final_sampled"]) for r in ok]
        doc: dict[str, Any] = {"env": env, "sampler": sampler, "credit": credit,
                               "seeds": [r["seed"] for r in ok], "n_runs": len(mine)}
        why = _reasons(reasons, [r for r in rows if r["status"] not in ("done", "not run")])
        if not ok:
            doc["status"] = "not run: " + (why or "no runs")
            configs[name] = doc
            continue
        doc["status"] = "done" if len(ok) == len(mine) else \
            f"partial: {len(ok)}/{len(mine)} runs ({why})"
        for key in ("start_sampled", "start_greedy", "final_sampled", "final_greedy",
                    "start_entropy", "final_entropy", "tool_steps", "env_steps",
                    "train_seconds"):
            mean, std = _mean_std([float(r[key]) for r in ok if r.get(key) is not None])
            doc[key] = {"mean": mean, "std": std}
        doc["final_sampled"]["ci"] = _t_interval(finals, level)
        doc["rollouts"] = steps * int(c["tasks_per_step"]) * int(c["n_total"])
        doc["seconds_per_iteration"] = doc["train_seconds"]["mean"] / steps
        doc["_outcomes"] = {mode: _outcomes(
            ok, f"tasks_{mode}") or _outcomes(ok, f"final_{mode}")
            for mode in ("sampled", "greedy")}
        configs[name] = doc
    verdicts = []
    for claim, a, b, paper in claims:
        da, db = configs[a], configs[b]
        diff = greedy = None
        if "_outcomes" in da and "_outcomes" in db:
            diff = compare(da["_outcomes"]["sampled"], db["_outcomes"]["sampled"], level)
            greedy = compare(da["_outcomes"]["greedy"], db["_outcomes"]["greedy"], level)
        if diff is not None:
            est, ci, se, dof = diff.estimate, list(diff.ci), diff.se, diff.df
            paired = (f"paired over {diff.n_seeds} seeds x {diff.n_tasks} tasks"
                      if diff.n_tasks else f"paired over {diff.n_seeds} seeds (rates)")
            g = (f"; greedy {greedy.estimate:+.3f} [{greedy.ci[0]:+.3f}, {greedy.ci[1]:+.3f}]"
                 if greedy is not None else "")
            note = paired + g
        else:
            est, ci, se, dof = math.nan, [math.nan, math.nan], None, None
            note = "; ".join(f"{n} {configs[n]['status']}" for n in (a, b)
                             if "_outcomes" not in configs[n]) or \
                "fewer than 2 common seeds"
        verdicts.append(verdict(
            f"{claim} ({a} > {b})", f"final held-out success {a} - {b}", est, ci, 0.0,
            "above", paper, note=note, delta=delta, level=level, se=se, df=dof).to_json())
    for doc in configs.values():
        doc.pop("_outcomes", None)
    for r in runs:
        for mode in ("sampled", "greedy"):
            r.pop(f"tasks_{mode}", None)
    plots = [_curves(out / "table1_curves.png", configs, runs)]
    results: dict[str, Any] = {
        "audit": KIND, "config": c, "paper_table": PAPER_TABLE, "configs": configs,
        "runs": runs, "verdicts": verdicts, "plots": plots,
        "seconds": study["seconds"]}
    return write_study_results(out, results, table1_report(results))


def _curves(path: Path, configs: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]
            ) -> str:
    """Mean held-out sampled success over seeds against iteration (left) and cumulative
    tool steps (right), one line per config; seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.2), squeeze=False)
    for name in configs:
        curves = [r["curve"] for r in runs if r["config"] == name and r["status"] == "done"]
        if not curves:
            continue
        n = min(len(cv) for cv in curves)
        it = np.array([cv[i]["iteration"] for cv in curves[:1] for i in range(n)])
        y = np.array([[cv[i]["heldout_sampled"] for i in range(n)] for cv in curves])
        x_tool = np.array([[cv[i]["tool_steps"] for i in range(n)] for cv in curves])
        for ax, x in ((axes[0][0], it), (axes[0][1], x_tool.mean(axis=0))):
            (line,) = ax.plot(x, y.mean(axis=0), marker="o", markersize=3, label=name)
            ax.fill_between(x, y.min(axis=0), y.max(axis=0), alpha=0.15,
                            color=line.get_color())
    axes[0][0].set_xlabel("iteration")
    axes[0][1].set_xlabel("tool steps spent (cumulative, mean over seeds)")
    for ax in axes[0]:
        ax.set_ylabel("held-out sampled success")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Table 1 in miniature: learning curves (mean over seeds, range shaded)")
    return save_figure(fig, path)


def _ms(d: Mapping[str, Any] | None, digits: int = 3) -> str:
    if not d:
        return "n/a"
    std = d.get("std")
    if std is None or not math.isfinite(std):
        return fmt(d.get("mean"), digits)
    return f"{fmt(d.get('mean'), digits)} ± {fmt(std, digits)}"


def _entropy(d: Mapping[str, Any]) -> str:
    """``first -> last`` mean token entropy (nats) of a config's training samples."""
    first, last = d.get("start_entropy"), d.get("final_entropy")
    if not first or not last or math.isnan(first["mean"]) or math.isnan(last["mean"]):
        return "n/a"
    return f"{first['mean']:.3f} -> {last['mean']:.3f}"


def table1_report(results: Mapping[str, Any]) -> str:
    """The markdown report of ``table1_results``' dict."""
    c = results["config"]
    envs = dict.fromkeys(d["env"] for d in results["configs"].values())
    start = "the tiny policy of its env"
    # the study's settings of one env's configs are its fields named ``<env>_...``
    # (train.studies.table1.env_setting): workflow_policy, workflow_horizons, ...
    for env in envs:
        if c.get(f"{env}_policy", "tiny") != "tiny":
            start += f" ({env}: {c[f'{env}_policy']})"
    for env in envs:
        if f"{env}_horizons" in c:
            start += (f"; {env} tasks at horizons {list(c[f'{env}_horizons'])}"
                      + (", optional stages marked (mark_optional)"
                         if c.get(f"{env}_mark_optional") else ""))
    lines = ["# Table 1 in miniature: held-out success after training", "",
             f"Miniature of {results['paper_table']}.", "",
             f"Every run: {start}, {c['steps']} iterations x "
             f"{c['tasks_per_step']} tasks x n_total = {c['n_total']} rollouts per tree "
             f"(equal iterations, equal n_total), seeds {list(c['seeds'])}, held-out "
             f"success on {c['heldout_tasks']} fixed held-out tasks (one sampled rollout "
             "each, temperature 1; greedy beside it, and the mean token entropy of the "
             "training samples in the first and the last iteration, which sharpening "
             "lowers). Mean ± std over seeds; the interval "
             "of a config's mean is the t interval over its seeds. Claims are judged on "
             "paired differences (seed x task) at the Bonferroni level of the study's "
             f"claims, equivalence margin delta = {c.get('delta', DEFAULT_DELTA)} "
             "(docs/METHODS.md V1-V5).", ""]
    for env in dict.fromkeys(d["env"] for d in results["configs"].values()):
        lines += [f"## {env}", ""]
        rows = []
        for name, d in results["configs"].items():
            if d["env"] != env:
                continue
            if "final_sampled" not in d:
                rows.append([name, d["sampler"], d["credit"], 0, d["status"], "", "", "",
                             "", "", "", ""])
                continue
            fs = d["final_sampled"]
            rows.append([name, d["sampler"], d["credit"], len(d["seeds"]),
                         _ms(d["start_sampled"]), _ms(fs),
                         fmt_ci(fs["mean"], fs["ci"]), _ms(d["final_greedy"]),
                         _entropy(d), _ms(d["tool_steps"], 0), d["rollouts"],
                         fmt(d["seconds_per_iteration"], 1)])
        lines += [markdown_table(
            ["config", "sampler", "credit", "seeds", "held-out start", "held-out end",
             "end: mean [CI]", "greedy end", "entropy first -> last", "tool steps",
             "rollouts", "s / iteration"],
            rows), ""]
    partial = [f"- {n}: {d['status']}" for n, d in results["configs"].items()
               if d["status"] != "done"]
    if partial:
        lines += ["Runs not in the table:", "", *partial, ""]
    lines += ["## Verdicts", "", *verdict_lines(results["verdicts"]), ""]
    if any(d["credit"] == "sgcd" for d in results["configs"].values()):
        lines += ["SGCD's contrast reference here is the deterministic `template` "
                  "summariser (the first differing action of a successful and a failed "
                  "sibling, as a hint): a stand-in for the paper's LLM summary, not the "
                  "method as published (docs/METHODS.md section 11).", ""]
    lines += ["Plots: " + ", ".join(f"`{p}`" for p in results["plots"]), "",
              "Reproduce: `rtrees study table1 --out DIR` with the settings in "
              f"`results.json` ({results['seconds']:.0f} s of data generation in the last "
              "invocation; finished runs are skipped on a rerun)."]
    return "\n".join(lines) + "\n"


@register_study_report(KIND)
def build_table1_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``)."""
    res = table1_results(study_dir, out)
    return ReportOutput(KIND, out, "Table 1 in miniature: held-out success after training",
                        verdict_counts(res["verdicts"]), (out / "report.md",))


__all__ = ["CLAIMS", "KIND", "PAPER_TABLE", "build_table1_report", "compare", "outcomes_at",
           "read_outcomes", "read_run_metrics", "run_summary", "table1_report",
           "table1_results"]
