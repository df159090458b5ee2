"""The credit audit on third-party environments (``rtrees study third-party-audit``,
issue 47 item 4): the report.

Reads only the study's files (``train.studies.third_party`` and ``train.jobs`` wrote them):
``study.json`` and the ranking audit's ``audit/results.json`` (docs/METHODS.md E10-E11,
every interval from one tree bootstrap shared by the estimators, at the study's family
level). Per estimator m: its pairwise accuracy PA_m (the share of child pairs of a
branching node that its scores order as the Mean@k references do) and Kendall tau-b
(macro), each with its interval; per estimator other than the baseline b, the paired
difference

    d_m = PA_m - PA_b                                                   (V2, over trees)

with its interval, judged by ``analysis.verdicts.verdict`` ("d_m > 0", the config's
pre-registered ``delta``, V1) at the Bonferroni level of the study's claims (V4:
``1 - 0.10 / K`` for K estimators besides the baseline): superior, inferior, equivalent
within delta, or underpowered with the minimum detectable effect beside it. A claim whose
estimators ranked fewer than ``MIN_RANKED_PREFIXES`` prefixes is underpowered, its
interval printed in the note but not judged.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

from analysis.report import (
    ReportOutput,
    fmt_ci,
    markdown_table,
    open_study,
    register_study_report,
    study_path,
    write_study_results,
)
from analysis.verdicts import verdict, verdict_counts, verdict_lines

KIND = "third-party-audit"
MIN_RANKED_PREFIXES = 5
"""Fewest prefixes with references not all tied (``n_prefixes`` of both estimators) for a
claim to be judged [R]; below it the claim is underpowered whatever its interval. Added
after the first reasoning-gym run, where 7 child pairs at one prefix of one tree gave every
estimator a zero-width tree-bootstrap interval [1.000, 1.000], which the rule V1 would call
"equivalent" to grpo on the evidence of one prefix."""


def _difference(diffs: dict[str, Any], a: str, b: str) -> tuple[float, list[float]] | None:
    """(estimate, ci) of PA_a - PA_b from the audit's paired differences (stored once per
    pair, in either order; NaN where the audit had no pair to rank)."""
    sign, key = (1.0, f"{a}-{b}") if f"{a}-{b}" in diffs else (-1.0, f"{b}-{a}")
    if key not in diffs:
        return None
    d = diffs[key]["pairwise_accuracy"]
    lo, hi = (math.nan if x is None else float(x) for x in d["ci"])
    est = math.nan if d["estimate"] is None else sign * float(d["estimate"])
    return est, ([lo, hi] if sign > 0 else [-hi, -lo])


def third_party_results(study_dir: str | Path, out_dir: str | Path | None = None
                        ) -> dict[str, Any]:
    """``results.json`` and ``report.md`` of a study directory (module docstring);
    returns the results dict."""
    src, out, study = open_study(study_dir, out_dir, KIND)
    config = study["config"]
    audit = json.loads((study_path(src, study["audit"], "audit") / "results.json")
                       .read_text())
    base = str(config["baseline"])
    level = float(study["level"])
    rows: dict[str, Any] = {}
    verdicts: list[dict[str, Any]] = []
    for label, m in audit["methods"].items():
        rows[label] = {"pairwise_accuracy": m["pairwise_accuracy"],
                       "pairwise_accuracy_ci": m["ci"]["pairwise_accuracy"],
                       "tau_b_macro": m["kendall_tau_b"]["macro"],
                       "tau_b_macro_ci": m["ci"]["kendall_tau_b"]["macro"],
                       "n_prefixes": m["n_prefixes"], "n_pairs": m["n_pairs"]}
    labels = {label.split("@")[0]: label for label in rows}
    for method in study["methods"]:
        if method == base or method not in labels or base not in labels:
            continue
        found = _difference(audit["paired_differences"], labels[method], labels[base])
        if found is None:
            continue
        estimate, ci = found  # NaN where no child pair had distinct references
        rows[labels[method]]["difference"] = {"estimate": estimate, "ci": ci}
        ranked = min(rows[labels[method]]["n_prefixes"], rows[labels[base]]["n_prefixes"])
        note = ""
        if ranked < MIN_RANKED_PREFIXES:  # judged as no data: an interval, not a verdict
            note = (f"only {ranked} ranked prefix(es): the interval {fmt_ci(estimate, ci)} is "
                    "not judged")
            ci = [math.nan, math.nan]
        v = verdict(f"{study['config']['env']}: {method} ranks children better than {base} "
                    f"(pairwise accuracy vs Mean@{config['k']})",
                    f"paired difference {method} - {base} of pairwise accuracy",
                    estimate, ci, 0.0, "above", "none (no paper runs this audit)",
                    note=note, delta=float(config["delta"]), level=level).to_json()
        rows[labels[method]]["verdict"] = v["verdict"]
        verdicts.append(v)
    results: dict[str, Any] = {
        "audit": KIND, "config": config, "env_class": study["env_class"],
        "exact_values": study["exact_values"], "level": level,
        "coverage": audit["coverage"], "methods": rows, "dropped": study["dropped"],
        "verdicts": verdicts, "seconds": study["seconds"]}
    return write_study_results(out, results, third_party_report(results))


def command(config: dict[str, Any]) -> str:
    """The ``rtrees study`` line that reproduces a study of ``config``."""
    defaults = {"n_total": 8, "k": 32, "seed": 0, "baseline": "grpo", "delta": 0.05,
                "max_new_tokens": 64, "n_boot": 2000}
    params = [f"--param env={config['env']}", f"--param policy={config['policy']}",
              f"--param n_tasks={config['n_tasks']}",
              f"--param methods={','.join(config['methods'])}"]
    params += [f"--param {k}={config[k]}" for k, v in defaults.items() if config.get(k) != v]
    if config.get("task_params"):  # a JSON object, quoted for a POSIX shell
        text = json.dumps(config["task_params"], sort_keys=True)
        params.append("--param " + shlex.quote(f"task_params={text}"))
    return f"rtrees study {KIND} --out DIR " + " ".join(params)


def third_party_report(results: dict[str, Any]) -> str:
    """The markdown report of ``third_party_results``' dict."""
    c, cov = results["config"], results["coverage"]
    base = c["baseline"]
    lines = [f"# Credit audit on {c['env']} ({results['env_class']})", "",
             f"Policy `{c['policy']}`; {c['n_tasks']} tasks, one BEL tree each with n_total "
             f"{c['n_total']}; Mean@{c['k']} references of every child of a branching node "
             f"({cov['n_trees']} trees, {cov['n_prefixes_audited']} prefixes audited, "
             f"{cov['n_pairs']} child pairs). Intervals: {results['level']:.1%} percentile, "
             f"tree bootstrap shared by every estimator ({c['n_boot']} resamples); "
             f"delta {c['delta']}.", ""]
    rows = []
    for label, r in results["methods"].items():
        d = r.get("difference")
        rows.append([label, fmt_ci(r["pairwise_accuracy"], r["pairwise_accuracy_ci"]),
                     fmt_ci(r["tau_b_macro"], r["tau_b_macro_ci"]),
                     fmt_ci(d["estimate"], d["ci"]) if d else "-",
                     r.get("verdict", "-"), r["n_pairs"]])
    lines += [markdown_table(["estimator", "pairwise acc.", "tau_b macro",
                              f"- {base} (pairwise acc.)", "verdict", "pairs"], rows), ""]
    if results["dropped"]:
        lines += ["Not applicable here:", ""]
        lines += [f"- {m}: {why}" for m, why in results["dropped"].items()]
        lines.append("")
    if not results["exact_values"]:
        lines += ["No credit-exact cosine: the environment declares no exact values "
                  "(`Environment.exact_values`).", ""]
    lines += ["## Verdicts", "", *verdict_lines(results["verdicts"]), "",
              f"Reproduce: `{command(c)}`."]
    return "\n".join(lines) + "\n"


@register_study_report(KIND)
def build_third_party_report(study_dir: Path, out: Path) -> ReportOutput:
    """The registered study builder (``analysis.report.build_study_report``)."""
    res = third_party_results(study_dir, out)
    return ReportOutput(KIND, out, f"Credit audit on {res['config']['env']}",
                        verdict_counts(res["verdicts"]), (out / "report.md",))


__all__ = ["KIND", "MIN_RANKED_PREFIXES", "build_third_party_report", "command",
           "third_party_report", "third_party_results"]
