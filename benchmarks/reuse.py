"""The reuse experiment (issue 28): can training on stored trees save new interaction?

Design (the defaults; every knob is a flag):

* **where credit matters**: ``workflow`` at horizon 12 (``--horizons 12,18`` adds 18), the
  tiny policy, ``epochs=2`` and ``minibatches=4`` (so the PPO ratio moves and clipping
  binds on some tokens), 4 fresh trees per iteration;
* **trees a gate can resolve**: the ``rooted`` sampler (``n_total=32``, ``n_root=2``): two
  root actions with 16 trajectories each, so a stored root gap has a resolvable size;
* **arms**: ``none`` (fresh trees only) and, at each staleness of ``--staleness``
  (``max_staleness``: stored trees at most that many policy versions old, this run's own
  trees), ``all`` / ``transport`` / ``gap-gate`` / ``dsc`` (its D7 calibration runs in the
  run and its tool steps are reported apart, not charged to the budget) / ``refresh`` /
  ``m2po``, 4 stored trees per iteration; ``--arms RULE@S,...`` picks a subset;
* **paired**: every arm of a seed starts from the same weights, draws the same training
  tasks, and is evaluated on the same 200 held-out tasks with the same evaluation seeds at
  each version (the trainer's ``heldout_rows``); seeds 0..S-1;
* **budget**: each run trains (resumably, ``eval_every`` iterations at a time) until it
  has spent ``--budget`` new tool steps (fresh trees, refreshes, dynamic-sampling extras);
* **primary metric**: the area under held-out success against new tool steps on [0, B],
  divided by B (the mean success over the budget), per (seed, task) from the per-task
  ``evaluations`` rows (each task's 0/1 outcome at each evaluated version, linearly
  interpolated in tool steps; B = ``--budget``). Sampled success is primary, greedy is
  reported beside it;
* **verdicts** (docs/METHODS.md section 8, ``analysis.verdicts``): each arm minus ``none``
  on the paired (seed, task) AUC differences, four-way at delta ``--delta``, Bonferroni
  over the arms; and the issue's target as its own claim per arm: success at B/2 minus
  ``none``'s success at B ("equal success at half the new tool steps"), equivalent or
  superior meaning the target is met;
* **power before running**: the effect the design can detect (``analysis.verdicts.Design``
  with its stated variance components) is printed before anything trains, and
  ``--power`` prints it without training.

Writes to ``--out``: ``results.json`` (per run: curves, costs, per-task AUCs), ``report.md``
(the table, the verdicts, the power statement, the command) and ``reuse_curve.png``. A
rerun of the same command continues every unfinished run (``--resume`` per chunk), so a
longer run (more seeds, ``--horizons 12,18``, a larger ``--budget``) extends this one.

    .venv/bin/python benchmarks/reuse.py --out out/reuse                 # the full design
    .venv/bin/python benchmarks/reuse.py --out /tmp/r --power            # power only
    .venv/bin/python benchmarks/reuse.py --out /tmp/r --seeds 2 --budget 300 \\
        --arms all@2 --set heldout_tasks=8 --set n_total=8 --set tasks_per_step=2 \\
        --set minibatches=2                                              # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.table1 import read_outcomes
from analysis.verdicts import (
    Design,
    family_level,
    paired_difference,
    verdict,
    verdict_lines,
)
from rollout_store.reader import read_trees
from train.config import ConfigError, load_config
from train.reuse.params import REUSE_MODES
from train.trainer import TrainError, read_metrics, train

REUSE_RULES: tuple[str, ...] = ("all", "transport", "gap-gate", "dsc", "refresh", "m2po")
"""The reuse arms of the issue's design (``none`` is always run)."""
DEFAULTS: dict[str, str] = {
    "env": "workflow", "sampler": "rooted", "n_total": "32", "tasks_per_step": "4",
    "epochs": "2", "minibatches": "4", "heldout_tasks": "200", "eval_every": "2",
    "reuse_per_step": "4", "progress": "false"}
"""TrainConfig fields of every run (``--set`` overrides them)."""
SAMPLER_PARAMS = {"n_root": 2}


class Arm:
    """One arm: a reuse rule at a staleness (``none`` has no staleness)."""

    def __init__(self, text: str) -> None:
        rule, _, stale = text.partition("@")
        self.rule: str = rule
        self.staleness: int | None = None
        if rule not in REUSE_MODES:
            raise SystemExit(f"error: arm {text!r}: unknown rule {rule!r}; rules: "
                             f"{', '.join(REUSE_MODES)}")
        if rule == "none":
            if stale:
                raise SystemExit(f"error: arm {text!r}: none reuses nothing, so it has no "
                                 "staleness")
        else:
            try:
                self.staleness = int(stale)
            except ValueError:
                raise SystemExit(f"error: arm {text!r}: write RULE@STALENESS, e.g. "
                                 "all@2") from None
            if self.staleness < 1:
                raise SystemExit(f"error: arm {text!r}: staleness must be >= 1")

    @property
    def name(self) -> str:
        return self.rule if self.staleness is None else f"{self.rule}@{self.staleness}"


def _ints(flag: str, text: str, low: int = 1) -> list[int]:
    """Comma-separated integers >= ``low``; a one-line ``SystemExit`` otherwise."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise SystemExit(f"error: {flag} takes comma-separated integers >= {low}, got "
                         f"{text!r}")
    return values


def default_arms(staleness: list[int]) -> list[Arm]:
    return [Arm("none")] + [Arm(f"{rule}@{s}") for s in staleness for rule in REUSE_RULES]


def _interp(x: float, xs: list[float], ys: np.ndarray) -> np.ndarray:
    """(T,) outcomes at tool steps ``x``: linear between evaluated versions, flat after the
    last. ``xs`` ascending (K,), ``ys`` (K, T)."""
    if x >= xs[-1]:
        return ys[-1]
    j = max(i for i, v in enumerate(xs) if v <= x)
    w = (x - xs[j]) / (xs[j + 1] - xs[j]) if xs[j + 1] > xs[j] else 0.0
    return (1 - w) * ys[j] + w * ys[j + 1]


def auc(xs: list[float], ys: np.ndarray, budget: float) -> np.ndarray:
    """(T,) area under each task's outcome curve on [0, budget] divided by budget:
    (1/B) integral_0^B y_t(x) dx with y_t piecewise linear through (xs, ys[:, t])."""
    grid = sorted({0.0, budget, *(x for x in xs if 0 < x < budget)})
    vals = [_interp(x, xs, ys) for x in grid]
    area = sum((grid[i + 1] - grid[i]) * (vals[i] + vals[i + 1]) / 2
               for i in range(len(grid) - 1))
    return np.asarray(area, np.float64) / budget


def run_dir(out: Path, horizon: int, arm: Arm, seed: int) -> tuple[str, Path, Path]:
    name = f"H{horizon}-{arm.name.replace('@', '-s')}-seed{seed}"
    return name, out / "runs" / name, out / "stores" / name


def run_one(out: Path, horizon: int, arm: Arm, seed: int, budget: float, max_steps: int,
            overrides: dict[str, str], train_more: bool = True) -> dict[str, Any] | None:
    """Train (resumably, ``eval_every`` iterations per call) until ``budget`` new tool
    steps or ``max_steps`` iterations, then read the run back (None: nothing committed)."""
    name, run, store = run_dir(out, horizon, arm, seed)
    base: dict[str, Any] = {**DEFAULTS, **overrides, "reuse": arm.rule, "seed": str(seed),
            "store": str(store), "out": str(run), "run_id": name,
            "task_params": {"horizons": horizon}, "sampler_params": dict(SAMPLER_PARAMS)}
    if arm.staleness is not None:
        base["max_staleness"] = str(arm.staleness)
    chunk = max(1, int(base["eval_every"]))
    k = 0
    while train_more and k < max_steps:
        spent = 0.0
        if store.is_dir():
            spent = sum(v for _, v in read_metrics(str(store), name).get("new_tool_steps", []))
        if spent >= budget:
            break
        k = min(max_steps, k + chunk)
        if not (run / "checkpoints" / f"step-{k:06d}").is_dir():  # else: done before
            t0 = time.time()
            try:
                train(load_config(None, {**base, "steps": str(k)}),
                      resume=(run / "config.json").exists())
            except TrainError as exc:  # e.g. a gated rule refusing thin stored trees
                raise SystemExit(f"error: {name}: {exc}") from None
            print(f"  {name}: {k} iterations ({time.time() - t0:.0f} s)", flush=True)
    return read_run(run, store, name, horizon, arm, seed)

def evaluations(store: Path, name: str) -> dict[str, dict[int, np.ndarray]]:
    """{mode: {step: (T,) success in task order}} of a run's held-out evaluations
    (``analysis.table1.read_outcomes``: step -1 the starting weights, a retried step's
    newest rows)."""
    return {mode: {step: np.asarray([ok for _, ok in sorted(tasks.items())])
                   for step, tasks in by.items()}
            for mode, by in read_outcomes(store, name).items()}


def read_run(run: Path, store: Path, name: str, horizon: int, arm: Arm, seed: int
             ) -> dict[str, Any] | None:
    if not store.is_dir():
        return None
    m = read_metrics(str(store), name)
    if not m.get("new_tool_steps"):
        return None
    cum, tools = 0.0, {-1: 0.0}
    for step, v in sorted(m["new_tool_steps"]):
        cum += v
        tools[step] = cum
    evals = evaluations(store, name)
    curves = {mode: [(tools[s], float(v.mean())) for s, v in sorted(by.items()) if s in tools]
              for mode, by in evals.items()}

    def total(key: str) -> float:
        return float(sum(v for _, v in m.get(key, [])))

    def mean(key: str) -> float | None:
        vals = [v for _, v in m.get(key, [])]
        return statistics.mean(vals) if vals else None

    return {"name": name, "horizon": horizon, "arm": arm.name, "rule": arm.rule,
            "staleness": arm.staleness, "seed": seed, "curves": curves,
            "evaluations": {mode: {str(s): v.astype(int).tolist() for s, v in by.items()}
                            for mode, by in evals.items()},
            "tool_steps_at": {str(s): x for s, x in tools.items()},
            "iterations": len(m.get("loss", [])), "new_tool_steps": total("new_tool_steps"),
            "refresh_tool_steps": total("reuse_new_tool_steps"),
            "calibration_tool_steps": total("reuse_calibration_tool_steps"),
            "reused": total("reuse_pairs_reuse"), "transported": total("reuse_pairs_transport"),
            "refreshed": total("reuse_pairs_refresh"),
            "feasible": total("reuse_pairs_feasible") if "reuse_pairs_feasible" in m else None,
            "clip_frac": mean("clip_frac_low"), "clip_frac_high": mean("clip_frac_high"),
            "is_weight_mean": mean("is_weight_mean"), "m2po_masked_frac": mean("m2po_masked_frac"),
            "seconds": total("seconds_sample") + total("seconds_commit")
            + total("seconds_credit") + total("seconds_train"),
            "regret": workflow_regret(run, str(store)) if arm.rule != "none" else None,
            "calibration": calibration(run) if arm.rule == "dsc" else None}


def task_outcomes(r: dict[str, Any], mode: str) -> tuple[list[float], np.ndarray]:
    """(K,) tool steps of a run's evaluated versions and the (K, T) per-task outcomes."""
    by = r["evaluations"].get(mode, {})
    steps = sorted(int(s) for s in by if s in r["tool_steps_at"])
    xs = [float(r["tool_steps_at"][str(s)]) for s in steps]
    return xs, np.asarray([by[str(s)] for s in steps], np.float64)


def arm_matrix(results: list[dict[str, Any]], horizon: int, arm: str, seeds: list[int],
               mode: str, budget: float, at: float = 1.0) -> np.ndarray | None:
    """(S, T) per-(seed, task) values of ``arm``: the AUC on [0, budget] (``at`` = 1.0),
    or, with ``at`` < 0, the outcome at tool steps -at * budget. None when a seed is
    missing or its run never reached the point."""
    rows = []
    for seed in seeds:
        got = [r for r in results if r["horizon"] == horizon and r["arm"] == arm
               and r["seed"] == seed]
        if not got:
            return None
        xs, ys = task_outcomes(got[0], mode)
        if len(xs) < 2 or xs[-1] < (budget if at > 0 else -at * budget):
            return None
        rows.append(auc(xs, ys, budget) if at > 0 else _interp(-at * budget, xs, ys))
    return np.asarray(rows)


def verdicts(results: list[dict[str, Any]], arms: list[str], seeds: list[int],
             budget: float, delta: float, mode: str = "sampled") -> list[dict[str, Any]]:
    """Per horizon and reuse arm: (1) AUC(arm) - AUC(none) > 0; (2) success(arm) at B/2 -
    success(none) at B > 0 (the issue's target, met when superior or equivalent). Paired
    by seed and task; Bonferroni over every claim of the study."""
    horizons = sorted({r["horizon"] for r in results})
    others = [a for a in arms if a != "none"]
    k = max(1, 2 * len(others) * len(horizons))
    level = family_level(k)
    out = []
    for h in horizons:
        base_auc = arm_matrix(results, h, "none", seeds, mode, budget)
        base_end = arm_matrix(results, h, "none", seeds, mode, budget, at=-1.0)
        for arm in others:
            claims = (
                (f"H{h} {arm} vs none: AUC of {mode} success over {budget:.0f} new tool "
                 "steps", "AUC(arm) - AUC(none)", arm_matrix(results, h, arm, seeds, mode,
                                                            budget), base_auc,
                 "no paper number on this metric (DSC-Gate: 39% fewer new tool steps than "
                 "a gap gate; M2PO: stable at 256 stale updates)"),
                (f"H{h} {arm} at B/2 vs none at B ({mode}): equal success at half the new "
                 "tool steps", "success(arm, B/2) - success(none, B)",
                 arm_matrix(results, h, arm, seeds, mode, budget, at=-0.5), base_end,
                 "issue 28's target: met when superior or equivalent"))
            for claim, stat, a, b, paper in claims:
                if a is None or b is None or len(seeds) < 2:
                    out.append(verdict(claim, stat, math.nan, (None, None), 0.0, "above",
                                       paper, note="missing runs", delta=delta,
                                       level=level).to_json())
                    continue
                d = paired_difference(a, b, level)
                out.append(verdict(claim, stat, d.estimate, d.ci, 0.0, "above", paper,
                                   note=f"{d.n_seeds} seeds x {d.n_tasks} tasks, paired",
                                   delta=delta, level=level, se=d.se, df=d.df).to_json())
    return out


def power_lines(n_arms: int, n_horizons: int, seeds: int, tasks: int, delta: float) -> list[str]:
    """What the design can detect before it runs (``Design``'s stated components; an AUC
    averages several evaluated versions, so its evaluation noise is at most this)."""
    design = Design()
    k = max(1, 2 * (n_arms - 1) * n_horizons)
    level = family_level(k)
    det = design.detectable(seeds, tasks, level)
    eq = design.detectable(seeds, tasks, level, "equivalence")
    need = design.seeds_needed(0.05, tasks, level)
    return [f"Power (analysis.verdicts.Design: sd_seed {design.sd_seed}, sd_task "
            f"{design.sd_task}, p {design.p}, rho {design.rho}; {k} claims, each at "
            f"{level:.2%}): with {seeds} seeds x {tasks} tasks a difference of "
            f"{det:.3f} is called superior with 80% power; a true 0 is called equivalent "
            f"with 80% power only for delta >= {eq:.3f} (registered delta {delta}); a "
            f"difference of 0.05 needs "
            f"{'more than 10,000' if need is None else need} seeds per arm."]


def calibration(run: Path) -> dict[str, Any] | None:
    """The D7 calibration a ``dsc`` run recorded (``reuse_params.json``): status, split,
    kappas, calibration trees and the new tool steps the calibration draws spent."""
    path = run / "reuse_params.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    cal = data.get("calibration") or {}
    return {"status": cal.get("status"), "iteration": cal.get("iteration"),
            "split": cal.get("split"), "trees": cal.get("trees"),
            "tool_steps": cal.get("tool_steps", 0),
            "kappas": {k: data.get(k) for k in ("kappa_R", "kappa_delta", "kappa_T",
                                                 "residual_var_R", "residual_var_delta",
                                                 "residual_var_T")}}


def workflow_regret(run: Path, store: str) -> dict[str, float] | None:
    """Mean decision regret max_a Q*(s0, a) - Q*(s0, chosen) over the stored trees a run
    resolved (chosen = the root action with the best value after the rule), and the
    fraction with regret > 0.02 (DSC-Gate's P(R > 0.02)); Q* from the workflow model."""
    from train.envs.workflow import WorkflowEnv
    from train.envs.workflow_model import WorkflowModel, WorkflowSpec

    log = run / "reuse.jsonl"
    if not log.is_file():
        return None
    records: dict[tuple[int, str], dict[str, Any]] = {}
    for line in log.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if "tree_id" not in r:  # a calibration line
            continue
        records[(r["iteration"], r["tree_id"])] = r  # a resumed iteration logs again
    trees = {t.tree_id: t for t in read_trees(store, sorted({k[1] for k in records}))}
    regrets = []
    for (_, tree_id), r in records.items():
        tree = trees[tree_id]
        values = {int(k): v for k, v in r["route_values"].items()}
        if len(values) < 2:
            continue
        model = WorkflowModel(WorkflowSpec.from_config((tree.env_config or {})["task"]))
        root = tree.root()
        s0 = WorkflowEnv.snapshot_state(tree.snapshots[root.snapshot_id or ""])
        q = {nid: model.optimal_values().q(s0, tree.node(nid).action_text) for nid in values}
        chosen = max(values, key=lambda nid: (values[nid], -nid))
        regrets.append(max(q.values()) - q[chosen])
    if not regrets:
        return None
    return {"mean": statistics.mean(regrets),
            "p_over_002": sum(x > 0.02 for x in regrets) / len(regrets), "n": len(regrets)}


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def report(results: list[dict[str, Any]], arms: list[str], seeds: list[int], budget: float,
           delta: float, head: list[str], out: Path) -> str:
    lines = [*head, "",
             "| H | arm | AUC sampled | AUC greedy | sampled at B | greedy at B | "
             "iterations | new tool steps | refresh steps | calibration steps (apart) | "
             "pairs reused / transported / refreshed | feasible pairs | clip frac | regret vs Q* | "
             "train s |",
             "|" + "---|" * 15]
    for h in sorted({r["horizon"] for r in results}):
        for arm in arms:
            runs = [r for r in results if r["horizon"] == h and r["arm"] == arm]
            if not runs:
                continue
            cells = []
            for mode, at in (("sampled", 1.0), ("greedy", 1.0), ("sampled", -1.0),
                             ("greedy", -1.0)):
                mat = arm_matrix(results, h, arm, sorted(r["seed"] for r in runs), mode,
                                 budget, at)
                if mat is None:
                    cells.append("-")
                    continue
                per_seed = mat.mean(axis=1)
                sd = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
                cells.append(f"{per_seed.mean():.3f} ± {sd:.3f}")

            def avg(key: str, rs: list[dict[str, Any]] = runs) -> float | None:
                vals = [float(r[key]) for r in rs if r.get(key) is not None]
                return statistics.mean(vals) if vals else None

            regs = [r["regret"]["mean"] for r in runs if r.get("regret")]
            lines.append(
                f"| {h} | {arm} | {' | '.join(cells)} | {_fmt(avg('iterations'), '.1f')} | "
                f"{_fmt(avg('new_tool_steps'), '.0f')} | {_fmt(avg('refresh_tool_steps'), '.0f')}"
                f" | {_fmt(avg('calibration_tool_steps'), '.0f')} | "
                f"{_fmt(avg('reused'), '.0f')} / {_fmt(avg('transported'), '.0f')} / "
                f"{_fmt(avg('refreshed'), '.0f')} | {_fmt(avg('feasible'), '.0f')} | "
                f"{_fmt(avg('clip_frac'), '.4f')} | "
                f"{_fmt(statistics.mean(regs) if regs else None, '.4f')} | "
                f"{_fmt(avg('seconds'), '.0f')} |")
    lines += ["", "AUC: mean held-out success over [0, B] new tool steps (B = "
              f"{budget:.0f}), per task interpolated between evaluated versions; ± is the sd "
              "over seeds. 'at B': success at B tool steps (interpolated). Calibration steps "
              "are dsc's D7 draws, not charged to the budget.", "", "## Verdicts", ""]
    vs = verdicts(results, arms, seeds, budget, delta)
    lines += verdict_lines(vs)
    for r in results:
        c = r.get("calibration")
        if c:
            lines.append(f"- {r['name']}: D7 calibration {c.get('status')} at iteration "
                         f"{c.get('iteration')} on {len(c.get('trees') or {})} held-apart trees, "
                         f"{c.get('tool_steps')} tool steps; kappas {c.get('kappas')}")
    text = "\n".join(lines)
    (out / "report.md").write_text("# Reuse experiment (issue 28)\n\n`" + " ".join(sys.argv)
                                   + "`\n\n" + text + "\n")
    (out / "verdicts.json").write_text(json.dumps(vs, indent=2) + "\n")
    return text


def plot(results: list[dict[str, Any]], arms: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    horizons = sorted({r["horizon"] for r in results})
    if not horizons:
        return
    fig, axes = plt.subplots(1, len(horizons), figsize=(7 * len(horizons), 4.5),
                             squeeze=False)
    for ax, h in zip(axes[0], horizons, strict=True):
        for j, arm in enumerate(arms):
            for i, r in enumerate(x for x in results if x["horizon"] == h and x["arm"] == arm):
                pts = r["curves"].get("sampled") or []
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, color=f"C{j % 10}", alpha=0.7, marker=".",
                            linestyle="-" if "@8" not in arm else "--",
                            label=arm if i == 0 else None)
        ax.set_title(f"workflow H={h}")
        ax.set_xlabel("new tool steps")
        ax.set_ylabel("held-out sampled success")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reuse_curve.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--horizons", default="12", help="comma-separated workflow horizons")
    ap.add_argument("--staleness", default="2,8", help="max_staleness values of the arms")
    ap.add_argument("--arms", default="", help="comma-separated RULE@STALENESS (and none) "
                    "instead of every rule at every staleness")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-ids", default="", help="comma-separated seeds to train (instead "
                    "of 0..SEEDS-1), e.g. one process per seed side by side; the report "
                    "covers every seed found")
    ap.add_argument("--budget", type=float, default=6000.0, help="new tool steps per run")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--delta", type=float, default=0.05, help="equivalence margin")
    ap.add_argument("--set", action="append", default=[], help="TrainConfig FIELD=VALUE")
    ap.add_argument("--power", action="store_true", help="print the power statement, train "
                    "nothing")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: report what the runs have committed")
    args = ap.parse_args()
    bad = [x for x in args.set if "=" not in x]
    if bad:
        raise SystemExit(f"error: --set takes FIELD=VALUE, got {bad[0]!r}")
    overrides = dict(item.split("=", 1) for item in args.set)
    horizons = _ints("--horizons", args.horizons)
    arms = ([Arm(a) for a in args.arms.split(",")] if args.arms
            else default_arms(_ints("--staleness", args.staleness)))
    if arms[0].rule != "none":
        arms.insert(0, Arm("none"))
    names = [a.name for a in arms]
    seeds = (_ints("--seed-ids", args.seed_ids, low=0) if args.seed_ids
             else list(range(args.seeds)))
    for flag, value in (("--seeds", args.seeds), ("--max-steps", args.max_steps)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    for flag, number in (("--budget", args.budget), ("--delta", args.delta)):
        if not (math.isfinite(number) and number > 0):
            raise SystemExit(f"error: {flag} must be a finite number > 0, got {number}")
    try:  # every run's settings, refused before anything trains
        cfg = load_config(None, {**DEFAULTS, **overrides, "steps": "1",
                                 "task_params": {"horizons": horizons[0]},
                                 "sampler_params": dict(SAMPLER_PARAMS)})
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    head = power_lines(len(arms), len(horizons), args.seeds, cfg.heldout_tasks, args.delta)
    print(head[0], flush=True)
    if args.power:
        return
    got = []
    for seed in sorted(set(seeds) | set(range(args.seeds))):
        if seed not in seeds:  # another process trains it: report what it committed
            got += [run_one(args.out, h, arm, seed, args.budget, args.max_steps, overrides,
                            train_more=False) for h in horizons for arm in arms]
            continue  # seed-major: a cut-short run still has complete seeds to compare
        for h in horizons:
            for arm in arms:
                got.append(run_one(args.out, h, arm, seed, args.budget, args.max_steps,
                                   overrides, train_more=not args.report_only))
    results = [r for r in got if r is not None]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"argv": sys.argv, "budget": args.budget, "arms": names, "results": results},
        indent=2) + "\n")
    done = sorted({r["seed"] for r in results})
    print(report(results, names, done, args.budget, args.delta, head, args.out))
    plot(results, names, args.out)


if __name__ == "__main__":
    main()
