"""``rtrees train``: on-policy GRPO-family training on rollout trees (issue 11).

One iteration, top to bottom in ``train``:

1. draw ``tasks_per_step`` tasks of the training split (disjoint from the fixed held-out
   split);
2. sample one tree per task with the sampler and budget ``n_total`` under the current
   weights (version k, published as checkpoint ``OUT/checkpoints/step-k``);
3. commit the trees with that ``policy_version`` and ``policy_ref`` (keyed: a resumed
   iteration re-samples the same trees and the store skips the duplicate commit);
4. compute credit through the registry (``credit_trees``, the code path of
   ``rtrees credit``) and commit it (keyed);
4b. with ``reuse`` != none (issue 12, ``train.reuse``): draw stored trees of earlier
   policy versions, score their actions under the pre-update weights pi_prox, resolve
   their sibling comparisons (reuse / transport D3-D5 / gate D7-D10 / refresh), commit
   the refreshed trees and the credit used (method ``CREDIT+RULE``); they train beside
   the fresh trees with the decoupled behaviour weight w = pi_prox / mu (G8);
5. build token batches (``train.batches``), run ``epochs`` PPO epochs of ``minibatches``
   optimizer steps each; loss = ``train.loss`` (G2-G4, E8-E9), normalised over each
   mini-batch so gradient accumulation over micro-batches changes nothing;
6. held-out success (sampled and greedy) every ``eval_every`` iterations, metrics into
   the store's ``metrics`` table, then publish the new weights as checkpoint
   ``step-(k+1)``: model and tokenizer (an ordinary HF directory: ``hf:PATH`` loads it),
   optimizer, scheduler, RNG states, iteration, store version, sampler state (JSON and
   safetensors, never a pickle: ``train.rundir.save_state``), and ``rtrees_policy.json``
   with the version, run id, env, run configuration and the sha256 of every file;
   written to a temporary directory and renamed into place (``train.rundir``). The last
   ``keep_last`` checkpoints and every ``save_every``-th are kept.

The writes of steps 3, 4, 4b and 6 (commits, checkpoint) are jobs of one writer thread
run in order while the loop goes on (``train.writer``; ``background_writes``): the loop
waits for the last checkpoint before its first optimizer step, for every write before
the reuse stage reads the store, and at the end. The finite check of the weights to
publish runs on the loop's thread, before anything samples them.

Trace credit (T2) scores the gold answer at every node of the fresh trees under a frozen
copy of the initial policy; the scores are committed to ``policy_scores`` (keyed) and the
credit is computed from them (``credit_for``), as ``rtrees credit --method trace`` would.

Data-parallel (issue 16, ``train.distributed``; ``torchrun --nproc-per-node N`` or
``rtrees train --nproc N``): the lines marked ``DDP`` split the iteration's trees over
ranks (tree j on rank j mod N), gather them, let rank 0 commit, checkpoint and evaluate,
normalise each mini-batch's loss by global counts and sum the gradients over ranks, so N
ranks compute the single-rank update (within float summation order).

Sharded (issue 27, ``--shard fsdp``, ``train.fsdp``): the lines marked ``FSDP`` train a
copy of the model sharded by FSDP2 (each decoder layer, the embeddings with the LM head,
the decoder), whose gradient reduce-scatter replaces the all-reduce; every rank runs the
same number of forward/backward passes per optimizer step (a zero-weight pass where it
has fewer micro-batches); the loaded model stays whole on every rank, receives the full
weights after each iteration and is what samples, evaluates, scores and names the policy
version; every rank writes its shard of each checkpoint (``torch.distributed.checkpoint``
under ``dcp/``, with the same HF directory, metadata and trainer state as unsharded), and
``--resume`` reshards it onto any number of ranks.

One trainer per run directory, one run directory per run id: ``open_run_dir`` holds an
exclusive lock on ``OUT/train.lock`` for the run's lifetime, creates ``config.json``
exclusively with a random run token, and records the token with the run id in the
store's ``metrics`` (row ``run_token``, step -2); another directory's run of the same id
(``/a/run`` and ``/b/run`` both default to ``train-run``) is refused (``RunIdTakenError``).

Resume (``resume=True``) loads the newest checkpoint that passes every check
(``load_checkpoint``: file digests, run id, env, run configuration, finite weights whose
recomputed version is the recorded one, state in the current format); a damaged or
foreign newer one is named in a one-line warning and skipped (``resume_checkpoint``),
and none usable is a ``TrainError``. Every random choice is seeded from (seed,
iteration, ...) and all state is restored, so on CPU a resumed run gives the same
per-step losses and final weights as an uninterrupted one. Each start is an attempt,
recorded in ``metrics`` (``rollout_store.attempts``); an iteration whose replayed trees
differ from what an earlier attempt committed (another device) is committed as this
attempt's retry (``KEY@aN``, tree ids ``ID@aN``) and the store's ``*_latest`` views hide
the rows it superseded.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import torch

from rollout_store.attempts import as_retry, retry_key, training_metrics
from rollout_store.maintenance import record_attempt
from rollout_store.reader import connect
from rollout_store.schema import EVALUATIONS, metrics_table
from rollout_store.store import CommitKeyConflictError, Store, now_utc, open_store
from rollout_store.tree import Tree
from train import distributed as dp
from train import fsdp
from train.batches import (
    NodeCredit,
    SplitTree,
    build_sequences,
    forward_logprobs,
    has_dropout,
    loss_pieces,
    make_rows,
    micro_batches,
    rows_credit,
    tree_layout_problem,
    tree_token_ratio,
)
from train.coerce import literal_value
from train.config import (
    CONFIG_FILE,
    RESUMABLE_FIELDS,
    UNSUPPORTED_CREDIT,
    ConfigError,
    TrainConfig,
    check_resume,
    create_config,
    new_run_token,
    read_config,
    read_run_token,
    write_config,
)
from train.credit.scores import GOLD
from train.credit.store_io import resolve_method, token_score_kinds
from train.envs import Task, env_class, make_env
from train.envs.base import task_identity
from train.envs.registry import same_env
from train.loss import (
    aggregate,
    denominator,
    masked_mean,
    token_loss,
    token_weights,
)
from train.policies.hf import HFPolicy, check_finite, quiet_progress, state_dict_version
from train.reuse.params import ReuseError, ReuseParams
from train.reuse.stage import make_reuse
from train.rundir import (
    META_FILE,
    CheckpointError,
    StateBinding,
    load_state,
    save_state,
    verify_checkpoint,
    write_checkpoint,
)
from train.sampling import SAMPLERS, CaliperSampler, CaliperState, Sampler, make_sampler
from train.sampling.base import mix_seed
from train.sampling.engine import Engine, TreeJob
from train.sampling.evaluation import run_episodes
from train.scoring import score_trees
from train.writer import Writes

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"  # structure and scalars (train.rundir.save_state)
STATE_TENSORS = "trainer_state.tensors"  # its tensors, safetensors format (not *.safetensors:
#                                          loaders glob those as weights)
OLD_STATE_FILE = "trainer_state.pt"  # the pickled format of earlier versions: never loaded


class TrainError(RuntimeError):
    """The run cannot start or continue (bad input, a store of another env, ...)."""


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


# ----------------------------------------------------------------------------- setup

def check_config(config: TrainConfig, world_size: int = 1) -> None:
    """Every named error that needs no heavy work (before anything is loaded or written);
    ``world_size``: the number of data-parallel ranks (``train.distributed``)."""
    if not config.store or not config.out:
        raise ConfigError("store and out are required")
    try:
        env_class(config.env)
    except ValueError as exc:  # EnvSpecError, in one line
        raise ConfigError(f"env: {exc}") from None
    if config.sampler not in SAMPLERS:
        raise ConfigError(f"unknown sampler {config.sampler!r}; choose from {list(SAMPLERS)}")
    from train.credit import ESTIMATORS
    from train.credit.store_io import CreditError, resolve_method

    if config.credit not in ESTIMATORS:
        raise ConfigError(f"unknown credit {config.credit!r}; choose from {sorted(ESTIMATORS)}")
    if config.credit in UNSUPPORTED_CREDIT:
        raise ConfigError(f"credit {config.credit!r} {UNSUPPORTED_CREDIT[config.credit]}")
    if config.credit == "trace" and "ref" in config.credit_params:
        raise ConfigError("credit_params: trace in the trainer scores with the frozen initial "
                          "policy (T2); drop ref=")
    try:
        resolve_method(config.credit, {k: str(v) for k, v in config.credit_params.items()})
    except CreditError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        make_sampler(config.sampler, **config.sampler_params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc
    kind = config.policy.partition(":")[0]
    if config.policy != "tiny" and kind not in ("tiny", "hf"):
        raise ConfigError(f"the trainer trains 'tiny', 'tiny:ENV' or 'hf:PATH' policies, "
                          f"not {config.policy!r}")
    try:
        ReuseParams.parse(config.reuse_params)
    except ValueError as exc:
        raise ConfigError(f"reuse_params: {exc}") from exc
    if config.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as exc:
            raise ConfigError("--tensorboard needs the tensorboard package "
                              "(pip install tensorboard)") from exc
    if config.credit == "trace" and config.reuses_stored:
        raise ConfigError("credit 'trace' with reuse: the trainer scores only the fresh trees "
                          "under the frozen reference (T2); use reuse none")
    if config.credit in ("factor", "sgcd") and "teacher" in config.credit_params:
        raise ConfigError(f"credit_params: {config.credit} in the trainer scores each tree "
                          "with the weights that sampled it (F3, Q3); drop teacher=")
    if config.credit in ("factor", "sgcd") and config.reuses_stored:
        raise ConfigError(f"credit {config.credit!r} with reuse: the trainer scores only the "
                          "fresh trees (F3, Q3); use reuse none")
    if world_size > 1 and config.dynamic_sampling_on:
        raise ConfigError("dynamic_sampling resamples a rank's trees one by one, which ranks "
                          "cannot share yet: train with one rank")
    if world_size > 1 and config.reuses_stored:
        raise ConfigError(f"reuse {config.reuse!r} is not data-parallel yet (stored trees are "
                          "drawn and refreshed by one process): train with one rank")
    if world_size > 1 and config.sampler == "caliper":
        raise ConfigError("sampler 'caliper' updates its bucket statistics tree by tree "
                          "within an iteration, which ranks cannot share: train with one rank")


def check_store_env(store: Store, env: str) -> None:
    con = connect(store)
    envs = [r[0] for r in con.execute("SELECT DISTINCT env FROM trees").fetchall()]
    other = sorted(e for e in envs if not same_env(e, env))
    if other:
        raise TrainError(f"store {store.path} holds trees of env {other}, not {env!r}")


def task_splits(config: TrainConfig) -> tuple[list[Task], list[Task]]:
    """(train, held-out): the held-out split is fixed by ``heldout_seed``; training tasks
    that occur in it (same prompt and config, ``task_identity``) are dropped, so the two
    are disjoint. Both splits are drawn
    with ``task_params`` (a bad option is a ``TrainError`` naming it)."""
    cls = env_class(config.env)
    generate = getattr(cls, "generate_tasks", None)
    if generate is None:
        raise TrainError(f"env {config.env!r} has no task generator")
    try:
        options = {k: literal_value(v, f"task_params.{k}") for k, v in config.task_params.items()}
        heldout = list(generate(config.heldout_tasks, seed=config.heldout_seed, **options)) \
            if config.heldout_tasks else []
        drawn = generate(config.train_tasks, seed=config.seed, **options)
    except (TypeError, ValueError) as exc:  # the generator names the bad option
        raise TrainError(f"task_params {dict(config.task_params)}: {exc}") from None
    seen = {task_identity(t) for t in heldout}
    train = [t for t in drawn if task_identity(t) not in seen]
    if not train:
        raise TrainError("the training split is empty")
    return train, heldout


def load_start_policy(config: TrainConfig, checkpoint: Path | None = None) -> HFPolicy:
    from train.policies import load_policy

    spec = f"hf:{checkpoint}" if checkpoint is not None else config.policy
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    policy = load_policy(spec, config.env, device="cpu", dtype=dtype)
    if not isinstance(policy, HFPolicy):
        raise TrainError(f"{spec} is not a transformers policy")
    return policy


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS / f"step-{step:06d}"


def checkpoints(out: Path) -> list[Path]:
    """Every published checkpoint directory, oldest first (temporary ones start with '.')."""
    root = out / CHECKPOINTS
    found = [p for p in root.glob("step-*") if p.is_dir()
             and p.name[5:].isdigit()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(out: Path) -> Path | None:
    """The newest published checkpoint (``resume_checkpoint`` checks it before use)."""
    found = checkpoints(out)
    return found[-1] if found else None


def run_fields(config: TrainConfig) -> dict[str, Any]:
    """The run's configuration but ``RESUMABLE_FIELDS`` (run directory, store, seed, ...),
    as JSON holds it: a checkpoint records it, so one copied from another run (or a
    ``config.json`` edited since) is recognised, field by field."""
    fields = {k: v for k, v in config.to_dict().items() if k not in RESUMABLE_FIELDS}
    loaded: dict[str, Any] = json.loads(json.dumps(fields))
    return loaded


def require_finite(policy: HFPolicy, step: int) -> None:
    """``TrainError`` (training diverged) unless every weight of ``policy`` is finite: the
    weights are never published as checkpoint ``step``, nor sampled from."""
    try:
        check_finite(policy.model, f"the weights to publish as step-{step:06d}")
    except CheckpointError as exc:
        raise TrainError(f"{exc}: training diverged, checkpoint step-{step:06d} not written "
                         "(lower lr or set grad_clip)") from None


def save_checkpoint(out: Path, step: int, policy: HFPolicy, version: str, state: dict[str, Any],
                    config: TrainConfig, shards: fsdp.Shards | None = None,
                    store: Store | None = None) -> Path:
    """Write checkpoint ``step`` atomically with a sha256 per file
    (``train.rundir.write_checkpoint``); prune. Non-finite weights are never published.
    ``shards`` (FSDP): called on every rank, each writes its shard of the model and
    optimizer under ``dcp/`` and rank 0 the rest (``train.fsdp.save_sharded``); ``policy``
    holds the full weights on every rank."""
    require_finite(policy, step)

    def fill(tmp: Path) -> None:
        with quiet_progress():
            policy.model.save_pretrained(tmp)
        policy.tokenizer.save_pretrained(tmp)
        save_state(state, tmp / STATE_FILE, tmp / STATE_TENSORS, StateBinding(  # issue 50
            config.resolved_run_id, step, read_run_token(out), store))

    meta = {"policy_version": version, "env": config.env, "step": step,
            "run_id": config.resolved_run_id, "trained_from": config.policy,
            "config": run_fields(config)}
    if shards is None:
        final = write_checkpoint(checkpoint_dir(out, step), fill, meta)
    else:  # FSDP: the replica in ``policy`` holds the full weights: no gather for them
        final = fsdp.save_sharded(checkpoint_dir(out, step), shards.world, shards.model,
                                  shards.optimizer, meta, lambda tmp, _: fill(tmp),
                                  gather_full=False)
        if not shards.world.is_main:
            return final
    steps = [int(p.name[5:]) for p in checkpoints(out)]
    for s in steps[:-config.keep_last]:
        if s % config.save_every:
            shutil.rmtree(checkpoint_dir(out, s), ignore_errors=True)
    return final


@dataclass(frozen=True)
class Resumed:
    """A checkpoint that passed every check of ``resume_checkpoint``, loaded."""

    path: Path
    policy: HFPolicy
    version: str
    state: dict[str, Any]


def load_checkpoint(path: Path, config: TrainConfig) -> Resumed:
    """Checkpoint ``path`` of this run, loaded, after every check (``CheckpointError``
    naming what failed): the file digests (``verify_checkpoint``: truncated, missing,
    flipped or edited files), the run id, env, step and run configuration (``run_fields``) it
    records (a checkpoint of another run), finite weights whose recomputed version
    ``RUN-state_dict_version`` is the recorded one, and trainer state in the current
    format (JSON and safetensors: nothing is unpickled) bound to its weights, run token and
    the store's records (``train.rundir.StateBinding``: a forged field is named)."""
    meta = verify_checkpoint(path, require=("config.json", STATE_FILE, STATE_TENSORS) + (
        (f"{fsdp.DCP_DIR}/.metadata",) if config.sharded else ()))
    step = int(path.name[5:])
    recorded = meta.get("config")
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{path / META_FILE} records no run configuration")
    here = run_fields(config)  # fields added since the checkpoint was written: not compared
    named = ("run_id", "env", "step")  # the checkpoint's own: run_id resolved ("" is not)
    for key, want in (("run_id", config.resolved_run_id), ("env", config.env), ("step", step),
                      *((k, here[k]) for k in sorted(recorded) if k in here and k not in named)):
        got = meta.get(key) if key in named else recorded[key]
        if got != want:
            raise CheckpointError(f"{path / META_FILE} records {key} {got!r}, not this "
                                  f"run's {want!r}: a checkpoint of another run (or "
                                  "config.json was edited since)")
    if not any(name.endswith(".safetensors") for name in meta.get("files", {})):
        raise CheckpointError(f"{path / META_FILE} records no weights file")
    policy = load_start_policy(config, path)  # digests again, finite, version recomputed
    version = f"{config.resolved_run_id}-{state_dict_version(policy.model)}"
    if meta.get("policy_version") != version:
        raise CheckpointError(f"{path / META_FILE} names policy version "
                              f"{meta.get('policy_version')!r}, but the weights are {version!r}")
    state = load_state(path / STATE_FILE, path / STATE_TENSORS, StateBinding(  # issue 50
        config.resolved_run_id, step, read_run_token(Path(config.out)), open_store(config.store)))
    if not isinstance(state, dict) or state.get("iteration") != step or not all(
            k in state for k in ("optimizer", "scheduler", "rng")):
        raise CheckpointError(f"{path / STATE_FILE} is not the trainer state of step {step}")
    return Resumed(path, policy, version, state)


def resume_checkpoint(out: Path, config: TrainConfig, warn: bool = True) -> Resumed | None:
    """The newest checkpoint of ``out`` that passes ``load_checkpoint``, loaded; None when
    there is none at all (killed before step 0 was published).

    Each newer one that fails is named in a one-line warning on stderr (``warn``), and
    training continues from the previous one (the skipped iterations rerun; their
    commits are keyed, so nothing lands twice). ``TrainError`` when no checkpoint is
    usable, or the newest one is of the old pickled format (never unpickled)."""
    found = checkpoints(out)
    if not found:
        return None
    skipped: list[str] = []
    for path in reversed(found):
        if (path / OLD_STATE_FILE).exists() and not (path / STATE_FILE).exists():
            raise TrainError(f"{path / OLD_STATE_FILE} is the old pickled trainer-state "
                             "format, which is never loaded (unpickling a file can run "
                             "code): start a new run directory")
        try:
            resumed = load_checkpoint(path, config)
        except (CheckpointError, FileNotFoundError) as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        if warn:
            for why in skipped:
                print(f"warning: checkpoint {why}; resuming from {path.name}",
                      file=sys.stderr, flush=True)
        return resumed
    raise TrainError(f"no usable checkpoint in {out / CHECKPOINTS} ({'; '.join(skipped)})")


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


# ----------------------------------------------------------------------- credit / eval

def credit_for(trees: Sequence[Tree], config: TrainConfig, scores: pa.Table | None = None,
               ref_version: str | None = None
               ) -> tuple[pa.Table, dict[tuple[str, int], NodeCredit]]:
    """Credit rows (committed) and per-node token credit (trained on), through the
    registry: ``credit_trees`` is the code path of ``rtrees credit``; the rows carry the
    per-token clip bounds (ELC E8, CALIPER C8), so the credit trained on is the credit
    committed (``rows_credit``) and stored credit can be read back (``stored_credit_key``).
    ``scores``: trace's ``policy_scores`` rows (kind ``gold_answer``, T2) of these trees
    under the frozen reference of version ``ref_version`` (recorded as the params' ``ref``,
    so the params hash names the reference weights, as ``rtrees credit --param ref=``)."""
    from train.credit.store_io import credit_trees

    params = {k: str(v) for k, v in config.credit_params.items()}
    if ref_version is not None:
        params["ref"] = ref_version
    rows = credit_trees(trees, config.credit, params, run_id=config.resolved_run_id,
                        scores=scores)
    return rows, rows_credit(rows)


def stored_credit_key(config: TrainConfig) -> tuple[str, str] | None:
    """(method, params hash) under which ``credit_for(trees, config)`` (no scores) credits
    trees, when that credit is a function of each tree alone (not ``spans_trees``: a
    prompt group's credit depends on which trees are credited together), else None: the
    reuse stage reads stored trees' committed credit under this key instead of crediting
    them again (``train.reuse.stage``)."""
    from train.credit.store_io import resolve_method

    _, p = resolve_method(config.credit, {k: str(v) for k, v in config.credit_params.items()})
    return None if p.spans_trees() else (config.credit, p.params_hash())


# ------------------------------------------------------------- the run directory

LOCK_FILE = "train.lock"
OWNER_METRIC = "run_token"
"""Metrics row (step ``OWNER_STEP``, value = the run token of ``OUT/config.json``) that
records which run directory owns a run id in the store; ``read_metrics`` leaves it out."""
OWNER_STEP = -2


class RunInUseError(TrainError):
    """Another trainer process holds the run directory (its lock file)."""


class RunIdTakenError(TrainError):
    """The run id is used in the store by another run directory."""


@dataclass
class RunLock:
    """An exclusive ``flock`` on ``OUT/train.lock``, held for the run's lifetime; the
    kernel releases it when the process dies (``kill -9`` included)."""

    out: Path
    handle: Any
    created: Path | None = None
    """The outermost directory ``lock_run_dir`` created (``out`` or an ancestor)."""

    def release(self, remove_dir: bool = False) -> None:
        """Drop the lock; ``remove_dir``: also remove the directories this process created
        (a run refused before it wrote anything else; a non-empty one stays)."""
        if self.handle is None:
            return
        self.handle.close()
        self.handle = None
        if remove_dir and self.created is not None:
            (self.out / LOCK_FILE).unlink(missing_ok=True)
            for d in [self.out, *self.out.parents]:
                with contextlib.suppress(OSError):  # something else is in it: leave it
                    d.rmdir()
                if d == self.created:
                    break


def lock_run_dir(out: Path) -> RunLock:
    """Create ``out`` if needed and lock it exclusively (``RunInUseError`` naming the
    holder's pid when another process holds it)."""
    created = None
    for d in [out, *out.parents]:
        if d.exists():
            break
        created = d
    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / LOCK_FILE, "a+")  # noqa: SIM115 - held until release()
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "pid unknown"
        handle.close()
        raise RunInUseError(f"{out} is in use by another trainer ({holder}); wait for it to "
                            "end, or pass another --out") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return RunLock(out, handle, created)


def _run_rows(store: Store, run_id: str) -> tuple[list[int], int, str | None]:
    """(owner tokens recorded for ``run_id``, its other rows in trees / metrics / credits,
    the run directory its trees' ``policy_ref`` names, if any)."""
    con = connect(store)
    args = {"r": run_id, "n": OWNER_METRIC, "s": OWNER_STEP}
    tokens = [int(v) for (v,) in con.execute(
        "SELECT value FROM metrics WHERE run_id = $r AND name = $n AND step = $s "
        "ORDER BY created_at", args).fetchall()]
    [(rows,)] = con.execute(
        "SELECT (SELECT count(*) FROM trees WHERE run_id = $r) + (SELECT count(*) FROM "
        "credits WHERE run_id = $r) + (SELECT count(*) FROM metrics WHERE run_id = $r AND "
        "NOT (name = $n AND step = $s))", args).fetchall()
    refs = con.execute("SELECT policy_ref FROM trees WHERE run_id = $r AND policy_ref IS NOT "
                       "NULL LIMIT 1", {"r": run_id}).fetchall()
    ref = Path(refs[0][0]) if refs else None
    where = str(ref.parent.parent) if ref is not None and ref.parent.name == CHECKPOINTS \
        else None
    return tokens, int(rows), where


def _taken(store: Store, run_id: str, where: str | None) -> RunIdTakenError:
    other = f" ({where})" if where else ""
    return RunIdTakenError(f"run_id {run_id!r} is already used in store {store.path} by another "
                           f"run directory{other}: pass --run-id NAME for this run, or "
                           "--resume in that run's directory")


def claim_run_id(store: Store, run_id: str, token: int, fresh: bool) -> None:
    """Record ``token`` as the owner of ``run_id`` in the store, or refuse
    (``RunIdTakenError``) when another run directory owns it: one whose token is recorded,
    or, for a ``fresh`` run, any row of that run id (a run written before tokens). Two
    claims at once commit under one key, so one row lands; the loser sees the other's."""
    tokens, rows, where = _run_rows(store, run_id)
    if (tokens and tokens[0] != token) or (not tokens and rows and fresh):
        raise _taken(store, run_id, where)
    if tokens:
        return
    store.append_metrics(metrics_table(run_id, OWNER_STEP, {OWNER_METRIC: float(token)},
                                       now_utc()), key=f"{run_id}:owner")
    tokens, _, where = _run_rows(store, run_id)
    if not tokens or tokens[0] != token:
        raise _taken(store, run_id, where)


def open_run_dir(out: Path, config: TrainConfig, store: Store, resume: bool) -> RunLock:
    """Lock ``out`` for this run (``lock_run_dir``), write ``config.json`` (a fresh run:
    exclusively, with a new run token; ``--resume``: after checking it again under the
    lock) and claim the run id in the store with the token (``claim_run_id``). A run
    refused here leaves no run directory it created behind."""
    run_id = config.resolved_run_id
    lock = lock_run_dir(out)
    try:
        if resume:
            check_resume(read_config(out), config)  # again: another process may have been
            token = read_run_token(out)  # ... writing it before this one held the lock
            if token is None:  # a run directory written before run tokens: adopt it
                token = new_run_token()
            write_config(config, out, token)
            claim_run_id(store, run_id, token, fresh=False)
        else:
            exists = TrainError(f"{out} already holds a run; pass --resume to continue it")
            if (out / CONFIG_FILE).exists():  # written while this process waited
                raise exists
            tokens, rows, where = _run_rows(store, run_id)
            if tokens or rows:
                raise _taken(store, run_id, where)
            token = new_run_token()
            try:
                create_config(config, out, token)
            except FileExistsError:
                raise exists from None
            try:
                claim_run_id(store, run_id, token, fresh=True)
            except RunIdTakenError:
                (out / CONFIG_FILE).unlink(missing_ok=True)
                raise
    except BaseException:
        lock.release(remove_dir=True)
        raise
    return lock


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
    reuse = make_reuse(config)  # stored-tree reuse (train.reuse); None: fresh trees only
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
        for tmp in (out / CHECKPOINTS).glob(".step-*") if (out / CHECKPOINTS).is_dir() else []:
            shutil.rmtree(tmp, ignore_errors=True)  # a checkpoint write a kill interrupted

    resumed = resume_checkpoint(out, config, warn=world.is_main) if resume else None
    start_ckpt = resumed.path if resumed is not None else None
    policy = resumed.policy if resumed is not None else load_start_policy(config)
    if config.layout == "tree":
        problem = tree_layout_problem(policy.model)
        if problem is not None:  # the run's config.json still says tree: resumes agree
            if world.is_main:
                print(f"note: this model cannot train in the tree layout ({problem}); "
                      "training in the paths layout", flush=True)
            config = config.replace(layout="paths")
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
    ref_policy = None  # the frozen initial policy: KL reference, and trace's scorer (T2)
    if config.kl_coef > 0 or config.credit == "trace":
        ref_policy = load_start_policy(config)
        ref_policy.model.eval().requires_grad_(False)
    ref_model = ref_policy.model if config.kl_coef > 0 and ref_policy is not None else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,  # FSDP: after sharding
                                  weight_decay=config.weight_decay)
    shards = fsdp.Shards(world, model, optimizer) if config.sharded else None
    warm = config.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    sampler = make_sampler(config.sampler, max_new_tokens=config.max_new_tokens,
                           temperature=config.temperature, **config.sampler_params)
    start = 0
    if resumed is not None:
        state = resumed.state
        try:
            if shards is not None:  # FSDP: model and optimizer shards, any world size
                fsdp.load_sharded(resumed.path, model, optimizer)
            else:
                optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            if isinstance(sampler, CaliperSampler) and state.get("sampler_state"):
                sampler.state = CaliperState.from_dict(state["sampler_state"])
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise TrainError(f"{resumed.path / STATE_FILE} does not restore this run's "
                             f"optimizer, scheduler and RNG ({type(exc).__name__}: {exc})"
                             ) from None
        start = int(state["iteration"])
    writer = None
    if config.tensorboard and world.is_main:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tensorboard"))
    report = TrainReport(run_id, out, rank=world.rank)

    def publish(step: int) -> HFPolicy:
        version = f"{run_id}-{state_dict_version(policy.model)}"  # FSDP: the full weights
        return policy.published(str(checkpoint_dir(out, step)), version)

    current = publish(start)
    if start_ckpt is None and (world.is_main or shards is not None):  # DDP: rank 0 writes
        _save_after_commits(out, 0, current,  # FSDP: every rank
                            _state(0, optimizer, scheduler, sampler, shards), store, config,
                            shards)
    elif resumed is not None:
        current = policy.published(str(resumed.path), resumed.version)

    # Each start of the run is an attempt, recorded with the iteration it starts from
    # (rollout_store.attempts); a replayed iteration whose trees differ from what an
    # earlier attempt committed is committed as this attempt's retry (KEY@aN, ids ID@aN),
    # and the store's *_latest views hide what it superseded.
    attempt = int(dp.all_max(world, [float(record_attempt(store, run_id, start))
                                     if world.is_main else 0.0])[0])
    # Commits and checkpoints run in order on a background thread while the loop goes on
    # (train.writer): the last checkpoint is waited for before the first optimizer step
    # (it reads the weights and optimizer state), everything before the reuse stage reads
    # the store and at the end. Inline for DDP / FSDP and for a replay that may have to
    # retry its keys.
    writes = Writes(config.background_writes and world.size == 1 and shards is None
                    and attempt < 2)
    held.append(writes)
    checkpointed = 0  # the ticket of the last checkpoint's write
    if start == 0 and config.eval_every and heldout and world.is_main:  # step -1
        initial, rows = _heldout(current, heldout, config, 0)
        writes.submit(partial(_commit_heldout, store, run_id, -1, rows))
        writes.submit(partial(_commit_metrics, store, run_id, -1, initial))
        report.heldout[0] = initial
    for it in range(start, config.steps):
        metrics: dict[str, float] = {}
        t0, waited = time.perf_counter(), writes.waited
        # 1-2. draw tasks, sample one tree each with the current weights
        rng = np.random.default_rng(mix_seed(config.seed, "tasks", it))
        picks = rng.choice(len(train_tasks), size=min(config.tasks_per_step, len(train_tasks)),
                           replace=False)
        model.eval()
        # one wavefront: every tree of the iteration advanced together by the engine
        mine = Engine(current).sample_trees([
            TreeJob(sampler, partial(make_env, config.env), train_tasks[i], config.n_total,
                    seed=mix_seed(config.seed, "tree", it, j),
                    tree_id=f"{run_id}/it{it:06d}/{j:03d}", run_id=run_id)
            for j, i in enumerate(picks) if world.owns(j)])  # DDP: tree j on rank j mod W
        if config.dynamic_sampling_on:  # Q1: groups with both outcomes (one rank)
            mine, ds = _dynamic_sampling(mine, [int(i) for i in picks], train_tasks, sampler,
                                         current, config, it)
            metrics.update(ds)
        n_trees = len(picks) if not config.dynamic_sampling_on else len(mine)
        trees = dp.gather_shards(world, mine, n_trees)  # DDP: every tree on every rank
        t1 = time.perf_counter()
        # 3. commit with policy_version / policy_ref of these weights (DDP: rank 0 commits
        #    every rank's trees under the single-process key, so they land once)
        retry = False
        if world.is_main:
            try:  # a background write's conflict raises later: then attempt < 2 anyway
                writes.submit(partial(store.append_trees, trees, key=f"{run_id}:trees:{it}"))
            except CommitKeyConflictError:
                if attempt < 2:
                    raise
                retry = True  # an earlier attempt committed other trees for this iteration
        if dp.all_max(world, [float(retry)])[0]:  # DDP: every rank renames its trees
            mine, trees = as_retry(mine, attempt), as_retry(trees, attempt)
            if world.is_main:
                writes.submit(partial(store.append_trees, trees,
                                      key=retry_key(f"{run_id}:trees:{it}", attempt)))

        def key(name: str, step: int = it, retry: bool = retry) -> str:
            """The commit key of this iteration's ``name`` rows (a retry's: KEY@aN)."""
            plain = f"{run_id}:{name}:{step}"
            return retry_key(plain, attempt) if retry else plain

        t2 = time.perf_counter()
        # 4. credit through the registry, committed; trace (T2) first scores the gold
        #    answer under the frozen initial policy (DDP: each rank its own trees)
        scores = ref_version = None
        if config.credit == "trace" and ref_policy is not None:
            ref_version = ref_policy.policy_version
            scores = pa.concat_tables(dp.gather_list(world, [score_trees(
                mine, ref_policy, GOLD, policy_ref=config.policy, run_id=run_id)]))
            if world.is_main:
                writes.submit(partial(store.append_policy_scores, scores, key=key("scores")))
        kinds = token_score_kinds(config.credit, resolve_method(config.credit, {
            k: str(v) for k, v in config.credit_params.items()})[1])
        if kinds:  # factor / sgcd (F3, Q3): teacher and student scores under these weights
            scores = pa.concat_tables(dp.gather_list(world, [score_trees(
                mine, current, kind, policy_ref=current.policy_ref, run_id=run_id)
                for kind in dict.fromkeys(kinds.values())]))
            if world.is_main:
                writes.submit(partial(store.append_policy_scores, scores, key=key("scores")))
        credit_rows_, credit = credit_for(trees, config, scores, ref_version)
        if world.is_main:
            writes.submit(partial(store.append_credits, credit_rows_, key=key("credit")))
        # 4b. stored trees (issue 12; train.reuse): earlier versions, scored under the
        #     pre-update weights pi_prox (D3, G8), comparisons resolved by the reuse rule,
        #     refreshed routes re-sampled and committed, their credit committed
        seqs = [build_sequences(t, current.prompt_ids) for t in trees]
        prox: dict[tuple[str, int], np.ndarray] | None = None
        staleness: dict[str, int] = {}
        batch_trees = list(trees)
        if reuse is not None:
            writes.wait()  # the stage reads the store
            try:
                got = reuse.step(store, model, current, partial(make_env, config.env),
                                 env_name=config.env, it=it,
                                 run_id=run_id, seed=config.seed, out=out,
                                 credit_for=partial(credit_for, config=config),
                                 credit_key=stored_credit_key(config),
                                 layout=config.layout, micro_tokens=config.micro_tokens,
                                 row_tokens=config.tree_row_tokens or None,
                                 max_new_tokens=config.max_new_tokens,
                                 temperature=config.temperature, key=key,
                                 rename=partial(as_retry, attempt=attempt) if retry else None)
            except ReuseError as exc:  # e.g. every stored tree too thin for a gated rule
                raise TrainError(str(exc)) from exc
            credit.update(got.credit)
            seqs += got.seqs
            batch_trees += got.trees
            prox, staleness = got.prox, got.staleness
            metrics.update(got.metrics)
        t3 = time.perf_counter()
        # 5. token batches and PPO epochs
        parts = _minibatch_parts(len(batch_trees), config, it)
        n_parts = len(parts)
        passes = 1 if reuse is None else reuse.stored_passes
        if passes > 1:  # U1: the stored trees' own parts, for the extra passes
            parts += [[len(trees) + i for i in part]
                      for part in _minibatch_parts(len(batch_trees) - len(trees), config, it)]
        part_batches = []
        for part in parts:
            own = [i for i in part if world.owns(i)]  # DDP: this rank's trees of the part
            part_seqs = [seqs[i] for i in own]
            # FSDP: no split trees (a split tree's forwards and backwards interleave, so
            # ranks would issue their collectives in different orders)
            row_tokens = None if shards is not None else config.tree_row_tokens or None
            rows = make_rows(part_seqs, credit, config.layout, config.node_weight,
                             config.clip_low, config.clip_high, max_row_tokens=row_tokens,
                             prox=prox, staleness=staleness)
            mbs = micro_batches(rows, config.layout, config.micro_tokens,
                                pad_id=current.pad_id)
            n_tokens = sum(float(mb.traj_count.sum()) for mb in mbs)
            n_seqs = sum(len(s.leaves) for s in part_seqs)
            n_actions = sum(float((mb.traj_count / mb.action_len).sum()) for mb in mbs
                            if mb.action_len is not None)  # F6: (trajectory, action) pairs
            tokens, paths, actions = dp.all_sum(world, [n_tokens, n_seqs, n_actions])  # DDP
            d = denominator(config.aggregation, tokens, paths, config.norm_length, actions)
            n_live = sum(1 for mb in mbs if mb.n_loss_tokens)
            n_passes = fsdp.passes_needed(world, n_live) if shards is not None else n_live
            part_batches.append((mbs, d, own, n_passes - n_live))  # FSDP: zero-weight passes
            metrics["split_trees"] = metrics.get("split_trees", 0.0) + sum(
                isinstance(u, SplitTree) for u in mbs)  # trees over tree_row_tokens
        diffs: list[float] = []  # the logprob check's max differences (check_in_loss)
        if config.check_logprobs and not check_in_loss:  # full weights (FSDP: no collective)
            with torch.no_grad():
                diffs = [float((forward_logprobs(policy.model, mb)[0] - mb.old_logp).abs().max())
                         for mbs, _, _, _ in part_batches for mb in mbs if mb.n_loss_tokens]
        writes.wait(checkpointed)  # it reads the weights and optimizer state stepped next
        model.train()
        sums = {"loss": 0.0, "clip_low": 0.0, "clip_high": 0.0, "dual": 0.0, "kl": 0.0,
                "entropy": 0.0, "tokens": 0.0, "wide": 0.0, "wide_clip": 0.0,
                "wide_released": 0.0}
        grad_norms: list[float] = []
        n_loss_tokens = 0
        forward_tokens = 0
        for epoch in range(config.epochs + passes - 1):  # U1: passes - 1 over stored parts
            order = (_epoch_order(n_parts, config, it, epoch) if epoch < config.epochs
                     else list(range(n_parts, len(part_batches))))
            for p in order:
                mbs, d, part, n_dummy = part_batches[p]
                optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                # a split tree (tree_row_tokens) is several pieces: its trunk forwarded
                # once, each branch's backward before the next branch's forward
                pieces = (piece for unit in mbs if unit.n_loss_tokens
                          for piece in loss_pieces(model, unit, with_entropy=True,
                                                   entropy_grad=config.entropy_coef > 0,
                                                   ref_model=ref_model))
                for piece in pieces:
                    mb, logp, entropy, ref = piece.mb, piece.logp, piece.entropy, piece.ref
                    assert entropy is not None
                    if check_in_loss and not grad_norms:  # no optimizer step yet
                        diffs.append(float((logp.detach() - mb.old_logp).abs().max()))
                    weight, old_logp = None, mb.old_logp  # G8: w = pi_prox / mu (1 fresh)
                    if reuse is not None:  # stored tokens: mb.stored
                        weight, old_logp = reuse.weight(mb, logp)
                    out_t = token_loss(logp, old_logp, mb.advantage, mb.clip_low,
                                       mb.clip_high, dual_clip=config.dual_clip, ref_logp=ref,
                                       kl_coef=config.kl_coef,
                                       kl_estimator=config.kl_estimator,
                                       entropy=entropy if config.entropy_coef > 0 else None,
                                       entropy_coef=config.entropy_coef, weight=weight)
                    w = token_weights(config.aggregation, mb.traj_count, mb.inv_len_sum,
                                      mb.action_len)
                    mask = torch.ones_like(w, dtype=torch.bool)
                    loss = aggregate(out_t.loss, mask, w, d)
                    piece.backward(loss)
                    step_loss += float(loss.detach())
                    k = mb.n_loss_tokens
                    n_loss_tokens += k
                    forward_tokens += mb.n_tokens
                    sums["clip_low"] += float(out_t.clipped_low.sum())
                    sums["clip_high"] += float(out_t.clipped_high.sum())
                    sums["dual"] += float(out_t.dual_clipped.sum())
                    # E8/C8 tokens whose lower bound is wider than the run's clip_low: how
                    # many, how many clipped there, how many the base bound would have clipped
                    wide = mb.clip_low > config.clip_low + 1e-9
                    if bool(wide.any()):
                        below_base = (out_t.ratio < 1.0 - config.clip_low) & (mb.advantage < 0)
                        sums["wide"] += float(wide.sum())
                        sums["wide_clip"] += float((out_t.clipped_low & wide).sum())
                        sums["wide_released"] += float(
                            (below_base & wide & ~out_t.clipped_low).sum())
                    sums["kl"] += masked_mean(out_t.kl, mask) * k
                    sums["entropy"] += float(entropy.detach().sum())
                for _ in range(n_dummy):  # FSDP: as many passes as the rank with the most
                    fsdp.dummy_backward(model, current.pad_id)
                if shards is None:  # FSDP reduce-scatters the gradients in backward
                    dp.all_reduce_grads(world, model.parameters())  # DDP: the part's grad
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), config.grad_clip if config.grad_clip > 0 else math.inf)
                grad_norms.append(fsdp.full_value(grad_norm))
                optimizer.step()
                scheduler.step()
                sums["loss"] += step_loss
        model.eval()
        if config.check_logprobs:
            metrics["logprob_diff_max"] = dp.all_max(world, [max(diffs, default=0.0)])[0]
        fsdp.copy_full_weights(model, policy.model)  # FSDP: the replica gets the new weights
        sums = dp.reduce_sums(world, sums)  # DDP: every rank's tokens
        n_loss_tokens, forward_tokens = (int(v) for v in dp.all_sum(
            world, [n_loss_tokens, forward_tokens]))
        t4 = time.perf_counter()
        n_steps = max(len(grad_norms), 1)
        leaves = [n for t in trees for n in t.nodes if n.reward is not None]
        if reuse is not None:
            metrics.update(reuse.loss_metrics())
            metrics["reuse_stored_passes"] = float(passes)
            metrics["reuse_extra_optimizer_steps"] = float(
                (passes - 1) * (len(part_batches) - n_parts))
        metrics.update({
            "loss": sums["loss"] / n_steps,
            "clip_frac_low": sums["clip_low"] / max(n_loss_tokens, 1),
            "clip_frac_high": sums["clip_high"] / max(n_loss_tokens, 1),
            "dual_clip_frac": sums["dual"] / max(n_loss_tokens, 1),
            "wide_low_frac": sums["wide"] / max(n_loss_tokens, 1),
            "wide_low_clip_frac": sums["wide_clip"] / max(sums["wide"], 1.0),
            "wide_low_released_frac": sums["wide_released"] / max(sums["wide"], 1.0),
            "kl": sums["kl"] / max(n_loss_tokens, 1),
            "entropy": sums["entropy"] / max(n_loss_tokens, 1),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "reward": float(np.mean([n.reward for n in leaves])) if leaves else 0.0,
            "success": float(np.mean([(n.reward or 0.0) >= 1.0 for n in leaves]))
            if leaves else 0.0,
            "tokens_per_s": forward_tokens / max(t4 - t3, 1e-9),
            "loss_tokens": float(n_loss_tokens),
            "forward_tokens": float(forward_tokens),  # real tokens through the model
            "tree_token_ratio": tree_token_ratio(seqs),
            "chain_breaks": float(sum(s.breaks() for s in seqs)),
            "env_steps": float(sum((t.meta or {}).get("env_steps", 0) for t in trees)),
            "new_tool_steps": float(sum(n.tool_calls or 0 for t in trees for n in t.nodes))
            + metrics.get("reuse_new_tool_steps", 0.0) + metrics.get("ds_extra_tool_steps", 0.0),
            "lr": float(scheduler.get_last_lr()[0]),
            "rss_mb": psutil.Process().memory_info().rss / 2**20,
            "seconds_sample": t1 - t0, "seconds_commit": t2 - t1,
            "seconds_credit": t3 - t2, "seconds_train": t4 - t3,
            "seconds_wait_writes": writes.waited - waited,  # within credit and train
        })
        # 6. publish version it + 1; held-out success; metrics; checkpoint (its write is
        #    queued, so diverged weights stop the run here, before anything samples them)
        require_finite(policy, it + 1)
        current = publish(it + 1)
        report.iterations = it + 1
        report.losses.append(metrics["loss"])
        report.rewards.append(metrics["reward"])
        if not world.is_main:  # DDP: rank 0 evaluates, commits metrics, checkpoints
            if shards is not None:  # FSDP: every rank writes its shard of the checkpoint
                _save_after_commits(out, it + 1, current,
                                    _state(it + 1, optimizer, scheduler, sampler, shards),
                                    store, config, shards)
            continue
        if config.eval_every and heldout and ((it + 1) % config.eval_every == 0 or
                                              it + 1 == config.steps):
            t5 = time.perf_counter()
            rates, rows = _heldout(current, heldout, config, it + 1)
            writes.submit(partial(_commit_heldout, store, run_id, it, rows,
                                  attempt if retry else 0))
            metrics.update(rates)
            metrics["seconds_eval"] = time.perf_counter() - t5
            report.heldout[it + 1] = metrics
        writes.submit(partial(_commit_metrics, store, run_id, it, metrics,
                              attempt if retry else 0))
        if writer is not None:
            for name, value in metrics.items():
                writer.add_scalar(name, value, it)
            writer.flush()
        checkpointed = writes.submit(partial(
            _save_after_commits, out, it + 1, current,
            _state(it + 1, optimizer, scheduler, sampler, shards), store, config, shards))
        if config.progress:
            extra = "".join(f" {k.split('_')[1]} {metrics[k]:.3f}" for k in
                            ("heldout_sampled", "heldout_greedy") if k in metrics)
            print(f"[{run_id}] it {it + 1}/{config.steps} loss {metrics['loss']:+.4f} "
                  f"reward {metrics['reward']:.3f} clip {metrics['clip_frac_low']:.3f}/"
                  f"{metrics['clip_frac_high']:.3f} ratio {metrics['tree_token_ratio']:.2f} "
                  f"{metrics['tokens_per_s']:.0f} tok/s{extra}", file=sys.stderr, flush=True)
    writes.close()  # every commit and checkpoint written; a failed one raises here
    if start >= config.steps and world.is_main:  # resumed a finished run: its stored result
        report.iterations, report.finished_before = start, True
        stored = read_metrics(store, run_id)  # metric step it holds iteration it + 1's eval
        for name in ("heldout_sampled", "heldout_greedy"):
            for metric_step, value in stored.get(name, []):
                report.heldout.setdefault(metric_step + 1, {})[name] = value
    if writer is not None:
        writer.close()
    dp.finish(world)  # DDP: leave the process group this call joined
    return report


def _mixed(tree: Tree) -> bool:
    """Q1: the tree has a successful and a failed trajectory (success = reward >= 1)."""
    rewards = [n.reward for n in tree.leaves() if n.reward is not None]
    return any(r >= 1.0 for r in rewards) and any(r < 1.0 for r in rewards)


def _dynamic_sampling(trees: list[Tree], picks: Sequence[int], tasks: Sequence[Task],
                      sampler: Sampler, policy: HFPolicy, config: TrainConfig, it: int
                      ) -> tuple[list[Tree], dict[str, float]]:
    """Q1 (DAPO's dynamic sampling): each tree without both outcomes is resampled with new
    seeds (``resample``: up to ``dynamic_rounds`` more trees, the last one kept) or dropped
    (``drop``). Each round resamples every tree still without both outcomes in one engine
    wavefront; tree j's round-r seed is keyed by (it, j, r), so its content does not depend
    on which others were resampled with it. Returns the kept trees (iteration order) and
    the extra-budget metrics; the discarded trees are not committed but their rollouts and
    tool steps are counted."""
    run_id = config.resolved_run_id
    extra = {"ds_dropped_trees": 0.0, "ds_extra_trees": 0.0, "ds_extra_rollouts": 0.0,
             "ds_extra_tool_steps": 0.0}

    def discard(tree: Tree, sign: float = 1.0) -> None:
        extra["ds_extra_rollouts"] += sign * sum(n.reward is not None for n in tree.leaves())
        extra["ds_extra_tool_steps"] += sign * sum(n.tool_calls or 0 for n in tree.nodes)

    current = list(trees)
    rounds = config.dynamic_rounds if config.dynamic_sampling_resamples else 0
    for r in range(1, rounds + 1):
        redo = [j for j, tree in enumerate(current) if not _mixed(tree)]
        if not redo:
            break
        for j in redo:
            discard(current[j])
            extra["ds_extra_trees"] += 1.0
        fresh = Engine(policy).sample_trees([
            TreeJob(sampler, partial(make_env, config.env), tasks[picks[j]], config.n_total,
                    seed=mix_seed(config.seed, "tree", it, j, "ds", r),
                    tree_id=f"{run_id}/it{it:06d}/{j:03d}-ds{r}", run_id=run_id)
            for j in redo])
        for j, tree in zip(redo, fresh, strict=True):
            current[j] = tree
    kept: list[Tree] = []
    for tree in current:
        if _mixed(tree):
            kept.append(tree)
        else:
            discard(tree)
            extra["ds_dropped_trees"] += 1.0
    if not kept:  # never train on nothing: keep the last tree sampled [R]
        kept.append(current[-1])
        discard(current[-1], -1.0)
        extra["ds_dropped_trees"] -= 1.0
    return kept, extra


def _state(iteration: int, optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Sampler,
           shards: fsdp.Shards | None = None) -> dict[str, Any]:
    """The trainer state of a checkpoint but its store version (``_save_after_commits``
    adds it); with ``shards`` (FSDP) the optimizer's is in the checkpoint's DCP directory,
    which ``optimizer`` names. The optimizer's state tensors are the live ones: written
    before its next step."""
    return {"iteration": iteration,
            "optimizer": optimizer.state_dict() if shards is None else fsdp.DCP_DIR,
            "scheduler": scheduler.state_dict(), "rng": rng_state(),
            "sampler_state": sampler.state.to_dict() if isinstance(sampler, CaliperSampler)
            else None}


def _save_after_commits(out: Path, step: int, policy: HFPolicy, state: dict[str, Any],
                        store: Store, config: TrainConfig, shards: fsdp.Shards | None
                        ) -> None:
    """``save_checkpoint`` of ``state`` (``_state``) with the store's version as the
    commits before it left it: the one way the trainer writes a checkpoint, inline or as a
    job of its ``Writes`` after the iteration's commits."""
    state = {**state, "store_version": dict(store.version())}
    save_checkpoint(out, step, policy, policy.policy_version, state, config, shards, store)


def _heldout(policy: HFPolicy, heldout: Sequence[Task], config: TrainConfig, version: int
             ) -> tuple[dict[str, float], pa.Table]:
    """Held-out success after ``version`` iterations, sampled and greedy (metric step is
    the iteration that produced the weights; -1 for the starting weights), and the
    per-task outcomes as ``evaluations`` rows (V2 pairs arms by task). The sampling seed
    depends only on ``version``, and episode i's stream on (seed, i, step), so every run
    of an env evaluates task i with the same stream at the same step."""
    seed = mix_seed(config.heldout_seed, "eval", version)
    metrics: dict[str, float] = {}
    parts = []
    now = now_utc()
    n = len(heldout)
    for mode, greedy in (("sampled", False), ("greedy", True)):
        ep = run_episodes(policy, config.env, heldout, seed=seed,
                          max_new_tokens=config.max_new_tokens, greedy=greedy)
        metrics[f"heldout_{mode}"] = ep.success_rate if n else float("nan")
        parts.append(pa.table({
            "run_id": pa.array([config.resolved_run_id] * n, pa.string()),
            "step": pa.array([version - 1] * n, pa.int64()),
            "mode": pa.array([mode] * n, pa.string()),
            "task_index": pa.array(range(n), pa.int32()),
            "task_id": pa.array([t.task_id for t in heldout], pa.string()),
            "eval_seed": pa.array([seed] * n, pa.int64()),
            "reward": pa.array(ep.rewards, pa.float64()),
            "success": pa.array(ep.successes, pa.bool_()),
            "steps": pa.array(ep.steps, pa.int32()),
            "created_at": pa.array([now] * n, EVALUATIONS.field("created_at").type),
        }, schema=EVALUATIONS))
    return metrics, pa.concat_tables(parts)


def _commit_heldout(store: Store, run_id: str, step: int, rows: pa.Table,
                    retry: int = 0) -> None:
    """Commit one evaluation's per-task rows (idempotent per step: an exact resume that
    repeats the evaluation writes the same rows under the same key; ``retry``: the attempt
    that replayed the step with other trees, whose rows go under ``KEY@aN``)."""
    plain = f"{run_id}:evaluations:{step}"
    store.append_evaluations(rows, key=retry_key(plain, retry) if retry else plain)


def _minibatch_parts(n_trees: int, config: TrainConfig, it: int) -> list[list[int]]:
    """The iteration's trees cut into ``minibatches`` parts (whole trees), seeded."""
    g = torch.Generator().manual_seed(mix_seed(config.seed, "parts", it))
    order = torch.randperm(n_trees, generator=g).tolist()
    k = min(config.minibatches, n_trees)
    return [order[i::k] for i in range(k)]


def _epoch_order(n_parts: int, config: TrainConfig, it: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(mix_seed(config.seed, "epoch", it, epoch))
    return torch.randperm(n_parts, generator=g).tolist()


def _commit_metrics(store: Store, run_id: str, it: int, metrics: dict[str, float],
                    retry: int = 0) -> None:
    finite = {k: metrics[k] for k in sorted(metrics) if math.isfinite(metrics[k])}
    table = metrics_table(run_id, it, finite, now_utc())
    plain = f"{run_id}:metrics:{it}"
    store.append_metrics(table, key=retry_key(plain, retry) if retry else plain)


def read_metrics(store: Store | str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` of a run, from the store's ``metrics_latest`` view
    (a value a resumed attempt re-computed replaces the earlier one) without the run token
    nor the attempt rows (``rollout_store.attempts.training_metrics``)."""
    return training_metrics(connect(store if isinstance(store, Store) else open_store(store)),
                            run_id)


__all__ = ["Resumed", "RunIdTakenError", "RunInUseError", "TrainError", "TrainReport",
           "check_config", "checkpoints", "credit_for", "latest_checkpoint",
           "load_checkpoint", "read_metrics", "resume_checkpoint", "stored_credit_key",
           "task_splits", "train"]
