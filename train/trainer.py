"""``rtrees train``: on-policy GRPO-family training on rollout trees (issue 11).

One iteration of ``_train``'s loop, top to bottom:

1. **sample**: draw ``tasks_per_step`` tasks of the training split (disjoint from the
   fixed held-out split) and sample one tree each with the sampler and budget ``n_total``
   under the current weights (version k, published as checkpoint ``step-k``), in one
   engine wavefront; with ``dynamic_sampling`` (Q1, ``train.sampling.dynamic``) trees
   without both outcomes are resampled or dropped;
2. **commit** the trees with that ``policy_version`` and ``policy_ref`` (keyed: a resumed
   iteration re-samples the same trees and the store skips the duplicate commit);
3. **credit** (``train.credit_stage``, resolved once at start): scores the method reads
   (trace T2 under the frozen initial policy, factor F3 / sgcd Q3 under these weights),
   then credit through the registry (the code path of ``rtrees credit``), committed;
4. **reuse** (issue 12, ``train.reuse``; ``reuse`` != none): stored trees of earlier
   policy versions, scored under the pre-update weights pi_prox, their sibling
   comparisons resolved by the rule, refreshed routes committed with the credit used;
   they train beside the fresh trees with the behaviour weight w = pi_prox / mu (G8);
5. **batches** (``train.batches``): the trees cut into ``minibatches`` parts of whole
   trees, each part's rows and micro-batches, and its loss denominator (``train.loss``);
6. **epochs**: ``epochs`` PPO epochs of one optimizer step per part; loss =
   ``train.loss`` (G2-G4, E8-E9), normalised over each mini-batch so gradient
   accumulation over micro-batches changes nothing; statistics in ``train.stats``;
7. **publish** the new weights as version k+1 (never non-finite ones); held-out success
   (sampled and greedy) every ``eval_every`` iterations; metrics into the store's
   ``metrics`` table; checkpoint ``step-(k+1)`` (``train.run``: weights, optimizer,
   scheduler, RNG, sampler state; atomic, digested, bound to the store).

The writes (commits, checkpoints) are jobs of one writer thread run in order while the
loop goes on (``train.writer``; ``background_writes``): the loop waits for the last
checkpoint before its first optimizer step, for every write before the reuse stage reads
the store, and at the end.

The run directory's life (its lock, the run id's claim, checkpoints, resume) is
``train.run``: every random choice is seeded from (seed, iteration, ...) and all state is
restored, so on CPU a resumed run gives the same per-step losses and final weights as an
uninterrupted one. Each start is an attempt (``rollout_store.attempts``); an iteration
whose replayed trees differ from what an earlier attempt committed (another device) is
committed as this attempt's retry (``KEY@aN``, tree ids ``ID@aN``).

Data-parallel (issue 16, ``train.distributed``; ``torchrun --nproc-per-node N`` or
``rtrees train --nproc N``): the lines marked ``DDP`` split the iteration's trees over
ranks (tree j on rank j mod N), gather them, let rank 0 commit, checkpoint and evaluate,
normalise each mini-batch's loss by global counts and sum the gradients over ranks, so N
ranks compute the single-rank update (within float summation order).

Sharded (issue 27, ``--shard fsdp``, ``train.fsdp``): the lines marked ``FSDP`` train a
copy of the model sharded by FSDP2, whose gradient reduce-scatter replaces the
all-reduce; every rank runs the same number of forward/backward passes per optimizer
step (a zero-weight pass where it has fewer micro-batches); the loaded model stays whole
on every rank, receives the full weights after each iteration and is what samples,
evaluates, scores and names the policy version; every rank writes its shard of each
checkpoint, and ``--resume`` reshards it onto any number of ranks.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import torch

from rollout_store.attempts import as_retry
from rollout_store.maintenance import record_attempt
from rollout_store.store import open_store
from train import distributed as dp
from train import fsdp
from train.batches import NodeCredit, SplitTree, Unit, make_rows, micro_batches
from train.config import CONFIG_FILE, TrainConfig, check_resume, read_config
from train.credit_stage import credit_for, make_credit, stored_credit_key
from train.envs import make_env
from train.forward import Piece, has_dropout, loss_pieces, tree_layout_problem
from train.loss import TokenLoss, aggregate, denominator, token_loss, token_weights
from train.policies.hf import HFPolicy, state_dict_version
from train.reuse.params import ReuseError
from train.reuse.stage import ReuseStage, make_reuse
from train.run import (
    OLD_STATE_FILE,
    OWNER_METRIC,
    OWNER_STEP,
    STATE_FILE,
    STATE_TENSORS,
    Commits,
    Resumed,
    RunIdTakenError,
    RunInUseError,
    RunLock,
    TrainError,
    check_config,
    check_store_env,
    checkpoint_dir,
    checkpoints,
    claim_run_id,
    clear_staging,
    commit_heldout,
    commit_metrics,
    latest_checkpoint,
    load_checkpoint,
    load_start_policy,
    lock_run_dir,
    open_run_dir,
    read_metrics,
    require_finite,
    restore_state,
    resume_checkpoint,
    save_after_commits,
    save_checkpoint,
    stored_heldout,
    task_splits,
    trainer_state,
)
from train.sampling import make_sampler
from train.sampling.base import mix_seed
from train.sampling.dynamic import dynamic_sampling
from train.sampling.engine import Engine, TreeJob
from train.sampling.evaluation import heldout_rows
from train.sequences import TreeSeqs, build_sequences
from train.stats import StepStats, iteration_metrics, logprob_diffs, progress_line, write_scalars
from train.writer import Writes


@dataclass
class TrainReport:
    run_id: str
    out: Path
    iterations: int = 0
    losses: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    heldout: dict[int, dict[str, float]] = field(default_factory=dict)
    rank: int = 0
    """Data-parallel rank that returns this report (rank 0 evaluates and holds ``heldout``)."""
    finished_before: bool = False
    """A resume found the run already finished: nothing ran, ``heldout`` is the stored one."""

    def summary(self) -> str:
        head = (f"{self.run_id}: already finished ({self.iterations} iterations in "
                f"{self.out}), nothing to do" if self.finished_before else
                f"{self.run_id}: {self.iterations} iterations in {self.out}")
        last = self.heldout[max(self.heldout)] if self.heldout else {}
        if "heldout_sampled" not in last:  # eval off (or none stored): no "nan" (issue 21)
            return f"{head}; held-out success not evaluated"
        greedy = last.get("heldout_greedy")
        return (f"{head}; held-out success {last['heldout_sampled']:.3f}"
                + ("" if greedy is None else f" (greedy {greedy:.3f})"))


# ------------------------------------------------------------------------------ loop

def train(config: TrainConfig, resume: bool = False) -> TrainReport:
    """Run (or with ``resume``, continue) the training run described by ``config``.

    Under ``torchrun`` / ``train.launch.launch`` every rank runs this function; the
    lines marked ``DDP`` are the data-parallel ones (``train.distributed``); with one
    process they do nothing. The run directory is locked (``open_run_dir``) from the
    moment it is written until this function returns."""
    held: list[RunLock | Writes] = []  # released last to first: the writes, then the lock
    try:
        return _train(config, resume, held)
    finally:
        for item in reversed(held):
            item.release()


def _train(config: TrainConfig, resume: bool, held: list[RunLock | Writes]) -> TrainReport:
    world = dp.init_world()  # DDP: rank and size from the environment (1: no group)
    check_config(config, world.size)
    config = config.replace(store=str(Path(config.store).resolve()),
                            out=str(Path(config.out).resolve()))
    out = Path(config.out)
    run_id = config.resolved_run_id
    if resume:
        check_resume(read_config(out), config)
    elif (out / CONFIG_FILE).exists():
        raise TrainError(f"{out} already holds a run; pass --resume to continue it")
    credit = make_credit(config)  # the credit method, resolved once (train.credit_stage)
    reuse = make_reuse(config, credit.credit, credit.stored_key)  # None: fresh trees only
    dp.barrier(world)  # DDP: every rank has checked the run directory before rank 0 writes
    try:
        if reuse is not None:
            reuse.check_params()  # before the store is created: a refusal writes nothing
        store = open_store(config.store, create=True) if world.is_main else None
        dp.barrier(world)  # DDP: the store exists before the other ranks open it
        store = store or open_store(config.store)
        if reuse is None:
            check_store_env(store, config.env)
        else:  # stored trees of another env are skipped and counted, not refused
            reuse.check(store, run_id)
    except ReuseError as exc:
        raise TrainError(str(exc)) from exc
    train_tasks, heldout = task_splits(config)
    failure: TrainError | None = None
    if world.is_main:  # DDP: rank 0 locks and writes the run directory, claims the run id
        try:
            held.append(open_run_dir(out, config, store, resume))
        except TrainError as exc:
            failure = exc
    if dp.all_max(world, [float(failure is not None)])[0]:  # DDP: every rank stops
        raise failure or TrainError(f"rank 0 could not open the run directory {out}")
    if world.is_main:
        if reuse is not None:
            reuse.start(out)
        clear_staging(out)  # a checkpoint write a kill interrupted

    resumed = resume_checkpoint(out, config, warn=world.is_main) if resume else None
    policy = resumed.policy if resumed is not None else load_start_policy(config)
    if config.layout == "tree":
        problem = tree_layout_problem(policy.model)
        if problem is not None:  # the run's config.json still says tree: resumes agree
            if world.is_main:
                print(f"note: this model cannot train in the tree layout ({problem}); "
                      "training in the paths layout", flush=True)
            config = config.replace(layout="paths")
            reuse = make_reuse(config, credit.credit, credit.stored_key)  # binds the layout
    model = policy.model  # the model trained (FSDP: a sharded copy; policy.model samples)
    if config.sharded:
        try:
            model = fsdp.shard_for_training(policy.model, world)
        except fsdp.ShardError as exc:
            raise TrainError(f"--shard fsdp: {exc}") from None
    # The logprob check (config.check_logprobs): the training forward of an iteration's
    # first mini-batch runs before any optimizer step, so its logprobs are the sampling
    # policy's and the check costs nothing there; a model with active dropout is checked
    # by a separate no-grad forward of every mini-batch instead.
    check_in_loss = config.check_logprobs and not has_dropout(policy.model)
    ref_policy = None  # the frozen initial policy: KL reference, and the T2 scorer
    if config.kl_coef > 0 or credit.needs_reference:
        ref_policy = load_start_policy(config)
        ref_policy.model.eval().requires_grad_(False)
        credit = credit.with_reference(ref_policy)
    ref_model = ref_policy.model if config.kl_coef > 0 and ref_policy is not None else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,  # FSDP: after sharding
                                  weight_decay=config.weight_decay)
    shards = fsdp.Shards(world, model, optimizer) if config.sharded else None
    warm = config.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    sampler = make_sampler(config.sampler, max_new_tokens=config.max_new_tokens,
                           temperature=config.temperature, **config.sampler_params)
    success = sampler.config.success_threshold  # the run's one success rule
    start = 0 if resumed is None else restore_state(resumed, model, optimizer, scheduler,
                                                    sampler, shards)
    writer = None
    if config.tensorboard and world.is_main:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tensorboard"))
    report = TrainReport(run_id, out, rank=world.rank)

    def publish(step: int) -> HFPolicy:
        version = f"{run_id}-{state_dict_version(policy.model)}"  # FSDP: the full weights
        return policy.published(str(checkpoint_dir(out, step)), version)

    def save(step: int) -> Callable[[], None]:
        """The write of checkpoint ``step``: ``current`` and the trainer state as they are
        now (the RNG and optimizer state taken here, before the loop moves on)."""
        return partial(save_after_commits, out, step, current, trainer_state(
            step, optimizer, scheduler, sampler, shards), store, config, shards)

    def evaluate(step: int) -> tuple[dict[str, float], pa.Table]:
        """Held-out success of the weights after ``step`` iterations (metric step
        ``step - 1``); the seed depends only on ``step``, so every run of an env evaluates
        task i with the same stream at the same step."""
        return heldout_rows(current, config.env, heldout, step=step - 1, run_id=run_id,
                            seed=mix_seed(config.heldout_seed, "eval", step),
                            max_new_tokens=config.max_new_tokens, success_threshold=success)

    current = publish(start)
    if resumed is None and (world.is_main or shards is not None):  # DDP: rank 0 writes,
        save(0)()  # FSDP: every rank its shard
    elif resumed is not None:
        current = policy.published(str(resumed.path), resumed.version)
    # Each start of the run is an attempt (rollout_store.attempts), recorded with the
    # iteration it starts from.
    attempt = int(dp.all_max(world, [float(record_attempt(store, run_id, start))
                                     if world.is_main else 0.0])[0])
    # Commits and checkpoints run in order on a background thread (train.writer); inline
    # for DDP / FSDP and for a replay that may have to retry its keys.
    writes = Writes(config.background_writes and world.size == 1 and shards is None
                    and attempt < 2)
    held.append(writes)
    checkpointed = 0  # the ticket of the last checkpoint's write
    commit = Commits(store, writes, run_id, attempt, world.is_main)
    if start == 0 and config.eval_every and heldout and world.is_main:  # step -1
        initial, rows = evaluate(0)
        writes.submit(partial(commit_heldout, store, run_id, -1, rows))
        writes.submit(partial(commit_metrics, store, run_id, -1, initial))
        report.heldout[0] = initial
    for it in range(start, config.steps):
        metrics: dict[str, float] = {}
        t0, waited = time.perf_counter(), writes.waited
        # 1. sample: draw tasks, one tree each with the current weights, in one wavefront
        rng = np.random.default_rng(mix_seed(config.seed, "tasks", it))
        picks = rng.choice(len(train_tasks), size=min(config.tasks_per_step, len(train_tasks)),
                           replace=False)
        model.eval()
        mine = Engine(current).sample_trees([
            TreeJob(sampler, partial(make_env, config.env), train_tasks[i], config.n_total,
                    seed=mix_seed(config.seed, "tree", it, j),
                    tree_id=f"{run_id}/it{it:06d}/{j:03d}", run_id=run_id)
            for j, i in enumerate(picks) if world.owns(j)])  # DDP: tree j on rank j mod W
        if config.dynamic_sampling_on:  # Q1: groups with both outcomes (one rank)
            mine, ds = dynamic_sampling(
                mine, [train_tasks[i] for i in picks], sampler, current, env=config.env,
                n_total=config.n_total, seed=config.seed, it=it, run_id=run_id,
                rounds=config.dynamic_rounds if config.dynamic_sampling_resamples else 0)
            metrics.update(ds)
        n_trees = len(mine) if config.dynamic_sampling_on else len(picks)
        trees = dp.gather_shards(world, mine, n_trees)  # DDP: every tree on every rank
        t1 = time.perf_counter()
        # 2. commit with policy_version / policy_ref of these weights (DDP: rank 0 commits
        #    every rank's trees under the single-process key, so they land once)
        retry = commit.trees(it, trees)  # True: an earlier attempt committed other trees
        if dp.all_max(world, [float(retry)])[0]:  # DDP: every rank renames its trees
            commit.retry = retry = True
            mine, trees = as_retry(mine, attempt), as_retry(trees, attempt)
            commit("trees", trees)  # as this attempt's retry: KEY@aN, ids ID@aN
        t2 = time.perf_counter()
        # 3. credit, committed (a method's scores first; DDP: each rank its own trees)
        credit_of = credit.step(trees, mine, current, world, commit, it)
        # 4. reuse: stored trees scored under pi_prox, resolved, refreshed, credited
        seqs = [build_sequences(t, current.prompt_ids) for t in trees]
        prox: dict[tuple[str, int], np.ndarray] | None = None
        staleness: dict[str, int] = {}
        n_batch = len(trees)
        if reuse is not None:
            writes.wait()  # the stage reads the store
            try:
                got = reuse.step(store, model, current, it, commit.key,
                                 partial(as_retry, attempt=attempt) if retry else None)
            except ReuseError as exc:  # e.g. every stored tree too thin for a gated rule
                raise TrainError(str(exc)) from exc
            credit_of.update(got.credit)
            seqs += got.seqs
            n_batch += len(got.trees)
            prox, staleness = got.prox, got.staleness
            metrics.update(got.metrics)
        t3 = time.perf_counter()
        # 5. batches: whole trees cut into mini-batches (U1: the stored trees' own parts
        #    for the extra passes over them)
        parts = _minibatch_parts(n_batch, config, it)
        n_parts = len(parts)
        passes = 1 if reuse is None else reuse.stored_passes
        if passes > 1:
            parts += [[len(trees) + i for i in part]
                      for part in _minibatch_parts(n_batch - len(trees), config, it)]
        batches, metrics["split_trees"] = _batches(parts, seqs, credit_of, prox, staleness,
                                                   config, world, shards is not None,
                                                   current.pad_id)
        stats = StepStats(config.clip_low, config.check_logprobs)
        if config.check_logprobs and not check_in_loss:  # full weights (FSDP: no collective)
            stats.logprob_diffs = logprob_diffs(policy.model, [u for b in batches
                                                               for u in b.units])
        # 6. epochs: one optimizer step per mini-batch
        writes.wait(checkpointed)  # it reads the weights and optimizer state stepped next
        model.train()
        for epoch in range(config.epochs + passes - 1):  # U1: passes - 1 over stored parts
            order = (_epoch_order(n_parts, config, it, epoch) if epoch < config.epochs
                     else list(range(n_parts, len(batches))))
            for b in (batches[p] for p in order):
                optimizer.zero_grad(set_to_none=True)
                # a split tree (tree_row_tokens) is several pieces: its trunk forwarded
                # once, each branch's backward before the next branch's forward
                for piece in (piece for unit in b.units if unit.n_loss_tokens
                              for piece in loss_pieces(model, unit, with_entropy=True,
                                                       entropy_grad=config.entropy_coef > 0,
                                                       ref_model=ref_model)):
                    assert piece.entropy is not None
                    if check_in_loss and not stats.stepped:  # no optimizer step yet
                        stats.logprob_diffs.append(
                            float((piece.logp.detach() - piece.mb.old_logp).abs().max()))
                    loss, terms = _loss(piece, b.denominator, reuse, config)
                    piece.backward(loss)
                    stats.add(piece.mb, terms, loss, piece.entropy)
                for _ in range(b.dummies):  # FSDP: as many passes as the rank with the most
                    fsdp.dummy_backward(model, current.pad_id)
                if shards is None:  # FSDP reduce-scatters the gradients in backward
                    dp.all_reduce_grads(world, model.parameters())  # DDP: the part's grad
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), config.grad_clip if config.grad_clip > 0 else math.inf)
                stats.step(fsdp.full_value(grad_norm))
                optimizer.step()
                scheduler.step()
        model.eval()
        fsdp.copy_full_weights(model, policy.model)  # FSDP: the replica gets the new weights
        stats.reduce(world)  # DDP: every rank's tokens
        t4 = time.perf_counter()
        if reuse is not None:
            metrics.update(reuse.loss_metrics())
            metrics["reuse_stored_passes"] = float(passes)
            metrics["reuse_extra_optimizer_steps"] = float(
                (passes - 1) * (len(batches) - n_parts))
        metrics.update(stats.metrics(t4 - t3))
        metrics.update(iteration_metrics(trees, seqs, success, metrics.get(
            "reuse_new_tool_steps", 0.0) + metrics.get("ds_extra_tool_steps", 0.0)))
        metrics.update({
            "lr": float(scheduler.get_last_lr()[0]),
            "rss_mb": psutil.Process().memory_info().rss / 2**20,
            "seconds_sample": t1 - t0, "seconds_commit": t2 - t1,
            "seconds_credit": t3 - t2, "seconds_train": t4 - t3,
            "seconds_wait_writes": writes.waited - waited,  # within credit and train
        })
        # 7. publish version it + 1 (diverged weights stop the run here, before anything
        #    samples them); held-out success; metrics; checkpoint (queued)
        require_finite(policy, it + 1)
        current = publish(it + 1)
        report.iterations = it + 1
        report.losses.append(metrics["loss"])
        report.rewards.append(metrics["reward"])
        if not world.is_main:  # DDP: rank 0 evaluates, commits metrics, checkpoints
            if shards is not None:  # FSDP: every rank writes its shard of the checkpoint
                save(it + 1)()
            continue
        if config.eval_every and heldout and ((it + 1) % config.eval_every == 0 or
                                              it + 1 == config.steps):
            t5 = time.perf_counter()
            rates, rows = evaluate(it + 1)
            writes.submit(partial(commit_heldout, store, run_id, it, rows,
                                  attempt if retry else 0))
            metrics.update(rates)
            metrics["seconds_eval"] = time.perf_counter() - t5
            report.heldout[it + 1] = metrics
        writes.submit(partial(commit_metrics, store, run_id, it, metrics,
                              attempt if retry else 0))
        if writer is not None:
            write_scalars(writer, metrics, it)
        checkpointed = writes.submit(save(it + 1))
        if config.progress:
            print(progress_line(run_id, it, config.steps, metrics), file=sys.stderr,
                  flush=True)
    writes.close()  # every commit and checkpoint written; a failed one raises here
    if start >= config.steps and world.is_main:  # resumed a finished run: its stored result
        report.iterations, report.finished_before = start, True
        report.heldout.update(stored_heldout(store, run_id))
    if writer is not None:
        writer.close()
    dp.finish(world)  # DDP: leave the process group this call joined
    return report


def _loss(piece: Piece, d: float, reuse: ReuseStage | None, config: TrainConfig
          ) -> tuple[torch.Tensor, TokenLoss]:
    """One loss piece's scalar loss and per-token terms: the clipped surrogate with the
    behaviour weight of stored tokens (G8: w = pi_prox / mu, 1 on fresh ones), KL and
    entropy terms (``train.loss.token_loss``), weighted per token by the aggregation
    (``token_weights``) and summed over the mini-batch's denominator ``d``
    (``aggregate``)."""
    mb, logp = piece.mb, piece.logp
    weight, old_logp = None, mb.old_logp
    if reuse is not None:  # stored tokens: mb.stored
        weight, old_logp = reuse.weight(mb, logp)
    terms = token_loss(logp, old_logp, mb.advantage, mb.clip_low, mb.clip_high,
                       dual_clip=config.dual_clip, ref_logp=piece.ref, kl_coef=config.kl_coef,
                       kl_estimator=config.kl_estimator,
                       entropy=piece.entropy if config.entropy_coef > 0 else None,
                       entropy_coef=config.entropy_coef, weight=weight)
    w = token_weights(config.aggregation, mb.traj_count, mb.inv_len_sum, mb.action_len)
    return aggregate(terms.loss, torch.ones_like(w, dtype=torch.bool), w, d), terms


@dataclass(frozen=True)
class _Batch:
    """One mini-batch: this rank's micro-batches, the loss denominator over every rank
    (``train.loss.denominator``), and the zero-weight passes FSDP adds to it."""

    units: list[Unit]
    denominator: float
    dummies: int


def _batches(parts: list[list[int]], seqs: list[TreeSeqs],
             credit: dict[tuple[str, int], NodeCredit],
             prox: dict[tuple[str, int], np.ndarray] | None, staleness: dict[str, int],
             config: TrainConfig, world: dp.World, sharded: bool, pad_id: int
             ) -> tuple[list[_Batch], float]:
    """Each part's (tree indices into ``seqs``) rows and micro-batches, and the number of
    trees split over ``tree_row_tokens``. FSDP splits no tree: a split tree's forwards and
    backwards interleave, so ranks would issue their collectives in different orders."""
    row_tokens = None if sharded else config.tree_row_tokens or None
    out, split = [], 0.0
    for part in parts:
        part_seqs = [seqs[i] for i in part if world.owns(i)]  # DDP: this rank's trees
        rows = make_rows(part_seqs, credit, config.layout, config.node_weight,
                         config.clip_low, config.clip_high, max_row_tokens=row_tokens,
                         prox=prox, staleness=staleness)
        mbs = micro_batches(rows, config.layout, config.micro_tokens, pad_id=pad_id)
        n_tokens = sum(float(mb.traj_count.sum()) for mb in mbs)
        n_seqs = sum(len(s.leaves) for s in part_seqs)
        n_actions = sum(float((mb.traj_count / mb.action_len).sum()) for mb in mbs
                        if mb.action_len is not None)  # F6: (trajectory, action) pairs
        tokens, paths, actions = dp.all_sum(world, [n_tokens, n_seqs, n_actions])  # DDP
        d = denominator(config.aggregation, tokens, paths, config.norm_length, actions)
        n_live = sum(1 for mb in mbs if mb.n_loss_tokens)
        n_passes = fsdp.passes_needed(world, n_live) if sharded else n_live
        out.append(_Batch(mbs, d, n_passes - n_live))
        split += sum(isinstance(u, SplitTree) for u in mbs)
    return out, split


def _minibatch_parts(n_trees: int, config: TrainConfig, it: int) -> list[list[int]]:
    """The iteration's trees cut into ``minibatches`` parts (whole trees), seeded."""
    g = torch.Generator().manual_seed(mix_seed(config.seed, "parts", it))
    order = torch.randperm(n_trees, generator=g).tolist()
    k = min(config.minibatches, n_trees)
    return [order[i::k] for i in range(k)]


def _epoch_order(n_parts: int, config: TrainConfig, it: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(mix_seed(config.seed, "epoch", it, epoch))
    return torch.randperm(n_parts, generator=g).tolist()


__all__ = ["OLD_STATE_FILE", "OWNER_METRIC", "OWNER_STEP", "STATE_FILE", "STATE_TENSORS",
           "Resumed", "RunIdTakenError", "RunInUseError", "TrainError", "TrainReport",
           "check_config", "checkpoint_dir", "checkpoints", "claim_run_id", "credit_for",
           "latest_checkpoint", "load_checkpoint", "load_start_policy", "lock_run_dir",
           "read_metrics", "require_finite", "resume_checkpoint", "save_checkpoint",
           "stored_credit_key", "task_splits", "train"]
