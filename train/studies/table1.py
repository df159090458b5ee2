"""Table 1 in miniature (``rtrees study table1``): held-out success after training, the data.

The seed papers' main tables compare methods by the held-out success of a policy trained
with each, at an equal rollout budget per prompt (ELPO's Table 1: "for every method, we
enforce the same per-input rollout budget N_total = 16 ... every branch expansion is also
counted as one rollout"; TRACE's Table 1: GRPO vs TRACE; CALIPER: vs GRPO; SLCA-GRPO: vs
GRPO on SGLS). Here each *config* is an (env, sampler, credit) triple trained by the
public trainer API, ``train.trainer.train(TrainConfig(...))``, from the same tiny starting
policy, for the same number of iterations, tasks per iteration and ``n_total``:

=====================  ======  ==========  ===========
config                 env     sampler     credit
=====================  ======  ==========  ===========
grpo+group             calc    group       grpo
tree_grpo+random       calc    random      tree_grpo
elpo+bel               calc    bel         elpo
caliper+caliper        calc    caliper     caliper
trace+group            calc    group       trace
grpo+group (sgls)      sgls    group       grpo
slca+group (sgls)      sgls    group       slca
factor+group           calc    group       factor (action-mean loss; not run by default)
sgcd+group             calc    group       sgcd (dynamic sampling; not run by default)
elpo+bel (no ELC)      calc    bel         elpo with eps_elc = 0 (not run by default)
factor+group (tm)      calc    group       factor with the token-mean loss (not run by
                                           default): whether F6's aggregation or F1-F5's
                                           credit decides FACTOR's row
factor+group (eta 0)   calc    group       factor without hindsight token weights
                                           (F5 eta = 0; not run by default)
grpo+group (ds)        calc    group       grpo with sgcd+group's dynamic sampling (not
                                           run by default): only the reshaping differs
grpo+group (steps)     calc    group       grpo with ``round(n_total * tool_step_ratio)``
                                           rollouts per tree (not run by default): GRPO
                                           at SGCD's tool steps
=====================  ======  ==========  ===========

The three calc FACTOR rows keep the issue-24 recipe (``context=template``,
``eta_schedule=constant``), so their old commands reproduce the old numbers; FACTOR's fair
test is ``factor+bel (workflow)`` against ``grpo+bel (workflow)`` (``FACTOR_WORKFLOW_CONFIGS``,
issue 47): the same BEL trees on workflow, whose feedback says whether a step went right,
FACTOR with the ``turn`` teacher and the annealed eta (its defaults, docs/METHODS.md F3,
F5), both at the study's one lr, clip, epochs and mini-batches. SGCD's arms
(``SGCD_CONFIGS``) use the ``template`` contrast reference, the only stand-in for the
paper's LLM summary that runs offline here.

and, not run by default, on workflow (``WORKFLOW_CONFIGS``): ``grpo+group (workflow)``,
``elpo+bel (workflow)``, ``tree_grpo+random (workflow)``, ``caliper+caliper (workflow)``
(the same samplers and credit as their calc rows). The powered design of the verdicts
issue is, e.g.::

    rtrees study table1 --out OUT --param configs="elpo+bel (workflow),grpo+group (workflow)"
        --param epochs=2 --param minibatches=4 --param seeds=0,1,2,3,4 --power

``grpo+group (sgls)`` is the baseline SLCA-GRPO's claim needs on the same env. The
workflow configs train at the horizons ``workflow_horizons`` (default 18: where each
step explains a few percent of the return variance and a failed trajectory has many
zero-advantage steps, so credit can matter; calc is a two-step task).
``workflow_mark_optional`` marks the optional stages in those tasks and
``workflow_policy`` (``hf:DIR``) starts the workflow configs from another policy: the
default tiny policy runs ``careful`` on every stage greedily and RL never moved it, while
one trained on marked tasks (``rtrees policy init --env workflow --task-param
horizons=18 --task-param mark_optional=true --out DIR``) leaves visible headroom
(benchmarks/README.md). ``elpo+bel (no
ELC)`` is ELPO without its wider lower clip bound (E8), the row that says whether ELC
matters; it needs a recipe where clipping binds: ``epochs``, ``minibatches`` and ``lr``
are the study's (defaults: the trainer's one epoch, two mini-batches, at which clipping
almost never binds; ``epochs=2 minibatches=4`` makes it bind, and the trainer's
``wide_low_*`` metrics show how much).

Layout of ``OUT``: ``study.json`` (written last, after every run) and one directory per
(config, seed), ``runs/<slug>-s<seed>/`` holding ``train/`` (the trainer's run
directory: ``config.json``, checkpoints) and ``store/`` (its trees, credit and the
``metrics`` table the report reads). Resumable: a run whose checkpoint of the last
iteration exists is skipped, one with a ``config.json`` but fewer checkpoints is resumed
(``train(config, resume=True)``: exact resume), the rest start. A config the trainer
refuses (``ConfigError`` / ``TrainError``, e.g. an estimator whose inputs it does not
produce, or a policy without a checkpoint) is recorded as ``not run: <reason>`` and the
study goes on. Several processes may share one ``OUT`` (e.g. one per core, each given other
seeds): each merges its runs into ``study.json`` under a lock (``merged_study``), so the
report of the last to finish covers every run of the same settings.

**Size.** The defaults (7 configs x 3 seeds, 20 iterations x 16 tasks x n_total 8, 100
held-out tasks evaluated sampled and greedy at iterations 0, 5, 10, 15, 20) are sized
for under 90 minutes on 2 cores, estimated from measured iteration times: the default
``TrainConfig`` calc run (60 iterations of the same 16 x 8 trees, 7 evaluations of 200
held-out tasks) took 1.2 min (grpo+group) and 1.5 min (elpo+bel) per run on the shared
2-core machine (``benchmarks/learning.py``, benchmarks/README.md), so a calc run here
(1/3 of the iterations, 5/14 of the evaluation episodes) is about 0.5 min and the 15
calc runs about 8 min, 16 with a 2x allowance for caliper and trace (reference scoring).
An sgls step costs more: its episodes take 2-5 tool turns of ~18 tokens over ~300-token
contexts where calc's take 1-3 of ~10; at an assumed 6x a calc run (the random-weights
sgls run sampled 13x slower than a calc run of the same size, but it never stops before
the token cap), the 6 sgls runs take about 18 min. Total about 35 min, leaving 2.5x for
load; each run's own seconds per iteration are in the report.
"""

from __future__ import annotations

import fcntl
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from train.coerce import check_bounds, check_types
from train.studies import STUDY_MAXIMA
from train.studies.workflow_study import make_study_dir, write_study

# name -> (env, sampler, credit); the order of the report's table.
CONFIGS: dict[str, tuple[str, str, str]] = {
    "grpo+group": ("calc", "group", "grpo"),
    "tree_grpo+random": ("calc", "random", "tree_grpo"),
    "elpo+bel": ("calc", "bel", "elpo"),
    "caliper+caliper": ("calc", "caliper", "caliper"),
    "trace+group": ("calc", "group", "trace"),
    "grpo+group (sgls)": ("sgls", "group", "grpo"),
    "slca+group (sgls)": ("sgls", "group", "slca"),
    "factor+group": ("calc", "group", "factor"),
    "sgcd+group": ("calc", "group", "sgcd"),
    "elpo+bel (no ELC)": ("calc", "bel", "elpo"),
    "factor+group (tm)": ("calc", "group", "factor"),
    "factor+group (eta 0)": ("calc", "group", "factor"),
    "grpo+group (workflow)": ("workflow", "group", "grpo"),
    "elpo+bel (workflow)": ("workflow", "bel", "elpo"),
    "tree_grpo+random (workflow)": ("workflow", "random", "tree_grpo"),
    "caliper+caliper (workflow)": ("workflow", "caliper", "caliper"),
    "grpo+group (ds)": ("calc", "group", "grpo"),
    "grpo+group (steps)": ("calc", "group", "grpo"),
    "factor+bel (workflow)": ("workflow", "bel", "factor"),
    "grpo+bel (workflow)": ("workflow", "bel", "grpo"),
}
# Configs that share (env, sampler, credit) with another: their directory's suffix.
SLUG_SUFFIX: dict[str, str] = {"elpo+bel (no ELC)": "-noelc", "factor+group (tm)": "-tm",
                               "factor+group (eta 0)": "-eta0", "grpo+group (ds)": "-ds",
                               "grpo+group (steps)": "-steps"}
# The configs a default study runs (factor and sgcd, issue 24, are accepted but their
# claims and the powered runs belong to the verdicts issue).
DEFAULT_CONFIGS: tuple[str, ...] = tuple(CONFIGS)[:7]
WORKFLOW_CONFIGS: tuple[str, ...] = ("grpo+group (workflow)", "elpo+bel (workflow)",
                                      "tree_grpo+random (workflow)",
                                      "caliper+caliper (workflow)")
"""The workflow rows of the issue-23 studies (ELPO, tree rollouts, CALIPER vs GRPO)."""
FACTOR_WORKFLOW_CONFIGS: tuple[str, ...] = ("factor+bel (workflow)", "grpo+bel (workflow)")
"""FACTOR's fair test (issue 47): the same branching trees on marked workflow, GRPO's lr,
clip and optimizer steps; FACTOR with the ``turn`` teacher and the annealed eta."""
SGCD_CONFIGS: tuple[str, ...] = ("sgcd+group", "grpo+group (ds)", "grpo+group (steps)",
                                 "grpo+group")
"""SGCD's fair arms (issue 47): GRPO with SGCD's dynamic sampling (only the reshaping
differs) and GRPO at SGCD's tool steps (``tool_step_ratio``)."""
# The issue-24 FACTOR recipe (the old numbers): the template teacher at a constant eta.
_FACTOR_24: dict[str, str] = {"context": "template", "eta_schedule": "constant"}
# TrainConfig fields a config sets beyond (env, sampler, credit): each method's recipe
# (docs/METHODS.md F6: FACTOR's action-mean loss; Q1: SGCD's dynamic sampling).
CONFIG_FIELDS: dict[str, dict[str, Any]] = {
    "factor+group": {"aggregation": "action-mean", "credit_params": dict(_FACTOR_24)},
    "sgcd+group": {"dynamic_sampling": "resample"},
    "elpo+bel (no ELC)": {"credit_params": {"eps_elc": "0"}},
    "factor+group (tm)": {"aggregation": "token-mean", "credit_params": dict(_FACTOR_24)},
    "factor+group (eta 0)": {"aggregation": "action-mean",
                             "credit_params": {**_FACTOR_24, "eta": "0"}},
    "grpo+group (ds)": {"dynamic_sampling": "resample"},
    "factor+bel (workflow)": {"aggregation": "action-mean"},
}
# Configs whose TrainConfig field (key) is the study's value of it times a study field
# (value): GRPO at SGCD's tool steps draws tool_step_ratio times the rollouts per tree.
CONFIG_SCALED: dict[str, tuple[str, str]] = {"grpo+group (steps)": ("n_total",
                                                                    "tool_step_ratio")}
Log = Callable[[str], None]
RUN_FILE = "table1_run.json"  # beside train/ and store/: the run's status and seconds


@dataclass(frozen=True)
class Table1Config:
    """Settings of the Table 1 study (``rtrees study table1``). Every config trains with
    the same iterations, tasks per iteration and ``n_total``; the rest of ``TrainConfig``
    stays at its defaults."""

    configs: tuple[str, ...] = DEFAULT_CONFIGS
    """Configs to run (names of ``CONFIGS``)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Trainer seeds (task draws, sampling, mini-batch order) of every config."""
    steps: int = 20
    """Training iterations of every run (equal iterations)."""
    tasks_per_step: int = 16
    """Training tasks per iteration, one tree each."""
    n_total: int = 8
    """Rollout budget per tree, every config (equal n_total; every suffix counts)."""
    heldout_tasks: int = 100
    """Size of the fixed held-out split (the trainer's ``heldout_seed``; the same tasks for
    every run of an env)."""
    eval_every: int = 5
    """Held-out evaluation every this many iterations (and at the start and the end)."""
    max_new_tokens: int = 48
    """Token cap of one agent step on calc."""
    sgls_max_new_tokens: int = 64
    """Token cap of one agent step on sgls (a reply takes up to ~45 tiny tokens)."""
    epochs: int = 1
    """PPO epochs per iteration, every config (``TrainConfig.epochs``)."""
    minibatches: int = 2
    """Mini-batches per epoch, every config (``TrainConfig.minibatches``)."""
    lr: float = 3e-4
    """Learning rate, every config (``TrainConfig.lr``)."""
    workflow_horizons: tuple[int, ...] = (18,)
    """Horizons of the workflow configs' tasks, both splits (``task_params``)."""
    workflow_max_new_tokens: int = 48
    """Token cap of one agent step on workflow."""
    workflow_mark_optional: bool = False
    """Workflow tasks mark their optional stages (``mark_optional``, both splits): the
    variant where the greedy policy can improve from visible information."""
    workflow_policy: str = "tiny"
    """Start policy of the workflow configs (``TrainConfig.policy``: ``tiny`` or
    ``hf:DIR``, e.g. a ``rtrees policy init --env workflow --task-param
    mark_optional=true --out DIR`` checkpoint)."""
    tool_step_ratio: float = 1.73
    """``grpo+group (steps)`` samples ``round(n_total * tool_step_ratio)`` rollouts per
    tree: GRPO at SGCD's tool steps (1.73: the sgcd+group / grpo+group tool steps of the
    issue-24 study, benchmarks/README.md; each run's tool steps are in the report)."""
    delta: float = 0.02
    """Pre-registered equivalence margin of every claim (docs/METHODS.md V1): a difference
    whose interval lies inside +-delta is called ``equivalent``."""

    def __post_init__(self) -> None:
        check_types(self)  # train.coerce: field types, finite floats (issue 21)
        check_bounds(self, {}, STUDY_MAXIMA)
        unknown = sorted(set(self.configs) - set(CONFIGS))
        if unknown or not self.configs:
            raise ValueError(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
        if not self.seeds:
            raise ValueError("name at least one seed")
        if min(self.steps, self.tasks_per_step, self.n_total, self.max_new_tokens,
               self.sgls_max_new_tokens, self.workflow_max_new_tokens, self.epochs,
               self.minibatches) < 1:
            raise ValueError("steps, tasks_per_step, n_total, epochs, minibatches and "
                             "max_new_tokens must be >= 1")
        if self.minibatches > self.tasks_per_step:
            raise ValueError(f"minibatches ({self.minibatches}) cannot exceed tasks_per_step "
                             f"({self.tasks_per_step})")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (self.workflow_policy == "tiny" or self.workflow_policy.startswith("hf:")):
            raise ValueError(f"workflow_policy must be tiny or hf:DIR, got "
                             f"{self.workflow_policy!r}")
        if not self.workflow_horizons or any(h < 2 for h in self.workflow_horizons):
            raise ValueError(f"workflow_horizons must be >= 2, got {self.workflow_horizons}")
        if not (0.0 < self.delta < 1.0):  # also refuses nan
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}")
        if self.heldout_tasks < 1 or self.eval_every < 1:
            raise ValueError("heldout_tasks and eval_every must be >= 1 (the table is "
                             "held-out success)")
        if not 1.0 <= self.tool_step_ratio <= 8.0:
            raise ValueError(f"tool_step_ratio must lie in [1, 8], got {self.tool_step_ratio}")
        if self.n_total < 4:
            raise ValueError(f"n_total must be >= 4 for a tree to branch, got {self.n_total}")


_FIELDS = frozenset(f.name for f in fields(Table1Config))


def slug(name: str) -> str:
    """``slca+group (sgls)`` -> ``sgls-slca-group``: the config's directory name."""
    env, sampler, credit = CONFIGS[name]
    return re.sub(r"[^a-z0-9_-]", "-", f"{env}-{credit}-{sampler}") + SLUG_SUFFIX.get(name, "")


def env_setting(config: Table1Config, env: str, setting: str, default: Any = None) -> Any:
    """The study's ``setting`` for the runs on ``env``: its field ``<env>_<setting>`` where
    it has one (``sgls_max_new_tokens``, ``workflow_policy``, ...), else the field
    ``setting`` shared by every env, else ``default``. The fields name their env as data,
    so no code here decides by an env's name."""
    own = f"{env}_{setting}"
    if own in _FIELDS:
        return getattr(config, own)
    return getattr(config, setting) if setting in _FIELDS else default


def env_task_params(config: Table1Config, env: str) -> dict[str, Any]:
    """The task options of the runs on ``env`` (both splits): ``horizons`` and, when set,
    ``mark_optional`` from its ``<env>_horizons`` / ``<env>_mark_optional`` fields (the
    workflow configs); none for an env without such fields."""
    horizons = env_setting(config, env, "horizons")
    if horizons is None:
        return {}
    return {"horizons": list(horizons),
            **({"mark_optional": True} if env_setting(config, env, "mark_optional") else {})}


def run_config(name: str, seed: int, config: Table1Config, run_dir: Path) -> Any:
    """The ``TrainConfig`` of one (config, seed) run in ``run_dir``."""
    from train.config import TrainConfig

    env, sampler, credit = CONFIGS[name]
    fields_: dict[str, Any] = dict(
        store=str(run_dir / "store"), out=str(run_dir / "train"),
        run_id=f"table1-{slug(name)}-s{seed}", env=env,
        policy=env_setting(config, env, "policy", "tiny"), sampler=sampler,
        credit=credit, steps=config.steps, tasks_per_step=config.tasks_per_step,
        n_total=config.n_total, heldout_tasks=config.heldout_tasks,
        eval_every=config.eval_every, seed=seed,
        max_new_tokens=env_setting(config, env, "max_new_tokens"),
        task_params=env_task_params(config, env),
        epochs=config.epochs, minibatches=config.minibatches, lr=config.lr,
        keep_last=1, save_every=config.steps, progress=False, **CONFIG_FIELDS.get(name, {}))
    if name in CONFIG_SCALED:
        field, factor = CONFIG_SCALED[name]
        fields_[field] = round(fields_[field] * getattr(config, factor))
    return TrainConfig(**fields_)


def run_finished(train_dir: Path, steps: int) -> bool:
    """Whether the trainer's run directory holds the checkpoint of its last iteration."""
    from train.trainer import checkpoint_dir, latest_checkpoint

    last = latest_checkpoint(train_dir)
    return last is not None and last == checkpoint_dir(train_dir, steps)


def run_one(name: str, seed: int, config: Table1Config, run_dir: Path,
            log: Log | None = None) -> dict[str, Any]:
    """Run (or skip, or resume) one (config, seed); returns its record (``RUN_FILE``:
    status, the refusal's reason, seconds of the invocation that finished it)."""
    from train.config import ConfigError
    from train.policies import PolicyUnavailableError
    from train.trainer import TrainError, train

    cfg = run_config(name, seed, config, run_dir)
    env, sampler, credit = CONFIGS[name]
    record: dict[str, Any] = {"config": name, "seed": seed, "env": env, "sampler": sampler,
                              "credit": credit, "run_id": cfg.run_id,
                              "dir": run_dir.name, "store": "store", "train": "train"}
    file = run_dir / RUN_FILE
    train_dir = Path(cfg.out)
    if file.is_file() and run_finished(train_dir, config.steps):
        done: dict[str, Any] = json.loads(file.read_text())
        return {**done, "skipped": True}
    run_dir.mkdir(parents=True, exist_ok=True)
    resume = (train_dir / "config.json").is_file()
    t0 = time.perf_counter()
    try:
        if not (resume and run_finished(train_dir, config.steps)):
            train(cfg, resume=resume)
    except (ConfigError, TrainError, PolicyUnavailableError) as exc:
        record.update(status="not run", reason=f"{type(exc).__name__}: {exc}",
                      seconds=time.perf_counter() - t0)
    else:
        record.update(status="done", resumed=resume, seconds=time.perf_counter() - t0)
    if log is not None:
        log(f"{name} seed {seed}: {record['status']} ({record['seconds']:.0f} s)"
            + (f": {record['reason']}" if record["status"] != "done" else ""))
    file.write_text(json.dumps(record, indent=2) + "\n")
    return record


def run_table1_study(out_dir: str | Path, config: Table1Config | None = None,
                     log: Log | None = None) -> Path:
    """Every (config, seed) run into ``out_dir/runs`` (module docstring), then
    ``study.json``; returns its path. A rerun skips finished runs, resumes unfinished ones
    and retries refused ones."""
    config = config or Table1Config()
    for env in dict.fromkeys(CONFIGS[name][0] for name in config.configs):
        policy = env_setting(config, env, "policy", "tiny")
        if policy.startswith("hf:"):
            # checked before any run: the workflow runs may come after hours of calc runs
            from train.policies.hf import require_checkpoint_dir

            try:
                require_checkpoint_dir(Path(policy.partition(":")[2]))
            except FileNotFoundError as exc:
                raise ValueError(f"{env}_policy {policy!r} is not a checkpoint "
                                 f"directory: {exc}") from None
    out = make_study_dir(out_dir)
    started = time.perf_counter()
    runs = []
    for name in config.configs:
        for seed in config.seeds:
            runs.append(run_one(name, seed, config, out / "runs" / f"{slug(name)}-s{seed}",
                                log))
    path = out / "study.json"
    with open(out / ".study.lock", "a") as lock:  # one merge at a time (module docstring)
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = merged_study(path, config, [{**r, "dir": f"runs/{r['dir']}"} for r in runs])
        return write_study(path, {**doc, "seconds": time.perf_counter() - started})


def merged_study(path: Path, config: Table1Config, runs: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """``study.json``'s content for ``runs``, merged with what ``path`` already records when
    its settings are ``config``'s but for ``configs`` and ``seeds``: several processes
    over one directory (each given other seeds or configs) then report every run, not
    only the last process's. Configs in ``CONFIGS`` order, seeds sorted; a run recorded
    again takes its new record."""
    mine = asdict(config)
    by_dir = {r["dir"]: r for r in runs}
    configs, seeds = set(config.configs), set(config.seeds)
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        same = {k: v for k, v in mine.items() if k not in ("configs", "seeds")}
        theirs = old.get("config", {}) if isinstance(old.get("config"), dict) else {}
        if old.get("study") == "table1" and json.loads(json.dumps(same)) == {
                k: v for k, v in theirs.items() if k not in ("configs", "seeds")}:
            by_dir = {**{r["dir"]: r for r in old.get("runs", [])}, **by_dir}
            configs |= set(theirs.get("configs", ()))
            seeds |= set(theirs.get("seeds", ()))
    order = [c for c in CONFIGS if c in configs]
    mine.update(configs=order, seeds=sorted(seeds))
    rank = {c: i for i, c in enumerate(order)}
    return {"study": "table1", "config": mine, "configs": {k: list(CONFIGS[k]) for k in order},
            "runs": sorted(by_dir.values(), key=lambda r: (rank.get(r["config"], len(rank)),
                                                           r["seed"]))}


# The settings of the study's test (``StudySpec.small``): one seed, one iteration, two calc
# configs (one with reference scoring) and one on sgls (the committed sgls policy).
SMALL: dict[str, Any] = {"configs": ("grpo+group", "trace+group", "slca+group (sgls)"),
                         "seeds": (0,),
                         "steps": 1, "tasks_per_step": 2, "n_total": 4, "heldout_tasks": 4,
                         "eval_every": 1}


__all__ = ["CONFIGS", "CONFIG_FIELDS", "CONFIG_SCALED", "DEFAULT_CONFIGS",
           "FACTOR_WORKFLOW_CONFIGS", "RUN_FILE", "SGCD_CONFIGS", "SLUG_SUFFIX", "SMALL",
           "WORKFLOW_CONFIGS", "Table1Config", "merged_study", "run_config", "run_finished",
           "run_one",
           "run_table1_study", "slug"]
