"""The statistics of the audits (pure numpy): E10 / E11, one cluster bootstrap, Spearman.

* **Cluster bootstrap** (``cluster_draws``): resamples of whole clusters (trees,
  tasks) with replacement, n_clusters per resample, the unit whose members are
  dependent. Every audit draws from it: the ranking audit (E10-E11 over tree
  resamples, as multiplicities ``draw_counts`` times per-tree sums), the gate study
  (``cluster_bootstrap_means`` over tasks) and the drift study (Spearman of the
  rows of the drawn tasks). ``rows_per_call`` resamples are drawn per generator
  call (one call per resample unless chunked for memory).
* **Spearman** (``spearman``): Spearman's rho with average ranks for ties; NaN when
  either side is constant.
* **E10 / E11** (``prefix_stats``, ``ranking_statistics``): pairwise accuracy and
  Kendall tau-b over the children of branching nodes, with tree-bootstrap
  percentile intervals and paired differences (definitions in ``analysis.ranking``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_PAIR_CHUNK = 4_000_000  # pairs formed at a time (bounds memory on huge prefixes)
_SMALL_PREFIX = 16  # prefixes up to this many children are paired as one matrix per size
_BOOT_CHUNK = 4_000_000  # resample-by-tree matrix entries held at a time


# ----- the cluster bootstrap ------------------------------------------------------------------


def cluster_draws(rng: np.random.Generator, n_boot: int, n_clusters: int,
                  rows_per_call: int = 1) -> Iterator[np.ndarray]:
    """(R, n_clusters) cluster indices drawn with replacement, ``n_boot`` rows in all,
    ``rows_per_call`` rows per generator call (the last chunk may be shorter)."""
    for r0 in range(0, n_boot, rows_per_call):
        r1 = min(n_boot, r0 + rows_per_call)
        yield rng.integers(0, n_clusters, size=(r1 - r0, n_clusters))


def draw_counts(draws: np.ndarray, n_clusters: int) -> np.ndarray:
    """(R, n_clusters) multiplicity of each cluster in each row of ``draws`` (R, C)."""
    n_rows = len(draws)
    flat = draws + (np.arange(n_rows) * n_clusters)[:, None]
    return np.bincount(flat.ravel(), minlength=n_rows * n_clusters).reshape(n_rows,
                                                                           n_clusters)


def cluster_bootstrap_means(values: Mapping[str, np.ndarray], clusters: np.ndarray,
                            n_boot: int, seed: int) -> dict[str, np.ndarray]:
    """(n_boot,) bootstrap means of each (I,) array, resampling whole clusters (I,)."""
    names, inverse = np.unique(clusters, return_inverse=True)
    n_c = names.size
    sums = {k: np.bincount(inverse, weights=v, minlength=n_c) for k, v in values.items()}
    counts = np.bincount(inverse, minlength=n_c).astype(np.float64)
    rng = np.random.default_rng(seed)
    w = np.concatenate([draw_counts(d, n_c) for d in cluster_draws(rng, n_boot, n_c)]
                       ).astype(np.float64)  # (B, C) multiplicities
    total = w @ counts
    return {k: (w @ s) / total for k, s in sums.items()}


def percentile_ci(samples: np.ndarray, level: float = 0.95) -> list[float]:
    """The two-sided percentile interval of finite ``samples`` ([NaN, NaN] if none)."""
    arr = np.asarray(samples, np.float64)
    arr = arr[np.isfinite(arr)]
    if not arr.size:
        return [math.nan, math.nan]
    tail = (100.0 - 100.0 * level) / 2.0  # 2.5 exactly at level 0.95
    return [float(np.percentile(arr, tail)), float(np.percentile(arr, 100.0 - tail))]


# ----- Spearman -------------------------------------------------------------------------------


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho (average ranks for ties); NaN when either side is constant."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2 or np.ptp(x) == 0.0 or np.ptp(y) == 0.0:
        return math.nan
    return float(spearmanr(x, y).statistic)


# ----- E10 / E11 ----------------------------------------------------------------------------


def _sign(xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
    """sign(xa - xb) as int8, exact (compares, never subtracts)."""
    return (xa > xb).astype(np.int8) - (xa < xb).astype(np.int8)


def _sign_diff(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sign(x[a] - x[b]) as int8, exact."""
    return _sign(x[a], x[b])


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
                 pair_chunk: int = _PAIR_CHUNK, small_prefix: int = _SMALL_PREFIX
                 ) -> PrefixStats:
    """E10-E11 sufficient statistics of every prefix.

    Inputs, one entry per child, sorted so that each prefix's children are
    contiguous: ``tree`` (N,) tree index, ``group`` (N,) prefix index 0..G-1
    (non-decreasing), ``q`` (N,) reference, ``scores`` (N, K) one column per
    method. The pairs i < j of each prefix are enumerated by index arithmetic:
    child c (position p in a prefix of size M) pairs with the M-1-p children after
    it, so ``a = repeat(c, M-1-p)`` and ``b = a + 1 + offset``; pair counts are
    summed per prefix with ``bincount``. O(Σ M²) time; pairs are formed at most
    ``pair_chunk`` at a time. Prefixes of at most ``small_prefix`` children (nearly all,
    in agent trees) take a shorter road: the children of the prefixes of one size M are
    a (G_M, M) matrix, their pairs its M(M-1)/2 upper-triangle column pairs, summed
    along rows.
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
    columns = np.ascontiguousarray(scores.T)  # (K, N): one method's scores contiguous
    conc = np.zeros((n_groups, k))
    untied_s = np.zeros((n_groups, k))
    untied_q = np.zeros(n_groups)
    for size in np.unique(sizes[(sizes >= 2) & (sizes <= small_prefix)]).tolist():
        gs = np.flatnonzero(sizes == size)  # (G_M,) prefixes of this size
        first_of, second_of = np.triu_indices(size, 1)
        at = offsets[gs][:, None] + np.arange(size)  # (G_M, M) their children
        qm = q[at]  # (G_M, M); below, columns first_of / second_of are the pairs i < j
        dq = _sign(qm[:, first_of], qm[:, second_of])
        untied_q[gs] = np.count_nonzero(dq, axis=1)
        for m in range(k):
            sm = columns[m][at]
            ds = _sign(sm[:, first_of], sm[:, second_of])
            conc[gs, m] = np.sum(ds * dq, axis=1, dtype=np.int64)
            untied_s[gs, m] = np.count_nonzero(ds, axis=1)
    if n and sizes.max() > small_prefix:  # the larger prefixes (else all done above)
        # pairs each child of a larger prefix makes with its later siblings
        later = np.where(sizes[group] > small_prefix,
                         sizes[group] - 1 - (np.arange(n) - offsets[group]), 0).astype(np.int64)
        cum = np.cumsum(later)
        bounds = np.searchsorted(cum, np.arange(pair_chunk, int(cum[-1]), pair_chunk))
        starts = np.concatenate([[0], bounds + 1])
        stops = np.concatenate([bounds + 1, [n]])
        for c0, c1 in zip(starts.tolist(), stops.tolist(), strict=True):  # chunks of pairs
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
                ds = _sign_diff(columns[m], a, b)
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
        r0 = 0
        for draws in cluster_draws(rng, n_boot, n_trees, max(1, _BOOT_CHUNK // n_trees)):
            r1 = r0 + len(draws)
            w = draw_counts(draws, n_trees).astype(np.float64)  # (R, T)
            stats = _point(w @ conc_t, w @ us_t, w @ ur_t, w @ tau_t, w @ ninc_t)
            for s in range(3):
                boot[s, r0:r1] = stats[s]
            r0 = r1
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


@dataclass(frozen=True)
class ClusterSums:
    """E10-E11 sufficient statistics summed per cluster (C clusters, e.g. tasks) for one
    set of scores: S, A, B and the sum and count of the per-prefix τ_b over E11's
    prefixes (``PrefixStats``), each (C,)."""

    concordance: np.ndarray
    untied_score: np.ndarray
    untied_reference: np.ndarray
    tau_sum: np.ndarray
    n_included: np.ndarray

    @staticmethod
    def of(ps: PrefixStats, cluster_of_tree: np.ndarray, n_clusters: int, column: int = 0
           ) -> ClusterSums:
        """Sum ``ps``'s prefixes (score column ``column``) into the cluster of their tree
        (``cluster_of_tree[ps.tree[g]]``)."""
        c = np.asarray(cluster_of_tree, np.int64)[ps.tree]
        inc = ps.included
        tau = np.where(inc, ps.tau_b()[:, column], 0.0)

        def total(w: np.ndarray) -> np.ndarray:
            return np.bincount(c, w, minlength=n_clusters).astype(np.float64)

        return ClusterSums(total(ps.concordance[:, column] * inc),
                           total(ps.untied_score[:, column] * inc),
                           total(ps.untied_reference * inc), total(tau),
                           total(inc.astype(np.float64)))


def paired_cluster_ranking(sums: Mapping[str, ClusterSums], n_boot: int, seed: int,
                           level: float = 0.95) -> dict[str, Any]:
    """E10 pairwise accuracy and E11 macro / pooled τ_b of several score sets on the same
    C clusters, with percentile intervals from ONE cluster bootstrap (the same resampled
    clusters for every set, ``cluster_draws``), and the paired difference of every
    ordered pair of sets from the per-resample differences.

    Returns ``{"point": {name: {metric: x}}, "ci": {name: {metric: [lo, hi]}},
    "differences": {"a - b": {metric: {"estimate": x, "ci": [lo, hi]}}}`` with metrics
    ``pairwise_accuracy``, ``tau_b_macro``, ``tau_b_pooled``."""
    names = list(sums)
    metrics = ("pairwise_accuracy", "tau_b_macro", "tau_b_pooled")
    if not names:
        return {"point": {}, "ci": {}, "differences": {}}
    stack = {f: np.stack([getattr(sums[n], f) for n in names], axis=1)  # (C, K)
             for f in ("concordance", "untied_score", "untied_reference", "tau_sum",
                       "n_included")}
    n_c = stack["concordance"].shape[0]

    def stats(w: np.ndarray) -> np.ndarray:  # w (R, C) -> (3, R, K)
        with np.errstate(invalid="ignore", divide="ignore"):
            conc, us, uq = w @ stack["concordance"], w @ stack["untied_score"], \
                w @ stack["untied_reference"]
            acc = 0.5 + 0.5 * conc / uq
            macro = (w @ stack["tau_sum"]) / (w @ stack["n_included"])
            denom = np.sqrt(us * uq)
            pooled = np.where(denom > 0, conc / np.where(denom > 0, denom, 1.0), 0.0)
            pooled = np.where(uq > 0, pooled, np.nan)
        return np.stack([acc, macro, pooled])

    point = stats(np.ones((1, n_c)))[:, 0, :]  # (3, K)
    boot = np.full((3, 0, len(names)), np.nan)
    if n_boot > 0 and n_c > 0:
        rng = np.random.default_rng(seed)
        w = np.concatenate([draw_counts(d, n_c) for d in cluster_draws(rng, n_boot, n_c)]
                           ).astype(np.float64)
        boot = stats(w)  # (3, B, K)
    out: dict[str, Any] = {"point": {}, "ci": {}, "differences": {}}
    for k, name in enumerate(names):
        out["point"][name] = {m: float(point[i, k]) for i, m in enumerate(metrics)}
        out["ci"][name] = {m: percentile_ci(boot[i, :, k], level) for i, m in enumerate(metrics)}
    for a, na in enumerate(names):
        for b, nb in enumerate(names):
            if a == b:
                continue
            out["differences"][f"{na} - {nb}"] = {
                m: {"estimate": float(point[i, a] - point[i, b]),
                    "ci": percentile_ci(boot[i, :, a] - boot[i, :, b], level)}
                for i, m in enumerate(metrics)}
    return out


def _dense(values: np.ndarray) -> tuple[np.ndarray, int]:
    uniq, index = np.unique(values, return_inverse=True)
    return index.astype(np.int64), len(uniq)


__all__ = ["ClusterSums", "Estimate", "MethodStatistics", "PairedDifference", "PrefixStats",
           "RankingStatistics", "cluster_bootstrap_means", "cluster_draws", "draw_counts",
           "group_index", "paired_cluster_ranking", "percentile_ci", "prefix_stats",
           "ranking_statistics", "spearman"]
