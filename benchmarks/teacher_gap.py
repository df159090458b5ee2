"""Can FACTOR's teacher read the feedback? (issue 47; docs/METHODS.md F7)

Collects trees with the tiny policy (or reads the store in ``OUT/store`` when it holds
trees already), scores them under the same policy as F3's student (kind ``plain``) and as
its teacher in each context (``template``: the issue-24 suffix; ``turn``: the feedback as
the policy's next tool-response turn), then reports, per context, the likelihood gap on
format tokens against content tokens and the correlation of the content gap with each
step's later success (``analysis.teacher_gap``), with the pre-registered verdicts
(format-neutral: median |gap| <= 0.1 on format tokens; informative: the 95% interval of r
above 0). Writes ``OUT/teacher_gap.json``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/teacher_gap.py --out out/gap-calc
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/teacher_gap.py --out out/gap-wf \\
        --env workflow --task-param horizons=12 --tasks 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from analysis.teacher_gap import FORMAT_BOUND, teacher_gap_check
from rollout_store.reader import connect
from rollout_store.store import Store
from train.credit.base import HINDSIGHT_KINDS, PLAIN


def _task_params(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = json.loads(value) if value[:1] in "[{0123456789tf" else value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--env", default="calc")
    ap.add_argument("--policy", default="tiny", help="load_policy spec (tiny or hf:DIR)")
    ap.add_argument("--sampler", default="bel", help="branching, so later success is a "
                    "subtree mean")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--n-total", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--contexts", default="template,turn")
    ap.add_argument("--boot", type=int, default=2000)
    args = ap.parse_args()

    from train.envs import env_class
    from train.policies import load_policy
    from train.sampling.collect import collect
    from train.scoring import ensure_scores

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "store"
    store = Store(str(path), create=not path.exists())
    t0 = time.perf_counter()
    n_trees = connect(store).execute("SELECT count(*) FROM trees").fetchone()
    if not n_trees or not n_trees[0]:
        policy = load_policy(args.policy, args.env)
        tasks = env_class(args.env).generate_tasks(args.tasks, args.seed,
                                                   **_task_params(args.task_param))
        collect(store, args.env, policy, args.sampler, tasks, args.n_total, args.seed,
                "teacher-gap", progress=False)
    t1 = time.perf_counter()
    contexts = args.contexts.split(",")
    version, _ = ensure_scores(store, PLAIN, args.policy)
    for c in contexts:
        ensure_scores(store, HINDSIGHT_KINDS[c], args.policy)
    t2 = time.perf_counter()
    report: dict[str, Any] = {"env": args.env, "policy": args.policy, "policy_version":
                              version, "sampler": args.sampler, "tasks": args.tasks,
                              "n_total": args.n_total, "seed": args.seed,
                              "task_params": _task_params(args.task_param),
                              "format_bound": FORMAT_BOUND, "contexts": {},
                              "seconds": {"collect": t1 - t0, "score": t2 - t1}}
    print(f"{args.env}, {args.policy} ({version}), {args.sampler} trees, {args.tasks} tasks "
          f"x n_total {args.n_total}; collect {t1 - t0:.0f} s, score {t2 - t1:.0f} s")
    print("| context | format tokens: median abs gap (mean) | content tokens: median abs "
          "gap (mean) | r(content gap, later success) [95% CI] | nodes / trees | "
          "format-neutral | informative |")
    print("|---|---|---|---|---|---|---|")
    for c in contexts:
        s = teacher_gap_check(store, HINDSIGHT_KINDS[c], version).summary(args.boot)
        report["contexts"][c] = s
        print(f"| {c} | {s['format_median_abs_gap']:.3f} ({s['format_mean_gap']:+.3f}; "
              f"{s['format_tokens']}) | {s['content_median_abs_gap']:.3f} "
              f"({s['content_mean_gap']:+.3f}; {s['content_tokens']}) | "
              f"{s['r_content_gap_success']:+.3f} [{s['r_ci95'][0]:+.3f}, "
              f"{s['r_ci95'][1]:+.3f}] | {s['nodes']} / {s['trees']} | "
              f"{'yes' if s['format_neutral'] else 'no'} | "
              f"{'yes' if s['informative'] else 'no'} |")
    (out / "teacher_gap.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
