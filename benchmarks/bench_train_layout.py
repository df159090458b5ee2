"""Loss-step throughput of the ``tree`` layout vs the ``paths`` layout on BEL trees.

Samples BEL trees (n_total 16) with the tiny calc policy, commits them to a temporary
store and reads them back (``--store DIR`` uses that store's trees instead), then times
one loss step (forward, loss, backward over every micro-batch) of each layout,
alternately, several times. Throughput counts the same work for both: the trajectory
tokens (paths tokens). Target (issue 11): tree >= 1.5x paths and >= 70% of the tree
token ratio (paths tokens / tree tokens, the FLOP bound).

    .venv/bin/python benchmarks/bench_train_layout.py [--trees 6] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import Timings, print_timings, timed, verdict
from rollout_store.reader import read_trees
from rollout_store.store import open_store
from train.batches import (
    MicroBatch,
    build_sequences,
    forward_logprobs,
    make_rows,
    micro_batches,
    tree_token_ratio,
)
from train.config import TrainConfig
from train.envs import make_env
from train.loss import aggregate, denominator, token_loss, token_weights
from train.policies import load_policy
from train.sampling import make_sampler
from train.trainer import credit_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trees", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--row-tokens", default="none,512,256",
                    help="tree-layout max_row_tokens values to time (none = one row per tree)")
    args = ap.parse_args()
    torch.manual_seed(0)
    policy = load_policy("tiny", "calc")
    with tempfile.TemporaryDirectory() as tmp:
        if args.store is None:
            env = make_env("calc")
            tasks = type(env).generate_tasks(args.trees, seed=123)
            sampler = make_sampler("bel")
            trees = [sampler.sample_tree(env, policy, t, 16, seed=i, run_id="bench")
                     for i, t in enumerate(tasks)]
            store = open_store(Path(tmp) / "store", create=True)
            store.append_trees(trees)
            trees = read_trees(store)
        else:
            trees = [t for t in read_trees(open_store(args.store)) if t.sampler == "bel"]
            trees = trees[:args.trees]
    _, credit = credit_for(trees, TrainConfig(store="x", out="x", credit="elpo"))
    seqs = [build_sequences(t, policy.prompt_ids) for t in trees]  # type: ignore[attr-defined]
    ratio = tree_token_ratio(seqs)
    model = copy.deepcopy(policy.model).train()  # type: ignore[attr-defined]
    n_traj_tokens = 0
    steps = {}
    variants: list[tuple[str, str, int | None]] = [("paths", "paths", None)]
    for v in args.row_tokens.split(","):
        cap = None if v == "none" else int(v)
        variants.append((f"tree@{v}", "tree", cap))
    forwarded: dict[str, int] = {}
    padded: dict[str, int] = {}
    for name, layout, cap in variants:
        rows = make_rows(seqs, credit, layout, max_row_tokens=cap)  # type: ignore[arg-type]
        mbs = micro_batches(rows, layout, 16_384)  # type: ignore[arg-type]
        n_tok = sum(float(mb.traj_count.sum()) for mb in mbs)
        forwarded[name] = sum(mb.n_tokens for mb in mbs)
        padded[name] = sum(mb.input_ids.numel() for mb in mbs)
        n_traj_tokens = forwarded[name] if layout == "paths" else n_traj_tokens
        d = denominator("token-mean", n_tok, sum(len(s.leaves) for s in seqs), 1)

        def step(mbs: list[MicroBatch] = mbs, d: float = d) -> None:
            model.zero_grad(set_to_none=True)
            for mb in mbs:
                lp, _ = forward_logprobs(model, mb)
                out = token_loss(lp, mb.old_logp, mb.advantage, mb.clip_low, mb.clip_high)
                w = token_weights("token-mean", mb.traj_count, mb.inv_len_sum)
                aggregate(out.loss, torch.ones_like(w, dtype=torch.bool), w, d).backward()
        steps[name] = step
    timings = {k: Timings(k) for k in steps}
    for k in steps:
        steps[k]()  # warm-up
    for _ in range(args.repeats):
        for k, fn in steps.items():
            timings[k].seconds.append(timed(fn))
    print(f"{len(trees)} BEL trees (n_total 16), {n_traj_tokens} paths tokens, "
          f"tree token ratio {ratio:.2f}; forwarded tokens: "
          + ", ".join(f"{k} {v} ({padded[k]} padded)" for k, v in forwarded.items()))
    print_timings(list(timings.values()), timings["paths"])
    best = min((t for k, t in timings.items() if k != "paths"), key=lambda t: t.min)
    speed = timings["paths"].min / best.min
    print("tokens/s (paths tokens per loss-step second): " + ", ".join(
        f"{k} {n_traj_tokens / t.min:.0f}" for k, t in timings.items()))
    print(f"best tree variant {best.name}: speed-up {speed:.2f}x = {speed / ratio:.0%} of the "
          f"tree token ratio {ratio:.2f}")
    verdict("tree vs paths loss step", speed, speed >= 1.5 and speed >= 0.7 * ratio,
            ">= 1.5x and >= 70% of the tree token ratio")


if __name__ == "__main__":
    main()
