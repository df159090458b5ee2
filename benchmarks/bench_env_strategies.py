"""Restore cost of the three snapshot strategies, and the memory of frozen fork copies
(issue 44, item 3).

One environment, ``calc``, under each strategy: ``native`` (``CalcEnv``'s own JSON
snapshot), ``replay`` (``ReplayEnv``: reset plus a replay of the log, O(depth) steps) and
``fork`` (``ForkEnv``: the env in a worker process, a snapshot a frozen fork of it, a
restore a fork of that copy, O(1) steps). For depths 1, 4 and 16 it takes a snapshot,
then ``--repeat`` times steps once away from it and times ``restore`` (the step moves the
env, so no restore is a no-op), and prints the p50 / p99 of the restores beside the time
of one step under that strategy (for fork, a round trip to the worker).

Memory: a fork env holding ``--frozen`` (default 64, the default ``RTREES_FORK_POOL``)
frozen copies, one per step of an episode, measured with psutil over its processes (the
supervisor, the live worker and the copies): RSS summed over processes is the ceiling (it
counts every shared copy-on-write page once per process), PSS the fair share, and USS
(pages private to one process) the floor; a copy costs its USS plus the pages its env
writes later.

Target: fork restores are flat in depth (p50 at depth 16 at most 1.5x p50 at depth 1).
Run from the repository root (about 5 s)::

    .venv/bin/python benchmarks/bench_env_strategies.py      # --repeat 100 --frozen 64
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable

import psutil
from _common import mib, print_table, timed, verdict

from train.envs.base import Environment
from train.envs.calc import CalcEnv
from train.envs.fork import ForkEnv
from train.envs.strategies import ReplayEnv

DEPTHS = (1, 4, 16)
TARGET = 1.5
ACTION = '<tool_call>{"name": "calc", "arguments": {"expr": "(17*23)+5"}}</tool_call>'
TASK = dataclasses.replace(CalcEnv.generate_tasks(1, seed=0)[0], max_steps=10_000)

STRATEGIES: dict[str, Callable[[], Environment]] = {
    "native": CalcEnv,
    "replay": lambda: ReplayEnv(CalcEnv()),
    "fork": lambda: ForkEnv(CalcEnv, "calc"),
}


def quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def restore_times(env: Environment, depth: int, repeat: int) -> list[float]:
    """Seconds of ``repeat`` restores of the snapshot at ``depth``, each after one step."""
    env.reset(TASK)
    for _ in range(depth):
        env.step(ACTION)
    snap = env.snapshot()
    times = []
    for _ in range(repeat):
        env.step(ACTION)
        times.append(timed(lambda: env.restore(snap)))
    return times


def step_time(env: Environment, n: int) -> float:
    env.reset(TASK)
    return statistics.median(timed(lambda: env.step(ACTION)) for _ in range(n))


def frozen_memory(n_frozen: int) -> list[list[object]]:
    """Rows (what, processes, RSS, PSS, USS) of a fork env holding ``n_frozen`` copies."""
    env = ForkEnv(CalcEnv, "calc", pool_size=n_frozen)
    try:
        env.reset(TASK)
        for _ in range(n_frozen):
            env.step(ACTION)
            env.snapshot()
        pids = env.pids()
        assert len(pids) == 2 + n_frozen, pids
        info = [psutil.Process(p).memory_full_info() for p in pids]
        rows: list[list[object]] = []
        for what, part in (("supervisor", info[:1]), ("live worker", info[1:2]),
                           (f"{n_frozen} frozen copies", info[2:]), ("all", info)):
            rows.append([what, len(part), mib(sum(m.rss for m in part)),
                         mib(sum(getattr(m, "pss", 0) for m in part)),
                         mib(sum(m.uss for m in part))])
        per = info[2:]
        rows.append(["one frozen copy (median)", 1,
                     mib(statistics.median(m.rss for m in per)),
                     mib(statistics.median(getattr(m, "pss", 0) for m in per)),
                     mib(statistics.median(m.uss for m in per))])
        return rows
    finally:
        env.close()


class ForkCalc(CalcEnv):
    """``calc`` declared ``fork``: ``make_env`` builds it in a worker process."""

    snapshot_strategy = "fork"


def collect_memory(n_trees: int, n_total: int) -> tuple[float, float, int, float]:
    """Collect ``n_trees`` BEL trees of ``ForkCalc`` (the tiny calc policy, every tree in
    flight at once through the engine) while a thread samples, every 50 ms, the summed RSS
    and USS of this process's fork processes; (peak RSS, peak USS, most processes, seconds)."""
    import threading
    import time

    from train.envs import register_env, unregister_env
    from train.policies import load_policy
    from train.sampling import make_sampler
    from train.sampling.chunks import sample_trees

    register_env("bench-fork-calc", "bench_env_strategies:ForkCalc")  # importable by workers
    me = psutil.Process()
    peak = {"rss": 0.0, "uss": 0.0, "n": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            rss = uss = 0.0
            kids = me.children(recursive=True)
            for kid in kids:
                try:
                    info = kid.memory_full_info()
                except psutil.Error:  # gone between listing and reading
                    continue
                rss, uss = rss + info.rss, uss + info.uss
            peak["rss"], peak["uss"] = max(peak["rss"], rss), max(peak["uss"], uss)
            peak["n"] = max(peak["n"], len(kids))

    policy = load_policy("tiny", "calc")
    tasks = CalcEnv.generate_tasks(n_trees, seed=3)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    start = time.perf_counter()
    try:
        trees = sample_trees("bench-fork-calc", policy, make_sampler("bel"), tasks, n_total,
                             0, "bench")
    finally:
        seconds = time.perf_counter() - start
        done.set()
        thread.join()
        unregister_env("bench-fork-calc")
    assert len(trees) == n_trees
    return peak["rss"], peak["uss"], int(peak["n"]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=100, help="restores per depth")
    parser.add_argument("--frozen", type=int, default=64, help="frozen copies to hold")
    parser.add_argument("--collect", type=int, default=0, metavar="N",
                        help="also collect N BEL trees (n_total 16) through fork and report "
                             "the peak memory of the fork processes")
    args = parser.parse_args()
    for name in ("repeat", "frozen", "collect"):
        if getattr(args, name) < (0 if name == "collect" else 1):
            parser.error(f"--{name} must be at least {0 if name == 'collect' else 1}")
    if args.collect:
        rss, uss, n, seconds = collect_memory(args.collect, 16)
        print(f"collecting {args.collect} BEL trees (n_total 16) of calc through fork: "
              f"{seconds:.1f} s; at most {n} fork processes, peak RSS sum {mib(rss)} "
              f"(ceiling), peak USS sum {mib(uss)} (floor)")

    rows: list[list[object]] = []
    p50: dict[tuple[str, int], float] = {}
    for name, make in STRATEGIES.items():
        env = make()
        try:
            step = step_time(env, args.repeat)
            for depth in DEPTHS:
                times = restore_times(env, depth, args.repeat)
                p50[name, depth] = statistics.median(times)
                rows.append([name, depth, f"{p50[name, depth] * 1e3:.3f}",
                             f"{quantile(times, 0.99) * 1e3:.3f}", f"{step * 1e3:.3f}",
                             f"{p50[name, depth] / step:.1f}"])
        finally:
            env.close()
    print(f"calc: restore after one step away, {args.repeat} restores per row (ms)")
    print_table(["strategy", "depth", "restore p50", "restore p99", "one step p50",
                 "p50 / step"], rows)
    print()
    print(f"memory of a fork env holding {args.frozen} frozen copies of a calc worker "
          "(RSS sum = ceiling, USS sum = floor)")
    print_table(["processes", "n", "RSS", "PSS", "USS"], frozen_memory(args.frozen))
    ratio = p50["fork", DEPTHS[-1]] / p50["fork", DEPTHS[0]]
    verdict(f"fork restore p50 depth {DEPTHS[-1]} / depth {DEPTHS[0]}", ratio,
            ratio <= TARGET, f"<= {TARGET}")


if __name__ == "__main__":
    main()
