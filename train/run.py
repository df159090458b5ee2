"""The life of a training run around its loop: checks, run directory, checkpoints, records.

``train.rundir`` writes and checks one checkpoint directory (atomic files, digests, the
trainer state bound to its weights and the store); this module is everything the trainer
does around its loop:

* **before the run**: every named error that needs no heavy work (``check_config``: the
  env, sampler, credit method, policy kind, reuse knobs and what ranks cannot share), a
  store of another env (``check_store_env``), and the disjoint task splits
  (``task_splits``);

* **one trainer per run directory, one run directory per run id**: ``open_run_dir``
  holds an exclusive ``flock`` on ``OUT/train.lock`` for the run's lifetime
  (``lock_run_dir``), creates ``config.json`` exclusively with a random run token, and
  records the token with the run id in the store's ``metrics`` (row ``run_token``, step
  -2: ``claim_run_id``); another directory's run of the same id (``/a/run`` and
  ``/b/run`` both default to ``train-run``) is refused (``RunIdTakenError``);
* **checkpoints** ``OUT/checkpoints/step-K`` (``checkpoint_dir``, ``checkpoints``):
  ``save_checkpoint`` publishes the weights, tokenizer, trainer state (``trainer_state``:
  optimizer, scheduler, RNG states, iteration, sampler state, store version) and
  ``rtrees_policy.json`` atomically, then prunes to the last ``keep_last`` and every
  ``save_every``-th; non-finite weights are never published (``require_finite``);
* **resume**: ``resume_checkpoint`` loads the newest checkpoint that passes every check
  of ``load_checkpoint`` (file digests, run id, env, run configuration, finite weights
  whose recomputed version is the recorded one, state in the current format bound to the
  run) and names each newer one it skips; ``restore_state`` puts its optimizer,
  scheduler, RNG and sampler state back;
* **records**: the iteration's keyed writes (``Commits``: trees, scores, credit, and an
  attempt's retry keys), metrics rows (``commit_metrics``, ``read_metrics``) and
  held-out rows (``commit_heldout``), keyed so that a replayed iteration lands once.
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rollout_store.attempts import retry_key, training_metrics
from rollout_store.reader import connect
from rollout_store.schema import metrics_table
from rollout_store.store import CommitKeyConflictError, Store, now_utc, open_store
from rollout_store.tree import Tree
from train import fsdp
from train.coerce import literal_value
from train.config import (
    CONFIG_FILE,
    RESUMABLE_FIELDS,
    ConfigError,
    TrainConfig,
    check_resume,
    create_config,
    new_run_token,
    read_config,
    read_run_token,
    write_config,
)
from train.credit_stage import make_credit
from train.envs import Task, env_class
from train.envs.base import task_identity
from train.envs.registry import same_env
from train.policies.hf import HFPolicy, check_finite, quiet_progress, state_dict_version
from train.reuse.params import ReuseParams
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
from train.writer import Writes

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"  # structure and scalars (train.rundir.save_state)
STATE_TENSORS = "trainer_state.tensors"  # its tensors, safetensors format (not *.safetensors:
#                                          loaders glob those as weights)
OLD_STATE_FILE = "trainer_state.pt"  # the pickled format of earlier versions: never loaded


class TrainError(RuntimeError):
    """The run cannot start or continue (bad input, a store of another env, ...)."""


# ------------------------------------------------------------- before the run starts

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
    make_credit(config)  # the method's needs against what the trainer gives it
    try:
        sampler = make_sampler(config.sampler, **config.sampler_params)
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
    if world_size > 1 and config.dynamic_sampling_on:
        raise ConfigError("dynamic_sampling resamples a rank's trees one by one, which ranks "
                          "cannot share yet: train with one rank")
    if world_size > 1 and config.reuses_stored:
        raise ConfigError(f"reuse {config.reuse!r} is not data-parallel yet (stored trees are "
                          "drawn and refreshed by one process): train with one rank")
    if world_size > 1 and sampler.rank_refusal is not None:
        raise ConfigError(f"sampler {config.sampler!r} {sampler.rank_refusal}: train with "
                          "one rank")


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


# ------------------------------------------------------------- checkpoints

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


def restore_state(resumed: Resumed, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: Any, sampler: Sampler, shards: fsdp.Shards | None) -> int:
    """Put ``resumed``'s optimizer (FSDP: the model and optimizer shards, onto any world
    size), scheduler, RNG and sampler state back; returns the iteration it starts from.
    A state that does not fit this run is a one-line ``TrainError``."""
    state = resumed.state
    try:
        if shards is not None:
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
    return int(state["iteration"])


def clear_staging(out: Path) -> None:
    """Remove checkpoint writes a kill interrupted (``.step-*`` staging directories)."""
    root = out / CHECKPOINTS
    for tmp in root.glob(".step-*") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)


def trainer_state(iteration: int, optimizer: torch.optim.Optimizer, scheduler: Any,
                  sampler: Sampler, shards: fsdp.Shards | None = None) -> dict[str, Any]:
    """The trainer state of a checkpoint but its store version (``save_after_commits``
    adds it); with ``shards`` (FSDP) the optimizer's is in the checkpoint's DCP directory,
    which ``optimizer`` names. The optimizer's state tensors are the live ones: written
    before its next step."""
    return {"iteration": iteration,
            "optimizer": optimizer.state_dict() if shards is None else fsdp.DCP_DIR,
            "scheduler": scheduler.state_dict(), "rng": rng_state(),
            "sampler_state": sampler.state.to_dict() if isinstance(sampler, CaliperSampler)
            else None}


def save_after_commits(out: Path, step: int, policy: HFPolicy, state: dict[str, Any],
                       store: Store, config: TrainConfig, shards: fsdp.Shards | None) -> None:
    """``save_checkpoint`` of ``state`` (``trainer_state``) with the store's version as the
    commits before it left it: the one way the trainer writes a checkpoint, inline or as a
    job of its ``Writes`` after the iteration's commits."""
    state = {**state, "store_version": dict(store.version())}
    save_checkpoint(out, step, policy, policy.policy_version, state, config, shards, store)


# ------------------------------------------------------------- the run directory lock

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


# ------------------------------------------------------------- records

def commit_heldout(store: Store, run_id: str, step: int, rows: pa.Table,
                   retry: int = 0) -> None:
    """Commit one evaluation's per-task rows (idempotent per step: an exact resume that
    repeats the evaluation writes the same rows under the same key; ``retry``: the attempt
    that replayed the step with other trees, whose rows go under ``KEY@aN``)."""
    plain = f"{run_id}:evaluations:{step}"
    store.append_evaluations(rows, key=retry_key(plain, retry) if retry else plain)


def commit_metrics(store: Store, run_id: str, it: int, metrics: dict[str, float],
                    retry: int = 0) -> None:
    finite = {k: metrics[k] for k in sorted(metrics) if math.isfinite(metrics[k])}
    table = metrics_table(run_id, it, finite, now_utc())
    plain = f"{run_id}:metrics:{it}"
    store.append_metrics(table, key=retry_key(plain, retry) if retry else plain)


def stored_heldout(store: Store, run_id: str) -> dict[int, dict[str, float]]:
    """The held-out success a run stored, ``{iterations: {name: value}}`` (its metric step
    k holds the evaluation after iteration k + 1): a finished run's result on resume."""
    found: dict[int, dict[str, float]] = {}
    stored = read_metrics(store, run_id)
    for name in ("heldout_sampled", "heldout_greedy"):
        for metric_step, value in stored.get(name, []):
            found.setdefault(metric_step + 1, {})[name] = value
    return found


@dataclass
class Commits:
    """The keyed writes of iteration ``it`` (rank 0 queues them on ``writes``): key
    ``RUN:NAME:IT``, or ``RUN:NAME:IT@aN`` (``retry``) when an earlier attempt committed
    other trees for the iteration and this attempt ``N`` commits its own beside them."""

    store: Store
    writes: Writes
    run_id: str
    attempt: int
    is_main: bool
    it: int = 0
    retry: bool = False

    def key(self, name: str) -> str:
        """The commit key of this iteration's ``name`` rows."""
        plain = f"{self.run_id}:{name}:{self.it}"
        return retry_key(plain, self.attempt) if self.retry else plain

    def __call__(self, name: str, rows: Any) -> None:
        """Queue this iteration's ``name`` rows (``trees``, ``scores``, ``credit``)."""
        append = {"trees": self.store.append_trees, "scores": self.store.append_policy_scores,
                  "credit": self.store.append_credits}[name]
        if self.is_main:
            self.writes.submit(partial(append, rows, key=self.key(name)))

    def trees(self, it: int, trees: list[Tree]) -> bool:
        """Start iteration ``it`` and queue its trees under the plain key; True when the
        store holds other trees under it (an earlier attempt's, on another device): the
        caller renames its trees and commits them as this attempt's retry. Only an
        attempt >= 2 can meet that, and its writes are inline, so the conflict raises here
        (a background write's would raise later)."""
        self.it, self.retry = it, False
        if not self.is_main:
            return False
        try:
            self.writes.submit(partial(self.store.append_trees, trees, key=self.key("trees")))
        except CommitKeyConflictError:
            if self.attempt < 2:
                raise
            return True
        return False


def read_metrics(store: Store | str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` of a run, from the store's ``metrics_latest`` view
    (a value a resumed attempt re-computed replaces the earlier one) without the run token
    nor the attempt rows (``rollout_store.attempts.training_metrics``)."""
    return training_metrics(connect(store if isinstance(store, Store) else open_store(store)),
                            run_id)


__all__ = [
    "CHECKPOINTS",
    "LOCK_FILE",
    "OLD_STATE_FILE",
    "OWNER_METRIC",
    "OWNER_STEP",
    "STATE_FILE",
    "STATE_TENSORS",
    "Commits",
    "Resumed",
    "RunIdTakenError",
    "RunInUseError",
    "RunLock",
    "TrainError",
    "check_config",
    "check_store_env",
    "checkpoint_dir",
    "checkpoints",
    "claim_run_id",
    "clear_staging",
    "commit_heldout",
    "commit_metrics",
    "latest_checkpoint",
    "load_checkpoint",
    "load_start_policy",
    "lock_run_dir",
    "open_run_dir",
    "read_metrics",
    "require_finite",
    "restore_state",
    "resume_checkpoint",
    "rng_state",
    "run_fields",
    "save_after_commits",
    "save_checkpoint",
    "set_rng_state",
    "stored_heldout",
    "task_splits",
    "trainer_state",
]
