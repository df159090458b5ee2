"""The main job behind ``make demo`` / ``rtrees demo`` (``DemoConfig``, ``run_demo_job``),
on embedded defaults (the tiny policy, calc, a local store, DuckDB); with
``train.jobs`` one of the two composition roots of ``train`` that import ``analysis``
(``tests/test_layering.py``):

1. **policy**: the tiny policy for the environment, trained by ``rtrees policy
   init`` unless a checkpoint exists (the committed one, or the cache), published as
   ``OUT/policy/step-000000``: the trees collected with it are version 0 of the
   training run, which starts from it (``train.reuse`` reads versions from
   ``step-N`` in ``policy_ref``);
2. **collect**: one tree per task with each sampler (``group``, ``bel``,
   ``caliper``), committed to the store (``train.sampling.collect``; idempotent per
   run id and seed);
3. **credit**: each method (``grpo``, ``tree_grpo``, ``elpo``, ``caliper``, ``trace``)
   for every collected tree lacking it; ``trace`` (T1-T7) first scores the gold answer
   under the starting policy, its frozen reference (``train.scoring``, from the store).
   On calc, grpo, tree_grpo and elpo order most siblings identically by construction
   (the report says why); trace orders them by another signal (how much a step raises
   the reference's probability of the gold answer), so the first table of the audit
   shows it telling methods apart, with intervals;
4. **references**: Mean@k for every child of a branching node of the collected trees
   (``train.sampling.references``);
5. **audit**: ``train.jobs.ranking_job`` (E10-E11, pooled and per sampler);
6. **train**: ``train.trainer.train`` with ``reuse="transport"`` over the collected trees,
   held-out success before, during and after (the trainer's ``metrics``);
7. **report**: ``analysis.demo_report`` (store and result files only) and a summary
   table.

Every step reuses what the store and the output directory already hold (trees, credit,
references, the finished training run), so a rerun only redoes the reporting.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from train.jobs import JobError, RankingJobConfig, fmt_ci, ranking_job
from train.reuse.params import ReuseMode

if TYPE_CHECKING:
    from rollout_store import Store
    from rollout_store.store import StoreVersion
    from train.config import TrainConfig

DEMO_STATE = "demo.json"
"""The main job's record in its output directory: settings, run ids, phase timings (what
``analysis.demo_report`` reads besides the store and the ranking results)."""
START_DIR = Path("policy") / "step-000000"
"""Where (under ``DemoConfig.out``) the starting weights are published: ``train.reuse``
reads a tree's policy version index from ``step-N`` in its ``policy_ref``, so trees
collected by ``OUT/policy/step-000000`` count as version 0 of the training run, which
starts from these very weights."""


START_POLICY = "start"
"""A ``DemoConfig.credit_params`` value: the starting policy (its checkpoint for scoring,
its version in the credit's parameters, as ``train.scoring.score_for_credit`` records)."""


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
    methods: tuple[str, ...] = ("grpo", "tree_grpo", "elpo", "caliper", "trace")
    """Credit methods computed for every collected tree and audited."""
    credit_params: tuple[tuple[str, str, str], ...] = (("trace", "ref", START_POLICY),)
    """Parameters of the audited methods, as (method, name, value); the value ``start``
    names the starting policy (``OUT/policy/step-000000``): trace's frozen reference (T2)
    scores each node's gold answer with it, read from the store. Parameters of a method
    not in ``methods`` are ignored."""
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

    def method_params(self, method: str, start: str) -> dict[str, str]:
        """``method``'s ``credit_params`` as ``--param`` pairs, ``start`` for the starting
        policy."""
        return {name: start if value == START_POLICY else value
                for m, name, value in self.credit_params if m == method}

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
    from train.credit.store_io import resolve_method
    from train.policies import load_policy
    from train.sampling.collect import collect, tree_id_for
    from train.sampling.references import ReferenceConfig, collect_references
    from train.scoring import score_and_credit
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
    spec = str(start_dir.resolve())
    for method in config.methods:
        # the hash of the params as stored: a scoring policy is recorded by its version
        params_hash = resolve_method(method, config.method_params(
            method, str(policy.policy_version)))[1].params_hash()
        [(lacking,)] = con.execute(
            "SELECT count(*) FROM _demo_trees d WHERE NOT EXISTS (SELECT 1 FROM credits c "
            "WHERE c.tree_id = d.tree_id AND c.method = $m AND c.method_params_hash = $h)",
            {"m": method, "h": params_hash}).fetchall()
        if lacking:  # score_and_credit credits every stored tree lacking it
            credit = score_and_credit(store, method, config.method_params(method, spec),
                                      progress=True)
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


__all__ = ["DEMO_STATE", "START_DIR", "START_POLICY", "DemoConfig", "DemoResult",
           "print_demo_summary", "run_demo_job"]
