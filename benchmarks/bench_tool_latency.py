"""Tool latency is hidden: trees/min of an environment whose tool calls take ``--latency``
seconds (a sleep in ``step``, as a remote tool or a sandbox would wait) over the same
environment with instant tools, both collected through the engine
(``train.sampling.collect.sample_trees``: every tree of the tasks in flight, environment
work on the tool pool while the decoder runs other trees' rows).

Environment: ``calc`` with a sleep before each step (``SlowCalc``, registered here with
``register_env``); policy: the embedded tiny calc policy; sampler ``--sampler`` (bel);
``--tasks`` x ``--n-total``. The two sides alternate ``--repeat`` times; the ratio is
trees/min with latency over trees/min without (minima, medians beside). Also printed:
the engine's tool-pool size and the tool steps per tree.

Target (issue 44): at least 0.8x at 200 ms (64 tasks x n_total 16, bel).
Measured 2026-12-06 (2 cores, quiet): ``--lag 0`` (the engine as it was: every tool call
collected at the next decode step) 0.05x; ``--lag 24`` 0.69x; ``--lag 48`` 0.76-0.81x;
``--lag 96`` 0.85x (PASS). A tree still steps its branches one after another on its one
environment (35 tool steps per tree here, 7 s at 200 ms), which bounds what overlap
across trees can hide.

    .venv/bin/python benchmarks/bench_tool_latency.py --latency 0.2 --tasks 64 --n-total 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Timings, print_timings, verdict

from train.envs import StepResult, register_env, unregister_env
from train.envs.calc import CalcEnv

LATENCY = {"s": 0.0}


class SlowCalc(CalcEnv):
    """``calc`` whose every step first waits ``LATENCY["s"]`` seconds (and declares a
    ``tool_lag`` of ``--lag`` decode steps)."""

    def step(self, action_text: str) -> StepResult:
        if LATENCY["s"] > 0:
            time.sleep(LATENCY["s"])
        return super().step(action_text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", type=float, default=0.2, help="seconds per tool step")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--n-total", type=int, default=16)
    ap.add_argument("--sampler", default="bel")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--lag", type=int, default=96,
                    help="the env's tool_lag: decode steps a tool call may overlap (0: the "
                         "engine waits for every tool call at the next decode step)")
    args = ap.parse_args()
    for name in ("tasks", "n_total", "repeat"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.latency <= 10:
        sys.exit("--latency must be in 0..10 seconds")

    from train.policies import load_policy
    from train.sampling import make_sampler
    from train.sampling.chunks import sample_trees
    from train.sampling.engine import LAGGED_TOOL_THREADS, default_tool_threads

    if not 0 <= args.lag <= 10_000:
        sys.exit("--lag must be in 0..10000")
    SlowCalc.tool_lag = args.lag
    register_env("bench-slow-calc", SlowCalc)
    policy = load_policy("tiny", "calc")
    tasks = CalcEnv.generate_tasks(args.tasks, seed=1)
    sampler = make_sampler(args.sampler)
    sides = {"0 ms tools": Timings("0 ms tools"),
             f"{args.latency * 1000:.0f} ms tools": Timings(f"{args.latency * 1000:.0f} ms tools")}
    steps = 0
    try:
        for _ in range(args.repeat):
            for (label, t), latency in zip(sides.items(), (0.0, args.latency), strict=True):
                LATENCY["s"] = latency
                start = time.perf_counter()
                trees = sample_trees("bench-slow-calc", policy, sampler, tasks, args.n_total,
                                     0, "bench")
                t.seconds.append(time.perf_counter() - start)
                steps = sum(len(tr.nodes) - 1 for tr in trees)
                print(f"{label}: {t.seconds[-1]:.1f} s, "
                      f"{60 * len(trees) / t.seconds[-1]:.1f} trees/min", flush=True)
    finally:
        unregister_env("bench-slow-calc")
    base, slow = sides.values()
    print(f"tool_lag {args.lag} decode steps; tool pool {default_tool_threads()} threads "
          f"({LAGGED_TOOL_THREADS} for lagged steps); {steps / args.tasks:.1f} tool steps per "
          f"tree ({args.sampler}, {args.tasks} tasks x n_total {args.n_total})")
    print_timings([base, slow], base)
    ratio = base.min / slow.min
    verdict(f"trees/min with {args.latency * 1000:.0f} ms tools over instant tools "
            f"(median {base.median / slow.median:.2f}x)", ratio, ratio >= 0.8, ">= 0.8x")


if __name__ == "__main__":
    main()
