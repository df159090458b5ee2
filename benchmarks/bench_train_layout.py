"""Loss-step speed and memory of the ``tree`` layout vs ``paths`` on trees that share
a long system prompt (issues 11 and 25).

Samples BEL calc trees (``--n-total``) with the tiny calc policy from
``make_env("calc", system_prompt_chars=N)`` (a shared system prompt with the tool schema
ahead of every task: real agent trees share 1-2k tokens), commits them to a temporary
store and reads them back, then times one loss step (forward, loss, backward over every
micro-batch) of each layout, alternately, ``--repeats`` times, for two architectures:
the tiny Llama (``tiny``) and a transformers Qwen2 with random weights of the same size
(``qwen2``: 4 layers, hidden 128, 4 query / 2 key-value heads), both through the tree
attention of ``train.policies.tree_attention``. ``tree`` is one row per tree (no shared
token forwarded twice); ``tree+pack`` packs the trees' rows into rows of at most
``--pack-tokens``; ``tree+split`` (``--split-tokens N``) splits every tree over N tokens
into a trunk row forwarded once and branch rows attending its keys
(``train.batches.SplitTree``), each branch's activations freed by its own backward.
``--env workflow --sampler caliper --task-param horizons=18`` gives the deeper trees.

Memory: the peak over a whole loss step of the bytes autograd holds saved for backward
(every tensor a forward stores, counted once per storage while it lives): the part of
peak memory that grows with the row, measured without a CUDA allocator. Then one synthetic
tree row of 2k, 8k and 32k tokens (a shared 1,500-token prompt, then random branches of
20-80 tokens, depth at most 8) is forwarded through the tiny model with the tree layout,
and its saved bytes per token are printed beside the (L, L) float mask the dense layout needed.

Targets (issue 25): at a tree token ratio >= 4, tree >= 85% of the ratio faster than
paths for both architectures; tree's saved bytes <= paths'; linear growth in row length.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_train_layout.py
        [--trees 2] [--n-total 12] [--system-prompt-chars 1500] [--repeats 2]
        [--sizes 2048,8192]   # about 3-4 minutes of one core

The recorded numbers (docs/results.md) come from ``--repeats 3 --sizes 2048,8192,32768``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import Timings, mib, print_table, print_timings, timed, verdict
from rollout_store.reader import read_trees
from rollout_store.store import open_store
from train.batches import MicroBatch, Unit, make_rows, micro_batches, pack_rows
from train.coerce import literal_value
from train.config import TrainConfig
from train.envs import make_env
from train.forward import forward_logprobs, loss_pieces
from train.loss import aggregate, denominator, token_loss, token_weights
from train.policies import load_policy
from train.sampling import make_sampler
from train.sequences import NodeSeq, TreeSeqs, build_sequences, tree_token_ratio
from train.trainer import credit_for


def saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``fn()`` and the bytes of the storages autograd saved for backward meanwhile."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def peak_saved_bytes(fn: Callable[[], None]) -> int:
    """The largest number of bytes autograd holds saved for backward at any moment of
    ``fn()`` (a storage counted once while any tensor saved on it lives): the part of peak
    memory that grows with the rows, including what each backward releases."""
    live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors alive]
    total, peak = [0], [0]

    def release(ptr: int) -> None:
        live[ptr][1] -= 1
        if live[ptr][1] == 0:
            total[0] -= live.pop(ptr)[0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in live:
            live[ptr] = [s.nbytes(), 0]
            total[0] += s.nbytes()
        live[ptr][1] += 1
        weakref.finalize(t, release, ptr)
        peak[0] = max(peak[0], total[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return peak[0]


def qwen2_like(vocab: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=352,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=65_536, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).float()


def synthetic_tree(n_tokens: int, rng: np.random.Generator, prompt: int = 1500) -> TreeSeqs:
    """A tree of about ``n_tokens`` tree tokens: a ``prompt``-token root, then nodes of
    20-80 tokens under random parents of depth < 8 (preorder kept by appending each new
    node under the last node or one of its ancestors)."""
    nodes = [NodeSeq(0, tuple(int(x) for x in rng.integers(8, 90, prompt)), 0, prompt, -1,
                     -1, (), 1, 1.0)]
    depth = [0]
    total = prompt
    while total < n_tokens:
        anc = [len(nodes) - 1]
        while nodes[anc[-1]].parent >= 0:
            anc.append(nodes[anc[-1]].parent)
        anc = [a for a in anc if depth[a] < 8]
        p = anc[int(rng.integers(0, len(anc)))]
        own = tuple(int(x) for x in rng.integers(8, 90, int(rng.integers(20, 81))))
        full = (*nodes[p].full, *own)
        nodes.append(NodeSeq(len(nodes), full, len(nodes[p].full), len(nodes[p].full), p, p,
                             (), 1, 1.0))
        depth.append(depth[p] + 1)
        total += len(own)
    parents = {n.parent for n in nodes}
    return TreeSeqs("syn", tuple(nodes), tuple(i for i in range(len(nodes))
                                               if i not in parents))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trees", type=int, default=2)
    ap.add_argument("--n-total", type=int, default=12)
    ap.add_argument("--system-prompt-chars", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pack-tokens", type=int, default=8192)
    ap.add_argument("--sizes", default="2048,8192",
                    help="tokens per row of the synthetic memory rows (empty: skip; "
                         "2048,8192,32768 adds about a minute and 4 GiB)")
    ap.add_argument("--archs", default="tiny,qwen2")
    ap.add_argument("--split-tokens", type=int, default=0,
                    help="also time tree+split: trees over this many tokens split into a "
                         "trunk and branch rows (train.batches.SplitTree); 0: skip")
    ap.add_argument("--env", default="calc", choices=("calc", "workflow"))
    ap.add_argument("--sampler", default="bel", help="a registered sampler (bel, caliper, ...)")
    ap.add_argument("--task-param", action="append", default=[], metavar="KEY=VALUE",
                    help="task-generator option, e.g. horizons=18 for workflow")
    args = ap.parse_args()
    torch.manual_seed(0)
    policy = load_policy("tiny", args.env)
    task_params = {k: literal_value(v) for k, _, v in
                   (p.partition("=") for p in args.task_param)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        env = make_env(args.env, system_prompt_chars=args.system_prompt_chars)
        tasks = type(env).generate_tasks(args.trees, seed=123, **task_params)
        sampler = make_sampler(args.sampler)
        trees = [sampler.sample_tree(env, policy, t, args.n_total, seed=i, run_id="bench")
                 for i, t in enumerate(tasks)]
        store = open_store(Path(tmp) / "store", create=True)
        store.append_trees(trees)
        trees = read_trees(store)
    sample_s = time.perf_counter() - t0
    _, credit = credit_for(trees, TrainConfig(store="x", out="x", credit="elpo"))
    seqs = [build_sequences(t, policy.prompt_ids) for t in trees]  # type: ignore[attr-defined]
    ratio = tree_token_ratio(seqs)
    per_tree = [tree_token_ratio([s]) for s in seqs]
    print(f"{len(trees)} {args.sampler} {args.env} trees {task_params or ''} "
          f"(n_total {args.n_total}, system prompt "
          f"{args.system_prompt_chars} chars, sampled in {sample_s:.1f} s): paths tokens "
          f"{sum(s.paths_tokens() for s in seqs)}, tree tokens "
          f"{sum(s.tree_tokens() for s in seqs)}, tree token ratio {ratio:.2f} (per tree "
          + ", ".join(f"{r:.2f}" for r in per_tree) + ")")
    models = {"tiny": policy.model,  # type: ignore[attr-defined]
              "qwen2": qwen2_like(len(policy.tokenizer))}  # type: ignore[attr-defined]
    n_seqs = sum(len(s.leaves) for s in seqs)
    variants = {"paths": make_rows(seqs, credit, "paths"), "tree": make_rows(seqs, credit, "tree")}
    variants["tree+pack"] = pack_rows(variants["tree"], args.pack_tokens)
    if args.split_tokens:
        variants["tree+split"] = make_rows(seqs, credit, "tree",
                                           max_row_tokens=args.split_tokens)
    summary = []
    for arch in args.archs.split(","):
        model = copy.deepcopy(models[arch]).train()
        steps: dict[str, Callable[[], None]] = {}
        memory: dict[str, int] = {}
        for name, rows in variants.items():
            layout = "paths" if name == "paths" else "tree"
            units = micro_batches(rows, layout, 16_384)  # type: ignore[arg-type]
            n_tok = sum(float(u.traj_count.sum()) for u in units)
            d = denominator("token-mean", n_tok, n_seqs, 1)

            def step(units: list[Unit] = units, d: float = d,
                     model: torch.nn.Module = model) -> None:
                model.zero_grad(set_to_none=True)
                for piece in (p for u in units for p in loss_pieces(model, u)):
                    mb = piece.mb
                    out = token_loss(piece.logp, mb.old_logp, mb.advantage, mb.clip_low,
                                     mb.clip_high)
                    w = token_weights("token-mean", mb.traj_count, mb.inv_len_sum)
                    piece.backward(aggregate(out.loss, torch.ones_like(w, dtype=torch.bool),
                                             w, d))
            memory[name] = peak_saved_bytes(step)  # warm-up, and the peak saved bytes
            steps[name] = step
        timings = {k: Timings(k) for k in steps}
        for _ in range(args.repeats):
            for k, fn in steps.items():
                timings[k].seconds.append(timed(fn))
        print(f"\n[{arch}] loss step, seconds:")
        print_timings(list(timings.values()), timings["paths"])
        print_table(["", "peak saved for backward", "x paths"],
                    [[k, mib(v), f"{v / memory['paths']:.2f}"] for k, v in memory.items()])
        n_traj = sum(s.paths_tokens() for s in seqs)
        print(f"tokens/s {arch} (paths tokens per loss-step second): " + ", ".join(
            f"{k} {n_traj / t.min:.0f}" for k, t in timings.items()))
        # the verdict's variant: the fastest tree variant within paths' memory, if any
        fits = [t for k, t in timings.items() if k != "paths" and memory[k] <= memory["paths"]]
        best = min(fits or [t for k, t in timings.items() if k != "paths"],
                   key=lambda t: t.min)
        speed = timings["paths"].min / best.min
        summary.append((arch, best.name, speed, memory[best.name] / memory["paths"]))
        print(f"[{arch}] best tree variant {best.name}: speed-up {speed:.2f}x = "
              f"{speed / ratio:.0%} of the tree token ratio {ratio:.2f}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if sizes:
        rng = np.random.default_rng(0)
        model = copy.deepcopy(models["tiny"]).train()
        table = []
        for n in sizes:
            ts = synthetic_tree(n, rng)
            rows = make_rows([ts], {}, "tree")  # no action tokens: one loss token set here
            rows[0].cols, rows[0].targets = [len(rows[0].ids) - 2], [rows[0].ids[-1]]
            for name in ("old_logp", "behav_logp", "advantage", "clip_low", "clip_high",
                         "traj_count", "inv_len_sum", "action_len"):
                setattr(rows[0], name, [1.0])
            rows[0].keys = [(0, 0, 0)]
            mb = micro_batches(rows, "tree", 10**9)[0]
            t = time.perf_counter()
            def forward(mb: MicroBatch = mb, model: torch.nn.Module = model) -> torch.Tensor:
                return forward_logprobs(model, mb)[0].sum()
            lp, n_bytes = saved_bytes(forward)
            lp.backward()
            secs = time.perf_counter() - t
            length = mb.input_ids.shape[1]
            table.append([f"{length} tokens", mib(n_bytes), f"{n_bytes / length:,.0f}",
                          mib(4 * length * length), f"{secs:.2f}"])
        print("\n[tiny] one synthetic tree row, forward + backward:")
        print_table(["row", "saved for backward", "bytes/token", "dense (L, L) fp32 mask",
                     "seconds"], table)
    print()
    for arch, name, speed, mem in summary:
        verdict(f"{arch} {name} vs paths loss step", speed,
                ratio >= 4 and speed >= 0.85 * ratio and mem <= 1.0,
                f"tree token ratio >= 4 ({ratio:.2f}), >= 85% of it ({0.85 * ratio:.2f}x), "
                f"memory <= paths ({mem:.2f}x)")


if __name__ == "__main__":
    main()
