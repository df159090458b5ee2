"""The reuse experiment of issue 12: does reusing stored trees save interaction?

For each env (``workflow``, ``calc``), each arm (by default every rule of
``train.reuse.resolve.RULES`` and ``none``: ``all``, ``transport``, ``dsc``, ``refresh``,
``m2po``, ``prox-interp``; ``--rules NAME=RULE:KEY=VALUE;...`` names an arm with its own
``reuse_params``, e.g. ``utd3=all:stored_passes=3``) and each of ``--seeds`` seeds,
``rtrees train`` (the tiny policy) runs one iteration at a time (``--resume``) until the
run has spent ``--budget`` NEW tool steps (fresh trees plus refreshes) or ``--max-steps``
iterations, with held-out success measured after every iteration. So the arms are
compared at equal new tool steps.

Writes to ``--out``: ``results.json``; ``report.md`` with, per env and rule, held-out
sampled success at the budget (mean and std over seeds), iterations, new tool steps,
pairs reused / transported / refreshed, refresh tool steps and what a refresh of every
stored trajectory would have cost, the tool steps ``dsc`` saved against ``refresh``, and
on workflow the decision regret of each rule against the env's exact optimal Q* values
(``WorkflowModel.optimal_values``; the leader a rule picks at a stored tree's root is
the root action with the best value after the rule, from the run's ``reuse.jsonl``);
and ``reuse_curve.png`` (held-out sampled success against new tool steps).

    .venv/bin/python benchmarks/reuse.py --out out/reuse                 # the full run
    .venv/bin/python benchmarks/reuse.py --out /tmp/r --seeds 1 --budget 40 \\
        --set heldout_tasks=8 --set tasks_per_step=2 --set n_total=3      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_store.reader import read_trees
from train.config import load_config
from train.reuse.params import REUSE_MODES
from train.trainer import read_metrics, train

RULES: tuple[str, ...] = REUSE_MODES
"""The default arms: one per rule, no extra ``reuse_params``."""


def parse_arm(text: str) -> tuple[str, str, str]:
    """``NAME=RULE:KEY=VALUE;KEY=VALUE`` (or a bare rule name) -> (arm name, rule,
    ``reuse_params`` text with commas); a one-line ``SystemExit`` for an unknown rule."""
    name, _, spec = text.partition("=") if "=" in text.split(":", 1)[0] else ("", "", text)
    rule, _, params = spec.partition(":")
    if rule not in REUSE_MODES:
        raise SystemExit(f"error: arm {text!r}: unknown rule {rule!r}; rules: "
                         f"{', '.join(REUSE_MODES)}")
    return name or rule, rule, params.replace(";", ",")
DEFAULTS: dict[str, str] = {"tasks_per_step": "8", "n_total": "4", "heldout_tasks": "64",
                            "eval_every": "1", "reuse_per_step": "8", "max_staleness": "4",
                            "minibatches": "2", "progress": "false"}


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _cum(points: list[tuple[int, float]]) -> dict[int, float]:
    total, out = 0.0, {}
    for step, value in sorted(points):
        total += value
        out[step] = total
    return out


def run_one(out: Path, env: str, arm: str, seed: int, budget: float, max_steps: int,
            overrides: dict[str, str], report_only: bool = False) -> dict[str, Any] | None:
    """Train (resumably) until ``budget`` new tool steps or ``max_steps`` iterations, then
    read the run's metrics; ``report_only``: only read what the run has committed so far
    (None when it has no finished iteration)."""
    label, rule, params = parse_arm(arm)
    name = f"{env}-{label}-seed{seed}"
    run = out / name
    base = {**DEFAULTS, **overrides, "env": env, "reuse": rule, "seed": str(seed),
            "store": str(out / "stores" / name), "out": str(run), "run_id": name}
    if params:
        base["reuse_params"] = ",".join(x for x in (overrides.get("reuse_params", ""), params)
                                        if x)
    cfg = load_config(None, {**base, "steps": "1"})
    for k in range(1, 0 if report_only else max_steps + 1):
        cfg = load_config(None, {**base, "steps": str(k)})
        if not (run / "checkpoints" / f"step-{k:06d}").is_dir():  # else: an earlier call did
            train(cfg, resume=(run / "config.json").exists())
        m = read_metrics(cfg.store, name)
        if sum(v for s, v in m["new_tool_steps"] if s < k) >= budget:
            break
    if not (out / "stores" / name).is_dir():
        return None
    m = read_metrics(str(out / "stores" / name), name)
    if not m.get("new_tool_steps"):
        return None
    tools = _cum(m["new_tool_steps"])
    curve = [(0.0, v) for s, v in m.get("heldout_sampled", []) if s == -1]
    curve += [(tools[s], v) for s, v in m.get("heldout_sampled", []) if s >= 0]

    def total(key: str) -> float:
        return sum(v for _, v in m.get(key, []))

    return {"env": env, "rule": label, "reuse": rule, "seed": seed, "curve": curve,
            "final": curve[-1][1] if curve else float("nan"),
            "iterations": len(m["loss"]), "new_tool_steps": total("new_tool_steps"),
            "reused": total("reuse_pairs_reuse"), "transported": total("reuse_pairs_transport"),
            "refreshed": total("reuse_pairs_refresh"),
            "refresh_tool_steps": total("reuse_new_tool_steps"),
            "refresh_all_tool_steps": total("reuse_refresh_all_tool_steps"),
            "is_weight_mean": statistics.mean(v for _, v in m["is_weight_mean"])
            if m.get("is_weight_mean") else 1.0,
            "extra_optimizer_steps": total("reuse_extra_optimizer_steps"),
            "prox_forward_tokens_saved": total("reuse_prox_forward_tokens_saved"),
            "m2po_masked_frac": statistics.mean(v for _, v in m["m2po_masked_frac"])
            if m.get("m2po_masked_frac") else None,
            "regret": workflow_regret(run, cfg.store) if env == "workflow" and rule != "none"
            else None, "calibration": calibration(run) if rule == "dsc" else None}


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


def _fewer(a: float, b: float) -> str:
    """``a`` against ``b`` as "N% fewer" or "N% more"."""
    if not b:
        return "no baseline"
    pct = (1.0 - a / b) * 100.0
    return f"{abs(pct):.0f}% {'fewer' if pct >= 0 else 'more'}"


def report(results: list[dict[str, Any]], out: Path) -> str:
    arms = list(dict.fromkeys(r["rule"] for r in results))
    lines = ["| env | rule | held-out sampled at budget | iterations | new tool steps | "
             "pairs reused / transported / refreshed | refresh tool steps | refresh-all "
             "would spend | mean w | regret vs Q* (workflow) |", "|" + "---|" * 10]
    for env in sorted({r["env"] for r in results}):
        for rule in arms:
            runs = [r for r in results if r["env"] == env and r["rule"] == rule]
            if not runs:
                continue
            final = [r["final"] for r in runs]

            def mean(key: str, rs: list[dict[str, Any]] = runs) -> float:
                return statistics.mean(float(r[key]) for r in rs)

            regs = [r["regret"]["mean"] for r in runs if r["regret"]]
            p02 = [r["regret"]["p_over_002"] for r in runs if r["regret"]]
            reg = (f"{statistics.mean(regs):.4f} (P>0.02 {statistics.mean(p02):.2f})"
                   if regs else "-")
            lines.append(
                f"| {env} | {rule} | {statistics.mean(final):.3f} ± {_std(final):.3f} | "
                f"{mean('iterations'):.1f} | {mean('new_tool_steps'):.0f} | "
                f"{mean('reused'):.0f} / {mean('transported'):.0f} / {mean('refreshed'):.0f} | "
                f"{mean('refresh_tool_steps'):.0f} | {mean('refresh_all_tool_steps'):.0f} | "
                f"{mean('is_weight_mean'):.3f} | {reg} |")
        dsc = [r for r in results if r["env"] == env and r["reuse"] == "dsc"]
        ref = [r for r in results if r["env"] == env and r["reuse"] == "refresh"]
        if dsc and ref:
            a = statistics.mean(float(r["refresh_tool_steps"]) for r in dsc)
            cal = statistics.mean(float((r["calibration"] or {}).get("tool_steps") or 0)
                                  for r in dsc)
            b = statistics.mean(float(r["refresh_tool_steps"]) for r in ref)
            lines.append(f"\n{env}: dsc spent {a:.0f} stored-tree tool steps ({cal:.0f} of "
                         f"them on the D7 calibration draws) vs {b:.0f} for refresh "
                         f"({_fewer(a, b)}; without the calibration {_fewer(a - cal, b)}; "
                         "DSC-Gate reports 39% fewer than a gap gate at matched regret)\n")
            for r in dsc:
                c = r["calibration"] or {}
                kap = c.get("kappas") or {}
                lines.append(f"- dsc seed {r['seed']}: calibration {c.get('status')} at "
                             f"iteration {c.get('iteration')} on {len(c.get('trees') or {})} "
                             f"held-apart trees ({c.get('split')}); kappa_R "
                             f"{kap.get('kappa_R')}, kappa_delta {kap.get('kappa_delta')}, "
                             f"kappa_T {kap.get('kappa_T')}")
    text = "\n".join(lines)
    (out / "report.md").write_text("# Reuse experiment (issue 12)\n\n`" + " ".join(sys.argv)
                                   + "`\n\n" + text + "\n")
    return text


def plot(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = sorted({r["env"] for r in results})
    if not envs:
        return
    fig, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4), squeeze=False)
    arms = list(dict.fromkeys(r["rule"] for r in results))
    for ax, env in zip(axes[0], envs, strict=True):
        for rule in arms:
            for i, r in enumerate(x for x in results if x["env"] == env and x["rule"] == rule):
                xs, ys = zip(*r["curve"], strict=True) if r["curve"] else ((), ())
                ax.plot(xs, ys, color=f"C{arms.index(rule) % 10}", alpha=0.7,
                        label=rule if i == 0 else None)
        ax.set_title(env)
        ax.set_xlabel("new tool steps")
        ax.set_ylabel("held-out sampled success")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reuse_curve.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--envs", default="workflow,calc")
    ap.add_argument("--rules", default=",".join(RULES),
                    help="comma-separated arms: a rule, or NAME=RULE:KEY=VALUE;... "
                    "(reuse_params of that arm)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-ids", default="", help="comma-separated seeds (instead of "
                    "0..SEEDS-1): one process per seed runs them side by side")
    ap.add_argument("--budget", type=float, default=1500.0, help="new tool steps per run")
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--set", action="append", default=[], help="TrainConfig FIELD=VALUE")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: report the iterations the runs have finished")
    args = ap.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    for arm in args.rules.split(","):
        parse_arm(arm)  # refuse a bad arm before anything runs
    got = [run_one(args.out, env, rule, seed, args.budget, args.max_steps, overrides,
                   args.report_only)
               for env in args.envs.split(",") for rule in args.rules.split(",")
               for seed in ([int(x) for x in args.seed_ids.split(",")] if args.seed_ids
                            else range(args.seeds))]
    results = [r for r in got if r is not None]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"argv": sys.argv, "results": results}, indent=2) + "\n")
    print(report(results, args.out))
    plot(results, args.out)


if __name__ == "__main__":
    main()
