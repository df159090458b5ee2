"""Collection throughput: trees per minute of ``group``, ``bel`` and ``caliper`` at equal n_total.

Each side is one ``train.sampling.collect.collect`` call (sampling, environment
steps and snapshots, validation and store commits) of ``--tasks`` tasks into a
fresh temporary store, with ``--n-total`` rollouts per tree and one worker.
Samplers are timed alternately, ``--repeat`` times; the ratios are trees/min of
each sampler over ``group``'s, from the minima (medians beside them).

Policy: ``load_policy("tiny", "calc")`` (the embedded tiny model on ``calc``)
when it loads (it needs a trained checkpoint: ``rtrees policy init --env calc``;
``--random-init`` takes fresh weights instead); otherwise, and with
``--fallback``, a uniform tabular policy on ``workflow`` (the script says which
it ran, and why). BEL explores in lockstep batches but probes one anchor at a time;
CALIPER resamples one position per chunk of K, so both make more, smaller
policy calls than ``group``'s single batch of n_total; the table shows the
policy calls per tree.

Target [ours; issue 6 sets none]: bel and caliper keep at least 0.5x of
group's trees per minute.

``--executors`` (issue 16) instead times one sampler (the first of ``--samplers``) on
each way ``collect`` runs its chunks: ``one`` process, ``processes`` (``--workers``
spawned processes) and ``ray`` (``--workers`` actors on a local Ray instance with
``--workers`` CPUs, started once before the timings; its start-up is printed apart, the
actors' start is inside each timing). Workers need the policy as a spec, so this mode
takes ``--policy`` on ``--env`` (``tabular`` on workflow with ``--fallback``). Ratios
are trees/min over ``one``'s; no target (on 2 cores the ceiling is 2x).

    .venv/bin/python benchmarks/bench_collect.py [--tasks 16 --n-total 16 --repeat 3]
        [--env calc --policy tiny] [--random-init --max-new-tokens 32] [--fallback]
    .venv/bin/python benchmarks/bench_collect.py --executors one processes ray --workers 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Timings, print_table, verdict

from rollout_store import Store, read_trees
from train.envs import Task, env_class
from train.policies.tabular import UniformWorkflowPolicy
from train.sampling.collect import CollectReport, collect

TARGET = 0.5


def load(env: str, spec: str, fallback: bool, random_init: bool) -> tuple[str, Any, str]:
    """(env, policy, description): ``load_policy(spec, env)``, else the tabular fallback."""
    why = "--fallback"
    if not fallback:
        try:
            from train.policies import load_policy  # type: ignore[attr-defined,unused-ignore]

            kw = {"random_init": True} if random_init else {}
            return env, load_policy(spec, env, **kw), \
                f"{spec}{' (random init)' if random_init else ''} on {env}"
        except ImportError:
            why = "train.policies.load_policy does not exist"
        except (RuntimeError, FileNotFoundError, ValueError) as exc:  # e.g. no checkpoint
            why = f"load_policy({spec!r}, {env!r}) failed: {str(exc).splitlines()[0]}"
    return "workflow", UniformWorkflowPolicy("uniform-tabular"), \
        f"uniform tabular policy on workflow (FALLBACK: {why})"


def timed_collect(root: Path, label: str, rep: int, timings: Timings, env: str, policy: Any,
                  sampler: str, tasks: list[Task], n_total: int, **options: Any
                  ) -> tuple[Store, CollectReport]:
    """One timed ``collect`` (seed ``rep``, run id ``bench-{label}``, no progress bar) into a
    fresh store ``root/{label}-{rep}``; its seconds go to ``timings``. ``options`` are
    ``collect``'s keyword options."""
    store = Store(root / f"{label}-{rep}", create=True)
    start = time.perf_counter()
    report = collect(store, env, policy, sampler, tasks, n_total, seed=rep,
                     run_id=f"bench-{label}", progress=False, **options)
    timings.seconds.append(time.perf_counter() - start)
    return store, report


def compare_executors(args: argparse.Namespace) -> None:
    """trees/min of one sampler run by each executor (``--executors``)."""
    env, spec = ("workflow", "tabular") if args.fallback else (args.env, args.policy)
    sampler = args.samplers[0]
    tasks = env_class(env).generate_tasks(args.tasks, seed=0)
    ray_started = None
    if "ray" in args.executors:
        import logging

        import ray

        start = time.perf_counter()
        ray.init(num_cpus=args.workers, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)
        ray_started = time.perf_counter() - start
    print(f"collect executors: {sampler}, policy {spec} on {env}; {args.tasks} tasks x "
          f"n_total {args.n_total}, {args.workers} workers, {args.commit_trees} trees per "
          f"commit, {args.repeat} repeats" + (f"; ray.init {ray_started:.1f} s (not timed)"
                                                if ray_started is not None else ""))
    options: dict[str, dict[str, Any]] = {
        "one": {}, "processes": {"workers": args.workers},
        "ray": {"workers": args.workers, "ray": "auto"}}
    timings = {name: Timings(name) for name in args.executors}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for name in args.executors:
                _, report = timed_collect(Path(tmp), name, rep, timings[name], env, spec,
                                          sampler, tasks, args.n_total,
                                          commit_trees=args.commit_trees, **options[name])
                assert report.trees == args.tasks, report.summary()
    base = timings[args.executors[0]]
    rows = [[name, f"{t.min:.2f}", f"{t.median:.2f}", f"{60 * args.tasks / t.min:.1f}",
             f"{60 * args.tasks / t.median:.1f}", f"{base.min / t.min:.2f}",
             f"{base.median / t.median:.2f}"] for name, t in timings.items()]
    print_table(["executor", "min s", "median s", "trees/min (min)", "trees/min (median)",
                 f"x {base.name} (min)", f"x {base.name} (median)"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="calc")
    ap.add_argument("--policy", default="tiny")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--n-total", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--samplers", nargs="+", default=["group", "bel", "caliper"])
    ap.add_argument("--fallback", action="store_true", help="Use the tabular workflow policy.")
    ap.add_argument("--random-init", action="store_true",
                    help="tiny with fresh random weights (no checkpoint needed; its steps run "
                         "to --max-new-tokens, so this measures compute, not a real mix)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--executors", nargs="+", choices=["one", "processes", "ray"],
                    help="Compare executors instead of samplers (module docstring).")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--commit-trees", type=int, default=2)
    args = ap.parse_args()
    if args.executors:
        compare_executors(args)
        return
    if "group" not in args.samplers:
        args.samplers.insert(0, "group")

    env, policy, what = load(args.env, args.policy, args.fallback, args.random_init)
    label = what.split(" (FALLBACK")[0]
    tasks = env_class(env).generate_tasks(args.tasks, seed=0)
    print(f"collect throughput: {what}; {args.tasks} tasks x n_total {args.n_total}, "
          f"{args.repeat} repeats")
    timings = {name: Timings(name) for name in args.samplers}
    stats: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for name in args.samplers:
                store, report = timed_collect(
                    Path(tmp), name, rep, timings[name], env, policy, name, tasks,
                    args.n_total, sampler_params={"max_new_tokens": args.max_new_tokens})
                if rep == 0:
                    trees = read_trees(store)
                    metas = [t.meta or {} for t in trees]
                    stats[name] = {
                        "nodes": report.nodes / len(trees),
                        "calls": statistics.mean(m.get("policy_calls", 0) for m in metas),
                        "success": statistics.mean(
                            statistics.mean(float(leaf.reward or 0.0) for leaf in t.leaves())
                            for t in trees),
                    }
    base = timings["group"]
    rows = []
    for name in args.samplers:
        t = timings[name]
        tpm_min, tpm_med = 60 * args.tasks / t.min, 60 * args.tasks / t.median
        rows.append([name, f"{t.min:.2f}", f"{tpm_min:.1f}", f"{tpm_med:.1f}",
                     f"{base.min / t.min:.2f}", f"{base.median / t.median:.2f}",
                     f"{stats[name]['nodes']:.1f}", f"{stats[name]['calls']:.1f}",
                     f"{stats[name]['success']:.2f}"])
    print_table(["sampler", "min s", "trees/min (min)", "trees/min (median)", "x group (min)",
                 "x group (median)", "nodes/tree", "policy calls/tree", "leaf success"], rows)
    for name in args.samplers:
        if name == "group":
            continue
        ratio = base.min / timings[name].min
        verdict(f"collect {name}/group trees per minute ({label})", ratio,
                ratio >= TARGET, f">= {TARGET}")


if __name__ == "__main__":
    main()
