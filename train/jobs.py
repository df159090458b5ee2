"""The composition root: every job that ties collection, credit and analysis together.

With ``train.demo`` (the main job) this is the only module of ``train`` that imports
``analysis`` (``tests/test_layering.py`` checks it): data flows one way, from the
environments and policies (``train.envs``, ``train.policies``) through the samplers and
studies (``train.sampling``, ``train.studies``) into stores and study files, which
``analysis`` reads. The CLI
commands parse their options, call one function of this module and print.

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

The main job behind ``make demo`` / ``rtrees demo`` (``run_demo_job``, its phases and
settings) is ``train.demo``: it calls ``ranking_job`` and ``fmt_ci`` from here.
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

if TYPE_CHECKING:
    from analysis.ranking import RankingResult
    from analysis.report import BuildSummary
    from rollout_store import Store
    from rollout_store.store import StoreVersion
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

__all__ = ["STUDIES", "JobError", "RankingJobConfig", "RankingJobResult", "StudySpec",
           "drift_study", "fmt_ci", "gate_study", "localization_study", "ranking_job",
           "rebuild_reports", "register_study", "run_study", "study_config"]
