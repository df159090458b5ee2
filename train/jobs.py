"""The composition root: every job that ties collection, credit and analysis together.

This is the only module of ``train`` that imports ``analysis`` (``tests/test_layering.py``
checks it): data flows one way, from the environments and policies (``train.envs``,
``train.policies``) through the samplers and studies (``train.sampling``,
``train.studies``) into stores and study files, which ``analysis`` reads. The CLI
commands parse their options, call one function of this module and print.

* ``run_demo_job``: the main job behind ``make demo`` / ``rtrees demo`` (below);
* ``ranking_job``: the Mean@k ranking audit of a store: check the credits, sample
  the missing references (``train.sampling.references``), audit (``analysis.ranking``,
  E10-E11) and write the report;
* ``drift_study``, ``gate_study``, ``localization_study``: each workflow study
  generates its data (``train.studies``) and then builds its report from those files
  (``analysis.drift`` / ``analysis.gates`` / ``analysis.localization``);
* ``run_study``: ``rtrees study NAME`` (``STUDIES``: ``dsc-l1``, ``elpo-fig3``,
  ``dsc-table2``, ``elpo-fig1``), the seed papers' claims re-run: data
  (``train.studies``), report with one verdict per claim (``analysis``);
* ``rebuild_reports``: every report from its data alone (``rtrees audit report``).

The main job (``DemoConfig``, ``run_demo_job``), on embedded defaults (the tiny policy,
calc, a local store, DuckDB):

1. **policy**: the tiny policy for the environment, trained by ``rtrees policy
   init`` unless a checkpoint exists (the committed one, or the cache), published as
   ``OUT/policy/step-000000``: the trees collected with it are version 0 of the
   training run, which starts from it (``train.reuse`` reads versions from
   ``step-N`` in ``policy_ref``);
2. **collect**: one tree per task with each sampler (``group``, ``bel``,
   ``caliper``), committed to the store (``train.sampling.collect``; idempotent per
   run id and seed);
3. **credit**: each method (``grpo``, ``tree_grpo``, ``elpo``, ``caliper``) for every
   collected tree lacking it;
4. **references**: Mean@k for every child of a branching node of the collected trees
   (``train.sampling.references``);
5. **audit**: ``ranking_job`` (E10-E11, pooled and per sampler);
6. **train**: ``train.trainer.train`` with ``reuse="transport"`` over the collected trees,
   held-out success before, during and after (the trainer's ``metrics``);
7. **report**: ``analysis.demo_report`` (store and result files only) and a summary
   table.

Every step reuses what the store and the output directory already hold (trees, credit,
references, the finished training run), so a rerun only redoes the reporting.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from train.reuse.params import ReuseMode

if TYPE_CHECKING:
    from analysis.ranking import RankingResult
    from analysis.report import BuildSummary
    from rollout_store import Store
    from rollout_store.store import StoreVersion
    from train.config import TrainConfig
    from train.sampling.collect import PolicySpec
    from train.sampling.references import ReferenceReport
    from train.studies.drift import DriftConfig
    from train.studies.gates import GateStudyConfig
    from train.studies.localization import LocalizationConfig


class JobError(RuntimeError):
    """A job cannot run as asked (the message says why and what to do)."""


# ----- the ranking audit ------------------------------------------------------------------


@dataclass(frozen=True)
class RankingJobConfig:
    """Settings of ``ranking_job`` (``rtrees audit ranking``)."""

    methods: tuple[str, ...]
    """Methods to audit: ``name`` (its latest params hash) or ``name@HASH``."""
    k: int = 32
    """Rollouts per child reference (Mean@k)."""
    policy: PolicySpec | None = None
    """Policy (spec) that samples the references (None: each tree's own policy_ref)."""
    own_version: bool = False
    """Audit the references of each tree's own policy version even when ``policy`` is
    named (the main job: its trees were sampled by that policy)."""
    n_boot: int = 2000
    level: float = 0.95
    seed: int = 0
    """Seeds the bootstrap and the reference rollouts."""
    collect: bool = True
    """Sample missing references first (False: audit what is stored)."""
    success_threshold: float = 1.0
    max_steps: int | None = None
    max_new_tokens: int = 128
    max_parallel: int = 512
    by: str | None = None
    """Also audit each ``sampler`` (tree construction) or ``run`` separately (None: pooled
    only; ``analysis.ranking.RankingConfig.by``)."""


@dataclass
class RankingJobResult:
    """What ``ranking_job`` did: the reference job's report (None without collection),
    the audit result, and the report files written."""

    references: ReferenceReport | None
    result: RankingResult
    files: list[Path]


def ranking_job(store: Store | str | Path, out: Path, config: RankingJobConfig,
                progress: bool = True, pin: StoreVersion | None = None
                ) -> RankingJobResult:
    """References (when ``collect``), then the audit, then the report (module docstring).

    Fails before the (expensive) reference job when a method lacks credit for an
    audited tree (``RankingError`` naming the ``rtrees credit`` command). ``pin``
    pins the credit check and the audit to that store version (with ``collect=False``:
    references sampled now would not be seen).
    """
    from analysis.ranking import (
        RankingConfig,
        credit_error,
        missing_credit,
        ranking_audit,
        resolve_methods,
    )
    from analysis.ranking_report import write_ranking_report
    from rollout_store import connect
    from rollout_store.reader import as_store
    from train.sampling.references import (
        ReferenceConfig,
        collect_references,
        policy_versions,
    )

    if config.by is not None and config.by not in ("sampler", "run"):
        raise JobError(f"--by must be sampler or run, got {config.by!r}")
    s = as_store(store)
    if pin is not None and config.collect:
        raise JobError("a pinned ranking job cannot collect references (collect=False)")
    con = connect(s, pin)
    for ref in resolve_methods(con, config.methods, str(s.path)):
        n_missing, n_total, example = missing_credit(con, [ref])[ref.label]
        if n_missing:
            raise credit_error(ref, n_missing, n_total, example, str(s.path))
    refs = None
    found: set[str | None] = set()
    if config.collect:
        refs = collect_references(s, ReferenceConfig(
            k=config.k, success_threshold=config.success_threshold,
            max_steps=config.max_steps, max_new_tokens=config.max_new_tokens,
            max_parallel=config.max_parallel, seed=config.seed),
            policy=config.policy, progress=progress)
        if config.policy is not None and not config.own_version:
            found = set(refs.versions.values())
    elif config.policy is not None and not config.own_version:
        found = set(policy_versions(s, config.policy).values())
    if len(found) > 1:
        raise JobError(f"--policy {config.policy!r} loads different versions per environment "
                       f"({sorted(map(str, found))}); audit one environment's trees at a time")
    version = found.pop() if found else None
    result = ranking_audit(s, RankingConfig(config.methods, k=config.k,
                                            reference_policy=version, n_boot=config.n_boot,
                                            level=config.level, seed=config.seed,
                                            by=config.by),  # type: ignore[arg-type]
                           version=pin)
    return RankingJobResult(refs, result, write_ranking_report(result, out))


# ----- the main job -----------------------------------------------------------------------

DEMO_STATE = "demo.json"
"""The main job's record in its output directory: settings, run ids, phase timings (what
``analysis.demo_report`` reads besides the store and the ranking results)."""
START_DIR = Path("policy") / "step-000000"
"""Where (under ``DemoConfig.out``) the starting weights are published: ``train.reuse``
reads a tree's policy version index from ``step-N`` in its ``policy_ref``, so trees
collected by ``OUT/policy/step-000000`` count as version 0 of the training run, which
starts from these very weights."""


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the main job (``make demo`` = ``rtrees demo``). The defaults are meant
    to fit in 10 minutes on 2 CPU cores from a warm environment; the reference job (k
    rollouts per child of every branching node) is most of it, so ``tasks`` and
    ``n_total`` set the time (the report's "Settings and why" section)."""

    store: Path = Path("store-demo")
    """Store directory (created if missing); collection, credit, references and the
    training run's trees and metrics all go here."""
    out: Path = Path("out/demo")
    """Report directory: report.md, results.json, PNGs, ``ranking/`` (the audit),
    ``train/`` (the training run), ``policy/`` (the starting weights)."""
    env: str = "calc"
    """Environment (a tiny policy exists for calc and workflow)."""
    policy: str = "tiny"
    """Starting policy spec (``train.policies.load_policy``; a transformers checkpoint, as
    the trainer needs one); ``tiny`` is trained by ``policy init`` when missing."""
    seed: int = 0
    """Seed of tasks, sampling, references, the bootstrap and the training run."""
    tasks: int = 16
    """Tasks collected with each sampler (from the training split: never a held-out
    prompt)."""
    n_total: int = 16
    """Rollout budget per collected tree (ELPO's N_total)."""
    samplers: tuple[str, ...] = ("group", "bel", "caliper")
    """Tree samplers to collect with (one run id each)."""
    methods: tuple[str, ...] = ("grpo", "tree_grpo", "elpo", "caliper")
    """Credit methods computed for every collected tree and audited."""
    k: int = 32
    """Rollouts behind each Mean@k reference."""
    max_new_tokens: int = 48
    """Token cap of one agent step (collection, references, training)."""
    init_minutes: float = 10.0
    """Time budget of ``policy init`` when no tiny checkpoint exists."""
    train_steps: int = 20
    """Training iterations (``TrainConfig.steps``)."""
    tasks_per_step: int = 16
    """Fresh trees per training iteration."""
    train_n_total: int = 8
    """Rollout budget of a fresh training tree."""
    train_sampler: str = "group"
    """Sampler of the fresh training trees."""
    train_credit: str = "grpo"
    """Credit of the training run (also applied to the reused stored trees)."""
    reuse: ReuseMode = "transport"
    """Stored-tree reuse rule of the training run (``TrainConfig.reuse``). ``transport``
    (D3-D5: the stored returns moved to the current weights, no new tool step): the
    collected trees hold about one trajectory per compared action, too thin for the gated
    rules (``dsc`` and ``gap-gate`` refuse them; docs/METHODS.md section 9)."""
    reuse_per_step: int = 8
    """Stored trees drawn per iteration besides the fresh ones (a refreshed tree costs at
    most its own tool steps: ``ReuseParams.refresh_cap``)."""
    max_staleness: int | None = None
    """Oldest stored policy version reused, in iterations (None: ``train_steps``, so the
    collected trees, version 0, stay eligible for the whole short run)."""
    heldout_tasks: int = 200
    """Held-out tasks of the evaluation (sampled and greedy), before, during and after."""
    eval_every: int = 5
    """Held-out evaluation every this many iterations (and at the start and the end)."""
    n_boot: int = 2000
    """Bootstrap resamples (trees) of the ranking audit's intervals."""

    def __post_init__(self) -> None:
        for name in ("tasks", "n_total", "k", "max_new_tokens", "train_steps",
                     "tasks_per_step", "train_n_total", "reuse_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.samplers or not self.methods:
            raise ValueError("name at least one sampler and one method")
        if self.reuse != "none" and self.train_steps < 2:
            raise ValueError("reuse needs train_steps >= 2: stored trees of version 0 are "
                             "historical from iteration 1 on")

    def run_id(self, sampler: str) -> str:
        """Run id of the trees collected with ``sampler``."""
        return f"demo-{self.env}-{sampler}-n{self.n_total}-s{self.seed}"

    @property
    def train_run_id(self) -> str:
        return f"demo-train-{self.env}-s{self.seed}"

    def train_config(self, policy: str) -> TrainConfig:
        """The training run: fresh ``train_sampler`` trees plus the collected trees,
        reused through ``reuse`` (``reuse_from`` names the collection run ids)."""
        from train.config import TrainConfig

        names = ", ".join("'" + self.run_id(s).replace("'", "''") + "'" for s in self.samplers)
        return TrainConfig(
            store=str(self.store), out=str(self.out / "train"), run_id=self.train_run_id,
            env=self.env, policy=policy, sampler=self.train_sampler,
            credit=self.train_credit, steps=self.train_steps,
            tasks_per_step=self.tasks_per_step, n_total=self.train_n_total,
            max_new_tokens=self.max_new_tokens, heldout_tasks=self.heldout_tasks,
            eval_every=self.eval_every, seed=self.seed, reuse=self.reuse,
            reuse_from=f"run_id IN ({names})", reuse_per_step=self.reuse_per_step,
            max_staleness=self.max_staleness or self.train_steps,
            minibatches=min(2, self.tasks_per_step))


@dataclass
class DemoResult:
    """What ``run_demo_job`` did and where its outputs are."""

    results: dict[str, Any]
    """The report's ``results.json`` (``analysis.demo_report``)."""
    files: list[Path]
    seconds: dict[str, float]
    """Wall time of each phase in this invocation."""
    reused: dict[str, bool]
    """Per phase: True when everything it needed was already there (nothing committed)."""


def _publish_start(config: DemoConfig, console: Console) -> Path:
    """The starting weights as ``OUT/policy/step-000000`` (``START_DIR``): the tiny
    checkpoint (trained by ``policy init`` when missing) or the named checkpoint, copied
    once."""
    import shutil

    from train.policies import load_policy

    target = config.out / START_DIR
    if target.is_dir():
        return target
    if config.policy == "tiny":
        from train.policies.tiny import find_checkpoint
        from train.policies.tiny_train import init_policy
        from train.sampling.evaluation import success_report

        if find_checkpoint(config.env, config.seed) is None:
            console.print(f"[bold]policy[/]: no tiny {config.env} checkpoint yet; training "
                          f"one (up to {config.init_minutes:g} min)")
            init_policy(config.env, seed=config.seed, minutes=config.init_minutes,
                        log=console.print, evaluate=success_report)
    ref = load_policy(config.policy, config.env).policy_ref
    if ref is None or not Path(ref).is_dir():
        raise JobError(f"policy {config.policy!r} has no checkpoint directory to train from "
                       "(the demo needs tiny or hf:PATH)")
    tmp = target.with_name(".step-000000.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ref, tmp)
    tmp.replace(target)
    return target


def _train_state(out: Path, steps: int) -> str:
    """``none`` (no run directory), ``done`` (checkpoint ``step-steps`` written) or
    ``partial`` (a run to resume)."""
    from train.trainer import latest_checkpoint

    if not (out / "config.json").is_file():
        return "none"
    last = latest_checkpoint(out)
    return "done" if last is not None and int(last.name.split("-")[1]) >= steps else "partial"


def run_demo_job(config: DemoConfig, console: Console | None = None) -> DemoResult:
    """The main job (module docstring), each phase reusing what exists; ends with the
    report (``analysis.demo_report``) and the summary table printed to ``console``.

    1. policy: the starting weights published as ``OUT/policy/step-000000``;
    2. collect: ``tasks`` training-split tasks with each sampler (one run id each);
    3. credit: each method for every collected tree lacking it;
    4. references: Mean@k for every child of a branching node of the collected trees;
    5. audit: ``ranking_job`` (E10-E11, pooled and per sampler) into ``OUT/ranking``,
       pinned to the store version its first complete run recorded when nothing new
       was collected (the training run adds trees the audit must not see);
    6. train: ``train.trainer.train`` with ``reuse`` over the collected trees (skipped
       when ``OUT/train`` holds the finished run, resumed when it holds a partial one);
    7. report: ``analysis.demo_report.write_demo_report``.
    """
    from analysis.demo_report import write_demo_report
    from rollout_store import Store
    from rollout_store.store import StoreVersion
    from train.config import ConfigError, check_resume, read_config
    from train.credit.store_io import compute_credits, resolve_method
    from train.policies import load_policy
    from train.sampling.collect import collect, tree_id_for
    from train.sampling.references import ReferenceConfig, collect_references
    from train.trainer import TrainError, task_splits, train

    console = console or Console()
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    reused: dict[str, bool] = {}
    clock, cpu_clock = time.perf_counter(), time.process_time()

    def lap(name: str) -> None:  # wall and CPU (all threads) seconds of one phase
        nonlocal clock, cpu_clock
        now, now_cpu = time.perf_counter(), time.process_time()
        seconds[name], cpu[name] = now - clock, now_cpu - cpu_clock
        clock, cpu_clock = now, now_cpu

    config.out.mkdir(parents=True, exist_ok=True)
    start_dir = _publish_start(config, console)
    policy = load_policy(str(start_dir.resolve()), config.env)
    train_config = config.train_config(f"hf:{start_dir.resolve()}")
    console.print(f"[bold]1/7 policy[/]: {escape(str(start_dir))} (version "
                  f"{policy.policy_version})")
    lap("policy")

    store = Store(config.store, create=True)
    mine = {config.run_id(s) for s in config.samplers} | {train_config.resolved_run_id}
    others = sorted({r for (r,) in _connect(store).sql("SELECT DISTINCT run_id FROM trees"
                                                        ).fetchall()} - mine)
    if others:  # the audit reads every referenced tree of the store
        raise JobError(f"store {config.store} holds trees of other runs ({', '.join(others[:3])}"
                       f"{', ...' if len(others) > 3 else ''}); give the demo its own --store")
    before = store.version()
    tasks = task_splits(train_config)[0][:config.tasks]
    tree_ids: list[str] = []
    for sampler in config.samplers:
        run_id = config.run_id(sampler)
        report = collect(store, config.env, policy, sampler, tasks, config.n_total,
                         config.seed, run_id,
                         sampler_params={"max_new_tokens": config.max_new_tokens})
        tree_ids += [tree_id_for(run_id, config.seed, t.task_id) for t in tasks]
        console.print(f"[bold]2/7 collect[/] {sampler}: {escape(report.summary())}")
    lap("collect")
    reused["collect"] = _unchanged(before, versions := store.version())

    con = _connect(store)
    con.register("_demo_trees", _id_table(tree_ids))
    for method in config.methods:
        params_hash = resolve_method(method)[1].params_hash()
        [(lacking,)] = con.execute(
            "SELECT count(*) FROM _demo_trees d WHERE NOT EXISTS (SELECT 1 FROM credits c "
            "WHERE c.tree_id = d.tree_id AND c.method = $m AND c.method_params_hash = $h)",
            {"m": method, "h": params_hash}).fetchall()
        if lacking:  # compute_credits credits every stored tree lacking it
            credit = compute_credits(store, method)
            console.print(f"[bold]3/7 credit[/]: {escape(credit.summary())}")
        else:
            console.print(f"[bold]3/7 credit[/]: {method} {escape(f'[{params_hash}]')}: "
                          "every collected tree has it")
    lap("credit")
    reused["credit"] = _unchanged(versions, versions := store.version())

    refs = collect_references(store, ReferenceConfig(
        k=config.k, max_new_tokens=config.max_new_tokens, seed=config.seed),
        policy=policy, tree_ids=tree_ids, progress=True)
    console.print(f"[bold]4/7 references[/]: {escape(refs.summary())}")
    lap("references")

    after = store.version()
    reused["references"] = _unchanged(versions, after)
    ranking_dir = config.out / "ranking"
    pin: StoreVersion = after
    recorded = ranking_dir / "results.json"
    if _unchanged(before, after) and recorded.is_file():
        doc = json.loads(recorded.read_text())
        if doc.get("k") == config.k and set(config.methods) <= set(doc.get("methods", {})):
            pin = StoreVersion({t: int(v) for t, v in doc["store_version"].items()})
    reused["audit"] = pin is not after
    job = ranking_job(store, ranking_dir, RankingJobConfig(
        tuple(config.methods), k=config.k, collect=False, n_boot=config.n_boot,
        seed=config.seed, by="sampler"), progress=True, pin=pin)
    console.print(f"[bold]5/7 audit[/]: {len(job.result.data.labels)} methods over "
                  f"{job.result.stats.n_prefixes} prefixes (store {pin})")
    lap("audit")

    state = _train_state(Path(train_config.out), config.train_steps)
    if state == "done":
        try:
            check_resume(read_config(Path(train_config.out)), train_config.replace(
                store=str(Path(train_config.store).resolve()),
                out=str(Path(train_config.out).resolve())))
        except ConfigError as exc:
            raise JobError(f"{exc}; remove it (or pass another --out) to train "
                           "again") from exc
        console.print(f"[bold]6/7 train[/]: {train_config.out} holds the finished run "
                      f"({config.train_steps} iterations); reused")
    else:
        console.print(f"[bold]6/7 train[/]: {config.train_steps} iterations of "
                      f"{config.tasks_per_step} {config.train_sampler} trees, reuse "
                      f"{config.reuse} of the collected trees"
                      + (" (resuming)" if state == "partial" else ""))
        try:
            train(train_config, resume=state == "partial")
        except (TrainError, ConfigError) as exc:
            raise JobError(f"training run {train_config.out}: {exc}") from exc
    reused["train"] = state == "done"
    lap("train")

    _write_state(config, train_config, start_dir, ranking_dir, seconds, cpu, reused)
    results, files = write_demo_report(config.out)
    lap("report")
    print_demo_summary(results, files, console)
    console.print(f"total {sum(seconds.values()):.0f} s wall, {sum(cpu.values()):.0f} s CPU ("
                  + ", ".join(f"{k} {v:.0f}/{cpu[k]:.0f} s" for k, v in seconds.items()) + ")")
    return DemoResult(results, files, seconds, reused)


def _unchanged(a: StoreVersion, b: StoreVersion) -> bool:
    """Nothing was committed between the two versions of a store."""
    return dict(a.versions) == dict(b.versions)


def _connect(store: Store) -> Any:
    from rollout_store import connect

    return connect(store)


def _id_table(ids: Sequence[str]) -> Any:
    import pyarrow as pa

    return pa.table({"tree_id": pa.array(list(ids), pa.string())})


def _write_state(config: DemoConfig, train_config: TrainConfig, start_dir: Path,
                 ranking_dir: Path, seconds: Mapping[str, float],
                 cpu: Mapping[str, float], reused: Mapping[str, bool]) -> Path:
    """``OUT/demo.json``: what ``analysis.demo_report`` needs besides the store."""
    from analysis.report import write_json

    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return write_json(config.out / DEMO_STATE, {
        "settings": settings,
        "store": str(Path(config.store).resolve()),
        "collect_runs": {s: config.run_id(s) for s in config.samplers},
        "train_run": train_config.resolved_run_id,
        "train_dir": str(Path(train_config.out).resolve()),
        "train_config": train_config.to_dict(),
        "start_policy": str(start_dir.resolve()),
        "ranking_dir": str(ranking_dir.resolve()),
        "phases": [[name, seconds[name], cpu[name]] for name in seconds],
        "reused": dict(reused),
    })


def print_demo_summary(results: Mapping[str, Any], files: Sequence[Path],
                       console: Console) -> None:
    """The terminal summary of the main job: ranking quality per method (pooled, with
    intervals, and tau-b per sampler), held-out success before and after training, tool
    steps, and the paths of the report and plots (``results`` from
    ``analysis.demo_report``)."""
    ranking = results["ranking"]
    settings = results["settings"]
    samplers = [s for s in settings["samplers"] if s in ranking["samplers"]]
    order = [m for m in settings["methods"] if m in ranking["methods"]]
    table = Table(title=f"Mean@{ranking['k']} ranking audit ({ranking['n_prefixes']} "
                        f"prefixes, {ranking['n_trees']} trees)")
    for col in ("method", "pairwise acc. [95% CI]", "Kendall tau-b macro [95% CI]",
                *(f"tau-b {s}" for s in samplers)):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name in order:
        m = ranking["methods"][name]
        table.add_row(name, fmt_ci(m["pairwise_accuracy"], m["pairwise_accuracy_ci"]),
                      fmt_ci(m["kendall_tau_b"], m["kendall_tau_b_ci"]),
                      *(fmt_ci(m["by_sampler"].get(s, {}).get("kendall_tau_b"), None)
                        for s in samplers))
    console.print(table)
    tr = results["training"]
    t2 = Table(title=f"training: {tr['iterations']} iterations, reuse {tr['reuse']} "
                     f"({tr['run_id']})")
    for col in ("held-out success", "before", "after"):
        t2.add_column(col, justify="left" if col == "held-out success" else "right")
    for kind in ("sampled", "greedy"):
        h = tr["heldout"][kind]
        t2.add_row(f"{kind} ({tr['heldout_tasks']} tasks)", fmt_ci(h["before"], None),
                   fmt_ci(h["after"], None))
    console.print(t2)
    steps = tr["tool_steps"]
    console.print(f"new tool steps: {steps['new']:,.0f} (fresh trees {steps['fresh']:,.0f}, "
                  f"reuse {steps['reuse_new']:,.0f}, of which calibration "
                  f"{steps.get('calibration', 0.0):,.0f}); saved by reuse: "
                  f"{steps['saved']:,.0f} (refresh-all {steps['refresh_all']:,.0f} - "
                  f"{steps['reuse_new']:,.0f} spent)")
    console.print("report: " + "  ".join(escape(str(f)) for f in files))


def fmt_ci(value: float | None, ci: Sequence[float | None] | None) -> str:
    """``0.712 [0.650, 0.770]`` (``analysis.report.fmt_ci``); ``-`` without a value, the
    value alone without an interval."""
    from analysis.report import fmt
    from analysis.report import fmt_ci as report_fmt_ci

    if value is None:
        return "-"
    if not ci or ci[0] is None:
        return fmt(value)
    return report_fmt_ci(value, ci)


# ----- the workflow studies -----------------------------------------------------------------


def drift_study(out: str | Path, config: DriftConfig | None = None) -> dict[str, Any]:
    """The credit-drift study (``train.studies.drift``), then its report
    (``analysis.drift``); returns the results dict (``results.json``)."""
    from analysis.drift import drift_results
    from train.studies.drift import run_drift_study

    return drift_results(run_drift_study(out, config).parent)


def gate_study(out: str | Path, config: GateStudyConfig | None = None) -> dict[str, Any]:
    """The gate study (``train.studies.gates``), then its report (``analysis.gates``)."""
    from analysis.gates import gate_results
    from train.studies.gates import run_gate_study

    return gate_results(run_gate_study(out, config).parent)


def localization_study(out: str | Path, config: LocalizationConfig | None = None
                       ) -> dict[str, Any]:
    """The localization study (``train.studies.localization``), then its report
    (``analysis.localization``)."""
    from analysis.localization import localization_results
    from train.studies.localization import run_localization_study

    return localization_results(run_localization_study(out, config).parent)


# ----- the seed papers' claims: ``rtrees study NAME`` -----------------------------------------


@dataclass(frozen=True)
class StudySpec:
    """One ``rtrees study`` study: its settings dataclass, the defaults it runs at, the small
    settings of its test, and the function that generates its data (``train.studies``) and
    then builds its report (``analysis``) in ``out``, returning ``results.json``'s content
    (which holds ``verdicts``: one dict per claim, ``analysis.verdicts.Verdict.to_json``).

    To add a study (e.g. ``table1`` once the trainer lands): a config dataclass, a
    ``run(out, config) -> dict`` that writes ``study.json`` + data files and calls its
    ``analysis`` report builder (registered with ``register_study_report``), and one
    ``register_study(StudySpec(...))`` call below. ``run(out, config, log)``: ``log`` takes
    the study's progress lines (None: quiet)."""

    name: str
    title: str
    config: str
    """The settings dataclass as ``module:Name`` (imported when the study runs, so that
    ``rtrees`` starts without importing every study)."""
    run: Callable[[Path, Any, Callable[[str], None] | None], dict[str, Any]]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    small: Mapping[str, Any] = field(default_factory=dict)

    @property
    def config_class(self) -> type:
        module, _, attr = self.config.partition(":")
        cls: type = getattr(importlib.import_module(module), attr)
        return cls


STUDIES: dict[str, StudySpec] = {}


def register_study(spec: StudySpec) -> StudySpec:
    """Add ``spec`` to ``STUDIES`` (``rtrees study NAME``)."""
    STUDIES[spec.name] = spec
    return spec


def study_config(name: str, params: Mapping[str, Any] | None = None, small: bool = False
                 ) -> Any:
    """The settings of study ``name``: its defaults, then (``small``) its test settings,
    then ``params`` (strings are converted to each field's type, ``train.coerce``). Unknown
    names and fields, and bad values, are ``ValueError``s naming them."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; choose from {sorted(STUDIES)}")
    from train.coerce import coerce_fields

    spec = STUDIES[name]
    fields = {f.name for f in dataclasses.fields(spec.config_class)}
    unknown = sorted(set(params or {}) - fields)
    if unknown:
        raise ValueError(f"study {name!r} has no settings {unknown}; it takes "
                         f"{sorted(fields)}")
    values: dict[str, Any] = {**spec.defaults, **(spec.small if small else {})}
    # train.coerce: text parsed by the field types (tuples a,b,c), floats finite; the
    # dataclass's __post_init__ checks types and ranges (check_types, check_bounds)
    values.update(coerce_fields(spec.config_class, params or {}, "--param "))
    return spec.config_class(**values)


def study_power(name: str, params: Mapping[str, Any] | None = None, small: bool = False,
                effect: float | None = None) -> list[str]:
    """``rtrees study NAME --power [--effect X]``: what the study can detect at its
    settings and (with ``effect``) the size that effect needs, without running anything
    (docs/METHODS.md V3-V5, ``analysis.power``)."""
    return _power_lines(name, study_config(name, params, small), effect)


def _power_lines(name: str, config: Any, effect: float | None = None) -> list[str]:
    """``analysis.power.study_power`` of a built settings dataclass, as printed lines."""
    from analysis.power import study_power as power

    return power(name, dataclasses.asdict(config), effect).lines()


def run_study(name: str, out: str | Path, params: Mapping[str, Any] | None = None,
              small: bool = False, log: Callable[[str], None] | None = None
              ) -> dict[str, Any]:
    """``rtrees study NAME --out DIR``: settings (``study_config``), the effect they can
    detect (``study_power``, logged before anything runs), data, report; returns the
    results (``results.json``), whose ``verdicts`` the CLI prints."""
    config = study_config(name, params, small)
    if log is not None:
        for line in _power_lines(name, config):
            log(line)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return STUDIES[name].run(out, config, log)


StudyLog = Callable[[str], None] | None


def _dsc_l1(out: Path, config: DriftConfig, log: StudyLog) -> dict[str, Any]:
    from analysis.drift import drift_results
    from train.studies.drift import run_drift_study

    return drift_results(run_drift_study(out, config, kind="dsc-l1", log=log).parent)


def _elpo_fig3(out: Path, config: Any, log: StudyLog) -> dict[str, Any]:
    from analysis.constructions import construction_results
    from train.studies.constructions import run_construction_study

    # its progress: the collection's and credit jobs' own bars
    return construction_results(run_construction_study(out, config,
                                                       progress=log is not None).parent)


def _credit_exact(out: Path, config: Any, log: StudyLog) -> dict[str, Any]:
    from analysis.exact_credit import exact_credit_results
    from train.studies.exact_credit import run_exact_credit_study

    return exact_credit_results(run_exact_credit_study(out, config,
                                                       progress=log is not None).parent)


def _dsc_table2(out: Path, config: Any, log: StudyLog) -> dict[str, Any]:
    from analysis.gates import gate_results
    from train.studies.gates import run_gate_study

    return gate_results(run_gate_study(out, config, kind="dsc-table2", log=log).parent)


def _elpo_fig1(out: Path, config: Any, log: StudyLog) -> dict[str, Any]:
    from analysis.recovery import recovery_results
    from train.studies.recovery import run_recovery_study

    return recovery_results(run_recovery_study(out, config, log=log).parent)


def _table1(out: Path, config: Any, log: StudyLog) -> dict[str, Any]:
    from analysis.table1 import table1_results
    from train.studies.table1 import run_table1_study

    return table1_results(run_table1_study(out, config, log=log).parent)


def third_party_audit(out: Path, config: Any, log: StudyLog = None) -> dict[str, Any]:
    """``rtrees study third-party-audit``: trees and credit (``train.studies.third_party``),
    then the Mean@k ranking audit of the estimators that ran, at the Bonferroni level of
    their claims against the baseline (V4), then the report (``analysis.third_party``)."""
    from analysis.third_party import third_party_results
    from analysis.verdicts import family_level
    from train.studies.third_party import run_third_party_study
    from train.studies.workflow_study import write_study

    path = run_third_party_study(out, config, log)
    study = json.loads(path.read_text())
    level = family_level(max(int(study["claims"]), 1))
    start = time.perf_counter()
    ranking_job(out / study["store"], out / study["audit"], RankingJobConfig(
        methods=tuple(study["methods"]), k=config.k, n_boot=config.n_boot, level=level,
        seed=config.seed, max_new_tokens=config.max_new_tokens), progress=log is not None)
    seconds = time.perf_counter() - start
    if log is not None:
        log(f"audit: Mean@{config.k} references and ranking in {seconds:.0f} s")
    study["level"] = level
    study["seconds"]["audit"] = round(seconds, 1)
    write_study(path, study)
    return third_party_results(out)


def _register_studies() -> None:
    from train.studies.table1 import SMALL as TABLE1_SMALL

    register_study(StudySpec(
        "dsc-l1", "DSC-Gate L1: branch sensitivity |G| explains credit drift better than KL",
        "train.studies.drift:DriftConfig", _dsc_l1,
        # L1's horizons and KL targets are DriftConfig's defaults; 48 tasks (the paper: 480)
        defaults={"n_tasks": 48, "n_boot": 1000},
        small={"n_tasks": 4, "kl_targets": (0.15, 0.6), "n_boot": 50}))
    register_study(StudySpec(
        "elpo-fig3", "ELPO Fig. 3: ranking quality by tree construction",
        "train.studies.constructions:ConstructionConfig", _elpo_fig3,
        small={"envs": ("workflow",), "n_tasks": 6, "n_boot": 100}))
    register_study(StudySpec(
        "elpo-fig1", "ELPO Fig. 1: recovery after fixing one step (workflow exact, calc BEL)",
        "train.studies.recovery:RecoveryConfig", _elpo_fig1,
        small={"n_tasks": 4, "failures_per_task": 2, "resamples": 4, "n_boot": 100,
               "calc_tasks": 4}))
    register_study(StudySpec(
        "dsc-table2", "DSC-Gate Table 2: gates after an update (L4 design on workflow)",
        "train.studies.gates:GateStudyConfig", _dsc_table2,
        # L4: 3:1 competing/serial test mix, the paper's margin, 10k paired resamples
        defaults={"n_dev": 40, "n_calib": 40, "n_eval": 120, "competing_share": 0.75,
                  "margin": 0.0005, "n_boot": 10000},
        small={"n_dev": 2, "n_calib": 3, "n_eval": 4, "n_old": 8, "cap_steps": 60,
               "n_boot": 50, "horizons": (6,), "kl_targets": (0.35,)}))
    register_study(StudySpec(
        "credit-exact", "Exact credit audit: cosine to the exact advantage by horizon",
        "train.studies.exact_credit:ExactCreditConfig", _credit_exact,
        small={"horizons": (6, 12), "n_tasks": 3, "n_total": 6, "n_boot": 50,
               "methods": ("grpo", "elpo")}))
    register_study(StudySpec(
        "table1", "Table 1 in miniature: held-out success after equal training budgets",
        "train.studies.table1:Table1Config", _table1,
        small=dict(TABLE1_SMALL)))
    register_study(StudySpec(
        "third-party-audit", "Mean@k ranking audit of every estimator on a third-party env",
        "train.studies.third_party:ThirdPartyAuditConfig", third_party_audit,
        small={"n_tasks": 3, "n_total": 4, "k": 4, "n_boot": 50,
               "methods": ("grpo", "tree_grpo", "elpo")}))


_register_studies()


def rebuild_reports(store: Store | None, out: Path, studies: Sequence[Path] = ()
                    ) -> BuildSummary:
    """Every report from its data alone: the store's audits (ranking) and each study
    directory's report (``analysis.report.build_reports``)."""
    from analysis.report import build_reports

    return build_reports(store, out, studies=studies)


__all__ = ["STUDIES", "DemoConfig", "DemoResult", "JobError", "RankingJobConfig",
           "RankingJobResult", "StudySpec", "drift_study", "fmt_ci", "gate_study",
           "localization_study", "print_demo_summary", "ranking_job", "rebuild_reports",
           "register_study", "run_demo_job", "run_study", "study_config"]
