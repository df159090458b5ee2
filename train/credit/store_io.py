"""Credit for stored trees (``rtrees credit``) and for in-memory trees (``credit_trees``).

Credit is a function of the stored data alone (docs/METHODS.md, "Prompt groups"):

* A tree's *prompt group* is every stored tree with the same
  (``run_id``, ``sampler``, ``policy_version``, ``task_id``): a group never mixes
  runs, samplers or policy versions (``base.group_keys``).
* Methods whose credit spans trees (``Params.spans_trees()``: grpo, elpo and
  trace with ``group="task"``, tree_grpo) are computed over whole groups, each
  group in one batch. Per-tree methods are computed tree by tree.
* ``compute_credits`` credits every tree (per-tree methods) or every group
  (prompt-group methods) that has no credit yet for (method, params hash),
  streaming the trees out of DuckDB ordered by group, so a group never
  straddles two batches. Commits are keyed by method, params hash and the
  batch's trees; crediting in one call or in several gives identical values,
  running the command twice changes nothing, and an interrupted run resumes.
* **A group that grew after it was credited is refused.** If some trees of a
  group have credit for (method, params hash) and others do not (trees joined
  the group later, e.g. a second ``collect`` of the same run with another
  seed), the group's stored credit was computed from fewer trees than it now
  holds. Stored credit is never rewritten, so ``compute_credits`` raises
  ``CreditError`` naming those groups before committing anything. Collect new
  trees under a new ``run_id`` (a new group), or credit with other parameters.

``credit_trees`` runs the same code path on in-memory trees and returns the
``credits`` rows (the trainer commits them itself); the trees passed must hold
whole prompt groups.

trace and dsc read policy scores of stored text (``train.credit.scores``), never
compute them: ``rtrees credit --param ref=SPEC`` (trace, T2) / ``--param target=SPEC``
(dsc, D3) first runs the scoring job (``train.scoring.score_for_credit``: loads SPEC,
scores the trees that lack scores of its version into ``policy_scores``, once per policy
version) and passes the version in the params; ``compute_credits`` credits from the
stored scores of that version. factor and sgcd read per-token scores (F3, Q3;
``TOKEN_SCORED``) the same way with ``--param teacher=SPEC``; without it, each tree's
scores of its own ``policy_version`` (as the trainer writes them) are read, and a tree
without them is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.progress import Progress

from rollout_store.reader import connect
from rollout_store.schema import CREDITS, NODE_INPUT
from rollout_store.store import Store, now_utc
from rollout_store.tree import Tree, TreeBatch
from train.credit import ESTIMATORS
from train.credit.base import (
    Credit,
    Estimator,
    Params,
    TreeArrays,
    from_tables,
    node_lists_to_tokens,
)
from train.credit.scores import (
    PLAIN,
    ScoreKind,
    score_extras,
    stored_scores,
    token_score_lists,
)

_NODE_COLUMNS = [*NODE_INPUT.names, "depth", "preorder", "subtree_size"]
_TREE_COLUMNS = ["tree_id", "run_id", "sampler", "policy_version", "task_id",
                 "critical_node_id"]
_GROUP_ORDER = "run_id, sampler, policy_version NULLS FIRST, task_id"


class CreditError(RuntimeError):
    """The method, its parameters or the stored trees do not allow computing credit."""


@dataclass
class CreditRunReport:
    method: str
    params_hash: str
    trees_done: int = 0
    trees_skipped: int = 0
    rows: int = 0
    commits: int = 0

    def summary(self) -> str:
        return (f"{self.method} [{self.params_hash}]: credit for {self.trees_done} trees "
                f"({self.rows} rows, {self.commits} commits); {self.trees_skipped} trees "
                "already had it")


def _candidates(store: Store, method: str, params_hash: str, spans: bool) -> Any:
    """A DuckDB connection holding TEMP TABLE ``todo``: the trees to credit now.

    ``todo`` has ``_TREE_COLUMNS`` and ``_group`` (a dense group number), ordered
    by group then tree. Raises ``CreditError`` for groups that grew after they
    were credited (prompt-group methods only; module docstring).
    """
    con = connect(store)
    con.execute(f"""
        CREATE TEMP TABLE cand AS
        SELECT {", ".join(_TREE_COLUMNS)},
               dense_rank() OVER (ORDER BY {_GROUP_ORDER}) AS _group,
               tree_id IN (SELECT tree_id FROM credits
                           WHERE method = $m AND method_params_hash = $h) AS _done
        FROM trees""", {"m": method, "h": params_hash})
    if spans:
        grown = con.sql("""
            SELECT run_id, sampler, policy_version, task_id, count(*) FILTER (WHERE _done),
                   count(*) FILTER (WHERE NOT _done)
            FROM cand GROUP BY run_id, sampler, policy_version, task_id
            HAVING bool_or(_done) AND bool_or(NOT _done)
            ORDER BY ALL""").fetchall()
        if grown:
            shown = "; ".join(f"(run {r!r}, sampler {s!r}, policy_version {v!r}, task {t!r}): "
                              f"{d} credited, {n} new" for r, s, v, t, d, n in grown[:3])
            more = f" and {len(grown) - 3} more" if len(grown) > 3 else ""
            raise CreditError(
                f"{method} [{params_hash}] credit spans each prompt group, and "
                f"{len(grown)} group(s) gained trees after they were credited: {shown}{more}. "
                "Stored credit is never rewritten; collect new trees under a new run_id, "
                "or credit with other parameters")
    con.execute("CREATE TEMP TABLE todo AS SELECT * EXCLUDE (_done) FROM cand "
                "WHERE NOT _done ORDER BY _group, tree_id")
    return con


def _batches(store: Store, method: str, params_hash: str, spans: bool, max_nodes: int
             ) -> Iterator[tuple[pa.Table, pa.Table]]:
    """(trees rows, nodes rows) of the trees to credit, whole groups per batch."""
    con = _candidates(store, method, params_hash, spans)
    todo = con.sql("SELECT * FROM todo").to_arrow_table()
    if todo.num_rows == 0:
        return
    cols = ", ".join(f"n.{c}" for c in _NODE_COLUMNS)
    reader = con.sql(f"""
        SELECT {cols}, t._group FROM nodes n JOIN todo t USING (tree_id)
        ORDER BY t._group, n.tree_id, n.preorder""").to_arrow_reader(65_536)
    pending: list[pa.RecordBatch] = []
    n_pending = 0
    for batch in reader:
        pending.append(batch)
        n_pending += batch.num_rows
        if n_pending >= max_nodes:
            table = pa.Table.from_batches(pending)
            groups = table.column("_group")
            last = groups[-1]
            done_mask = pc.not_equal(groups, last)  # the last group may continue
            ready, rest = table.filter(done_mask), table.filter(pc.invert(done_mask))
            pending, n_pending = rest.to_batches(), rest.num_rows
            if ready.num_rows:
                yield _with_trees(todo, ready)
    if pending:
        yield _with_trees(todo, pa.Table.from_batches(pending))


def _with_trees(todo: pa.Table, nodes: pa.Table) -> tuple[pa.Table, pa.Table]:
    ids = pc.unique(nodes.column("tree_id"))
    trees = todo.filter(pc.is_in(todo.column("tree_id"), value_set=ids))
    return trees.drop_columns(["_group"]), nodes.drop_columns(["_group"])


def stored_extras(nodes: pa.Table) -> dict[str, np.ndarray]:
    """Estimator inputs that samplers record in node ``meta`` (rows follow ``nodes``).

    ``caliper_y0``: the CALIPER sampler marks the original failed suffix y_0 of
    each local group (``{"caliper_y0": true}``); without it the estimator
    falls back to guessing y_0 by shared prefix.
    """
    meta = pc.fill_null(nodes.column("meta"), "")
    y0 = pc.match_substring(meta, '"caliper_y0": true')
    return {"caliper_y0": np.asarray(y0.to_numpy(zero_copy_only=False), dtype=bool)}


def credit_rows(batch: TreeArrays, credit: Credit, trees: pa.Table, method: str,
                params_json: str, params_hash: str, run_id: str) -> pa.Table:
    """One ``credits`` row per node: ``value`` = node credit, ``token_values`` = the
    advantages of its action tokens (the agent tokens, in order), ``clip_low`` /
    ``clip_high`` = the per-token clip epsilons of those tokens where the method sets them
    (ELPO E8, CALIPER C8), else empty lists (``schema.CLIP_BOUNDS``)."""
    versions = dict(zip(trees.column("tree_id").to_pylist(),
                        trees.column("policy_version").to_pylist(), strict=True))
    tree_names = [batch.tree_ids[b] for b in batch.node_tree]
    values = np.asarray(credit.node, dtype=np.float64)
    if not np.isfinite(np.nan_to_num(values, nan=0.0)).all():
        raise CreditError(f"{method} produced inf credit")
    # Per-node action-token advantages: agent tokens are the first tokens of each node.
    n_agent = np.bincount(batch.token_node[batch.agent_mask], minlength=batch.n_nodes)
    token_vals = credit.token[batch.agent_mask].astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(n_agent)]).astype(np.int32)
    none = np.zeros(batch.n_nodes + 1, np.int32)  # every node an empty list: no bounds

    def bounds(eps: np.ndarray | None) -> pa.ListArray:
        if eps is None:
            return pa.ListArray.from_arrays(pa.array(none), pa.array([], pa.float64()))
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(
            np.asarray(eps, np.float64)[batch.agent_mask]))

    now = now_utc()
    n = batch.n_nodes
    return pa.table({
        "run_id": pa.array([run_id] * n, pa.string()),
        "method": pa.array([method] * n, pa.string()),
        "method_params_hash": pa.array([params_hash] * n, pa.string()),
        "method_params": pa.array([params_json] * n, pa.string()),
        "tree_id": pa.array(tree_names, pa.string()),
        "node_id": pa.array(batch.node_ids, pa.int64()),
        # Nodes without credit (the root, a non-leaf some methods leave undefined) store 0.
        "value": pa.array(np.nan_to_num(values, nan=0.0), pa.float64()),
        "token_values": pa.ListArray.from_arrays(pa.array(offsets), pa.array(token_vals)),
        "policy_version": pa.array([versions.get(t) for t in tree_names], pa.string()),
        "created_at": pa.array([now] * n, CREDITS.field("created_at").type),
        "clip_low": bounds(credit.clip_low),
        "clip_high": bounds(credit.clip_high),
    }, schema=CREDITS)


def stored_credit(store: Store, tree_ids: Sequence[str], method: str, params_hash: str
                  ) -> pa.Table:
    """The committed ``credits`` rows of (``method``, ``params_hash``) for ``tree_ids``
    whose clip bounds are recorded (``schema.CLIP_BOUNDS``: non-null; rows of schema
    version < 4 read them as null and are left out), one row per (tree_id, node_id) (the
    earliest committed where several runs credited a tree: the same inputs give the same
    credit), ordered by tree_id and node_id. Whether a tree's rows are complete is the
    caller's question (``complete_credit``)."""
    if not tree_ids:
        return CREDITS.empty_table()
    con = connect(store)
    con.register("_credit_trees", pa.table({"tree_id": pa.array(list(tree_ids), pa.string())}))
    cols = ", ".join(CREDITS.names)
    got = con.sql(
        f"SELECT {cols} FROM (SELECT *, row_number() OVER (PARTITION BY tree_id, node_id "
        "ORDER BY created_at, run_id) AS _k FROM credits WHERE method = $m AND "
        "method_params_hash = $h AND clip_low IS NOT NULL AND clip_high IS NOT NULL AND "
        "tree_id IN (SELECT tree_id FROM _credit_trees)) WHERE _k = 1 "
        "ORDER BY tree_id, node_id", params={"m": method, "h": params_hash}).to_arrow_table()
    con.unregister("_credit_trees")
    return got.cast(CREDITS)


def complete_credit(rows: pa.Table, trees: Sequence[Tree]) -> set[str]:
    """Ids of ``trees`` for which ``rows`` (``stored_credit``) hold a row for every node."""
    have: dict[str, set[int]] = {}
    for t, n in zip(rows.column("tree_id").to_pylist(), rows.column("node_id").to_pylist(),
                    strict=True):
        have.setdefault(t, set()).add(int(n))
    return {t.tree_id for t in trees
            if have.get(t.tree_id, set()) >= {n.node_id for n in t.nodes}}


def resolve_method(method: str, params: Mapping[str, str] | Params | None = None
                   ) -> tuple[Estimator[Any], Any]:
    """The registered estimator and its params (``KEY=VALUE`` strings or a params object)."""
    if method not in ESTIMATORS:
        raise CreditError(f"unknown method {method!r}; choose from {sorted(ESTIMATORS)}")
    estimator = ESTIMATORS[method]
    if isinstance(params, Params):
        if not isinstance(params, estimator.params_type):
            raise CreditError(f"{method} takes {estimator.params_type.__name__}, "
                              f"got {type(params).__name__}")
        return estimator, params
    try:
        return estimator, estimator.parse_params(dict(params or {}))
    except (ValueError, TypeError) as exc:
        raise CreditError(str(exc)) from exc


# Methods whose inputs are policy scores of stored text: (params field naming the
# scoring policy, kind of ``policy_scores`` rows) (train.credit.scores, train.scoring),
# as each params type declares (``Params.node_scores``).
SCORED: dict[str, tuple[str, ScoreKind]] = {
    name: e.params_type.node_scores for name, e in sorted(ESTIMATORS.items())
    if e.params_type.node_scores is not None}


# Methods whose inputs are per-token policy scores (F3, Q3): the params field naming the
# scoring policy is ``teacher``; ``token_score_kinds`` gives {extras name: kind}.
TOKEN_SCORED: tuple[str, ...] = tuple(
    name for name, e in sorted(ESTIMATORS.items()) if e.params_type.token_scorer is not None)


def token_score_kinds(method: str, p: Any) -> dict[str, ScoreKind]:
    """{extras name: ``policy_scores`` kind} that ``method`` with params ``p`` reads
    (empty when its teacher weight is off: factor ``eta=0``, sgcd ``kappa=0``), as the
    params declare (``Params.token_score_kinds``)."""
    kinds: dict[str, ScoreKind] = p.token_score_kinds()
    return kinds


def _score_source(method: str, p: Any) -> tuple[ScoreKind, str] | None:
    """(kind, scoring policy version) when ``p`` names a scoring policy, else None."""
    if method not in SCORED:
        return None
    field, kind = SCORED[method]
    value = getattr(p, field)
    return None if value is None else (kind, str(value))


def _credit_tables(trees: pa.Table, nodes: pa.Table, estimator: Estimator[Any], p: Any,
                   run_id: str, scores: pa.Table | None = None) -> pa.Table:
    """``credits`` rows for whole trees given as ``trees`` / ``nodes`` rows (one batch).

    The one code path of ``compute_credits`` and ``credit_trees``; ``scores`` are the
    ``policy_scores`` rows of these trees for a scored method (trace, dsc).
    """
    rows, _, _ = _credit_batch(trees, nodes, estimator, p, run_id, scores)
    return rows


def _credit_batch(trees: pa.Table, nodes: pa.Table, estimator: Estimator[Any], p: Any,
                  run_id: str, scores: pa.Table | None = None
                  ) -> tuple[pa.Table, TreeArrays, Credit]:
    """``_credit_tables`` with the batch and the estimator's ``Credit`` it was built from."""
    extras = stored_extras(nodes)
    source = _score_source(estimator.name, p)
    if source is not None and scores is not None:
        extras.update(score_extras(nodes, scores, *source))
    token_kinds = token_score_kinds(estimator.name, p)
    if token_kinds and scores is not None:
        _check_student_scores(trees, nodes, scores, estimator.name, p.teacher,
                              p.min_scored_tokens)
        for name, kind in token_kinds.items():
            extras[name] = token_score_lists(trees, nodes, scores, kind, p.teacher)
    batch = from_tables(trees, nodes, extras)
    if token_kinds and scores is not None:  # per-node lists onto the agent tokens (T,)
        batch = replace(batch, extras={**batch.extras, **{
            name: node_lists_to_tokens(batch, batch.extras[name]) for name in token_kinds}})
    try:
        credit = estimator(batch, p)
    except KeyError as exc:
        hint = ""
        if estimator.name in SCORED:
            hint = (f"; pass --param {SCORED[estimator.name][0]}=SPEC to score them from the "
                    "store with that policy")
        elif estimator.name in TOKEN_SCORED:
            hint = "; pass --param teacher=SPEC to score them from the store with that policy"
        raise CreditError(f"{estimator.name} needs input {exc} that stored trees do not "
                          f"carry (see the estimator's docstring){hint}") from exc
    except ValueError as exc:
        raise CreditError(f"{estimator.name}: {exc}") from exc
    return (credit_rows(batch, credit, trees, estimator.name, p.to_json(), p.params_hash(),
                        run_id), batch, credit)


def _check_student_scores(trees: pa.Table, nodes: pa.Table, scores: pa.Table, method: str,
                          teacher: str | None, min_tokens: int = 1) -> None:
    """Refuse trees with steps (of at least ``min_tokens`` action tokens, the params'
    ``min_scored_tokens``) but no ``plain`` scores of the teacher's (or, teacher None,
    their own) policy version: their credit would silently lose its token allocation."""
    own = dict(zip(trees.column("tree_id").to_pylist(),
                   trees.column("policy_version").to_pylist(), strict=True))
    scored = {t for t, k, v in zip(*(scores.column(c).to_pylist() for c in (
        "tree_id", "kind", "policy_version")), strict=True)
        if k == PLAIN and v == (own.get(t) if teacher is None else teacher)}
    steps = pc.and_(pc.is_valid(nodes.column("parent_id")),
                    pc.greater(pc.fill_null(pc.list_value_length(
                        nodes.column("action_token_ids")), 0), max(min_tokens, 1) - 1))
    need = set(nodes.filter(steps).column("tree_id").to_pylist())
    missing = sorted(need - scored)
    if missing:
        whose = "their own policy versions" if teacher is None else f"policy {teacher!r}"
        raise CreditError(f"{method}: {len(missing)} tree(s) have no stored '{PLAIN}' scores "
                          f"of {whose} (e.g. {missing[0]!r}); pass --param teacher=SPEC to "
                          "score them")


def credit_trees(trees: Sequence[Tree], method: str,
                 params: Mapping[str, str] | Params | None = None,
                 run_id: str | None = None, scores: pa.Table | None = None) -> pa.Table:
    """``credits`` rows (``schema.CREDITS``, one per node) for in-memory trees.

    The same code path as ``rtrees credit`` (``compute_credits``): trees are
    validated, grouped by (run_id, sampler, policy_version, task_id), credited
    with ``method`` and ``params`` (``KEY=VALUE`` strings or the estimator's
    params object) and turned into rows; nothing is committed. For a method
    whose credit spans prompt groups (``Params.spans_trees()``) pass every tree
    of each group at once. ``run_id`` defaults to ``credit-METHOD-HASH``.
    ``scores``: for trace / dsc, the ``policy_scores`` rows of these trees
    (``train.scoring.score_trees`` with the frozen reference / target policy, or the stored
    ones); the params' ``ref`` / ``target`` must then be that policy's version.
    Raises ``CreditError`` (unknown method or parameter, missing inputs).
    """
    if not trees:
        resolve_method(method, params)
        return CREDITS.empty_table()
    return credit_trees_full(trees, method, params, run_id, scores)[0]


def credit_trees_full(trees: Sequence[Tree], method: str,
                      params: Mapping[str, str] | Params | None = None,
                      run_id: str | None = None, scores: pa.Table | None = None
                      ) -> tuple[pa.Table, TreeArrays, Credit]:
    """``credit_trees`` with the batch and ``Credit`` the rows were made from (the trainer
    reads per-token clip bounds there); ``trees`` must not be empty."""
    estimator, p = resolve_method(method, params)
    batch = TreeBatch.from_trees(list(trees))
    try:
        structure = batch.validate()
    except ValueError as exc:
        raise CreditError(str(exc)) from exc
    nodes = batch.nodes
    for name, values in (("depth", structure.depth), ("preorder", structure.preorder),
                         ("subtree_size", structure.subtree_size)):
        nodes = nodes.append_column(name, pa.array(values, pa.int32()))
    return _credit_batch(batch.trees, nodes, estimator, p,
                         run_id or f"credit-{method}-{p.params_hash()}", scores)


def compute_credits(store: Store, method: str,
                    params: Mapping[str, str] | Params | None = None,
                    run_id: str | None = None, max_nodes: int = 200_000,
                    progress: bool = True) -> CreditRunReport:
    """Compute and commit ``method`` credit for every stored tree (or group) that lacks it.

    See the module docstring: prompt-group methods credit whole groups and
    refuse groups that grew after they were credited (``CreditError``). A scored method
    reads the stored ``policy_scores`` of the policy version its params name (the scoring
    job, ``train.scoring.score_for_credit``, writes them and puts the version there).
    """
    estimator, p = resolve_method(method, params)
    source = _score_source(method, p)
    token_kinds = token_score_kinds(method, p)
    params_hash = p.params_hash()
    run_id = run_id or f"credit-{method}-{params_hash}"
    report = CreditRunReport(method, params_hash)
    con = connect(store)
    total = con.sql("SELECT count(*) FROM trees").fetchall()[0][0]
    done_before = con.execute(
        "SELECT count(DISTINCT tree_id) FROM credits WHERE method = $m AND "
        "method_params_hash = $h", {"m": method, "h": params_hash}).fetchall()[0][0]
    report.trees_skipped = int(done_before)
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"credit {method}", total=max(total - done_before, 0))
        for trees, nodes in _batches(store, method, params_hash, p.spans_trees(), max_nodes):
            ids = trees.column("tree_id").to_pylist()
            scores = None if source is None else stored_scores(store, ids, *source)
            if token_kinds:
                scores = pa.concat_tables([stored_scores(store, ids, kind, p.teacher)
                                           for kind in dict.fromkeys(token_kinds.values())])
            rows = _credit_tables(trees, nodes, estimator, p, run_id, scores)
            digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]
            store.append_credits(rows, key=f"credit:{method}:{params_hash}:{digest}")
            report.trees_done += len(ids)
            report.rows += rows.num_rows
            report.commits += 1
            bar.advance(task, len(ids))
    return report
