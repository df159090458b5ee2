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

``--engine`` (issue 22) times, per sampler, the rollout engine (``collect.sample_trees``:
every tree of the tasks advanced together in one continuously batched decoder, rows
joining and leaving between tokens, with the HF backend's prefix cache) against the
tree-at-a-time path as it ran before the engine (one tree after another, each round of
a tree one whole ``sample_rows`` call over that tree's rows: ``Engine(policy,
continuous=False)`` per tree, without the prefix cache; ``--baseline-cache`` gives it
the cache, which measures the batching alone), sampling only (no store), side by side;
it checks that both made the same trees. Targets (issue 22): at least 3x for ``group``,
2.5x for ``bel`` and ``caliper`` (64 tasks x n_total 16).
``--eval N`` times the trainer's held-out evaluation of N calc tasks (one episode each,
sampled, then greedy) through the engine (``train.sampling.evaluation.run_episodes``
per mode) against the loop the trainer had before it (``_old_evaluate``, kept here only
as the baseline: lockstep, one ``sample`` call per step over every live task,
environments stepped one after another), and sampled alone.
Target: at least 4x (200 tasks).
``--decode-scaling`` times one decode step of the policy's model (its prefix in a
``BufferLayer`` cache of 100 or 300 keys) at 1 to 512 rows and prints the cost per row:
the ratio of the per-row cost at 16 rows (one group tree of n_total 16, the tree-at-a-time
batch) to the cheapest per-row cost at any size bounds what batching trees can save on
decode steps (prefill and tools aside).

    .venv/bin/python benchmarks/bench_collect.py --engine --tasks 64 --n-total 16 --repeat 1
    .venv/bin/python benchmarks/bench_collect.py --eval 200 --repeat 3
    .venv/bin/python benchmarks/bench_collect.py --decode-scaling --repeat 3
    .venv/bin/python benchmarks/bench_collect.py [--tasks 16 --n-total 16 --repeat 3]
        [--env calc --policy tiny] [--random-init --max-new-tokens 32] [--fallback]
    .venv/bin/python benchmarks/bench_collect.py --executors one processes ray --workers 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
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


ENGINE_TARGETS = {"group": 3.0, "bel": 2.5, "caliper": 2.5}
EVAL_TARGET = 4.0


def today(policy: Any, keep_cache: bool) -> Any:
    """The policy as the old path ran it: the HF backend without its cross-call prefix
    cache (the same weights and rendering), unless ``keep_cache``."""
    if keep_cache or getattr(policy, "prefix_cache", None) is None:
        return policy
    import copy

    old = copy.copy(policy)
    old.prefix_cache = None
    return old


def compare_engine(args: argparse.Namespace) -> None:
    """trees/min of the engine over the tree-at-a-time path, per sampler (``--engine``)."""
    from train.envs import make_env
    from train.sampling import make_sampler
    from train.sampling.collect import sample_trees, tree_id_for, tree_seed
    from train.sampling.engine import Engine, TreeJob

    env, policy, what = load(args.env, args.policy, args.fallback, args.random_init)
    baseline = today(policy, args.baseline_cache)
    tasks = env_class(env).generate_tasks(args.tasks, seed=0)
    print(f"engine vs tree at a time: {what}; {args.tasks} tasks x n_total {args.n_total}, "
          f"max_new_tokens {args.max_new_tokens}, {args.repeat} repeats; baseline prefix "
          f"cache {'on' if args.baseline_cache else 'off (today)'}")
    rows = []
    for name in args.samplers:
        t_one, t_engine = Timings("tree at a time"), Timings("engine")
        same = trees = 0
        for rep in range(args.repeat):
            params = {"max_new_tokens": args.max_new_tokens}
            sampler = make_sampler(name, **params)
            start = time.perf_counter()
            one_env = make_env(env)
            alone = [Engine(baseline, continuous=False).sample_trees([TreeJob(
                sampler, one_env, task, args.n_total, tree_seed(rep, task.task_id),
                tree_id_for("b", rep, task.task_id), "b")])[0] for task in tasks]
            one_env.close()
            t_one.seconds.append(time.perf_counter() - start)
            sampler = make_sampler(name, **params)
            start = time.perf_counter()
            together = sample_trees(env, policy, sampler, tasks, args.n_total, rep, "b")
            t_engine.seconds.append(time.perf_counter() - start)
            if name != "caliper":  # caliper's bucket counts carry over differently
                same += sum([n.action_token_ids for n in a.nodes] ==
                            [n.action_token_ids for n in b.nodes]
                            for a, b in zip(alone, together, strict=True))
                trees += len(alone)
        ratio = t_one.min / t_engine.min
        rows.append([name, f"{60 * args.tasks / t_one.min:.1f}",
                     f"{60 * args.tasks / t_engine.min:.1f}", f"{ratio:.2f}",
                     f"{t_one.median / t_engine.median:.2f}",
                     f"{same}/{trees}" if trees else "-"])
    print_table(["sampler", "trees/min one at a time", "trees/min engine", "x (min)",
                 "x (median)", "same tokens (trees)"], rows)
    for row in rows:
        target = ENGINE_TARGETS.get(row[0], 2.5)
        verdict(f"collect {row[0]} engine / tree at a time", float(row[3]),
                float(row[3]) >= target, f">= {target}")


def _old_evaluate(policy: Any, env_name: str, tasks: list[Task], seed: int,
                  max_new_tokens: int, top_p: float = 1.0) -> float:
    """The held-out loop before the engine (trainer ``evaluate``), the baseline only."""
    from train.envs import make_env
    from train.policies.base import SampleConfig
    from train.sampling.base import mix_seed

    envs = [make_env(env_name) for _ in tasks]
    turns: list[list[Any]] = [[("prompt", e.reset(t))] for e, t in zip(envs, tasks, strict=True)]
    active = list(range(len(tasks)))
    success = [0.0] * len(tasks)
    for step in range(max(t.max_steps for t in tasks)):
        if not active:
            break
        config = SampleConfig(n=1, max_new_tokens=max_new_tokens, top_p=top_p,
                              seed=mix_seed(seed, "eval", step))
        conts = policy.sample([turns[i] for i in active], config)
        still = []
        for i, [cont] in zip(active, conts, strict=True):
            result = envs[i].step(cont.text)
            turns[i] += [("action", cont.text), ("observation", result.observation)]
            if result.done:
                success[i] = float(result.reward_parts.get("reward", 0.0) >= 1.0)
            elif step + 1 < tasks[i].max_steps:
                still.append(i)
        active = still
    for e in envs:
        e.close()
    return sum(success) / len(success)


def compare_eval(args: argparse.Namespace) -> None:
    """Held-out evaluation through the engine vs the old loop (``--eval N``): the
    trainer's evaluation, sampled then greedy, and sampled alone."""
    from train.sampling.evaluation import GREEDY_TOP_P, run_episodes

    env, policy, what = load("calc", args.policy, args.fallback, args.random_init)
    tasks = env_class(env).generate_tasks(args.eval, seed=1)
    print(f"held-out evaluation: {what}; {args.eval} tasks, max_new_tokens "
          f"{args.max_new_tokens}, {args.repeat} repeats")
    names = ("old loop, sampled + greedy", "engine, sampled + greedy", "old loop, sampled",
             "engine, sampled")
    timings = {n: Timings(n) for n in names}
    rates: dict[str, list[float]] = {n: [] for n in names}
    old_policy = today(policy, args.baseline_cache)

    def timed(name: str, fn: Any) -> None:
        start = time.perf_counter()
        rates[name].append(fn())
        timings[name].seconds.append(time.perf_counter() - start)

    n_tokens = args.max_new_tokens
    for rep in range(args.repeat):
        timed(names[0], partial(lambda r: (
            _old_evaluate(old_policy, env, tasks, r, n_tokens),
            _old_evaluate(old_policy, env, tasks, r, n_tokens, GREEDY_TOP_P))[0], rep))
        timed(names[1], partial(lambda r: (
            run_episodes(policy, env, tasks, seed=r, max_new_tokens=n_tokens),
            run_episodes(policy, env, tasks, seed=r, max_new_tokens=n_tokens, greedy=True)
        )[0].success_rate, rep))
        timed(names[2], partial(_old_evaluate, old_policy, env, tasks, rep, n_tokens))
        timed(names[3], partial(lambda r: run_episodes(
            policy, env, tasks, seed=r, max_new_tokens=n_tokens).success_rate, rep))
    print_table(["", "min s", "median s", "sampled success (mean)"],
                [[t.name, f"{t.min:.2f}", f"{t.median:.2f}",
                  f"{statistics.mean(rates[t.name]):.3f}"] for t in timings.values()])
    ratio = timings[names[0]].min / timings[names[1]].min
    alone = timings[names[2]].min / timings[names[3]].min
    print(f"sampled alone: engine / old loop {alone:.2f}x")
    verdict(f"held-out evaluation (sampled + greedy) of {args.eval} tasks, engine / old loop",
            ratio, ratio >= EVAL_TARGET, f">= {EVAL_TARGET}")


def decode_scaling(args: argparse.Namespace) -> None:
    """Cost of one decode step of the policy's model by batch rows and keys
    (``--decode-scaling``): what batching rows can save at most (module docstring)."""
    import torch

    from train.policies.hf import buffered_cache

    _, policy, what = load(args.env, args.policy, False, args.random_init)
    model = getattr(policy, "model", None)
    if model is None:
        raise SystemExit(f"error: {what} has no transformers model to time")
    print(f"one decode step of {what}: {torch.get_num_threads()} torch threads, "
          f"{args.repeat} x 20 steps, min")
    rows_out: list[list[str]] = []
    per_row: dict[tuple[int, int], float] = {}
    for keys in (100, 300):
        for rows in (1, 16, 64, 128, 256, 512):
            ids = torch.randint(0, model.config.vocab_size, (rows, keys))
            best = float("inf")
            with torch.inference_mode():
                for _ in range(args.repeat):
                    cache = buffered_cache(model.config, 0)
                    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                    start = time.perf_counter()
                    for j in range(20):
                        model(input_ids=ids[:, :1], position_ids=torch.full((rows, 1), keys + j),
                              cache=cache, use_cache=True)
                    best = min(best, (time.perf_counter() - start) / 20)
            per_row[rows, keys] = best / rows
            rows_out.append([str(keys), str(rows), f"{best * 1e3:.2f}",
                             f"{best / rows * 1e6:.0f}"])
    print_table(["keys", "rows", "ms/step", "us per row"], rows_out)
    for keys in (100, 300):
        floor = min(v for (r, k), v in per_row.items() if k == keys and r >= 16)
        print(f"keys {keys}: decoding 16 rows per step (one group tree) costs "
              f"{per_row[16, keys] / floor:.2f}x the cheapest per-row cost of any batch: the "
              "most that batching trees can save on decode steps")


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
    ap.add_argument("--engine", action="store_true",
                    help="The engine vs tree at a time, per sampler (module docstring).")
    ap.add_argument("--baseline-cache", action="store_true",
                    help="Give the baselines the HF prefix cache too (the engine's batching "
                         "alone); by default they run without it, as before the engine.")
    ap.add_argument("--eval", type=int, default=0,
                    help="Time held-out evaluation of this many calc tasks instead.")
    ap.add_argument("--decode-scaling", action="store_true",
                    help="Time one decode step of the model by rows and keys instead.")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.decode_scaling:
        decode_scaling(args)
        return
    if args.engine:
        compare_engine(args)
        return
    if args.eval:
        compare_eval(args)
        return
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
