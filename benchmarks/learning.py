"""The learning experiment of issue 11: does the default ``rtrees train`` run learn?

Runs ``train.trainer.train`` with the default ``TrainConfig`` (the tiny calc policy) for
``grpo``+``group`` and ``elpo``+``bel``, over ``--seeds`` seeds each, and writes to
``--out``: ``results.json``, ``report.md`` (mean and std over seeds of held-out sampled
and greedy success at the start and the end, the gain, new tool steps) and
``learning_curve.png`` (held-out sampled success against iteration). The claim checked:
gain > 2 x the seed-to-seed std of the final held-out success.

    .venv/bin/python benchmarks/learning.py --out out/learning          # the full run
    .venv/bin/python benchmarks/learning.py --out /tmp/l --set steps=2 --set heldout_tasks=20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.config import load_config
from train.trainer import read_metrics, train

RECIPES = {"grpo+group": {"credit": "grpo", "sampler": "group"},
           "elpo+bel": {"credit": "elpo", "sampler": "bel"}}


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--set", action="append", default=[], help="TrainConfig FIELD=VALUE")
    args = ap.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    results: dict[str, list[dict[str, object]]] = {}
    for name in args.recipes.split(","):
        for seed in range(args.seeds):
            run = args.out / f"{name}-seed{seed}"
            cfg = load_config(None, {**RECIPES[name], **overrides, "seed": str(seed),
                                     "store": str(args.out / "store"), "out": str(run),
                                     "run_id": f"{name}-seed{seed}"})
            train(cfg, resume=(run / "config.json").exists())
            m = read_metrics(cfg.store, cfg.resolved_run_id)
            curve = m.get("heldout_sampled", [])
            results.setdefault(name, []).append({
                "seed": seed, "curve": curve,
                "start_sampled": curve[0][1], "end_sampled": curve[-1][1],
                "start_greedy": m["heldout_greedy"][0][1], "end_greedy": m["heldout_greedy"][-1][1],
                "new_tool_steps": sum(v for _, v in m["new_tool_steps"]),
                "seconds": sum(v for k in ("seconds_sample", "seconds_commit", "seconds_credit",
                                           "seconds_train", "seconds_eval")
                               for _, v in m.get(k, []))})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["| recipe | start sampled | end sampled | gain | 2 x std(end) | learns | "
             "end greedy | new tool steps | minutes/run |", "|" + "---|" * 9]
    for name, runs in results.items():
        start = [float(r["start_sampled"]) for r in runs]  # type: ignore[arg-type]
        end = [float(r["end_sampled"]) for r in runs]  # type: ignore[arg-type]
        greedy = [float(r["end_greedy"]) for r in runs]  # type: ignore[arg-type]
        tools = [float(r["new_tool_steps"]) for r in runs]  # type: ignore[arg-type]
        gain = statistics.mean(end) - statistics.mean(start)
        lines.append(
            f"| {name} | {statistics.mean(start):.3f} ± {_std(start):.3f} | "
            f"{statistics.mean(end):.3f} ± {_std(end):.3f} | {gain:+.3f} | {2 * _std(end):.3f} | "
            f"{'yes' if gain > 2 * _std(end) else 'no'} | {statistics.mean(greedy):.3f} | "
            f"{statistics.mean(tools):.0f} | "
            f"{statistics.mean(float(r['seconds']) for r in runs) / 60:.1f} |")  # type: ignore[arg-type]
    (args.out / "report.md").write_text("# Learning experiment (issue 11)\n\n" +
                                        "\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in results.items():
        for r in runs:
            xs = [s + 1 for s, _ in r["curve"]]  # type: ignore[attr-defined]
            ys = [v for _, v in r["curve"]]  # type: ignore[attr-defined]
            ax.plot(xs, ys, label=f"{name} seed {r['seed']}", alpha=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out sampled success")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "learning_curve.png", dpi=120)
    print(f"wrote {args.out}/report.md, results.json, learning_curve.png")


if __name__ == "__main__":
    main()
