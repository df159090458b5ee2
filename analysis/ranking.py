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

Computation: three projected DuckDB scans of the store's views (the children, the
references, the methods' credits), joined in numpy on one int64 key per (tree, node),
give one row per child of every branching node (reference and every method's score);
pairs are formed with numpy index arithmetic within each prefix and reduced with
``bincount`` (no Python loop per prefix); each bootstrap resample is a vector of tree
counts, so all resamples are one matrix product with per-tree sums. Trees are indexed in
the order the ``nodes`` view first holds them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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

MissingCredit = Literal["error", "drop"]
SplitBy = Literal["sampler", "run"]
SPLIT_COLUMNS: dict[str, str] = {"sampler": "sampler", "run": "run_id"}  # by -> trees column


class RankingError(RuntimeError):
    """The store lacks what the audit needs (credits, references); the message says what
    to run."""


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


def credit_hashes(con: duckdb.DuckDBPyConnection) -> dict[str, list[tuple[str, str | None]]]:
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
    available = credit_hashes(con)
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

    def subset(self, tree_mask: np.ndarray) -> RankingData:
        """The rows of the trees with ``tree_mask[tree]`` (a (T,) bool array), prefixes
        renumbered; tree indices and ids are kept (so bootstrap units stay trees)."""
        rows = np.flatnonzero(np.asarray(tree_mask, bool)[self.tree])
        tree, parent = self.tree[rows], self.parent_id[rows]
        return replace(self, tree=tree, group=group_index([tree, parent]), parent_id=parent,
                       node_id=self.node_id[rows], successes=self.successes[rows],
                       k_total=self.k_total[rows], scores=self.scores[rows])

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
        found = _row_order(tree, parent, node)
        order = slice(None) if found is None else found
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


@dataclass(frozen=True)
class _NodeKeys:
    """One int64 key per (tree, node): ``code(tree_id) · span + node_id - lo``, tree ids
    coded by their index in ``names``, node ids in ``[lo, lo + span)``; ``dense`` when
    arrays of ``size`` = len(names) · span entries are small enough to index by key."""

    names: pa.Array
    lo: int
    span: int
    dense: bool

    @property
    def size(self) -> int:
        return len(self.names) * self.span

    def of(self, t: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(keys, row indices) of the rows of ``t`` (``tree_id``, ``node_id``) whose tree is in
        ``names`` and node in range: the others can match no child."""
        code = pc.fill_null(pc.index_in(t.column("tree_id"), value_set=self.names), -1)
        code = code.to_numpy().astype(np.int64)
        node = t.column("node_id").to_numpy().astype(np.int64, copy=False) - self.lo
        rows = np.flatnonzero((code >= 0) & (node >= 0) & (node < self.span))
        return code[rows] * self.span + node[rows], rows


def _at_keys(keys: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sorted unique ``keys``: (index of each target in ``keys``, whether it is there)."""
    if not len(keys):
        return np.zeros(len(targets), np.int64), np.zeros(len(targets), bool)
    pos = np.minimum(np.searchsorted(keys, targets), len(keys) - 1)
    return pos, keys[pos] == targets


def _sums_at(nk: _NodeKeys, keys: np.ndarray, columns: Sequence[np.ndarray],
             targets: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """(per column, Σ of its int values at each target key; whether the key has any row)."""
    if nk.dense:
        n = np.bincount(keys, minlength=nk.size)
        return [np.bincount(keys, c.astype(np.float64), minlength=nk.size)[targets].astype(
            np.int64) for c in columns], n[targets] > 0  # exact: sums < 2^53
    order = np.argsort(keys, kind="stable")
    found, first = np.unique(keys[order], return_index=True)
    pos, hit = _at_keys(found, targets)
    if not len(first):
        return [np.zeros(len(targets), np.int64) for _ in columns], hit
    return [np.add.reduceat(c.astype(np.int64)[order], first)[pos] for c in columns], hit


def _latest_at(nk: _NodeKeys, keys: np.ndarray, created: np.ndarray, values: np.ndarray,
               targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value of the largest ``created`` per target key (ties: the first row), whether the key
    has any row)."""
    if nk.dense:
        n = np.bincount(keys, minlength=nk.size)
        if not len(n) or n.max() <= 1:  # one write per node, the usual case: no sort
            dense = np.zeros(nk.size)
            dense[keys] = values
            return dense[targets], n[targets] > 0
    order = np.lexsort((-created, keys))  # per key the latest first; ties in row order
    found, first = np.unique(keys[order], return_index=True)
    pos, hit = _at_keys(found, targets)
    latest = values[order][first]
    return latest[pos] if len(first) else np.zeros(len(targets)), hit


def _row_order(tree: np.ndarray, parent: np.ndarray, node: np.ndarray) -> np.ndarray | None:
    """The permutation sorting rows by (tree, parent, node), None when already sorted."""
    d_tree, d_parent, d_node = np.diff(tree), np.diff(parent), np.diff(node)
    if np.all((d_tree > 0) | ((d_tree == 0) & ((d_parent > 0) | (
            (d_parent == 0) & (d_node > 0))))):
        return None
    return np.lexsort((node, parent, tree))


@dataclass(frozen=True)
class _Children:
    """Every child of a branching node (a parent with >= 2 children), N rows sorted by
    (tree, parent, node): tree ``names[code]``, trees in the order the ``nodes`` view first
    holds them; the pooled reference (``successes``, ``k``; 0 where ``has_ref`` is false)
    and per method i its latest credit ``scores[:, i]`` (where ``has_score[:, i]``)."""

    names: pa.Array  # (T,) string tree ids
    code: np.ndarray  # (N,) int64, non-decreasing
    parent: np.ndarray  # (N,) int64
    node: np.ndarray  # (N,) int64
    successes: np.ndarray  # (N,) int64
    k: np.ndarray  # (N,) int64
    has_ref: np.ndarray  # (N,) bool
    scores: np.ndarray  # (N, K) float64
    has_score: np.ndarray  # (N, K) bool


def _branching_children(con: duckdb.DuckDBPyConnection, methods: Sequence[MethodRef],
                        k: int, reference_policy: str | None = None) -> _Children:
    """The children of every branching node with their reference and latest scores:
    ``successes`` = Σ successes and ``k`` = Σ k over the child's ``mc_references`` rows at
    ``k`` from the tree's policy version (or ``reference_policy``), and per method the
    ``value`` of its largest ``created_at`` (ties: the first row scanned, as DuckDB's
    ``arg_max``).

    Three projected scans (the children; references joined with ``trees``; the methods'
    credits), no token column read; the grouping and the joins on (tree, node) run in numpy
    on one int64 key per node (``_NodeKeys``: tree ids dictionary-encoded once), by
    ``bincount`` over the key space when it is at most 4x the children (else by sorting),
    rather than as DuckDB hash joins and aggregates on string ids (about 4x the bare query
    of ``benchmarks/bench_ranking.py`` on their own).
    """
    kids = con.sql("SELECT tree_id, parent_id, node_id FROM nodes "
                   "WHERE parent_id IS NOT NULL").to_arrow_table()
    enc = pc.dictionary_encode(kids.column("tree_id")).combine_chunks()
    code = enc.indices.to_numpy().astype(np.int64)
    parent = kids.column("parent_id").to_numpy().astype(np.int64, copy=False)
    node = kids.column("node_id").to_numpy().astype(np.int64, copy=False)
    lo = int(min(parent.min(), node.min())) if len(node) else 0
    span = int(max(parent.max(), node.max())) - lo + 1 if len(node) else 1
    if len(enc.dictionary) * span * span >= 2**62:
        raise RankingError(f"node ids span {span} in {len(enc.dictionary)} trees: too wide "
                           "to key")
    nk = _NodeKeys(enc.dictionary, lo, span, len(enc.dictionary) * span <= 4 * len(node) + 1024)
    prefix = code * span + (parent - lo)
    if nk.dense:
        n_children = np.bincount(prefix, minlength=nk.size)[prefix]
    else:
        _, inverse, counts = np.unique(prefix, return_inverse=True, return_counts=True)
        n_children = counts[inverse]
    rows = np.flatnonzero(n_children >= 2)
    position = prefix[rows] * span + (node[rows] - lo)  # sorts by (tree, parent, node)
    if np.any(np.diff(position) < 0):
        rows = rows[np.argsort(position, kind="stable")]
    code, parent, node = code[rows], parent[rows], node[rows]
    target = code * span + (node - lo)

    ref = con.sql(
        "SELECT r.tree_id, r.node_id, r.successes, r.k FROM mc_references r "
        "JOIN trees t USING (tree_id) WHERE r.k = $k AND r.policy_version IS NOT "
        "DISTINCT FROM coalesce($policy, t.policy_version)",
        params={"k": int(k), "policy": reference_policy}).to_arrow_table()
    keys, at = nk.of(ref)
    (successes, k_total), has_ref = _sums_at(
        nk, keys, [ref.column(c).to_numpy()[at] for c in ("successes", "k")], target)

    pairs = list(dict.fromkeys((m.method, m.params_hash) for m in methods))
    params: dict[str, object] = {}
    cases, terms = ["WHEN false THEN -1"], ["false"]
    for j, (method, params_hash) in enumerate(pairs):
        params[f"m{j}"], params[f"h{j}"] = method, params_hash
        terms.append(f"(method = $m{j} AND method_params_hash = $h{j})")
        cases.append(f"WHEN {terms[-1]} THEN {j}")
    credit = con.sql(
        f"SELECT tree_id, node_id, value, epoch_us(created_at) AS at, "
        f"CASE {' '.join(cases)} END AS pair FROM credits WHERE {' OR '.join(terms)}",
        params=params).to_arrow_table()
    latest: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    for j, pair in enumerate(pairs):
        mine = credit.filter(pc.equal(credit.column("pair"), j)) if len(pairs) > 1 else credit
        keys, at = nk.of(mine)
        latest[pair] = _latest_at(nk, keys, mine.column("at").to_numpy()[at],
                                  mine.column("value").to_numpy().astype(np.float64)[at],
                                  target)
    scores = np.zeros((len(rows), len(methods)))
    has_score = np.zeros((len(rows), len(methods)), bool)
    for i, m in enumerate(methods):
        scores[:, i], has_score[:, i] = latest[(m.method, m.params_hash)]
    return _Children(nk.names, code, parent, node, np.where(has_ref, successes, 0),
                     np.where(has_ref, k_total, 0), has_ref, scores, has_score)


def load_ranking_data(con: duckdb.DuckDBPyConnection, methods: Sequence[MethodRef], k: int,
                      reference_policy: str | None = None, *, store: str = "STORE",
                      on_missing_credit: MissingCredit = "error"
                      ) -> tuple[RankingData, dict[str, str]]:
    """The children of every branching node with their reference and scores
    (``_branching_children``).

    A prefix is audited when every child has a reference (k rollouts, from the tree's
    own policy version or ``reference_policy``). Among audited prefixes a child without
    a method's score means its tree lacks that credit: ``RankingError`` naming the
    ``rtrees credit`` command (``on_missing_credit="error"``), or the method is dropped
    (``"drop"``; returned with the reason). Trees are indexed in the order the ``nodes``
    view first holds them (the bootstrap's resampling units).
    """
    c = _branching_children(con, methods, k, reference_policy)
    # Complete prefixes (every child referenced); rows are sorted, so prefixes contiguous.
    group = group_index([c.code, c.parent])
    sizes = np.bincount(group)
    n_ref = np.bincount(group, c.has_ref, minlength=len(sizes))
    complete = n_ref == sizes
    n_branching, n_partial = len(sizes), int(np.sum(~complete & (n_ref > 0)))
    rows = np.flatnonzero(complete[group])
    codes, tree = np.unique(c.code[rows], return_inverse=True)  # first-seen order kept
    dropped: dict[str, str] = {}
    keep = []
    for i, m in enumerate(methods):
        missing = ~c.has_score[rows, i]
        if missing.any():
            lacking = np.unique(c.code[rows][missing])
            example = min(c.names.take(pa.array(lacking)).to_pylist())
            err = credit_error(m, len(lacking), len(codes), example, store)
            if on_missing_credit == "error":
                raise err
            dropped[m.label] = str(err)
        else:
            keep.append(i)
    tree = tree.astype(np.int64)
    parent = c.parent[rows]
    data = RankingData(
        labels=tuple(methods[i].label for i in keep),
        tree_ids=[str(t) for t in c.names.take(pa.array(codes)).to_pylist()], tree=tree,
        group=group_index([tree, parent]), parent_id=parent, node_id=c.node[rows],
        successes=c.successes[rows], k_total=c.k[rows], scores=c.scores[rows][:, keep],
        n_prefixes_branching=n_branching, n_prefixes_missing_reference=n_partial)
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


def split_statistics(con: duckdb.DuckDBPyConnection, data: RankingData, by: SplitBy,
                     n_boot: int, level: float, seed: int) -> dict[str, RankingStatistics]:
    """E10-E11 of each group of trees (``trees.sampler`` or ``trees.run_id``), in group
    name order; groups without an audited prefix are left out."""
    column = SPLIT_COLUMNS[by]
    rows = con.sql(f"SELECT tree_id, {column} FROM trees").fetchall()
    value = {t: str(v) for t, v in rows}
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
    groups = (split_statistics(con, data, config.by, config.n_boot, config.level, config.seed)
              if config.by else {})
    return RankingResult(config, path, dict(pinned.versions), kept, data, stats, dropped,
                         groups)


__all__ = ["Estimate", "MethodRef", "MethodStatistics", "PairedDifference", "PrefixStats",
           "RankingConfig", "RankingData", "RankingError", "RankingResult",
           "RankingStatistics", "group_index", "load_ranking_data",
           "missing_credit", "prefix_stats", "ranking_audit", "ranking_statistics",
           "resolve_methods", "split_statistics"]
