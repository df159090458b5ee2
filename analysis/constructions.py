"""ELPO Fig. 3 report: ranking quality by tree construction (``rtrees study elpo-fig3``).

Reads only the study's files (``train.studies.constructions`` wrote them): per
environment a store (trees of every sampler, credits, Mean@k references) and on workflow
``exact-workflow.parquet`` (the exact value of every child of a branching node).

For each construction (sampler, credit; ``study.json``'s ``constructions``) and each
reference (workflow: ``exact`` and ``mean@k``; calc: ``mean@k``), over the children of
the branching nodes of that sampler's trees: pairwise accuracy (E10) and Kendall τ_b
macro / pooled (E11), with the statistics of ``analysis.ranking``; intervals and paired
differences from ONE task bootstrap shared by every construction
(``analysis.stats.paired_cluster_ranking``: a task's trees of all samplers are resampled
together, so differences are paired over tasks).

Verdicts (``analysis.verdicts``) on the paper's claim "ELPO > ELPO w/o BEL > AEPO on both
metrics" (pairwise accuracy and macro τ_b), on the primary reference of each environment
(workflow: exact; calc: Mean@k): each ">" is the paired difference > 0.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from analysis.ranking_data import load_ranking_data, resolve_methods
from analysis.report import (
    BarSeries,
    ReportOutput,
    bar_plot_with_intervals,
    fmt,
    fmt_ci,
    markdown_table,
    open_study,
    plain_name,
    register_study_report,
    study_int,
    study_path,
    write_study_results,
)
from analysis.stats import ClusterSums, group_index, paired_cluster_ranking, prefix_stats
from analysis.verdicts import verdict, verdict_counts, verdict_lines

CLAIM_ORDER = ("ELPO", "ELPO w/o BEL", "AEPO stand-in")  # the paper: ELPO > w/o BEL > AEPO
METRICS = {"pairwise_accuracy": "pairwise accuracy (E10)", "tau_b_macro": "Kendall τ_b macro",
           "tau_b_pooled": "Kendall τ_b pooled"}


def construction_sums(store_dir: Path, constructions: dict[str, list[str]], k: int,
                      exact_path: Path | None) -> dict[str, Any]:
    """Per reference and construction the per-task ``ClusterSums``, plus coverage counts.

    One row per child of every branching node whose children all have a Mean@k reference
    (``analysis.ranking_data.load_ranking_data``, every method's latest credit); the exact
    reference joins on (tree_id, node_id)."""
    from rollout_store import Store, connect

    con = connect(Store(store_dir))
    methods = sorted({m for _, m in constructions.values()})
    refs = resolve_methods(con, methods, str(store_dir))
    data, _ = load_ranking_data(con, refs, k, None, store=str(store_dir))
    trees = con.sql("SELECT tree_id, sampler, task_id FROM trees").to_arrow_table()
    info = {t: (s, task) for t, s, task in zip(*(trees.column(c).to_pylist()
                                                 for c in ("tree_id", "sampler", "task_id")),
                                               strict=True)}
    tasks = sorted({task for _, task in info.values()})
    task_index = {t: i for i, t in enumerate(tasks)}
    sampler_of_tree = np.array([info[t][0] for t in data.tree_ids], dtype=object)
    task_of_tree = np.array([task_index[info[t][1]] for t in data.tree_ids], np.int64)
    references: dict[str, np.ndarray] = {f"mean@{k}": data.q}
    if exact_path is not None:
        exact = pq.read_table(exact_path)
        lookup = {(t, int(n)): float(v) for t, n, v in zip(
            *(exact.column(c).to_pylist() for c in ("tree_id", "node_id", "exact")),
            strict=True)}
        references["exact"] = np.array([lookup.get((data.tree_ids[t], int(n)), math.nan)
                                        for t, n in zip(data.tree, data.node_id, strict=True)])
    sums: dict[str, dict[str, ClusterSums]] = {}
    coverage: dict[str, dict[str, int]] = {}
    for name, (sampler, method) in constructions.items():
        rows = np.flatnonzero(sampler_of_tree[data.tree] == sampler)
        col = data.labels.index(method)
        tree, parent = data.tree[rows], data.parent_id[rows]
        group = group_index([tree, parent])
        coverage[name] = {"trees": int(np.unique(tree).size),
                          "prefixes": int(group.max() + 1) if rows.size else 0,
                          "children": int(rows.size)}
        for ref, q in references.items():
            if rows.size and np.isnan(q[rows]).any():
                raise ValueError(f"{exact_path}: children of {sampler} trees lack an exact "
                                 "value (rerun the study into a fresh directory)")
            ps = prefix_stats(tree, group, q[rows], data.scores[rows][:, [col]])
            sums.setdefault(ref, {})[name] = ClusterSums.of(ps, task_of_tree, len(tasks))
    return {"sums": sums, "coverage": coverage, "n_tasks": len(tasks),
            "methods": {r.method: r.params_hash for r in refs}}


def construction_verdicts(env: str, reference: str, stats: dict[str, Any], paper: str
                          ) -> list[dict[str, Any]]:
    """The claim's two ">" on both metrics as verdicts (paired differences > 0)."""
    out = []
    for a, b in itertools.pairwise(CLAIM_ORDER):
        d = stats["differences"].get(f"{a} - {b}")
        if d is None:
            continue
        for metric in ("pairwise_accuracy", "tau_b_macro"):
            out.append(verdict(
                f"Fig. 3 ({env}, {reference} reference): {a} > {b} in {METRICS[metric]}",
                f"paired difference {a} - {b}", d[metric]["estimate"], d[metric]["ci"], 0.0,
                "above", paper, delta=DELTA).to_json())
    return out


DELTA = 0.02
"""Pre-registered equivalence margin (V1) of a difference in pairwise accuracy or tau-b
[R]: the paper's Fig. 3 values are not recovered, so the margin is the one Table 1 uses
for success rates."""
PAPER = "ELPO > ELPO w/o BEL > AEPO on both metrics (200 questions, Qwen2.5-7B; values " \
        "not recovered)"


def construction_results(study_dir: str | Path, out_dir: str | Path | None = None
                         ) -> dict[str, Any]:
    """The ELPO Fig. 3 report of a study directory: ``results.json``, ``report.md`` and one
    bar plot per (environment, reference) into ``out_dir`` (default: the study directory);
    returns the results dict."""
    src, out, study = open_study(study_dir, out_dir, "elpo-fig3")
    config = study["config"]
    constructions = {k: list(v) for k, v in study["constructions"].items()}
    envs: dict[str, Any] = {}
    verdicts: list[dict[str, Any]] = []
    plots: list[str] = []
    for env, doc in study["envs"].items():
        env = plain_name(env, "study.json envs key")  # it names output files
        exact = study_path(src, doc["exact"], f"envs.{env}.exact") if doc.get("exact") \
            else None
        found = construction_sums(study_path(src, doc["store"], f"envs.{env}.store"),
                                  constructions, study_int(config, "k"),
                                  exact)
        per_ref = {}
        for ref, sums in found["sums"].items():
            st = paired_cluster_ranking(sums, config["n_boot"], config["seed"])
            per_ref[ref] = st
            names = list(sums)
            path = out / f"fig3_{env}_{ref.replace('@', '')}.png"
            bar_plot_with_intervals(path, names, [
                BarSeries(METRICS[m], [st["point"][n][m] for n in names],
                          [tuple(st["ci"][n][m]) for n in names],
                          reference=0.5 if m == "pairwise_accuracy" else 0.0)
                for m in ("pairwise_accuracy", "tau_b_macro")],
                suptitle=f"{env}: ranking vs {ref} reference")
            plots.append(path.name)
        primary = "exact" if "exact" in per_ref else f"mean@{config['k']}"
        verdicts += construction_verdicts(env, primary, per_ref[primary], PAPER)
        envs[env] = {"n_tasks": found["n_tasks"], "coverage": found["coverage"],
                     "methods": found["methods"], "primary_reference": primary,
                     "references": per_ref}
    results: dict[str, Any] = {
        "audit": "elpo-fig3", "config": config, "constructions": constructions,
        "aepo_stand_in": study["aepo_stand_in"], "envs": envs, "verdicts": verdicts,
        "plots": plots, "seconds": study["seconds"]}
    return write_study_results(out, results, construction_report(results))


def construction_report(results: dict[str, Any]) -> str:
    """The markdown report of ``construction_results``' dict."""
    c = results["config"]
    lines = ["# ELPO Fig. 3: ranking quality by tree construction", "",
             f"Equal budget n_total = {c['n_total']} per tree, the same tasks for every "
             f"construction; references: exact child values (workflow) and Mean@{c['k']}. "
             "Intervals: 95% percentile, task bootstrap shared by all constructions "
             f"({c['n_boot']} resamples); differences are paired over tasks.", "",
             "| construction | sampler | credit |", "|---|---|---|"]
    lines += [f"| {n} | {s} | {m} |" for n, (s, m) in results["constructions"].items()]
    lines += ["", f"AEPO stand-in: {results['aepo_stand_in']}.", ""]
    for env, doc in results["envs"].items():
        lines += [f"## {env} ({doc['n_tasks']} tasks)", ""]
        for ref, st in doc["references"].items():
            tag = " (primary)" if ref == doc["primary_reference"] else ""
            lines += [f"### reference: {ref}{tag}", ""]
            rows = []
            for name, cov in doc["coverage"].items():
                rows.append([name, *(fmt_ci(st["point"][name][m], st["ci"][name][m])
                                     for m in METRICS),
                             cov["trees"], cov["prefixes"], cov["children"]])
            lines += [markdown_table(["construction", *METRICS.values(), "trees",
                                      "prefixes", "children"], rows), ""]
            diffs = [[key, *(fmt_ci(d[m]["estimate"], d[m]["ci"]) for m in METRICS)]
                     for key, d in st["differences"].items()
                     if key.split(" - ")[0] in CLAIM_ORDER and key.split(" - ")[1] in
                     CLAIM_ORDER and CLAIM_ORDER.index(key.split(" - ")[0])
                     < CLAIM_ORDER.index(key.split(" - ")[1])]
            diffs += [[key, *(fmt_ci(d[m]["estimate"], d[m]["ci"]) for m in METRICS)]
                      for key, d in st["differences"].items()
                      if key in ("ELPO - Tree-GRPO", "ELPO - GRPO", "Tree-GRPO - GRPO")]
            lines += ["Paired differences (over tasks):", "",
                      markdown_table(["difference", *METRICS.values()], diffs), ""]
        if "exact" in doc["references"]:
            mc = doc["references"][f"mean@{c['k']}"]["point"]
            ex = doc["references"]["exact"]["point"]
            cost = ", ".join(f"{n} {fmt(ex[n]['pairwise_accuracy'] - mc[n]['pairwise_accuracy'])}"
                             for n in ex)
            lines += [f"Monte Carlo noise of the Mean@{c['k']} reference (pairwise accuracy, "
                      f"exact minus Mean@{c['k']}): {cost}.", ""]
    lines += ["## Verdicts", "", *verdict_lines(results["verdicts"]), "",
              "Plots: " + ", ".join(f"`{p}`" for p in results["plots"]), "",
              f"Reproduce: `rtrees study elpo-fig3 --out DIR` with the settings in "
              f"`results.json` ({results['seconds']:.0f} s of data generation here)."]
    return "\n".join(lines) + "\n"


@register_study_report("elpo-fig3")
def build_construction_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``)."""
    res = construction_results(study_dir, out)
    return ReportOutput("elpo-fig3", out, "ELPO Fig. 3: ranking by tree construction",
                        verdict_counts(res["verdicts"]), (out / "report.md",))


__all__ = ["CLAIM_ORDER", "build_construction_report", "construction_report",
           "construction_results", "construction_sums", "construction_verdicts"]
