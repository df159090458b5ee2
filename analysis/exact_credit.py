"""Exact credit audit report (``rtrees study credit-exact``): the cosine between each
method's credit and the exact advantage, by horizon (docs/METHODS.md section 8.5, X2).

Reads only the study's files (``train.studies.exact_credit`` wrote them): per horizon a
store (trees, credits) and ``exact-H{H}.parquet`` (the exact advantage of every action
node). Per tree and method, over the tree's action nodes with credit c and exact
advantage a (both (N,)):

    cos = (c . a) / (|c| |a|)                                          (X2)

(a tree where either vector is 0 has no cosine and is counted apart). Per (horizon,
method): the mean cosine over trees with a 95% task bootstrap interval (one tree per
task); per method other than ``grpo``, the paired difference ``method - grpo`` over the
trees both cover (V2: a t interval over trees), with a verdict per horizon at the family
level of the study's claims (V4: Bonferroni over methods x horizons) and the config's
``delta``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from analysis.report import (
    ReportOutput,
    fmt_ci,
    markdown_table,
    open_study,
    register_study_report,
    study_int,
    study_path,
    write_study_results,
)
from analysis.verdicts import (
    family_level,
    paired_difference,
    verdict,
    verdict_counts,
    verdict_lines,
)

BASELINE = "grpo"


def tree_cosines(store_dir: Path, exact_path: Path, methods: list[str]
                 ) -> dict[str, dict[str, float]]:
    """{method: {tree_id: cosine X2}} over the trees whose vectors are both non-zero (the
    latest credit row per node of each method)."""
    from rollout_store import Store, connect

    con = connect(Store(store_dir))
    exact = pq.read_table(exact_path)
    adv = {(t, int(n)): float(v) for t, n, v in zip(
        *(exact.column(c).to_pylist() for c in ("tree_id", "node_id", "advantage")),
        strict=True)}
    out: dict[str, dict[str, float]] = {}
    for method in methods:
        rows = con.execute("""
            SELECT tree_id, node_id, arg_max(value, created_at) AS value
            FROM credits_latest WHERE method = ? GROUP BY tree_id, node_id
            ORDER BY tree_id, node_id""",  # a fixed order: the same sums, bit for bit
                           [method]).fetchall()
        per_tree: dict[str, tuple[list[float], list[float]]] = {}
        for tid, nid, value in rows:
            a = adv.get((tid, int(nid)))
            if a is None or value is None:  # the root, or no credit
                continue
            cs, xs = per_tree.setdefault(tid, ([], []))
            cs.append(float(value))
            xs.append(a)
        cos = {}
        for tid, (cs, xs) in per_tree.items():
            c, x = np.asarray(cs), np.asarray(xs)
            norm = float(np.linalg.norm(c) * np.linalg.norm(x))
            if norm > 0:
                cos[tid] = float(c @ x) / norm
        out[method] = cos
    return out


def _boot_mean(values: np.ndarray, n_boot: int, rng: np.random.Generator, level: float
               ) -> tuple[float, list[float]]:
    """The mean and its percentile bootstrap interval at ``level`` (rows resampled)."""
    if values.size < 2:
        return float(values.mean()) if values.size else float("nan"), [float("nan")] * 2
    idx = rng.integers(0, values.size, (n_boot, values.size))
    means = values[idx].mean(axis=1)
    tail = (1.0 - level) / 2
    return float(values.mean()), [float(np.quantile(means, tail)),
                                  float(np.quantile(means, 1 - tail))]


def exact_credit_results(study_dir: str | Path, out_dir: str | Path | None = None
                         ) -> dict[str, Any]:
    """The report of a ``credit-exact`` study directory: ``results.json`` and
    ``report.md`` into ``out_dir`` (default: the study directory); returns the results."""
    src, out, study = open_study(study_dir, out_dir, "credit-exact")
    config = study["config"]
    methods = [str(m) for m in config["methods"]]
    n_boot = study_int(config, "n_boot")
    others = [m for m in methods if m != BASELINE]
    level = family_level(max(len(others) * len(study["horizons"]), 1))
    horizons: dict[str, Any] = {}
    verdicts: list[dict[str, Any]] = []
    for h, doc in study["horizons"].items():
        rng = np.random.default_rng([study_int(config, "seed"), int(h)])
        cos = tree_cosines(study_path(src, doc["store"], f"horizons.{h}.store"),
                           study_path(src, doc["exact"], f"horizons.{h}.exact"), methods)
        per_method = {}
        for m in methods:
            mean, ci = _boot_mean(np.asarray(list(cos[m].values())), n_boot, rng, 0.95)
            per_method[m] = {"mean": mean, "ci": ci, "trees": len(cos[m])}
        diffs = {}
        for m in others:
            both = sorted(set(cos[m]) & set(cos[BASELINE]))
            if len(both) < 2:
                est, ci, se, df = float("nan"), [float("nan")] * 2, None, None
            else:  # V2 over trees (one per task): t interval with n - 1 df
                d = paired_difference(np.asarray([cos[m][t] for t in both]),
                                      np.asarray([cos[BASELINE][t] for t in both]), level)
                est, ci, se, df = d.estimate, list(d.ci), d.se, d.df
            diffs[m] = {"estimate": est, "ci": ci, "trees": len(both)}
            verdicts.append(verdict(
                f"H = {h}: {m} credit is closer to the exact advantage than {BASELINE}'s "
                "(cosine, X2)", f"paired difference {m} - {BASELINE} of the mean cosine",
                est, ci, 0.0, "above", "not a paper claim (issue 23 item 3)",
                delta=float(config["delta"]), level=level, se=se, df=df).to_json())
        horizons[h] = {"methods": per_method, "differences": diffs}
    results: dict[str, Any] = {"audit": "credit-exact", "config": config,
                               "horizons": horizons, "verdicts": verdicts, "level": level,
                               "seconds": study["seconds"]}
    return write_study_results(out, results, exact_credit_report(results))


def exact_credit_report(results: dict[str, Any]) -> str:
    """The markdown report of ``exact_credit_results``' dict."""
    c = results["config"]
    lines = ["# Exact credit audit: cosine between credit and the exact advantage", "",
             f"Workflow, {c['n_tasks']} tasks per horizon, one `{c['sampler']}` tree of "
             f"n_total = {c['n_total']} per task, the tabular policy mu (beta "
             f"{c['mu_beta']}, noise {c['mu_noise']}); every method credits the same "
             "trees. Cosine (X2) per tree over its action nodes, mean over trees; "
             f"intervals: task bootstrap ({c['n_boot']} resamples), 95% for the means, "
             f"{results['level']:.4f} (V4, t over trees) for the differences to {BASELINE}.",
             ""]
    methods = list(c["methods"])
    rows = [[h, *(fmt_ci(doc["methods"][m]["mean"], doc["methods"][m]["ci"])
                  for m in methods)] for h, doc in results["horizons"].items()]
    lines += [markdown_table(["H", *methods], rows), ""]
    rows = [[h, *(fmt_ci(doc["differences"][m]["estimate"], doc["differences"][m]["ci"])
                  for m in methods if m != BASELINE)]
            for h, doc in results["horizons"].items()]
    lines += [f"Paired differences to {BASELINE}:", "",
              markdown_table(["H", *(f"{m} - {BASELINE}" for m in methods
                                     if m != BASELINE)], rows), "",
              "## Verdicts", "", *verdict_lines(results["verdicts"]), "",
              f"Reproduce: `rtrees study credit-exact --out DIR` with the settings in "
              f"`results.json` ({results['seconds']:.0f} s of data generation here)."]
    return "\n".join(lines) + "\n"


@register_study_report("credit-exact")
def build_exact_credit_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``)."""
    res = exact_credit_results(study_dir, out)
    return ReportOutput("credit-exact", out, "Exact credit audit (cosine by horizon)",
                        verdict_counts(res["verdicts"]), (out / "report.md",))


__all__ = ["BASELINE", "build_exact_credit_report", "exact_credit_report",
           "exact_credit_results", "tree_cosines"]
