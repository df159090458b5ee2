"""The composition root: every job that ties collection, credit and analysis together.

This is the only module of ``train`` that imports ``analysis`` (``tests/test_layering.py``
checks it): data flows one way, from the environments and policies (``train.envs``,
``train.policies``) through the samplers and studies (``train.sampling``,
``train.studies``) into stores and study files, which ``analysis`` reads. The CLI
commands parse their options, call one function of this module and print.

* ``run_pipeline``: the main job behind ``make demo`` / ``rtrees pipeline``: init,
  collect, credit, audit (below);
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

The main job, on embedded defaults (the tiny policy, calc, a local store, DuckDB):

1. **policy**: the tiny policy for the environment, trained by ``rtrees policy
   init`` unless a checkpoint exists (the committed one, or the cache);
2. **collect**: one tree per task with each sampler (``group``, ``bel``), committed
   to the store (``train.sampling.collect``; idempotent per run id and seed);
3. **credit**: each method (``grpo``, ``elpo``) for every stored tree lacking it;
4. **audit**: ``ranking_job``: the reference job samples k rollouts from every
   branching child without a reference, then ``analysis.ranking`` reports.

Every step reuses what the store already holds, so a rerun only redoes the
reporting.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from analysis.ranking import RankingResult
    from analysis.report import BuildSummary
    from rollout_store import Store
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
                progress: bool = True) -> RankingJobResult:
    """References (when ``collect``), then the audit, then the report (module docstring).

    Fails before the (expensive) reference job when a method lacks credit for an
    audited tree (``RankingError`` naming the ``rtrees credit`` command).
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
    con = connect(s)
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
                                            by=config.by))  # type: ignore[arg-type]
    return RankingJobResult(refs, result, write_ranking_report(result, out))


# ----- the main job -----------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineConfig:
    """Settings of the main job (defaults: the embedded demo, ~15 min on 2 cores cold)."""

    store: Path = Path("store-demo")
    """Store directory (created if missing)."""
    out: Path = Path("out/demo")
    """Where the ranking report goes (report.md, results.json, plots)."""
    env: str = "calc"
    """Environment (the tiny policy exists for calc and workflow)."""
    policy: str = "tiny"
    """Policy spec (``train.policies.load_policy``)."""
    seed: int = 0
    """Seed of tasks, sampling, references and the bootstrap."""
    tasks: int = 12
    """Tasks collected with each sampler."""
    n_total: int = 16
    """Rollout budget per tree."""
    samplers: tuple[str, ...] = ("group", "bel")
    """Samplers to collect with (one run id each)."""
    methods: tuple[str, ...] = ("grpo", "elpo")
    """Credit methods computed and audited."""
    k: int = 32
    """Rollouts behind each Mean@k reference."""
    init_minutes: float = 10.0
    """Time budget of ``policy init`` when no checkpoint exists."""
    max_new_tokens: int = 64
    """Token cap of one agent step while collecting and referencing."""

    def __post_init__(self) -> None:
        if self.tasks < 1 or self.n_total < 1 or self.k < 1:
            raise ValueError("tasks, n_total and k must be >= 1")
        if not self.samplers or not self.methods:
            raise ValueError("name at least one sampler and one method")


def run_pipeline(config: PipelineConfig, console: Console | None = None) -> dict[str, Any]:
    """Run the four steps of the module docstring; print a summary table and the report path.
    Returns the audit's results (``results.json`` content)."""
    from rollout_store import Store
    from train.credit.store_io import compute_credits
    from train.envs import env_class
    from train.policies import load_policy
    from train.sampling.collect import collect

    console = console or Console()
    start = time.perf_counter()
    if config.policy == "tiny":
        from train.policies.tiny import find_checkpoint
        from train.policies.tiny_train import init_policy

        if find_checkpoint(config.env, config.seed) is None:
            console.print(f"[bold]1/4 policy[/]: no tiny {config.env} checkpoint yet; "
                          f"training one (up to {config.init_minutes:g} min)")
            init_policy(config.env, seed=config.seed, minutes=config.init_minutes,
                        log=console.print)
    policy = load_policy(config.policy, config.env)
    console.print(f"[bold]1/4 policy[/]: {config.policy} {policy.policy_version} "
                  f"({policy.policy_ref})")

    store = Store(config.store, create=True)
    tasks = env_class(config.env).generate_tasks(config.tasks, config.seed)
    for sampler in config.samplers:
        run_id = f"demo-{config.env}-{sampler}-{config.policy}-n{config.n_total}"
        report = collect(store, config.env, policy, sampler, tasks, config.n_total,
                         config.seed, run_id,
                         sampler_params={"max_new_tokens": config.max_new_tokens})
        console.print(f"[bold]2/4 collect[/] {sampler}: {escape(report.summary())}")
    for method in config.methods:
        credit = compute_credits(store, method)
        console.print(f"[bold]3/4 credit[/]: {escape(credit.summary())}")
    job = ranking_job(store, config.out, RankingJobConfig(
        tuple(config.methods), k=config.k, policy=policy, own_version=True, seed=config.seed,
        max_new_tokens=config.max_new_tokens), progress=True)
    assert job.references is not None
    console.print(f"[bold]4/4 audit[/]: references {escape(job.references.summary())}")
    doc: dict[str, Any] = job.result.to_json()
    table = Table(title=f"Mean@{config.k} ranking audit ({config.env}, {config.policy})")
    for col in ("method", "pairwise acc.", "Kendall tau-b (macro)", "prefixes", "pairs"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, m in doc["methods"].items():
        table.add_row(name, fmt_ci(m["pairwise_accuracy"], m["ci"]["pairwise_accuracy"]),
                      fmt_ci(m["kendall_tau_b"]["macro"], m["ci"]["kendall_tau_b"]["macro"]),
                      str(m["n_prefixes"]), str(m["n_pairs"]))
    console.print(table)
    console.print(f"report: {config.out / 'report.md'}  "
                  f"({time.perf_counter() - start:.0f} s)")
    return doc


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
    ``register_study(StudySpec(...))`` call below."""

    name: str
    title: str
    config: str
    """The settings dataclass as ``module:Name`` (imported when the study runs, so that
    ``rtrees`` starts without importing every study)."""
    run: Callable[[Path, Any], dict[str, Any]]
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


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """A ``--param`` string as the config field's type: int, float, bool, str, None, or a
    tuple of those written ``a,b,c``."""
    if not isinstance(value, str):
        return value
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin is tuple or hint is tuple:
        inner = args[0] if args else str
        parts = [p.strip() for p in value.split(",") if p.strip()]
        return tuple(_coerce(p, inner, name) for p in parts)
    if origin in (types.UnionType, typing.Union):
        if type(None) in args and value.lower() in ("none", "null"):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ValueError:
                continue
        raise ValueError(f"--param {name}={value!r}: expected {hint}")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"--param {name}={value!r}: one of {list(args)}")
        return value
    if hint is bool:
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"--param {name}={value!r}: expected true or false")
    if hint in (int, float):
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"--param {name}={value!r}: expected {hint.__name__}") from None
    return value


def study_config(name: str, params: Mapping[str, Any] | None = None, small: bool = False
                 ) -> Any:
    """The settings of study ``name``: its defaults, then (``small``) its test settings,
    then ``params`` (strings are converted to each field's type). Unknown names and
    fields are ``ValueError``s naming the choices."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; choose from {sorted(STUDIES)}")
    spec = STUDIES[name]
    hints = typing.get_type_hints(spec.config_class)
    fields = {f.name for f in dataclasses.fields(spec.config_class)}
    unknown = sorted(set(params or {}) - fields)
    if unknown:
        raise ValueError(f"study {name!r} has no settings {unknown}; it takes "
                         f"{sorted(fields)}")
    values: dict[str, Any] = {**spec.defaults, **(spec.small if small else {})}
    values.update({k: _coerce(v, hints[k], k) for k, v in (params or {}).items()})
    return spec.config_class(**values)


def run_study(name: str, out: str | Path, params: Mapping[str, Any] | None = None,
              small: bool = False) -> dict[str, Any]:
    """``rtrees study NAME --out DIR``: settings (``study_config``), data, report; returns
    the results (``results.json``), whose ``verdicts`` the CLI prints."""
    config = study_config(name, params, small)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return STUDIES[name].run(out, config)


def _dsc_l1(out: Path, config: DriftConfig) -> dict[str, Any]:
    from analysis.drift import drift_results
    from train.studies.drift import run_drift_study

    return drift_results(run_drift_study(out, config, kind="dsc-l1").parent)


def _elpo_fig3(out: Path, config: Any) -> dict[str, Any]:
    from analysis.constructions import construction_results
    from train.studies.constructions import run_construction_study

    return construction_results(run_construction_study(out, config).parent)


def _dsc_table2(out: Path, config: Any) -> dict[str, Any]:
    from analysis.gates import gate_results
    from train.studies.gates import run_gate_study

    return gate_results(run_gate_study(out, config, kind="dsc-table2").parent)


def _elpo_fig1(out: Path, config: Any) -> dict[str, Any]:
    from analysis.recovery import recovery_results
    from train.studies.recovery import run_recovery_study

    return recovery_results(run_recovery_study(out, config).parent)


def _register_studies() -> None:
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


_register_studies()


def rebuild_reports(store: Store | None, out: Path, studies: Sequence[Path] = ()
                    ) -> BuildSummary:
    """Every report from its data alone: the store's audits (ranking) and each study
    directory's report (``analysis.report.build_reports``)."""
    from analysis.report import build_reports

    return build_reports(store, out, studies=studies)


__all__ = ["STUDIES", "JobError", "PipelineConfig", "RankingJobConfig", "RankingJobResult",
           "StudySpec", "drift_study", "fmt_ci", "gate_study", "localization_study",
           "ranking_job", "rebuild_reports", "register_study", "run_pipeline", "run_study",
           "study_config"]
