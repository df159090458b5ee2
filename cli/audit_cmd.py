"""``rtrees audit ...``: audits of stored trees and the workflow studies.

Every command parses its options, calls one function of ``train.jobs`` and prints.

``rtrees audit ranking --store DIR --methods grpo,tree_grpo,elpo,caliper --k 32 --out DIR
[--policy SPEC] [--by sampler|run]`` runs the Mean@K ranking audit
(``train.jobs.ranking_job``); ``--by`` adds the same audit per tree construction
(``trees.sampler``) or per run (``trees.run_id``). Children
of branching nodes that lack a reference at this k are first given one by the
reference job (``train.sampling.references``: k rollouts from each child's
snapshot, with the policy that produced the tree unless ``--policy`` names
another), committed to the store; references already there are reused.

``rtrees audit drift|gates|localization --out DIR`` runs a workflow study: its data
(``train.studies``) then its report (``analysis``), both in ``DIR``.

``rtrees audit report [--store DIR] [--study DIR ...] --out DIR`` rebuilds every
audit report from its data alone: the store's ranking audits, and each study
directory's report from its ``study.json`` and data files
(``train.jobs.rebuild_reports``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cli._common import console, fail

audit_app = typer.Typer(help="Audit stored trees: ranking audit, workflow studies, report "
                             "rebuilds.", no_args_is_help=True)

StoreOpt = Annotated[Path, typer.Option("--store", help="Store directory.")]
OutOpt = Annotated[Path, typer.Option("--out", help="Directory for report.md, results.json "
                                                    "and the plots.")]


@audit_app.command("ranking")
def ranking(
    store: StoreOpt,
    out: OutOpt,
    methods: Annotated[str, typer.Option(help="Comma-separated methods, each `name` (its "
                                              "latest params hash) or `name@HASH`.")],
    k: Annotated[int, typer.Option(help="Rollouts per child reference (Mean@k).")] = 32,
    policy: Annotated[str | None, typer.Option(
        help="Policy spec that samples the references (default: each tree's own "
             "trees.policy_ref, which must load trees.policy_version).")] = None,
    bootstrap: Annotated[int, typer.Option(help="Bootstrap resamples of trees.")] = 2000,
    level: Annotated[float, typer.Option(help="Confidence level of the intervals.")] = 0.95,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap and the rollouts.")] = 0,
    collect: Annotated[bool, typer.Option(
        help="Sample missing references first (--no-collect: audit what is stored).")] = True,
    success_threshold: Annotated[float, typer.Option(
        help="A reference rollout succeeds when its final reward is >= this.")] = 1.0,
    max_steps: Annotated[int | None, typer.Option(
        help="Episode step limit (default: the tree's recorded limit).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Token cap of one agent step.")] = 128,
    max_parallel: Annotated[int, typer.Option(
        help="Reference rollouts stepped together (environments held at once).")] = 512,
    by: Annotated[str | None, typer.Option(
        help="Also audit each group of trees alone: `sampler` (tree construction) or "
             "`run` (run id).")] = None,
) -> None:
    """Mean@K ranking audit: pairwise accuracy (E10) and Kendall tau-b (E11) per method."""
    from analysis.ranking import RankingError
    from rollout_store import SchemaMismatchError, Store, StoreError
    from train.jobs import JobError, RankingJobConfig, fmt_ci, ranking_job
    from train.sampling.continuation import ContinuationError

    names = tuple(m.strip() for m in methods.split(",") if m.strip())
    try:
        job = ranking_job(Store(store), out, RankingJobConfig(
            names, k=k, policy=policy, n_boot=bootstrap, level=level, seed=seed,
            collect=collect, success_threshold=success_threshold, max_steps=max_steps,
            max_new_tokens=max_new_tokens, max_parallel=max_parallel, by=by))
    except (RankingError, ContinuationError, JobError, StoreError, SchemaMismatchError,
            ValueError) as exc:
        fail(str(exc))
    if job.references is not None:
        console.print(job.references.summary(), markup=False)
    stats = job.result.stats
    table = Table(title=f"Mean@{k} ranking audit: {stats.n_prefixes} prefixes, "
                        f"{stats.n_trees} trees")
    for col in ("method", "pairwise acc.", "tau_b macro", "tau_b pooled", "pairs"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m in stats.methods:
        table.add_row(m.label, fmt_ci(m.pairwise_accuracy.value, m.pairwise_accuracy.ci),
                      fmt_ci(m.tau_b_macro.value, m.tau_b_macro.ci),
                      fmt_ci(m.tau_b_pooled.value, m.tau_b_pooled.ci), f"{m.n_pairs:,}")
    console.print(table)
    if job.result.groups:
        split = Table(title=f"by {by}")
        for col in (str(by), "method", "pairwise acc.", "tau_b macro", "trees"):
            split.add_column(col, justify="left" if col in (by, "method") else "right")
        for name, g in job.result.groups.items():
            for m in g.methods:
                split.add_row(name, m.label,
                              fmt_ci(m.pairwise_accuracy.value, m.pairwise_accuracy.ci),
                              fmt_ci(m.tau_b_macro.value, m.tau_b_macro.ci), str(g.n_trees))
        console.print(split)
    console.print(f"wrote {', '.join(str(f) for f in job.files)}")


@audit_app.command("report")
def report(
    out: OutOpt,
    store: Annotated[Path | None, typer.Option(
        "--store", help="Store whose audits (ranking) to rebuild.")] = None,
    study: Annotated[list[Path] | None, typer.Option(
        "--study", help="A study directory (drift, gates, localization, or one of "
                        "`rtrees study`) to rebuild; repeat for several.")] = None,
) -> None:
    """Rebuild every audit report from its data alone (one directory per report)."""
    from rollout_store import SchemaMismatchError, Store, StoreError
    from train.jobs import rebuild_reports

    if store is None and not study:
        fail("name a store (--store DIR) and/or study directories (--study DIR)")
    try:
        summary = rebuild_reports(None if store is None else Store(store), out, study or [])
    except (StoreError, SchemaMismatchError, ValueError) as exc:
        fail(str(exc))
    for o in summary.outputs:  # one line each, never wrapped (users grep them)
        console.print(f"{o.title}: {o.summary}" + (f"  ({o.directory})" if o.files else ""),
                      soft_wrap=True, markup=False, highlight=False)
    for name, reason in summary.skipped.items():
        console.print(f"{name}: not built ({reason})", soft_wrap=True, markup=False,
                      highlight=False)
    console.print(f"index: {summary.index}", soft_wrap=True, markup=False, highlight=False)
    # A study asked for by name that was not built is a failure, not a note (issue 21): a
    # script must not read exit 0 as "every report rebuilt". The store's own audits with
    # no data stay notes: they were not asked for one by one.
    missing = [(name, why) for name, why in summary.skipped.items()
               if name in {str(s) for s in study or []}]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        fail(f"requested study {missing[0][0]} was not built: {missing[0][1]}{more}")


StudyOut = Annotated[Path, typer.Option("--out", help="Directory for the study's data, "
                                                      "results.json, report.md and plots.")]


def _print_study(title: str, out: Path, lines: list[str]) -> None:
    console.print(f"[bold]{title}[/]")
    for line in lines:
        console.print(f"  {line}", highlight=False)
    console.print(f"report: {out / 'report.md'}")


@audit_app.command("drift")
def drift(
    out: StudyOut,
    tasks: Annotated[int, typer.Option(help="Workflow tasks.")] = 12,
    seed: Annotated[int, typer.Option(help="Seed of tasks, old policy and updates.")] = 0,
    tau: Annotated[float, typer.Option(help="Relevance threshold of a reversal.")] = 0.02,
) -> None:
    """Credit drift and branch sensitivity across tabular policy updates (exact, workflow)."""
    from train.jobs import drift_study
    from train.studies.drift import DriftConfig

    try:
        res = drift_study(out, DriftConfig(n_tasks=tasks, seed=seed, tau=tau))
    except ValueError as exc:
        fail(str(exc))
    _print_study("credit drift", out, [f"{k}: {v}" for k, v in res.get("summary", {}).items()
                                       if not isinstance(v, dict | list)])


@audit_app.command("gates")
def gates(
    out: StudyOut,
    eval_tasks: Annotated[int, typer.Option(help="Evaluation tasks.")] = 40,
    old: Annotated[int, typer.Option(help="Old trajectories per root action.")] = 64,
    seed: Annotated[int, typer.Option(help="Seed of every task and trajectory.")] = 0,
) -> None:
    """DSC / Gap / WIS / DR / reuse / transport gates: regret and new tool steps (workflow)."""
    from train.jobs import gate_study
    from train.studies.gates import GateStudyConfig

    try:
        res = gate_study(out, GateStudyConfig(n_eval=eval_tasks, n_old=old, seed=seed))
    except ValueError as exc:
        fail(str(exc))
    _print_study("gate evaluation", out, [str(res.get("finding", {}).get("statement", ""))])


@audit_app.command("localization")
def localization(
    out: StudyOut,
    tasks: Annotated[int, typer.Option(help="Workflow tasks per outcome mode.")] = 12,
    seed: Annotated[int, typer.Option(help="Seed of tasks and searches.")] = 0,
    repeats: Annotated[int, typer.Option(help="Localizations of each failed trajectory.")] = 4,
) -> None:
    """BEL's accuracy against the exact first irrecoverable step, and its consistency."""
    from train.jobs import localization_study
    from train.studies.localization import LocalizationConfig

    try:
        res = localization_study(out, LocalizationConfig(n_tasks=tasks, seed=seed,
                                                         repeats=repeats))
    except ValueError as exc:
        fail(str(exc))
    table = Table(title="BEL localization: accuracy vs suffixes per probe (X)")
    for col in ("outcomes", "X", "trajectories", "accuracy", "agreement", "probes"):
        table.add_column(col, justify="right")
    for r in res["table"]:  # rows of the results table, not trees
        agree = r["pairwise_agreement"]
        table.add_row("deterministic" if r["deterministic"] else "stochastic", str(r["x"]),
                      str(r["n_trajectories"]), f"{r['accuracy']:.2f}",
                      "-" if agree is None else f"{agree:.2f}", f"{r['probes']:.2f}")
    console.print(table)
    console.print(f"report: {out / 'report.md'}")
