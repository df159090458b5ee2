"""CPU time of the same work on a quiet machine and beside two CPU-bound neighbours (issue 22).

Runs ``rtrees demo`` (or, with ``--quick``, a small ``rtrees collect`` of tiny-calc trees,
which exercises the same sampling path in a minute) in a child process twice: once
quiet, once while ``--neighbours`` busy-loop processes run beside it, and reports the
child's CPU time (user + system, from ``resource.getrusage(RUSAGE_CHILDREN)``) and wall
time for both. Torch threads that spin on oversubscribed cores show up as CPU time
that grows with the load although the work is the same; with the threads chosen from
the usable CPUs and the model size (``train.policies.hf.configure_threads``: one for
the tiny model) the ratio should stay near 1.

Target (issue 22): CPU time with two neighbours at most 1.5x the quiet CPU time.
Run from the repository root, on an otherwise idle machine::

    .venv/bin/python benchmarks/bench_threads.py            # make demo, about 2 x 10 min
    .venv/bin/python benchmarks/bench_threads.py --quick    # a small collect instead
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table, verdict

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.5


def busy(stop_at: float) -> None:
    """A CPU-bound neighbour: spin until ``stop_at`` (time.time)."""
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def command(quick: bool, workdir: Path) -> list[str]:
    python = [sys.executable, "-m", "cli.main"]
    if quick:
        return [*python, "collect", "--env", "calc", "--policy", "tiny", "--sampler", "group",
                "--tasks", "16", "--n-total", "8", "--store", str(workdir / "store"),
                "--run-id", "bench-threads", "--no-progress"]
    return [*python, "demo", "--store", str(workdir / "store"), "--out", str(workdir / "out")]


def run_once(quick: bool, neighbours: int, timeout: float) -> tuple[float, float]:
    """(child CPU seconds, wall seconds) of one run with ``neighbours`` busy processes."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-threads-"))
    procs = [multiprocessing.Process(target=busy, args=(time.time() + timeout,), daemon=True)
             for _ in range(neighbours)]
    for p in procs:
        p.start()
    try:
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RTREES_THREADS")}
        env["PYTHONPATH"] = str(ROOT)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command(quick, workdir), cwd=ROOT, env=env, check=True,
                       timeout=timeout, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        for p in procs:
            p.terminate()
            p.join()
        shutil.rmtree(workdir, ignore_errors=True)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="A small collect instead of the demo.")
    ap.add_argument("--neighbours", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()
    what = "rtrees collect (16 calc trees x 8)" if args.quick else "rtrees demo"
    print(f"CPU time of {what}: quiet vs {args.neighbours} CPU-bound neighbours; "
          f"{len(os.sched_getaffinity(0))} usable CPUs")
    quiet = run_once(args.quick, 0, args.timeout)
    loaded = run_once(args.quick, args.neighbours, args.timeout)
    print_table(["run", "CPU s", "wall s"],
                [["quiet", f"{quiet[0]:.1f}", f"{quiet[1]:.1f}"],
                 [f"{args.neighbours} neighbours", f"{loaded[0]:.1f}", f"{loaded[1]:.1f}"]])
    ratio = loaded[0] / quiet[0]
    verdict(f"CPU time with {args.neighbours} neighbours / quiet ({what})", ratio,
            ratio <= TARGET, f"<= {TARGET}")


if __name__ == "__main__":
    main()
