"""One training iteration per sequence: our trainer against TRL's ``GRPOTrainer`` (issue 11).

Both sides start from the same tiny calc checkpoint (``find_checkpoint("calc", 0)``, an
ordinary HF directory), in the same process, on CPU, fp32, with the same batch (``--tasks``
prompts x ``--group`` completions each), the same generation cap (``--max-new-tokens``),
the same learning rate, GRPO credit, clip bounds (0.2 / 0.28), no KL, no reference model,
one optimizer step per iteration. Timings alternate the two sides ``--repeats`` times
after one untimed warm-up iteration each; the verdict uses the ratio of the minima.

Equalising single-turn and multi-turn. Our trainer runs multi-turn tool-using episodes;
TRL's GRPOTrainer here is single-turn (prompt -> one completion -> reward). The timed
comparison therefore uses *single-step* calc tasks (``CalcEnv.generate_tasks(...,
max_steps=1)``): an episode is one agent step, so each of our trajectories is exactly
one completion, as on the TRL side, and both sides get the reward of the calc env on it
(1.0 for a correct ``<answer>``; a tool call ends the one-step episode with 0.0).
Seconds per sequence = seconds per iteration / (tasks x group).

Stopping. Our policy stops a completion at ``</tool_call>`` / ``</answer>``; the TRL side
gets the same rule by making every tokenizer id whose text contains a stop string an eos
id of the model's generation config (TRL stops at, and keeps, eos ids). ``--fixed-length``
turns stopping off on both sides, so every completion is exactly ``max_new_tokens``.

Our side (``train.trainer``'s own functions, in the order of one ``train`` iteration;
``OURS_PHASES``): *sample*: every task's ``GroupSampler`` tree in one rollout-engine call
as the trainer does (``Engine.sample_trees``: each decode step one ``HFPolicy.sample_rows``
call over every tree's live rows, each group sharing its prompt's KV cache); *credit*:
``credit_for`` (the registry path of ``rtrees credit``, grpo); *batches*:
``build_sequences``, ``make_rows`` (layout ``tree``: each prompt forwarded once per
group), ``micro_batches``; *train*: forward (its logprobs also make the trainer's default
``check_logprobs`` comparison with the sampling logprobs, free before the optimizer
step), ``token_loss`` (G2-G3, dual clip), ``aggregate`` (token-mean), backward, grad
clip, AdamW step; *store*: ``append_trees``, ``append_credits`` and the metrics row,
keyed commits into a fresh Delta store; *checkpoint*: the finite check of the new
weights, their hash (the ``policy_version``) and ``save_checkpoint`` (HF directory,
optimizer, RNG, atomic rename); *wait*: the trainer's wait for its writes before the
first optimizer step.

Two ways to write (``train.writer``; the trainer's ``background_writes``), each its own
side with its own store and run directory: *inline*, every commit and the checkpoint on
the loop's thread (store and checkpoint are their full cost, wait is 0); *background
writes* (the trainer's default), the commits and the checkpoint queued, in order, on a
writer thread while the next iteration samples (store and checkpoint are the cost of
queueing; wait is what the loop still blocks). A background iteration is timed as in a
long run: right after an untimed one, whose writes are in flight while it runs; after
each timed iteration its own writes finish untimed before the next side runs. Rows:
core = sample + credit + batches + train; + store commits (inline); the whole iteration
body of ``train``, inline and with background writes (the verdict's row).

TRL side: ``GRPOTrainer(model, reward_funcs=[calc reward], args=GRPOConfig(
num_generations=group, max_completion_length=max_new_tokens, per_device_train_batch_size=
tasks x group, steps_per_generation=1, num_iterations=1, beta=0, loss_type="dapo"
(token-mean), epsilon 0.2, epsilon_high 0.28, bf16=False, use_cpu=True,
gradient_checkpointing=False (TRL's default is True), save_strategy="no",
report_to="none"))``; each repeat calls ``trainer.train()`` with ``max_steps=1``. The
reward function decodes each completion's ids (special tokens kept) and runs the calc
env's ``reset`` / ``step`` on it. Rows: step = ``on_step_begin`` to ``on_step_end`` of a
callback (generation, reward, advantages, loss, backward, optimizer step, TRL's logging);
train() = the whole call (adds the per-call setup of the HF Trainer loop).

Informational: ``--multi-turn`` also runs one ``train.trainer.train`` iteration of the
default (multi-turn, up to 4 steps) calc tasks, end to end (policy load, checkpoints 0
and 1, store), and reports it per trajectory and per agent token; TRL has no such row.

Threads: one torch thread by default, for both sides. On the shared 2-core machine torch's
default of two OpenMP threads, under load, made both sides many times slower and ours (many
small ops: per-tree decoding) most; ``--threads 0`` keeps torch's default.

Without trl (a dev-only extra) the script prints the reason and exits 0.

    nice -n 10 .venv/bin/python benchmarks/bench_train_trl.py [--tasks 16 --group 8
        --max-new-tokens 48 --repeats 3 --threads 1 --fixed-length --multi-turn]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import print_table, verdict
from rollout_store.store import Store, open_store
from train.batches import make_rows, micro_batches
from train.config import TrainConfig
from train.envs import Task, env_class, make_env
from train.forward import forward_logprobs
from train.loss import aggregate, denominator, token_loss, token_weights
from train.policies.base import STOP_STRINGS
from train.policies.hf import HFPolicy, state_dict_version
from train.policies.tiny import find_checkpoint
from train.run import commit_metrics, require_finite, save_after_commits, trainer_state
from train.sampling import make_sampler
from train.sampling.base import mix_seed
from train.sampling.engine import Engine, TreeJob
from train.sequences import build_sequences
from train.trainer import credit_for
from train.writer import Writes

CORE = ("sample", "credit", "batches", "train")
OURS_PHASES = (*CORE, "store", "checkpoint", "wait")
TARGET = 1.5


@dataclass
class Sample:
    """One timed iteration: wall and process-CPU seconds per phase, generated tokens."""

    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    gen_tokens: int = 0
    reward: float = 0.0

    def total(self, phases: tuple[str, ...], cpu: bool = False) -> float:
        src = self.cpu if cpu else self.wall
        return sum(src[p] for p in phases)


class Clock:
    """Wall and CPU time of consecutive phases."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.t, self.c = time.perf_counter(), time.process_time()

    def lap(self, phase: str) -> None:
        t, c = time.perf_counter(), time.process_time()
        self.sample.wall[phase] = self.sample.wall.get(phase, 0.0) + t - self.t
        self.sample.cpu[phase] = self.sample.cpu.get(phase, 0.0) + c - self.c
        self.t, self.c = t, c


# ------------------------------------------------------------------------- our side

class Ours:
    """Our trainer's iteration, from ``train.trainer``'s functions (module docstring)."""

    def __init__(self, ckpt: Path, tasks: list[Task], args: argparse.Namespace, tmp: Path,
                 background: bool) -> None:
        stops: tuple[str, ...] = () if args.fixed_length else STOP_STRINGS
        self.policy = HFPolicy.from_pretrained(ckpt, device="cpu", stop_strings=stops)
        if args.fixed_length:
            self.policy.eos_ids = frozenset()
        self.model = self.policy.model
        self.tasks = tasks
        side = "background" if background else "inline"
        self.writes = Writes(background)
        self.checkpointed = 0  # the ticket of the last checkpoint's write
        self.config = TrainConfig(store=str(tmp / f"store-{side}"), out=str(tmp / f"run-{side}"),
                                  run_id="bench-ours", tasks_per_step=len(tasks),
                                  n_total=args.group, max_new_tokens=args.max_new_tokens,
                                  minibatches=1, lr=args.lr, sampler="group", credit="grpo",
                                  heldout_tasks=0, progress=False,
                                  background_writes=background)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.sampler = make_sampler("group", max_new_tokens=self.config.max_new_tokens,
                                    temperature=self.config.temperature)
        self.store: Store = open_store(self.config.store, create=True)
        self.env = make_env("calc")
        self.it = 0

    def iteration(self) -> Sample:
        cfg, it, model = self.config, self.it, self.model
        run_id = cfg.resolved_run_id
        sample = Sample()
        clock = Clock(sample)
        model.eval()
        trees = Engine(self.policy).sample_trees([  # one wavefront, as the trainer does
            TreeJob(self.sampler, partial(make_env, "calc"), task, cfg.n_total,
                    seed=mix_seed(cfg.seed, "tree", it, j),
                    tree_id=f"{run_id}/it{it:06d}/{j:03d}", run_id=run_id)
            for j, task in enumerate(self.tasks)])
        clock.lap("sample")
        submit = self.writes.submit
        submit(partial(self.store.append_trees, trees, key=f"{run_id}:trees:{it}"))
        clock.lap("store")
        rows_, credit = credit_for(trees, cfg)
        clock.lap("credit")
        submit(partial(self.store.append_credits, rows_, key=f"{run_id}:credit:{it}"))
        clock.lap("store")
        seqs = [build_sequences(t, self.policy.prompt_ids) for t in trees]
        rows = make_rows(seqs, credit, cfg.layout, cfg.node_weight, cfg.clip_low, cfg.clip_high,
                         max_row_tokens=cfg.tree_row_tokens or None)
        mbs = micro_batches(rows, cfg.layout, cfg.micro_tokens, pad_id=self.policy.pad_id)
        n_tokens = sum(float(mb.traj_count.sum()) for mb in mbs)
        d = denominator(cfg.aggregation, n_tokens, sum(len(s.leaves) for s in seqs),
                        cfg.norm_length)
        clock.lap("batches")
        self.writes.wait(self.checkpointed)  # it reads the weights (as the trainer waits)
        clock.lap("wait")
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = ent_sum = diff = 0.0
        for mb in mbs:
            if not mb.n_loss_tokens:
                continue
            logp, entropy = forward_logprobs(model, mb, with_entropy=True, entropy_grad=False)
            # the logprob check on the training forward (before the optimizer step), as
            # the trainer makes it for a model without dropout
            diff = max(diff, float((logp.detach() - mb.old_logp).abs().max()))
            out = token_loss(logp, mb.old_logp, mb.advantage, mb.clip_low, mb.clip_high,
                             dual_clip=cfg.dual_clip)
            w = token_weights(cfg.aggregation, mb.traj_count, mb.inv_len_sum)
            loss = aggregate(out.loss, torch.ones_like(w, dtype=torch.bool), w, d)
            loss.backward()
            total += float(loss.detach())
            ent_sum += float(entropy.detach().sum()) if entropy is not None else 0.0
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        model.eval()
        clock.lap("train")
        leaves = [n for t in trees for n in t.nodes if n.reward is not None]
        sample.reward = float(np.mean([n.reward or 0.0 for n in leaves]))
        sample.gen_tokens = sum(len(n.action_token_ids or []) for t in trees for n in t.nodes)
        submit(partial(commit_metrics, self.store, run_id, it, {
            "loss": total, "grad_norm": grad_norm, "logprob_diff_max": diff,
            "entropy": ent_sum / max(n_tokens, 1.0), "reward": sample.reward}))
        clock.lap("store")
        require_finite(self.policy, it + 1)  # on the loop's thread, as the trainer does
        version = f"{run_id}-{state_dict_version(model)}"
        current = self.policy.published(str(Path(cfg.out) / "checkpoints" / f"step-{it + 1}"),
                                        version)
        self.checkpointed = submit(partial(
            save_after_commits, Path(cfg.out), it + 1, current,
            trainer_state(it + 1, self.optimizer, self.scheduler, self.sampler), self.store, cfg,
            None))
        clock.lap("checkpoint")
        self.it += 1
        return sample

    def steady(self) -> Sample:
        """One iteration timed as it runs inside a long run: with the writes of the
        iteration before it in flight (background writes), its own finished untimed
        afterwards so the next side starts on a quiet machine."""
        if self.writes.background:
            self.iteration()
        sample = self.iteration()
        self.writes.wait()
        return sample


# ------------------------------------------------------------------------- TRL side

class TRLSide:
    """TRL's GRPOTrainer on the same checkpoint, batch and lengths (module docstring)."""

    def __init__(self, ckpt: Path, tasks: list[Task], args: argparse.Namespace, tmp: Path
                 ) -> None:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from transformers.trainer_callback import PrinterCallback
        from trl import GRPOConfig, GRPOTrainer

        tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True,
                                            trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True,
                                                     trust_remote_code=False,
                                                     dtype=torch.float32)
        texts = tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=False)
        stop_ids = sorted(i for i, s in enumerate(texts) if any(x in s for x in STOP_STRINGS))
        eos = [tok.eos_token_id] + ([] if args.fixed_length else stop_ids)
        model.generation_config.eos_token_id = eos
        self.eos = set(eos)
        self.tok = tok
        self.tasks = tasks
        self.gen_tokens: list[int] = []
        self.rewards: list[float] = []
        self.steps: list[tuple[float, float]] = []
        side = self

        class StepClock(TrainerCallback):
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                self.t, self.c = time.perf_counter(), time.process_time()

            def on_step_end(self, *a: Any, **k: Any) -> None:
                side.steps.append((time.perf_counter() - self.t, time.process_time() - self.c))

        gen_kwargs = ({"min_new_tokens": args.max_new_tokens} if args.fixed_length else None)
        config = GRPOConfig(
            output_dir=str(tmp / "trl"), per_device_train_batch_size=len(tasks) * args.group,
            gradient_accumulation_steps=1, steps_per_generation=1, num_generations=args.group,
            max_completion_length=args.max_new_tokens, max_steps=1, learning_rate=args.lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            beta=0.0, num_iterations=1, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
            temperature=1.0, top_p=1.0, top_k=0, bf16=False, use_cpu=True,
            gradient_checkpointing=False, save_strategy="no", report_to="none",
            logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=args.seed,
            shuffle_dataset=False, generation_kwargs=gen_kwargs)
        rows = [{"prompt": [{"role": "user", "content": t.prompt}], "task_index": i}
                for i, t in enumerate(tasks)]
        self.trainer = GRPOTrainer(model=model, reward_funcs=[self.reward], args=config,
                                   train_dataset=Dataset.from_list(rows), processing_class=tok,
                                   callbacks=[StepClock()])
        self.trainer.remove_callback(PrinterCallback)  # TRL's per-step log dicts on stdout
        self.generate_s: list[float] = []  # wall seconds of generation + reward + advantages
        inner = getattr(self.trainer, "_generate_and_score_completions", None)  # TRL private
        if inner is not None:
            def timed_generate(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                out = inner(*a, **k)
                self.generate_s.append(time.perf_counter() - t)
                return out

            self.trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign]

    def prompt_ids(self, task: Task) -> list[int]:
        ids: Any = self.tok.apply_chat_template([{"role": "user", "content": task.prompt}],
                                                add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def reward(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
               task_index: list[int], **_: Any) -> list[float | None]:
        """The calc env's reward of each completion (ids decoded as our policy does)."""
        out: list[float | None] = []
        for ids, i in zip(completion_ids, task_index, strict=True):
            ids = list(ids)
            text_ids = ids[:-1] if ids and ids[-1] in self.eos else ids
            text = str(self.tok.decode(text_ids, skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False))
            env = make_env("calc")
            env.reset(self.tasks[i])
            out.append(float(env.step(text).reward_parts.get("reward", 0.0)))
        self.gen_tokens.append(sum(len(ids) for ids in completion_ids))
        self.rewards.append(float(np.mean([r or 0.0 for r in out])))
        return out

    def iteration(self) -> tuple[Sample, Sample]:
        """(the optimizer step as the callback timed it, the whole ``train()`` call)."""
        t, c = time.perf_counter(), time.process_time()
        self.trainer.train()
        whole = Sample({"step": time.perf_counter() - t}, {"step": time.process_time() - c})
        wall, cpu = self.steps[-1]
        gen = self.generate_s[-1] if self.generate_s else math.nan
        step = Sample({"step": wall, "generate": gen}, {"step": cpu})
        for s in (step, whole):
            s.gen_tokens, s.reward = self.gen_tokens[-1], self.rewards[-1]
        return step, whole


# ----------------------------------------------------------------------------- main

def multi_turn_row(args: argparse.Namespace, tmp: Path) -> list[object]:
    """One ``train.trainer.train`` iteration on the default (multi-turn) calc tasks."""
    from train.config import load_config
    from train.trainer import read_metrics, train

    cfg = load_config(None, {"store": str(tmp / "mt-store"), "out": str(tmp / "mt-run"),
                             "steps": 1, "tasks_per_step": args.tasks, "n_total": args.group,
                             "max_new_tokens": args.max_new_tokens, "minibatches": 1,
                             "heldout_tasks": 0, "eval_every": 0, "lr": args.lr,
                             "progress": False, "run_id": "bench-mt"})
    t = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t
    m = {k: v[0][1] for k, v in read_metrics(cfg.store, "bench-mt").items()}
    trajectories = args.tasks * args.group
    body = sum(m[f"seconds_{p}"] for p in ("sample", "commit", "credit", "train"))
    return ["ours train() 1 it, multi-turn (whole call)", f"{wall:.3f}", "-",
            f"{wall / trajectories * 1e3:.2f}", "-",
            f"{int(m['loss_tokens'])} agent tok (loss phases {body:.2f} s)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=16, help="prompts per iteration")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads, both sides (0: torch's default; see the docstring)")
    ap.add_argument("--fixed-length", action="store_true",
                    help="no stop strings / eos on either side: every completion is "
                         "max_new_tokens long")
    ap.add_argument("--multi-turn", action="store_true",
                    help="also one train.trainer.train iteration on multi-turn calc tasks")
    args = ap.parse_args()
    for option in ("tasks", "group", "max_new_tokens", "repeats"):
        if getattr(args, option) < 1:
            ap.error(f"--{option.replace('_', '-')} must be at least 1, "
                     f"got {getattr(args, option)}")
    try:
        import datasets  # noqa: F401
        import trl
    except ImportError as exc:
        print(f"SKIP: trl is not importable ({exc}); it is a dev-only extra: "
              f".venv/bin/pip install -c <(echo torch==2.13.0) trl")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ckpt = find_checkpoint("calc", 0)
    if ckpt is None:
        print("SKIP: no tiny calc checkpoint (rtrees policy init --env calc --seed 0)")
        return
    tasks = env_class("calc").generate_tasks(args.tasks, seed=args.seed + 1, max_steps=1)
    n_seq = args.tasks * args.group
    print(f"trl {trl.__version__}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; checkpoint {ckpt}")
    print(f"{args.tasks} single-step calc tasks x {args.group} = {n_seq} sequences per "
          f"iteration, max_new_tokens {args.max_new_tokens}, "
          f"{'fixed length' if args.fixed_length else 'stop at </tool_call> / </answer>'}")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        ours = Ours(ckpt, tasks, args, tmp, background=False)
        ours_bg = Ours(ckpt, tasks, args, tmp, background=True)
        theirs = TRLSide(ckpt, tasks, args, tmp)
        same = all(ours.policy.prompt_ids([("prompt", t.prompt)]) == theirs.prompt_ids(t)
                   for t in tasks)
        print(f"prompt token ids identical on both sides: {same}")
        ours.steady()  # warm-up (untimed): allocator, first-call costs
        ours_bg.steady()
        theirs.iteration()
        o_runs: list[Sample] = []
        b_runs: list[Sample] = []
        t_steps: list[Sample] = []
        t_whole: list[Sample] = []
        for _ in range(args.repeats):
            o_runs.append(ours.steady())
            b_runs.append(ours_bg.steady())
            step, whole = theirs.iteration()
            t_steps.append(step)
            t_whole.append(whole)
        extra = [multi_turn_row(args, tmp)] if args.multi_turn else []

    def stats(xs: list[float]) -> tuple[float, float]:
        return min(xs), statistics.median(xs)

    rows: list[list[object]] = []
    variants: list[tuple[str, list[Sample], tuple[str, ...]]] = [
        ("ours core (sample+credit+train)", o_runs, CORE),
        ("ours + store commits, inline", o_runs, (*CORE, "store")),
        ("ours whole it., writes inline", o_runs, OURS_PHASES),
        ("ours whole it., background writes", b_runs, OURS_PHASES),
        ("TRL GRPOTrainer step", t_steps, ("step",)),
        ("TRL trainer.train() call", t_whole, ("step",)),
    ]
    best: dict[str, float] = {}
    for name, runs, phases in variants:
        w_min, w_med = stats([r.total(phases) for r in runs])
        c_min, _ = stats([r.total(phases, cpu=True) for r in runs])
        tok = statistics.mean(r.gen_tokens for r in runs)
        best[name] = w_min
        rows.append([name, f"{w_min:.3f}", f"{w_med:.3f}", f"{w_min / n_seq * 1e3:.2f}",
                     f"{c_min / n_seq * 1e3:.2f}",
                     f"{tok / n_seq:.1f} tok/seq, reward {runs[0].reward:.3f}"])
    print_table(["", "min s/it", "median s/it", "ms/seq (min)", "CPU ms/seq", "generated"],
                rows + extra)
    for label, runs in (("inline", o_runs), ("background writes", b_runs)):
        print(f"ours by phase, {label} (min s): " + ", ".join(
            f"{p} {min(r.wall[p] for r in runs):.3f}" for p in OURS_PHASES))
    gen = min(r.wall["generate"] for r in t_steps)
    rest = min(r.wall["step"] - r.wall["generate"] for r in t_steps)
    print(f"TRL step by phase (min s): generate+reward {gen:.3f}, "
          f"loss+backward+step+logging {rest:.3f}")
    trl_step = best["TRL GRPOTrainer step"]
    for name in list(best)[:4]:
        print(f"speed-up per sequence, {name} vs TRL step: {trl_step / best[name]:.2f}x")
    ratio = trl_step / best["ours whole it., background writes"]
    verdict("TRL step s/seq / ours whole-iteration s/seq", ratio,
            ratio >= TARGET and math.isfinite(ratio), f">= {TARGET}x")


if __name__ == "__main__":
    main()
