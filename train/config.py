"""``TrainConfig``: the one flat, typed configuration of ``rtrees train``.

Every field is documented once, below. A config comes from the defaults, a TOML file
(``load_config``; top-level keys are field names, ``sampler_params`` /
``credit_params`` are tables) and ``KEY=VALUE`` overrides (``apply_overrides``, typed
by the field annotations), in that order. Every value is checked by ``train.coerce``
(text parsed as the field's type, typed TOML/JSON values of the field's type, floats
finite) and integer sizes against ``MINIMA`` / ``MAXIMA``, all in ``__post_init__``,
before anything is written. The trainer writes the config it ran with, and a random run
token (``RUN_TOKEN``), to ``OUT/config.json`` (created exclusively: ``create_config``);
``--resume`` refuses a directory whose config differs in any field but
``RESUMABLE_FIELDS`` and names the fields (``ConfigMismatchError``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import secrets
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from train.batches import LAYOUTS, NODE_WEIGHTS, Layout, NodeWeight
from train.coerce import CoerceError, check_bounds, check_types, coerce_fields
from train.loss import AGGREGATIONS, IS_MODES, KL_ESTIMATORS, Aggregation, ISMode, KLEstimator
from train.reuse.params import REUSE_MODES, ReuseMode, ReuseParams

# Fields a resumed run may change: how long it runs and what it displays.
RESUMABLE_FIELDS: frozenset[str] = frozenset({"steps", "tensorboard", "progress",
                                              "background_writes"})
# Integer fields' lower bounds (inclusive).
MINIMA: dict[str, int] = {
    **dict.fromkeys(("steps", "tasks_per_step", "n_total", "max_new_tokens", "train_tasks",
                     "epochs", "minibatches", "micro_tokens", "norm_length", "keep_last",
                     "save_every", "reuse_per_step", "max_staleness"), 1),
    **dict.fromkeys(("heldout_tasks", "eval_every", "warmup_steps", "tree_row_tokens",
                     "seed", "heldout_seed", "dynamic_rounds"), 0)}
# Integer fields' upper bounds (inclusive; ``rtrees train --fields`` prints them): sizes
# that are allocated up front or per iteration. The task splits are generated whole
# (100k sgls tasks: about 1.1 GB and a minute here; 1e9 was OOM-killed, issue 21).
MAXIMA: dict[str, int] = {
    "train_tasks": 100_000, "heldout_tasks": 10_000, "tasks_per_step": 4_096,
    "n_total": 4_096, "max_new_tokens": 32_768, "micro_tokens": 1 << 22,
    "norm_length": 1 << 20, "tree_row_tokens": 1 << 20, "reuse_per_step": 4_096,
    "steps": 10_000_000, "epochs": 1_000, "minibatches": 4_096, "keep_last": 10_000,
    "warmup_steps": 10_000_000, "seed": 2**63 - 1, "heldout_seed": 2**63 - 1,
    "dynamic_rounds": 64}


class ConfigError(ValueError):
    """A bad configuration value or file; the message names the field."""


class ConfigMismatchError(ConfigError):
    """``--resume`` of a run directory written with a different configuration."""



DynamicSampling = Literal["off", "resample", "drop"]
Shard = Literal["none", "fsdp"]
SHARD_MODES: tuple[str, ...] = ("none", "fsdp")
"""``TrainConfig.shard`` choices: whole model per rank (data-parallel) or FSDP2."""


@dataclass(frozen=True)
class _Q1Choice:
    """What a ``dynamic_sampling`` choice does (Q1): acts on one-outcome trees at all, and
    resamples them (else drops them)."""

    active: bool
    resamples: bool


DYNAMIC_SAMPLING: dict[str, _Q1Choice] = {"off": _Q1Choice(False, False),
                                          "resample": _Q1Choice(True, True),
                                          "drop": _Q1Choice(True, False)}
"""``TrainConfig.dynamic_sampling`` choices (Q1)."""

PolicyDtype = Literal["auto", "float32", "float64"]
"""``TrainConfig.dtype`` choices."""


@dataclass(frozen=True)
class TrainConfig:
    """Configuration of one training run (``rtrees train``)."""

    store: str = ""
    """Store directory the run's trees, credit and metrics are committed to (required)."""
    out: str = ""
    """Run directory: config.json, checkpoints/, tensorboard/ (required)."""
    run_id: str = ""
    """Run id in the store; empty: ``train-`` + the run directory's name."""
    env: str = "calc"
    """Environment (``train.envs.ENVIRONMENTS``)."""
    policy: str = "tiny"
    """Starting policy spec: ``tiny`` or ``hf:PATH`` (``train.policies.load_policy``)."""
    dtype: PolicyDtype = "auto"
    """Parameter precision of the trained policy: ``auto`` (as saved), ``float32`` or
    ``float64``. Sampling, scoring and the loss then run in it (logits are never cast
    below float32). ``float64`` makes a run reproducible across CPUs of one kind: their
    kernels reduce in other orders, which moves float32 logits by ~1e-7 and, through
    sampling, can change a token; in float64 the same moves are ~1e-16
    (``tests/test_trainer_golden.py`` runs in it; docs/REPRODUCIBILITY.md)."""
    sampler: str = "group"
    """Tree sampler (``train.sampling.SAMPLERS``)."""
    sampler_params: dict[str, Any] = field(default_factory=dict)
    """Sampler config fields (e.g. ``b_max``), as for ``rtrees collect --param``."""
    credit: str = "grpo"
    """Credit estimator (``train.credit.ESTIMATORS``)."""
    credit_params: dict[str, Any] = field(default_factory=dict)
    """Estimator parameters (``KEY=VALUE`` strings, as for ``rtrees credit --param``)."""
    steps: int = 60
    """Training iterations (sample, commit, credit, PPO epochs, publish)."""
    tasks_per_step: int = 16
    """Training tasks drawn per iteration; one tree each."""
    n_total: int = 8
    """Rollout budget per tree (every rollout, full or suffix, counts)."""
    max_new_tokens: int = 48
    """Token cap of one agent step while sampling."""
    temperature: float = 1.0
    """Sampling temperature of the training trees (logprobs are of the untempered policy)."""
    train_tasks: int = 20_000
    """Size of the training split of the env's task generator (drawn with ``seed``)."""
    heldout_tasks: int = 200
    """Size of the fixed held-out split (drawn with ``heldout_seed``, disjoint from train)."""
    heldout_seed: int = 1_000_003
    """Generator seed of the held-out split (fixed across runs, so runs compare)."""
    task_params: dict[str, Any] = field(default_factory=dict)
    """Options of the env's task generator for both splits (``generate_tasks(n, seed,
    **task_params)``), e.g. workflow ``horizons=18`` or calc ``difficulties=2,3``; text
    values are read by ``train.coerce.literal_value``."""
    eval_every: int = 10
    """Held-out evaluation (sampled and greedy success) every this many iterations and at
    the start and end; 0 turns it off."""
    seed: int = 0
    """Seed of task draws, sampling and mini-batch order."""
    lr: float = 3e-4
    """AdamW learning rate (3e-4 lifted the tiny calc policy in minutes)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps (constant afterwards)."""
    grad_clip: float = 1.0
    """Max global gradient norm (0: no clipping)."""
    epochs: int = 1
    """PPO epochs over each iteration's tokens."""
    minibatches: int = 2
    """Optimizer steps per epoch: the iteration's trees are cut into this many parts."""
    micro_tokens: int = 16_384
    """Padded tokens per forward pass (gradient accumulation; does not change the update)."""
    layout: Layout = "tree"
    """Token layout: ``tree`` (shared prefixes once) or ``paths`` (one row per trajectory)."""
    tree_row_tokens: int = 2048
    """Tree layout: a tree with more tokens is split into a trunk row (the nodes whose
    subtree is larger) and branch rows of at most about this many tokens that attend the
    trunk's keys (``train.batches.SplitTree``): the trunk is forwarded once, and each
    branch's activations are freed by its backward before the next; 0 keeps one row per
    tree. Either way no token is forwarded twice; attention memory is linear in the row,
    and the split bounds what deep trees save for backward
    (benchmarks/bench_train_layout.py --split-tokens)."""
    node_weight: NodeWeight = "trajectories"
    """Loss weight of a tree node: trajectories through it (= paths) or ``once`` (E7 note)."""
    aggregation: Aggregation = "token-mean"
    """Loss aggregation (G4): token-mean | seq-mean-token-mean | seq-mean-token-sum-norm |
    action-mean (F6, FACTOR: each action's tokens averaged, summed over actions)."""
    norm_length: int = 192
    """Constant token count of ``seq-mean-token-sum-norm`` (Dr.GRPO's generation budget)."""
    clip_low: float = 0.2
    """eps_low of G3 where the credit sets no per-token bound (ELPO/CALIPER set theirs)."""
    clip_high: float = 0.28
    """eps_high of G3 (clip-higher, DAPO) where the credit sets no per-token bound."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c (> 1) for negative advantages; None turns it off."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the frozen initial policy (0: off, no reference)."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator: k1 or k3 (clamped)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (0: off)."""
    check_logprobs: bool = True
    """Compare the trainer's logprobs of the sampled tokens with the stored sampling
    logprobs and log the max difference (metric ``logprob_diff_max``): on the training
    forward of the first mini-batch, before any optimizer step (free; every token when
    there is one mini-batch), or, for a model with active dropout, by a separate no-grad
    forward of every mini-batch."""
    save_every: int = 10
    """Checkpoints at multiples of this are kept for good (one is written every iteration)."""
    keep_last: int = 3
    """The last N checkpoints are kept besides those."""
    tensorboard: bool = False
    """Also write TensorBoard event files to OUT/tensorboard."""
    progress: bool = True
    """Show a progress line per iteration."""
    background_writes: bool = True
    """Run an iteration's store commits and its checkpoint on a background thread, in
    order, while the next iteration samples (``train.writer``); the loop waits for them
    before its first optimizer step. Same files, same order; false writes inline (DDP,
    FSDP and replayed attempts always do)."""
    reuse: ReuseMode = "none"
    """Stored-tree reuse rule (issue 12, ``train.reuse.resolve.RULES``; docs/METHODS.md
    section 9): none | all (stored credit as it is) | transport (D3-D5 to the current
    weights) | dsc (the gate D7-D10 per pair) | refresh (new suffixes from the stored
    snapshots under the current policy) | m2po (stored returns, M2PO's second-moment mask
    M1) | prox-interp (stored returns, pi_prox interpolated by staleness P1) | gap-gate
    (reuse a resolved stored gap, refresh the rest: the Gap gate GG1)."""
    reuse_from: str = ""
    """SQL filter over the store's ``trees`` view choosing the stored trees to reuse; empty:
    this run's own trees (``run_id`` = the run's id). Only trees of earlier policy versions
    (checkpoint step < the current iteration) are ever used."""
    reuse_per_step: int = 8
    """Stored trees drawn (seeded) per iteration besides the fresh ones (reuse != none)."""
    max_staleness: int = 4
    """Stored trees more than this many policy versions (checkpoint steps) older than the
    current weights are skipped and counted (metric ``reuse_skip_stale``)."""
    is_cap: float = 2.0
    """Cap of the behaviour weight w = pi_prox / mu of stored tokens (G8)."""
    is_mode: ISMode = "truncate"
    """G8 above the cap: ``truncate`` (w = min(w, cap)) or ``mask`` (w = 0)."""
    reuse_params: dict[str, Any] = field(default_factory=dict)
    """Gate, refresh and rule knobs (``train.reuse.params.ReuseParams``): kappa_R,
    kappa_delta, kappa_T (D7 radii), calibrate, calib_trees, calib_draws, calib_level (D7
    calibration), min_trajectories (the gated rules' refusal of thin trees), kappa_e,
    refresh_batch, refresh_cap (new tool steps per stored tree), m2po_threshold (M1),
    stored_passes (update-to-data, U1)."""
    dynamic_sampling: DynamicSampling = "off"
    """Q1 (SGCD, DAPO): a tree whose leaves are all successes or all failures is
    ``resample``d (new seeds, up to ``dynamic_rounds`` more trees, the last kept) or
    ``drop``ped; ``off`` keeps every tree. Extra trees are counted in the metrics."""
    dynamic_rounds: int = 3
    """Q1: the most extra trees sampled for one task with ``dynamic_sampling=resample``."""
    shard: Shard = "none"
    """Parameter sharding over the ranks: ``none`` (every rank holds the whole model and
    optimizer; gradients all-reduced) or ``fsdp`` (FSDP2 ``fully_shard`` per decoder layer,
    embeddings and LM head; checkpoints by ``torch.distributed.checkpoint``, resumable on
    any number of ranks; ``train/fsdp.py``). Not changeable on resume."""

    def __post_init__(self) -> None:
        try:  # types (a TOML ``steps = 2.5``), finite floats, size bounds (issue 21)
            check_types(self)
            check_bounds(self, MINIMA, MAXIMA)
        except CoerceError as exc:
            raise ConfigError(str(exc)) from None
        if self.minibatches > self.tasks_per_step:
            raise ConfigError(f"minibatches ({self.minibatches}) cannot exceed tasks_per_step "
                              f"({self.tasks_per_step}): a mini-batch holds whole trees")
        if self.lr <= 0 or self.temperature <= 0:
            raise ConfigError("lr and temperature must be > 0")
        if min(self.weight_decay, self.grad_clip, self.kl_coef, self.entropy_coef) < 0:
            raise ConfigError("weight_decay, grad_clip, kl_coef, entropy_coef must be >= 0")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ConfigError(f"clip_low must lie in [0, 1) and clip_high >= 0, got "
                              f"{self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        choices: dict[str, tuple[str, ...]] = {
            "layout": LAYOUTS, "node_weight": NODE_WEIGHTS, "aggregation": AGGREGATIONS,
            "kl_estimator": KL_ESTIMATORS, "dynamic_sampling": tuple(DYNAMIC_SAMPLING),
            "shard": SHARD_MODES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.layout == "paths" and self.node_weight != "trajectories":
            raise ConfigError("node_weight 'once' needs layout 'tree' (paths repeats prefixes)")
        for name, allowed in (("reuse", REUSE_MODES), ("is_mode", IS_MODES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not self.is_cap >= 1.0:
            raise ConfigError(f"is_cap must be >= 1 (w = 1 on fresh tokens), got {self.is_cap}")
        try:
            ReuseParams.parse(self.reuse_params)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"reuse_params: {exc}") from exc

    # ------------------------------------------------------------------ derived
    @property
    def reuses_stored(self) -> bool:
        """Stored trees join the batch (a ``train.reuse`` rule; not ``reuse none``)."""
        return self.reuse != "none"

    @property
    def dynamic_sampling_on(self) -> bool:
        """Q1 acts on one-outcome trees (``dynamic_sampling`` resample or drop)."""
        return DYNAMIC_SAMPLING[self.dynamic_sampling].active

    @property
    def dynamic_sampling_resamples(self) -> bool:
        """Q1 resamples one-outcome trees (rather than dropping them)."""
        return DYNAMIC_SAMPLING[self.dynamic_sampling].resamples

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the parameters over the ranks (``shard`` fsdp)."""
        return self.shard == "fsdp"

    @property
    def resolved_run_id(self) -> str:
        return self.run_id or f"train-{Path(self.out).resolve().name}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def field_names() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal after it in this module's source)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in itertools.pairwise(body):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and \
                isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())
            if a.target.id in MAXIMA:
                docs[a.target.id] += f" (at most {MAXIMA[a.target.id]:_})"
    return docs


def coerce_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` checked and typed by ``TrainConfig``'s annotations (``train.coerce``:
    text is parsed, typed TOML/JSON values must have the field's type, floats finite)."""
    try:
        return coerce_fields(TrainConfig, overrides, "config ")
    except CoerceError as exc:
        raise ConfigError(str(exc)) from None


def apply_overrides(config: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """``config`` with fields replaced (strings typed by the field annotations)."""
    changes = coerce_overrides(overrides)
    try:
        return config.replace(**changes)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None
                ) -> TrainConfig:
    """Defaults, then the TOML file ``path`` (if any), then ``overrides``."""
    config = TrainConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: {exc}") from exc
        config = apply_overrides(config, data)
    return apply_overrides(config, overrides or {})


CONFIG_FILE = "config.json"


RUN_TOKEN = "run_token"
"""Key of ``config.json`` beside the fields: a random token naming the run directory; the
trainer records it with the run id in the store, so another directory cannot continue
(or mix its trees into) the run of the same id."""


def new_run_token() -> int:
    """A random run token: a positive integer below 2^52 (exact as the float64 a metrics
    row stores)."""
    return secrets.randbits(52) + 1


def _config_text(config: TrainConfig, token: int | None) -> str:
    doc: dict[str, Any] = config.to_dict()
    if token is not None:
        doc[RUN_TOKEN] = token
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def create_config(config: TrainConfig, out: Path, token: int) -> Path:
    """Write ``out/config.json`` exclusively: ``FileExistsError`` when one exists (another
    run's). Written to a temporary file, fsynced and hard-linked into place, so it appears
    whole or not at all and two writers cannot both succeed."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONFIG_FILE
    tmp = out / f".{CONFIG_FILE}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            fh.write(_config_text(config, token))
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except OSError as exc:
            if isinstance(exc, FileExistsError):
                raise
            # a file system without hard links: O_EXCL (the file may appear half written
            # to a reader, never to a second writer)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as fh:
                fh.write(tmp.read_text())
                fh.flush()
                os.fsync(fh.fileno())
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_config(config: TrainConfig, out: Path, token: int | None = None) -> Path:
    """Replace ``out/config.json`` (a resumed run, under the run directory's lock)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONFIG_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(_config_text(config, token))
    tmp.replace(path)
    return path


def _read_doc(out: Path) -> dict[str, Any]:
    path = out / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{out} has no {CONFIG_FILE}: not a training run directory")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not a readable config ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} is not a readable config (not a JSON object)")
    return doc


def read_config(out: Path) -> TrainConfig:
    """The config ``out/config.json`` holds (checked as ``--set`` values are)."""
    doc = _read_doc(out)
    doc.pop(RUN_TOKEN, None)
    return apply_overrides(TrainConfig(), doc)


def read_run_token(out: Path) -> int | None:
    """The run token of ``out/config.json``; None for a directory written before tokens."""
    token = _read_doc(out).get(RUN_TOKEN)
    if token is None:
        return None
    if isinstance(token, bool) or not isinstance(token, int) or not 0 < token < 2**53:
        raise ConfigError(f"{out / CONFIG_FILE}: {RUN_TOKEN} {token!r} is not a run token")
    return token


def check_resume(saved: TrainConfig, config: TrainConfig) -> None:
    """Raise ``ConfigMismatchError`` naming every field (but ``RESUMABLE_FIELDS``) that
    differs between the run directory's config and this one."""
    a, b = saved.to_dict(), config.to_dict()
    diff = [f"{k}: {a[k]!r} -> {b[k]!r}" for k in a if k not in RESUMABLE_FIELDS and a[k] != b[k]]
    if diff:
        raise ConfigMismatchError(f"{config.out} was written by a different config; "
                                  f"differing fields: {'; '.join(diff)}")


__all__ = ["CONFIG_FILE", "MAXIMA", "MINIMA", "RESUMABLE_FIELDS", "RUN_TOKEN", "SHARD_MODES",
           "ConfigError", "ConfigMismatchError", "TrainConfig",
           "apply_overrides", "check_resume", "coerce_overrides", "create_config",
           "field_docs", "field_names", "load_config", "new_run_token", "read_config",
           "read_run_token", "write_config"]
