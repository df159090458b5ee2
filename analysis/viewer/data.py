"""What the viewer shows, as JSON-ready dicts: one pinned, read-only view of a store.

``ViewerData(store)`` opens the store's DuckDB views on the locked-down connection
``rollout_store.reader.connect(..., restricted=True)`` builds (the one ``rtrees sql``
uses: no host file can be read or written), pinned to one store version, and answers
the page's questions:

* ``runs()``: every run with its trees, samplers and metric names;
* ``trees(where)``: the trees whose row satisfies a user's SQL ``WHERE`` expression over
  ``trees`` plus four derived columns (``reward``: the mean leaf reward, ``max_reward``,
  ``leaves``, ``labels``: the tree's current labels as ``key=value`` words); the text goes
  through ``checked_where`` first;
* ``tree(tree_id)``: one tree for the drawing and the node panel: nodes with their
  layout (``analysis.tree_plot.tree_layout``: depth down, leaves in preorder), action and
  observation text, tokens (decoded with the tree's ``policy_ref`` tokenizer where that is
  a checkpoint directory holding ``tokenizer.json``) with logprobs and entropies, credit
  under every stored method (values and per-token values), Mean@k references, snapshot
  summaries, BEL's critical step, CALIPER's local groups, refresh lineage and the current
  labels of the tree and its nodes (``labels_latest``, with the number of label rows in
  the history);
* ``compare(tree_id, a, b)``: where two credit methods disagree on one tree, by sign and
  by rank among siblings;
* ``metrics(run_id)``: a run's metrics as ``{name: [[step, value], ...]}``.
* ``sibling_diff(tree_id, node_id)``: a branching node's children side by side
  (``analysis.compare.sibling_diff``, issue 48), with credit and Mean@k;
* ``heldout(run_id)``: held-out success per evaluation with Wilson intervals.

``ViewerStores`` opens several stores at once (each a ``ViewerData`` by name) and answers
the questions that span them: trajectories compared by step (``compare``) and two runs'
metrics overlaid (``metrics_diff``).

Credit methods are keyed ``method`` when a tree holds one hyperparameter hash of it, else
``method@<hash prefix>``.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.tree_plot import tree_layout
from rollout_store.attempts import TRAINING_METRICS, training_metrics
from rollout_store.reader import as_store, connect, read_trees, run_query
from rollout_store.store import Store

if TYPE_CHECKING:
    import duckdb

    from rollout_store.tree import Tree

# The relation a tree filter runs over: the trees view plus derived reward columns.
TREE_ROWS_VIEW = "viewer_tree_rows"
_TREE_ROWS_SQL = f"""
    CREATE OR REPLACE TEMP VIEW {TREE_ROWS_VIEW} AS
    SELECT t.*, r.reward, r.max_reward, coalesce(r.leaves, 0) AS leaves,
           coalesce(l.labels, '') AS labels
    FROM trees t LEFT JOIN (
        SELECT tree_id, avg(reward) AS reward, max(reward) AS max_reward, count(*) AS leaves
        FROM paths GROUP BY tree_id) r USING (tree_id)
    LEFT JOIN (
        SELECT tree_id, string_agg(key || '=' || value, ' ' ORDER BY key) AS labels
        FROM labels_latest WHERE node_id IS NULL GROUP BY tree_id) l USING (tree_id)"""
TREE_LIST_COLUMNS = ("tree_id", "run_id", "task_id", "env", "sampler", "policy_version",
                     "n_nodes", "leaves", "reward", "critical_node_id", "labels", "created_at")
MAX_TREES = 2000  # rows a tree list returns at most (the page says when it was cut)
SNAPSHOT_PREVIEW = 400  # characters of a snapshot state shown in the panel


class FilterError(ValueError):
    """A tree filter that is not a single boolean expression over ``trees``."""


def checked_where(con: duckdb.DuckDBPyConnection, text: str) -> str:
    """``text`` if it is one boolean expression usable as ``WHERE (text)`` over the tree
    rows, else ``FilterError`` naming what is wrong.

    The check is the store's one filter checker (``rollout_store.sqlguard.checked_filter``,
    the one ``--reuse-from`` uses): DuckDB's parser, one expression, only columns of the
    tree rows (``trees`` plus ``reward``, ``max_reward``, ``leaves``, ``labels``), pure
    scalar functions, no subquery, table function or file. It is then run once with
    ``LIMIT 0`` on the locked-down connection, so a type error is reported here.
    """
    from rollout_store.schema import SCHEMAS
    from rollout_store.sqlguard import UnsafeSQLError, checked_filter

    columns = [*SCHEMAS["trees"].names, "reward", "max_reward", "leaves", "labels"]
    try:
        checked = checked_filter(text, columns, what="tree filter")
    except UnsafeSQLError as exc:
        raise FilterError(str(exc)) from None
    try:
        run_query(con, f"SELECT 1 FROM {TREE_ROWS_VIEW} WHERE {checked} LIMIT 0")
    except Exception as exc:  # duckdb.Error: a bad column, a type error
        raise FilterError(f"bad filter: {str(exc).splitlines()[0]}") from None
    return checked


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities as None, datetimes as ISO text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def _loads(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@lru_cache(maxsize=8)
def _tokenizer(ref: str) -> Any:
    """The ``tokenizers.Tokenizer`` of a checkpoint directory, or None (no code runs: a
    ``tokenizer.json`` is data)."""
    path = Path(ref) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    except Exception:  # an unreadable tokenizer: show token ids instead
        return None


def token_texts(policy_ref: str | None, ids: Sequence[int]) -> list[str] | None:
    """Each token id decoded alone with ``policy_ref``'s tokenizer, or None without one."""
    tok = _tokenizer(policy_ref) if policy_ref else None
    if tok is None:
        return None
    return [tok.decode([int(i)], skip_special_tokens=False) for i in ids]


def _decoder(policy_ref: str | None) -> Callable[[Sequence[int]], list[str] | None] | None:
    """``token_texts`` bound to a tree's tokenizer, or None where it has none."""
    if not policy_ref or _tokenizer(policy_ref) is None:
        return None
    return lambda ids: token_texts(policy_ref, ids)


def snapshot_summary(snapshot_id: str, env: str, state: bytes) -> dict[str, Any]:
    """Size, sha256 and the first ``SNAPSHOT_PREVIEW`` characters of a state (as UTF-8
    with replacement; JSON states are pretty-printed)."""
    from rollout_store.snapshots import state_hash

    text = state.decode("utf-8", errors="replace")
    with contextlib.suppress(json.JSONDecodeError, RecursionError):
        text = json.dumps(json.loads(text), indent=1, sort_keys=True)
    return {"snapshot_id": snapshot_id, "env": env, "bytes": len(state),
            "sha256": state_hash(state), "preview": text[:SNAPSHOT_PREVIEW],
            "truncated": len(text) > SNAPSHOT_PREVIEW}


def caliper_groups(tree: Tree) -> list[dict[str, Any]]:
    """CALIPER's local groups (METHODS.md section 3): per branching node with ``local``
    resamples, its members (the resamples and the original step y_0, marked
    ``meta["caliper_y0"]``)."""
    members: dict[int, list[int]] = defaultdict(list)
    y0: dict[int, int] = {}
    for n in tree.nodes:
        meta = n.meta or {}
        if n.parent_id is None:
            continue
        if n.phase == "local" or meta.get("caliper_y0"):
            members[n.parent_id].append(n.node_id)
            if meta.get("caliper_y0"):
                y0[n.parent_id] = n.node_id
    return [{"branch": p, "members": sorted(m), "y0": y0.get(p),
             "bucket": next(((tree.node(i).meta or {}).get("caliper_bucket") for i in m
                             if (tree.node(i).meta or {}).get("caliper_bucket")), None)}
            for p, m in sorted(members.items()) if len(m) >= 2 or p in y0]


def sibling_ranks(parents: Mapping[int, int | None], values: Mapping[int, float]
                  ) -> dict[int, int]:
    """Rank (1 = highest value) of each node among its siblings that have a value, for
    parents with two or more valued children; ties share the lower rank."""
    groups: dict[int, list[int]] = defaultdict(list)
    for nid, parent in parents.items():
        if parent is not None and nid in values:
            groups[parent].append(nid)
    ranks: dict[int, int] = {}
    for kids in groups.values():
        if len(kids) < 2:
            continue
        for nid in kids:
            ranks[nid] = 1 + sum(values[o] > values[nid] for o in kids)
    return ranks


def compare_credit(parents: Mapping[int, int | None], a: Mapping[int, float],
                   b: Mapping[int, float], eps: float = 1e-9) -> list[dict[str, Any]]:
    """Per node valued by both methods: both values, whether their signs disagree (both
    beyond ``eps`` in size and of opposite sign, or one zero and one not) and each
    method's rank among the node's siblings (``sibling_ranks``; None outside a branching
    node); ``rank_differs`` where those ranks differ."""
    ra, rb = sibling_ranks(parents, a), sibling_ranks(parents, b)

    def sign(v: float) -> int:
        return 0 if abs(v) <= eps else (1 if v > 0 else -1)

    out = []
    for nid in sorted(set(a) & set(b)):
        out.append({"node_id": nid, "a": a[nid], "b": b[nid],
                    "sign_differs": sign(a[nid]) != sign(b[nid]),
                    "rank_a": ra.get(nid), "rank_b": rb.get(nid),
                    "rank_differs": ra.get(nid) != rb.get(nid)})
    return out


class ViewerData:
    """A read-only, pinned view of one store for the viewer (see the module docstring).

    Thread-safe: one lock serialises the DuckDB connection."""

    def __init__(self, store: Store | str | Path) -> None:
        self.store = as_store(store)
        self._lock = threading.Lock()
        self.reload()

    def reload(self) -> None:
        """Pin the store's latest version (after a label is written, say)."""
        with self._lock:
            self.version = self.store.version()
            self.con = connect(self.store, self.version, restricted=True)
            self.con.execute(_TREE_ROWS_SQL)

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """The rows of one query, run within ``QueryLimits()`` (time, and the process's
        memory growth: a filter the checker passed still cannot take the server down;
        ``QueryLimitError``, a ``StoreError``, past a limit)."""
        from rollout_store.sqlguard import run_limited

        def run() -> tuple[list[str], list[tuple[Any, ...]]]:
            cur = self.con.execute(sql, list(params))
            return [d[0] for d in cur.description or []], cur.fetchall()

        with self._lock:
            names, rows = run_limited(self.con, run)
        return [{k: _clean(v) for k, v in zip(names, r, strict=True)} for r in rows]

    def summary(self) -> dict[str, Any]:
        """The store's path, pinned version and table row counts."""
        (n_trees,), = [tuple(r.values()) for r in self._rows("SELECT count(*) FROM trees")]
        return {"store": str(self.store.path), "version": dict(self.version),
                "trees": n_trees}

    def runs(self) -> list[dict[str, Any]]:
        """One row per run id found in ``trees``, ``credits`` or the training metrics
        (``TRAINING_METRICS``: no bookkeeping rows, the latest write per step)."""
        return self._rows(f"""
            WITH ids AS (SELECT run_id FROM trees UNION SELECT run_id FROM {TRAINING_METRICS}
                         UNION SELECT run_id FROM credits)
            SELECT i.run_id,
                   (SELECT count(*) FROM trees t WHERE t.run_id = i.run_id) AS trees,
                   (SELECT string_agg(DISTINCT sampler, ',' ORDER BY sampler) FROM trees t
                    WHERE t.run_id = i.run_id) AS samplers,
                   (SELECT count(DISTINCT name) FROM {TRAINING_METRICS} m
                    WHERE m.run_id = i.run_id)
                       AS metrics
            FROM ids i ORDER BY i.run_id""")

    def trees(self, where: str | None = None, run_id: str | None = None,
              limit: int = MAX_TREES) -> dict[str, Any]:
        """Tree rows (``TREE_LIST_COLUMNS``) matching ``where`` (checked) and ``run_id``;
        ``FilterError`` also when a checked filter fails on the rows (a bad regex)."""
        clauses, params = [], []
        if where and where.strip():
            with self._lock:
                clauses.append(f"({checked_where(self.con, where)})")
        if run_id:
            clauses.append("run_id = ?")
            params.append(run_id)
        cond = " AND ".join(clauses) or "true"
        sql = (f"SELECT {', '.join(TREE_LIST_COLUMNS)} FROM {TREE_ROWS_VIEW} "
               f"WHERE {cond} ORDER BY run_id, tree_id LIMIT {int(limit) + 1}")
        import duckdb

        try:
            rows = self._rows(sql, params)
        except duckdb.Error as exc:  # a checked filter failing on the rows: bad regex, cast
            if not (where and where.strip()):
                raise
            raise FilterError(f"filter failed: {str(exc).strip().splitlines()[0]}") from None
        return {"trees": rows[:limit], "truncated": len(rows) > limit}

    def _credits(self, tree_id: str) -> dict[str, dict[int, dict[str, Any]]]:
        rows = self._rows("""
            SELECT method, method_params_hash AS h, node_id, value, token_values, created_at
            FROM credits WHERE tree_id = ? ORDER BY created_at""", [tree_id])
        hashes: dict[str, set[str]] = defaultdict(set)
        for r in rows:
            hashes[r["method"]].add(r["h"])
        out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        for r in rows:  # later rows (newer created_at) win
            key = r["method"] if len(hashes[r["method"]]) == 1 else f"{r['method']}@{r['h'][:8]}"
            out[key][int(r["node_id"])] = {
                "value": _clean(r["value"]),
                "tokens": None if r["token_values"] is None
                else [_clean(float(v)) if v is not None else None for v in r["token_values"]]}
        return dict(sorted(out.items()))

    def _mean_at_k(self, tree_id: str) -> dict[int, list[dict[str, Any]]]:
        """The tree's Mean@k references by node: ``{k, successes, mean, policy_version,
        run_id}``, oldest first."""
        mc: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in self._rows("""SELECT node_id, k, successes, policy_version, run_id
                               FROM mc_references WHERE tree_id = ? ORDER BY created_at""",
                            [tree_id]):
            r["mean"] = r["successes"] / r["k"] if r["k"] else None
            mc[int(r.pop("node_id"))].append(r)
        return dict(mc)

    def _one_tree(self, tree_id: str) -> Tree:
        found = read_trees(self.store, [tree_id], self.version)
        if not found:
            raise KeyError(f"no tree {tree_id!r} in {self.store.path}")
        return found[0]

    def _credit_values(self, tree_id: str) -> dict[str, dict[int, float | None]]:
        return {m: {nid: v["value"] for nid, v in by_node.items()}
                for m, by_node in self._credits(tree_id).items()}

    def sibling_diff(self, tree_id: str, node_id: int, ref: int | None = None
                     ) -> dict[str, Any]:
        """``analysis.compare.sibling_diff`` of one stored node: its children side by side
        with their credit under every stored method and Mean@k references, tokens decoded
        with the tree's tokenizer where there is one. ``KeyError``: an unknown tree or
        node; ``ValueError``: a node that does not branch, a ``ref`` not its child."""
        from analysis.compare import sibling_diff

        tree = self._one_tree(tree_id)
        out = sibling_diff(tree, node_id, self._credit_values(tree_id),
                           self._mean_at_k(tree_id), _decoder(tree.policy_ref), ref)
        out["store"] = str(self.store.path)
        return out

    def trajectory_item(self, tree_id: str, leaf: int | None, label: str) -> dict[str, Any]:
        """One column's input to ``analysis.compare.compare_trajectories``."""
        return {"label": label, "tree": self._one_tree(tree_id), "leaf": leaf,
                "credits": self._credit_values(tree_id)}

    def heldout(self, run_id: str) -> list[dict[str, Any]]:
        """Held-out success of a run per evaluation (``evaluations``: one row per task;
        the latest write per (step, mode, task)): ``{step, mode, n, successes, rate, low,
        high}`` with the 95% Wilson interval (``analysis.compare.wilson_interval``). The
        step is the metric step (``evaluations.step + 1``: the iteration that produced the
        weights, 0 for the starting ones), as the ``heldout_*`` metrics plot it."""
        from analysis.compare import wilson_interval

        rows = self._rows("""
            SELECT step + 1 AS step, mode, count(*) AS n,
                   sum(success::INTEGER) AS successes FROM (
                SELECT *, row_number() OVER (PARTITION BY step, mode, task_index
                                             ORDER BY created_at DESC) AS _r
                FROM evaluations WHERE run_id = ?) WHERE _r = 1
            GROUP BY ALL ORDER BY mode, step""", [run_id])
        for r in rows:
            r["successes"] = int(r["successes"] or 0)
            r["rate"] = r["successes"] / r["n"]
            r["low"], r["high"] = wilson_interval(r["successes"], int(r["n"]))
        return rows

    def tree(self, tree_id: str) -> dict[str, Any]:
        """Everything the tree page shows (see the module docstring); ``KeyError`` for an
        unknown tree id."""
        tree = self._one_tree(tree_id)
        pos = tree_layout(tree)
        credits = self._credits(tree_id)
        mc = self._mean_at_k(tree_id)
        nodes = []
        for n in tree.preorder():
            texts = token_texts(tree.policy_ref, n.action_token_ids)
            nodes.append({
                "id": n.node_id, "parent": n.parent_id, "kind": n.kind, "phase": n.phase,
                "x": pos[n.node_id][0], "depth": int(-pos[n.node_id][1]),
                "terminal": n.terminal, "reward": _clean(n.reward),
                "reward_parts": {k: _clean(v) for k, v in n.reward_parts.items()},
                "action_text": n.action_text, "observation_text": n.observation_text,
                "tokens": {"ids": list(n.action_token_ids), "text": texts,
                           "logprob": [_clean(float(v)) for v in n.action_logprobs],
                           "entropy": [_clean(float(v)) for v in n.action_entropies]},
                "segments": [{"kind": s.kind, "start": s.start, "end": s.end}
                             for s in n.segments],
                "snapshot_id": n.snapshot_id, "n_gen_tokens": n.n_gen_tokens,
                "tool_calls": n.tool_calls, "meta": n.meta,
                "credit": {m: v[n.node_id] for m, v in credits.items() if n.node_id in v},
                "mc": mc.get(n.node_id, []),
            })
        snapshots = {sid: snapshot_summary(sid, tree.env, state)
                     for sid, state in tree.snapshots.items()}
        meta = tree.meta or {}
        labels = self.labels(tree_id)
        refreshed_by = [r["tree_id"] for r in self._rows(
            "SELECT tree_id FROM trees WHERE json_extract_string(meta, '$.refresh_of') = ? "
            "ORDER BY tree_id", [tree_id])]
        return {
            "tree": {"tree_id": tree.tree_id, "run_id": tree.run_id, "task_id": tree.task_id,
                     "env": tree.env, "sampler": tree.sampler,
                     "policy_version": tree.policy_version, "policy_ref": tree.policy_ref,
                     "budget": tree.budget, "seed": tree.seed,
                     "rollouts_by_phase": tree.rollouts_by_phase,
                     "critical_node_id": tree.critical_node_id,
                     "created_at": _clean(tree.created_at), "meta": tree.meta},
            "nodes": nodes,
            "methods": list(credits),
            "snapshots": snapshots,
            "groups": caliper_groups(tree),
            "labels": labels,
            "lineage": {"refresh_of": meta.get("refresh_of"),
                        "refresh_of_version": meta.get("refresh_of_version"),
                        "refreshed_nodes": meta.get("refreshed_nodes", []),
                        "lineage": meta.get("lineage", {}),
                        "copied": {n.node_id: (n.meta or {}).get("copy_of")
                                   for n in tree.nodes if (n.meta or {}).get("copy_of")
                                   is not None},
                        "refreshed_by": refreshed_by},
        }

    def labels(self, tree_id: str) -> dict[str, Any]:
        """The tree's current labels: ``tree`` (of the whole tree) and ``nodes`` ({node id:
        [...]}), each ``{key, value, author, created_at}``; ``history``: all label rows."""
        out: dict[str, Any] = {"tree": [], "nodes": defaultdict(list)}
        for r in self._rows("SELECT node_id, key, value, author, created_at FROM "
                            "labels_latest WHERE tree_id = ? ORDER BY key", [tree_id]):
            nid = r.pop("node_id")
            (out["tree"] if nid is None else out["nodes"][int(nid)]).append(r)
        out["nodes"] = dict(out["nodes"])
        (out["history"],), = [tuple(r.values()) for r in self._rows(
            "SELECT count(*) FROM labels WHERE tree_id = ?", [tree_id])]
        return out

    def compare(self, tree_id: str, a: str, b: str,
                tree: dict[str, Any] | None = None) -> dict[str, Any]:
        """``compare_credit`` of methods ``a`` and ``b`` (keys of ``tree()['methods']``);
        ``tree`` is ``self.tree(tree_id)`` when the caller has it already."""
        data = self.tree(tree_id) if tree is None else tree
        credits = {m: {n["id"]: n["credit"][m]["value"] for n in data["nodes"]
                       if m in n["credit"] and n["credit"][m]["value"] is not None}
                   for m in (a, b)}
        for m in (a, b):
            if m not in data["methods"]:
                raise KeyError(f"tree {tree_id!r} has no credit of method {m!r} "
                               f"(it has {', '.join(data['methods']) or 'none'})")
        parents = {n["id"]: n["parent"] for n in data["nodes"]}
        rows = compare_credit(parents, credits[a], credits[b])
        return {"a": a, "b": b, "rows": rows,
                "sign_disagreements": sum(r["sign_differs"] for r in rows),
                "rank_disagreements": sum(r["rank_differs"] for r in rows)}

    def metrics(self, run_id: str) -> dict[str, list[list[float]]]:
        """``{name: [[step, value], ...]}`` of one run, steps ascending
        (``rollout_store.attempts.training_metrics``)."""
        with self._lock:
            found = training_metrics(self.con, run_id)
        return {name: [[step, value] for step, value in rows] for name, rows in found.items()}


def store_label(store: Store | str | Path) -> str:
    """The name a store goes by among several: its path as given."""
    return str(store.path) if isinstance(store, Store) else str(store)


class ViewerStores:
    """Several stores opened at once (issue 48): one ``ViewerData`` per store, by name
    (``store_label``: the path as given), the first the default. Each stays pinned and
    read-only on its own locked connection."""

    def __init__(self, stores: Mapping[str, ViewerData | Store | str | Path]
                 | Sequence[Store | str | Path]) -> None:
        named = dict(stores) if isinstance(stores, Mapping) else {
            store_label(s): s for s in stores}
        if not named:
            raise ValueError("no store given")
        self.by_name = {name: s if isinstance(s, ViewerData) else ViewerData(s)
                        for name, s in named.items()}
        self.first = next(iter(self.by_name.values()))

    @classmethod
    def of(cls, data: ViewerData | ViewerStores | Store | str | Path) -> ViewerStores:
        """``data`` as stores: itself, or the one store it is or reads."""
        if isinstance(data, ViewerStores):
            return data
        if isinstance(data, ViewerData):
            return cls({str(data.store.path): data})
        return cls([data])

    def get(self, name: str | None) -> ViewerData:
        """The store called ``name`` (None or "": the first); ``KeyError`` names the
        stores there are."""
        if not name:
            return self.first
        if name not in self.by_name:
            raise KeyError(f"no store {name!r} open here (open: {', '.join(self.by_name)})")
        return self.by_name[name]

    def summary(self) -> list[dict[str, Any]]:
        """Each store's name and ``ViewerData.summary()``."""
        return [dict(d.summary(), name=name) for name, d in self.by_name.items()]

    def compare(self, specs: Sequence[tuple[str | None, str, int | None]]) -> dict[str, Any]:
        """``analysis.compare.compare_trajectories`` of ``(store, tree_id, leaf)`` triples
        (store None: the first; leaf None: the tree's best leaf), in columns labelled
        ``store:tree:leaf`` (``tree:leaf`` with one store open)."""
        from analysis.compare import compare_trajectories

        items = []
        for store, tree_id, leaf in specs:
            data = self.get(store)
            name = next(n for n, d in self.by_name.items() if d is data)
            label = f"{tree_id}:{'best' if leaf is None else leaf}"
            if len(self.by_name) > 1:
                label = f"{name}:{label}"
            item = data.trajectory_item(tree_id, leaf, label)
            item["store"] = name
            items.append(item)
        out = compare_trajectories(items, lambda t: _decoder(t.policy_ref))
        for col, item in zip(out["columns"], items, strict=True):
            col["store"] = item["store"]
        return out

    def metrics_diff(self, a: tuple[str | None, str], b: tuple[str | None, str]
                     ) -> dict[str, Any]:
        """Two runs' metrics (``(store, run_id)`` each) overlaid
        (``analysis.compare.metrics_diff``), with each run's held-out success and its
        intervals (``ViewerData.heldout``). ``KeyError`` for a run with neither metrics
        nor evaluations."""
        from analysis.compare import metrics_diff

        found = []
        for store, run in (a, b):
            data = self.get(store)
            m, h = data.metrics(run), data.heldout(run)
            if not m and not h:
                raise KeyError(f"run {run!r} has no metrics and no held-out evaluations in "
                               f"{data.store.path}")
            found.append((m, h))
        return {"a": {"store": a[0] or "", "run": a[1]}, "b": {"store": b[0] or "", "run": b[1]},
                "metrics": metrics_diff(found[0][0], found[1][0]),
                "heldout": {"a": found[0][1], "b": found[1][1]}}
