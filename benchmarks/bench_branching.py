"""Shared-prefix branching against regenerating every branch with its prefix (issue 6).

Eight branches continue one 256-token prefix with the tiny model (random weights:
speed does not depend on them). The shared side is ``HFPolicy.sample([t], n=8)``:
the prefix is prefilled once and its KV cache expanded to the 8 branches. The naive
side is ``HFPolicy.sample([t] * 8, n=1)``: the same code with 8 copies of the
transcript in one batch, so every branch prefills its own prefix. Both then decode
the same number of new tokens (stop strings and ``<eos>`` are switched off so every
branch runs to the cap). The two sides alternate, ``--repeat`` times, at 16, 64 and
128 new tokens; the table shows min / median seconds, the ratios naive / shared of
the minima and medians, and the prefix tokens each side computed per branch.

Target: zero prefix tokens recomputed by branches 2..8, at least 1.5x faster at 16
new tokens, and never slower. Run from the repository root::

    .venv/bin/python benchmarks/bench_branching.py      # --prefix 256 --branches 8 --repeat 15
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from _common import Timings, print_table, timed, verdict

from train.policies.base import SampleConfig, Transcript
from train.policies.hf import HFPolicy
from train.policies.tiny import n_parameters, random_tiny_policy


def prefix_transcript(policy: HFPolicy, n_tokens: int, seed: int = 0) -> Transcript:
    """A one-prompt transcript whose rendered prompt is exactly ``n_tokens`` tokens:
    ``<|user|>`` + digits and operators (one token each) + ``<|assistant|>``."""
    rng = random.Random(seed)
    body = "".join(rng.choice("0123456789+-*/()") for _ in range(n_tokens - 2))
    transcript: Transcript = [("prompt", body)]
    if len(policy.prompt_ids(transcript)) != n_tokens:
        raise RuntimeError("the prefix did not tokenize to the requested length")
    return transcript


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=256, help="prefix tokens")
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    policy = random_tiny_policy(seed=0, stop_strings=())
    policy.eos_ids = frozenset()  # every branch generates exactly max_new_tokens
    transcript = prefix_transcript(policy, args.prefix)
    k = args.branches
    print(f"tiny model: {n_parameters(policy.model):,} parameters; {k} branches from a "
          f"{args.prefix}-token prefix; {args.repeat} alternating runs per size; "
          f"{args.threads} threads\n")

    rows, ratios = [], {}
    for new in args.new_tokens:
        def shared(new: int = new) -> list[list[int]]:
            conts = policy.sample([transcript], SampleConfig(n=k, max_new_tokens=new, seed=0))
            return [[c.prefill_tokens, len(c.token_ids)] for c in conts[0]]

        def naive(new: int = new) -> list[list[int]]:
            conts = policy.sample([transcript] * k,
                                  SampleConfig(n=1, max_new_tokens=new, seed=0))
            return [[c[0].prefill_tokens, len(c[0].token_ids)] for c in conts]

        shared_stats, naive_stats = shared(), naive()  # warm-up, and the token counts
        assert all(n == new for _, n in shared_stats + naive_stats)
        t_shared, t_naive = Timings(f"shared, {new} new"), Timings(f"naive, {new} new")
        for r in range(args.repeat):  # alternate which side goes first
            for side, t in ((shared, t_shared), (naive, t_naive))[::1 if r % 2 else -1]:
                t.seconds.append(timed(side))
        recomputed = sum(p for p, _ in shared_stats) - args.prefix
        ratio_min = t_naive.min / t_shared.min
        ratio_median = t_naive.median / t_shared.median
        ratios[new] = (ratio_min, recomputed)
        for t, stats in ((t_shared, shared_stats), (t_naive, naive_stats)):
            per_branch = [p for p, _ in stats]
            rows.append([t.name, f"{t.min:.3f}", f"{t.median:.3f}",
                         f"{statistics.mean(per_branch):.0f}",
                         f"{per_branch[0]}/{per_branch[1]}",
                         f"{ratio_min:.2f}" if t is t_naive else "",
                         f"{ratio_median:.2f}" if t is t_naive else ""])
    print_table(["", "min s", "median s", "prefill tok/branch (mean)",
                 "branch 1/2 prefill", "naive/shared (min)", "naive/shared (median)"], rows)
    print()
    recomputed_total = sum(r for _, r in ratios.values())
    print(f"prefix tokens recomputed by branches 2..{k} (shared): {recomputed_total}")
    first = args.new_tokens[0]
    passed = (recomputed_total == 0 and ratios[first][0] >= 1.5
              and all(r >= 1.0 for r, _ in ratios.values()))
    verdict(f"shared-prefix branching speedup at {first} new tokens "
            f"(min over sizes {min(r for r, _ in ratios.values()):.2f})",
            ratios[first][0], passed, f">= 1.5 at {first}, >= 1.0 at every size, "
            "0 prefix tokens recomputed")


if __name__ == "__main__":
    main()
