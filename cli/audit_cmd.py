"""``rtrees audit ...``: audits of stored trees (DESIGN.md section 6).

``rtrees audit ranking --store DIR --methods grpo,tree_grpo,elpo,caliper --k 32 --out DIR
[--policy SPEC]`` runs the Mean@K ranking audit (``analysis.ranking``). Children
of branching nodes that lack a reference at this k are first given one by the
reference job (``train.sampling.references``: k rollouts from each child's
snapshot, with the policy that produced the tree unless ``--policy`` names
another), committed to the store; references already there are reused.

``rtrees audit report --store DIR --out DIR`` rebuilds every audit report from
the store alone (``analysis.report.build_reports``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

audit_app = typer.Typer(help="Audit stored trees: ranking audit, report rebuilds.",
                        no_args_is_help=True)
console = Console()
err = Console(stderr=True, soft_wrap=True)

StoreOpt = Annotated[Path, typer.Option("--store", help="Store directory.")]
OutOpt = Annotated[Path, typer.Option("--out", help="Directory for report.md, results.json "
                                                    "and the plots.")]


def _fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


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
) -> None:
    """Mean@K ranking audit: pairwise accuracy (E10) and Kendall tau-b (E11) per method."""
    from analysis.ranking import (
        RankingConfig,
        RankingError,
        credit_error,
        missing_credit,
        ranking_audit,
        resolve_methods,
        write_ranking_report,
    )
    from rollout_store import SchemaMismatchError, Store, StoreError, connect
    from train.sampling.references import (
        ReferenceConfig,
        ReferenceJobError,
        collect_references,
        policy_versions,
    )

    names = tuple(m.strip() for m in methods.split(",") if m.strip())
    try:
        s = Store(store)
        con = connect(s)
        refs = resolve_methods(con, names, str(s.path))
        for ref in refs:  # fail before the (expensive) reference job
            n_missing, n_total, example = missing_credit(con, [ref])[ref.label]
            if n_missing:
                raise credit_error(ref, n_missing, n_total, example, str(s.path))
        version: str | None = None
        if collect:
            report = collect_references(s, ReferenceConfig(
                k=k, success_threshold=success_threshold, max_steps=max_steps,
                max_new_tokens=max_new_tokens, max_parallel=max_parallel, seed=seed),
                policy=policy, progress=True)
            console.print(report.summary(), markup=False)
            found = set(report.versions.values()) if policy is not None else set()
        elif policy is not None:
            found = set(policy_versions(s, policy).values())
        else:
            found = set()
        if len(found) > 1:
            _fail(f"--policy {policy!r} loads different versions per environment "
                  f"({sorted(map(str, found))}); audit one environment's trees at a time")
        version = found.pop() if found else None
        result = ranking_audit(s, RankingConfig(names, k=k, reference_policy=version,
                                                n_boot=bootstrap, level=level, seed=seed))
    except (RankingError, ReferenceJobError, StoreError, SchemaMismatchError,
            ValueError) as exc:
        _fail(str(exc))
    files = write_ranking_report(result, out)
    table = Table(title=f"Mean@{k} ranking audit: {result.stats.n_prefixes} prefixes, "
                        f"{result.stats.n_trees} trees")
    for col in ("method", "pairwise acc.", "tau_b macro", "tau_b pooled", "pairs"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m in result.stats.methods:
        table.add_row(m.label, _ci(m.pairwise_accuracy.value, m.pairwise_accuracy.ci),
                      _ci(m.tau_b_macro.value, m.tau_b_macro.ci),
                      _ci(m.tau_b_pooled.value, m.tau_b_pooled.ci), f"{m.n_pairs:,}")
    console.print(table)
    console.print(f"wrote {', '.join(str(f) for f in files)}")


def _ci(value: float, ci: tuple[float, float]) -> str:
    from analysis.report import fmt_ci

    return fmt_ci(value, ci)


@audit_app.command("report")
def report(store: StoreOpt, out: OutOpt) -> None:
    """Rebuild every audit report from the store alone (one directory per report)."""
    from analysis.report import build_reports
    from rollout_store import SchemaMismatchError, Store, StoreError

    try:
        summary = build_reports(Store(store), out)
    except (StoreError, SchemaMismatchError) as exc:
        _fail(str(exc))
    for o in summary.outputs:
        console.print(f"{o.title}: {o.summary}" + (f"  ({o.directory})" if o.files else ""))
    for name, reason in summary.skipped.items():
        console.print(f"{name}: not built ({reason})")
    console.print(f"index: {summary.index}")


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
    from analysis.drift import DriftConfig, drift_audit

    res = drift_audit(out, DriftConfig(n_tasks=tasks, seed=seed, tau=tau))
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
    from analysis.gates import GateStudyConfig, gate_audit

    res = gate_audit(out, GateStudyConfig(n_eval=eval_tasks, n_old=old, seed=seed))
    _print_study("gate evaluation", out, [str(res.get("finding", {}).get("statement", ""))])


@audit_app.command("localization")
def localization(
    out: StudyOut,
    tasks: Annotated[int, typer.Option(help="Workflow tasks per outcome mode.")] = 12,
    seed: Annotated[int, typer.Option(help="Seed of tasks and searches.")] = 0,
    repeats: Annotated[int, typer.Option(help="Localizations of each failed trajectory.")] = 4,
) -> None:
    """BEL's accuracy against the exact first irrecoverable step, and its consistency."""
    from analysis.localization import LocalizationConfig, localization_audit

    res = localization_audit(out, LocalizationConfig(n_tasks=tasks, seed=seed, repeats=repeats))
    table = Table(title="BEL localization: accuracy vs suffixes per probe (X)")
    for col in ("outcomes", "X", "trajectories", "accuracy", "agreement", "probes"):
        table.add_column(col, justify="right")
    for r in res["table"]:
        agree = r["pairwise_agreement"]
        table.add_row("deterministic" if r["deterministic"] else "stochastic", str(r["x"]),
                      str(r["n_trajectories"]), f"{r['accuracy']:.2f}",
                      "-" if agree is None else f"{agree:.2f}", f"{r['probes']:.2f}")
    console.print(table)
    console.print(f"report: {out / 'report.md'}")
