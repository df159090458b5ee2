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

**Interval** (95% percentile, ``n_boot`` resamples): a two-level bootstrap, seeds with
replacement, then the held-out tasks of each drawn seed. The trainer stores held-out
success as a rate, not per task; a task resample of n Bernoulli outcomes with k
successes is Binomial(n, k/n) / n, so it is recomputable from the rate and n alone.
Differences between configs resample the two independently (unpaired: without per-task
outcomes the shared held-out tasks cannot be paired, which widens the interval).

**Verdicts** (``analysis.verdicts``): each claim "A > B" is the difference of mean final
held-out sampled success, judged on its interval; the paper's numbers (other models,
benchmarks and scales) are printed beside ours, not compared.
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
    write_study_results,
)
from analysis.stats import percentile_ci
from analysis.verdicts import verdict, verdict_lines

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
)
LEVEL = 0.95


def read_run_metrics(store_dir: Path, run_id: str) -> dict[str, dict[int, float]]:
    """``{name: {step: value}}`` of one run from its store's ``metrics`` table."""
    from rollout_store import Store, connect

    con = connect(Store(store_dir))
    rows = con.execute("SELECT name, step, value FROM metrics WHERE run_id = ? "
                       "ORDER BY name, step", [run_id]).fetchall()
    out: dict[str, dict[int, float]] = {}
    for name, step, value in rows:
        out.setdefault(str(name), {})[int(step)] = float(value)
    return out


def run_summary(metrics: Mapping[str, Mapping[int, float]], steps: int) -> dict[str, Any]:
    """One run's numbers: held-out success at the start and after ``steps`` iterations,
    its curve (iteration, sampled, cumulative tool steps), tool and env steps, seconds."""
    sampled = metrics.get("heldout_sampled", {})
    greedy = metrics.get("heldout_greedy", {})
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
            "tool_steps": float(sum(tool.get(s, 0.0) for s in range(steps))),
            "env_steps": float(sum(env_steps.get(s, 0.0) for s in range(steps))),
            "train_seconds": float(sum(v for p in phases
                                       for v in metrics.get(p, {}).values())),
            "curve": curve}


def boot_means(rates: Sequence[float], n_tasks: int, n_boot: int,
               rng: np.random.Generator) -> np.ndarray:
    """(n_boot,) bootstrap means over seeds of held-out success: seeds drawn with
    replacement, then each drawn seed's n_tasks outcomes (Binomial(n, k/n) / n)."""
    p = np.clip(np.asarray(rates, np.float64), 0.0, 1.0)
    idx = rng.integers(0, p.size, size=(n_boot, p.size))
    return (rng.binomial(n_tasks, p[idx]) / n_tasks).mean(axis=1)


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
    steps, n_tasks = int(c["steps"]), int(c["heldout_tasks"])
    rng = np.random.default_rng(c["boot_seed"])
    configs: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for name, (env, sampler, credit) in study["configs"].items():
        mine = [r for r in study["runs"] if r["config"] == name]
        rows, reasons = [], []
        for r in mine:
            row = {k: r[k] for k in ("config", "seed", "run_id", "status")}
            if r["status"] == "done":
                m = read_run_metrics(src / r["dir"] / r["store"], r["run_id"])
                row.update(run_summary(m, steps))
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
        boots = boot_means(finals, n_tasks, int(c["n_boot"]), rng)
        for key in ("start_sampled", "start_greedy", "final_sampled", "final_greedy",
                    "tool_steps", "env_steps", "train_seconds"):
            mean, std = _mean_std([float(r[key]) for r in ok if r[key] is not None])
            doc[key] = {"mean": mean, "std": std}
        doc["final_sampled"]["ci"] = percentile_ci(boots, LEVEL)
        doc["rollouts"] = steps * int(c["tasks_per_step"]) * int(c["n_total"])
        doc["seconds_per_iteration"] = doc["train_seconds"]["mean"] / steps
        doc["_boot"] = boots
        configs[name] = doc
    verdicts = []
    for claim, a, b, paper in CLAIMS:
        if a not in configs or b not in configs:
            continue
        da, db = configs[a], configs[b]
        if "_boot" in da and "_boot" in db:
            est = da["final_sampled"]["mean"] - db["final_sampled"]["mean"]
            ci = percentile_ci(da["_boot"] - db["_boot"], LEVEL)
            note = ""
        else:
            est, ci = math.nan, [math.nan, math.nan]
            note = "; ".join(f"{n} {configs[n]['status']}" for n in (a, b)
                             if "_boot" not in configs[n])
        verdicts.append(verdict(
            f"{claim} ({a} > {b})", f"final held-out success {a} - {b}", est, ci, 0.0,
            "above", paper, note=note).to_json())
    for doc in configs.values():
        doc.pop("_boot", None)
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


def table1_report(results: Mapping[str, Any]) -> str:
    """The markdown report of ``table1_results``' dict."""
    c = results["config"]
    lines = ["# Table 1 in miniature: held-out success after training", "",
             f"Miniature of {results['paper_table']}.", "",
             f"Every run: the tiny policy of its env, {c['steps']} iterations x "
             f"{c['tasks_per_step']} tasks x n_total = {c['n_total']} rollouts per tree "
             f"(equal iterations, equal n_total), seeds {list(c['seeds'])}, held-out "
             f"success on {c['heldout_tasks']} fixed held-out tasks (one sampled rollout "
             "each, temperature 1; greedy beside it). Mean ± std over seeds; 95% interval "
             f"of the mean: {c['n_boot']} two-level resamples (seeds, then held-out tasks "
             "as Binomial(n, k/n); unpaired across configs).", ""]
    for env in dict.fromkeys(d["env"] for d in results["configs"].values()):
        lines += [f"## {env}", ""]
        rows = []
        for name, d in results["configs"].items():
            if d["env"] != env:
                continue
            if "final_sampled" not in d:
                rows.append([name, d["sampler"], d["credit"], 0, d["status"], "", "", "",
                             "", "", ""])
                continue
            fs = d["final_sampled"]
            rows.append([name, d["sampler"], d["credit"], len(d["seeds"]),
                         _ms(d["start_sampled"]), _ms(fs),
                         fmt_ci(fs["mean"], fs["ci"]), _ms(d["final_greedy"]),
                         _ms(d["tool_steps"], 0), d["rollouts"],
                         fmt(d["seconds_per_iteration"], 1)])
        lines += [markdown_table(
            ["config", "sampler", "credit", "seeds", "held-out start", "held-out end",
             "end: mean [95% CI]", "greedy end", "tool steps", "rollouts", "s / iteration"],
            rows), ""]
    partial = [f"- {n}: {d['status']}" for n, d in results["configs"].items()
               if d["status"] != "done"]
    if partial:
        lines += ["Runs not in the table:", "", *partial, ""]
    lines += ["## Verdicts", "", *verdict_lines(results["verdicts"]), "",
              "Plots: " + ", ".join(f"`{p}`" for p in results["plots"]), "",
              "Reproduce: `rtrees study table1 --out DIR` with the settings in "
              f"`results.json` ({results['seconds']:.0f} s of data generation in the last "
              "invocation; finished runs are skipped on a rerun)."]
    return "\n".join(lines) + "\n"


@register_study_report(KIND)
def build_table1_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``)."""
    res = table1_results(study_dir, out)
    counts = {v: sum(x["verdict"] == v for x in res["verdicts"])
              for v in ("reproduced", "not reproduced", "inconclusive")}
    return ReportOutput(KIND, out, "Table 1 in miniature: held-out success after training",
                        ", ".join(f"{n} {v}" for v, n in counts.items()),
                        (out / "report.md",))


__all__ = ["CLAIMS", "KIND", "PAPER_TABLE", "boot_means", "build_table1_report",
           "read_run_metrics", "run_summary", "table1_report", "table1_results"]
