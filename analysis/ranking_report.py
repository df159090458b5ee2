"""The Mean@K ranking report (``analysis.ranking``'s audit as files), from the store alone.

``write_ranking_report`` writes ``results.json``, ``report.md``, ``ranking.png`` and
``score_vs_reference.png`` for one ``RankingResult`` (E10 pairwise accuracy, E11
Kendall tau-b with tree-bootstrap intervals); ``build_ranking_reports`` is the
registered report builder of ``rtrees audit report``: one report per stored
reference set (k, policy), over every method with credits.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.ranking import (
    RankingConfig,
    RankingError,
    RankingResult,
    credit_hashes,
    ranking_audit,
)
from analysis.report import (
    BarSeries,
    NothingToReport,
    ReportOutput,
    bar_plot_with_intervals,
    fmt,
    fmt_ci,
    markdown_table,
    register_report,
    scatter_panels,
    write_json,
)

if TYPE_CHECKING:
    import duckdb

    from rollout_store.store import Store


def write_ranking_report(result: RankingResult, out: Path) -> list[Path]:
    """Write ``results.json``, ``report.md``, ``ranking.png`` and ``score_vs_reference.png``.

    ``results.json`` keys: ``methods.<label>.pairwise_accuracy`` (E10),
    ``.kendall_tau_b.macro`` / ``.pooled`` (E11), ``.n_prefixes``, ``.n_pairs``,
    ``.ci.pairwise_accuracy`` / ``.ci.kendall_tau_b.{macro,pooled}`` ([low, high]);
    ``paired_differences.<a>-<b>.{pairwise_accuracy, kendall_tau_b.{macro,pooled}}``
    with ``estimate`` and ``ci``; ``coverage``, ``bootstrap`` and provenance.
    """
    out.mkdir(parents=True, exist_ok=True)
    doc = result.to_json()
    s = result.stats
    files = [write_json(out / "results.json", doc)]
    labels = [m.label for m in s.methods]
    level = f"{round(100 * s.level)}%"
    panels = [
        BarSeries("pairwise accuracy (E10)", [m.pairwise_accuracy.value for m in s.methods],
                  [m.pairwise_accuracy.ci for m in s.methods], reference=0.5),
        BarSeries("Kendall τ_b, macro (E11)", [m.tau_b_macro.value for m in s.methods],
                  [m.tau_b_macro.ci for m in s.methods], reference=0.0),
        BarSeries("Kendall τ_b, pooled (E11)", [m.tau_b_pooled.value for m in s.methods],
                  [m.tau_b_pooled.ci for m in s.methods], reference=0.0),
    ]
    files.append(bar_plot_with_intervals(
        out / "ranking.png", labels, panels,
        suptitle=f"Mean@{result.config.k} ranking audit ({level} tree-bootstrap intervals)"))
    d = result.data
    files.append(scatter_panels(
        out / "score_vs_reference.png", d.q, {lab: d.scores[:, i] for i, lab in
                                              enumerate(d.labels)},
        xlabel=f"reference q = Mean@{result.config.k}", ylabel="method score (credit)",
        suptitle="child score vs reference (every audited child)"))
    md = _markdown(result, doc, level)
    (out / "report.md").write_text(md)
    files.append(out / "report.md")
    return files


def _markdown(result: RankingResult, doc: dict[str, Any], level: str) -> str:
    s = result.stats
    cov = doc["coverage"]
    who = ("each tree's own policy version" if result.config.reference_policy is None
           else f"policy version `{result.config.reference_policy}`")
    rows = [[m.label, f"`{doc['methods'][m.label]['method_params_hash']}`",
             fmt_ci(m.pairwise_accuracy.value, m.pairwise_accuracy.ci),
             fmt_ci(m.tau_b_macro.value, m.tau_b_macro.ci),
             fmt_ci(m.tau_b_pooled.value, m.tau_b_pooled.ci),
             m.n_prefixes, m.n_pairs, m.n_prefixes_score_tied] for m in s.methods]
    lines = [
        f"# Mean@{result.config.k} ranking audit",
        "",
        f"Store `{result.store}` at version {', '.join(f'{k}@{v}' for k, v in result.store_version.items())}. "  # noqa: E501
        f"References: k = {result.config.k} rollouts per child, sampled with {who}.",
        "",
        f"{cov['n_prefixes_audited']} audited prefixes (branching nodes) in {cov['n_trees']} "
        f"trees, {cov['n_children']} children; {cov['n_prefixes_reference_tied']} prefixes "
        f"skipped because every reference ties; {cov['n_pairs']} of "
        f"{cov['n_pairs_total']} pairs untied in the reference. "
        f"{cov['n_prefixes_missing_reference']} of {cov['n_prefixes_branching']} branching "
        "nodes lack a reference for some child and are left out.",
        "",
        markdown_table(["method", "params", f"pairwise accuracy [{level} CI]",
                        f"τ_b macro [{level} CI]", f"τ_b pooled [{level} CI]", "prefixes",
                        "pairs", "score-tied prefixes"], rows),
        "",
    ]
    if s.differences:
        drows = [[f"{d.a} - {d.b}", fmt_ci(d.pairwise_accuracy.value, d.pairwise_accuracy.ci),
                  fmt_ci(d.tau_b_macro.value, d.tau_b_macro.ci),
                  fmt_ci(d.tau_b_pooled.value, d.tau_b_pooled.ci)] for d in s.differences]
        lines += ["## Paired differences (same prefixes, same bootstrap resamples)", "",
                  markdown_table(["a - b", "pairwise accuracy", "τ_b macro", "τ_b pooled"],
                                 drows), ""]
    if result.groups:
        lines += [f"## By {result.config.by}", "",
                  f"The same audit on each {result.config.by}'s trees alone (bootstrap over "
                  "that group's trees); a construction is its sampler plus a credit.", ""]
        grows = [[name, m.label, fmt_ci(m.pairwise_accuracy.value, m.pairwise_accuracy.ci),
                  fmt_ci(m.tau_b_macro.value, m.tau_b_macro.ci),
                  fmt_ci(m.tau_b_pooled.value, m.tau_b_pooled.ci), g.n_trees, m.n_prefixes,
                  m.n_pairs]
                 for name, g in result.groups.items() for m in g.methods]
        header = [str(result.config.by), "method", f"pairwise accuracy [{level} CI]",
                  f"τ_b macro [{level} CI]", f"τ_b pooled [{level} CI]", "trees", "prefixes",
                  "pairs"]
        lines += [markdown_table(header, grows), ""]
    if result.dropped_methods:
        lines += ["## Methods left out", ""]
        lines += [f"- {why}" for why in result.dropped_methods.values()]
        lines.append("")
    lines += [
        "![bars](ranking.png)", "", "![scatter](score_vs_reference.png)", "",
        "## Definitions", "",
        "- Pairwise accuracy (E10): over pairs of children of one prefix whose references "
        "differ, the share ordered like the reference; pairs tied in the score count ½. "
        "Pooled over all such pairs (½ is chance).",
        "- Kendall τ_b (E11): (n_c - n_d)/√((n_0 - n_1)(n_0 - n_2)) per prefix, averaged "
        "over prefixes (macro), and pooled as Σ(n_c - n_d)/√(Σ(n_0 - n_1)·Σ(n_0 - n_2)). "
        "Prefixes where every reference ties are skipped; a prefix where every score ties "
        "counts τ_b = 0 [R].",
        f"- Intervals: {s.n_boot} percentile-bootstrap resamples of trees (seed {s.seed}); "
        "paired differences use the same resamples for both methods.",
        "- Scores are the `credits.value` of each child; n/a marks an undefined value.",
        "",
    ]
    return "\n".join(lines)


def reference_sets(con: duckdb.DuckDBPyConnection) -> list[tuple[int, str | None]]:
    """Distinct (k, reference policy) of the stored references: None when the reference
    was sampled with the tree's own policy version."""
    rows = con.sql("""
        SELECT DISTINCT r.k, CASE WHEN r.policy_version IS NOT DISTINCT FROM t.policy_version
                                  THEN NULL ELSE r.policy_version END AS policy
        FROM mc_references r JOIN trees t USING (tree_id)
        ORDER BY r.k, policy NULLS FIRST""").fetchall()
    return [(int(k), p) for k, p in rows]


def _slug(text: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:40]
    return f"{clean}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"


def report_dir_name(k: int, policy: str | None) -> str:
    """``ranking-k32`` (own policy) or ``ranking-k32-policy-<slug>``."""
    return f"ranking-k{k}" if policy is None else f"ranking-k{k}-policy-{_slug(policy)}"


@register_report("ranking")
def build_ranking_reports(store: Store, out: Path, n_boot: int = 2000,
                          seed: int = 0) -> list[ReportOutput]:
    """One ranking report per stored reference set (k, policy), over every method with
    credits (each at its latest parameter hash; methods lacking credit for an audited
    tree are listed as left out). Reads only the store."""
    from rollout_store.reader import connect

    con = connect(store)
    sets = reference_sets(con)
    names = sorted(credit_hashes(con))
    if not sets:
        raise NothingToReport("no mc_references in the store")
    if not names:
        raise NothingToReport("no credits in the store")
    outputs = []
    for k, policy in sets:
        config = RankingConfig(tuple(names), k=k, reference_policy=policy, n_boot=n_boot,
                               seed=seed)
        try:
            result = ranking_audit(store, config, on_missing_credit="drop")
        except RankingError as exc:  # listed in the index, without a link
            outputs.append(ReportOutput("ranking", out / report_dir_name(k, policy),
                                        f"Mean@{k} ranking audit", f"not built: {exc}"))
            continue
        directory = out / report_dir_name(k, policy)
        files = write_ranking_report(result, directory)
        best = max(result.stats.methods, key=lambda m: m.tau_b_macro.value)
        summary = (f"{result.stats.n_prefixes} prefixes, {len(result.stats.methods)} methods; "
                   f"highest macro τ_b: {best.label} {fmt(best.tau_b_macro.value)}")
        title = f"Mean@{k} ranking audit" + ("" if policy is None else f" (policy {policy})")
        outputs.append(ReportOutput("ranking", directory, title, summary, tuple(files)))
    return outputs


__all__ = ["build_ranking_reports", "reference_sets", "report_dir_name", "write_ranking_report"]
