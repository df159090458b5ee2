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

Computation: one DuckDB query over the store's views gives one row per child of
every branching node (reference and every method's score); pairs are formed
with numpy index arithmetic within each prefix and reduced with ``bincount``
(no Python loop per prefix); each bootstrap resample is a vector of tree
counts, so all resamples are one matrix product with per-tree sums.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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

    from rollout_store.store import Store, StoreVersion

MissingCredit = Literal["error", "drop"]
_PAIR_CHUNK = 4_000_000  # pairs formed at a time (bounds memory on huge prefixes)
_BOOT_CHUNK = 4_000_000  # resample-by-tree matrix entries held at a time


class RankingError(RuntimeError):
    """The store lacks what the audit needs (credits, references); the message says what
    to run."""


# ===== statistics (pure numpy) ===============================================================


def _sign_diff(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sign(x[a] - x[b]) as int8, exact (compares, never subtracts)."""
    xa, xb = x[a], x[b]
    return (xa > xb).astype(np.int8) - (xa < xb).astype(np.int8)


def group_index(keys: Sequence[np.ndarray]) -> np.ndarray:
    """Index 0..G-1 of consecutive runs of equal key tuples (rows sorted by the keys)."""
    n = len(keys[0])
    if n == 0:
        return np.zeros(0, np.int64)
    new = np.zeros(n, bool)
    new[0] = True
    for key in keys:
        new[1:] |= key[1:] != key[:-1]
    return np.cumsum(new) - 1


@dataclass(frozen=True)
class PrefixStats:
    """Per-prefix sufficient statistics of E10-E11 (shapes: G prefixes, K methods).

    ``tree[g]`` is the tree index of prefix g; ``n_children`` M; ``concordance``
    S = n_c - n_d; ``untied_score`` A = n_0 - n_1; ``untied_reference`` B = n_0 - n_2.
    """

    tree: np.ndarray  # (G,) int64
    n_children: np.ndarray  # (G,) int64
    concordance: np.ndarray  # (G, K) float64 (exact integers)
    untied_score: np.ndarray  # (G, K) float64 (exact integers)
    untied_reference: np.ndarray  # (G,) float64 (exact integers)

    @property
    def n_pairs(self) -> np.ndarray:
        return self.n_children * (self.n_children - 1) // 2

    @property
    def included(self) -> np.ndarray:
        """Prefixes E11 keeps: references not all tied (B > 0)."""
        return self.untied_reference > 0

    def tau_b(self) -> np.ndarray:
        """(G, K) Kendall τ_b per prefix (E11); NaN where the references all tie, 0 where
        only the scores all tie [R]."""
        denom = np.sqrt(self.untied_score * self.untied_reference[:, None])
        with np.errstate(invalid="ignore", divide="ignore"):
            tau = np.where(denom > 0, self.concordance / np.where(denom > 0, denom, 1.0), 0.0)
        tau[~self.included] = np.nan
        return tau


def prefix_stats(tree: np.ndarray, group: np.ndarray, q: np.ndarray, scores: np.ndarray,
                 pair_chunk: int = _PAIR_CHUNK) -> PrefixStats:
    """E10-E11 sufficient statistics of every prefix.

    Inputs, one entry per child, sorted so that each prefix's children are
    contiguous: ``tree`` (N,) tree index, ``group`` (N,) prefix index 0..G-1
    (non-decreasing), ``q`` (N,) reference, ``scores`` (N, K) one column per
    method. The pairs i < j of each prefix are enumerated by index arithmetic:
    child c (position p in a prefix of size M) pairs with the M-1-p children after
    it, so ``a = repeat(c, M-1-p)`` and ``b = a + 1 + offset``; pair counts are
    summed per prefix with ``bincount``. O(Σ M²) time; pairs are formed at most
    ``pair_chunk`` at a time.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim == 1:
        scores = scores[:, None]
    n, k = scores.shape
    group = np.asarray(group, dtype=np.int64)
    if n and np.any(np.diff(group) < 0):
        raise ValueError("children must be sorted by prefix (group must be non-decreasing)")
    q = np.asarray(q, dtype=np.float64)
    sizes = np.bincount(group) if n else np.zeros(0, np.int64)
    n_groups = len(sizes)
    offsets = np.cumsum(sizes) - sizes
    later = (sizes[group] - 1 - (np.arange(n) - offsets[group])).astype(np.int64)  # (N,)
    conc = np.zeros((n_groups, k))
    untied_s = np.zeros((n_groups, k))
    untied_q = np.zeros(n_groups)
    cum = np.cumsum(later)
    bounds = np.searchsorted(cum, np.arange(pair_chunk, int(cum[-1]) if n else 0, pair_chunk))
    starts = np.concatenate([[0], bounds + 1]) if n else np.zeros(0, np.int64)
    stops = np.concatenate([bounds + 1, [n]]) if n else np.zeros(0, np.int64)
    for c0, c1 in zip(starts.tolist(), stops.tolist(), strict=True):  # chunks, not prefixes
        reps = later[c0:c1]
        n_pairs = int(reps.sum())
        if n_pairs == 0:
            continue
        a = np.repeat(np.arange(c0, c1), reps)  # (P,) first child of each pair
        first = np.cumsum(reps) - reps
        b = a + 1 + (np.arange(n_pairs) - np.repeat(first, reps))  # (P,) a later sibling
        g = group[a]
        dq = _sign_diff(q, a, b)
        untied_q += np.bincount(g, weights=dq != 0, minlength=n_groups)
        for m in range(k):  # methods, not prefixes
            ds = _sign_diff(scores[:, m], a, b)
            conc[:, m] += np.bincount(g, weights=ds * dq, minlength=n_groups)
            untied_s[:, m] += np.bincount(g, weights=ds != 0, minlength=n_groups)
    first_child = offsets if n else np.zeros(0, np.int64)
    g_tree = np.asarray(tree, dtype=np.int64)[first_child] if n else np.zeros(0, np.int64)
    return PrefixStats(g_tree, sizes.astype(np.int64), conc, untied_s, untied_q)


@dataclass(frozen=True)
class Estimate:
    """A statistic and its percentile-bootstrap interval (NaN when undefined)."""

    value: float
    ci: tuple[float, float]

    def to_json(self) -> dict[str, Any]:
        return {"estimate": self.value, "ci": list(self.ci)}


@dataclass(frozen=True)
class MethodStatistics:
    """E10-E11 for one method."""

    label: str
    pairwise_accuracy: Estimate
    tau_b_macro: Estimate
    tau_b_pooled: Estimate
    n_prefixes: int  # prefixes with references not all tied (E11's)
    n_pairs: int  # pairs untied in the reference (E10's denominator)
    n_prefixes_score_tied: int  # of those, prefixes where every score ties (τ_b := 0)


@dataclass(frozen=True)
class PairedDifference:
    """Method ``a`` minus method ``b`` on the same prefixes and bootstrap resamples."""

    a: str
    b: str
    pairwise_accuracy: Estimate
    tau_b_macro: Estimate
    tau_b_pooled: Estimate


@dataclass(frozen=True)
class RankingStatistics:
    """Everything the audit reports, for methods in input order."""

    methods: list[MethodStatistics]
    differences: list[PairedDifference]
    n_trees: int  # trees with at least one audited prefix (the bootstrap units)
    n_prefixes: int  # audited prefixes (all children referenced and scored)
    n_prefixes_reference_tied: int  # skipped by E11: every reference ties
    n_children: int
    n_pairs: int  # pairs untied in the reference
    n_pairs_total: int  # all within-prefix pairs, ties included
    n_boot: int
    level: float
    seed: int
    tau_b_prefix: np.ndarray = field(repr=False)  # (G, K), NaN where skipped

    def method(self, label: str) -> MethodStatistics:
        for m in self.methods:
            if m.label == label:
                return m
        raise KeyError(label)


def _point(conc: np.ndarray, untied_s: np.ndarray, untied_q: np.ndarray,
           tau_sum: np.ndarray, n_inc: np.ndarray) -> tuple[np.ndarray, ...]:
    """(pairwise accuracy, macro τ_b, pooled τ_b) from sums over prefixes; the leading
    axes are resamples (or none), the last is methods. ``untied_q`` and ``n_inc`` lack the
    method axis."""
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = 0.5 + 0.5 * conc / untied_q[..., None]
        macro = tau_sum / n_inc[..., None]
        denom = np.sqrt(untied_s * untied_q[..., None])
        pooled = np.where(denom > 0, conc / np.where(denom > 0, denom, 1.0), 0.0)
    pooled = np.where(untied_q[..., None] > 0, pooled, np.nan)
    return acc, macro, pooled


def _tree_counts(rng: np.random.Generator, n_boot: int, n_trees: int) -> np.ndarray:
    """(n_boot, n_trees) multiplicity of each tree in each resample (trees drawn with
    replacement, n_trees per resample)."""
    draws = rng.integers(0, n_trees, size=(n_boot, n_trees))
    flat = draws + (np.arange(n_boot) * n_trees)[:, None]
    return np.bincount(flat.ravel(), minlength=n_boot * n_trees).reshape(n_boot, n_trees)


def ranking_statistics(tree: np.ndarray, group: np.ndarray, q: np.ndarray, scores: np.ndarray,
                       labels: Sequence[str], n_boot: int = 2000, level: float = 0.95,
                       seed: int = 0) -> RankingStatistics:
    """E10-E11 per method with tree-bootstrap intervals and paired differences.

    Inputs as in ``prefix_stats`` (``tree`` indexes trees 0..T-1; ``scores`` has one
    column per label). ``n_boot = 0`` skips the bootstrap (intervals NaN).
    """
    scores = np.asarray(scores, dtype=np.float64)
    scores = scores[:, None] if scores.ndim == 1 else scores
    if scores.shape[1] != len(labels):
        raise ValueError(f"{scores.shape[1]} score columns for {len(labels)} labels")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    ps = prefix_stats(tree, group, q, scores)
    inc = ps.included
    tau = ps.tau_b()
    tau_inc = np.where(inc[:, None], tau, 0.0)
    # Per-tree sums (T, ...) over the included prefixes: the bootstrap's sufficient stats.
    t_index, n_trees = _dense(ps.tree)
    per_tree = [np.stack([np.bincount(t_index, w * inc, minlength=n_trees)
                          for w in col.T], axis=1)
                for col in (ps.concordance, ps.untied_score, tau_inc)]
    ur_t = np.bincount(t_index, ps.untied_reference * inc, minlength=n_trees)
    ninc_t = np.bincount(t_index, inc.astype(float), minlength=n_trees)
    conc_t, us_t, tau_t = per_tree
    point = _point(conc_t.sum(0), us_t.sum(0), np.asarray(ur_t.sum()), tau_t.sum(0),
                   np.asarray(ninc_t.sum()))
    k = len(labels)
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    alpha = (1.0 - level) / 2.0
    ci = np.full((3, 2, k), np.nan)
    ci_diff = np.full((3, 2, len(pairs)), np.nan)
    if n_boot > 0 and n_trees > 0:
        rng = np.random.default_rng(seed)
        boot = np.empty((3, n_boot, k))
        rows = max(1, _BOOT_CHUNK // n_trees)
        for r0 in range(0, n_boot, rows):  # chunks of resamples
            r1 = min(n_boot, r0 + rows)
            w = _tree_counts(rng, r1 - r0, n_trees).astype(np.float64)  # (R, T)
            stats = _point(w @ conc_t, w @ us_t, w @ ur_t, w @ tau_t, w @ ninc_t)
            for s in range(3):
                boot[s, r0:r1] = stats[s]
        with warnings.catch_warnings():  # all-NaN slices: no resample defines the statistic
            warnings.simplefilter("ignore", RuntimeWarning)
            ci = np.nanquantile(boot, [alpha, 1.0 - alpha], axis=1)  # (2, 3, K)
            ci = np.moveaxis(ci, 0, 1)  # (3, 2, K)
            if pairs:
                ia = [i for i, _ in pairs]
                ib = [j for _, j in pairs]
                diff = boot[:, :, ia] - boot[:, :, ib]
                ci_diff = np.moveaxis(np.nanquantile(diff, [alpha, 1.0 - alpha], axis=1), 0, 1)

    def est(s: int, m: int) -> Estimate:
        return Estimate(float(point[s][m]), (float(ci[s, 0, m]), float(ci[s, 1, m])))

    methods = [
        MethodStatistics(label, est(0, m), est(1, m), est(2, m), int(inc.sum()),
                         int(ps.untied_reference[inc].sum()),
                         int(np.sum(inc & (ps.untied_score[:, m] == 0))))
        for m, label in enumerate(labels)
    ]

    def dest(s: int, p: int) -> Estimate:
        i, j = pairs[p]
        return Estimate(float(point[s][i] - point[s][j]),
                        (float(ci_diff[s, 0, p]), float(ci_diff[s, 1, p])))

    differences = [PairedDifference(labels[i], labels[j], dest(0, p), dest(1, p), dest(2, p))
                   for p, (i, j) in enumerate(pairs)]
    return RankingStatistics(
        methods=methods, differences=differences, n_trees=n_trees,
        n_prefixes=len(ps.n_children), n_prefixes_reference_tied=int((~inc).sum()),
        n_children=len(q), n_pairs=int(ps.untied_reference.sum()),
        n_pairs_total=int(ps.n_pairs.sum()), n_boot=n_boot, level=level, seed=seed,
        tau_b_prefix=tau)


def _dense(values: np.ndarray) -> tuple[np.ndarray, int]:
    uniq, index = np.unique(values, return_inverse=True)
    return index.astype(np.int64), len(uniq)


# ===== the store side (SQL) ==================================================================


@dataclass(frozen=True)
class MethodRef:
    """One method's credits to audit: its name, parameter hash, and the report label."""

    method: str
    params_hash: str
    params_json: str | None
    label: str

    def credit_command(self, store: str) -> str:
        """The ``rtrees credit`` command that computes this credit."""
        cmd = f"rtrees credit --store {store} --method {self.method}"
        try:
            params = json.loads(self.params_json) if self.params_json else {}
        except json.JSONDecodeError:
            params = {}
        if isinstance(params, dict):
            cmd += "".join(f" --param {k}={v}" for k, v in params.items())
        return cmd


def _credit_hashes(con: duckdb.DuckDBPyConnection) -> dict[str, list[tuple[str, str | None]]]:
    """Every method's parameter hashes with their params JSON, most recent first."""
    rows = con.sql("""
        SELECT method, method_params_hash, any_value(method_params), max(created_at) AS last
        FROM credits GROUP BY method, method_params_hash
        ORDER BY method, last DESC, method_params_hash""").fetchall()
    out: dict[str, list[tuple[str, str | None]]] = {}
    for method, h, params, _ in rows:
        out.setdefault(method, []).append((h, params))
    return out


def resolve_methods(con: duckdb.DuckDBPyConnection, names: Sequence[str],
                    store: str = "STORE") -> list[MethodRef]:
    """``method`` or ``method@HASH`` names to the credits they denote.

    ``method`` alone takes the parameter hash written last; ``method@HASH`` takes
    the one hash starting with HASH. Raises ``RankingError`` naming the command to
    run when a method has no credits.
    """
    if not names:
        raise RankingError("no methods to audit")
    available = _credit_hashes(con)
    refs = []
    for name in names:
        method, _, prefix = name.strip().partition("@")
        hashes = available.get(method, [])
        if not hashes:
            raise RankingError(
                f"method {method!r} has no credits in {store}; compute them with: "
                f"rtrees credit --store {store} --method {method}"
                + (f" (methods with credits: {', '.join(sorted(available))})"
                   if available else ""))
        if prefix:
            hits = [(h, p) for h, p in hashes if h.startswith(prefix)]
            if len(hits) != 1:
                raise RankingError(
                    f"{name!r}: {'no' if not hits else 'several'} {method} parameter hashes "
                    f"start with {prefix!r}; stored hashes: {', '.join(h for h, _ in hashes)}")
            h, params = hits[0]
        else:
            h, params = hashes[0]
        refs.append(MethodRef(method, h, params, name.strip()))
    labels = [r.label for r in refs]
    if len(set(labels)) != len(labels):
        raise RankingError(f"methods named twice: {labels}")
    return refs


_BRANCHING_SQL = """
    kids AS (SELECT tree_id, parent_id, node_id FROM nodes WHERE parent_id IS NOT NULL),
    prefixes AS (SELECT tree_id, parent_id FROM kids GROUP BY tree_id, parent_id
                 HAVING count(*) >= 2)"""


def _credit_filter(methods: Sequence[MethodRef], params: dict[str, object]) -> str:
    terms = []
    for i, m in enumerate(methods):
        params[f"m{i}"], params[f"h{i}"] = m.method, m.params_hash
        terms.append(f"(method = $m{i} AND method_params_hash = $h{i})")
    return " OR ".join(terms)


def missing_credit(con: duckdb.DuckDBPyConnection, methods: Sequence[MethodRef]
                   ) -> dict[str, tuple[int, int, str | None]]:
    """Per method label: (trees with a branching node lacking its credit, such trees in
    all, an example tree id). Used to fail before an expensive reference job."""
    params: dict[str, object] = {}
    where = _credit_filter(methods, params)
    rows = con.execute(f"""
        WITH {_BRANCHING_SQL},
        audited AS (SELECT DISTINCT tree_id FROM prefixes),
        have AS (SELECT DISTINCT method, method_params_hash, tree_id FROM credits
                 WHERE {where})
        SELECT h.method, h.method_params_hash, count(DISTINCT h.tree_id)
        FROM have h SEMI JOIN audited a USING (tree_id) GROUP BY ALL""", params).fetchall()
    n_audited = con.sql(f"WITH {_BRANCHING_SQL} SELECT count(DISTINCT tree_id) "
                        "FROM prefixes").fetchall()[0][0]
    have = {(m, h): n for m, h, n in rows}
    out = {}
    for m in methods:
        n_missing = int(n_audited) - int(have.get((m.method, m.params_hash), 0))
        example = None
        if n_missing:
            found = con.execute(f"""
                WITH {_BRANCHING_SQL}
                SELECT min(tree_id) FROM (SELECT DISTINCT tree_id FROM prefixes) a
                WHERE tree_id NOT IN (SELECT tree_id FROM credits WHERE method = $m
                                      AND method_params_hash = $h)""",
                {"m": m.method, "h": m.params_hash}).fetchall()
            example = found[0][0]
        out[m.label] = (n_missing, int(n_audited), example)
    return out


def credit_error(ref: MethodRef, n_missing: int, n_total: int, example: str | None,
                 store: str) -> RankingError:
    return RankingError(
        f"method {ref.label!r} ({ref.method}, params {ref.params_hash}) has no credit for "
        f"{n_missing} of {n_total} audited trees (e.g. {example!r}); compute it with: "
        f"{ref.credit_command(store)}")


@dataclass(frozen=True)
class RankingData:
    """One row per child of every audited prefix, sorted by (tree, prefix, child)."""

    labels: tuple[str, ...]
    tree_ids: list[str]  # tree index -> tree_id
    tree: np.ndarray  # (N,) int64 tree index
    group: np.ndarray  # (N,) int64 prefix index (non-decreasing)
    parent_id: np.ndarray  # (N,) int64
    node_id: np.ndarray  # (N,) int64
    successes: np.ndarray  # (N,) int64
    k_total: np.ndarray  # (N,) int64 rollouts behind the reference (k, or a multiple)
    scores: np.ndarray  # (N, K) float64
    n_prefixes_branching: int = 0  # every branching node of the store
    n_prefixes_missing_reference: int = 0  # some child lacks a reference at this k

    @property
    def q(self) -> np.ndarray:
        return self.successes / self.k_total

    def statistics(self, n_boot: int = 2000, level: float = 0.95,
                   seed: int = 0) -> RankingStatistics:
        return ranking_statistics(self.tree, self.group, self.q, self.scores, self.labels,
                                  n_boot, level, seed)

    @staticmethod
    def from_table(table: pa.Table, labels: Sequence[str]) -> RankingData:
        """From columns tree_id, parent_id, node_id, successes, k and one ``s{i}`` score column
        per label (any row order; sorted here unless already sorted by tree and prefix)."""
        enc = pc.dictionary_encode(table.column("tree_id")).combine_chunks()
        tree = enc.indices.to_numpy().astype(np.int64)
        names = enc.dictionary.to_pylist()
        parent = table.column("parent_id").to_numpy().astype(np.int64)
        node = table.column("node_id").to_numpy().astype(np.int64)
        # Sort only when needed: prefixes must be contiguous, trees in first-seen order.
        d_tree, d_parent, d_node = np.diff(tree), np.diff(parent), np.diff(node)
        ordered = np.all((d_tree > 0) | ((d_tree == 0) & ((d_parent > 0) | (
            (d_parent == 0) & (d_node > 0)))))
        order = slice(None) if ordered else np.lexsort((node, parent, tree))
        tree, parent, node = tree[order], parent[order], node[order]

        def col(name: str, dtype: type) -> np.ndarray:
            return table.column(name).to_numpy().astype(dtype)[order]

        scores = np.zeros((len(tree), len(labels)))
        for i in range(len(labels)):
            scores[:, i] = col(f"s{i}", np.float64)
        return RankingData(
            labels=tuple(labels), tree_ids=[str(t) for t in names], tree=tree,
            group=group_index([tree, parent]), parent_id=parent, node_id=node,
            successes=col("successes", np.int64), k_total=col("k", np.int64), scores=scores)


def load_ranking_data(con: duckdb.DuckDBPyConnection, methods: Sequence[MethodRef], k: int,
                      reference_policy: str | None = None, *, store: str = "STORE",
                      on_missing_credit: MissingCredit = "error"
                      ) -> tuple[RankingData, dict[str, str]]:
    """The children of every branching node with their reference and scores (one query).

    A prefix is audited when every child has a reference (k rollouts, from the tree's
    own policy version or ``reference_policy``). Among audited prefixes a child without
    a method's score means its tree lacks that credit: ``RankingError`` naming the
    ``rtrees credit`` command (``on_missing_credit="error"``), or the method is dropped
    (``"drop"``; returned with the reason).
    """
    params: dict[str, object] = {"k": int(k), "policy": reference_policy}
    where = _credit_filter(methods, params)
    pivot = ", ".join(
        f"arg_max(value, created_at) FILTER (WHERE method = $m{i} AND "
        f"method_params_hash = $h{i}) AS s{i}" for i in range(len(methods)))
    table = con.sql(f"""
        WITH {_BRANCHING_SQL},
        ref AS (
            SELECT r.tree_id, r.node_id, sum(r.successes)::BIGINT AS successes,
                   sum(r.k)::BIGINT AS k
            FROM mc_references r JOIN trees t USING (tree_id)
            WHERE r.k = $k AND r.policy_version IS NOT DISTINCT FROM
                  coalesce($policy, t.policy_version)
            GROUP BY r.tree_id, r.node_id),
        score AS (
            SELECT tree_id, node_id, {pivot} FROM credits WHERE {where}
            GROUP BY tree_id, node_id)
        SELECT c.tree_id, c.parent_id, c.node_id, ref.successes, ref.k,
               {", ".join(f"s.s{i}" for i in range(len(methods)))}
        FROM kids c JOIN prefixes USING (tree_id, parent_id)
        LEFT JOIN ref USING (tree_id, node_id)
        LEFT JOIN score s USING (tree_id, node_id)""", params=params).to_arrow_table()
    # Complete prefixes (every child referenced), found with numpy rather than a window.
    tree = pc.dictionary_encode(table.column("tree_id")).combine_chunks().indices.to_numpy()
    parent = table.column("parent_id").to_numpy()
    order = np.lexsort((table.column("node_id").to_numpy(), parent, tree))
    group = group_index([tree[order], parent[order]])
    has_ref = table.column("k").is_valid().to_numpy(zero_copy_only=False)[order]
    sizes = np.bincount(group)
    n_ref = np.bincount(group, has_ref, minlength=len(sizes))
    complete = n_ref == sizes
    n_branching, n_partial = len(sizes), int(np.sum(~complete & (n_ref > 0)))
    table = table.take(pa.array(order[complete[group]]))
    dropped: dict[str, str] = {}
    keep = []
    for i, m in enumerate(methods):
        col = table.column(f"s{i}")
        if col.null_count:
            missing = table.filter(col.is_null()).column("tree_id")
            trees = np.unique(missing.to_numpy(zero_copy_only=False))
            n_trees = len(np.unique(table.column("tree_id").to_numpy(zero_copy_only=False)))
            err = credit_error(m, len(trees), n_trees, str(trees[0]), store)
            if on_missing_credit == "error":
                raise err
            dropped[m.label] = str(err)
        else:
            keep.append(i)
    table = table.select(["tree_id", "parent_id", "node_id", "successes", "k"]
                         + [f"s{i}" for i in keep])
    table = table.rename_columns([*table.column_names[:5], *(f"s{j}" for j in range(len(keep)))])
    data = RankingData.from_table(table, [methods[i].label for i in keep])
    data = replace(data, n_prefixes_branching=n_branching,
                   n_prefixes_missing_reference=n_partial)
    return data, dropped


# ===== the audit =============================================================================


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

    def __post_init__(self) -> None:
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
        }


def ranking_audit(store: Store | str | Path, config: RankingConfig, *,
                  version: StoreVersion | int | None = None,
                  on_missing_credit: MissingCredit = "error") -> RankingResult:
    """Run the ranking audit on the store's credits and references (reads only the store).

    Raises ``RankingError`` when a method has no credits, or (``on_missing_credit=
    "error"``) lacks credit for an audited tree, or no prefix has references at
    ``config.k``; the message names the command that fixes it.
    """
    from rollout_store.reader import as_store, connect

    s = as_store(store)
    pinned = s.resolve(version)
    con = connect(s, pinned)
    path = str(s.path)
    methods = resolve_methods(con, config.methods, path)
    data, dropped = load_ranking_data(con, methods, config.k, config.reference_policy,
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
    return RankingResult(config, path, dict(pinned.versions), kept, data, stats, dropped)


# ===== the report ============================================================================


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
    names = sorted(_credit_hashes(con))
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


__all__ = ["Estimate", "MethodRef", "MethodStatistics", "PairedDifference", "PrefixStats",
           "RankingConfig", "RankingData", "RankingError", "RankingResult",
           "RankingStatistics", "build_ranking_reports", "group_index", "load_ranking_data",
           "missing_credit", "prefix_stats", "ranking_audit", "ranking_statistics",
           "reference_sets", "resolve_methods", "write_ranking_report"]
