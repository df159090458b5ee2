"""Mean@K ranking audit (ELPO §5; METHODS.md §2.4, E10-E11), from the store alone.

At every *prefix* (a branching node: a node with M >= 2 children) each child c
has a method score s(c) (its stored credit, ``credits.value``) and a reference
q(c) = successes / k, the success rate of k rollouts continued from c (the
``mc_references`` table, written by the collection job
``train.sampling.references``). The audit asks how well each method orders the
children the way the reference does.

Statistics, per method, over the prefixes P whose references are not all tied
(E11 skips the others). For a pair (i, j) of children of one prefix let
ds = sign(s_i - s_j) and dq = sign(q_i - q_j). Per prefix g:

* S_g = n_c - n_d = Σ_{i<j} ds·dq,
* A_g = n_0 - n_1 = #{i<j : s_i != s_j}   (pairs untied in the score),
* B_g = n_0 - n_2 = #{i<j : q_i != q_j}   (pairs untied in the reference),

with n_0 = M(M-1)/2 and n_1, n_2 the pairs tied in s and in q. Then

* (E10) pairwise accuracy = Σ_{dq != 0} [1{ds = dq} + ½·1{ds = 0}] / Σ_g B_g
  = ½ + ½ · Σ_g S_g / Σ_g B_g      (pooled over all pairs of all prefixes);
* (E11) Kendall τ_b of prefix g = S_g / sqrt(A_g · B_g) (scipy's variant b);
  macro τ_b = mean over P of the prefix values;
  pooled τ_b = Σ_g S_g / sqrt(Σ_g A_g · Σ_g B_g) (one τ_b over all within-prefix
  pairs; pairs across prefixes are never compared).

Choices not fixed by the sources [R]:

* a prefix whose scores all tie (A_g = 0, τ_b undefined; scipy gives NaN) counts
  as τ_b = 0 in the macro average: a method that cannot order the children
  earns no correlation, just as tied scores earn ½ in E10 (their number is
  reported as ``n_prefixes_score_tied``);
* only *complete* prefixes are audited: every child has a reference at the
  requested k and a score from every method. A prefix with some children
  lacking a reference is left out and counted (``n_prefixes_missing_reference``);
  a method lacking credit for an audited tree is an error that names the
  ``rtrees credit`` command to run;
* several ``mc_references`` rows for one child (same k and policy version, e.g.
  two runs) are pooled: q = Σ successes / Σ k;
* references are those of the tree's own policy version by default
  (``reference_policy=None``), or of a named policy version;
* several parameter hashes of one method: ``method`` picks the hash whose
  credits were written last (latest ``created_at``); ``method@HASH`` (a unique
  prefix of the hash is enough) names one;
* confidence intervals: percentile bootstrap over trees (the resampling unit,
  since the prefixes and pairs of one tree are dependent), ``n_boot`` resamples,
  the same resamples for every method, so the paired difference between two
  methods gets its interval from the per-resample differences.


Loading (the store side: which rows, joined how) is ``analysis.ranking_data``; this module
is the audit: what to audit (``RankingConfig``), the statistics per method and per group
of trees, and the result (``RankingResult``). Names a user of the audit needs are
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from analysis.ranking_data import (
    RANKING_TABLES,
    MethodRef,
    MissingCredit,
    RankingData,
    RankingError,
    TableSource,
    credit_error,
    credit_hashes,
    load_ranking_data,
    missing_credit,
    resolve_methods,
)
from analysis.stats import (
    Estimate,
    MethodStatistics,
    PairedDifference,
    PrefixStats,
    RankingStatistics,
    group_index,
    prefix_stats,
    ranking_statistics,
)

if TYPE_CHECKING:
    import duckdb

    from rollout_store.store import Store, StoreVersion

SplitBy = Literal["sampler", "run"]
SPLIT_COLUMNS: dict[str, str] = {"sampler": "sampler", "run": "run_id"}  # by -> trees column


@dataclass(frozen=True)
class RankingConfig:
    """What to audit.

    ``methods``: ``method`` or ``method@HASH`` names (see the module docstring).
    ``k``: rollouts behind each reference (``mc_references.k``).
    ``reference_policy``: None for references from each tree's own policy version,
    else the policy version the references were sampled with.
    ``n_boot`` bootstrap resamples of trees (0: no intervals), ``level`` their
    coverage, ``seed`` their random generator.
    """

    methods: tuple[str, ...]
    k: int = 32
    reference_policy: str | None = None
    n_boot: int = 2000
    level: float = 0.95
    seed: int = 0
    by: SplitBy | None = None
    """Also audit each group of trees separately: ``sampler`` (``trees.sampler``, i.e. the
    tree construction) or ``run`` (``trees.run_id``); None: the pooled audit only."""

    def __post_init__(self) -> None:
        if self.by is not None and self.by not in SPLIT_COLUMNS:
            raise ValueError(f"by must be one of {sorted(SPLIT_COLUMNS)}, got {self.by!r}")
        if not self.methods:
            raise ValueError("methods must name at least one method")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.n_boot < 0:
            raise ValueError(f"n_boot must be >= 0, got {self.n_boot}")
        if not 0.0 < self.level < 1.0:
            raise ValueError(f"level must lie in (0, 1), got {self.level}")


@dataclass(frozen=True)
class RankingResult:
    """The audit of one store: configuration, provenance, data and statistics."""

    config: RankingConfig
    store: str
    store_version: dict[str, int]
    methods: list[MethodRef]
    data: RankingData
    stats: RankingStatistics
    dropped_methods: dict[str, str] = field(default_factory=dict)
    groups: dict[str, RankingStatistics] = field(default_factory=dict)
    """With ``config.by``: the audit of each group's trees (same bootstrap settings)."""

    def to_json(self) -> dict[str, Any]:
        """The ``results.json`` document (keys documented in ``write_ranking_report``)."""
        s = self.stats
        refs = {m.label: m for m in self.methods}
        methods = {}
        for m in s.methods:
            methods[m.label] = {
                "method": refs[m.label].method,
                "method_params_hash": refs[m.label].params_hash,
                "method_params": refs[m.label].params_json,
                "pairwise_accuracy": m.pairwise_accuracy.value,
                "kendall_tau_b": {"macro": m.tau_b_macro.value, "pooled": m.tau_b_pooled.value},
                "n_prefixes": m.n_prefixes,
                "n_pairs": m.n_pairs,
                "n_prefixes_score_tied": m.n_prefixes_score_tied,
                "ci": {"pairwise_accuracy": list(m.pairwise_accuracy.ci),
                       "kendall_tau_b": {"macro": list(m.tau_b_macro.ci),
                                         "pooled": list(m.tau_b_pooled.ci)}},
            }
        diffs = {
            f"{d.a}-{d.b}": {
                "a": d.a, "b": d.b,
                "pairwise_accuracy": d.pairwise_accuracy.to_json(),
                "kendall_tau_b": {"macro": d.tau_b_macro.to_json(),
                                  "pooled": d.tau_b_pooled.to_json()},
            }
            for d in s.differences
        }
        return {
            "audit": "ranking",
            "store": self.store,
            "store_version": self.store_version,
            "k": self.config.k,
            "reference_policy": self.config.reference_policy,
            "bootstrap": {"n_boot": s.n_boot, "level": s.level, "seed": s.seed,
                          "unit": "tree", "interval": "percentile"},
            "coverage": {
                "n_trees": s.n_trees,
                "n_prefixes_branching": self.data.n_prefixes_branching,
                "n_prefixes_audited": s.n_prefixes,
                "n_prefixes_reference_tied": s.n_prefixes_reference_tied,
                "n_prefixes_missing_reference": self.data.n_prefixes_missing_reference,
                "n_children": s.n_children,
                "n_pairs": s.n_pairs,
                "n_pairs_total": s.n_pairs_total,
            },
            "methods": methods,
            "paired_differences": diffs,
            "dropped_methods": self.dropped_methods,
            **({"by": self.config.by, "groups": {
                name: _stats_json(g) for name, g in self.groups.items()}}
               if self.config.by else {}),
        }


def _stats_json(s: RankingStatistics) -> dict[str, Any]:
    """One group's statistics (``RankingResult.groups``) as JSON."""
    return {
        "n_trees": s.n_trees, "n_prefixes": s.n_prefixes, "n_pairs": s.n_pairs,
        "methods": {m.label: {"pairwise_accuracy": m.pairwise_accuracy.to_json(),
                              "kendall_tau_b": {"macro": m.tau_b_macro.to_json(),
                                                "pooled": m.tau_b_pooled.to_json()},
                              "n_prefixes": m.n_prefixes, "n_pairs": m.n_pairs}
                    for m in s.methods},
        "paired_differences": {f"{d.a}-{d.b}": {
            "pairwise_accuracy": d.pairwise_accuracy.to_json(),
            "kendall_tau_b": {"macro": d.tau_b_macro.to_json(),
                              "pooled": d.tau_b_pooled.to_json()}} for d in s.differences},
    }


def split_statistics(source: duckdb.DuckDBPyConnection | TableSource, data: RankingData,
                     by: SplitBy, n_boot: int, level: float, seed: int
                     ) -> dict[str, RankingStatistics]:
    """E10-E11 of each group of trees (``trees.sampler`` or ``trees.run_id``), in group
    name order; groups without an audited prefix are left out."""
    column = SPLIT_COLUMNS[by]
    rows = TableSource.of(source).table("trees", ("tree_id", column))
    value = {t: str(v) for t, v in zip(rows.column("tree_id").to_pylist(),
                                       rows.column(column).to_pylist(), strict=True)}
    names = np.array([value.get(t, "") for t in data.tree_ids], dtype=object)
    out: dict[str, RankingStatistics] = {}
    for name in sorted(set(names.tolist())):
        part = data.subset(names == name)
        if len(part.tree):
            out[name] = part.statistics(n_boot, level, seed)
    return out


def ranking_audit(store: Store | str | Path, config: RankingConfig, *,
                  version: StoreVersion | int | None = None,
                  on_missing_credit: MissingCredit = "error") -> RankingResult:
    """Run the ranking audit on the store's credits and references (reads only the store).

    Raises ``RankingError`` when a method has no credits, or (``on_missing_credit=
    "error"``) lacks credit for an audited tree, or no prefix has references at
    ``config.k``; the message names the command that fixes it.
    """
    from rollout_store.store import Store

    # a path: open (and check) just the tables the audit reads
    s = store if isinstance(store, Store) else Store(store, tables=RANKING_TABLES)
    path = str(s.path)
    with s.pinned_reads():  # each table's log read once
        pinned = s.resolve(version, RANKING_TABLES)
        source = TableSource.pinned(s, pinned)
        methods = resolve_methods(source, config.methods, path)
        data, dropped = load_ranking_data(source, methods, config.k, config.reference_policy,
                                          store=path, on_missing_credit=on_missing_credit)
    if len(data.q) == 0:
        who = ("each tree's own policy" if config.reference_policy is None
               else f"policy version {config.reference_policy!r}")
        raise RankingError(
            f"no branching node of {path} has references at k={config.k} from {who} for "
            f"all its children ({data.n_prefixes_branching} branching nodes); collect them "
            f"with: rtrees audit ranking --store {path} --k {config.k} ... (it runs the "
            "reference job), or train.sampling.references.collect_references")
    if not data.labels:
        raise RankingError("every method lacks credit for some audited tree: "
                           + "; ".join(dropped.values()))
    stats = data.statistics(config.n_boot, config.level, config.seed)
    kept = [m for m in methods if m.label in data.labels]
    with s.pinned_reads():
        groups = (split_statistics(source, data, config.by, config.n_boot, config.level,
                                   config.seed) if config.by else {})
    return RankingResult(config, path, dict(pinned.versions), kept, data, stats, dropped,
                         groups)



__all__ = ["RANKING_TABLES", "Estimate", "MethodRef", "MethodStatistics", "PairedDifference",
           "PrefixStats", "RankingConfig", "RankingData", "RankingError", "RankingResult",
           "RankingStatistics", "TableSource", "credit_error", "credit_hashes", "group_index",
           "load_ranking_data", "missing_credit", "prefix_stats", "ranking_audit",
           "ranking_statistics", "resolve_methods", "split_statistics"]
